//! Base64url without padding, the encoding of every JOSE field (RFC 7515 2); decoding also
//! accepts the padded form some writers leave.
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;

pub(crate) fn b64(text: &str) -> std::result::Result<Vec<u8>, base64::DecodeError> {
    URL_SAFE_NO_PAD.decode(text.trim_end_matches('='))
}

pub(crate) fn b64_encode(bytes: &[u8]) -> String {
    URL_SAFE_NO_PAD.encode(bytes)
}
