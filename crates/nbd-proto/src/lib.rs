//! The NBD protocol's wire numbers, written once for cryptblk's server (`cryptblk-nbd`) and
//! client (`cryptblk-nbd-client`): magics, handshake and transmission flags, options, option
//! replies, commands, structured reply chunks, metadata contexts and error numbers.
//!
//! Numbers follow doc/proto.md of the NetworkBlockDevice/nbd project and, for the `qemu:`
//! contexts, QEMU's docs/interop/nbd.rst; every field on the wire is big-endian. What each
//! side accepts (payload limits, how much of a reply it holds) is that side's policy and
//! lives with it.
#![no_std]
#![forbid(unsafe_code)]

/// "NBDMAGIC": the first eight bytes the server sends.
pub const NBD_MAGIC: u64 = 0x4e42_444d_4147_4943;
/// "IHAVEOPT": starts the newstyle handshake and prefixes every client option.
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
/// Prefixes every server reply to an option.
pub const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

// Handshake flags (server) and client flags.
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
pub const CLIENT_FLAG_FIXED_NEWSTYLE: u32 = 1 << 0;
pub const CLIENT_FLAG_NO_ZEROES: u32 = 1 << 1;
pub const KNOWN_CLIENT_FLAGS: u32 = CLIENT_FLAG_FIXED_NEWSTYLE | CLIENT_FLAG_NO_ZEROES;

// Options.
pub const OPT_EXPORT_NAME: u32 = 1;
pub const OPT_ABORT: u32 = 2;
pub const OPT_LIST: u32 = 3;
pub const OPT_STARTTLS: u32 = 5;
pub const OPT_INFO: u32 = 6;
pub const OPT_GO: u32 = 7;
pub const OPT_STRUCTURED_REPLY: u32 = 8;
pub const OPT_LIST_META_CONTEXT: u32 = 9;
pub const OPT_SET_META_CONTEXT: u32 = 10;

// Option reply types.
pub const REP_ACK: u32 = 1;
pub const REP_SERVER: u32 = 2;
pub const REP_INFO: u32 = 3;
pub const REP_META_CONTEXT: u32 = 4;
/// The bit every option error reply type carries.
pub const REP_ERR: u32 = 1 << 31;
pub const REP_ERR_UNSUP: u32 = REP_ERR | 1;
pub const REP_ERR_POLICY: u32 = REP_ERR | 2;
pub const REP_ERR_INVALID: u32 = REP_ERR | 3;
pub const REP_ERR_TLS_REQD: u32 = REP_ERR | 5;
pub const REP_ERR_UNKNOWN: u32 = REP_ERR | 6;
pub const REP_ERR_SHUTDOWN: u32 = REP_ERR | 7;
pub const REP_ERR_TOO_BIG: u32 = REP_ERR | 9;

// Information types in NBD_REP_INFO.
pub const INFO_EXPORT: u16 = 0;
pub const INFO_NAME: u16 = 1;
pub const INFO_DESCRIPTION: u16 = 2;
pub const INFO_BLOCK_SIZE: u16 = 3;

// Transmission flags.
pub const TFLAG_HAS_FLAGS: u16 = 1 << 0;
pub const TFLAG_READ_ONLY: u16 = 1 << 1;
pub const TFLAG_SEND_FLUSH: u16 = 1 << 2;
pub const TFLAG_SEND_FUA: u16 = 1 << 3;
pub const TFLAG_SEND_TRIM: u16 = 1 << 5;
pub const TFLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
pub const TFLAG_SEND_DF: u16 = 1 << 7;
pub const TFLAG_CAN_MULTI_CONN: u16 = 1 << 8;

// Commands.
pub const CMD_READ: u16 = 0;
pub const CMD_WRITE: u16 = 1;
pub const CMD_DISC: u16 = 2;
pub const CMD_FLUSH: u16 = 3;
pub const CMD_TRIM: u16 = 4;
pub const CMD_CACHE: u16 = 5;
pub const CMD_WRITE_ZEROES: u16 = 6;
pub const CMD_BLOCK_STATUS: u16 = 7;

// Command flags.
pub const CMD_FLAG_FUA: u16 = 1 << 0;
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
pub const CMD_FLAG_DF: u16 = 1 << 2;
pub const CMD_FLAG_REQ_ONE: u16 = 1 << 3;
pub const CMD_FLAG_FAST_ZERO: u16 = 1 << 4;

// Structured reply chunk types and flags.
pub const REPLY_FLAG_DONE: u16 = 1 << 0;
pub const REPLY_TYPE_NONE: u16 = 0;
pub const REPLY_TYPE_OFFSET_DATA: u16 = 1;
pub const REPLY_TYPE_OFFSET_HOLE: u16 = 2;
pub const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
/// The bit every error chunk type carries.
pub const REPLY_TYPE_ERROR_BIT: u16 = 1 << 15;
pub const REPLY_TYPE_ERROR: u16 = REPLY_TYPE_ERROR_BIT | 1;
pub const REPLY_TYPE_ERROR_OFFSET: u16 = REPLY_TYPE_ERROR_BIT | 2;

// base:allocation flags.
pub const STATE_HOLE: u32 = 1 << 0;
pub const STATE_ZERO: u32 = 1 << 1;
/// The `qemu:dirty-bitmap:` contexts' one flag: the extent changed since the bitmap began.
pub const STATE_DIRTY: u32 = 1 << 0;

/// The allocation metadata context every export offers.
pub const BASE_ALLOCATION: &str = "base:allocation";
/// A dirty bitmap's context is this prefix followed by the bitmap's name (QEMU's naming).
pub const DIRTY_BITMAP_PREFIX: &str = "qemu:dirty-bitmap:";

/// Error numbers NBD puts on the wire (fixed by the protocol, not the host's errno values).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum NbdErrno {
    Perm = 1,
    Io = 5,
    NoMem = 12,
    Inval = 22,
    NoSpc = 28,
    Overflow = 75,
    NotSup = 95,
    Shutdown = 108,
}

/// Size of a request header (magic, flags, type, cookie, offset, length).
pub const REQUEST_HEADER_LEN: usize = 28;
/// Size of an option header after IHAVEOPT (option, length).
pub const OPTION_HEADER_LEN: usize = 16;
pub const SIMPLE_REPLY_HEADER_LEN: usize = 16;
pub const STRUCTURED_REPLY_HEADER_LEN: usize = 20;

/// The protocol caps names and metadata-context queries at 4 KiB.
pub const MAX_STRING_LEN: u32 = 4096;
