//! Offline re-encryption and in-place encryption as the interop tests drive them: the
//! command lines of cryptblk and of cryptsetup (cheap keyslots), the header's commit counter,
//! and a run signalled mid-way.
use super::{read_prefix, s, tool, CHEAP_PBKDF2, CS_CHEAP_PBKDF2};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn words(start: &[&str], key: &Path, kdf: &[&str], extra: &[&str], img: &Path) -> Vec<String> {
    let key_and_image = ["--key-file", s(key), s(img)];
    let (key, img) = key_and_image.split_at(2);
    let all = start.iter().chain(key).chain(kdf).chain(extra).chain(img);
    all.map(|w| w.to_string()).collect()
}

/// `cryptblk reencrypt --key-file KEY` (the key is the third word), a cheap keyslot, `extra`
/// and the image.
pub fn cryptblk_args(key: &Path, img: &Path, extra: &[&str]) -> Vec<String> {
    words(&["reencrypt"], key, CHEAP_PBKDF2, extra, img)
}

/// `cryptsetup reencrypt --force-offline-reencrypt` with a cheap keyslot, `extra` and the
/// image.
pub fn cryptsetup_args(key: &Path, img: &Path, extra: &[&str]) -> Vec<String> {
    let start = ["reencrypt", "--force-offline-reencrypt", "--batch-mode"];
    words(&start, key, CS_CHEAP_PBKDF2, extra, img)
}

/// The LUKS2 header's seqid (cryptsetup's epoch): every committed hotzone bumps it; 0 where
/// no header was written yet (a plaintext image whose first 4 KiB are zero).
pub fn seqid(img: &Path) -> u64 {
    let head = read_prefix(img, 24);
    u64::from_be_bytes(head[16..24].try_into().unwrap())
}

/// Whether cryptsetup sees a re-encryption (or encryption) under way.
pub fn in_reencryption(img: &Path) -> bool {
    let out = tool("cryptsetup", ["luksDump", s(img)]);
    out.ok();
    out.stdout.contains("online-reencrypt-v2")
}

/// Starts `cmd`, waits until the header has advanced by `commits` seqids (so the run is well
/// under way), then SIGKILLs it. Panics if it finished first.
pub fn kill_midway(cmd: Command, img: &Path, commits: u64) {
    signal_midway(cmd, img, commits, Duration::ZERO, "KILL");
}

/// As [`kill_midway`] with another signal, sent `settle` after the commits; returns the
/// process's exit code and stderr.
pub fn signal_midway(
    mut cmd: Command,
    img: &Path,
    commits: u64,
    settle: Duration,
    signal: &str,
) -> (Option<i32>, String) {
    let start = seqid(img);
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while seqid(img) < start + commits {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("the run ended ({status}) before it could be killed mid-way");
        }
        assert!(Instant::now() < deadline, "no progress in 60 s");
        std::thread::sleep(Duration::from_millis(2));
    }
    std::thread::sleep(settle);
    tool("kill", ["-s", signal, &child.id().to_string()]).ok();
    let out = child.wait_with_output().unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}
