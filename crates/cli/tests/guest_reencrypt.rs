//! Guest end-to-end: a running VM's disk re-encrypted online. The test guest (see
//! guest_e2e.rs) runs rounds of fio with crc32c verify (`restart-verify`: large and small
//! writes on 2 queues, fsyncs, every block read back, `verify_fatal`) on a vhost-user-blk disk
//! while `reencrypt-start` replaces the volume key of a LUKS2 disk, or encrypts a raw disk in
//! place (`--encrypt`); the daemon is killed with `kill -9` three times during the work,
//! restarted on the image (which it serves in mid-reencryption; an encrypted disk's image is
//! LUKS2 from the start, so it is attached with the passphrase from then on) and told to
//! continue. Every fio round must pass, and cryptsetup must open the final image.

mod common;

use common::*;
use std::time::{Duration, Instant};

const KILLS: usize = 3;

fn start_reencryption(daemon: &Daemon, key: &Key) -> serde_json::Value {
    start_with(daemon, key, &[])
}

fn start_with(daemon: &Daemon, key: &Key, extra: &[&str]) -> serde_json::Value {
    let start = "reencrypt-start vol --key-file {} --max-bandwidth 4M";
    daemon.ctl_ok(&argv!(start, key; CTL_CHEAP_KDF, extra))
}

/// Kills the daemon `KILLS` times while the work runs, restarting it (the first restart
/// changed by `change`) and continuing; then waits for the end. Returns the bytes done at each
/// kill.
fn kill_and_restart_through(
    daemon: &mut Daemon,
    guest: &mut Vm,
    key: &Key,
    change: impl FnOnce(Serve) -> Serve,
) -> Vec<u64> {
    let mut change = Some(change);
    let mut rng = rand::thread_rng();
    let mut done_at_kill = Vec::new();
    for _ in 1..=KILLS {
        std::thread::sleep(Duration::from_millis(rand::Rng::gen_range(
            &mut rng,
            1000..2500,
        )));
        guest.assert_running();
        let st = daemon.ctl_ok(&["reencrypt-status", "vol"]);
        assert_eq!(
            st["phase"], "running",
            "finished too early to kill mid-way: {st}"
        );
        done_at_kill.push(st["bytes-done"].as_u64().unwrap());
        daemon.kill9();
        match change.take() {
            Some(change) => daemon.restart_with(change),
            None => daemon.restart(),
        }
        daemon.wait_log(QUEUES_STARTED, BOUND);
        let st = daemon.ctl_ok(&["reencrypt-status", "vol"]);
        assert_eq!(st["phase"], "paused", "{st}: {}", daemon.log());
        start_reencryption(daemon, key);
    }
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        let st = daemon.ctl_ok(&["reencrypt-status", "vol"]);
        if st["phase"] == "finished" {
            break;
        }
        assert!(st["last-error"].is_null(), "{st}");
        assert!(Instant::now() < deadline, "not finished: {st}");
        guest.assert_running();
        std::thread::sleep(Duration::from_millis(200));
    }
    std::thread::sleep(Duration::from_millis(1000));
    done_at_kill
}

/// The guest on the daemon's disk, running rounds of verified fio until told to stop.
fn boot(t: &TestDir, daemon: &mut Daemon) -> Vm {
    let mut guest = VmConfig::fio_rounds(daemon.vhost_socket()).boot(t.root(), "guest");
    daemon.wait_log(QUEUES_STARTED, BOUND);
    guest.wait_fio_running();
    guest
}

#[test]
fn guest_fio_verify_passes_while_its_disk_is_reencrypted_through_daemon_kills() {
    let t = TestDir::new();
    let key = t.key("key");
    let img = t.luks2("img.luks", "64M", &key);
    let old_key = xts::cryptsetup_volume_key(&img, &key);
    let serve = t.serve().vhost_user().disk(&img).name("vol").control();
    let mut daemon = serve.args(&["--num-queues", "2"]).log_level("info").start();
    let mut guest = boot(&t, &mut daemon);

    let st = start_reencryption(&daemon, &key);
    assert_eq!(st["phase"], "running", "{st}");
    let done_at_kill = kill_and_restart_through(&mut daemon, &mut guest, &key, |s| s);

    let console = guest.stop_and_assert_passed();
    assert_eq!(daemon.terminate(), 0, "cryptblk serve:\n{}", daemon.log());

    let dump = tool("cryptsetup", ["luksDump", s(&img)]);
    dump.ok();
    assert!(!dump.stdout.contains("online-reencrypt"), "{}", dump.stdout);
    assert!(img.opens_with(&key));
    assert_ne!(xts::cryptsetup_volume_key(&img, &key), old_key);
    eprintln!(
        "fio rounds: {}; bytes done at each kill: {done_at_kill:?}",
        console.matches("FIO-JSON-END").count()
    );
}

#[test]
fn guest_fio_verify_passes_while_its_raw_disk_is_encrypted_through_daemon_kills() {
    let t = TestDir::new();
    let key = t.key("key");
    const DISK: u64 = 64 * MIB;
    let img = t.raw("img.raw", DISK);
    let serve = t.serve().vhost_user().disk(&img).name("vol").control();
    let mut daemon = serve.args(&["--num-queues", "2"]).log_level("info").start();
    let mut guest = boot(&t, &mut daemon);

    let st = start_with(&daemon, &key, &["--encrypt", "--reduce-device-size", "8M"]);
    assert_eq!(st["phase"], "running", "{st}");
    assert_eq!(st["mode"], "encrypt", "{st}");
    // The image is LUKS2 from the start: the daemon attaches it with the passphrase after that.
    let done_at_kill =
        kill_and_restart_through(&mut daemon, &mut guest, &key, |serve| serve.key(&key));

    let console = guest.stop_and_assert_passed();
    assert_eq!(daemon.terminate(), 0, "cryptblk serve:\n{}", daemon.log());

    let dump = tool("cryptsetup", ["luksDump", s(&img)]);
    dump.ok();
    assert!(!dump.stdout.contains("online-reencrypt"), "{}", dump.stdout);
    assert!(cryptsetup_accepts(&img, &key));
    // The guest's disk kept its size: the image is the 4 MiB header and the disk.
    assert_eq!(std::fs::metadata(&img).unwrap().len(), 4 * MIB + DISK);
    eprintln!(
        "fio rounds: {}; bytes encrypted at each kill: {done_at_kill:?}",
        console.matches("FIO-JSON-END").count()
    );
}
