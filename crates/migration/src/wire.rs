//! The migration wire protocol: length-prefixed frames over any reliable byte stream (a Unix
//! or TCP socket today, a TLS stream later).
//!
//! Every frame is a 12-byte header followed by its payload; all integers are little-endian:
//!
//! ```text
//! magic "CBMG" (4) | kind u8 | reserved 0 0 0 | payload length u32
//! ```
//!
//! | kind | frame     | payload                                                             |
//! |------|-----------|---------------------------------------------------------------------|
//! | 1    | Hello     | version u32, disk size u64, granularity u32, header length u64,     |
//! |      |           | role u8, flags u8, reserved 0 0, session id (16 bytes)              |
//! | 2    | Chunk     | offset u64, SHA-256 of (offset as u64 LE ‖ data) (32 bytes), data   |
//! | 3    | Zero      | offset u64, length u64 (the range is a hole / reads as zeros)       |
//! | 4    | PassDone  | pass u32, dirty bytes left u64                                      |
//! | 5    | Complete  | (empty)                                                             |
//! | 6    | Error     | UTF-8 message                                                       |
//! | 7    | Request   | offset u64, length u64: destination asks for a range it lacks       |
//! | 8    | Missing   | offset u64, length u64: a range the destination does not have       |
//! | 9    | Postcopy  | (empty) source: every Missing range is sent, the destination is live |
//! | 10   | MissingEnd| (empty) destination, on resume: every Missing range is sent         |
//! | 11   | SharedImage| UTF-8 identity of the image both sides reach (shared storage): the  |
//! |      |           | source's, then the destination's in answer if it is the same image |
//! | 12   | Checkpoints| the source's checkpoints, at switchover (`wire/checkpoints.rs`)    |
//! | 13   | Ready     | (empty) destination, once, in precopy: it serves the disk now (opened, |
//! |      |           | its exports published); only after Hellos with [`FLAG_AWAITS_READY`] |
//! |      |           | and [`FLAG_ANNOUNCES_READY`]; the switchover waits for it           |
//!
//! Everything read from the stream is untrusted: the header is checked (magic, kind, a length
//! cap per kind) before any payload buffer is allocated, and a chunk's checksum is verified by
//! the parser, so a frame that reaches the caller as `Frame::Chunk` is already known intact.
//! The checksum covers the offset too, so a flipped offset bit cannot send good data to the
//! wrong place. SHA-256 (the `sha2` crate the workspace already uses for LUKS) rather than a
//! CRC: it catches every corruption a CRC does, runs at GB/s with the SHA extensions, and
//! leaves no doubt when the stream later crosses untrusted networks under TLS.
//!
//! The parsers are pure functions over byte slices and never panic; the stream helpers only
//! add reading and writing.

mod checkpoints;
mod hello;
mod stream;

use cryptblk_volume::checkpoint::CarriedCheckpoints;
use sha2::{Digest, Sha256};

pub use hello::{
    Hello, Role, FLAG_ANNOUNCES_READY, FLAG_AWAITS_READY, FLAG_CHECKPOINTS,
    FLAG_CHECKPOINTS_ACCEPTED, FLAG_POSTCOPY, FLAG_PREEMPT, FLAG_SHARED,
};
pub use stream::{
    chunk_prefix, is_timeout, read_frame, read_frame_after_idle, write_chunk, write_frame,
};

/// Bumped on any incompatible change. The header and the first field of `Hello` never change,
/// so that two different versions can always tell each other so.
pub const PROTOCOL_VERSION: u32 = 2;
pub const MAGIC: [u8; 4] = *b"CBMG";
pub const HEADER_LEN: usize = 12;
/// Largest chunk of data one frame may carry.
pub const MAX_CHUNK_LEN: usize = 64 << 20;
/// Largest error message accepted from a peer.
pub const MAX_ERROR_LEN: usize = 64 << 10;
/// Longest shared-image identity accepted from a peer.
pub const MAX_IDENTITY_LEN: usize = 1024;
pub const CHECKSUM_LEN: usize = 32;

const HELLO_LEN: usize = 44;
/// The part of Hello every version has: enough to tell versions apart.
const HELLO_V1_LEN: usize = 24;
pub const SESSION_ID_LEN: usize = 16;
const CHUNK_PREFIX: usize = 8 + CHECKSUM_LEN;
/// Bytes a chunk frame adds to its data on the wire.
pub const CHUNK_OVERHEAD: usize = HEADER_LEN + CHUNK_PREFIX;

const KIND_HELLO: u8 = 1;
const KIND_CHUNK: u8 = 2;
const KIND_ZERO: u8 = 3;
const KIND_PASS_DONE: u8 = 4;
const KIND_COMPLETE: u8 = 5;
const KIND_ERROR: u8 = 6;
const KIND_REQUEST: u8 = 7;
const KIND_MISSING: u8 = 8;
const KIND_POSTCOPY: u8 = 9;
const KIND_MISSING_END: u8 = 10;
const KIND_SHARED_IMAGE: u8 = 11;
const KIND_CHECKPOINTS: u8 = 12;
const KIND_READY: u8 = 13;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    Hello(Hello),
    /// `data.len()` bytes of the image file at `offset`. Construct with [`Frame::chunk`];
    /// a decoded chunk has had its checksum verified.
    Chunk {
        offset: u64,
        data: Vec<u8>,
        checksum: [u8; CHECKSUM_LEN],
    },
    /// `len` bytes at `offset` are unallocated in the source and read as zeros.
    Zero {
        offset: u64,
        len: u64,
    },
    /// The sender finished pass `pass`; `dirty_left` bytes are still dirty.
    PassDone {
        pass: u32,
        dirty_left: u64,
    },
    /// Sender: nothing more follows. Receiver (in reply): everything is written and flushed.
    Complete,
    /// The sending side gives up; the migration is over.
    Error {
        message: String,
    },
    /// Destination to source: send `len` bytes at `offset` now (a read is waiting for them).
    Request {
        offset: u64,
        len: u64,
    },
    /// `len` bytes at `offset` are not valid on the destination: at postcopy switchover (from
    /// the source), or when resuming a broken postcopy (from the destination).
    Missing {
        offset: u64,
        len: u64,
    },
    /// Source: every `Missing` range has been sent; the destination serves from now on.
    Postcopy,
    /// Destination, on resume: every `Missing` range has been sent.
    MissingEnd,
    /// Shared storage: which image the sender reaches (see `SharedStorage::identity`).
    SharedImage {
        identity: String,
    },
    /// Source, at switchover (before `Complete` or `Missing`): its disk's checkpoints.
    Checkpoints(CarriedCheckpoints),
    /// Destination, before the switchover: it serves the disk now, so the source may switch
    /// over (a switchover asked for earlier waits for this).
    Ready,
}

/// Why bytes from the stream were not a valid frame.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
    #[error("the peer closed the connection")]
    Closed,
    #[error("frame truncated: needed {needed} bytes, got {got}")]
    Truncated { needed: usize, got: usize },
    #[error("bad frame magic {0:02x?} (not a cryptblk migration stream, or out of sync)")]
    BadMagic([u8; 4]),
    #[error("reserved frame header bytes are not zero")]
    Reserved,
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    #[error("frame kind {kind} with a {len}-byte payload (allowed: {min}..={max})")]
    BadLength {
        kind: u8,
        len: usize,
        min: usize,
        max: usize,
    },
    #[error("checksum mismatch in the chunk at offset {offset} ({len} bytes): data corrupted in transit")]
    ChecksumMismatch { offset: u64, len: usize },
    #[error("range of {len} bytes at offset {offset} is empty or overflows")]
    BadRange { offset: u64, len: u64 },
    #[error("text from the peer (an error message or image identity) is not valid UTF-8")]
    BadUtf8,
    #[error("checkpoints from the peer: {0}")]
    BadCheckpoints(String),
    #[error("unknown channel role {0} in Hello")]
    BadRole(u8),
}

/// A validated frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    pub kind: u8,
    pub len: usize,
}

/// The checksum a chunk carries.
pub fn checksum(offset: u64, data: &[u8]) -> [u8; CHECKSUM_LEN] {
    let mut h = Sha256::new();
    h.update(offset.to_le_bytes());
    h.update(data);
    h.finalize().into()
}

fn length_bounds(kind: u8) -> Option<(usize, usize)> {
    Some(match kind {
        // Longer Hellos are allowed so a future version can append fields and still be told
        // apart by its version number; the current version's length is checked on decode.
        KIND_HELLO => (HELLO_V1_LEN, 4096),
        KIND_CHUNK => (CHUNK_PREFIX + 1, CHUNK_PREFIX + MAX_CHUNK_LEN),
        KIND_ZERO => (16, 16),
        KIND_PASS_DONE => (12, 12),
        KIND_COMPLETE => (0, 0),
        KIND_ERROR => (0, MAX_ERROR_LEN),
        KIND_REQUEST | KIND_MISSING => (16, 16),
        KIND_POSTCOPY | KIND_MISSING_END | KIND_READY => (0, 0),
        KIND_SHARED_IMAGE => (1, MAX_IDENTITY_LEN),
        KIND_CHECKPOINTS => (checkpoints::HEAD, checkpoints::MAX_LEN),
        _ => return None,
    })
}

/// Parses and validates a frame header (the first `HEADER_LEN` bytes of `buf`): magic, zero
/// reserved bytes, a known kind, and a payload length within that kind's bounds, so that the
/// caller can allocate the payload buffer safely.
pub fn parse_header(buf: &[u8]) -> Result<FrameHeader, WireError> {
    let h = buf.get(..HEADER_LEN).ok_or(WireError::Truncated {
        needed: HEADER_LEN,
        got: buf.len(),
    })?;
    let magic = [h[0], h[1], h[2], h[3]];
    if magic != MAGIC {
        return Err(WireError::BadMagic(magic));
    }
    if h[5..8] != [0, 0, 0] {
        return Err(WireError::Reserved);
    }
    let kind = h[4];
    let len = u32::from_le_bytes([h[8], h[9], h[10], h[11]]) as usize;
    let (min, max) = length_bounds(kind).ok_or(WireError::UnknownKind(kind))?;
    if len < min || len > max {
        return Err(WireError::BadLength {
            kind,
            len,
            min,
            max,
        });
    }
    Ok(FrameHeader { kind, len })
}

fn u32_at(p: &[u8], at: usize) -> u32 {
    let mut b = [0u8; 4];
    b.copy_from_slice(&p[at..at + 4]);
    u32::from_le_bytes(b)
}

fn u64_at(p: &[u8], at: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&p[at..at + 8]);
    u64::from_le_bytes(b)
}

/// Decodes the payload of a frame whose header `parse_header` accepted. Verifies a chunk's
/// checksum and that no range is empty or wraps around.
pub fn decode_payload(header: FrameHeader, payload: &[u8]) -> Result<Frame, WireError> {
    let FrameHeader { kind, len } = header;
    if payload.len() != len {
        return Err(WireError::Truncated {
            needed: len,
            got: payload.len(),
        });
    }
    // Re-check the bounds: the header may have been built by the caller, not parse_header, and
    // every index below relies on them.
    let (min, max) = length_bounds(kind).ok_or(WireError::UnknownKind(kind))?;
    if len < min || len > max {
        return Err(WireError::BadLength {
            kind,
            len,
            min,
            max,
        });
    }
    let p = payload;
    match kind {
        KIND_HELLO => hello::decode(p).map(Frame::Hello),
        KIND_CHUNK => verified_chunk(&p[..CHUNK_PREFIX], p[CHUNK_PREFIX..].to_vec()),
        KIND_ZERO => {
            let (offset, zlen) = (u64_at(p, 0), u64_at(p, 8));
            if zlen == 0 || offset.checked_add(zlen).is_none() {
                return Err(WireError::BadRange { offset, len: zlen });
            }
            Ok(Frame::Zero { offset, len: zlen })
        }
        KIND_PASS_DONE => Ok(Frame::PassDone {
            pass: u32_at(p, 0),
            dirty_left: u64_at(p, 4),
        }),
        KIND_COMPLETE => Ok(Frame::Complete),
        KIND_REQUEST | KIND_MISSING => {
            let (offset, rlen) = (u64_at(p, 0), u64_at(p, 8));
            if rlen == 0 || offset.checked_add(rlen).is_none() {
                return Err(WireError::BadRange { offset, len: rlen });
            }
            Ok(if kind == KIND_REQUEST {
                Frame::Request { offset, len: rlen }
            } else {
                Frame::Missing { offset, len: rlen }
            })
        }
        KIND_POSTCOPY => Ok(Frame::Postcopy),
        KIND_MISSING_END => Ok(Frame::MissingEnd),
        KIND_READY => Ok(Frame::Ready),
        KIND_ERROR => match std::str::from_utf8(p) {
            Ok(m) => Ok(Frame::Error {
                message: m.to_owned(),
            }),
            Err(_) => Err(WireError::BadUtf8),
        },
        KIND_SHARED_IMAGE => match std::str::from_utf8(p) {
            Ok(identity) => Ok(Frame::SharedImage {
                identity: identity.to_owned(),
            }),
            Err(_) => Err(WireError::BadUtf8),
        },
        KIND_CHECKPOINTS => checkpoints::decode(p).map(Frame::Checkpoints),
        other => Err(WireError::UnknownKind(other)),
    }
}

/// A chunk frame from its prefix (offset, checksum) and data, once the checksum (which covers
/// the offset too) and the range are verified.
fn verified_chunk(prefix: &[u8], data: Vec<u8>) -> Result<Frame, WireError> {
    let offset = u64_at(prefix, 0);
    let mut sum = [0u8; CHECKSUM_LEN];
    sum.copy_from_slice(&prefix[8..CHUNK_PREFIX]);
    if offset.checked_add(data.len() as u64).is_none() {
        return Err(WireError::BadRange {
            offset,
            len: data.len() as u64,
        });
    }
    if checksum(offset, &data) != sum {
        return Err(WireError::ChecksumMismatch {
            offset,
            len: data.len(),
        });
    }
    Ok(Frame::Chunk {
        offset,
        data,
        checksum: sum,
    })
}

/// Decodes one complete frame from the start of `buf`; returns it and the bytes it used.
pub fn decode(buf: &[u8]) -> Result<(Frame, usize), WireError> {
    let header = parse_header(buf)?;
    let end = HEADER_LEN + header.len;
    let payload = buf.get(HEADER_LEN..end).ok_or(WireError::Truncated {
        needed: end,
        got: buf.len(),
    })?;
    Ok((decode_payload(header, payload)?, end))
}

fn push_header(out: &mut Vec<u8>, kind: u8, len: usize) {
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&[kind, 0, 0, 0]);
    // Encoders only build frames within the caps, which are far below u32::MAX.
    out.extend_from_slice(&(len as u32).to_le_bytes());
}

impl Frame {
    /// A chunk with its checksum computed.
    pub fn chunk(offset: u64, data: Vec<u8>) -> Frame {
        let checksum = checksum(offset, &data);
        Frame::Chunk {
            offset,
            data,
            checksum,
        }
    }

    /// Appends the encoded frame to `out`. Frames beyond the caps (a chunk over
    /// `MAX_CHUNK_LEN`, a long error message) are the caller's bug; error messages are
    /// truncated to fit rather than dropped, since they are the last thing a peer hears.
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        match self {
            Frame::Hello(h) => {
                push_header(out, KIND_HELLO, HELLO_LEN);
                hello::encode(h, out);
            }
            Frame::Chunk {
                offset,
                data,
                checksum,
            } => {
                push_header(out, KIND_CHUNK, CHUNK_PREFIX + data.len());
                out.extend_from_slice(&offset.to_le_bytes());
                out.extend_from_slice(checksum);
                out.extend_from_slice(data);
            }
            Frame::Zero { offset, len } => {
                push_header(out, KIND_ZERO, 16);
                out.extend_from_slice(&offset.to_le_bytes());
                out.extend_from_slice(&len.to_le_bytes());
            }
            Frame::PassDone { pass, dirty_left } => {
                push_header(out, KIND_PASS_DONE, 12);
                out.extend_from_slice(&pass.to_le_bytes());
                out.extend_from_slice(&dirty_left.to_le_bytes());
            }
            Frame::Complete => push_header(out, KIND_COMPLETE, 0),
            Frame::Request { offset, len } | Frame::Missing { offset, len } => {
                let kind = if matches!(self, Frame::Request { .. }) {
                    KIND_REQUEST
                } else {
                    KIND_MISSING
                };
                push_header(out, kind, 16);
                out.extend_from_slice(&offset.to_le_bytes());
                out.extend_from_slice(&len.to_le_bytes());
            }
            Frame::Postcopy => push_header(out, KIND_POSTCOPY, 0),
            Frame::MissingEnd => push_header(out, KIND_MISSING_END, 0),
            Frame::Ready => push_header(out, KIND_READY, 0),
            Frame::SharedImage { identity } => {
                // Identities are short (fsid/pool/image id); a longer one is the caller's bug.
                let bytes = &identity.as_bytes()[..identity.len().min(MAX_IDENTITY_LEN)];
                push_header(out, KIND_SHARED_IMAGE, bytes.len());
                out.extend_from_slice(bytes);
            }
            Frame::Checkpoints(c) => {
                push_header(out, KIND_CHECKPOINTS, checkpoints::encoded_len(c));
                checkpoints::encode(c, out);
            }
            Frame::Error { message } => {
                let mut end = message.len().min(MAX_ERROR_LEN);
                while !message.is_char_boundary(end) {
                    end -= 1;
                }
                push_header(out, KIND_ERROR, end);
                out.extend_from_slice(&message.as_bytes()[..end]);
            }
        }
    }

    /// The frame's kind, for messages.
    pub fn name(&self) -> &'static str {
        match self {
            Frame::Hello(_) => "Hello",
            Frame::Chunk { .. } => "Chunk",
            Frame::Zero { .. } => "Zero",
            Frame::PassDone { .. } => "PassDone",
            Frame::Complete => "Complete",
            Frame::Error { .. } => "Error",
            Frame::Request { .. } => "Request",
            Frame::Missing { .. } => "Missing",
            Frame::Postcopy => "Postcopy",
            Frame::MissingEnd => "MissingEnd",
            Frame::SharedImage { .. } => "SharedImage",
            Frame::Checkpoints(_) => "Checkpoints",
            Frame::Ready => "Ready",
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        self.encode_into(&mut out);
        out
    }
}

#[cfg(test)]
mod tests;
