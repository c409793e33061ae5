//! Portable engine on RustCrypto `aes` (which itself picks AES-NI/VAES at run time), our
//! batched XTS (`xts.rs`) and `cbc`. Supports every spec the parser accepts that AES can express,
//! including AES-192-XTS, which OpenSSL lacks.

use super::xts::Xts;
use super::{check_run, check_sector_size};
use crate::iv::IvGen;
use crate::{CipherSpec, CryptoError, Direction, Engine, Mode, SecretKey, SectorCipher};
use aes::cipher::array::Array;
use aes::cipher::{
    BlockCipherDecrypt, BlockCipherEncrypt, BlockModeDecrypt, BlockModeEncrypt, InnerIvInit,
    KeyInit,
};
use aes::{Aes128, Aes192, Aes256};
use std::sync::Arc;

pub(crate) const NAME: &str = "rustcrypto";

pub(crate) struct RustCryptoEngine;

impl Engine for RustCryptoEngine {
    fn name(&self) -> &'static str {
        NAME
    }

    fn supports(&self, spec: &CipherSpec) -> bool {
        crate::iv::check_supported(spec).is_ok()
    }

    fn new_cipher(
        &self,
        spec: &CipherSpec,
        key: &SecretKey,
        sector_size: usize,
    ) -> Result<Arc<dyn SectorCipher>, CryptoError> {
        check_sector_size(sector_size)?;
        check_key_len(spec, key)?;
        let iv = IvGen::new(spec, key, sector_size)?;
        let k = key.as_bytes();
        let core = match spec.mode() {
            Mode::Xts => {
                let (k1, k2) = k.split_at(k.len() / 2);
                match k1.len() {
                    16 => Core::Xts128(Xts::new(aes_key(k1)?, aes_key(k2)?)),
                    24 => Core::Xts192(Xts::new(aes_key(k1)?, aes_key(k2)?)),
                    _ => Core::Xts256(Xts::new(aes_key(k1)?, aes_key(k2)?)),
                }
            }
            Mode::Cbc => match k.len() {
                16 => Core::Cbc128(aes_key(k)?),
                24 => Core::Cbc192(aes_key(k)?),
                _ => Core::Cbc256(aes_key(k)?),
            },
        };
        Ok(Arc::new(RustCryptoCipher {
            core,
            iv,
            sector_size,
        }))
    }
}

/// The spec carries the expected key length; the key handed in must match it exactly.
pub(crate) fn check_key_len(spec: &CipherSpec, key: &SecretKey) -> Result<(), CryptoError> {
    if key.len() == spec.key_bytes() {
        Ok(())
    } else {
        Err(CryptoError::InvalidKeySize {
            bits: key.len() * 8,
            spec: spec.to_luks2_string(),
            expected: "the key size named by the cipher spec",
        })
    }
}

fn aes_key<C: KeyInit>(k: &[u8]) -> Result<C, CryptoError> {
    C::new_from_slice(k).map_err(|_| CryptoError::Engine {
        engine: NAME,
        message: format!("AES rejected a {}-byte key", k.len()),
    })
}

/// One variant per key size keeps dispatch static inside the per-sector loops.
enum Core {
    Xts128(Xts<Aes128>),
    Xts192(Xts<Aes192>),
    Xts256(Xts<Aes256>),
    Cbc128(Aes128),
    Cbc192(Aes192),
    Cbc256(Aes256),
}

struct RustCryptoCipher {
    core: Core,
    iv: IvGen,
    sector_size: usize,
}

impl SectorCipher for RustCryptoCipher {
    fn sector_size(&self) -> usize {
        self.sector_size
    }

    fn engine_name(&self) -> &'static str {
        NAME
    }

    fn crypt(&self, dir: Direction, first_sector: u64, data: &mut [u8]) -> Result<(), CryptoError> {
        check_run(self.sector_size, data.len())?;
        match &self.core {
            Core::Xts128(x) => xts(x, &self.iv, dir, first_sector, data, self.sector_size),
            Core::Xts192(x) => xts(x, &self.iv, dir, first_sector, data, self.sector_size),
            Core::Xts256(x) => xts(x, &self.iv, dir, first_sector, data, self.sector_size),
            Core::Cbc128(c) => cbc(c, &self.iv, dir, first_sector, data, self.sector_size),
            Core::Cbc192(c) => cbc(c, &self.iv, dir, first_sector, data, self.sector_size),
            Core::Cbc256(c) => cbc(c, &self.iv, dir, first_sector, data, self.sector_size),
        }
        Ok(())
    }
}

fn xts<C>(x: &Xts<C>, iv: &IvGen, dir: Direction, first: u64, data: &mut [u8], sector_size: usize)
where
    C: BlockCipherEncrypt
        + BlockCipherDecrypt
        + aes::cipher::BlockSizeUser<BlockSize = aes::cipher::consts::U16>,
{
    x.crypt_sectors(dir, data, sector_size, |i| {
        iv.iv(first.wrapping_add(i as u64))
    });
}

fn cbc<C>(c: &C, iv: &IvGen, dir: Direction, first: u64, data: &mut [u8], sector_size: usize)
where
    C: BlockCipherEncrypt
        + BlockCipherDecrypt
        + aes::cipher::BlockSizeUser<BlockSize = aes::cipher::consts::U16>,
{
    for (i, sector) in data.chunks_exact_mut(sector_size).enumerate() {
        let sector_iv = Array(iv.iv(first.wrapping_add(i as u64)));
        // Sector sizes are multiples of 16, so there is never a partial block left over.
        let (blocks, _) = Array::slice_as_chunks_mut(sector);
        match dir {
            Direction::Encrypt => {
                cbc::Encryptor::<&C>::inner_iv_init(c, &sector_iv).encrypt_blocks(blocks)
            }
            Direction::Decrypt => {
                cbc::Decryptor::<&C>::inner_iv_init(c, &sector_iv).decrypt_blocks(blocks)
            }
        }
    }
}
