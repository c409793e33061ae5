//! virtio-blk requests as a guest driver builds them: header, data and status descriptors in
//! the queue's data area, with the layouts of virtio-bindings' `virtio_blk` structures.

use std::mem::{offset_of, size_of};

use virtio_bindings::virtio_blk::{
    virtio_blk_discard_write_zeroes, virtio_blk_outhdr, VIRTIO_BLK_ID_BYTES, VIRTIO_BLK_T_DISCARD,
    VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT, VIRTIO_BLK_T_WRITE_ZEROES,
};
use vm_memory::{Address, Bytes, GuestAddress};

use super::guest::{Guest, DATA_BASE, DATA_PER_QUEUE};
use super::ring::Desc;
use super::S_OK;

const HEADER_LEN: u32 = size_of::<virtio_blk_outhdr>() as u32;
const RANGE_LEN: u32 = size_of::<virtio_blk_discard_write_zeroes>() as u32;

impl Guest {
    /// Allocates a zeroed buffer in queue `q`'s data area.
    pub fn alloc(&mut self, q: usize, len: u32) -> GuestAddress {
        let tq = &mut self.queues[q];
        let start = DATA_BASE + q as u64 * DATA_PER_QUEUE;
        let len64 = (u64::from(len) + 15) & !15;
        if tq.data_next + len64 > start + DATA_PER_QUEUE {
            tq.data_next = start;
        }
        let addr = GuestAddress(tq.data_next);
        tq.data_next += len64.max(16);
        self.mem
            .write_slice(&vec![0u8; len as usize], addr)
            .unwrap();
        addr
    }

    /// A request header of type `kind` for `sector`.
    pub fn header(&mut self, q: usize, kind: u32, sector: u64) -> GuestAddress {
        let addr = self.alloc(q, HEADER_LEN);
        let field = |offset: usize| addr.unchecked_add(offset as u64);
        self.mem
            .write_obj(kind.to_le(), field(offset_of!(virtio_blk_outhdr, type_)))
            .unwrap();
        self.mem
            .write_obj(sector.to_le(), field(offset_of!(virtio_blk_outhdr, sector)))
            .unwrap();
        addr
    }

    /// A one-byte status buffer holding 0xff (no status value), so a test sees whether the
    /// device wrote it.
    pub fn status_buf(&mut self, q: usize) -> GuestAddress {
        let addr = self.alloc(q, 1);
        self.mem.write_obj(0xffu8, addr).unwrap();
        addr
    }

    pub fn status(&self, addr: GuestAddress) -> u8 {
        self.mem.read_obj(addr).unwrap()
    }

    /// Builds an OUT request (header, data split into `seg` byte pieces, status) without
    /// submitting it.
    pub fn out_chain(
        &mut self,
        q: usize,
        sector: u64,
        data: &[u8],
        seg: usize,
    ) -> (Vec<Desc>, GuestAddress) {
        let mut descs = vec![self.header_desc(q, VIRTIO_BLK_T_OUT, sector)];
        for chunk in data.chunks(seg) {
            let addr = self.alloc(q, chunk.len() as u32);
            self.mem.write_slice(chunk, addr).unwrap();
            descs.push(Desc {
                addr,
                len: chunk.len() as u32,
                write: false,
            });
        }
        let status = self.status_buf(q);
        descs.push(status_desc(status));
        (descs, status)
    }

    /// Builds an IN request for `len` bytes in `seg` byte pieces.
    pub fn in_chain(
        &mut self,
        q: usize,
        sector: u64,
        len: usize,
        seg: usize,
    ) -> (Vec<Desc>, GuestAddress) {
        let mut descs = vec![self.header_desc(q, VIRTIO_BLK_T_IN, sector)];
        let mut left = len;
        while left > 0 {
            let n = left.min(seg) as u32;
            let addr = self.alloc(q, n);
            descs.push(Desc {
                addr,
                len: n,
                write: true,
            });
            left -= n as usize;
        }
        let status = self.status_buf(q);
        descs.push(status_desc(status));
        (descs, status)
    }

    /// Concatenated contents of the data descriptors of a chain (between header and status).
    pub fn data_of(&self, descs: &[Desc]) -> Vec<u8> {
        let mut out = Vec::new();
        for d in &descs[1..descs.len() - 1] {
            let mut buf = vec![0u8; d.len as usize];
            self.mem.read_slice(&mut buf, d.addr).unwrap();
            out.extend_from_slice(&buf);
        }
        out
    }

    pub fn write(&mut self, q: usize, sector: u64, data: &[u8]) -> u8 {
        let (descs, s) = self.out_chain(q, sector, data, 4096);
        let used = self.run(q, &descs);
        assert_eq!(used, 1);
        self.status(s)
    }

    pub fn read(&mut self, q: usize, sector: u64, len: usize) -> (u8, Vec<u8>) {
        let (descs, s) = self.in_chain(q, sector, len, 4096);
        let used = self.run(q, &descs);
        let status = self.status(s);
        if status == S_OK {
            assert_eq!(used as usize, len + 1);
        }
        (status, self.data_of(&descs))
    }

    /// A request with only header and status.
    pub fn simple(&mut self, q: usize, kind: u32, sector: u64) -> u8 {
        let header = self.header_desc(q, kind, sector);
        let status = self.status_buf(q);
        self.run(q, &[header, status_desc(status)]);
        self.status(status)
    }

    /// A WRITE_ZEROES request with one range.
    pub fn write_zeroes(&mut self, q: usize, sector: u64, num_sectors: u32, flags: u32) -> u8 {
        self.range_request(q, VIRTIO_BLK_T_WRITE_ZEROES, sector, num_sectors, flags)
    }

    /// A DISCARD request with one range.
    pub fn discard(&mut self, q: usize, sector: u64, num_sectors: u32, flags: u32) -> u8 {
        self.range_request(q, VIRTIO_BLK_T_DISCARD, sector, num_sectors, flags)
    }

    /// GET_ID: (status, the 20-byte ID buffer).
    pub fn get_id(&mut self, q: usize) -> (u8, Vec<u8>) {
        let header = self.header_desc(q, VIRTIO_BLK_T_GET_ID, 0);
        let id = Desc {
            addr: self.alloc(q, VIRTIO_BLK_ID_BYTES),
            len: VIRTIO_BLK_ID_BYTES,
            write: true,
        };
        let status = self.status_buf(q);
        let descs = [header, id, status_desc(status)];
        let used = self.run(q, &descs);
        assert_eq!(used, VIRTIO_BLK_ID_BYTES + 1);
        (self.status(status), self.data_of(&descs))
    }

    /// A request of `kind` carrying one range (WRITE_ZEROES, DISCARD).
    fn range_request(
        &mut self,
        q: usize,
        kind: u32,
        sector: u64,
        num_sectors: u32,
        flags: u32,
    ) -> u8 {
        let header = self.header_desc(q, kind, 0);
        let range = self.alloc(q, RANGE_LEN);
        let field = |offset: usize| range.unchecked_add(offset as u64);
        type Range = virtio_blk_discard_write_zeroes;
        let mem = &self.mem;
        mem.write_obj(sector.to_le(), field(offset_of!(Range, sector)))
            .unwrap();
        mem.write_obj(num_sectors.to_le(), field(offset_of!(Range, num_sectors)))
            .unwrap();
        mem.write_obj(flags.to_le(), field(offset_of!(Range, flags)))
            .unwrap();
        let status = self.status_buf(q);
        let range = Desc {
            addr: range,
            len: RANGE_LEN,
            write: false,
        };
        let used = self.run(q, &[header, range, status_desc(status)]);
        assert_eq!(used, 1);
        self.status(status)
    }

    /// Publishes (without a kick) a write at `sector` of `segments` data segments of `len`
    /// bytes, every one the same guest memory at `data` (aliased descriptors in an indirect
    /// table): the largest request a guest may send from the least of its memory. Returns the
    /// address of its status byte.
    pub fn publish_aliased_write(
        &mut self,
        q: usize,
        sector: u64,
        data: GuestAddress,
        segments: usize,
        len: u32,
    ) -> GuestAddress {
        let mut descs = vec![self.header_desc(q, VIRTIO_BLK_T_OUT, sector)];
        descs.extend((0..segments).map(|_| Desc {
            addr: data,
            len,
            write: false,
        }));
        let status = self.status_buf(q);
        descs.push(status_desc(status));
        self.publish_indirect(q, &descs);
        status
    }

    fn header_desc(&mut self, q: usize, kind: u32, sector: u64) -> Desc {
        Desc {
            addr: self.header(q, kind, sector),
            len: HEADER_LEN,
            write: false,
        }
    }
}

fn status_desc(addr: GuestAddress) -> Desc {
    Desc {
        addr,
        len: 1,
        write: true,
    }
}
