//! NBD wire numbers (the NBD project's doc/proto.md; big-endian on the wire) and bounded
//! readers for what the server sends.
use crate::Error;
use std::io::Read;

pub const NBD_MAGIC: u64 = 0x4e42_444d_4147_4943;
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
pub const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
pub const FLAG_NO_ZEROES: u16 = 1 << 1;

pub const OPT_GO: u32 = 7;
pub const OPT_STRUCTURED_REPLY: u32 = 8;
pub const OPT_SET_META_CONTEXT: u32 = 10;

pub const REP_ACK: u32 = 1;
pub const REP_INFO: u32 = 3;
pub const REP_META_CONTEXT: u32 = 4;
pub const REP_ERR: u32 = 1 << 31;

pub const INFO_EXPORT: u16 = 0;

pub const CMD_READ: u16 = 0;
pub const CMD_DISC: u16 = 2;
pub const CMD_BLOCK_STATUS: u16 = 7;

pub const REPLY_FLAG_DONE: u16 = 1 << 0;
pub const REPLY_TYPE_NONE: u16 = 0;
pub const REPLY_TYPE_OFFSET_DATA: u16 = 1;
pub const REPLY_TYPE_OFFSET_HOLE: u16 = 2;
pub const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
pub const REPLY_TYPE_ERROR_BIT: u16 = 1 << 15;
pub const REPLY_TYPE_ERROR_OFFSET: u16 = REPLY_TYPE_ERROR_BIT | 2;

/// The allocation context every server with block status offers.
pub const BASE_ALLOCATION: &str = "base:allocation";
/// `qemu:dirty-bitmap:NAME`: the extents of bitmap NAME (flag [`STATE_DIRTY`]).
pub const DIRTY_BITMAP_PREFIX: &str = "qemu:dirty-bitmap:";
/// `base:allocation`: the extent is not allocated.
pub const STATE_HOLE: u32 = 1 << 0;
/// `base:allocation`: the extent reads as zeroes.
pub const STATE_ZERO: u32 = 1 << 1;
/// `qemu:dirty-bitmap:NAME`: the extent changed since the bitmap was started.
pub const STATE_DIRTY: u32 = 1 << 0;

/// Bounds on what the server may make this client hold.
pub const MAX_OPTION_REPLY: usize = 64 << 10;
pub const MAX_BLOCK_STATUS_CHUNK: usize = 4 << 20;
pub const MAX_ERROR_MESSAGE: usize = 4 << 10;
pub const MAX_CHUNKS_PER_REPLY: usize = 65_536;

pub fn read_u16(r: &mut impl Read) -> Result<u16, Error> {
    let mut b = [0; 2];
    r.read_exact(&mut b)?;
    Ok(u16::from_be_bytes(b))
}

pub fn read_u32(r: &mut impl Read) -> Result<u32, Error> {
    let mut b = [0; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_be_bytes(b))
}

pub fn read_u64(r: &mut impl Read) -> Result<u64, Error> {
    let mut b = [0; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_be_bytes(b))
}

/// Reads `len` bytes the server announced, refusing more than `bound` before allocating.
pub fn read_bounded(
    r: &mut impl Read,
    len: u64,
    bound: usize,
    what: &str,
) -> Result<Vec<u8>, Error> {
    if len > bound as u64 {
        return Err(Error::protocol(format!(
            "{what} of {len} bytes (this client accepts at most {bound})"
        )));
    }
    let mut buf = vec![0; len as usize];
    r.read_exact(&mut buf)?;
    Ok(buf)
}

/// A big-endian field cursor over a payload already read (never reads past its end).
pub struct Fields<'a> {
    rest: &'a [u8],
}

impl<'a> Fields<'a> {
    pub fn new(bytes: &'a [u8]) -> Self {
        Fields { rest: bytes }
    }

    pub fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], Error> {
        if self.rest.len() < n {
            return Err(Error::protocol(format!("{what} is cut short")));
        }
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        Ok(head)
    }

    pub fn u16(&mut self, what: &str) -> Result<u16, Error> {
        let b = self.take(2, what)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }

    pub fn u32(&mut self, what: &str) -> Result<u32, Error> {
        let b = self.take(4, what)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    pub fn u64(&mut self, what: &str) -> Result<u64, Error> {
        let mut a = [0; 8];
        a.copy_from_slice(self.take(8, what)?);
        Ok(u64::from_be_bytes(a))
    }

    pub fn rest(&self) -> &'a [u8] {
        self.rest
    }
}
