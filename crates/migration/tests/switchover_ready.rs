//! A switchover asked for before the destination serves the disk (its header still arriving,
//! or being opened) waits for the destination's `Ready`, with the source serving on
//! meanwhile; a destination that does not announce it is switched to when asked.

mod common;

use common::*;
use cryptblk_block::BlockDevice;
use cryptblk_migration::channel::ListenOptions;
use cryptblk_migration::{
    IncomingMigration, MigrationAddress, MigrationError, NewFile, Phase, SourceMigration,
    SourceOptions,
};
use std::sync::Arc;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(120);

fn localhost() -> MigrationAddress {
    "tcp:127.0.0.1:0".parse().unwrap()
}

fn listen(dir: &std::path::Path, announces_ready: bool) -> Arc<IncomingMigration> {
    IncomingMigration::listen_with(
        &localhost(),
        Arc::new(NewFile(dir.join("dst.luks"))),
        ListenOptions {
            announces_ready,
            ..Default::default()
        },
    )
    .unwrap()
}

fn start(src: &SourceDisk, incoming: &IncomingMigration) -> Arc<SourceMigration> {
    SourceMigration::start(
        src.raw.clone(),
        src.tracker.clone(),
        incoming.address(),
        SourceOptions {
            postcopy: true,
            preempt: true,
            max_bandwidth: Some(4 << 20),
            ..Default::default()
        },
    )
    .unwrap()
}

/// A guest write on the source, recorded in the model.
fn source_write(src: &SourceDisk, fill: u8, offset: u64) {
    let buf = vec![fill; SECTOR];
    src.tracker.write_at(&buf, offset).unwrap();
    src.model.lock().unwrap()[offset as usize..offset as usize + SECTOR].copy_from_slice(&buf);
}

#[test]
fn a_postcopy_asked_for_early_happens_once_the_destination_serves() {
    let dir = tempfile::tempdir().unwrap();
    let src = luks2_source(&dir.path().join("src.luks"), 16 << 20, 41);
    let incoming = listen(dir.path(), true);
    let mig = start(&src, &incoming);

    // Asked for at once, before the destination has even opened the disk: accepted, deferred.
    mig.switchover(true).unwrap();
    let st = mig.status();
    assert!(st.switchover_pending, "{st:?}");
    assert_eq!(st.phase, Phase::Precopy);
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        incoming.phase(),
        Phase::Precopy,
        "the destination went live before it served the disk"
    );
    // The source serves on meanwhile: the guest's writes land and travel.
    assert!(!src.tracker.is_fenced());
    source_write(&src, 0x5a, 3 << 20);
    // Asked for again while it waits: refused, saying why.
    let again = mig.switchover(true).unwrap_err();
    assert!(
        matches!(again, MigrationError::WrongPhase { .. }) && again.to_string().contains("waits"),
        "{again}"
    );

    let dst_disk = destination_disk(&incoming);
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(
        mig.status().phase,
        Phase::Precopy,
        "opened is not yet served: only ready() says that"
    );
    incoming.ready().unwrap();
    assert_eq!(mig.wait_for(Phase::Postcopy, WAIT), Phase::Postcopy);
    assert_eq!(incoming.wait_for(Phase::Postcopy, WAIT), Phase::Postcopy);
    let st = mig.status();
    assert!(!st.switchover_pending && st.downtime.is_some(), "{st:?}");
    assert!(src.tracker.is_fenced());

    // The destination serves everything, the write made while the switchover waited too.
    assert_matches_model(&*dst_disk, &src.model.lock().unwrap());
    assert_eq!(mig.wait(WAIT), Phase::Completed, "{:?}", mig.status());
    assert_eq!(incoming.wait_for(Phase::Completed, WAIT), Phase::Completed);
    // Said again after the switchover: nothing to say.
    incoming.ready().unwrap();
}

#[test]
fn a_waiting_switchover_can_still_be_cancelled() {
    let dir = tempfile::tempdir().unwrap();
    let src = luks2_source(&dir.path().join("src.luks"), 8 << 20, 42);
    let incoming = listen(dir.path(), true);
    let mig = start(&src, &incoming);
    mig.switchover(true).unwrap();
    assert!(mig.status().switchover_pending);
    mig.cancel().unwrap();
    assert_eq!(mig.wait(WAIT), Phase::Cancelled);
    assert!(incoming.wait_for(Phase::Completed, WAIT).is_final());
    assert!(!src.tracker.is_fenced() && !src.tracker.is_tracking());
    source_write(&src, 0x33, 0);
    assert_matches_model(&*src.tracker, &src.model.lock().unwrap());
}

/// A destination that does not say `Ready` (as one from before it): the source switches
/// over when asked, as it always did.
#[test]
fn a_destination_that_does_not_announce_ready_is_switched_to_when_asked() {
    let dir = tempfile::tempdir().unwrap();
    let src = luks2_source(&dir.path().join("src.luks"), 8 << 20, 43);
    let incoming = listen(dir.path(), false);
    let mig = start(&src, &incoming);
    let dst_disk = destination_disk(&incoming);
    mig.switchover(true).unwrap();
    assert!(src.tracker.is_fenced(), "fenced at once, not deferred");
    assert!(!mig.status().switchover_pending);
    assert_eq!(incoming.wait_for(Phase::Postcopy, WAIT), Phase::Postcopy);
    // ready() has nothing to say to it.
    incoming.ready().unwrap();
    assert_eq!(mig.wait(WAIT), Phase::Completed, "{:?}", mig.status());
    assert_matches_model(&*dst_disk, &src.model.lock().unwrap());
}
