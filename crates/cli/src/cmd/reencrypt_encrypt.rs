//! `cryptblk reencrypt --encrypt`: the start of an in-place encryption of a plaintext image
//! (cryptsetup's `--encrypt --reduce-device-size`). Once the header is written the run goes
//! on like any other reencryption (`reencrypt.rs`), and `--resume-only` continues it.
use crate::args::{Cli, ReencryptArgs};
use crate::exit::UsageError;
use crate::options::{layout_error, new_layout, pbkdf_options};
use crate::secrets::read_passphrase;
use anyhow::{bail, Context, Result};
use cryptblk_luks::luks2::reencrypt::encrypt_init;
use cryptblk_luks::{HashAlg, LuksImage, LuksVersion};
use zeroize::Zeroizing;

/// Write the LUKS2 header of a new encryption unless the image already has one. Returns the
/// passphrase when it did (so a passphrase on stdin is read once), `None` when the image is
/// already LUKS2 in reencryption (the caller continues it).
pub fn init_unless_luks(
    _cli: &Cli,
    a: &ReencryptArgs,
    file: &dyn cryptblk_luks::HeaderIo,
    path: &str,
) -> Result<Option<Zeroizing<Vec<u8>>>> {
    if LuksImage::probe(file).with_context(|| format!("reading {path}"))? {
        let (image, _) =
            LuksImage::read(file).with_context(|| format!("reading the LUKS header of {path}"))?;
        let in_reencryption = match &image {
            LuksImage::V2(h) => h
                .reencrypt_state()
                .with_context(|| path.to_string())?
                .is_some(),
            LuksImage::V1(_) => false,
        };
        if !in_reencryption {
            bail!(UsageError(format!(
                "{path} already has a LUKS header; --encrypt is for a plaintext image (to replace the volume key, run `cryptblk reencrypt` without --encrypt)"
            )));
        }
        return Ok(None);
    }
    if a.resume_only {
        bail!(UsageError(format!(
            "{path} has no LUKS header, so no encryption is in progress (nothing to resume)"
        )));
    }
    let Some(reduce) = a.reduce_device_size else {
        bail!(UsageError(format!(
            "{path}: --encrypt needs --reduce-device-size (room for the LUKS2 header: half of it holds the header, the last SIZE bytes of the image are given up; cryptsetup recommends 32M)"
        )));
    };
    let layout = new_layout(a).for_encryption().map_err(layout_error)?;
    let hash = HashAlg::parse(&a.hash)?;
    let pbkdf = pbkdf_options(&a.pbkdf, hash, LuksVersion::V2)?;
    let params = layout.encrypt_params(hash, pbkdf, reduce);
    let passphrase = read_passphrase(
        a.key_file.as_deref(),
        "Enter passphrase for the new keyslot: ",
    )?;
    encrypt_init(file, &passphrase, &params)
        .with_context(|| format!("starting the encryption of {path}"))?;
    Ok(Some(passphrase))
}
