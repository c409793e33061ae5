//! The names a disk's host cache mode and I/O engine have on the wire (`disk-add`'s `cache` and
//! `aio`, a config file's `[[disk]]` table, `disk-list`'s answer). They are the contract's own
//! types so that the contract does not depend on the data path; the daemon and the CLI turn them
//! into `cryptblk-block`'s `CacheMode` and `AioEngine` where they open an image.
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// The host page cache and flush behaviour of an image, with QEMU's `cache=` names and meaning:
/// `none` (O_DIRECT, the default), `writeback`, `writethrough`, `directsync` (O_DIRECT, every
/// write synced) and `unsafe` (flushes ignored).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CacheMode {
    #[default]
    None,
    Writeback,
    Writethrough,
    Directsync,
    Unsafe,
}

impl CacheMode {
    pub const ALL: [CacheMode; 5] = [
        CacheMode::None,
        CacheMode::Writeback,
        CacheMode::Writethrough,
        CacheMode::Directsync,
        CacheMode::Unsafe,
    ];

    pub fn name(self) -> &'static str {
        match self {
            CacheMode::None => "none",
            CacheMode::Writeback => "writeback",
            CacheMode::Writethrough => "writethrough",
            CacheMode::Directsync => "directsync",
            CacheMode::Unsafe => "unsafe",
        }
    }
}

/// The engine that performs a disk's asynchronous I/O: `io_uring` (the default) or `threads`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub enum AioEngine {
    #[default]
    #[serde(rename = "io_uring")]
    IoUring,
    #[serde(rename = "threads")]
    Threads,
}

impl AioEngine {
    pub const ALL: [AioEngine; 2] = [AioEngine::IoUring, AioEngine::Threads];

    pub fn name(self) -> &'static str {
        match self {
            AioEngine::IoUring => "io_uring",
            AioEngine::Threads => "threads",
        }
    }
}

impl fmt::Display for CacheMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl fmt::Display for AioEngine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An unknown name for a [`CacheMode`] or an [`AioEngine`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown {what} \"{given}\" (expected one of: {expected})")]
pub struct UnknownName {
    pub what: &'static str,
    pub given: String,
    pub expected: &'static str,
}

impl FromStr for CacheMode {
    type Err = UnknownName;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        CacheMode::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| UnknownName {
                what: "cache mode",
                given: s.to_string(),
                expected: "none, writeback, writethrough, directsync, unsafe",
            })
    }
}

impl FromStr for AioEngine {
    type Err = UnknownName;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        AioEngine::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| UnknownName {
                what: "aio engine",
                given: s.to_string(),
                expected: "io_uring, threads",
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_serde_uses_them() {
        for m in CacheMode::ALL {
            assert_eq!(m.name().parse::<CacheMode>(), Ok(m));
            assert_eq!(serde_json::to_string(&m).unwrap(), format!("\"{m}\""));
        }
        for e in AioEngine::ALL {
            assert_eq!(e.name().parse::<AioEngine>(), Ok(e));
            assert_eq!(serde_json::to_string(&e).unwrap(), format!("\"{e}\""));
        }
        let err = "direct".parse::<CacheMode>().unwrap_err().to_string();
        assert!(err.contains("unknown cache mode \"direct\""), "{err}");
        let err = "aio".parse::<AioEngine>().unwrap_err().to_string();
        assert!(err.contains("unknown aio engine \"aio\""), "{err}");
        assert_eq!(
            (CacheMode::default(), AioEngine::default()),
            (CacheMode::None, AioEngine::IoUring)
        );
    }
}
