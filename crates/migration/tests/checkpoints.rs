//! A migration carries the source disk's checkpoints to a destination that takes them, at the
//! switchover and before the destination goes live; a destination older than checkpoints is
//! sent none (and its answer, the source's own Hello flags echoed, is not taken for a yes).

mod common;

use common::*;
use cryptblk_migration::wire::{self, Frame, FLAG_CHECKPOINTS};
use cryptblk_migration::{
    CheckpointSource, IncomingMigration, Phase, SourceMigration, SourceOptions,
};
use cryptblk_volume::checkpoint::{CarriedCheckpoint, CarriedCheckpoints};
use std::net::TcpListener;
use std::sync::{Arc, Mutex};
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(120);

fn carried() -> CarriedCheckpoints {
    CarriedCheckpoints {
        granularity: 64 << 10,
        covered: 4 << 20,
        checkpoints: vec![
            CarriedCheckpoint {
                name: "c0".into(),
                created: 10,
                runs: vec![(0, 2), (40, 1)],
            },
            CarriedCheckpoint {
                name: "c1".into(),
                created: 20,
                runs: vec![(3, 1)],
            },
        ],
    }
}

fn options(postcopy: bool, checkpoints: Option<CarriedCheckpoints>) -> SourceOptions {
    SourceOptions {
        chunk_size: 256 << 10,
        postcopy,
        checkpoints: checkpoints.map(|c| CheckpointSource(Arc::new(move || Ok(c.clone())))),
        ..Default::default()
    }
}

/// Migrates a 2 MiB disk with `checkpoints` on the source; returns what the destination's
/// hook heard, and the destination's phase when it did.
fn migrate(
    postcopy: bool,
    checkpoints: Option<CarriedCheckpoints>,
) -> (Option<CarriedCheckpoints>, Phase) {
    let dir = tempfile::tempdir().unwrap();
    let src = luks2_source(&dir.path().join("src.luks"), 2 << 20, 3);
    let incoming = IncomingMigration::listen(
        &"tcp:127.0.0.1:0".parse().unwrap(),
        &dir.path().join("dst.luks"),
        None,
    )
    .unwrap();
    let carries = checkpoints.is_some();
    let mig = SourceMigration::start(
        src.raw.clone(),
        src.tracker.clone(),
        incoming.address(),
        options(postcopy, checkpoints),
    )
    .unwrap();
    incoming.wait_header(WAIT).unwrap();
    assert_eq!(incoming.carries_checkpoints(), carries);
    let heard = Arc::new(Mutex::new(None));
    let (h, watched) = (heard.clone(), incoming.clone());
    incoming.on_checkpoints(Box::new(move |c| {
        *h.lock().unwrap() = Some((c, watched.phase()));
    }));
    mig.switchover(postcopy).unwrap();
    assert_eq!(mig.wait(WAIT), Phase::Completed, "{:?}", mig.status());
    assert_eq!(incoming.wait_for(Phase::Completed, WAIT), Phase::Completed);
    let heard = heard.lock().unwrap().take();
    heard.expect("the hook is called at every switchover")
}

#[test]
fn precopy_carries_the_checkpoints_before_the_destination_is_live() {
    let (got, phase) = migrate(false, Some(carried()));
    assert_eq!(got, Some(carried()));
    assert_eq!(
        phase,
        Phase::Precopy,
        "heard after the destination went live"
    );
}

#[test]
fn postcopy_carries_the_checkpoints_before_the_destination_is_live() {
    let (got, phase) = migrate(true, Some(carried()));
    assert_eq!(got, Some(carried()));
    assert_eq!(
        phase,
        Phase::Precopy,
        "heard after the destination went live"
    );
}

#[test]
fn a_source_without_checkpoints_says_so_at_the_switchover() {
    let (got, phase) = migrate(false, None);
    assert_eq!(got, None);
    assert_eq!(phase, Phase::Precopy);
}

/// A destination older than checkpoints answers with the source's own Hello (flags echoed):
/// the source must not send it a frame it cannot parse.
#[test]
fn an_older_destination_is_sent_no_checkpoints() {
    let dir = tempfile::tempdir().unwrap();
    let src = luks2_source(&dir.path().join("src.luks"), 1 << 20, 5);
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let to = format!("tcp:{}", listener.local_addr().unwrap())
        .parse()
        .unwrap();
    let old = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let hello = match wire::read_frame(&mut s).unwrap() {
            Frame::Hello(h) => h,
            other => panic!("{other:?}"),
        };
        assert_ne!(hello.flags & FLAG_CHECKPOINTS, 0, "the source offers them");
        wire::write_frame(&mut s, &Frame::Hello(hello)).unwrap();
        let mut kinds = Vec::new();
        loop {
            let frame = wire::read_frame(&mut s).unwrap();
            kinds.push(frame.name());
            if frame == Frame::Complete {
                wire::write_frame(&mut s, &Frame::Complete).unwrap();
                return kinds;
            }
        }
    });
    let mig = SourceMigration::start(
        src.raw.clone(),
        src.tracker.clone(),
        &to,
        options(false, Some(carried())),
    )
    .unwrap();
    mig.switchover(false).unwrap();
    assert_eq!(mig.wait(WAIT), Phase::Completed, "{:?}", mig.status());
    let kinds = old.join().unwrap();
    assert!(kinds.contains(&"Chunk"), "{kinds:?}");
    assert!(!kinds.contains(&"Checkpoints"), "{kinds:?}");
}
