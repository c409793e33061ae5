//! `cryptblk reencrypt IMAGE`: cryptsetup's offline `reencrypt` for LUKS2 image files and RBD
//! images. The work is in `cryptblk_luks::luks2::reencrypt`; here are the options, the
//! passphrase, the lock on the image, progress and signals.
use super::reencrypt_run::run_to_end;
use crate::args::{Cli, ReencryptArgs, ResilienceMode};
use crate::convert::interrupt::InterruptFlag;
use crate::exit::UsageError;
use crate::options::{crypto_pool, layout_error, new_layout, pbkdf_options, unlock_options};
use crate::secrets::read_passphrase;
use anyhow::{bail, Context, Result};
use cryptblk_luks::luks2::reencrypt::{InitParams, Reencryption, ResilienceChoice};
use cryptblk_luks::{HashAlg, HeaderIo, LuksError, LuksImage, LuksVersion};
use zeroize::Zeroizing;

fn unsupported(what: &'static str, name: &str, hint: &str) -> anyhow::Error {
    LuksError::Unsupported {
        what,
        name: name.into(),
        hint: hint.into(),
    }
    .into()
}

pub fn run(cli: &Cli, a: &ReencryptArgs) -> Result<()> {
    if a.reduce_device_size.is_some() && !a.encrypt {
        return Err(unsupported("reencryption layout", "data shift", "--reduce-device-size is for --encrypt; cryptblk does not move the data of a LUKS2 image"));
    }
    if a.decrypt || a.header.is_some() {
        return super::reencrypt_decrypt::run(cli, a);
    }
    let resilience = match a.resilience {
        ResilienceMode::Checksum => ResilienceChoice::Checksum(HashAlg::parse(&a.resilience_hash)?),
        ResilienceMode::None => ResilienceChoice::None,
        ResilienceMode::Journal => ResilienceChoice::Journal,
        ResilienceMode::Datashift => {
            return Err(unsupported(
                "resilience",
                "datashift",
                "cryptblk implements checksum (default), journal and none",
            ))
        }
    };
    // Registered first, so a signal during the (possibly long) KDF or the init commit stops
    // the run cleanly instead of killing it.
    let interrupt = InterruptFlag::register()?;
    let file: Box<dyn HeaderIo + Sync> = match crate::rbd::rbd_name(&a.image) {
        // Opened writable, an RBD image is under its exclusive lock: a daemon serving it
        // makes this an "in use" error.
        Some(name) => Box::new(crate::rbd::open(name, true)?),
        None => {
            let file = super::key::open_file_for_update(&a.image, "re-encrypting")?;
            // The hotzones bypass the page cache where the filesystem allows it.
            Box::new(cryptblk_luks::DirectFile::new(file, &a.image))
        }
    };
    let file = &*file;
    let path = a.image.display().to_string();
    let mut encrypt_passphrase = None;
    if a.encrypt {
        encrypt_passphrase = super::reencrypt_encrypt::init_unless_luks(cli, a, file, &path)?;
        if a.init_only && encrypt_passphrase.is_some() {
            return Ok(());
        }
    }
    let (image, warnings) =
        LuksImage::read(file).with_context(|| format!("reading the LUKS header of {path}"))?;
    for w in &warnings {
        eprintln!("cryptblk: warning: {path}: {w}");
    }
    let unlock = unlock_options(cli);
    let (mut hdr, passphrase) = match image {
        LuksImage::V2(h) => (h, None),
        LuksImage::V1(v1) => {
            let (h, passphrase) = convert_luks1_first(a, file, &v1, &path, &unlock)?;
            (h, Some(passphrase))
        }
    };
    let in_progress = hdr
        .reencrypt_state()
        .with_context(|| path.clone())?
        .is_some();
    let passphrase = match passphrase.or(encrypt_passphrase.take()) {
        Some(p) => p,
        None => read_passphrase(a.key_file.as_deref(), "Enter passphrase: ")?,
    };
    if in_progress {
        if a.init_only {
            bail!(UsageError(format!(
                "{path}: a reencryption is already in progress; continue it with --resume-only"
            )));
        }
        if !a.encrypt && (a.cipher.is_some() || a.key_size.is_some() || a.sector_size.is_some()) {
            eprintln!("cryptblk: {path}: continuing the reencryption in progress; --cipher, --key-size and --sector-size are ignored");
        }
    } else {
        if a.resume_only {
            bail!(UsageError(format!(
                "{path}: no reencryption is in progress (nothing to resume)"
            )));
        }
        let params = init_params(a, &hdr, resilience)?;
        hdr.reencrypt_init(file, &passphrase, &unlock, &params)
            .with_context(|| format!("starting the reencryption of {path}"))?;
        if a.init_only {
            return Ok(());
        }
    }
    let r = Reencryption::open(
        file,
        hdr,
        &passphrase,
        &unlock,
        a.key_slot,
        crypto_pool(cli)?,
    )
    .with_context(|| format!("opening the reencryption of {path}"))?;
    drop(passphrase);
    run_to_end(a, file, r, &path, &interrupt, "")
}

/// A LUKS1 image becomes LUKS2 first (as `cryptblk convert-header` does it), once the
/// passphrase is known to open it, so a wrong passphrase or a refused option leaves it
/// untouched.
fn convert_luks1_first(
    a: &ReencryptArgs,
    file: &dyn cryptblk_luks::HeaderIo,
    v1: &cryptblk_luks::luks1::Luks1Header,
    path: &str,
    unlock: &cryptblk_luks::UnlockOptions,
) -> Result<(cryptblk_luks::luks2::Luks2Header, Zeroizing<Vec<u8>>)> {
    if a.resume_only {
        bail!(UsageError(format!(
            "{path}: a LUKS1 image has no reencryption in progress (nothing to resume)"
        )));
    }
    let passphrase = read_passphrase(a.key_file.as_deref(), "Enter passphrase: ")?;
    let (hdr, how) = cryptblk_volume::convert_luks1_first(file, v1, &passphrase, unlock, path)?;
    eprintln!(
        "cryptblk: note: {path}: converted the LUKS1 header to LUKS2 first ({})",
        super::convert_header::describe(how)
    );
    Ok((hdr, passphrase))
}

fn init_params(
    a: &ReencryptArgs,
    hdr: &cryptblk_luks::luks2::Luks2Header,
    resilience: ResilienceChoice,
) -> Result<InitParams> {
    let layout = new_layout(a).for_reencryption(hdr).map_err(layout_error)?;
    let hash = HashAlg::parse(&a.hash)?;
    let pbkdf = pbkdf_options(&a.pbkdf, hash, LuksVersion::V2)?;
    Ok(layout.init_params(resilience, pbkdf, a.key_slot))
}
