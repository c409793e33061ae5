//! Passphrases sent inline, encrypted with the daemon's master key, as QEMU takes them in
//! `secret` objects with `keyid` and `iv`: libvirt writes 32 random bytes to a file QEMU reads
//! at start (its master key) and sends each secret as base64 of its AES-256-CBC ciphertext
//! (PKCS#7 padding) with base64 of a fresh 16-byte IV. So a passphrase crosses the control
//! socket, and may sit in a request log or a config file, only encrypted; the ciphertext may
//! be logged, the plaintext never is.
//!
//! The master key (`serve --master-key-file`) is read once, at start, into a zeroizing buffer:
//! exactly 32 raw bytes from a regular file or a pipe. A file its group or others may read is
//! used with a warning, as key files are. A wrong master key or IV is not always detectable
//! (CBC has no integrity check): a wrong key almost always breaks the padding and is reported
//! so, but a wrong IV garbles only the first 16 bytes of the passphrase, which then opens no
//! keyslot (the usual wrong-passphrase error).
use crate::error::{Context, Error, Result};
use crate::key_file::{permission_warning, read_capped, Passphrase};
use base64::Engine;
use openssl::symm::{Cipher, Crypter, Mode};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::Path;
use zeroize::Zeroizing;

/// Bytes of the master key (AES-256).
pub const MASTER_KEY_BYTES: usize = 32;

/// Bytes of a secret's IV (one AES block).
pub const IV_BYTES: usize = 16;

/// The daemon's master key; wiped from memory when dropped, never printed. On the heap, so
/// moving it (into the daemon) leaves no copy behind on a stack.
pub struct MasterKey(Box<Zeroizing<[u8; MASTER_KEY_BYTES]>>);

impl std::fmt::Debug for MasterKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MasterKey(..)")
    }
}

impl MasterKey {
    /// The key of exactly [`MASTER_KEY_BYTES`] bytes (`None` for another length).
    pub fn from_bytes(bytes: &[u8]) -> Option<MasterKey> {
        let mut key = Box::new(Zeroizing::new([0u8; MASTER_KEY_BYTES]));
        (bytes.len() == MASTER_KEY_BYTES).then(|| {
            key.copy_from_slice(bytes);
            MasterKey(key)
        })
    }

    /// Reads the master key file at `path`: a regular file or a pipe holding exactly 32 raw
    /// bytes (e.g. `head -c 32 /dev/urandom > master.key`).
    pub fn from_file(path: &Path) -> Result<MasterKey> {
        let what = || format!("reading the master key file {}", path.display());
        let mut file = std::fs::File::open(path).with_context(what)?;
        let meta = file.metadata().with_context(what)?;
        let kind = meta.file_type();
        let refused = if kind.is_dir() {
            Some("a directory")
        } else if kind.is_char_device() || kind.is_block_device() {
            Some("a device")
        } else if !(kind.is_file() || kind.is_fifo() || kind.is_socket()) {
            Some("not a regular file")
        } else {
            None
        };
        if let Some(refused) = refused {
            return Err(Error::usage(format!(
                "master key file {} is {refused}: give a file holding exactly \
                 {MASTER_KEY_BYTES} random bytes",
                path.display()
            )));
        }
        if let Some(warning) = permission_warning(path, meta.permissions().mode()) {
            tracing::warn!("master {warning}");
        }
        let bytes = read_capped(&mut file, MASTER_KEY_BYTES, 0, None).with_context(what)?;
        match bytes.as_deref().and_then(|b| MasterKey::from_bytes(b)) {
            Some(key) => Ok(key),
            None => Err(Error::usage(format!(
                "master key file {} holds {}, not exactly {MASTER_KEY_BYTES} bytes: the master \
                 key is {MASTER_KEY_BYTES} raw random bytes (head -c {MASTER_KEY_BYTES} \
                 /dev/urandom), not text or base64",
                path.display(),
                match bytes {
                    Some(b) => format!("{} bytes", b.len()),
                    None => format!("more than {MASTER_KEY_BYTES} bytes"),
                }
            ))),
        }
    }

    /// Decrypts the passphrase of the params `PREFIX-secret` (base64 AES-256-CBC ciphertext,
    /// PKCS#7 padded) and `PREFIX-secret-iv` (base64 of 16 bytes) into a zeroizing buffer.
    pub fn decrypt(&self, ciphertext: &str, iv: &str, prefix: &str) -> Result<Passphrase> {
        let data = decode(ciphertext, &format!("{prefix}-secret"))?;
        let iv = decode(iv, &format!("{prefix}-secret-iv"))?;
        if iv.len() != IV_BYTES {
            return Err(Error::invalid_params(format!(
                "{prefix}-secret-iv holds {} bytes, not {IV_BYTES}: give base64 of the 16-byte \
                 IV the secret was encrypted with",
                iv.len()
            )));
        }
        let cipher = Cipher::aes_256_cbc();
        if data.is_empty() || data.len() % cipher.block_size() != 0 {
            return Err(Error::invalid_params(format!(
                "{prefix}-secret is {} bytes, not whole 16-byte AES blocks: give base64 of the \
                 AES-256-CBC ciphertext (with PKCS#7 padding, as openssl enc makes it)",
                data.len()
            )));
        }
        let not_decrypted = || {
            Error::invalid_params(format!(
                "{prefix}-secret did not decrypt with the daemon's master key (wrong key or \
                 IV?): encrypt the passphrase with AES-256-CBC under the key in serve's \
                 --master-key-file"
            ))
        };
        let mut plain: Passphrase = Zeroizing::new(vec![0; data.len() + cipher.block_size()]);
        let mut crypter = Crypter::new(cipher, Mode::Decrypt, &self.0[..], Some(&iv))
            .map_err(|_| not_decrypted())?;
        crypter.pad(true);
        let n = crypter
            .update(&data, &mut plain)
            .map_err(|_| not_decrypted())?;
        // A wrong key leaves padding that does not check out: refused here.
        let tail = crypter
            .finalize(&mut plain[n..])
            .map_err(|_| not_decrypted())?;
        plain.truncate(n + tail);
        if plain.is_empty() {
            return Err(Error::usage(format!(
                "{prefix}-secret decrypts to an empty passphrase: encrypt the passphrase itself \
                 (every byte counts)"
            )));
        }
        Ok(plain)
    }
}

/// The passphrase of `PREFIX-secret`, decrypted with `master`: an invalid-params error naming
/// what to do when the daemon was started without one.
pub fn decrypt_secret(
    master: Option<&MasterKey>,
    ciphertext: &str,
    iv: &str,
    prefix: &str,
) -> Result<Passphrase> {
    let master = master.ok_or_else(|| {
        Error::invalid_params(format!(
            "{prefix}-secret: the daemon has no master key: start serve with --master-key-file \
             FILE (32 random bytes) and encrypt the passphrase with that key"
        ))
    })?;
    master.decrypt(ciphertext, iv, prefix)
}

/// Base64 (standard alphabet, padded, as libvirt and `openssl enc -a` write it; line breaks
/// and spaces are ignored) of the param `param`, in a zeroizing buffer.
fn decode(text: &str, param: &str) -> Result<Zeroizing<Vec<u8>>> {
    let compact: String = text.chars().filter(|c| !c.is_ascii_whitespace()).collect();
    base64::engine::general_purpose::STANDARD
        .decode(compact.as_bytes())
        .map(Zeroizing::new)
        .map_err(|e| Error::invalid_params(format!("{param} is not base64 ({e})")))
}

#[cfg(test)]
mod tests;
