//! The opt-in key cache (`serve --key-cache keyring`): each unlocked LUKS disk's volume keys,
//! with the fingerprints of the digests they match (`cryptblk_luks::KnownKey`), kept in the
//! kernel keyring of the daemon's user, so that a daemon started after a crash (SIGKILL, the
//! OOM killer) opens its disks without a key derivation, as cryptsetup keeps dm-crypt's keys
//! in the kernel keyring (`--link-vk-to-keyring`).
//!
//! One `user` key per disk, named `cryptblk:<LUKS UUID>`, in the user keyring (`@u`). Its
//! payload is never logged. The keys carry a timeout that the running daemon renews
//! (`refresh`), so they outlive a crashed daemon by at most that long; a detached disk's key
//! is removed at once. A stale entry (the volume was re-encrypted or re-formatted meanwhile)
//! fails the fingerprint check and the passphrase is used instead.
//!
//! Payload: `CBK1`, then per key: the 32-byte digest fingerprint, the key's length as two
//! bytes (little-endian) and the key.

use cryptblk_crypto::SecretKey;
use cryptblk_luks::{DigestFingerprint, KnownKey};
use linux_keyutils::{Key, KeyRing, KeyRingIdentifier};
use std::collections::BTreeMap;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;
use zeroize::Zeroizing;

const MAGIC: &[u8; 4] = b"CBK1";
/// The largest payload the kernel keeps in a `user` key.
const MAX_PAYLOAD: usize = 32 * 1024;

/// Why the key cache cannot be used (the daemon then works without it, saying so).
#[derive(Debug, thiserror::Error)]
#[error("the kernel keyring {what}: {errno}")]
pub struct KeyCacheError {
    what: &'static str,
    errno: linux_keyutils::KeyError,
}

/// The daemon's cache of volume keys in its user's kernel keyring.
pub struct KeyCache {
    keyring: KeyRing,
    timeout: Duration,
    /// The keys this daemon stored, by LUKS UUID, whose timeouts it renews.
    stored: Mutex<BTreeMap<String, Key>>,
}

impl std::fmt::Debug for KeyCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyCache")
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

fn description(uuid: &str) -> String {
    format!("cryptblk:{uuid}")
}

impl KeyCache {
    /// The cache in the user keyring; keys live `timeout` past their last renewal.
    pub fn open(timeout: Duration) -> Result<KeyCache, KeyCacheError> {
        let keyring = KeyRing::from_special_id(KeyRingIdentifier::User, true).map_err(|errno| {
            KeyCacheError {
                what: "of the daemon's user cannot be opened",
                errno,
            }
        })?;
        // The keys are the daemon's as long as it possesses the user keyring: link it into the
        // session keyring (systemd gives services a private one, `KeyringMode=private`).
        if let Ok(session) = KeyRing::from_special_id(KeyRingIdentifier::Session, false) {
            let _ = session.link_keyring(keyring);
        }
        Ok(KeyCache {
            keyring,
            timeout,
            stored: Mutex::new(BTreeMap::new()),
        })
    }

    /// The cached keys of the volume with LUKS UUID `uuid`, if any (a malformed entry is
    /// treated as none and removed).
    pub fn lookup(&self, uuid: &str) -> Option<Vec<KnownKey>> {
        let key = self.keyring.search(&description(uuid)).ok()?;
        let mut payload = Zeroizing::new(vec![0u8; MAX_PAYLOAD]);
        let len = key.read(&mut *payload).ok()?;
        match decode(payload.get(..len)?) {
            Some(keys) => Some(keys),
            None => {
                tracing::warn!(uuid, "the key cache's entry is malformed; removing it");
                let _ = key.invalidate();
                None
            }
        }
    }

    /// Stores (or replaces) the keys of volume `uuid`.
    pub fn store(&self, uuid: &str, keys: &[KnownKey]) -> Result<(), KeyCacheError> {
        let payload = encode(keys);
        let key = self
            .keyring
            .add_key(&description(uuid), &*payload)
            .map_err(|errno| KeyCacheError {
                what: "refused a key",
                errno,
            })?;
        let _ = key.set_timeout(self.timeout_secs());
        self.stored
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(uuid.to_string(), key);
        Ok(())
    }

    /// Removes the keys of volume `uuid` (its disk was detached).
    pub fn remove(&self, uuid: &str) {
        let stored = self
            .stored
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(uuid);
        let key = stored.or_else(|| self.keyring.search(&description(uuid)).ok());
        if let Some(key) = key {
            let _ = key.invalidate();
        }
    }

    /// Renews the timeout of every key this daemon stored.
    pub fn refresh(&self) {
        let seconds = self.timeout_secs();
        for key in self
            .stored
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
        {
            let _ = key.set_timeout(seconds);
        }
    }

    /// How often `refresh` must run so that no key expires under a live daemon.
    pub fn refresh_interval(&self) -> Duration {
        (self.timeout / 3).max(Duration::from_secs(1))
    }

    fn timeout_secs(&self) -> usize {
        usize::try_from(self.timeout.as_secs().max(1)).unwrap_or(usize::MAX)
    }
}

/// The keys as bytes (the cache's payload, and the secret part of a hand-over message).
pub(crate) fn encode(keys: &[KnownKey]) -> Zeroizing<Vec<u8>> {
    let mut out = Zeroizing::new(Vec::with_capacity(
        4 + keys.iter().map(|k| 34 + k.key.len()).sum::<usize>(),
    ));
    out.extend_from_slice(MAGIC);
    for k in keys {
        out.extend_from_slice(k.digest.as_bytes());
        out.extend_from_slice(&(k.key.len() as u16).to_le_bytes());
        out.extend_from_slice(k.key.as_bytes());
    }
    out
}

/// The keys of a payload; `None` if it is not one `encode` wrote.
pub(crate) fn decode(mut payload: &[u8]) -> Option<Vec<KnownKey>> {
    payload = payload.strip_prefix(MAGIC)?;
    let mut keys = Vec::new();
    while !payload.is_empty() {
        let (digest, rest) = payload.split_first_chunk::<32>()?;
        let (len, rest) = rest.split_first_chunk::<2>()?;
        let len = usize::from(u16::from_le_bytes(*len));
        if len == 0 || len > rest.len() {
            return None;
        }
        let (key, rest) = rest.split_at(len);
        keys.push(KnownKey {
            key: SecretKey::from_slice(key),
            digest: DigestFingerprint::from_bytes(*digest),
        });
        payload = rest;
    }
    (!keys.is_empty()).then_some(keys)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_round_trip_and_malformed_ones_are_refused() {
        let keys = vec![
            KnownKey {
                key: SecretKey::from_slice(&[7u8; 64]),
                digest: DigestFingerprint::from_bytes([1; 32]),
            },
            KnownKey {
                key: SecretKey::from_slice(&[9u8; 32]),
                digest: DigestFingerprint::from_bytes([2; 32]),
            },
        ];
        let payload = encode(&keys);
        let back = decode(&payload).unwrap();
        assert_eq!(back.len(), 2);
        assert_eq!(back[0].key.as_bytes(), &[7u8; 64][..]);
        assert_eq!(back[1].digest, DigestFingerprint::from_bytes([2; 32]));
        assert!(decode(&payload[..payload.len() - 1]).is_none());
        assert!(decode(b"CBK1").is_none());
        assert!(decode(b"XXXX").is_none());
        assert!(decode(&payload[..4 + 33]).is_none());
    }

    /// The kernel keeps what `store` put there for the next daemon, and `remove` takes it
    /// away (skipped where the keyring syscalls are not allowed, e.g. some containers).
    #[test]
    fn stores_finds_and_removes_keys_in_the_user_keyring() {
        let Ok(cache) = KeyCache::open(Duration::from_secs(60)) else {
            cryptblk_testutil::skip("no kernel keyring here");
            return;
        };
        let uuid = format!("test-{}", std::process::id());
        let keys = vec![KnownKey {
            key: SecretKey::from_slice(&[5u8; 32]),
            digest: DigestFingerprint::from_bytes([3; 32]),
        }];
        cache.store(&uuid, &keys).unwrap();
        let found = cache.lookup(&uuid).expect("stored key");
        assert_eq!(found[0].key.as_bytes(), &[5u8; 32][..]);
        cache.refresh();
        cache.remove(&uuid);
        assert!(cache.lookup(&uuid).is_none());
    }
}
