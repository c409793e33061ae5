//! NBD wire format: the protocol's numbers (from `cryptblk-nbd-proto`, shared with the
//! client), this server's limits, and pure parsers and encoders for the fixed-size
//! structures. Parsers take byte slices from an untrusted peer and return `None` or a typed
//! error instead of panicking, so they can be fuzzed in isolation.

pub use cryptblk_nbd_proto::*;

/// The largest READ or WRITE payload accepted, as advertised in NBD_INFO_BLOCK_SIZE; larger
/// requests are refused so one request can never pin more memory than this.
pub const MAX_PAYLOAD: u32 = 32 << 20;
/// Option payloads beyond this are not legitimate (names are at most 4 KiB each); the
/// connection is closed rather than reading an attacker-chosen amount.
pub const MAX_OPTION_LEN: u32 = 64 << 10;

/// A transmission-phase request header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestHeader {
    pub flags: u16,
    pub command: u16,
    pub cookie: u64,
    pub offset: u64,
    pub length: u32,
}

/// Why a request header is unusable; both mean the stream is out of sync, so the connection
/// must close.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum RequestParseError {
    #[error("request header is {0} bytes, expected 28")]
    Truncated(usize),
    #[error("bad request magic {0:#010x}")]
    BadMagic(u32),
}

fn be_u16(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_be_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

fn be_u32(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_be_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

fn be_u64(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_be_bytes(b.get(at..at + 8)?.try_into().ok()?))
}

pub fn parse_request_header(bytes: &[u8]) -> Result<RequestHeader, RequestParseError> {
    if bytes.len() != REQUEST_HEADER_LEN {
        return Err(RequestParseError::Truncated(bytes.len()));
    }
    let truncated = RequestParseError::Truncated(bytes.len());
    let magic = be_u32(bytes, 0).ok_or(truncated)?;
    if magic != REQUEST_MAGIC {
        return Err(RequestParseError::BadMagic(magic));
    }
    Ok(RequestHeader {
        flags: be_u16(bytes, 4).ok_or(truncated)?,
        command: be_u16(bytes, 6).ok_or(truncated)?,
        cookie: be_u64(bytes, 8).ok_or(truncated)?,
        offset: be_u64(bytes, 16).ok_or(truncated)?,
        length: be_u32(bytes, 24).ok_or(truncated)?,
    })
}

pub fn encode_request_header(h: &RequestHeader) -> [u8; REQUEST_HEADER_LEN] {
    let mut out = [0u8; REQUEST_HEADER_LEN];
    out[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
    out[4..6].copy_from_slice(&h.flags.to_be_bytes());
    out[6..8].copy_from_slice(&h.command.to_be_bytes());
    out[8..16].copy_from_slice(&h.cookie.to_be_bytes());
    out[16..24].copy_from_slice(&h.offset.to_be_bytes());
    out[24..28].copy_from_slice(&h.length.to_be_bytes());
    out
}

/// The header of a client option: `IHAVEOPT`, option code, payload length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionHeader {
    pub option: u32,
    pub length: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum OptionParseError {
    #[error("option header is {0} bytes, expected 16")]
    Truncated(usize),
    #[error("bad option magic {0:#018x}")]
    BadMagic(u64),
}

pub fn parse_option_header(bytes: &[u8]) -> Result<OptionHeader, OptionParseError> {
    if bytes.len() != OPTION_HEADER_LEN {
        return Err(OptionParseError::Truncated(bytes.len()));
    }
    let truncated = OptionParseError::Truncated(bytes.len());
    let magic = be_u64(bytes, 0).ok_or(truncated)?;
    if magic != IHAVEOPT {
        return Err(OptionParseError::BadMagic(magic));
    }
    Ok(OptionHeader {
        option: be_u32(bytes, 8).ok_or(truncated)?,
        length: be_u32(bytes, 12).ok_or(truncated)?,
    })
}

/// Payload of NBD_OPT_INFO / NBD_OPT_GO: an export name and the information types asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InfoRequest {
    pub name: String,
    pub requests: Vec<u16>,
}

/// Parses an NBD_OPT_INFO/GO payload; `None` when the lengths do not add up exactly or the
/// name is not UTF-8 (the reply is then NBD_REP_ERR_INVALID).
pub fn parse_info_request(data: &[u8]) -> Option<InfoRequest> {
    let name_len = be_u32(data, 0)? as usize;
    let name_end = 4usize.checked_add(name_len)?;
    let name = std::str::from_utf8(data.get(4..name_end)?).ok()?.to_owned();
    let count = be_u16(data, name_end)? as usize;
    let list = data.get(name_end + 2..)?;
    if list.len() != count * 2 {
        return None;
    }
    let requests = list
        .chunks_exact(2)
        .map(|c| u16::from_be_bytes([c[0], c[1]]))
        .collect();
    Some(InfoRequest { name, requests })
}

/// Payload of NBD_OPT_LIST_META_CONTEXT / NBD_OPT_SET_META_CONTEXT.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetaContextRequest {
    pub export_name: String,
    pub queries: Vec<String>,
}

/// Parses a meta-context option payload; `None` when lengths do not add up exactly, a string
/// is over 4 KiB or not UTF-8.
pub fn parse_meta_context_request(data: &[u8]) -> Option<MetaContextRequest> {
    let mut at = 0usize;
    let export_name = take_length_prefixed_string(data, &mut at)?;
    let count = be_u32(data, at)?;
    at += 4;
    // Each query takes at least four bytes, which bounds the allocation by the payload size.
    let remaining = data.len().checked_sub(at)?;
    if count as usize > remaining / 4 {
        return None;
    }
    let mut queries = Vec::with_capacity(count as usize);
    for _ in 0..count {
        queries.push(take_length_prefixed_string(data, &mut at)?);
    }
    if at != data.len() {
        return None;
    }
    Some(MetaContextRequest {
        export_name,
        queries,
    })
}

/// Reads a u32 length and that many bytes of UTF-8 at `*at`, advancing `*at` past them.
fn take_length_prefixed_string(data: &[u8], at: &mut usize) -> Option<String> {
    let len = be_u32(data, *at)?;
    if len > MAX_STRING_LEN {
        return None;
    }
    let start = at.checked_add(4)?;
    let end = start.checked_add(len as usize)?;
    let text = std::str::from_utf8(data.get(start..end)?).ok()?.to_owned();
    *at = end;
    Some(text)
}

/// An option reply header followed by `payload_len` bytes of payload.
pub fn encode_option_reply_header(option: u32, reply: u32, payload_len: u32) -> [u8; 20] {
    let mut out = [0u8; 20];
    out[0..8].copy_from_slice(&OPTION_REPLY_MAGIC.to_be_bytes());
    out[8..12].copy_from_slice(&option.to_be_bytes());
    out[12..16].copy_from_slice(&reply.to_be_bytes());
    out[16..20].copy_from_slice(&payload_len.to_be_bytes());
    out
}

pub fn encode_simple_reply(error: u32, cookie: u64) -> [u8; SIMPLE_REPLY_HEADER_LEN] {
    let mut out = [0u8; SIMPLE_REPLY_HEADER_LEN];
    out[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    out[4..8].copy_from_slice(&error.to_be_bytes());
    out[8..16].copy_from_slice(&cookie.to_be_bytes());
    out
}

pub fn encode_structured_reply_header(
    flags: u16,
    reply_type: u16,
    cookie: u64,
    length: u32,
) -> [u8; STRUCTURED_REPLY_HEADER_LEN] {
    let mut out = [0u8; STRUCTURED_REPLY_HEADER_LEN];
    out[0..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    out[4..6].copy_from_slice(&flags.to_be_bytes());
    out[6..8].copy_from_slice(&reply_type.to_be_bytes());
    out[8..16].copy_from_slice(&cookie.to_be_bytes());
    out[16..20].copy_from_slice(&length.to_be_bytes());
    out
}

/// A structured NBD_REPLY_TYPE_ERROR chunk (with DONE) without a message.
pub fn encode_structured_error(cookie: u64, error: NbdErrno) -> Vec<u8> {
    let mut out = Vec::with_capacity(STRUCTURED_REPLY_HEADER_LEN + 6);
    out.extend_from_slice(&encode_structured_reply_header(
        REPLY_FLAG_DONE,
        REPLY_TYPE_ERROR,
        cookie,
        6,
    ));
    out.extend_from_slice(&(error as u32).to_be_bytes());
    out.extend_from_slice(&0u16.to_be_bytes());
    out
}

/// One NBD_REP_INFO payload (type + data).
pub fn encode_info_export(size: u64, transmission_flags: u16) -> Vec<u8> {
    let mut out = Vec::with_capacity(12);
    out.extend_from_slice(&INFO_EXPORT.to_be_bytes());
    out.extend_from_slice(&size.to_be_bytes());
    out.extend_from_slice(&transmission_flags.to_be_bytes());
    out
}

pub fn encode_info_string(info_type: u16, text: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(2 + text.len());
    out.extend_from_slice(&info_type.to_be_bytes());
    out.extend_from_slice(text.as_bytes());
    out
}

pub fn encode_info_block_size(minimum: u32, preferred: u32, maximum: u32) -> Vec<u8> {
    let mut out = Vec::with_capacity(14);
    out.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
    out.extend_from_slice(&minimum.to_be_bytes());
    out.extend_from_slice(&preferred.to_be_bytes());
    out.extend_from_slice(&maximum.to_be_bytes());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_header_round_trip() {
        let h = RequestHeader {
            flags: CMD_FLAG_FUA,
            command: CMD_WRITE,
            cookie: 0x0102_0304_0506_0708,
            offset: 4096,
            length: 512,
        };
        assert_eq!(parse_request_header(&encode_request_header(&h)), Ok(h));
        let mut bad = encode_request_header(&h);
        bad[0] ^= 1;
        assert!(matches!(
            parse_request_header(&bad),
            Err(RequestParseError::BadMagic(_))
        ));
        assert_eq!(
            parse_request_header(&bad[..10]),
            Err(RequestParseError::Truncated(10))
        );
    }

    #[test]
    fn info_request_lengths_must_add_up() {
        let mut data = Vec::new();
        data.extend_from_slice(&3u32.to_be_bytes());
        data.extend_from_slice(b"abc");
        data.extend_from_slice(&2u16.to_be_bytes());
        data.extend_from_slice(&INFO_NAME.to_be_bytes());
        data.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
        let parsed = parse_info_request(&data).unwrap();
        assert_eq!(parsed.name, "abc");
        assert_eq!(parsed.requests, vec![INFO_NAME, INFO_BLOCK_SIZE]);
        assert_eq!(parse_info_request(&data[..data.len() - 1]), None);
        data.push(0);
        assert_eq!(parse_info_request(&data), None);
        assert_eq!(parse_info_request(&u32::MAX.to_be_bytes()), None);
    }

    #[test]
    fn meta_context_request() {
        let mut data = Vec::new();
        data.extend_from_slice(&1u32.to_be_bytes());
        data.extend_from_slice(b"x");
        data.extend_from_slice(&2u32.to_be_bytes());
        for q in ["base:allocation", "qemu:dirty-bitmap:a"] {
            data.extend_from_slice(&(q.len() as u32).to_be_bytes());
            data.extend_from_slice(q.as_bytes());
        }
        let parsed = parse_meta_context_request(&data).unwrap();
        assert_eq!(parsed.export_name, "x");
        assert_eq!(
            parsed.queries,
            vec!["base:allocation", "qemu:dirty-bitmap:a"]
        );
        assert_eq!(parse_meta_context_request(&data[..data.len() - 2]), None);
        // A huge query count must not allocate.
        let mut huge = Vec::new();
        huge.extend_from_slice(&0u32.to_be_bytes());
        huge.extend_from_slice(&u32::MAX.to_be_bytes());
        assert_eq!(parse_meta_context_request(&huge), None);
    }
}
