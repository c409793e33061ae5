//! Guest end-to-end: restarting `cryptblk serve` under a running VM. The test guest (see
//! guest_e2e.rs) runs rounds of a mixed fio job on a LUKS2 vhost-user-blk disk with 2 queues
//! (1 MiB writes at depth 8 and 4 KiB writes at depth 24, fsync every 8 writes, every block
//! read back and crc32c-verified, `verify_fatal`) while the test kills the daemon with
//! `kill -9` and starts a new one, 8 times, then upgrades it once: SIGTERM, and the new daemon
//! started from another binary file once the old one has drained and exited (docs/operations.md:
//! "Upgrading"). QEMU 7.2 reconnects by itself (`-chardev socket,...,reconnect=1`). Every fio
//! round must pass, and nothing may hang: a restarted daemon the VM does not come back to, or a
//! guest that does not finish, fails the test after a bounded wait.
//!
//! The pause each restart costs the guest is printed: from the kill to the restarted daemon
//! logging that the VM started its queues again (polled every 10 ms), and the longest latency
//! fio saw on any read or write in each round.

mod common;

use common::*;
use std::time::{Duration, Instant};

/// kill -9 restarts, then one SIGTERM restart onto another binary (an upgrade).
const KILLS: usize = 8;
/// How long the guest's I/O runs between restarts: a random time in this range (ms), so that
/// kills land anywhere in fio's rounds (writes, fsyncs, verify reads, between rounds).
const RUNNING_MS: std::ops::Range<u64> = 300..1300;
/// The longest latency (ms) fio reports for any read or write of each round whose JSON report
/// parses (QEMU's own messages share the console and may cut into one). fio's fsync latencies
/// are left out: with libaio they count from long before the fsync is issued.
fn round_max_latencies(console: &str) -> Vec<f64> {
    let mut out = Vec::new();
    let mut json: Option<String> = None;
    for line in console.lines() {
        if line.starts_with("FIO-JSON-BEGIN") {
            json = Some(String::new());
        } else if line.starts_with("FIO-JSON-END") {
            let Some(text) = json.take() else { continue };
            let Ok(report) = serde_json::from_str::<serde_json::Value>(&text) else {
                continue;
            };
            let mut max_ns = 0u64;
            for job in report["jobs"].as_array().into_iter().flatten() {
                for dir in ["read", "write"] {
                    max_ns = max_ns.max(job[dir]["lat_ns"]["max"].as_u64().unwrap_or(0));
                }
            }
            out.push(max_ns as f64 / 1e6);
        } else if let Some(text) = json.as_mut() {
            if !line.starts_with("qemu-system") {
                text.push_str(line);
                text.push('\n');
            }
        }
    }
    out
}

#[test]
fn guest_fio_verify_survives_daemon_kills_and_restarts() {
    let t = TestDir::new();
    let img = t.luks2("img.luks", "64M", &t.key("key"));
    // The upgrade installs a new binary file (a copy: a test has one version of cryptblk) that
    // the next start runs; the running daemon keeps its own, as after `apt upgrade`.
    let upgraded = t.path("cryptblk-upgraded");
    std::fs::copy(bin(), &upgraded).unwrap();
    let serve = t
        .serve()
        .vhost_user()
        .disk(&img)
        .args(&["--num-queues", "2"]);
    let mut serve = serve.log_level("info").start();

    let mut guest = VmConfig::fio_rounds(serve.vhost_socket()).boot(t.root(), "guest");
    // The guest booted and fio runs.
    serve.wait_log(QUEUES_STARTED, BOUND);
    guest.wait_fio_running();

    let mut rng = rand::thread_rng();
    let mut running = || Duration::from_millis(rand::Rng::gen_range(&mut rng, RUNNING_MS));
    let mut pauses = Vec::new();
    for restart in 1..=KILLS + 1 {
        std::thread::sleep(running());
        guest.assert_running();
        let killed = Instant::now();
        if restart <= KILLS {
            serve.kill9();
            serve.restart();
        } else {
            let code = serve.terminate();
            assert_eq!(code, 0, "cryptblk serve on SIGTERM:\n{}", serve.log());
            serve.restart_with(|serve| serve.binary(&upgraded));
        }
        let started = serve.wait_log(QUEUES_STARTED, BOUND);
        pauses.push(started - killed);
    }
    std::thread::sleep(running());

    // The guest finishes its round and must have passed every one.
    let console = guest.stop_and_assert_passed();
    assert_eq!(serve.terminate(), 0, "cryptblk serve:\n{}", serve.log());

    let ms = |d: &Duration| format!("{:.0}", d.as_secs_f64() * 1000.0);
    let kills: Vec<String> = pauses[..KILLS].iter().map(ms).collect();
    let rounds = round_max_latencies(&console);
    eprintln!(
        "restart pause (kill to queues restarted, ms): kill -9 {}; SIGTERM upgrade {}",
        kills.join(" "),
        ms(&pauses[KILLS])
    );
    eprintln!(
        "fio rounds: {}, longest read/write latency per round (ms): {}",
        console.matches("FIO-JSON-END").count(),
        rounds
            .iter()
            .map(|m| format!("{m:.0}"))
            .collect::<Vec<_>>()
            .join(" ")
    );
}
