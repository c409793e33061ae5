//! LUKS1 and LUKS2 on-disk formats, byte-compatible with cryptsetup and QEMU's luks driver.
//!
//! Most callers only need [`LuksImage`]: `probe`/`read` a file, `unlock` it with a passphrase
//! to get the volume key, `format` a new image, and add, remove or change keyslots.
//! The version modules (`luks1`, `luks2`) expose the same shape underneath; `af`, `kdf` and
//! `keyslot_area` are the building blocks both share.
//!
//! Headers are untrusted input: parsing validates every size and offset and reports
//! `LuksError::Corrupt`/`Truncated` instead of panicking (fuzzed, see `fuzz/`).
//! Changes are ordered for crash safety: new key material is written and synced before the
//! header that activates it; removal wipes the slot's area first (as cryptsetup does) and then
//! rewrites the header without it.

#![forbid(unsafe_code)]

pub mod af;
mod ct;
mod direct_file;
mod error;
mod hash;
mod image;
mod io;
pub mod kdf;
mod kdf_cost;
pub mod keyslot_area;
mod known_key;
pub mod luks1;

pub use direct_file::{DirectFile, DIRECT_ALIGN};
pub use error::{LuksError, Result};
pub use hash::HashAlg;
pub use image::LuksImage;
pub use io::HeaderIo;
pub use known_key::{DigestFingerprint, KnownKey, Unlocker};
mod options;
pub use options::{
    FormatOptions, LuksVersion, PbkdfKind, PbkdfOptions, UnlockOptions,
    DEFAULT_MAX_ARGON2_WORK_KIB, DEFAULT_MAX_PBKDF2_ITERATIONS,
};
pub mod luks2;
