//! LUKS images for tests that are about something other than the key derivation.

use std::path::Path;

use cryptblk_crypto::{CipherSpec, SecretKey};
use cryptblk_luks::{FormatOptions, HashAlg, LuksImage, PbkdfOptions};

/// Creates `path` (which must not exist) as a LUKS2 image: aes-xts-plain64 with a 512-bit key,
/// `sector_size`-byte encryption sectors, `payload` bytes of payload, and one keyslot for
/// `passphrase` whose PBKDF2 takes 1000 iterations, so opening it costs next to nothing.
/// Returns the header and the volume key, as `LuksImage::format` does.
pub fn cheap_luks2(
    path: &Path,
    passphrase: &[u8],
    payload: u64,
    sector_size: u32,
) -> (LuksImage, SecretKey) {
    let options = FormatOptions {
        pbkdf: PbkdfOptions::pbkdf2_iterations(HashAlg::Sha256, 1000),
        ..FormatOptions::luks2(
            CipherSpec::parse_luks2("aes-xts-plain64", 64).unwrap(),
            sector_size,
        )
    };
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(path)
        .unwrap_or_else(|e| panic!("cannot create {}: {e}", path.display()));
    LuksImage::format(&file, &options, passphrase, Some(payload)).unwrap()
}
