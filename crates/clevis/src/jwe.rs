//! The JWE half of the tang pin: the content key from the ECDH-ES shared secret (Concat KDF,
//! RFC 7518 4.6 with direct key agreement) and the AES-GCM decryption of the payload.
use crate::error::{Result, TokenError};
use crate::jose::FlattenedJwe;
use openssl::symm::{decrypt_aead, Cipher};
use zeroize::Zeroizing;

/// Key bytes of a JWE content encryption (`enc`) cryptblk supports.
pub(crate) fn key_len(enc: &str) -> Result<usize> {
    match enc {
        "A128GCM" => Ok(16),
        "A192GCM" => Ok(24),
        "A256GCM" => Ok(32),
        other => Err(TokenError::Unsupported(format!(
            "JWE content encryption \"{other}\" (clevis uses A256GCM)"
        ))),
    }
}

/// The content key of a direct ECDH-ES JWE: Concat KDF with SHA-256 over the shared secret
/// `z`, AlgorithmID = `enc`, PartyUInfo = `apu`, PartyVInfo = `apv`, SuppPubInfo = the key
/// length in bits (each info field prefixed with its 32-bit big-endian length).
pub(crate) fn concat_kdf(
    z: &[u8],
    enc: &str,
    apu: &[u8],
    apv: &[u8],
) -> Result<Zeroizing<Vec<u8>>> {
    let len = key_len(enc)?;
    let mut key = Zeroizing::new(Vec::with_capacity(len + 32));
    let mut round: u32 = 1;
    while key.len() < len {
        let mut h = openssl::sha::Sha256::new();
        h.update(&round.to_be_bytes());
        h.update(z);
        for info in [enc.as_bytes(), apu, apv] {
            h.update(&(info.len() as u32).to_be_bytes());
            h.update(info);
        }
        h.update(&((len * 8) as u32).to_be_bytes());
        key.extend_from_slice(Zeroizing::new(h.finish()).as_slice());
        round += 1;
    }
    key.truncate(len);
    Ok(key)
}

/// Decrypts the payload with `cek`. `Ok(None)` when the tag does not verify (the key is not
/// the one the token was sealed with).
pub(crate) fn decrypt(
    jwe: &FlattenedJwe,
    enc: &str,
    cek: &[u8],
) -> Result<Option<Zeroizing<Vec<u8>>>> {
    let cipher = match key_len(enc)? {
        16 => Cipher::aes_128_gcm(),
        24 => Cipher::aes_192_gcm(),
        _ => Cipher::aes_256_gcm(),
    };
    // RFC 7516 5.2 step 14: the AAD is the protected header's base64url text as stored,
    // then "." and the `aad` member when there is one.
    let mut aad = jwe.protected.clone().into_bytes();
    if let Some(extra) = &jwe.aad {
        aad.push(b'.');
        aad.extend_from_slice(extra.as_bytes());
    }
    match decrypt_aead(cipher, cek, Some(&jwe.iv), &aad, &jwe.ciphertext, &jwe.tag) {
        Ok(plain) => Ok(Some(Zeroizing::new(plain))),
        Err(_) => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RFC 7518 appendix C: ECDH-ES with enc A128GCM, apu "Alice", apv "Bob".
    #[test]
    fn concat_kdf_matches_rfc7518_appendix_c() {
        let z = [
            158, 86, 217, 29, 129, 113, 53, 211, 114, 131, 66, 131, 191, 132, 38, 156, 251, 49,
            110, 163, 218, 128, 106, 72, 246, 218, 167, 121, 140, 254, 144, 196,
        ];
        let key = concat_kdf(&z, "A128GCM", b"Alice", b"Bob").unwrap();
        assert_eq!(
            key.as_slice(),
            [86, 170, 141, 234, 248, 35, 109, 32, 92, 34, 40, 205, 113, 167, 16, 26]
        );
    }

    #[test]
    fn unknown_enc_is_unsupported() {
        assert!(matches!(
            concat_kdf(&[0; 32], "A256CBC-HS512", b"", b""),
            Err(TokenError::Unsupported(_))
        ));
    }
}
