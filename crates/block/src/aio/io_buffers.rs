//! `IoBuffers`: the memory of one request, as a value that keeps that memory alive.
//!
//! A request's data lives in memory the daemon does not own in the Rust sense: a guest's RAM
//! (mapped from the VMM's memory table, which the VMM may replace at any time), or a buffer a
//! frontend lent. The kernel and the cipher reach it through raw addresses ([`IoVec`]s), never
//! through a Rust reference. What makes those addresses valid is held here, once, instead of
//! being argued at every layer a request passes: an `IoBuffers` is an `Arc` of the memory's
//! owner ([`MemoryOwner`]: a guest memory table snapshot, an [`OwnedBuffer`]) plus the
//! iovecs, each checked against that owner when it was added. The pipeline keeps a copy of the
//! value (an `Arc` clone and the slot's reused list) from `push` until the completion is
//! handed out, so a memory table swap in between cannot unmap what a request still uses, and
//! the queue's traits are safe to call.
//!
//! Memory without an owner (a stage's bounce buffer, an NBD connection's payload buffer) can be
//! added with the `unsafe` [`IoBuffers::add_raw`]: its caller promises the lifetime instead.

use super::IoVec;
use crate::AlignedBuf;
use cryptblk_crypto::RawSectors;
use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

/// Memory requests may use: a guest's RAM as mapped from the VMM's memory table, a buffer of
/// the daemon's own. Addresses are the owner's own (a guest physical address, an offset into
/// a buffer); `locate` turns them into process addresses after checking them.
///
/// # Safety
/// Where `locate(addr, len)` returns `Some(p)`, the `len` bytes at `p` must be mapped, valid for
/// reads and writes from any thread, and stay so for as long as the owner lives (so an `Arc` of
/// it keeps them valid); and while an `Arc` of the owner is shared, nothing may hold a Rust
/// reference to those bytes (other parties, a guest, writing them concurrently only changes the
/// data a request transfers).
pub unsafe trait MemoryOwner: Send + Sync + 'static {
    /// The process address of the `len` bytes at `addr`, or `None` where any of them lies
    /// outside the memory (or the range spans two separate mappings).
    fn locate(&self, addr: u64, len: usize) -> Option<NonNull<u8>>;
}

/// A range a request names lies outside the memory it was checked against: a malicious or
/// broken descriptor, or a memory table that changed under it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum BufferError {
    #[error("buffer of {len} bytes at {addr:#x} lies outside the request's memory")]
    OutOfBounds { addr: u64, len: usize },
    #[error(
        "buffer of {len} bytes at {addr:#x} added to request buffers that have no memory owner"
    )]
    NoOwner { addr: u64, len: usize },
}

/// The buffers of one request: the owner of their memory and the checked iovecs. Reused from
/// request to request (`clear`, `set_owner`, `add`), so building one allocates nothing in
/// steady state.
#[derive(Default, Clone)]
pub struct IoBuffers {
    owner: Option<Arc<dyn MemoryOwner>>,
    iov: Vec<IoVec>,
}

/// A request with no data (flush, discard, write zeroes).
pub(crate) static NO_BUFFERS: IoBuffers = IoBuffers::new();

impl IoBuffers {
    /// No memory and no buffers.
    pub const fn new() -> Self {
        IoBuffers {
            owner: None,
            iov: Vec::new(),
        }
    }

    /// Empty, with room for `n` iovecs before it allocates.
    pub fn with_capacity(n: usize) -> Self {
        IoBuffers {
            owner: None,
            iov: Vec::with_capacity(n),
        }
    }

    /// All of `owner`'s `len` bytes from address 0 as one buffer (an [`OwnedBuffer`]).
    pub fn whole(owner: Arc<dyn MemoryOwner>, len: usize) -> Result<Self, BufferError> {
        let mut buffers = IoBuffers::with_capacity(1);
        buffers.set_owner(owner);
        buffers.add(0, len)?;
        Ok(buffers)
    }

    /// Lets go of the memory and the buffers (keeping the list's storage).
    pub fn clear(&mut self) {
        self.owner = None;
        self.iov.clear();
    }

    /// Empties the list, keeping the owner (for the next request in the same memory).
    pub fn clear_list(&mut self) {
        self.iov.clear();
    }

    /// Empties the list and makes `owner` the memory later `add`s are checked against.
    pub fn set_owner(&mut self, owner: Arc<dyn MemoryOwner>) {
        self.iov.clear();
        self.owner = Some(owner);
    }

    /// Appends the `len` bytes at `addr` of the owner's memory, after checking they lie in it.
    /// An empty range is skipped.
    pub fn add(&mut self, addr: u64, len: usize) -> Result<(), BufferError> {
        if len == 0 {
            return Ok(());
        }
        let owner = self
            .owner
            .as_ref()
            .ok_or(BufferError::NoOwner { addr, len })?;
        let base = owner
            .locate(addr, len)
            .ok_or(BufferError::OutOfBounds { addr, len })?;
        self.iov.push(IoVec::from_raw(base.as_ptr(), len));
        Ok(())
    }

    /// Appends `len` bytes at `base`, memory no owner vouches for.
    ///
    /// # Safety
    /// The bytes must be valid for reads and writes, with no Rust reference to them, from now
    /// until every request this value (or a copy of it) is pushed with has had its completion
    /// handed out by its queue's `drain` (or the queue is dropped), and for as long as this
    /// value and its copies are used otherwise (an engine's `start`, an `Offload`).
    pub unsafe fn add_raw(&mut self, base: *mut u8, len: usize) {
        self.iov.push(IoVec::from_raw(base, len));
    }

    /// Becomes a copy of `other` (an `Arc` clone and the list copied into this one's storage).
    pub fn copy_from(&mut self, other: &IoBuffers) {
        self.owner.clone_from(&other.owner);
        self.iov.clear();
        self.iov.extend_from_slice(&other.iov);
    }

    /// The checked buffers, for a system call or a cipher. Every one is valid for reads and
    /// writes while this value lives (see the module doc).
    pub fn iov(&self) -> &[IoVec] {
        &self.iov
    }

    /// Each buffer as a run of bytes for a cipher to transform in place (decryption into the
    /// request's memory), while this value is borrowed.
    pub fn raw_in_place(&self) -> impl Iterator<Item = RawSectors<'_>> + '_ {
        self.iov.iter().map(|v| {
            // SAFETY: every buffer is valid for reads and writes while this value lives (its
            // owner's `locate` contract, held by the `Arc`; or `add_raw`'s contract), and no
            // Rust reference reaches it; the borrow of `self` bounds the value's lifetime.
            unsafe { RawSectors::in_place(v.base(), v.len()) }
        })
    }

    /// Each buffer as the source of a run a cipher writes into the next bytes of `out`
    /// (encryption from the request's memory into one contiguous buffer), leaving the buffers
    /// as they are; `None` when `out` is shorter than `len()`.
    pub fn raw_into<'a>(
        &'a self,
        out: &'a mut [u8],
    ) -> Option<impl Iterator<Item = RawSectors<'a>> + 'a> {
        if (out.len() as u64) < self.len() {
            return None;
        }
        let mut rest = out;
        Some(self.iov.iter().map(move |v| {
            let (piece, tail) = std::mem::take(&mut rest).split_at_mut(v.len());
            rest = tail;
            // SAFETY: the buffer is valid for reads while this value lives (as in
            // `raw_in_place`); `piece` is an exclusive borrow of as many bytes for `'a`, used
            // only through this value, and cannot overlap the buffer, which no Rust reference
            // reaches.
            unsafe { RawSectors::new(v.base(), piece.as_mut_ptr(), v.len()) }
        }))
    }

    /// Total bytes.
    pub fn len(&self) -> u64 {
        super::iov_len(&self.iov)
    }

    pub fn is_empty(&self) -> bool {
        self.iov.iter().all(IoVec::is_empty)
    }
}

impl fmt::Debug for IoBuffers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IoBuffers")
            .field("owned", &self.owner.is_some())
            .field("iov", &self.iov)
            .finish()
    }
}

/// A heap buffer requests can own, aligned for direct I/O: a frontend's or tool's data in
/// flight. Its bytes are reachable only through `&mut self`, so only while no request holds
/// it (`Arc::get_mut` on the frontend's handle after the completion was handed out).
pub struct OwnedBuffer(AlignedBuf);

impl OwnedBuffer {
    /// `len` zero bytes.
    pub fn zeroed(len: usize) -> Self {
        OwnedBuffer(AlignedBuf::zeroed(len))
    }

    /// A buffer holding a copy of `data`.
    pub fn from_bytes(data: &[u8]) -> Self {
        let mut buf = OwnedBuffer::zeroed(data.len());
        buf.bytes_mut()[..data.len()].copy_from_slice(data);
        buf
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The bytes (exclusive access: no request holds this buffer).
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.0
    }
}

// SAFETY: the bytes are this value's own allocation, freed only when it drops; `locate` checks
// the range lies inside it. References to the bytes need `&mut self`, which an `Arc` shared
// with a request cannot give.
unsafe impl MemoryOwner for OwnedBuffer {
    fn locate(&self, addr: u64, len: usize) -> Option<NonNull<u8>> {
        let start = usize::try_from(addr).ok()?;
        let end = start.checked_add(len)?;
        if end > self.0.len() {
            return None;
        }
        // SAFETY: start <= end <= len: inside (or one past the end of) the allocation.
        Some(unsafe { self.0.base().add(start) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cryptblk_crypto::Direction;

    #[test]
    fn ranges_inside_the_owner_are_located() {
        let owner: Arc<dyn MemoryOwner> = Arc::new(OwnedBuffer::zeroed(8192));
        let mut buffers = IoBuffers::new();
        buffers.set_owner(owner.clone());
        buffers.add(0, 4096).unwrap();
        buffers.add(4096, 4096).unwrap();
        buffers.add(100, 0).unwrap();
        assert_eq!(buffers.iov().len(), 2);
        assert_eq!(buffers.len(), 8192);
        let base = owner.locate(0, 1).unwrap().as_ptr();
        assert_eq!(buffers.iov()[1].base(), base.wrapping_add(4096));
    }

    #[test]
    fn a_range_outside_the_owner_is_refused() {
        let mut buffers = IoBuffers::new();
        buffers.set_owner(Arc::new(OwnedBuffer::zeroed(4096)));
        for (addr, len) in [
            (4096, 1),
            (4095, 2),
            (0, 4097),
            (u64::MAX, 1),
            (1 << 40, 512),
        ] {
            assert_eq!(
                buffers.add(addr, len),
                Err(BufferError::OutOfBounds { addr, len }),
                "{addr:#x}+{len}"
            );
        }
        assert!(buffers.iov().is_empty(), "a refused range adds nothing");
        let mut unowned = IoBuffers::new();
        assert_eq!(
            unowned.add(0, 1),
            Err(BufferError::NoOwner { addr: 0, len: 1 })
        );
    }

    #[test]
    fn ciphers_reach_each_buffer_in_place_or_into_one_contiguous_output() {
        let spec = cryptblk_crypto::CipherSpec::parse_luks2("aes-xts-plain64", 64).unwrap();
        let key = cryptblk_crypto::SecretKey::new(vec![3u8; 64]);
        let cipher = cryptblk_crypto::portable_engine()
            .new_cipher(&spec, &key, 512)
            .unwrap();
        let plain: Vec<u8> = (0..3072u32).map(|i| (i * 7 % 251) as u8).collect();
        let mut want = plain.clone();
        cipher.crypt(Direction::Encrypt, 9, &mut want).unwrap();

        // Two buffers out of order in the owner's memory: 1 KiB at 2048, 2 KiB at 0.
        let mut memory = plain[1024..].to_vec();
        memory.extend_from_slice(&plain[..1024]);
        let owner = Arc::new(OwnedBuffer::from_bytes(&memory));
        let mut buffers = IoBuffers::new();
        buffers.set_owner(owner.clone());
        buffers.add(2048, 1024).unwrap();
        buffers.add(0, 2048).unwrap();

        let mut out = vec![0u8; 3072 + 512];
        assert!(buffers.raw_into(&mut out[..3071]).is_none(), "too short");
        let mut sector = 9;
        for run in buffers.raw_into(&mut out).unwrap() {
            let n = run.len() as u64 / 512;
            cipher.crypt_raw(Direction::Encrypt, sector, run).unwrap();
            sector += n;
        }
        assert!(out[..3072] == want[..], "encrypted in request order");
        assert!(
            out[3072..].iter().all(|&b| b == 0),
            "nothing past the request"
        );

        let mut sector = 9;
        for run in buffers.raw_in_place() {
            assert!(run.is_in_place());
            let n = run.len() as u64 / 512;
            cipher.crypt_raw(Direction::Encrypt, sector, run).unwrap();
            sector += n;
        }
        drop(buffers);
        let mut owner = Arc::into_inner(owner).expect("the buffers let go of the memory");
        let mut got = owner.bytes_mut()[2048..].to_vec();
        got.extend_from_slice(&owner.bytes_mut()[..2048]);
        assert!(got == want, "encrypted in place, each buffer where it lies");
    }

    #[test]
    fn a_copy_keeps_the_memory_alive_and_clear_lets_go() {
        let buf = Arc::new(OwnedBuffer::zeroed(4096));
        let mut buffers = IoBuffers::whole(buf.clone(), 4096).unwrap();
        let mut copy = IoBuffers::new();
        copy.copy_from(&buffers);
        assert_eq!(Arc::strong_count(&buf), 3);
        assert_eq!(copy.iov()[0].base(), buffers.iov()[0].base());
        buffers.clear();
        copy.clear();
        assert_eq!(Arc::strong_count(&buf), 1, "cleared buffers hold no memory");
    }
}
