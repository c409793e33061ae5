use crate::args::{Cli, KeyAddArgs, KeyChangeArgs, KeyCommand, KeyRemoveArgs};
use crate::options::{pbkdf_options, unlock_options};
use crate::secrets::read_passphrase;
use anyhow::{bail, Context, Result};
use cryptblk_luks::{HashAlg, HeaderIo, LuksImage};
use std::fs::File;
use std::path::Path;

pub fn run(cli: &Cli, command: &KeyCommand) -> Result<()> {
    match command {
        KeyCommand::Add(a) => add(cli, a),
        KeyCommand::Remove(a) => remove(cli, a),
        KeyCommand::Change(a) => change(cli, a),
    }
}

/// Opens the image for a header update, exclusively: a daemon serving it, or a second key
/// command, must not interleave header writes with ours.
fn open_for_update(path: &Path) -> Result<(Box<dyn HeaderIo>, LuksImage)> {
    let file: Box<dyn HeaderIo> = match crate::rbd::rbd_name(path) {
        // Opened writable, an RBD image is under its exclusive lock already.
        Some(name) => Box::new(crate::rbd::open(name, true)?),
        None => Box::new(open_file_for_update(path, "changing keys")?),
    };
    let (image, warnings) = LuksImage::read(&*file)
        .with_context(|| format!("reading the LUKS header of {}", path.display()))?;
    for warning in &warnings {
        eprintln!("cryptblk: warning: {}: {warning}", path.display());
    }
    if let Some(reason) = image.read_only_reason() {
        bail!("{} cannot be modified: {reason}", path.display());
    }
    Ok((file, image))
}

/// Opens an image file for writing with its exclusive lock: nothing else may use it while
/// `job` ("changing keys", "re-encrypting") rewrites it.
pub(crate) fn open_file_for_update(path: &Path, job: &str) -> Result<File> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .with_context(|| format!("opening {}", path.display()))?;
    file.try_lock().map_err(|_| {
        anyhow::Error::from(cryptblk_block::BlockError::new(
            cryptblk_block::BlockErrorKind::Locked,
            format!(
                "{} is in use by another process; stop it before {job}",
                path.display()
            ),
        ))
    })?;
    Ok(file)
}

fn add(cli: &Cli, a: &KeyAddArgs) -> Result<()> {
    let (file, mut image) = open_for_update(&a.image)?;
    let old = read_passphrase(a.key_file.as_deref(), "Enter any existing passphrase: ")?;
    let (_, volume_key) = image.unlock(&*file, &old, &unlock_options(cli))?;
    let new = read_passphrase(
        a.new_key_file.as_deref(),
        "Enter new passphrase for key slot: ",
    )?;
    let pbkdf = pbkdf_options(&a.pbkdf, HashAlg::Sha256, image.version())?;
    let slot = image.add_keyslot(&*file, &volume_key, &new, a.key_slot, &pbkdf)?;
    println!("Added keyslot {slot} to {}", a.image.display());
    Ok(())
}

fn remove(cli: &Cli, a: &KeyRemoveArgs) -> Result<()> {
    let (file, mut image) = open_for_update(&a.image)?;
    let passphrase = read_passphrase(
        a.key_file.as_deref(),
        "Enter passphrase of the keyslot to remove: ",
    )?;
    let (slot, _) = image.unlock(&*file, &passphrase, &unlock_options(cli))?;
    if image.active_keyslots().len() == 1 && !a.force {
        bail!(
            "keyslot {slot} is the last one: removing it makes the data unrecoverable; add another key first or pass --force"
        );
    }
    image.remove_keyslot(&*file, slot)?;
    println!("Removed keyslot {slot} from {}", a.image.display());
    Ok(())
}

fn change(cli: &Cli, a: &KeyChangeArgs) -> Result<()> {
    let (file, mut image) = open_for_update(&a.image)?;
    let old = read_passphrase(a.key_file.as_deref(), "Enter passphrase to be changed: ")?;
    let new = read_passphrase(a.new_key_file.as_deref(), "Enter new passphrase: ")?;
    let pbkdf = pbkdf_options(&a.pbkdf, HashAlg::Sha256, image.version())?;
    let slot = image.change_passphrase(&*file, &old, &new, &pbkdf, &unlock_options(cli))?;
    println!(
        "Changed the passphrase; it is now in keyslot {slot} of {}",
        a.image.display()
    );
    Ok(())
}
