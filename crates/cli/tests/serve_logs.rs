//! `serve --log-format json`: one JSON object per line on stderr, the disk's name as a field,
//! so a log shipper can index what the daemon did to which disk.
mod common;

use common::*;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[test]
fn json_log_lines_name_the_disk() {
    let dir = tempdir();
    let dir = dir.path();
    let image = dir.join("vm1.raw");
    std::fs::write(&image, vec![0u8; 1 << 20]).unwrap();
    let nbd = dir.join("nbd.sock");
    let log = dir.join("serve.log");
    let mut child = Command::new(bin())
        .args([
            "serve",
            "--log-format",
            "json",
            "--name",
            "vm1",
            "--image",
            s(&image),
        ])
        .arg("--nbd")
        .arg(format!("unix:{}", nbd.display()))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .env_remove("RUST_LOG")
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !nbd.exists() {
        assert!(child.try_wait().unwrap().is_none(), "serve exited early");
        assert!(Instant::now() < deadline, "serve did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    let pid = libc::pid_t::try_from(child.id()).unwrap();
    // SAFETY: kill(2) on the child this test spawned and has not reaped.
    let sent = unsafe { libc::kill(pid, libc::SIGTERM) };
    assert_eq!(sent, 0);
    assert_eq!(child.wait().unwrap().code(), Some(0));

    let text = std::fs::read_to_string(&log).unwrap();
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: not JSON: {l}")))
        .collect();
    let serving = lines
        .iter()
        .find(|l| {
            l["message"]
                .as_str()
                .is_some_and(|m| m.starts_with("serving"))
        })
        .unwrap_or_else(|| panic!("no `serving` line in:\n{text}"));
    assert_eq!(serving["disk"], "vm1", "{serving}");
    assert_eq!(serving["level"], "INFO", "{serving}");
    assert!(
        serving["message"].as_str().unwrap().contains("(raw)"),
        "{serving}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l["message"] == "detached" && l["disk"] == "vm1"),
        "{text}"
    );
}
