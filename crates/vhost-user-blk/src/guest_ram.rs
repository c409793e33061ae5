//! Guest memory as the owner of requests' buffers (`MemoryOwner`): the one place where a
//! guest-physical range named by a descriptor becomes a process address.
//!
//! A `GuestRam` holds one snapshot of the memory table (`GuestMemoryMmap`, whose regions stay
//! mapped as long as it lives). A request's `IoBuffers` keep an `Arc` of it until the I/O queue
//! hands the completion out, so a memory table the frontend replaces meanwhile stays mapped
//! for the requests still using it, and is unmapped when the last of them completes.

use std::ptr::NonNull;
use std::sync::Arc;

use cryptblk_block::aio::MemoryOwner;
use vm_memory::bitmap::Bitmap;
use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryMmap};

/// One snapshot of a guest's memory table, as the owner of request buffers.
pub struct GuestRam<B: Bitmap + 'static>(Arc<GuestMemoryMmap<B>>);

impl<B: Bitmap + Send + Sync + 'static> GuestRam<B> {
    /// The owner of buffers in `mem` (one allocation per memory table, not per request).
    pub fn owner(mem: Arc<GuestMemoryMmap<B>>) -> Arc<dyn MemoryOwner> {
        Arc::new(GuestRam(mem))
    }
}

// SAFETY: `get_slice` succeeds only for a range inside one region of the snapshot, and the
// snapshot's regions stay mapped read-write (vhost-user maps the frontend's memory fds
// PROT_READ | PROT_WRITE) for as long as it lives, which this value's `Arc` ensures. This
// process reaches guest memory only through vm-memory's volatile accessors and raw pointers,
// never a Rust reference; the guest writing it concurrently only changes the data.
unsafe impl<B: Bitmap + Send + Sync + 'static> MemoryOwner for GuestRam<B> {
    fn locate(&self, addr: u64, len: usize) -> Option<NonNull<u8>> {
        let slice = self.0.get_slice(GuestAddress(addr), len).ok()?;
        NonNull::new(slice.ptr_guard_mut().as_ptr())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cryptblk_block::aio::{BufferError, IoBuffers};

    fn two_regions() -> Arc<GuestMemoryMmap<()>> {
        let ranges = [(GuestAddress(0), 0x10000), (GuestAddress(0x20000), 0x10000)];
        Arc::new(GuestMemoryMmap::<()>::from_ranges(&ranges).unwrap())
    }

    #[test]
    fn descriptors_inside_a_region_become_its_addresses() {
        let mem = two_regions();
        let mut buffers = IoBuffers::new();
        buffers.set_owner(GuestRam::owner(mem.clone()));
        buffers.add(0x1000, 0x2000).unwrap();
        buffers.add(0x2f000, 0x1000).unwrap();
        let host = mem.get_host_address(GuestAddress(0x2f000)).unwrap();
        assert_eq!(buffers.iov()[1].base(), host);
        assert_eq!(buffers.len(), 0x3000);
    }

    #[test]
    fn a_malicious_descriptor_gets_an_error_not_a_mapping() {
        let mut buffers = IoBuffers::new();
        buffers.set_owner(GuestRam::owner(two_regions()));
        // In the hole between the regions, across a region's end, past the end of memory, and
        // wrapping the address space.
        for (addr, len) in [
            (0x10000, 0x1000),
            (0xf000, 0x2000),
            (0x2f000, 0x1001),
            (0x40000, 512),
            (u64::MAX - 10, 512),
        ] {
            assert_eq!(
                buffers.add(addr, len),
                Err(BufferError::OutOfBounds { addr, len }),
                "{addr:#x}+{len:#x}"
            );
        }
        assert!(buffers.iov().is_empty());
    }

    #[test]
    fn buffers_keep_a_replaced_memory_table_mapped() {
        let mem = two_regions();
        let mut buffers = IoBuffers::new();
        buffers.set_owner(GuestRam::owner(mem.clone()));
        buffers.add(0, 4096).unwrap();
        let table = Arc::downgrade(&mem);
        // The frontend replaces the table: the message thread lets go of the old snapshot.
        drop(mem);
        assert!(table.upgrade().is_some(), "a buffer's memory was unmapped");
        buffers.clear();
        assert!(table.upgrade().is_none());
    }
}
