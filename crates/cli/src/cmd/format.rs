use crate::args::{Cli, FormatArgs};
use crate::exit::UsageError;
use crate::options::format_options;
use crate::secrets::read_passphrase;
use anyhow::{bail, Context, Result};
use cryptblk_luks::{HeaderIo, LuksImage};
use std::fs::{File, OpenOptions};
use std::io::{BufRead, IsTerminal, Write};

pub fn run(_cli: &Cli, args: &FormatArgs) -> Result<()> {
    let opts = format_options(&args.luks)?;
    let path = &args.image;
    if let Some(size) = args.size {
        if size == 0 || size % opts.sector_size as u64 != 0 {
            return Err(UsageError(format!(
                "SIZE {size} must be a non-zero multiple of the {}-byte encryption sector",
                opts.sector_size
            ))
            .into());
        }
    }
    if let Some(name) = crate::rbd::rbd_name(path) {
        let image = format_rbd(name, args, &opts)?;
        report(args, &opts, &image);
        return Ok(());
    }
    let (file, created) = match args.size {
        Some(_) => {
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .open(path)
                .map_err(|e| {
                    if e.kind() == std::io::ErrorKind::AlreadyExists {
                        anyhow::Error::from(UsageError(format!(
                        "{} already exists: omit SIZE to format it in place, or choose a new name",
                        path.display()
                    )))
                    } else {
                        anyhow::Error::from(e).context(format!("creating {}", path.display()))
                    }
                })?;
            (file, true)
        }
        None => {
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .open(path)
                .with_context(|| {
                    format!(
                        "opening {} (give a SIZE to create a new image)",
                        path.display()
                    )
                })?;
            (file, false)
        }
    };
    let result = format_file(&file, args, &opts, created);
    if result.is_err() && created {
        drop(file);
        let _ = std::fs::remove_file(path);
    }
    let (image, _volume_key) = result?;
    report(args, &opts, &image);
    Ok(())
}

fn report(args: &FormatArgs, opts: &cryptblk_luks::FormatOptions, image: &LuksImage) {
    let path = &args.image;
    println!(
        "Formatted {} as LUKS{}: {} {} bits, {}-byte sectors, data at offset {}, uuid {}",
        path.display(),
        if matches!(image, LuksImage::V1(_)) {
            1
        } else {
            2
        },
        opts.cipher.to_luks2_string(),
        opts.cipher.key_bytes() * 8,
        opts.sector_size,
        image.data_offset(),
        image.uuid()
    );
}

/// Formats an RBD image: a new one of SIZE (payload) bytes plus the header when SIZE is
/// given, else an existing one in place, as `rbd encryption format` does (payload = the image
/// minus the header). The header sits at the image's start, where librbd's encryption and
/// QEMU's `encrypt.format=` look for it.
fn format_rbd(
    name: &str,
    args: &FormatArgs,
    opts: &cryptblk_luks::FormatOptions,
) -> Result<LuksImage> {
    let (created, device) = match args.size {
        Some(_) => {
            let (created, device) = crate::rbd::NewImage::create(name)?;
            (Some(created), device)
        }
        None => {
            let device = crate::rbd::open(name, true)?;
            confirm_overwrite(args)?;
            if device.image().size() == 0 {
                bail!("{name} is empty: give a SIZE to create the payload");
            }
            (None, device)
        }
    };
    let passphrase = read_passphrase(
        args.key_file.as_deref(),
        "Enter passphrase for the new image: ",
    )?;
    let result = LuksImage::format(&device, opts, &passphrase, args.size)
        .and_then(|formatted| Ok(device.sync_data().map(|()| formatted)?))
        .with_context(|| format!("formatting {name}"));
    // Closed before a failed new image is removed (librbd refuses to remove an open one).
    drop(device);
    let (image, _volume_key) = result?;
    if let Some(created) = created {
        created.keep();
    }
    Ok(image)
}

fn format_file(
    file: &File,
    args: &FormatArgs,
    opts: &cryptblk_luks::FormatOptions,
    created: bool,
) -> Result<(LuksImage, cryptblk_crypto::SecretKey)> {
    file.try_lock().map_err(|_| {
        anyhow::Error::from(cryptblk_block::BlockError::new(
            cryptblk_block::BlockErrorKind::Locked,
            format!("{} is in use by another process", args.image.display()),
        ))
    })?;
    if !created {
        confirm_overwrite(args)?;
        let len = file.metadata()?.len();
        if len == 0 {
            bail!(
                "{} is empty: give a SIZE to create the payload",
                args.image.display()
            );
        }
    }
    let passphrase = read_passphrase(
        args.key_file.as_deref(),
        "Enter passphrase for the new image: ",
    )?;
    let result = LuksImage::format(file, opts, &passphrase, args.size)
        .with_context(|| format!("formatting {}", args.image.display()))?;
    file.sync_all()
        .with_context(|| format!("syncing {}", args.image.display()))?;
    Ok(result)
}

/// cryptsetup asks before destroying data; so do we, but only when someone can answer.
fn confirm_overwrite(args: &FormatArgs) -> Result<()> {
    if args.batch || !std::io::stdin().is_terminal() {
        return Ok(());
    }
    eprint!(
        "WARNING: this overwrites the data on {} irrevocably.\nAre you sure? (Type 'yes' in capital letters): ",
        args.image.display()
    );
    std::io::stderr().flush()?;
    let mut answer = String::new();
    std::io::stdin().lock().read_line(&mut answer)?;
    if answer.trim_end() != "YES" {
        bail!("not confirmed; nothing was written");
    }
    Ok(())
}
