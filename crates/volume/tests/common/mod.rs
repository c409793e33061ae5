//! What the volume's integration tests share: an image file as a container, and a LUKS image
//! formatted with a cheap key derivation.
#![allow(dead_code)]

use cryptblk_block::{Container, OpenOptions, RawFile};
use cryptblk_crypto::CipherSpec;
use cryptblk_luks::{FormatOptions, HashAlg, LuksImage, LuksVersion, PbkdfOptions};
use std::path::Path;
use std::sync::Arc;

/// The passphrase of every image `luks` formats.
pub const PW: &[u8] = b"correct horse";

/// PBKDF2 at 1000 iterations: a test's unlock takes no time.
pub fn cheap() -> PbkdfOptions {
    PbkdfOptions::pbkdf2_iterations(HashAlg::Sha256, 1000)
}

/// The image file at `path`, writable and locked.
pub fn container(path: &Path) -> Arc<dyn Container> {
    Arc::new(
        RawFile::open(
            path,
            OpenOptions {
                writable: true,
                lock: true,
            },
        )
        .unwrap(),
    )
}

/// Formats a new LUKS `version` image (AES-XTS, 512-byte sectors) at `path` with a payload
/// of `payload` bytes, opened by [`PW`].
pub fn luks(path: &Path, version: LuksVersion, payload: u64) {
    let cipher = CipherSpec::parse_luks2("aes-xts-plain64", 64).unwrap();
    let options = FormatOptions {
        version,
        pbkdf: cheap(),
        ..FormatOptions::luks2(cipher, 512)
    };
    let file = std::fs::File::create_new(path).unwrap();
    LuksImage::format(&file, &options, PW, Some(payload)).unwrap();
}
