//! What the Debian package installs beside the binary (contrib/debian, scripts/build-deb.sh):
//! the example /etc/cryptblk/disks.toml is a config `serve` reads, with no disk as shipped
//! (the service then starts with only its control socket) and with its example disk once
//! uncommented; a config without disks and without a control socket is a usage error that
//! says what to give. The package itself is built, installed and checked by
//! scripts/test-deb.sh (lintian, dpkg -i, systemd-analyze verify, man, demo).
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const EXAMPLE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../contrib/debian/disks.toml"
);

#[test]
fn the_example_config_has_no_disk_and_one_once_uncommented() {
    let text = std::fs::read_to_string(EXAMPLE).unwrap();
    let base = Path::new("/etc/cryptblk");
    assert!(cryptblk_daemon::config::parse_config(&text, base)
        .unwrap()
        .is_empty());
    // The commented example disk: everything from `# [[disk]]` on, uncommented.
    let example: String = text
        .lines()
        .skip_while(|l| *l != "# [[disk]]")
        .map(|l| l.strip_prefix("# ").unwrap_or(l))
        .collect::<Vec<_>>()
        .join("\n");
    let disks = cryptblk_daemon::config::parse_config(&example, base)
        .unwrap_or_else(|e| panic!("the example disk does not parse: {e:?}\n{example}"));
    assert_eq!(disks.len(), 1);
    let disk = &disks[0];
    assert_eq!(disk.name, "vm1");
    assert_eq!(
        disk.vhost_user_blk.as_deref(),
        Some(Path::new("/run/cryptblk/vm1.sock"))
    );
    assert_eq!(
        disk.key_file.as_deref(),
        Some(Path::new("/etc/cryptblk/vm1.key"))
    );
    assert_eq!(disk.num_queues, 2);
}

#[test]
fn a_config_without_disks_needs_a_control_socket() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_cryptblk"))
        .args(["serve", "--config", EXAMPLE])
        .current_dir(dir.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("no [[disk]]") && stderr.contains("--control"),
        "{stderr}"
    );

    // With one, the daemon serves no disk until one is added.
    let control = dir.path().join("control.sock");
    let mut daemon = Command::new(env!("CARGO_BIN_EXE_cryptblk"))
        .args(["serve", "--config", EXAMPLE, "--control"])
        .arg(&control)
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while !control.exists() {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "no control socket after 30 s"
        );
        if let Some(status) = daemon.try_wait().unwrap() {
            panic!("serve exited: {status}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let list = Command::new(env!("CARGO_BIN_EXE_cryptblk"))
        .args(["ctl", "-s"])
        .arg(&control)
        .arg("disk-list")
        .output()
        .unwrap();
    assert!(list.status.success(), "{list:?}");
    let disks: serde_json::Value = serde_json::from_slice(&list.stdout).unwrap();
    assert_eq!(disks["disks"].as_array().map(Vec::len), Some(0), "{disks}");
    // SAFETY: kill(2) on the child we spawned; it has not been waited for, so its pid is ours.
    assert_eq!(unsafe { libc::kill(daemon.id() as i32, libc::SIGTERM) }, 0);
    assert!(daemon.wait().unwrap().success());
}
