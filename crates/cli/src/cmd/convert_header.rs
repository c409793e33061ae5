//! `cryptblk convert-header --type luks2 IMAGE`: cryptsetup's `convert`, named apart from our
//! `convert` (which copies an image between raw, qcow2 and LUKS). The work is in
//! `cryptblk_luks::luks2::from_luks1`; `reencrypt` calls it too for a LUKS1 image.
use crate::args::{ConvertHeaderArgs, HeaderType};
use crate::exit::UsageError;
use anyhow::{Context, Result};
use cryptblk_luks::luks1::Luks1Header;
use cryptblk_luks::luks2::from_luks1::{convert_luks1, KeyslotPlacement};
use cryptblk_luks::luks2::Luks2Header;
use cryptblk_luks::LuksImage;

pub fn run(a: &ConvertHeaderArgs) -> Result<()> {
    let HeaderType::Luks2 = a.to;
    let file = super::key::open_file_for_update(&a.image, "converting its header")?;
    let path = a.image.display().to_string();
    let (image, warnings) =
        LuksImage::read(&file).with_context(|| format!("reading the LUKS header of {path}"))?;
    for w in &warnings {
        eprintln!("cryptblk: warning: {path}: {w}");
    }
    let v1 = match image {
        LuksImage::V1(h) => h,
        LuksImage::V2(_) => {
            return Err(UsageError(format!(
                "{path} is already LUKS2 (converting LUKS2 back to LUKS1 is not implemented)"
            ))
            .into())
        }
    };
    let (_, how) = convert(&file, &v1, &path)?;
    println!("Converted {path} to LUKS2 ({})", describe(how));
    Ok(())
}

/// Convert `v1` in place; every refusal comes before the first write.
pub(crate) fn convert(
    file: &dyn cryptblk_luks::HeaderIo,
    v1: &Luks1Header,
    path: &str,
) -> Result<(Luks2Header, KeyslotPlacement)> {
    convert_luks1(file, v1)
        .with_context(|| format!("converting the LUKS1 header of {path} to LUKS2"))
}

pub(crate) fn describe(how: KeyslotPlacement) -> &'static str {
    match how {
        KeyslotPlacement::Shifted => {
            "keyslot material moved up 28 KiB, as `cryptsetup convert --type luks2` moves it"
        }
        KeyslotPlacement::Compacted => {
            "active keyslots copied to free space before the payload, which starts right after the LUKS1 keyslots as in QEMU-made images"
        }
    }
}
