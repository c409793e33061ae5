//! How an image is opened for serving: the host cache mode (QEMU's `cache=` names and meaning)
//! and the engine that performs asynchronous I/O.

use std::fmt;
use std::str::FromStr;

/// The host page cache and flush behaviour of an image, with QEMU's names and meaning
/// (`cache.direct` and `cache.no-flush`, plus write-through).
///
/// | mode | O_DIRECT | guest write cache | flushes |
/// |---|---|---|---|
/// | `none` (default) | yes | on (guest flushes) | honoured |
/// | `writeback` | no | on | honoured |
/// | `writethrough` | no | off (every write synced) | honoured |
/// | `directsync` | yes | off (every write synced) | honoured |
/// | `unsafe` | no | on | ignored |
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum CacheMode {
    /// Bypass the host page cache (O_DIRECT); the guest's flushes reach the device.
    #[default]
    None,
    /// Use the host page cache; flushes are fdatasync.
    Writeback,
    /// Use the host page cache and complete every write only once it is durable.
    Writethrough,
    /// Bypass the host page cache and complete every write only once it is durable.
    Directsync,
    /// Use the host page cache and ignore flushes: fast, and a host crash loses data.
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

    /// The image file is opened with O_DIRECT.
    pub fn direct(self) -> bool {
        matches!(self, CacheMode::None | CacheMode::Directsync)
    }

    /// Every write is made durable before it completes (the guest sees no write cache).
    pub fn write_through(self) -> bool {
        matches!(self, CacheMode::Writethrough | CacheMode::Directsync)
    }

    /// Flush requests succeed without doing anything.
    pub fn ignore_flush(self) -> bool {
        self == CacheMode::Unsafe
    }

    pub fn name(self) -> &'static str {
        match self {
            CacheMode::None => "none",
            CacheMode::Writeback => "writeback",
            CacheMode::Writethrough => "writethrough",
            CacheMode::Directsync => "directsync",
            CacheMode::Unsafe => "unsafe",
        }
    }

    /// The mode used where the filesystem refuses O_DIRECT (tmpfs): the same flush
    /// behaviour through the page cache.
    pub fn without_direct(self) -> CacheMode {
        match self {
            CacheMode::None => CacheMode::Writeback,
            CacheMode::Directsync => CacheMode::Writethrough,
            other => other,
        }
    }
}

impl fmt::Display for CacheMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An unknown name for a `CacheMode` or `AioEngine`.
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

/// The engine that performs a disk's asynchronous I/O.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize,
)]
pub enum AioEngine {
    /// Linux io_uring: one ring per queue thread, submissions batched. Falls back to `Threads`
    /// (with a notice) where the kernel refuses io_uring.
    #[default]
    #[serde(rename = "io_uring")]
    IoUring,
    /// A pool of threads doing synchronous I/O.
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

impl fmt::Display for AioEngine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
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
    fn names_round_trip_and_match_qemu() {
        for m in CacheMode::ALL {
            assert_eq!(m.name().parse::<CacheMode>(), Ok(m));
        }
        for e in AioEngine::ALL {
            assert_eq!(e.name().parse::<AioEngine>(), Ok(e));
        }
        let err = "direct".parse::<CacheMode>().unwrap_err().to_string();
        assert!(err.contains("unknown cache mode \"direct\""), "{err}");
        // QEMU: none and directsync use O_DIRECT; writethrough and directsync sync every
        // write; only unsafe drops flushes.
        let direct: Vec<_> = CacheMode::ALL.into_iter().filter(|m| m.direct()).collect();
        assert_eq!(direct, [CacheMode::None, CacheMode::Directsync]);
        let wt: Vec<_> = CacheMode::ALL
            .into_iter()
            .filter(|m| m.write_through())
            .collect();
        assert_eq!(wt, [CacheMode::Writethrough, CacheMode::Directsync]);
        assert_eq!(CacheMode::default(), CacheMode::None);
        assert_eq!(CacheMode::None.without_direct(), CacheMode::Writeback);
        assert_eq!(
            CacheMode::Directsync.without_direct(),
            CacheMode::Writethrough
        );
    }

    #[test]
    fn serde_uses_the_command_line_names() {
        #[derive(serde::Deserialize, serde::Serialize, PartialEq, Debug)]
        struct T {
            cache: CacheMode,
            aio: AioEngine,
        }
        let t: T = serde_json::from_str(r#"{"cache":"directsync","aio":"io_uring"}"#).unwrap();
        assert_eq!(
            t,
            T {
                cache: CacheMode::Directsync,
                aio: AioEngine::IoUring
            }
        );
        assert_eq!(
            serde_json::to_string(&T {
                cache: CacheMode::Unsafe,
                aio: AioEngine::Threads
            })
            .unwrap(),
            r#"{"cache":"unsafe","aio":"threads"}"#
        );
    }
}
