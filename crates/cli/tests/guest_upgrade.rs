//! Guest end-to-end: a VM's disk through upgrades and kills of a daemon serving several LUKS2
//! disks at cryptblk's default key derivation. The test guest (see guest_e2e.rs) runs rounds
//! of fio with crc32c verify on one of them (2 queues, QEMU `reconnect=1`) while the test
//! alternates `ctl upgrade` (a new daemon process takes the disks, sockets and keys over) and
//! `kill -9` followed by a new daemon with the key cache on, three times each. Every fio round
//! must pass, no restart may need a key derivation, and nothing may hang.
//!
//! The pause each event costs the guest is printed: from the request (or the kill) to the
//! daemon logging that the VM started its queues again, most of it QEMU's one-second
//! reconnect delay.

mod common;

use common::*;
use std::time::{Duration, Instant};

/// Disks the daemon serves (the guest uses the first).
const DISKS: usize = 3;
/// Upgrades and kills, alternating.
const EVENTS: usize = 6;

/// Waits until the VM has started its queues more than `before` times in the log (a
/// successor's lines follow its predecessor's in the same file; a restarted daemon writes a
/// log of its own).
fn wait_started(daemon: &Daemon, before: usize) -> Instant {
    wait_until(BOUND, || {
        (daemon.log().matches(QUEUES_STARTED).count() > before).then(Instant::now)
    })
    .unwrap_or_else(|| {
        panic!(
            "the VM did not come back within {BOUND:?}:\n{}",
            daemon.log()
        )
    })
}

#[test]
fn guest_fio_verify_survives_upgrades_and_kills_without_key_derivation() {
    if !kernel_keyring_available() {
        cryptblk_testutil::skip(
            "the kernel keyring is not available here (the key cache needs it)",
        );
        return;
    }
    let t = TestDir::new();
    let key = t.key("key");
    let config = default_kdf_disks(&t, &key, DISKS, "64M", "num-queues = 2\n");
    let mut daemon = t
        .serve()
        .config(&config)
        .control()
        .args(&["--key-cache", "keyring", "--key-cache-timeout", "120"])
        .log_level("info")
        .start();

    let mut guest = VmConfig::fio_rounds(&t.path("d0.sock")).boot(t.root(), "guest");
    wait_started(&daemon, 0);
    guest.wait_fio_running();

    let mut pauses = Vec::new();
    let mut from_cache = 0;
    for event in 0..EVENTS {
        std::thread::sleep(Duration::from_millis(700));
        guest.assert_running();
        let asked = Instant::now();
        let upgrade = event % 2 == 0;
        let mut before = 0;
        if upgrade {
            before = daemon.log().matches(QUEUES_STARTED).count();
            let answer = daemon.upgrade();
            assert_eq!(answer["without-kdf"], DISKS, "{answer}");
        } else {
            daemon.kill9();
            daemon.restart();
            let log = daemon.log();
            from_cache += log
                .matches("opened with the volume key from the key cache")
                .count();
        }
        pauses.push((upgrade, wait_started(&daemon, before) - asked));
    }
    std::thread::sleep(Duration::from_millis(700));
    let console = guest.stop_and_assert_passed();
    assert_eq!(
        from_cache,
        DISKS * EVENTS / 2,
        "a restart after a kill derived a key"
    );

    let ms = |d: &Duration| format!("{:.0}", d.as_secs_f64() * 1000.0);
    let list = |upgrade: bool| {
        pauses
            .iter()
            .filter(|(u, _)| *u == upgrade)
            .map(|(_, d)| ms(d))
            .collect::<Vec<_>>()
            .join(" ")
    };
    eprintln!(
        "VM pause (request or kill to queues restarted, ms): upgrade {}; kill -9 + restart {}; fio rounds {}",
        list(true),
        list(false),
        console.matches("FIO-JSON-END").count()
    );
    // Detaching removes the cached keys: nothing of this test stays in the keyring.
    for i in 0..DISKS {
        daemon.ctl_ok(&["disk-remove", &format!("d{i}"), "--force"]);
    }
    assert_eq!(daemon.terminate(), 0);
}
