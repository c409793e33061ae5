//! NBD wire numbers (`cryptblk-nbd-proto`, shared with the server) and bounded readers for
//! what the server sends.
use crate::Error;
use std::io::Read;

pub use cryptblk_nbd_proto::*;

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
