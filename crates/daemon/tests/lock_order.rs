//! No control request waits behind another: a migration start that is connecting (to a peer
//! that never answers) and a keyslot change that is deriving keys or reading its key file hold
//! no lock, so every other request on the disk answers at once ("busy" where the two
//! exclude each other), and `disk-remove` waits at most for the start's connect timeout.
mod common;

use common::*;
use cryptblk_control::api::{DiskResizeParams, ErrorKind, KeyAddParams, MigrateStartParams};
use std::io::Write;
use std::net::TcpListener;
use std::os::unix::fs::OpenOptionsExt;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn start_params(name: &str, to: &str, timeout_ms: u64) -> MigrateStartParams {
    MigrateStartParams {
        name: name.into(),
        to: to.into(),
        postcopy: false,
        preempt: false,
        shared: false,
        chunk_size: None,
        max_bandwidth: None,
        break_chunks: None,
        max_passes: None,
        tls_creds: None,
        peer_name: None,
        insecure: false,
        connect_timeout: Some(timeout_ms),
    }
}

/// Calls `f` until it returns true, for at most 10 s.
fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(Instant::now() < deadline, "not within 10 s: {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_connecting_migration_blocks_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let d = daemon();
    let image = luks_image(dir.path(), "v.luks");
    let key = key_file(dir.path(), "k", PASSPHRASE);
    let mut c = disk("v", &image);
    c.key_file = Some(key.clone());
    d.add_disk(c).unwrap();

    // Accepts into its backlog and never answers.
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let to = format!("tcp:{}", silent.local_addr().unwrap());
    let timeout = Duration::from_millis(3000);
    let starter = {
        let d = d.clone();
        let p = start_params("v", &to, timeout.as_millis() as u64);
        std::thread::spawn(move || {
            let t = Instant::now();
            (d.migrate_start(&p), t.elapsed())
        })
    };
    // Once the start is under way, everything else answers at once.
    eventually("migrate-status reports the start", || {
        d.migrate_status("v")
            .is_err_and(|e| e.kind() == ErrorKind::Busy)
    });
    let quick = |what: &str, f: &dyn Fn()| {
        let t = Instant::now();
        f();
        assert!(
            t.elapsed() < Duration::from_millis(500),
            "{what} took {:?}",
            t.elapsed()
        );
    };
    quick("key-add", &|| {
        let err = d
            .key_add(&key_add_params(&key), &mut Default::default())
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Busy, "{err}");
    });
    quick("second migrate-start", &|| {
        let err = d.migrate_start(&start_params("v", &to, 100)).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Busy, "{err}");
    });
    quick("stats and disk-list", &|| {
        d.stats(None).unwrap();
        assert_eq!(d.list().disks.len(), 1);
    });
    quick("migrate-cancel", &|| {
        d.migrate_cancel("v").unwrap();
    });

    // The start gives up after its timeout, saying why.
    let (result, took) = starter.join().unwrap();
    let err = result.unwrap_err();
    let line = cryptblk_daemon::chain(&err);
    assert!(line.contains("connect timeout"), "{line}");
    assert!(
        took >= timeout && took < timeout + Duration::from_secs(5),
        "{took:?}"
    );

    // The header is free again: a keyslot change goes through.
    let added = d
        .key_add(
            &KeyAddParams {
                name: "v".into(),
                key_file: Some(key.clone()),
                key_fd: None,
                new_key_file: Some(key_file(dir.path(), "k2", b"second")),
                new_key_fd: None,
                key_secret: None,
                key_secret_iv: None,
                new_key_secret: None,
                new_key_secret_iv: None,
                pbkdf: Some(cryptblk_control::api::Pbkdf::Pbkdf2),
                iter_time: Some(1),
            },
            &mut Default::default(),
        )
        .unwrap();
    assert_eq!(added, 1);

    // disk-remove during a start waits only for the start to give up.
    let starter = {
        let d = d.clone();
        let p = start_params("v", &to, 1000);
        std::thread::spawn(move || d.migrate_start(&p))
    };
    eventually("the second start is connecting", || {
        d.migrate_status("v")
            .is_err_and(|e| e.kind() == ErrorKind::Busy)
    });
    let t = Instant::now();
    d.remove_disk("v", false).unwrap();
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    assert!(starter.join().unwrap().is_err());
    drop(silent);
}

#[test]
fn a_keyslot_change_blocks_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let d = daemon();
    let image = luks_image(dir.path(), "v.luks");
    let key = key_file(dir.path(), "k", PASSPHRASE);
    let mut c = disk("v", &image);
    c.key_file = Some(key.clone());
    d.add_disk(c).unwrap();

    // The new passphrase comes from a FIFO nobody writes yet: key-add waits inside its
    // header change for as long as the test wants.
    let fifo = dir.path().join("new-key");
    let path = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: mkfifo(3) on a NUL-terminated path in our temporary directory.
    assert_eq!(unsafe { libc::mkfifo(path.as_ptr(), 0o600) }, 0);
    let adder = {
        let d: Arc<_> = d.clone();
        let p = KeyAddParams {
            name: "v".into(),
            key_file: Some(key.clone()),
            key_fd: None,
            new_key_file: Some(fifo.clone()),
            new_key_fd: None,
            key_secret: None,
            key_secret_iv: None,
            new_key_secret: None,
            new_key_secret_iv: None,
            pbkdf: Some(cryptblk_control::api::Pbkdf::Pbkdf2),
            iter_time: Some(1),
        };
        std::thread::spawn(move || d.key_add(&p, &mut Default::default()))
    };
    // The FIFO can be opened for writing without blocking once key-add has it open for
    // reading, which it does inside its header change.
    let mut writer = None;
    eventually("key-add reads the new passphrase", || {
        assert!(!adder.is_finished(), "key-add returned early");
        let opened = std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&fifo);
        writer = opened.ok();
        writer.is_some()
    });
    // Nothing listens there: a start that got past the header check would fail at once.
    let nowhere = format!("unix:{}", dir.path().join("nobody.sock").display());
    let err = d
        .migrate_start(&start_params("v", &nowhere, 1000))
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Busy, "{err}");
    let t = Instant::now();
    d.stats(Some("v")).unwrap();
    let err = d
        .key_add(&key_add_params(&key), &mut Default::default())
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Busy);
    // A resize waits for the header change too: refused at once, the size unchanged.
    let size = d.list().disks[0].attached.as_ref().unwrap().size;
    let grow = DiskResizeParams {
        name: "v".into(),
        size: size + (1 << 20),
        allow_shrink: false,
    };
    let err = d.resize_disk(&grow).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Busy, "{err}");
    assert!(err.to_string().contains("disk-resize"), "{err}");
    assert!(
        t.elapsed() < Duration::from_millis(500),
        "{:?}",
        t.elapsed()
    );

    let mut writer = writer.unwrap();
    writer.write_all(b"new passphrase").unwrap();
    drop(writer);
    assert_eq!(adder.join().unwrap().unwrap(), 1);
    // And the start is possible again (it fails to connect, which proves it got there).
    let err = d
        .migrate_start(&start_params("v", &nowhere, 1000))
        .unwrap_err();
    assert_ne!(err.kind(), ErrorKind::Busy, "{err}");
    // And so is the resize.
    assert_eq!(d.resize_disk(&grow).unwrap().size, size + (1 << 20));
    d.remove_disk("v", false).unwrap();
}

/// Adds the key file's passphrase again to disk `v`, as cheaply as allowed.
fn key_add_params(key: &std::path::Path) -> KeyAddParams {
    KeyAddParams {
        name: "v".into(),
        key_file: Some(key.to_path_buf()),
        key_fd: None,
        new_key_file: Some(key.to_path_buf()),
        new_key_fd: None,
        key_secret: None,
        key_secret_iv: None,
        new_key_secret: None,
        new_key_secret_iv: None,
        pbkdf: None,
        iter_time: Some(1),
    }
}
