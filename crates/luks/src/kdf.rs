//! Passphrase key derivation: the KDFs a keyslot can store (PBKDF2, argon2i/argon2id) and
//! deriving a key with one. Choosing a new keyslot's cost is `kdf_cost`.
use crate::{HashAlg, LuksError, Result};
use cryptblk_crypto::SecretKey;
use zeroize::Zeroizing;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Argon2Variant {
    Argon2i,
    Argon2id,
}

impl Argon2Variant {
    /// The name LUKS2 JSON uses ("argon2i" / "argon2id").
    pub fn name(self) -> &'static str {
        match self {
            Argon2Variant::Argon2i => "argon2i",
            Argon2Variant::Argon2id => "argon2id",
        }
    }
}

/// A fully specified KDF, as stored in a keyslot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kdf {
    Pbkdf2 {
        hash: HashAlg,
        iterations: u32,
    },
    Argon2 {
        variant: Argon2Variant,
        time: u32,
        memory_kib: u32,
        parallel: u32,
    },
}

/// cryptsetup's floors: fewer PBKDF2 iterations or argon2 passes than this are refused when
/// creating keyslots, whatever the benchmark says.
pub const MIN_PBKDF2_ITERATIONS: u32 = 1000;
pub const MIN_ARGON2_TIME: u32 = 4;
/// cryptsetup never lowers argon2 memory below this while benchmarking.
pub const MIN_ARGON2_MEMORY_KIB: u32 = 32;
/// cryptsetup's upper bounds for argon2 (4 GiB, 4 lanes is the default but 16 is accepted).
pub const MAX_ARGON2_MEMORY_KIB: u32 = 4 * 1024 * 1024;
pub const MAX_ARGON2_PARALLEL: u32 = 16;

/// Derive `out_len` bytes from `passphrase` and `salt`.
pub fn derive(kdf: &Kdf, passphrase: &[u8], salt: &[u8], out_len: usize) -> Result<SecretKey> {
    if out_len == 0 {
        return Err(LuksError::InvalidArgument(
            "KDF output length must not be zero".into(),
        ));
    }
    let mut out = Zeroizing::new(vec![0u8; out_len]);
    match *kdf {
        Kdf::Pbkdf2 { hash, iterations } => {
            if iterations == 0 {
                return Err(LuksError::InvalidArgument(
                    "PBKDF2 iteration count of zero".into(),
                ));
            }
            hash.pbkdf2(passphrase, salt, iterations, &mut out);
        }
        Kdf::Argon2 {
            variant,
            time,
            memory_kib,
            parallel,
        } => {
            argon2_into(
                variant, time, memory_kib, parallel, passphrase, salt, &mut out,
            )?;
        }
    }
    Ok(SecretKey::from_slice(&out))
}

pub(crate) fn argon2_into(
    variant: Argon2Variant,
    time: u32,
    memory_kib: u32,
    parallel: u32,
    passphrase: &[u8],
    salt: &[u8],
    out: &mut [u8],
) -> Result<()> {
    let bad = |e: argon2::Error| {
        LuksError::InvalidArgument(format!(
            "argon2 parameters rejected (time {time}, memory {memory_kib} KiB, parallel {parallel}): {e}"
        ))
    };
    let params = argon2::Params::new(memory_kib, time, parallel, Some(out.len())).map_err(bad)?;
    let algorithm = match variant {
        Argon2Variant::Argon2i => argon2::Algorithm::Argon2i,
        Argon2Variant::Argon2id => argon2::Algorithm::Argon2id,
    };
    argon2::Argon2::new(algorithm, argon2::Version::V0x13, params)
        .hash_password_into(passphrase, salt, out)
        .map_err(bad)
}
