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

use common::guest::{build_guest, Guest, Serve, BOUND};
use common::MIB;
use std::ffi::OsStr;
use std::path::Path;
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
    let artifacts = build_guest();
    let dir = tempfile::tempdir().unwrap();
    let path = |name: &str| dir.path().join(name);
    let (key, img, socket) = (path("key"), path("img.luks"), path("vub.sock"));
    std::fs::write(&key, b"guest restart passphrase").unwrap();
    let os = OsStr::new;
    common::cryptblk([
        os("format"),
        os("--type"),
        os("luks2"),
        os("--pbkdf"),
        os("pbkdf2"),
        os("--pbkdf-force-iterations"),
        os("1000"),
        os("--key-file"),
        key.as_os_str(),
        img.as_os_str(),
        os("64M"),
    ])
    .ok();
    let args = [
        os("--vhost-user-blk"),
        socket.as_os_str(),
        os("--image"),
        img.as_os_str(),
        os("--key-file"),
        key.as_os_str(),
        os("--num-queues"),
        os("2"),
    ];
    let installed = Path::new(env!("CARGO_BIN_EXE_cryptblk"));
    // The upgrade installs a new binary file (a copy: a test has one version of cryptblk) that
    // the next start runs; the running daemon keeps its own, as after `apt upgrade`.
    let upgraded = path("cryptblk-upgraded");
    std::fs::copy(installed, &upgraded).unwrap();
    let mut serve = Serve::start(installed, &args, &socket, path("serve-0.log"));

    let mut guest = Guest::start_restart_verify(&artifacts, &socket, 32 * MIB, dir.path());
    // The guest booted and fio runs.
    serve.wait_started();
    guest.wait_for_console("FIO-JSON-BEGIN 1", "fio never started", BOUND);

    let mut rng = rand::thread_rng();
    let mut running = || Duration::from_millis(rand::Rng::gen_range(&mut rng, RUNNING_MS));
    let mut pauses = Vec::new();
    for restart in 1..=KILLS + 1 {
        std::thread::sleep(running());
        guest.assert_running();
        let killed = Instant::now();
        if restart <= KILLS {
            serve.kill();
        } else {
            let output = serve.output();
            let status = serve.terminate();
            assert!(
                status.success(),
                "cryptblk serve on SIGTERM: {status}\n{output}"
            );
        }
        let binary = if restart <= KILLS {
            installed
        } else {
            &upgraded
        };
        serve = Serve::start(
            binary,
            &args,
            &socket,
            path(&format!("serve-{restart}.log")),
        );
        let started = serve.wait_started();
        pauses.push(started - killed);
    }
    std::thread::sleep(running());

    // The guest finishes its round and must have passed every one.
    let console = guest.stop_and_assert_passed();
    let output = serve.output();
    let status = serve.terminate();
    assert!(status.success(), "cryptblk serve: {status}\n{output}");

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
