//! `key-add` and `key-remove` on an attached LUKS disk: the header is rewritten in place
//! (crash-safe, see cryptblk-luks) while the disk keeps serving.
use crate::activity::HeaderChange;
use crate::disk::AttachedDisk;
use crate::error::{Context, Error, Result};
use crate::key_source::{read_key_source, unlocking_with};
use crate::registry::Daemon;
use cryptblk_control::api::{
    key_source, KeyAddParams, KeyParams, KeyRemoveParams, KeySource, Pbkdf,
};
use cryptblk_control::PassedFds;
use cryptblk_luks::kdf::Argon2Variant;
use cryptblk_luks::{HashAlg, LuksVersion, PbkdfKind, PbkdfOptions};
use cryptblk_volume::{Keyslots, LastKeyslot, RemoveError};
use std::sync::Arc;

impl Daemon {
    /// Adds a keyslot to an attached LUKS disk; returns the new slot. Passphrases given by
    /// descriptor are taken from `fds`.
    pub fn key_add(&self, p: &KeyAddParams, fds: &mut PassedFds) -> Result<usize> {
        let name = p.name.as_str();
        let old_source = required_source(p.key_params(), "key")?;
        let new_source = required_source(p.new_key_params(), "new-key")?;
        let disk = self.attached(name)?;
        let file = luks_file(&disk)?;
        let _change = self.begin_header_change(&disk)?;
        let (mut keyslots, _) =
            Keyslots::read(file.header_io()).context("reading the LUKS header")?;
        let old = read_key_source(old_source, "key", fds, self.master_key.as_ref())?;
        let unlocked = keyslots
            .unlock(&old, &self.unlock)
            .with_context(|| unlocking_with(old_source, "key"))?;
        let new = read_key_source(new_source, "new-key", fds, self.master_key.as_ref())?;
        let pbkdf = pbkdf_options(p.pbkdf, p.iter_time, unlocked.version())?;
        unlocked
            .add_keyslot(&new, None, &pbkdf)
            .context("adding the keyslot")
    }

    /// Removes the keyslot the given passphrase opens; refuses to remove the last one.
    pub fn key_remove(&self, p: &KeyRemoveParams, fds: &mut PassedFds) -> Result<usize> {
        let name = p.name.as_str();
        let source = required_source(p.key_params(), "key")?;
        let disk = self.attached(name)?;
        let file = luks_file(&disk)?;
        let _change = self.begin_header_change(&disk)?;
        let (mut keyslots, _) =
            Keyslots::read(file.header_io()).context("reading the LUKS header")?;
        let passphrase = read_key_source(source, "key", fds, self.master_key.as_ref())?;
        let unlocked = keyslots
            .unlock(&passphrase, &self.unlock)
            .with_context(|| unlocking_with(source, "key"))?;
        match unlocked.remove_keyslot(LastKeyslot::Refuse) {
            Ok(slot) => Ok(slot),
            Err(RemoveError::LastKeyslot { slot }) => Err(Error::conflict(format!(
                "keyslot {slot} is the last one of disk \"{name}\": removing it would make the \
                 data unrecoverable; add another key first"
            ))),
            Err(RemoveError::Luks(e)) => Err(e).context("removing the keyslot"),
        }
    }

    /// Marks the disk's header as changing (no migration can start meanwhile). The header
    /// travels once, at the start of a migration: a keyslot change while one is under way
    /// (or while one is bringing the disk in) would be lost on the other side, so it is
    /// refused.
    pub(crate) fn begin_header_change(&self, disk: &AttachedDisk) -> Result<HeaderChange> {
        let name = disk.name();
        if self.incoming_in_progress(name) {
            return Err(Error::busy(format!(
                "disk \"{name}\" is being migrated: change its keyslots or size before or after"
            )));
        }
        disk.activity.begin_header_change(name)
    }
}

/// The passphrase source of the params `PREFIX-file`/`PREFIX-fd`/`PREFIX-secret`: exactly one.
pub(crate) fn required_source<'a>(given: KeyParams<'a>, prefix: &str) -> Result<KeySource<'a>> {
    match key_source(given, prefix, true) {
        Ok(Some(source)) => Ok(source),
        Ok(None) => unreachable!("a required source is present or an error"),
        Err(e) => Err(Error::invalid_params(e.message)),
    }
}

pub(crate) fn luks_file(disk: &AttachedDisk) -> Result<Arc<dyn cryptblk_block::Container>> {
    match disk.image.luks() {
        Some(_) => Ok(disk.image.container.clone()),
        None => Err(Error::conflict(format!(
            "disk \"{}\" is {}, not LUKS: it has no keyslots",
            disk.name(),
            disk.image.format().name()
        ))),
    }
}

/// The key derivation of a new keyslot: `pbkdf` (default argon2id on LUKS2, pbkdf2 on LUKS1),
/// benchmarked to `iter_time_ms` (default 2000), cryptsetup's memory cost.
pub fn pbkdf_options(
    pbkdf: Option<Pbkdf>,
    iter_time_ms: Option<u32>,
    version: LuksVersion,
) -> Result<PbkdfOptions> {
    let kind = match (version, pbkdf) {
        (LuksVersion::V1, None | Some(Pbkdf::Pbkdf2)) => PbkdfKind::Pbkdf2,
        (LuksVersion::V1, Some(other)) => {
            return Err(Error::usage(format!(
                "LUKS1 keyslots only support pbkdf2, not {}",
                format!("{other:?}").to_lowercase()
            )))
        }
        (LuksVersion::V2, None | Some(Pbkdf::Argon2id)) => {
            PbkdfKind::Argon2(Argon2Variant::Argon2id)
        }
        (LuksVersion::V2, Some(Pbkdf::Argon2i)) => PbkdfKind::Argon2(Argon2Variant::Argon2i),
        (LuksVersion::V2, Some(Pbkdf::Pbkdf2)) => PbkdfKind::Pbkdf2,
    };
    let mut opts = PbkdfOptions {
        kind,
        hash: HashAlg::Sha256,
        memory_kib: PbkdfOptions::default_argon2_memory_kib(),
        ..PbkdfOptions::default()
    };
    if let Some(ms) = iter_time_ms {
        if ms == 0 {
            return Err(Error::usage("iter-time must be at least 1 ms"));
        }
        opts.iter_time_ms = ms;
    }
    Ok(opts)
}

#[cfg(test)]
mod tests {
    use super::*;
    use cryptblk_control::api::ErrorKind;

    #[test]
    fn pbkdf_defaults_follow_the_luks_version() {
        let v2 = pbkdf_options(None, None, LuksVersion::V2).unwrap();
        assert_eq!(v2.kind, PbkdfKind::Argon2(Argon2Variant::Argon2id));
        assert_eq!(v2.iter_time_ms, 2000);
        let v1 = pbkdf_options(None, Some(50), LuksVersion::V1).unwrap();
        assert_eq!((v1.kind, v1.iter_time_ms), (PbkdfKind::Pbkdf2, 50));
        let e = pbkdf_options(Some(Pbkdf::Argon2i), None, LuksVersion::V1).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Usage);
        assert!(e.to_string().contains("not argon2i"), "{e}");
        assert!(pbkdf_options(None, Some(0), LuksVersion::V2).is_err());
    }
}
