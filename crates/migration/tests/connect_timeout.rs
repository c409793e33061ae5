//! A destination that accepts the connection and never answers (a wrong port, a hung peer)
//! fails the start after the connect timeout, with an error that says so; the disk is left
//! as it was.
use cryptblk_block::{BlockDevice, OpenOptions, RawFile};
use cryptblk_migration::{MigrationError, SourceMigration, SourceOptions};
use cryptblk_volume::DirtyTracker;
use std::net::TcpListener;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[test]
fn a_silent_destination_times_out() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("src.raw");
    std::fs::write(&path, vec![0u8; 1 << 20]).unwrap();
    let raw = Arc::new(
        RawFile::open(
            &path,
            OpenOptions {
                writable: true,
                lock: true,
            },
        )
        .unwrap(),
    );
    let tracker = Arc::new(DirtyTracker::new(raw.clone(), 0, 4096).unwrap());
    // Accepts (the kernel completes the handshake from its backlog) and never says a word.
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let to = format!("tcp:{}", silent.local_addr().unwrap())
        .parse()
        .unwrap();
    let opts = SourceOptions {
        connect_timeout: Duration::from_millis(300),
        ..SourceOptions::default()
    };
    let started = Instant::now();
    let err = SourceMigration::start(raw.clone(), tracker.clone(), &to, opts).unwrap_err();
    let took = started.elapsed();
    assert!(matches!(err, MigrationError::Connect { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains("no Hello came back within 300 ms"), "{msg}");
    assert!(took >= Duration::from_millis(300), "{took:?}");
    assert!(took < Duration::from_secs(5), "{took:?}");
    assert!(!tracker.is_tracking() && !tracker.is_fenced());
    drop(silent);

    // Nothing listening at all: refused at once, not after the timeout.
    let opts = SourceOptions {
        connect_timeout: Duration::from_secs(30),
        ..SourceOptions::default()
    };
    let started = Instant::now();
    let err = SourceMigration::start(raw.clone(), tracker, &to, opts).unwrap_err();
    assert!(matches!(err, MigrationError::Connect { .. }), "{err:?}");
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(raw.size(), 1 << 20);
}
