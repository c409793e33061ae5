//! Two ends of a real migration in one process, over TCP (and TLS): LUKS2 images, verified
//! guest I/O on the source during precopy and on the destination during postcopy, cuts and
//! recovery, and hostile peers.

mod common;

use common::*;
use cryptblk_block::BlockDevice;
use cryptblk_migration::wire::{self, Frame, Hello, Role, SESSION_ID_LEN};
use cryptblk_migration::{
    IncomingMigration, MigrationAddress, Phase, SourceMigration, SourceOptions, PROTOCOL_VERSION,
};
use cryptblk_volume::{open_luks_volume, VolumeOptions};
use std::io::Write;
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(120);

fn localhost() -> MigrationAddress {
    "tcp:127.0.0.1:0".parse().unwrap()
}

fn listen(dir: &std::path::Path) -> Arc<IncomingMigration> {
    IncomingMigration::listen(&localhost(), &dir.join("dst.luks"), None).unwrap()
}

/// Reopens the destination image from scratch and checks it against the model (once the
/// migration's threads let go of the file).
fn assert_destination_image(dir: &std::path::Path, model: &[u8]) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let vol = loop {
        match open_luks_volume(dir.join("dst.luks"), PW, &VolumeOptions::default()) {
            Ok(v) => break v,
            Err(e) if std::time::Instant::now() < deadline && e.to_string().contains("in use") => {
                std::thread::sleep(Duration::from_millis(50))
            }
            Err(e) => panic!("{e}"),
        }
    };
    assert_matches_model(&vol, model);
}

#[test]
fn precopy_under_concurrent_writes_then_switchover() {
    let dir = tempfile::tempdir().unwrap();
    let src = luks2_source(&dir.path().join("src.luks"), 16 << 20, 1);
    let incoming = listen(dir.path());
    let stop = Arc::new(AtomicBool::new(false));
    let ops = Arc::new(AtomicU64::new(0));
    let writer = spawn_io(
        src.tracker.clone(),
        src.model.clone(),
        stop.clone(),
        2,
        true,
        ops.clone(),
    );
    let mig = SourceMigration::start(
        src.raw.clone(),
        src.tracker.clone(),
        incoming.address(),
        SourceOptions {
            chunk_size: 256 << 10,
            max_bandwidth: Some(24 << 20),
            ..Default::default()
        },
    )
    .unwrap();
    // A second source is refused at once, with the reason.
    let other = luks2_source(&dir.path().join("other.luks"), 4 << 20, 13);
    let err = SourceMigration::start(
        other.raw.clone(),
        other.tracker.clone(),
        incoming.address(),
        SourceOptions::default(),
    )
    .unwrap_err();
    assert!(err.to_string().contains("already receives"), "{err}");
    // Keep writing until the first full pass is over, so that writes behind its cursor need a
    // second one.
    let deadline = std::time::Instant::now() + WAIT;
    while mig.status().passes < 1 {
        assert!(std::time::Instant::now() < deadline, "{:?}", mig.status());
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(200));
    stop.store(true, Ordering::SeqCst);
    writer.join().unwrap();
    assert!(ops.load(Ordering::SeqCst) > 10, "the writer hardly ran");
    let status = mig.status();
    assert_eq!(status.phase, Phase::Precopy, "{status:?}");

    mig.switchover(false).unwrap();
    // Fenced: the source serves no more I/O, so nothing can be lost after the handover.
    let mut buf = vec![0u8; SECTOR];
    let err = src.tracker.read_at(&mut buf, 0).unwrap_err();
    assert!(err.to_string().contains("handed over"), "{err}");
    assert_eq!(mig.wait(WAIT), Phase::Completed, "{:?}", mig.status());
    assert_eq!(
        incoming.wait_for(Phase::Completed, WAIT),
        Phase::Completed,
        "{:?}",
        incoming.status()
    );
    let status = mig.status();
    assert!(
        status.passes >= 2,
        "writes during the copy need more passes: {status:?}"
    );
    assert!(
        status.zero_bytes > 0,
        "unwritten space must travel as holes: {status:?}"
    );
    assert!(status.downtime.is_some());
    assert_eq!(status.dirty_blocks, 0);

    // Ciphertext identical, and it decrypts to exactly what the guest wrote.
    assert_eq!(
        std::fs::read(dir.path().join("src.luks")).unwrap(),
        std::fs::read(dir.path().join("dst.luks")).unwrap()
    );
    drop(incoming);
    assert_destination_image(dir.path(), &src.model.lock().unwrap());
}

/// Postcopy: writes on the source during precopy, then the destination goes live while most of
/// the disk is still missing and a writer and a reader work on it, fetching on demand.
fn postcopy_with_destination_io(preempt: bool, tls: Option<&std::path::Path>) {
    let dir = tempfile::tempdir().unwrap();
    let src = luks2_source(&dir.path().join("src.luks"), 32 << 20, 3);
    let (server_tls, client_tls) = match tls {
        Some(creds) => (
            Some(Arc::new(cryptblk_tls::server_config(creds).unwrap())),
            Some(Arc::new(cryptblk_tls::client_config(creds).unwrap())),
        ),
        None => (None, None),
    };
    let incoming =
        IncomingMigration::listen(&localhost(), &dir.path().join("dst.luks"), server_tls).unwrap();
    let mig = SourceMigration::start(
        src.raw.clone(),
        src.tracker.clone(),
        incoming.address(),
        SourceOptions {
            chunk_size: 1 << 20,
            max_bandwidth: Some(8 << 20),
            postcopy: true,
            preempt,
            tls: client_tls,
            ..Default::default()
        },
    )
    .unwrap();
    let dst_disk = destination_disk(&incoming);

    let stop = Arc::new(AtomicBool::new(false));
    let ops = Arc::new(AtomicU64::new(0));
    let writer = spawn_io(
        src.tracker.clone(),
        src.model.clone(),
        stop.clone(),
        4,
        true,
        ops.clone(),
    );
    std::thread::sleep(Duration::from_millis(500));
    stop.store(true, Ordering::SeqCst);
    writer.join().unwrap();

    mig.switchover(true).unwrap();
    assert_eq!(mig.wait_for(Phase::Postcopy, WAIT), Phase::Postcopy);
    assert_eq!(incoming.wait_for(Phase::Postcopy, WAIT), Phase::Postcopy);
    let missing = incoming.status().missing_blocks;
    assert!(
        missing > 1000,
        "postcopy should start with most blocks missing: {missing}"
    );

    let stop = Arc::new(AtomicBool::new(false));
    let dst_ops = Arc::new(AtomicU64::new(0));
    let dev: Arc<dyn BlockDevice> = dst_disk.clone();
    let workers = [
        spawn_io(
            dev.clone(),
            src.model.clone(),
            stop.clone(),
            5,
            true,
            dst_ops.clone(),
        ),
        spawn_io(
            dev,
            src.model.clone(),
            stop.clone(),
            6,
            false,
            dst_ops.clone(),
        ),
    ];
    std::thread::sleep(Duration::from_millis(1500));
    stop.store(true, Ordering::SeqCst);
    for w in workers {
        w.join().unwrap();
    }
    assert!(
        dst_ops.load(Ordering::SeqCst) > 10,
        "destination I/O hardly ran"
    );
    assert_eq!(mig.wait(WAIT), Phase::Completed, "{:?}", mig.status());
    assert_eq!(incoming.wait_for(Phase::Completed, WAIT), Phase::Completed);
    let st = incoming.status();
    assert!(
        st.urgent_requests > 0,
        "reads of missing blocks must fetch: {st:?}"
    );
    assert!(st.latency.count > 0 && st.latency.p99_us > 0, "{st:?}");
    assert!(mig.status().urgent_served > 0);
    assert_matches_model(&*dst_disk, &src.model.lock().unwrap());
    drop(dst_disk);
    drop(incoming);
    assert_destination_image(dir.path(), &src.model.lock().unwrap());
}

#[test]
fn postcopy_shared_channel() {
    postcopy_with_destination_io(false, None);
}

#[test]
fn postcopy_with_preempt_channel() {
    postcopy_with_destination_io(true, None);
}

#[test]
fn postcopy_with_preempt_over_tls() {
    let creds = tempfile::tempdir().unwrap();
    make_credentials(creds.path(), "cryptblk migration CA");
    postcopy_with_destination_io(true, Some(creds.path()));
}

#[test]
fn tls_refuses_a_source_the_destination_does_not_trust() {
    let (ours, theirs) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    make_credentials(ours.path(), "destination CA");
    make_credentials(theirs.path(), "stranger CA");
    let dir = tempfile::tempdir().unwrap();
    let src = luks2_source(&dir.path().join("src.luks"), 4 << 20, 7);
    let server = cryptblk_tls::server_config(ours.path());
    let incoming = IncomingMigration::listen(
        &localhost(),
        &dir.path().join("dst.luks"),
        Some(Arc::new(server.unwrap())),
    )
    .unwrap();
    let err = SourceMigration::start(
        src.raw.clone(),
        src.tracker.clone(),
        incoming.address(),
        SourceOptions {
            tls: Some(Arc::new(
                cryptblk_tls::client_config(theirs.path()).unwrap(),
            )),
            ..Default::default()
        },
    )
    .unwrap_err();
    assert!(err.to_string().contains("destination"), "{err}");
    assert_eq!(
        incoming.phase(),
        Phase::Setup,
        "a refused peer must change nothing"
    );
    assert!(!dir.path().join("dst.luks").exists());
    // The source was never touched.
    src.tracker.write_at(&[1u8; SECTOR], 0).unwrap();
}

#[test]
fn connection_cut_mid_postcopy_pauses_and_recovers() {
    let dir = tempfile::tempdir().unwrap();
    let src = luks2_source(&dir.path().join("src.luks"), 32 << 20, 8);
    let incoming = listen(dir.path());
    let direct = incoming.address().clone();
    let MigrationAddress::Tcp(target) = &direct else {
        unreachable!()
    };
    let proxy = Proxy::start(target.clone());
    let mig = SourceMigration::start(
        src.raw.clone(),
        src.tracker.clone(),
        &format!("tcp:{}", proxy.addr).parse().unwrap(),
        SourceOptions {
            chunk_size: 1 << 20,
            max_bandwidth: Some(4 << 20),
            postcopy: true,
            preempt: true,
            ..Default::default()
        },
    )
    .unwrap();
    let dst_disk = destination_disk(&incoming);
    mig.switchover(true).unwrap();
    assert_eq!(incoming.wait_for(Phase::Postcopy, WAIT), Phase::Postcopy);

    // A writer on the destination, then the network goes away.
    let stop = Arc::new(AtomicBool::new(false));
    let ops = Arc::new(AtomicU64::new(0));
    let dev: Arc<dyn BlockDevice> = dst_disk.clone();
    let writer = spawn_io(dev, src.model.clone(), stop.clone(), 9, true, ops.clone());
    std::thread::sleep(Duration::from_millis(500));
    stop.store(true, Ordering::SeqCst);
    writer.join().unwrap();
    proxy.cut();
    assert_eq!(
        mig.wait_for(Phase::PostcopyPaused, WAIT),
        Phase::PostcopyPaused
    );
    assert_eq!(
        incoming.wait_for(Phase::PostcopyPaused, WAIT),
        Phase::PostcopyPaused
    );
    assert!(incoming.status().missing_blocks > 0);

    // A read of the end of the disk (sent last) waits: nothing is served wrongly meanwhile.
    let last = src.payload - SECTOR as u64;
    let reader = {
        let disk = dst_disk.clone();
        std::thread::spawn(move || {
            let mut buf = vec![0u8; SECTOR];
            disk.read_at(&mut buf, last).unwrap();
            buf
        })
    };
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        !reader.is_finished(),
        "a read of a missing block returned while paused"
    );

    mig.recover(&direct).unwrap();
    let got = reader.join().unwrap();
    let model = src.model.lock().unwrap().clone();
    assert_eq!(
        got,
        model[last as usize..],
        "the waiting read got the right data"
    );
    assert_eq!(mig.wait(WAIT), Phase::Completed, "{:?}", mig.status());
    assert_eq!(incoming.wait_for(Phase::Completed, WAIT), Phase::Completed);
    assert_matches_model(&*dst_disk, &model);
    drop(dst_disk);
    drop(incoming);
    assert_destination_image(dir.path(), &model);
}

#[test]
fn cancel_during_precopy_leaves_the_source_running() {
    let dir = tempfile::tempdir().unwrap();
    let src = luks2_source(&dir.path().join("src.luks"), 16 << 20, 10);
    let incoming = listen(dir.path());
    let mig = SourceMigration::start(
        src.raw.clone(),
        src.tracker.clone(),
        incoming.address(),
        SourceOptions {
            max_bandwidth: Some(4 << 20),
            ..Default::default()
        },
    )
    .unwrap();
    incoming.wait_header(WAIT).unwrap();
    mig.cancel().unwrap();
    assert_eq!(mig.wait(WAIT), Phase::Cancelled);
    assert!(incoming.wait_for(Phase::Completed, WAIT).is_final());
    assert_ne!(incoming.phase(), Phase::Completed);
    assert!(
        !dir.path().join("dst.luks").exists(),
        "the partial image stays behind"
    );
    assert!(!src.tracker.is_tracking() && !src.tracker.is_fenced());
    let buf = vec![7u8; SECTOR];
    src.tracker.write_at(&buf, 0).unwrap();
    src.model.lock().unwrap()[..SECTOR].copy_from_slice(&buf);
    assert_matches_model(&*src.tracker, &src.model.lock().unwrap());
}

/// Speaks the protocol by hand to the destination.
fn raw_peer(incoming: &IncomingMigration) -> TcpStream {
    let MigrationAddress::Tcp(hp) = incoming.address() else {
        unreachable!()
    };
    TcpStream::connect(hp).unwrap()
}

fn hello(role: Role, version: u32, session: u8) -> Frame {
    Frame::Hello(Hello {
        version,
        disk_size_bytes: 1 << 20,
        granularity: 4096,
        header_len: 0,
        role,
        flags: 0,
        session: [session; SESSION_ID_LEN],
    })
}

/// The frames the destination sends back until it closes.
fn replies(mut s: TcpStream) -> Vec<Frame> {
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut out = Vec::new();
    while let Ok(f) = wire::read_frame(&mut s) {
        out.push(f);
    }
    out
}

fn error_of(frames: &[Frame]) -> String {
    frames
        .iter()
        .find_map(|f| match f {
            Frame::Error { message } => Some(message.clone()),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no Error frame in {frames:?}"))
}

#[test]
fn version_mismatch_and_strangers_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let incoming = listen(dir.path());
    let mut s = raw_peer(&incoming);
    wire::write_frame(&mut s, &hello(Role::Bulk, 1, 1)).unwrap();
    let msg = error_of(&replies(s));
    assert!(msg.contains("version"), "{msg}");
    // An urgent channel for a migration that does not exist.
    let mut s = raw_peer(&incoming);
    wire::write_frame(&mut s, &hello(Role::Urgent, PROTOCOL_VERSION, 2)).unwrap();
    assert!(error_of(&replies(s)).contains("session"));
    assert_eq!(incoming.phase(), Phase::Setup);
    assert!(!dir.path().join("dst.luks").exists());
}

/// A bad frame after a good handshake: the destination says why, hangs up, fails the
/// migration and removes the partial image; nothing of the frame was written.
fn hostile(frame_bytes: Vec<u8>, expect: &str) {
    let dir = tempfile::tempdir().unwrap();
    let incoming = listen(dir.path());
    let mut s = raw_peer(&incoming);
    wire::write_frame(&mut s, &hello(Role::Bulk, PROTOCOL_VERSION, 3)).unwrap();
    s.write_all(&frame_bytes).unwrap();
    let frames = replies(s);
    assert!(
        matches!(frames.first(), Some(Frame::Hello(_))),
        "{frames:?}"
    );
    let msg = error_of(&frames);
    assert!(msg.contains(expect), "'{msg}' should mention '{expect}'");
    assert_eq!(incoming.wait_for(Phase::Failed, WAIT), Phase::Failed);
    assert!(!dir.path().join("dst.luks").exists());
}

#[test]
fn chunk_outside_the_disk_is_refused() {
    hostile(Frame::chunk(1 << 20, vec![1u8; 4096]).encode(), "outside");
}

#[test]
fn corrupted_chunk_is_refused() {
    let mut bytes = Frame::chunk(0, vec![1u8; 4096]).encode();
    let n = bytes.len();
    bytes[n - 1] ^= 0x40;
    hostile(bytes, "checksum");
}

#[test]
fn unaligned_chunk_is_refused() {
    hostile(Frame::chunk(100, vec![1u8; 4096]).encode(), "aligned");
}

#[test]
fn garbage_is_refused() {
    hostile(b"GET / HTTP/1.1\r\n\r\n".to_vec(), "magic");
}

/// After the pass limit, dirty blocks wait for the switchover instead of being resent, and the
/// switchover still sends them all.
#[test]
fn pass_limit_holds_resends_until_switchover() {
    let dir = tempfile::tempdir().unwrap();
    let src = luks2_source(&dir.path().join("src.luks"), 8 << 20, 11);
    let incoming = listen(dir.path());
    let mig = SourceMigration::start(
        src.raw.clone(),
        src.tracker.clone(),
        incoming.address(),
        SourceOptions {
            max_passes: 1,
            ..Default::default()
        },
    )
    .unwrap();
    let deadline = std::time::Instant::now() + WAIT;
    while mig.status().passes < 1 {
        assert!(std::time::Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(20));
    }
    let stop = Arc::new(AtomicBool::new(false));
    let ops = Arc::new(AtomicU64::new(0));
    let writer = spawn_io(
        src.tracker.clone(),
        src.model.clone(),
        stop.clone(),
        12,
        true,
        ops.clone(),
    );
    std::thread::sleep(Duration::from_millis(500));
    stop.store(true, Ordering::SeqCst);
    writer.join().unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let st = mig.status();
    assert_eq!(st.passes, 1, "{st:?}");
    assert!(
        st.dirty_blocks > 0,
        "writes after the limit stay dirty: {st:?}"
    );
    mig.switchover(false).unwrap();
    assert_eq!(mig.wait(WAIT), Phase::Completed, "{:?}", mig.status());
    assert_eq!(incoming.wait_for(Phase::Completed, WAIT), Phase::Completed);
    drop(incoming);
    assert_destination_image(dir.path(), &src.model.lock().unwrap());
}
