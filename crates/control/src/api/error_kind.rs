//! Why a method failed, as the protocol's application error codes. This table is the one
//! place where failure kinds meet wire codes; `cryptblk`'s exit statuses are mapped from the
//! kinds in the binary, never computed from the codes.
use serde::{Deserialize, Serialize};

/// The kind of a failed request. Each kind has one JSON-RPC error code ([`ErrorKind::code`]);
/// the codes are a published contract (see CHANGELOG.md) and never change meaning.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub enum ErrorKind {
    /// The params do not fit the method (-32602, the specification's "invalid params").
    InvalidParams,
    /// The request is well-formed but cannot be done as asked (e.g. a LUKS image without a
    /// key file), -32001.
    Usage,
    /// No keyslot accepts the passphrase, -32002.
    WrongPassphrase,
    /// An unsupported cipher, mode, hash, image format or feature, -32003.
    Unsupported,
    /// A damaged, truncated or inconsistent image or header, -32004.
    Damaged,
    /// An I/O error, -32005.
    Io,
    /// The image is in use (locked by another process), -32006.
    InUse,
    /// A resource limit (KDF memory or cost above the daemon's limits), -32007.
    ResourceLimit,
    /// Any other failure, -32008.
    Other,
    /// No disk has that name, -32010.
    NoSuchDisk,
    /// The request conflicts with the daemon's state (name or socket taken, last keyslot,
    /// nothing to export, no migration), -32011.
    Conflict,
    /// The disk is busy (a VM is connected, it is being added, migrated or its keyslots are
    /// changing); retrying later can succeed, -32012.
    Busy,
}

impl ErrorKind {
    pub const ALL: [ErrorKind; 12] = [
        ErrorKind::InvalidParams,
        ErrorKind::Usage,
        ErrorKind::WrongPassphrase,
        ErrorKind::Unsupported,
        ErrorKind::Damaged,
        ErrorKind::Io,
        ErrorKind::InUse,
        ErrorKind::ResourceLimit,
        ErrorKind::Other,
        ErrorKind::NoSuchDisk,
        ErrorKind::Conflict,
        ErrorKind::Busy,
    ];

    /// The JSON-RPC error code the daemon answers with.
    pub fn code(self) -> i64 {
        match self {
            ErrorKind::InvalidParams => crate::INVALID_PARAMS,
            ErrorKind::Usage => -32001,
            ErrorKind::WrongPassphrase => -32002,
            ErrorKind::Unsupported => -32003,
            ErrorKind::Damaged => -32004,
            ErrorKind::Io => -32005,
            ErrorKind::InUse => -32006,
            ErrorKind::ResourceLimit => -32007,
            ErrorKind::Other => -32008,
            ErrorKind::NoSuchDisk => -32010,
            ErrorKind::Conflict => -32011,
            ErrorKind::Busy => -32012,
        }
    }

    /// The kind of an error a client received. The specification's request errors (invalid
    /// request, unknown method, invalid params) are the caller's mistake, so `InvalidParams`;
    /// codes this table does not name (parse error, internal error, shutting down) are
    /// `Other`.
    pub fn from_code(code: i64) -> ErrorKind {
        if (crate::INVALID_PARAMS..=crate::INVALID_REQUEST).contains(&code) {
            return ErrorKind::InvalidParams;
        }
        ErrorKind::ALL
            .into_iter()
            .find(|k| k.code() == code)
            .unwrap_or(ErrorKind::Other)
    }

    /// What the code means, for the protocol reference.
    pub fn describe(self) -> &'static str {
        match self {
            ErrorKind::InvalidParams => "invalid params",
            ErrorKind::Usage => "usage (cannot be done as asked)",
            ErrorKind::WrongPassphrase => "wrong passphrase",
            ErrorKind::Unsupported => "unsupported",
            ErrorKind::Damaged => "damaged image",
            ErrorKind::Io => "I/O error",
            ErrorKind::InUse => "image in use",
            ErrorKind::ResourceLimit => "resource limit",
            ErrorKind::Other => "other failure",
            ErrorKind::NoSuchDisk => "no such disk",
            ErrorKind::Conflict => {
                "conflict (name or socket taken, last keyslot, nothing to export)"
            }
            ErrorKind::Busy => "busy (a VM is connected: pass force; still adding; migrating)",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_the_published_ones_and_round_trip() {
        let codes: Vec<i64> = ErrorKind::ALL.iter().map(|k| k.code()).collect();
        assert_eq!(
            codes,
            [
                -32602, -32001, -32002, -32003, -32004, -32005, -32006, -32007, -32008, -32010,
                -32011, -32012
            ]
        );
        for k in ErrorKind::ALL {
            assert_eq!(ErrorKind::from_code(k.code()), k);
            assert!(crate::APPLICATION_ERROR_MIN <= k.code() || k == ErrorKind::InvalidParams);
        }
        assert_eq!(
            ErrorKind::from_code(crate::METHOD_NOT_FOUND),
            ErrorKind::InvalidParams
        );
        assert_eq!(
            ErrorKind::from_code(crate::INVALID_REQUEST),
            ErrorKind::InvalidParams
        );
        assert_eq!(
            ErrorKind::from_code(crate::INTERNAL_ERROR),
            ErrorKind::Other
        );
        assert_eq!(
            ErrorKind::from_code(crate::SERVER_SHUTTING_DOWN),
            ErrorKind::Other
        );
    }
}
