//! Who may migrate a disk in: with TLS and a pinned peer name only the source whose
//! certificate carries it (and the source only talks to a destination whose certificate
//! carries the name it pinned); a peer that connects and says nothing, or stalls inside a
//! frame, is dropped after the timeout while the listener stays open for the real source.
mod common;

use common::*;
use cryptblk_migration::channel::ListenOptions;
use cryptblk_migration::wire::{self, Frame, Hello, Role, SESSION_ID_LEN};
use cryptblk_migration::{
    IncomingMigration, MigrationAddress, NewFile, Phase, SourceMigration, SourceOptions,
    PROTOCOL_VERSION,
};
use cryptblk_testutil::x509::make_client_credentials;
use cryptblk_tls::AllowList;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

const WAIT: Duration = Duration::from_secs(120);

fn localhost() -> MigrationAddress {
    "tcp:127.0.0.1:0".parse().unwrap()
}

fn tls_source(creds: &Path, peer_name: Option<&str>) -> SourceOptions {
    SourceOptions {
        tls: Some(Arc::new(cryptblk_tls::client_config(creds).unwrap())),
        peer_name: peer_name.map(str::to_string),
        connect_timeout: Duration::from_secs(5),
        ..Default::default()
    }
}

fn migrate_to_completion(src: &SourceDisk, incoming: &IncomingMigration, opts: SourceOptions) {
    let mig = SourceMigration::start(
        src.raw.clone(),
        src.tracker.clone(),
        incoming.address(),
        opts,
    )
    .unwrap();
    mig.switchover(false).unwrap();
    assert_eq!(mig.wait(WAIT), Phase::Completed, "{:?}", mig.status());
    assert_eq!(
        incoming.wait_for(Phase::Completed, WAIT),
        Phase::Completed,
        "{:?}",
        incoming.status()
    );
}

#[test]
fn only_the_pinned_peer_migrates() {
    let dir = tempfile::tempdir().unwrap();
    let pki = dir.path().join("pki");
    std::fs::create_dir(&pki).unwrap();
    make_credentials(&pki, "cryptblk migration CA");
    // The real source's certificate says "src-host"; the CA's other client certificate
    // ("cryptblk test client") is just as valid, but not the pinned peer.
    let real = dir.path().join("real-source");
    make_client_credentials(&pki, &real, "src-host", None);
    let src = luks2_source(&dir.path().join("src.luks"), 4 << 20, 21);
    let image = dir.path().join("dst.luks");
    let incoming = IncomingMigration::listen_with(
        &localhost(),
        Arc::new(NewFile(image.clone())),
        ListenOptions {
            tls: Some(Arc::new(cryptblk_tls::server_config(&pki).unwrap())),
            peer_names: Some(AllowList::new(["src-host"]).unwrap()),
            ..Default::default()
        },
    )
    .unwrap();

    let err = SourceMigration::start(
        src.raw.clone(),
        src.tracker.clone(),
        incoming.address(),
        tls_source(&pki, None),
    )
    .unwrap_err();
    assert!(err.to_string().contains("destination"), "{err}");
    assert_eq!(
        incoming.phase(),
        Phase::Setup,
        "a refused peer changes nothing"
    );
    assert!(!image.exists(), "a refused peer must not create the image");

    // The source pins the destination's name too: this one's certificate says localhost.
    let err = SourceMigration::start(
        src.raw.clone(),
        src.tracker.clone(),
        incoming.address(),
        tls_source(&real, Some("dst.example.org")),
    )
    .unwrap_err();
    assert!(
        err.to_string().to_lowercase().contains("certificate"),
        "{err}"
    );
    assert_eq!(incoming.phase(), Phase::Setup);

    // The real source, checking the destination's name, migrates.
    migrate_to_completion(&src, &incoming, tls_source(&real, Some("localhost")));
    assert_eq!(
        std::fs::read(dir.path().join("src.luks")).unwrap(),
        std::fs::read(&image).unwrap()
    );
}

#[test]
fn a_pinned_name_without_tls_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let err = IncomingMigration::listen_with(
        &localhost(),
        Arc::new(NewFile(dir.path().join("dst.luks"))),
        ListenOptions {
            peer_names: Some(AllowList::new(["src-host"]).unwrap()),
            ..Default::default()
        },
    )
    .unwrap_err();
    assert!(err.to_string().contains("needs TLS"), "{err}");
}

fn tcp_target(incoming: &IncomingMigration) -> String {
    let MigrationAddress::Tcp(target) = incoming.address() else {
        unreachable!()
    };
    target.clone()
}

/// Whether the destination hangs up on `peer` within `within` (it reads EOF or a reset).
fn hung_up_within(peer: &mut TcpStream, within: Duration) -> bool {
    peer.set_read_timeout(Some(within)).unwrap();
    let mut buf = [0u8; 4096];
    loop {
        match peer.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) => return e.kind() == std::io::ErrorKind::ConnectionReset,
        }
    }
}

#[test]
fn a_silent_peer_is_dropped_and_the_real_source_still_migrates() {
    let dir = tempfile::tempdir().unwrap();
    let src = luks2_source(&dir.path().join("src.luks"), 4 << 20, 22);
    let incoming = IncomingMigration::listen_with(
        &localhost(),
        Arc::new(NewFile(dir.path().join("dst.luks"))),
        ListenOptions {
            hello_timeout: Duration::from_millis(500),
            ..Default::default()
        },
    )
    .unwrap();
    let start = Instant::now();
    let mut silent = TcpStream::connect(tcp_target(&incoming)).unwrap();
    assert!(hung_up_within(&mut silent, Duration::from_secs(5)));
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "{:?}",
        start.elapsed()
    );
    assert_eq!(incoming.phase(), Phase::Setup);
    migrate_to_completion(&src, &incoming, SourceOptions::default());
}

#[test]
fn a_peer_that_stalls_inside_a_frame_is_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let incoming = IncomingMigration::listen_with(
        &localhost(),
        Arc::new(NewFile(dir.path().join("dst.raw"))),
        ListenOptions {
            frame_timeout: Duration::from_millis(500),
            ..Default::default()
        },
    )
    .unwrap();
    let mut peer = TcpStream::connect(tcp_target(&incoming)).unwrap();
    let hello = Hello {
        version: PROTOCOL_VERSION,
        disk_size_bytes: 1 << 20,
        granularity: 4096,
        header_len: 0,
        role: Role::Bulk,
        flags: 0,
        session: [3; SESSION_ID_LEN],
    };
    wire::write_frame(&mut peer, &Frame::Hello(hello)).unwrap();
    assert!(matches!(
        wire::read_frame(&mut peer).unwrap(),
        Frame::Hello(_)
    ));
    // A frame that begins and never ends; the wait between frames alone is not bounded.
    let zero = Frame::Zero {
        offset: 0,
        len: 4096,
    }
    .encode();
    std::thread::sleep(Duration::from_millis(800));
    assert_eq!(
        incoming.phase(),
        Phase::Precopy,
        "idle between frames is fine"
    );
    peer.write_all(&zero[..5]).unwrap();
    let start = Instant::now();
    assert_eq!(
        incoming.wait_for(Phase::Completed, Duration::from_secs(10)),
        Phase::Failed,
        "{:?}",
        incoming.status()
    );
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );
    assert!(hung_up_within(&mut peer, Duration::from_secs(5)));
}
