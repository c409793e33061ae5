//! A migration source's frame sequence against a real destination session: mostly valid
//! frames built with the wire encoder from the input (Hello, chunks, zero ranges, dirty and
//! missing lists, pass ends, checkpoints, postcopy, Complete, in any order and repeated) plus
//! raw garbage,
//! sent over a UNIX socket to an `IncomingMigration` writing into a small temporary image.
//! Shared by the `migration_session` fuzz target and the stable replay in
//! crates/migration/tests/fuzz_session_replay.rs.
//!
//! Checks: nothing panics (a panic on a destination thread aborts under libFuzzer, fails the
//! replay through the phase check), and once the source has sent everything and hung up the
//! session ends within a few seconds: `Completed`, `Failed` or `Cancelled` with the error
//! recorded, `PostcopyPaused` (the documented wait for the source to recover), or still
//! `Setup` with no session when the Hello was refused.
//!
//! Input (missing bytes read as zero): byte 0 picks the Hello (bit 7 set: no Hello first;
//! bits 0..1 disk size, 2..3 granularity, 4..5 header length, bit 6 a wrong version); then
//! 3 bytes per frame: kind, and two argument bytes (at most `MAX_FRAMES` frames).

use cryptblk_block::{Container, RawFile};
use cryptblk_migration::channel::ListenOptions;
use cryptblk_migration::wire::{Frame, Hello, Role, FLAG_CHECKPOINTS, SESSION_ID_LEN};
use cryptblk_migration::PROTOCOL_VERSION;
use cryptblk_migration::{IncomingMigration, IncomingStore, MigrationAddress, Phase};
use cryptblk_volume::checkpoint::{CarriedCheckpoint, CarriedCheckpoints};
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

const MAX_FRAMES: usize = 64;
/// A larger disk is refused by the store, so no input makes the destination allocate much.
const STORE_LIMIT: u64 = 8 << 20;
/// How long the session may take to end once the source hung up.
const SETTLE: Duration = Duration::from_secs(5);

/// A new image file in a temporary directory, refusing sizes over `STORE_LIMIT`.
struct SmallFile(PathBuf);

impl IncomingStore for SmallFile {
    fn name(&self) -> &Path {
        &self.0
    }
    fn exists(&self) -> bool {
        self.0.exists()
    }
    fn create(&self, size: u64) -> Result<Arc<dyn Container>, String> {
        if size > STORE_LIMIT {
            return Err(format!(
                "{size} bytes is over the test store's {STORE_LIMIT}"
            ));
        }
        Ok(Arc::new(
            RawFile::create(&self.0, size).map_err(|e| e.to_string())?,
        ))
    }
    fn remove(&self) -> bool {
        let _ = std::fs::remove_file(&self.0);
        true
    }
}

fn hello(b: u8) -> Hello {
    let disk_size_bytes = [1 << 20, 64 << 10, (1 << 20) + 512, 16 << 20][usize::from(b & 3)];
    let granularity = [4096, 512, 65536, 3000][usize::from((b >> 2) & 3)];
    let header_len = [0, 4096, 65536, 100][usize::from((b >> 4) & 3)];
    Hello {
        version: if b & 0x40 != 0 {
            PROTOCOL_VERSION + 1
        } else {
            PROTOCOL_VERSION
        },
        disk_size_bytes,
        granularity,
        header_len,
        role: Role::Bulk,
        // The source carries checkpoints (the destination accepts them).
        flags: FLAG_CHECKPOINTS,
        session: [0x5a; SESSION_ID_LEN],
    }
}

/// An offset: mostly block-aligned inside a 1 MiB disk, sometimes odd or far outside.
fn offset(a: u8) -> u64 {
    match a >> 6 {
        0 | 1 => u64::from(a & 0x3f) * 16384,
        2 => u64::from(a & 0x3f) * 4096 + 512,
        _ => u64::MAX - u64::from(a & 0x3f) * 4096,
    }
}

fn length(b: u8) -> u64 {
    match b >> 6 {
        0 | 1 => (u64::from(b & 0x3f) + 1) * 4096,
        2 => u64::from(b & 0x3f) * 512 + 1,
        _ => u64::MAX - u64::from(b & 0x3f),
    }
}

/// The bytes the source sends.
fn stream(data: &[u8]) -> Vec<u8> {
    let first = data.first().copied().unwrap_or(0);
    let mut out = Vec::new();
    if first & 0x80 == 0 {
        Frame::Hello(hello(first)).encode_into(&mut out);
    }
    let mut prev: Option<Frame> = None;
    for op in data.get(1..).unwrap_or(&[]).chunks(3).take(MAX_FRAMES) {
        let byte = |i: usize| op.get(i).copied().unwrap_or(0);
        let (a, b) = (byte(1), byte(2));
        let frame = match byte(0) % 15 {
            0 => Frame::Hello(hello(a)),
            1 | 2 => {
                // Up to 64 KiB of data, never a whole 2^64 range.
                let len = (length(b) % (64 << 10)) as usize;
                Frame::chunk(offset(a), vec![a; len])
            }
            3 => Frame::Zero {
                offset: offset(a),
                len: length(b),
            },
            4 => Frame::PassDone {
                pass: u32::from(a),
                dirty_left: u64::from(b),
            },
            5 => Frame::Complete,
            6 => Frame::Postcopy,
            7 => Frame::Missing {
                offset: offset(a),
                len: length(b),
            },
            8 => Frame::MissingEnd,
            9 => Frame::Request {
                offset: offset(a),
                len: length(b),
            },
            10 => Frame::Error {
                message: "source gave up".into(),
            },
            11 => Frame::SharedImage {
                identity: format!("image-{a}"),
            },
            12 => {
                // A frame cut short or damaged: raw bytes of a valid one, altered.
                let mut raw = Frame::Zero {
                    offset: offset(a),
                    len: 4096,
                }
                .encode();
                let i = usize::from(b) % raw.len();
                raw[i] ^= 0xff;
                out.extend_from_slice(&raw[..usize::from(a) % raw.len()]);
                continue;
            }
            13 => {
                // Checkpoints covering `a` 64 KiB regions (more than a 1 MiB disk has from
                // 17 on), with a run at `b % 16` (past the covered ones at times).
                let covered = u64::from(a) << 16;
                Frame::Checkpoints(CarriedCheckpoints {
                    granularity: 64 << 10,
                    covered,
                    checkpoints: (0..a % 3)
                        .map(|k| CarriedCheckpoint {
                            name: format!("c{k}"),
                            created: u64::from(b),
                            runs: vec![(u64::from(b % 16), 1)],
                        })
                        .collect(),
                })
            }
            _ => match &prev {
                Some(f) => f.clone(),
                None => continue,
            },
        };
        frame.encode_into(&mut out);
        prev = Some(frame);
    }
    out
}

/// Runs one input and returns the phase the session ended in; panics when a checked property
/// does not hold.
pub fn run(data: &[u8]) -> Phase {
    let dir = tempfile::tempdir().unwrap();
    let incoming = IncomingMigration::listen_with(
        &MigrationAddress::Unix(dir.path().join("mig.sock")),
        Arc::new(SmallFile(dir.path().join("disk.img"))),
        ListenOptions {
            hello_timeout: Duration::from_secs(2),
            frame_timeout: Duration::from_secs(2),
            ..Default::default()
        },
    )
    .unwrap();
    let MigrationAddress::Unix(path) = incoming.address().clone() else {
        unreachable!("listening on a UNIX socket")
    };
    let mut peer = UnixStream::connect(path).unwrap();
    // Drain what the destination answers, so its writes never block; ends at its hang-up.
    let mut replies = peer.try_clone().unwrap();
    let drain = std::thread::spawn(move || {
        let mut buf = [0u8; 16384];
        while matches!(replies.read(&mut buf), Ok(n) if n > 0) {}
    });
    // The destination may hang up at any point: a failed write just ends the sending.
    let _ = peer.write_all(&stream(data));
    let _ = peer.shutdown(std::net::Shutdown::Write);

    let deadline = Instant::now() + SETTLE;
    let phase = loop {
        let phase = incoming.phase();
        let ended = phase.is_final()
            || phase == Phase::PostcopyPaused
            || (phase == Phase::Setup && drain.is_finished());
        if ended || Instant::now() >= deadline {
            break phase;
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    let status = incoming.status();
    match phase {
        Phase::Completed | Phase::PostcopyPaused => {}
        Phase::Failed | Phase::Cancelled => {
            assert!(
                status.error.is_some(),
                "{phase} without an error: {status:?}"
            )
        }
        Phase::Setup => assert!(
            status.disk_size.is_none() && drain.is_finished(),
            "no session, yet the connection is still open after {SETTLE:?}: {status:?}"
        ),
        Phase::Precopy | Phase::Postcopy => {
            panic!("the session did not end {SETTLE:?} after the source hung up: {status:?}")
        }
    }
    let _ = peer.shutdown(std::net::Shutdown::Both);
    drop(incoming);
    drain.join().unwrap();
    phase
}
