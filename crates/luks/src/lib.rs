//! LUKS1 and LUKS2 on-disk formats, byte-compatible with cryptsetup and QEMU's luks driver.

pub mod af;
mod ct;
mod error;
mod hash;
mod image;
mod io;
pub mod kdf;
pub mod keyslot_area;
pub mod luks1;

pub use error::{LuksError, Result};
pub use hash::HashAlg;
pub use image::LuksImage;
mod options;
pub use options::{FormatOptions, LuksVersion, PbkdfKind, PbkdfOptions, UnlockOptions};
pub mod luks2;
