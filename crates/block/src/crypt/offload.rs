//! The volume's crypto as work for the backend's pool threads (`aio::Offload`): with the
//! `threads` engine, each request is decrypted or encrypted by the thread that read or writes
//! it, so the crypto of a batch runs on as many threads as its transfers do.

use super::{crypto_error, CryptCore};
use crate::aio::{IoVec, Offload};
use crate::BlockError;
use cryptblk_crypto::Direction;
use std::sync::Arc;

pub(super) struct VolumeCrypto(pub(super) Arc<CryptCore>);

impl VolumeCrypto {
    /// The payload offset of backend offset `offset`.
    fn payload_offset(&self, offset: u64) -> u64 {
        offset - self.0.layout.data_offset
    }
}

impl Offload for VolumeCrypto {
    unsafe fn after_read(&self, offset: u64, iov: &[IoVec]) -> Result<(), BlockError> {
        let core = &*self.0;
        let mut off = self.payload_offset(offset);
        for v in iov {
            // SAFETY: the segment is valid for reads and writes (this function's contract)
            // and is transformed in place; the crypt queue only passes whole sectors.
            unsafe {
                core.pool.crypt_raw(
                    &core.cipher,
                    Direction::Decrypt,
                    core.iv_sector(off),
                    v.base(),
                    v.base(),
                    v.len(),
                )
            }
            .map_err(|e| crypto_error(Direction::Decrypt, off, e))?;
            off += v.len() as u64;
        }
        Ok(())
    }

    unsafe fn before_write(
        &self,
        offset: u64,
        iov: &[IoVec],
        out: *mut u8,
    ) -> Result<(), BlockError> {
        let core = &*self.0;
        let start = self.payload_offset(offset);
        let mut pos = 0usize;
        for v in iov {
            let off = start + pos as u64;
            // SAFETY: the segment is readable and `out + pos` is writable for its length,
            // disjoint from it (this function's contract: `out` holds the whole request).
            unsafe {
                core.pool.crypt_raw(
                    &core.cipher,
                    Direction::Encrypt,
                    core.iv_sector(off),
                    v.base(),
                    out.add(pos),
                    v.len(),
                )
            }
            .map_err(|e| crypto_error(Direction::Encrypt, off, e))?;
            pos += v.len();
        }
        Ok(())
    }
}
