//! The cipher a run writes, from `reencrypt-start`'s `cipher` and `key-size` and cryptsetup's
//! defaults; a reencryption and an encryption in place choose it alike.
use crate::error::{Error, Result};
use cryptblk_crypto::CipherSpec;

/// The cipher a reencryption writes: `name` (default: `current`'s, else aes-xts-plain64) with
/// a `bits`-bit key (default: the current size when no cipher is named, else 512 for XTS and
/// 256 for the others, as cryptsetup's defaults).
pub(super) fn chosen_cipher(
    name: Option<&str>,
    bits: Option<u32>,
    current: Option<&CipherSpec>,
) -> Result<CipherSpec> {
    let named = name.is_some();
    let name = name
        .map(str::to_string)
        .or_else(|| current.map(CipherSpec::to_luks2_string))
        .unwrap_or_else(|| "aes-xts-plain64".to_string());
    let bits = match (bits, current) {
        (Some(b), _) => b as usize,
        (None, Some(c)) if !named => c.key_bytes() * 8,
        (None, _) => CipherSpec::default_key_bits(&name)
            .map_err(|e| Error::caused(format!("cipher {name}"), e))?,
    };
    if !bits.is_multiple_of(8) {
        return Err(Error::invalid_params(format!(
            "key-size {bits} is not a whole number of bytes"
        )));
    }
    CipherSpec::parse_luks2(&name, bits / 8)
        .map_err(|e| Error::caused(format!("cipher {name} with a {bits}-bit key"), e))
}
