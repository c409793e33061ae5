//! `cryptblk reencrypt --decrypt --header FILE IMAGE` against the real cryptsetup 2.7 (built by
//! scripts/build-cryptsetup27.sh; Debian 12's 2.6.1 cannot decrypt an image whose header is
//! at its head): either tool starts the decryption, the other finishes it, also after the one
//! that started was killed mid-way; the plaintext ends up at offset 0 of the image, byte for
//! byte the volume that was encrypted.
//!
//! No cryptsetup 2.7 fails the test (it is never skipped): scripts/test.sh builds it.
mod common;

use common::reencrypt::seqid;
use common::*;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The volume: the data shift of the images below is 8 MiB, so this is a dozen hotzones.
const VOLUME: u64 = 96 * MIB;

/// A LUKS2 image made by the system's cryptsetup (2.6) whose volume is `plain` (data offset
/// 8 MiB, so the image is the volume plus 8 MiB).
fn luks2_image(dir: &Path, key: &Path, plain: &[u8]) -> PathBuf {
    let img = cryptsetup_encrypt_in_place(dir, "img", plain, key, CS_CHEAP_PBKDF2);
    let len = std::fs::metadata(&img).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&img)
        .unwrap()
        .set_len(len - 8 * MIB)
        .unwrap();
    img
}

struct Setup {
    t: TestDir,
    key: Key,
    plain: Vec<u8>,
    img: PathBuf,
    hdr: PathBuf,
}

fn setup(seed: u64) -> Setup {
    let t = TestDir::new();
    let key = t.key("key");
    let plain_path = t.path("plain");
    random_file(&plain_path, VOLUME, seed);
    let plain = read(&plain_path);
    std::fs::remove_file(&plain_path).unwrap();
    let img = luks2_image(t.root(), &key, &plain);
    let hdr = t.path("img.hdr");
    Setup {
        t,
        key,
        plain,
        img,
        hdr,
    }
}

/// cryptsetup 2.7's `reencrypt --decrypt --header` with `extra` options.
fn cs27_args(t: &Setup, extra: &[&str]) -> Vec<std::ffi::OsString> {
    let mut args = argv!(
        "reencrypt --decrypt --header {} --force-offline-reencrypt --batch-mode --key-file {}",
        t.hdr,
        t.key
    );
    args.extend(extra.iter().map(Into::into));
    args.push(t.img.clone().into());
    args
}

fn cryptblk_args(t: &Setup, extra: &[&str]) -> Vec<std::ffi::OsString> {
    let mut args = argv!(
        "reencrypt --decrypt --header {} --key-file {}",
        t.hdr,
        t.key
    );
    args.extend(extra.iter().map(Into::into));
    args.push(t.img.clone().into());
    args
}

/// The image holds the plaintext at offset 0, and the header file says the decryption is
/// over (no keyslots, no requirement) to both tools.
#[track_caller]
fn check_decrypted(t: &Setup, by: &str) {
    let image = read(&t.img);
    assert_eq!(
        image.len() as u64,
        VOLUME + 8 * MIB,
        "{by}: the image size changed"
    );
    assert_same_bytes(&image[..t.plain.len()], &t.plain, by);
    let dump = tool(
        s(&cryptblk_testutil::cryptsetup27()),
        ["luksDump", s(&t.hdr)],
    );
    dump.ok();
    let stdout = &dump.stdout;
    let done = !stdout.contains("online-reencrypt") && !stdout.contains("luks2");
    assert!(
        done,
        "{by}: the header still has a reencryption or keyslots:\n{stdout}"
    );
    let linear = stdout.contains("linear");
    assert!(
        linear,
        "{by}: no linear segment in the final header:\n{stdout}"
    );
    // The image is a plain disk now: no LUKS header left for cryptblk to find.
    cryptblk(["dump", s(&t.img)]).expect_code(code::DAMAGED);
}

/// The header file's JSON (primary copy).
fn header_json(hdr: &Path) -> serde_json::Value {
    let bytes = read_prefix(hdr, 16384);
    let end = 4096 + bytes[4096..].iter().position(|&b| b == 0).unwrap();
    serde_json::from_slice(&bytes[4096..end]).unwrap()
}

fn in_hotzone(hdr: &Path) -> bool {
    header_json(hdr).to_string().contains("in-reencryption")
}

/// Run `program args` and SIGKILL it once the header file has seen `commits` more commits;
/// returns whether it was still running then (false: it finished first).
fn kill_after_commits<S: AsRef<std::ffi::OsStr> + std::fmt::Debug>(
    program: &str,
    args: &[S],
    hdr: &Path,
    commits: u64,
) -> bool {
    let mut child = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut start = None;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            assert!(status.success(), "{program} {args:?} failed: {status}");
            return false;
        }
        if hdr.is_file() && std::fs::metadata(hdr).unwrap().len() >= 24 {
            let now = seqid(hdr);
            let first = *start.get_or_insert(now);
            if now >= first + commits {
                break;
            }
        }
        assert!(Instant::now() < deadline, "{program}: no progress");
        std::thread::sleep(Duration::from_millis(1));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    true
}

#[test]
fn cryptblk_decrypts_to_a_new_header_file() {
    let t = setup(23);
    let before = read(&t.img);

    // Without --header: refused before any read or write, naming the way.
    let refused = cryptblk(argv!("reencrypt --decrypt --key-file {} {}", t.key, t.img));
    refused.expect_code(code::USAGE);
    refused.error_line(&["--decrypt needs --header"]);
    // A wrong passphrase: exit 2, no header file, the image untouched.
    let wrong = t.t.path("wrong");
    std::fs::write(&wrong, "not the passphrase").unwrap();
    cryptblk(argv!(
        "reencrypt --decrypt --header {} --key-file {} {}",
        t.hdr,
        wrong,
        t.img
    ))
    .expect_code(code::WRONG_PASSPHRASE);
    assert!(!t.hdr.exists(), "a refused --decrypt left a header file");
    // An existing FILE, even empty, is read as a header (as cryptsetup does) and refused.
    std::fs::write(&t.hdr, b"").unwrap();
    let existing = cryptblk(cryptblk_args(&t, &[]));
    existing.expect_code(code::DAMAGED);
    existing.error_line(&["not a valid LUKS2 header"]);
    std::fs::remove_file(&t.hdr).unwrap();
    assert!(
        read(&t.img) == before,
        "a refused --decrypt changed the image"
    );

    cryptblk(cryptblk_args(&t, &["-p"])).ok();
    check_decrypted(&t, "decrypted by cryptblk");
}

/// The metadata without what is random or timed (salts, digest values, iteration counts).
fn comparable(mut json: serde_json::Value) -> serde_json::Value {
    for d in json["digests"].as_object_mut().unwrap().values_mut() {
        let d = d.as_object_mut().unwrap();
        for field in ["salt", "digest", "iterations"] {
            d.remove(field);
        }
    }
    for k in json["keyslots"].as_object_mut().unwrap().values_mut() {
        if let Some(kdf) = k.get_mut("kdf").and_then(|v| v.as_object_mut()) {
            kdf.remove("salt");
        }
    }
    json
}

/// cryptblk's `--init-only` and cryptsetup 2.7's (with the options `extra`) on two copies of
/// an image leave the same bytes and the same metadata; then each tool finishes the other's.
fn same_init_and_each_finishes_the_other(seed: u64, extra: &[&str]) {
    let t = setup(seed);
    let twin = Setup {
        key: t.key.clone(),
        plain: t.plain.clone(),
        img: t.t.path("twin.img"),
        hdr: t.t.path("twin.hdr"),
        t: TestDir::new(),
    };
    std::fs::copy(&t.img, &twin.img).unwrap();
    let mut init = vec!["--init-only"];
    init.extend_from_slice(extra);
    tool(s(&cryptblk_testutil::cryptsetup27()), cs27_args(&t, &init)).ok();
    cryptblk(cryptblk_args(&twin, &init)).ok();
    let what = "the image after cryptblk's --init-only differs from the one after cryptsetup 2.7's";
    assert!(read(&t.img) == read(&twin.img), "{extra:?}: {what}");
    let (ours, theirs) = (
        comparable(header_json(&twin.hdr)),
        comparable(header_json(&t.hdr)),
    );
    let what = "cryptblk's header metadata differs from cryptsetup 2.7's";
    assert_eq!(ours, theirs, "{extra:?}: {what}");
    let size = |hdr: &Path| std::fs::metadata(hdr).unwrap().len();
    assert_eq!(
        size(&twin.hdr),
        size(&t.hdr),
        "the header files differ in size"
    );
    tool(
        s(&cryptblk_testutil::cryptsetup27()),
        cs27_args(&twin, &["--resume-only"]),
    )
    .ok();
    check_decrypted(&twin, "started by cryptblk, finished by cryptsetup 2.7");
    cryptblk(argv!(
        "reencrypt --resume-only --header {} --key-file {} {}",
        t.hdr,
        t.key,
        t.img
    ))
    .ok();
    check_decrypted(&t, "started by cryptsetup 2.7, finished by cryptblk");
}

#[test]
fn cryptblk_init_only_leaves_what_cryptsetup27_init_only_leaves() {
    same_init_and_each_finishes_the_other(28, &[]);
}

#[test]
fn a_journal_for_the_moved_segment_works_both_ways_too() {
    // The journal holds the moved segment itself, which must fit the free keyslots area
    // (a little under the 8 MiB data offset here): cryptsetup and cryptblk both refuse more.
    let t = setup(29);
    let refused = cryptblk(cryptblk_args(
        &t,
        &["--resilience", "journal", "--init-only"],
    ));
    refused.expect_code(code::USAGE);
    refused.error_line(&["datashift-journal", "--hotzone-size"]);
    assert!(!t.hdr.exists(), "a refused --decrypt left a header file");
    same_init_and_each_finishes_the_other(30, &["--resilience", "journal", "--hotzone-size", "4M"]);
}

#[test]
fn cryptblk_killed_mid_way_then_cryptsetup27_repairs_and_resumes() {
    let t = setup(26);
    let pristine = read(&t.img);
    // Kill until one kill lands inside a hotzone: each hotzone is two commits (flag it, move
    // the boundary past it), so the number of commits to wait for alternates in parity.
    let mut in_hot = false;
    for attempt in 0..8 {
        std::fs::write(&t.img, &pristine).unwrap();
        let _ = std::fs::remove_file(&t.hdr);
        cryptblk(cryptblk_args(&t, &["--init-only"])).ok();
        let args = argv!(
            "reencrypt --resume-only --header {} --key-file {} {}",
            t.hdr,
            t.key,
            t.img
        );
        assert!(
            kill_after_commits(bin(), &args, &t.hdr, 2 + attempt),
            "cryptblk finished before the kill"
        );
        in_hot = in_hotzone(&t.hdr);
        if in_hot {
            break;
        }
    }
    assert!(in_hot, "no kill landed inside a hotzone in 8 tries");
    let cs27 = cryptblk_testutil::cryptsetup27();
    tool(
        s(&cs27),
        argv!(
            "repair --batch-mode --header {} --key-file {} {}",
            t.hdr,
            t.key,
            t.img
        ),
    )
    .ok();
    tool(s(&cs27), cs27_args(&t, &["--resume-only"])).ok();
    check_decrypted(&t, "cryptblk killed, finished by cryptsetup 2.7");
}

#[test]
fn cryptsetup27_killed_mid_way_then_cryptblk_resumes() {
    let t = setup(27);
    let cs27 = cryptblk_testutil::cryptsetup27();
    let pristine = read(&t.img);
    let mut in_hot = false;
    for attempt in 0..8 {
        std::fs::write(&t.img, &pristine).unwrap();
        let _ = std::fs::remove_file(&t.hdr);
        tool(s(&cs27), cs27_args(&t, &["--init-only"])).ok();
        let args = cs27_args(&t, &["--resume-only"]);
        assert!(
            kill_after_commits(s(&cs27), &args, &t.hdr, 2 + attempt),
            "cryptsetup finished before the kill"
        );
        in_hot = in_hotzone(&t.hdr);
        if in_hot {
            break;
        }
    }
    assert!(in_hot, "no kill landed inside a hotzone in 8 tries");
    cryptblk(argv!(
        "reencrypt --resume-only --header {} --key-file {} {}",
        t.hdr,
        t.key,
        t.img
    ))
    .ok();
    check_decrypted(&t, "cryptsetup 2.7 killed, finished by cryptblk");
}

#[test]
fn sigterm_stops_after_the_hotzone_and_cryptsetup27_resumes_without_repair() {
    let t = setup(31);
    let mut child = Command::new(bin())
        .args(cryptblk_args(&t, &[]))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut start = None;
    loop {
        assert!(
            child.try_wait().unwrap().is_none(),
            "cryptblk finished before the signal"
        );
        if t.hdr.is_file() && std::fs::metadata(&t.hdr).unwrap().len() >= 24 {
            let now = seqid(&t.hdr);
            if now >= *start.get_or_insert(now) + 4 {
                break;
            }
        }
        assert!(Instant::now() < deadline, "no progress");
        std::thread::sleep(Duration::from_millis(1));
    }
    tool("kill", ["-TERM", &child.id().to_string()]).ok();
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(code::OTHER), "{stderr}");
    let resume = format!("--resume-only --header {}", s(&t.hdr));
    let told = stderr.contains("interrupted") && stderr.contains(&resume);
    assert!(told, "the message does not say how to continue: {stderr}");
    // Stopped cleanly: no hotzone is left flagged, so cryptsetup resumes without repair.
    assert!(!in_hotzone(&t.hdr), "a hotzone is left flagged");
    tool(
        s(&cryptblk_testutil::cryptsetup27()),
        cs27_args(&t, &["--resume-only"]),
    )
    .ok();
    check_decrypted(
        &t,
        "cryptblk stopped by SIGTERM, finished by cryptsetup 2.7",
    );
}
