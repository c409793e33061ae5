//! Guest end-to-end: a running VM's disk re-encrypted online. The test guest (see
//! guest_e2e.rs) runs rounds of fio with crc32c verify (`restart-verify`: large and small
//! writes on 2 queues, fsyncs, every block read back, `verify_fatal`) on a vhost-user-blk disk
//! while `reencrypt-start` replaces the volume key of a LUKS2 disk, or encrypts a raw disk in
//! place (`--encrypt`); the daemon is killed with `kill -9` three times during the work,
//! restarted on the image (which it serves in mid-reencryption; an encrypted disk's image is
//! LUKS2 from the start, so it is attached with the passphrase from then on) and told to
//! continue. Every fio round must pass, and cryptsetup must open the final image.

mod common;

use common::guest::{build_guest, Guest, Serve, BOUND};
use common::{ctl_json, s, tool, xts, MIB};
use std::ffi::OsStr;
use std::path::Path;
use std::time::{Duration, Instant};

const KILLS: usize = 3;

/// Starts the daemon and waits for its control socket too.
fn serve(args: &[&OsStr], socket: &Path, control: &Path, log: std::path::PathBuf) -> Serve {
    let _ = std::fs::remove_file(control);
    let serve = Serve::start(Path::new(common::bin()), args, socket, log);
    let deadline = Instant::now() + BOUND;
    while !control.exists() {
        assert!(
            Instant::now() < deadline,
            "no control socket: {}",
            serve.output()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    serve
}

fn start_reencryption(control: &Path, key: &Path) -> serde_json::Value {
    start_with(control, key, &[])
}

fn start_with(control: &Path, key: &Path, extra: &[&str]) -> serde_json::Value {
    let mut args = vec![
        "reencrypt-start",
        "vol",
        "--key-file",
        s(key),
        "--pbkdf",
        "pbkdf2",
        "--iter-time",
        "1",
        "--max-bandwidth",
        "4M",
    ];
    args.extend_from_slice(extra);
    ctl_json(control, &args)
}

/// Kills the daemon `KILLS` times while the work runs, restarting it with `restart_args` and
/// continuing; then waits for the end. Returns the daemon and the bytes done at each kill.
fn kill_and_restart_through(
    mut daemon: Serve,
    guest: &mut Guest,
    restart_args: &[&OsStr],
    (socket, control, key): (&Path, &Path, &Path),
    log: impl Fn(usize) -> std::path::PathBuf,
) -> (Serve, Vec<u64>) {
    let mut rng = rand::thread_rng();
    let mut done_at_kill = Vec::new();
    for restart in 1..=KILLS {
        std::thread::sleep(Duration::from_millis(rand::Rng::gen_range(
            &mut rng,
            1000..2500,
        )));
        guest.assert_running();
        let st = ctl_json(control, &["reencrypt-status", "vol"]);
        assert_eq!(
            st["phase"], "running",
            "finished too early to kill mid-way: {st}"
        );
        done_at_kill.push(st["bytes-done"].as_u64().unwrap());
        daemon.kill();
        daemon = serve(restart_args, socket, control, log(restart));
        daemon.wait_started();
        let st = ctl_json(control, &["reencrypt-status", "vol"]);
        assert_eq!(st["phase"], "paused", "{st}: {}", daemon.output());
        start_reencryption(control, key);
    }
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        let st = ctl_json(control, &["reencrypt-status", "vol"]);
        if st["phase"] == "finished" {
            break;
        }
        assert!(st["last-error"].is_null(), "{st}");
        assert!(Instant::now() < deadline, "not finished: {st}");
        guest.assert_running();
        std::thread::sleep(Duration::from_millis(200));
    }
    std::thread::sleep(Duration::from_millis(1000));
    (daemon, done_at_kill)
}

#[test]
fn guest_fio_verify_passes_while_its_disk_is_reencrypted_through_daemon_kills() {
    let artifacts = build_guest();
    let dir = tempfile::tempdir().unwrap();
    let path = |name: &str| dir.path().join(name);
    let (key, img, socket, control) = (
        path("key"),
        path("img.luks"),
        path("vub.sock"),
        path("ctl.sock"),
    );
    std::fs::write(&key, b"guest reencrypt passphrase").unwrap();
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
    let old_key = xts::cryptsetup_volume_key(&img, &key);
    let args = [
        os("--vhost-user-blk"),
        socket.as_os_str(),
        os("--image"),
        img.as_os_str(),
        os("--key-file"),
        key.as_os_str(),
        os("--name"),
        os("vol"),
        os("--num-queues"),
        os("2"),
        os("--control"),
        control.as_os_str(),
    ];
    let mut daemon = serve(&args, &socket, &control, path("serve-0.log"));

    let mut guest = Guest::start_restart_verify(&artifacts, &socket, 32 * MIB, dir.path());
    daemon.wait_started();
    guest.wait_for_console("FIO-JSON-BEGIN 1", "fio never started", BOUND);

    let st = start_reencryption(&control, &key);
    assert_eq!(st["phase"], "running", "{st}");
    let (daemon, done_at_kill) =
        kill_and_restart_through(daemon, &mut guest, &args, (&socket, &control, &key), |n| {
            path(&format!("serve-{n}.log"))
        });

    let console = guest.stop_and_assert_passed();
    let output = daemon.output();
    assert!(daemon.terminate().success(), "cryptblk serve:\n{output}");

    let dump = tool("cryptsetup", ["luksDump", s(&img)]);
    dump.ok();
    assert!(!dump.stdout.contains("online-reencrypt"), "{}", dump.stdout);
    assert!(common::cryptsetup_accepts(&img, &key));
    assert_ne!(xts::cryptsetup_volume_key(&img, &key), old_key);
    eprintln!(
        "fio rounds: {}; bytes done at each kill: {done_at_kill:?}",
        console.matches("FIO-JSON-END").count()
    );
}

#[test]
fn guest_fio_verify_passes_while_its_raw_disk_is_encrypted_through_daemon_kills() {
    let artifacts = build_guest();
    let dir = tempfile::tempdir().unwrap();
    let path = |name: &str| dir.path().join(name);
    let (key, img, socket, control) = (
        path("key"),
        path("img.raw"),
        path("vub.sock"),
        path("ctl.sock"),
    );
    std::fs::write(&key, b"guest encrypt passphrase").unwrap();
    const DISK: u64 = 64 * MIB;
    std::fs::File::create(&img).unwrap().set_len(DISK).unwrap();
    let os = OsStr::new;
    let raw_args = [
        os("--vhost-user-blk"),
        socket.as_os_str(),
        os("--image"),
        img.as_os_str(),
        os("--name"),
        os("vol"),
        os("--num-queues"),
        os("2"),
        os("--control"),
        control.as_os_str(),
    ];
    let mut luks_args = raw_args.to_vec();
    luks_args.extend([os("--key-file"), key.as_os_str()]);
    let mut daemon = serve(&raw_args, &socket, &control, path("serve-0.log"));

    let mut guest = Guest::start_restart_verify(&artifacts, &socket, 32 * MIB, dir.path());
    daemon.wait_started();
    guest.wait_for_console("FIO-JSON-BEGIN 1", "fio never started", BOUND);

    let st = start_with(&control, &key, &["--encrypt", "--reduce-device-size", "8M"]);
    assert_eq!(st["phase"], "running", "{st}");
    assert_eq!(st["mode"], "encrypt", "{st}");
    let (daemon, done_at_kill) = kill_and_restart_through(
        daemon,
        &mut guest,
        &luks_args,
        (&socket, &control, &key),
        |n| path(&format!("serve-{n}.log")),
    );

    let console = guest.stop_and_assert_passed();
    let output = daemon.output();
    assert!(daemon.terminate().success(), "cryptblk serve:\n{output}");

    let dump = tool("cryptsetup", ["luksDump", s(&img)]);
    dump.ok();
    assert!(!dump.stdout.contains("online-reencrypt"), "{}", dump.stdout);
    assert!(common::cryptsetup_accepts(&img, &key));
    // The guest's disk kept its size: the image is the 4 MiB header and the disk.
    assert_eq!(std::fs::metadata(&img).unwrap().len(), 4 * MIB + DISK);
    eprintln!(
        "fio rounds: {}; bytes encrypted at each kill: {done_at_kill:?}",
        console.matches("FIO-JSON-END").count()
    );
}
