//! What an export offers a client, decided from the export and its device: the transmission
//! flags, the block size limits, whether it is read-only and whether it takes discards. The
//! handshake announces these; the transmission phase holds each request to them.

use crate::export::Export;
use crate::protocol::*;

/// (minimum, preferred, maximum) for NBD_INFO_BLOCK_SIZE.
pub(crate) fn block_size_limits(export: &Export) -> (u32, u32, u32) {
    let minimum = export.device.logical_block_size().max(1);
    (minimum, minimum.max(4096), MAX_PAYLOAD)
}

pub(crate) fn is_read_only(export: &Export) -> bool {
    export.read_only || export.device.read_only()
}

/// Whether the device implements discard: a zero-length discard succeeds exactly on devices
/// that do (the trait's default refuses every discard as unsupported). On a read-only export
/// only when TRIM releases ([`Export::trim_releases`]).
pub(crate) fn supports_trim(export: &Export) -> bool {
    (!is_read_only(export) || export.trim_releases) && export.device.discard(0, 0).is_ok()
}

/// The transmission flags announced for `export` (NBD_INFO_EXPORT, NBD_OPT_EXPORT_NAME).
pub(crate) fn transmission_flags(export: &Export, structured_replies: bool) -> u16 {
    // CAN_MULTI_CONN is safe: every connection to an export shares one device, and FLUSH is
    // fdatasync of the shared file, so a flush on any connection covers writes completed on
    // all of them.
    let mut flags = TFLAG_HAS_FLAGS
        | TFLAG_SEND_FLUSH
        | TFLAG_SEND_FUA
        | TFLAG_SEND_WRITE_ZEROES
        | TFLAG_CAN_MULTI_CONN;
    if is_read_only(export) {
        flags |= TFLAG_READ_ONLY;
    }
    if supports_trim(export) {
        flags |= TFLAG_SEND_TRIM;
    }
    // Reads are always answered in one chunk, so "don't fragment" costs nothing.
    if structured_replies {
        flags |= TFLAG_SEND_DF;
    }
    flags
}
