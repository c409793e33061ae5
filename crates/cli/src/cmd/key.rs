use crate::args::{Cli, KeyAddArgs, KeyChangeArgs, KeyCommand, KeyRemoveArgs};
use crate::options::{pbkdf_options, unlock_options};
use crate::secrets::read_passphrase;
use anyhow::{bail, Context, Result};
use cryptblk_luks::{HashAlg, HeaderIo};
use cryptblk_volume::{Keyslots, LastKeyslot, RemoveError};
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
/// command, must not interleave header writes with ours. `change` runs on its keyslots.
fn update<T>(path: &Path, change: impl FnOnce(Keyslots<'_>) -> Result<T>) -> Result<T> {
    let file: Box<dyn HeaderIo> = match crate::rbd::rbd_name(path) {
        // Opened writable, an RBD image is under its exclusive lock already.
        Some(name) => Box::new(crate::rbd::open(name, true)?),
        None => Box::new(open_file_for_update(path, "changing keys")?),
    };
    let (keyslots, warnings) = Keyslots::read(&*file)
        .with_context(|| format!("reading the LUKS header of {}", path.display()))?;
    for warning in &warnings {
        eprintln!("cryptblk: warning: {}: {warning}", path.display());
    }
    if let Some(reason) = keyslots.read_only_reason() {
        bail!("{} cannot be modified: {reason}", path.display());
    }
    change(keyslots)
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
    let slot = update(&a.image, |mut keyslots| {
        let old = read_passphrase(a.key_file.as_deref(), "Enter any existing passphrase: ")?;
        let unlocked = keyslots.unlock(&old, &unlock_options(cli))?;
        let new = read_passphrase(
            a.new_key_file.as_deref(),
            "Enter new passphrase for key slot: ",
        )?;
        let pbkdf = pbkdf_options(&a.pbkdf, HashAlg::Sha256, unlocked.version())?;
        Ok(unlocked.add_keyslot(&new, a.key_slot, &pbkdf)?)
    })?;
    println!("Added keyslot {slot} to {}", a.image.display());
    Ok(())
}

fn remove(cli: &Cli, a: &KeyRemoveArgs) -> Result<()> {
    let slot = update(&a.image, |mut keyslots| {
        let passphrase = read_passphrase(
            a.key_file.as_deref(),
            "Enter passphrase of the keyslot to remove: ",
        )?;
        let unlocked = keyslots.unlock(&passphrase, &unlock_options(cli))?;
        let last = if a.force {
            LastKeyslot::Allow
        } else {
            LastKeyslot::Refuse
        };
        match unlocked.remove_keyslot(last) {
            Ok(slot) => Ok(slot),
            Err(RemoveError::LastKeyslot { slot }) => bail!(
                "keyslot {slot} is the last one: removing it makes the data unrecoverable; add another key first or pass --force"
            ),
            Err(RemoveError::Luks(e)) => Err(e.into()),
        }
    })?;
    println!("Removed keyslot {slot} from {}", a.image.display());
    Ok(())
}

fn change(cli: &Cli, a: &KeyChangeArgs) -> Result<()> {
    let slot = update(&a.image, |mut keyslots| {
        let old = read_passphrase(a.key_file.as_deref(), "Enter passphrase to be changed: ")?;
        let new = read_passphrase(a.new_key_file.as_deref(), "Enter new passphrase: ")?;
        let pbkdf = pbkdf_options(&a.pbkdf, HashAlg::Sha256, keyslots.version())?;
        Ok(keyslots.change_passphrase(&old, &new, &pbkdf, &unlock_options(cli))?)
    })?;
    println!(
        "Changed the passphrase; it is now in keyslot {slot} of {}",
        a.image.display()
    );
    Ok(())
}
