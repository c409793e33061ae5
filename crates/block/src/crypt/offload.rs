//! The volume's crypto as work for the backend's pool threads (`aio::Offload`): with the
//! `threads` engine, each request is decrypted or encrypted by the thread that read or writes
//! it, so the crypto of a batch runs on as many threads as its transfers do.

use super::CryptCore;
use crate::aio::{IoVec, Offload};
use crate::BlockError;
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
        // SAFETY: forwarded (the segments are readable and writable, this function's
        // contract); the crypt queue only passes whole sectors.
        unsafe { self.0.decrypt_iov(self.payload_offset(offset), iov) }
    }

    unsafe fn before_write(
        &self,
        offset: u64,
        iov: &[IoVec],
        out: *mut u8,
    ) -> Result<(), BlockError> {
        // SAFETY: forwarded: `out` holds the whole request, disjoint from the segments.
        unsafe { self.0.encrypt_iov(self.payload_offset(offset), iov, out) }
    }
}
