//! `cryptblk reencrypt --decrypt --header FILE IMAGE`: decrypt a LUKS2 image in place as
//! cryptsetup 2.7 does (its header exported to FILE, the plaintext moved to offset 0; the
//! layout is in `cryptblk_luks::luks2::reencrypt`'s `decrypt.rs`), and `--resume-only
//! --header FILE IMAGE` to continue one either tool started.
//!
//! FILE decides which: a FILE that does not exist is created and a decryption starts; an
//! existing one must be the detached header of a decryption in progress (cryptsetup reads an
//! existing FILE, even an empty one, as a header and refuses it otherwise; so does this).
use super::reencrypt_run::run_to_end;
use crate::args::{Cli, ReencryptArgs, ResilienceMode};
use crate::convert::interrupt::InterruptFlag;
use crate::exit::UsageError;
use crate::options::{crypto_pool, pbkdf_options, unlock_options};
use crate::secrets::read_passphrase;
use anyhow::{bail, Context, Result};
use cryptblk_luks::luks2::reencrypt::{decrypt_init, DecryptParams, MovedResilience, Reencryption};
use cryptblk_luks::luks2::Luks2Header;
use cryptblk_luks::{HashAlg, HeaderIo, LuksError, LuksImage, LuksVersion};
use std::fs::File;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

pub fn run(cli: &Cli, a: &ReencryptArgs) -> Result<()> {
    let Some(header) = a.header.as_deref() else {
        bail!(UsageError(
            "--decrypt needs --header FILE: the LUKS2 header is exported to FILE (a new file) and the plaintext moves to offset 0 of the image, as cryptsetup 2.7 does; or make a plaintext copy with `cryptblk convert -O raw IMAGE COPY`".into()
        ));
    };
    if a.encrypt || a.reduce_device_size.is_some() {
        bail!(UsageError(
            "--header is for --decrypt; --encrypt keeps the header in the image".into()
        ));
    }
    if crate::rbd::rbd_name(&a.image).is_some() {
        return Err(LuksError::Unsupported {
            what: "reencryption mode",
            name: "decrypt".into(),
            hint: "an RBD image cannot be decrypted in place; make a plaintext copy with `cryptblk convert -O raw rbd:POOL/IMAGE COPY`".into(),
        }
        .into());
    }
    let interrupt = InterruptFlag::register()?;
    let image = super::key::open_file_for_update(&a.image, "decrypting")?;
    let image = cryptblk_luks::DirectFile::new(image, &a.image);
    let path = a.image.display().to_string();
    let hpath = header.display().to_string();
    let unlock = unlock_options(cli);

    let (header_file, hdr, passphrase) = if header.exists() {
        if a.init_only {
            bail!(UsageError(format!(
                "{hpath} exists: a decryption is already in progress or the file is something else; continue one with --resume-only, or name a new file"
            )));
        }
        let file = super::key::open_file_for_update(header, "decrypting")?;
        let hdr = read_header(&file, &hpath)?;
        let passphrase = read_passphrase(a.key_file.as_deref(), "Enter passphrase: ")?;
        (file, hdr, passphrase)
    } else {
        if a.resume_only || !a.decrypt {
            bail!(UsageError(format!(
                "{hpath} does not exist: no decryption to resume (`--decrypt --header {hpath}` starts one and exports the header there)"
            )));
        }
        let (file, hdr, passphrase) = init(a, &image, header, &path, &unlock)?;
        if a.init_only {
            return Ok(());
        }
        (file, hdr, passphrase)
    };
    let r = Reencryption::open_detached(
        &header_file,
        &image,
        hdr,
        &passphrase,
        &unlock,
        a.key_slot,
        crypto_pool(cli)?,
    )
    .with_context(|| format!("opening the decryption of {path} (header {hpath})"))?;
    drop(passphrase);
    run_to_end(
        a,
        &image,
        r,
        &path,
        &interrupt,
        &format!(" --header {hpath}"),
    )
}

/// The detached header of a decryption in progress, or why FILE is not one.
fn read_header(file: &File, hpath: &str) -> Result<Luks2Header> {
    let (hdr, warnings) = Luks2Header::read_detached(file).map_err(|e| match e {
        LuksError::NotLuks(why) => LuksError::NotLuks(format!(
            "{hpath} is not a valid LUKS2 header ({why}); --header names a new file to start a decryption, or the header of one in progress"
        )),
        other => other,
    })?;
    for w in &warnings {
        eprintln!("cryptblk: warning: {hpath}: {w}");
    }
    if hdr.reencrypt_state()?.is_none() {
        bail!(UsageError(format!(
            "{hpath} is a LUKS2 header with no reencryption in progress: nothing to resume (to start a decryption, name a new file)"
        )));
    }
    Ok(hdr)
}

/// Start the decryption: the passphrase must open the image before FILE is created; a failure
/// before the image is touched removes FILE again.
fn init(
    a: &ReencryptArgs,
    image: &(dyn HeaderIo + Sync),
    header: &Path,
    path: &str,
    unlock: &cryptblk_luks::UnlockOptions,
) -> Result<(File, Luks2Header, zeroize::Zeroizing<Vec<u8>>)> {
    match LuksImage::read(image).with_context(|| format!("reading the LUKS header of {path}"))? {
        (LuksImage::V2(_), _) => {}
        (LuksImage::V1(_), _) => {
            return Err(LuksError::Unsupported {
                what: "LUKS version",
                name: "1".into(),
                hint: "convert the header to LUKS2 first (`cryptblk convert-header`)".into(),
            }
            .into())
        }
    }
    // cryptsetup's meanings for a decryption: the moved segment is protected by checksums
    // (datashift-checksum) or a journal (datashift-journal); the rest by the data shift.
    let resilience = match a.resilience {
        ResilienceMode::Checksum => MovedResilience::Checksum(HashAlg::parse(&a.resilience_hash)?),
        ResilienceMode::Journal => MovedResilience::Journal,
        ResilienceMode::None | ResilienceMode::Datashift => bail!(UsageError(
            "--decrypt takes --resilience checksum (the default) or journal: the data moves, which is its own protection, except for the part decrypted in place last".into()
        )),
    };
    let params = DecryptParams {
        resilience,
        moved_len: a.hotzone_size,
        keyslot: a.key_slot,
        pbkdf: pbkdf_options(&a.pbkdf, HashAlg::parse(&a.hash)?, LuksVersion::V2)?,
    };
    let passphrase = read_passphrase(a.key_file.as_deref(), "Enter passphrase: ")?;
    let hpath = header.display().to_string();
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(header)
        .with_context(|| format!("creating the header file {hpath}"))?;
    match decrypt_init(image, &file, &passphrase, unlock, &params) {
        Ok(hdr) => Ok((file, hdr, passphrase)),
        Err(e) => {
            // Untouched image (still LUKS): the header file is of no use, as in cryptsetup.
            if LuksImage::probe(image).unwrap_or(false) {
                let _ = std::fs::remove_file(header);
                Err(e).with_context(|| format!("starting the decryption of {path}"))
            } else {
                Err(e).with_context(|| {
                    format!("starting the decryption of {path} (its header is kept in {hpath})")
                })
            }
        }
    }
}
