//! The Hello each side sends first on a connection: what the connection is for, the disk's
//! geometry, the flags both sides agree on, and the session it belongs to. Its layout is in
//! the table of `wire.rs` (kind 1).

use super::{u32_at, u64_at, WireError, HELLO_LEN, PROTOCOL_VERSION, SESSION_ID_LEN};

/// What a connection is for; the first Hello on it says so.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The main channel: the bulk stream, switchover, and (without preempt) urgent requests.
    Bulk = 1,
    /// The preempt channel: urgent requests and their answers only.
    Urgent = 2,
    /// A new main channel replacing a broken one, after which the destination says what it
    /// still lacks.
    Resume = 3,
}

impl Role {
    fn from_u8(v: u8) -> Option<Role> {
        Some(match v {
            1 => Role::Bulk,
            2 => Role::Urgent,
            3 => Role::Resume,
            _ => return None,
        })
    }
}

/// Hello flag: the source may switch over in postcopy mode.
pub const FLAG_POSTCOPY: u8 = 1;
/// Hello flag: urgent requests use their own connection.
pub const FLAG_PREEMPT: u8 = 2;
/// Hello flag: both sides reach the same image (shared storage); no data is sent, only the
/// right to write is handed over at switchover.
pub const FLAG_SHARED: u8 = 4;
/// Hello flag, source: at switchover it sends its disk's checkpoints if the destination
/// answers with [`FLAG_CHECKPOINTS_ACCEPTED`].
pub const FLAG_CHECKPOINTS: u8 = 8;
/// Hello flag, destination only: send the checkpoints. A distinct bit, because a destination
/// older than checkpoints answers with the source's own flags.
pub const FLAG_CHECKPOINTS_ACCEPTED: u8 = 16;
/// Hello flag, source: its switchover waits for the destination's `Ready` (the destination
/// serves the disk), if the destination answers with [`FLAG_ANNOUNCES_READY`].
pub const FLAG_AWAITS_READY: u8 = 32;
/// Hello flag, destination only: it will send `Ready` once it serves the disk. A distinct bit,
/// because a destination older than `Ready` answers with the source's own flags; without it the
/// source switches over when asked, as before.
pub const FLAG_ANNOUNCES_READY: u8 = 64;

/// The handshake each side sends first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hello {
    pub version: u32,
    /// Size of the image *file* (header and payload), which both sides must agree on.
    pub disk_size_bytes: u64,
    /// Dirty-tracking block size of the sender; the receiver tracks what it got at this size.
    pub granularity: u32,
    /// Bytes of format header at the start of the file (the LUKS data offset; 0 for raw).
    pub header_len: u64,
    pub role: Role,
    /// `FLAG_*` bits.
    pub flags: u8,
    /// Chosen at random by the source for one migration; every later connection of the same
    /// migration (preempt channel, resume) must present it.
    pub session: [u8; SESSION_ID_LEN],
}

/// A Hello payload (of a length `length_bounds` accepted); another version's is only read far
/// enough to report the mismatch, the current one must be whole.
pub(super) fn decode(p: &[u8]) -> Result<Hello, WireError> {
    let version = u32_at(p, 0);
    if version == PROTOCOL_VERSION && p.len() != HELLO_LEN {
        return Err(WireError::BadLength {
            kind: super::KIND_HELLO,
            len: p.len(),
            min: HELLO_LEN,
            max: HELLO_LEN,
        });
    }
    let mut hello = Hello {
        version,
        disk_size_bytes: u64_at(p, 4),
        granularity: u32_at(p, 12),
        header_len: u64_at(p, 16),
        role: Role::Bulk,
        flags: 0,
        session: [0; SESSION_ID_LEN],
    };
    if version == PROTOCOL_VERSION {
        hello.role = Role::from_u8(p[24]).ok_or(WireError::BadRole(p[24]))?;
        hello.flags = p[25];
        if p[26..28] != [0, 0] {
            return Err(WireError::Reserved);
        }
        hello.session.copy_from_slice(&p[28..HELLO_LEN]);
    }
    Ok(hello)
}

pub(super) fn encode(h: &Hello, out: &mut Vec<u8>) {
    out.extend_from_slice(&h.version.to_le_bytes());
    out.extend_from_slice(&h.disk_size_bytes.to_le_bytes());
    out.extend_from_slice(&h.granularity.to_le_bytes());
    out.extend_from_slice(&h.header_len.to_le_bytes());
    out.extend_from_slice(&[h.role as u8, h.flags, 0, 0]);
    out.extend_from_slice(&h.session);
}
