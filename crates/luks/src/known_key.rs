//! Volume keys already known, and how a header accepts one without a key derivation.
//!
//! A daemon that restarts (an upgrade handing its volumes to a successor, or a key cache that
//! outlives a crash) has each disk's volume key but not the seconds of argon2 a passphrase
//! costs, nor the PBKDF2 of the header's digest check (~125 ms per key at cryptsetup's
//! defaults, too much for hundreds of disks). So a key travels with the fingerprint of the
//! digest it was checked against when its volume was first unlocked: a hash of everything
//! the header stores about that digest (the kind, hash, iterations, salt and the digest value
//! itself). A header still holding a digest with that fingerprint describes the same volume
//! key: the digest value is a one-way function of the key and the salt, so a changed key
//! (a re-encryption, a new `luksFormat` under the same UUID) changes the value, and with it
//! the fingerprint. The check is then a hash of a few dozen bytes instead of a KDF.
//!
//! The fingerprint vouches for a key only as far as whoever recorded the pair had checked
//! it: the daemon records a pair only right after a keyslot or the digest itself accepted
//! the key.

use cryptblk_crypto::SecretKey;
use sha2::{Digest as _, Sha256};
use std::fmt;

/// What identifies a header's volume-key digest (see the module documentation).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct DigestFingerprint([u8; 32]);

impl DigestFingerprint {
    /// The fingerprint of a digest given as its stored fields, each length-prefixed so that no
    /// two different records hash alike.
    pub(crate) fn of(fields: &[&[u8]]) -> DigestFingerprint {
        let mut hash = Sha256::new();
        for field in fields {
            hash.update((field.len() as u64).to_le_bytes());
            hash.update(field);
        }
        DigestFingerprint(hash.finalize().into())
    }

    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    pub fn from_bytes(bytes: [u8; 32]) -> DigestFingerprint {
        DigestFingerprint(bytes)
    }

    /// Lowercase hex, e.g. to name a cached key.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }
}

impl fmt::Debug for DigestFingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Not secret (the header is public), but long: the first bytes tell them apart.
        write!(f, "DigestFingerprint({}..)", &self.to_hex()[..12])
    }
}

/// A volume key and the fingerprint of the digest that accepted it.
pub struct KnownKey {
    pub key: SecretKey,
    pub digest: DigestFingerprint,
}

impl KnownKey {
    /// A copy (on locked pages, as every `SecretKey`).
    pub fn duplicate(&self) -> KnownKey {
        KnownKey {
            key: SecretKey::from_slice(self.key.as_bytes()),
            digest: self.digest,
        }
    }
}

impl fmt::Debug for KnownKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KnownKey")
            .field("key", &"(secret)")
            .field("digest", &self.digest)
            .finish()
    }
}

/// What opens a volume: a passphrase, tried on the keyslots (a KDF each), or volume keys
/// already known, matched to the header's digests by fingerprint (no KDF).
#[derive(Clone, Copy)]
pub enum Unlocker<'a> {
    Passphrase(&'a [u8]),
    Keys(&'a [KnownKey]),
}

impl fmt::Debug for Unlocker<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Unlocker::Passphrase(_) => f.write_str("Unlocker::Passphrase(..)"),
            Unlocker::Keys(keys) => f.debug_tuple("Unlocker::Keys").field(keys).finish(),
        }
    }
}

impl Unlocker<'_> {
    /// The known key for the digest with `fingerprint`, copied; `None` for a passphrase.
    pub(crate) fn known(&self, fingerprint: DigestFingerprint) -> Option<Option<SecretKey>> {
        match self {
            Unlocker::Passphrase(_) => None,
            Unlocker::Keys(keys) => Some(
                keys.iter()
                    .find(|k| k.digest == fingerprint)
                    .map(|k| SecretKey::from_slice(k.key.as_bytes())),
            ),
        }
    }
}
