//! LUKS2 `clevis` tokens bound with the tang pin (network-bound disk encryption): find them in
//! a header, and recover the passphrase of their keyslot from the tang server, as
//! `clevis luks unlock` does, with no clevis or jose binary.
//!
//! Why not a JOSE crate: the tang pin needs the McCallum-Relyea exchange (point addition
//! and subtraction on the raw curve points), which no JOSE library exposes; the JWE part
//! around it (ECDH-ES Concat KDF and AES-GCM) is a few lines on OpenSSL, which the workspace
//! already builds. The token JSON is untrusted and every field is checked.

#![forbid(unsafe_code)]
mod base64url;
mod error;
mod http;
mod jose;
mod jwe;
mod jwk;
mod tang;
mod token;

pub use error::{Result, TokenError};
pub use token::{clevis_tokens, parse_token, ClevisToken};

use std::time::Duration;
use zeroize::Zeroizing;

/// How long a tang server gets to answer, connection included, by default.
pub const DEFAULT_TANG_TIMEOUT: Duration = Duration::from_secs(10);

/// The passphrase `token` holds for its keyslots, recovered through its tang server within
/// `timeout`. Zeroized on drop.
pub fn recover_passphrase(token: &ClevisToken, timeout: Duration) -> Result<Zeroizing<Vec<u8>>> {
    let h = &token.header;
    let secret = tang::recover_shared_secret(h, timeout)?;
    let cek = jwe::concat_kdf(&secret, &h.enc, &h.apu, &h.apv)?;
    match jwe::decrypt(&token.jwe, &h.enc, &cek)? {
        Some(passphrase) => Ok(passphrase),
        None => Err(TokenError::WrongServerKey { url: h.url.clone() }),
    }
}
