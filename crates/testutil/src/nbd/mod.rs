//! NBD test clients, both framed by `cryptblk_nbd::protocol` (its constants and header
//! codec), so the tests speak the protocol the server implements and nothing is declared twice:
//! - [`NbdClient`]: a strict client that checks everything a server sends, for tests of
//!   behaviour (pipelined I/O, errors, crashes) and checked against qemu-nbd itself.
//! - [`RawClient`]: speaks NBD message by message and sends whatever the test asks, for
//!   malformed input and protocol corner cases.

mod client;
mod error;
mod raw;

pub use client::{ExportInfo, NbdClient};
pub use error::{NbdError, Result};
pub use raw::RawClient;

use std::io::{self, Read, Write};

use cryptblk_nbd::protocol::{
    encode_request_header, RequestHeader, IHAVEOPT, MAX_OPTION_LEN, OPTION_REPLY_MAGIC,
    REQUEST_HEADER_LEN,
};

/// Sends one option (`IHAVEOPT`, option, length, data) in a single write.
fn write_option(stream: &mut impl Write, option: u32, data: &[u8]) -> io::Result<()> {
    let mut message = Vec::with_capacity(16 + data.len());
    message.extend_from_slice(&IHAVEOPT.to_be_bytes());
    message.extend_from_slice(&option.to_be_bytes());
    message.extend_from_slice(&(data.len() as u32).to_be_bytes());
    message.extend_from_slice(data);
    stream.write_all(&message)
}

/// Sends one transmission request: its header and `data` (a write's payload) in one write.
fn write_request(stream: &mut impl Write, header: &RequestHeader, data: &[u8]) -> io::Result<()> {
    let mut message = Vec::with_capacity(REQUEST_HEADER_LEN + data.len());
    message.extend_from_slice(&encode_request_header(header));
    message.extend_from_slice(data);
    stream.write_all(&message)
}

/// One option reply: (option, reply type, payload). Fails on a bad magic or a payload longer
/// than any legitimate reply.
fn read_option_reply(stream: &mut impl Read) -> Result<(u32, u32, Vec<u8>)> {
    let magic = read_u64(stream)?;
    if magic != OPTION_REPLY_MAGIC {
        return Err(NbdError::Protocol(format!(
            "bad option reply magic {magic:#x}"
        )));
    }
    let option = read_u32(stream)?;
    let reply = read_u32(stream)?;
    let len = read_u32(stream)?;
    if len > MAX_OPTION_LEN {
        return Err(NbdError::Protocol(format!("option reply of {len} bytes")));
    }
    let mut payload = vec![0u8; len as usize];
    stream.read_exact(&mut payload)?;
    Ok((option, reply, payload))
}

fn read_u16(r: &mut impl Read) -> io::Result<u16> {
    let mut b = [0u8; 2];
    r.read_exact(&mut b)?;
    Ok(u16::from_be_bytes(b))
}

fn read_u32(r: &mut impl Read) -> io::Result<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_be_bytes(b))
}

fn read_u64(r: &mut impl Read) -> io::Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_be_bytes(b))
}
