//! `cryptblk reencrypt` against the real cryptsetup 2.6 (`--force-offline-reencrypt`), and
//! against 2.7 (Debian 13's, built by scripts/build-cryptsetup27.sh) for the three hand-overs:
//! each tool finishes what the other started or left after SIGKILL, and the result always
//! decrypts to the original plaintext through cryptblk and through an independent path
//! (cryptsetup's volume key + openssl's AES-XTS on sampled sectors).
mod common;

use common::reencrypt::{self, in_reencryption, kill_midway, signal_midway};
use common::*;
use std::process::Command;
use std::time::Duration;

/// Plaintext in each image: large enough for hundreds of 64 KiB hotzones, so a kill lands
/// mid-way.
const PLAIN: u64 = 32 * MIB;

struct Case {
    _t: TestDir,
    img: std::path::PathBuf,
    key: Key,
    plain: Vec<u8>,
}

/// A LUKS2 image (512-byte sectors, aes-xts-plain64 with a 256-bit key, as QEMU makes them)
/// holding random plaintext, encrypted by cryptsetup itself.
fn case() -> Case {
    let t = TestDir::new();
    let key = t.key("key");
    let plain = random_data(PLAIN);
    let extra = [
        CS_CHEAP_PBKDF2,
        &["--sector-size", "512", "--key-size", "256"],
    ]
    .concat();
    let img = cryptsetup_encrypt_in_place(t.root(), "img", &plain, &key, &extra);
    Case {
        _t: t,
        img,
        key,
        plain,
    }
}

fn cs_reencrypt(c: &Case, extra: &[&str]) -> Vec<String> {
    reencrypt::cryptsetup_args(&c.key, &c.img, extra)
}

fn cryptblk_reencrypt_args(c: &Case, extra: &[&str]) -> Vec<String> {
    reencrypt::cryptblk_args(&c.key, &c.img, extra)
}

/// The result is a plain LUKS2 image with the new layout; cryptblk, cryptsetup and openssl all
/// read the original plaintext from it.
fn check_result(c: &Case, sector: u64, key_bits: usize) {
    assert!(!in_reencryption(&c.img), "reencryption not finished");
    let dump = dump_json(&c.img);
    assert_eq!(dump["sector_size"].as_u64(), Some(sector), "{dump}");
    assert!(
        cryptsetup_accepts(&c.img, &c.key),
        "cryptsetup refuses the passphrase"
    );
    let out = cryptblk_decrypt(&c.img, &c.key, &c.img.with_extension("raw"));
    assert_same_bytes(
        &out[..PLAIN as usize],
        &c.plain,
        "cryptblk's decryption after reencryption",
    );
    independent_check(c, sector, key_bits);
}

/// cryptsetup recovers the volume key with the passphrase; openssl decrypts sampled sectors
/// (first, last, and spread in between) with it.
fn independent_check(c: &Case, sector: u64, key_bits: usize) {
    let key_hex = xts::cryptsetup_volume_key(&c.img, &c.key);
    assert_eq!(key_hex.len() * 4, key_bits, "volume key size: {key_hex}");
    xts::check_sampled_sectors(&c.img, &key_hex, sector, &c.plain);
}

/// New layout for the interop cases: 4096-byte sectors and a 512-bit aes-xts key.
const NEW_LAYOUT: &[&str] = &["--sector-size", "4096", "--key-size", "512"];

/// The system's cryptsetup (2.6 on Debian 12).
const CRYPTSETUP: &str = "cryptsetup";

fn cs_init_cryptblk_finishes(cs: &str, resilience: &str) {
    let c = case();
    let args = cs_reencrypt(
        &c,
        &[&["--init-only", "--resilience", resilience], NEW_LAYOUT].concat(),
    );
    tool(cs, &args).ok();
    assert!(in_reencryption(&c.img));
    cryptblk(cryptblk_reencrypt_args(
        &c,
        &["--resume-only", "--hotzone-size", "1M"],
    ))
    .ok();
    check_result(&c, 4096, 512);
}

#[test]
fn cryptsetup_init_only_checksum_cryptblk_finishes() {
    cs_init_cryptblk_finishes(CRYPTSETUP, "checksum");
}

#[test]
fn cryptsetup27_init_only_checksum_cryptblk_finishes() {
    cs_init_cryptblk_finishes(s(&cryptblk_testutil::cryptsetup27()), "checksum");
}

#[test]
fn cryptsetup_init_only_none_cryptblk_finishes() {
    cs_init_cryptblk_finishes(CRYPTSETUP, "none");
}

#[test]
fn cryptsetup_init_only_journal_cryptblk_finishes() {
    cs_init_cryptblk_finishes(CRYPTSETUP, "journal");
}

#[test]
fn cryptsetup_killed_cryptblk_resumes() {
    cs_killed_cryptblk_resumes(CRYPTSETUP, "checksum");
}

#[test]
fn cryptsetup27_killed_cryptblk_resumes() {
    cs_killed_cryptblk_resumes(s(&cryptblk_testutil::cryptsetup27()), "checksum");
}

#[test]
fn cryptsetup_killed_cryptblk_resumes_journal() {
    cs_killed_cryptblk_resumes(CRYPTSETUP, "journal");
}

fn cs_killed_cryptblk_resumes(cs: &str, resilience: &str) {
    let c = case();
    let args = cs_reencrypt(
        &c,
        &[
            &["--hotzone-size", "64K", "--resilience", resilience],
            NEW_LAYOUT,
        ]
        .concat(),
    );
    let mut cmd = Command::new(cryptblk_testutil::tool(cs));
    cmd.args(&args);
    kill_midway(cmd, &c.img, 40);
    assert!(
        in_reencryption(&c.img),
        "cryptsetup finished before the kill"
    );
    let out = cryptblk(cryptblk_reencrypt_args(
        &c,
        &["--resume-only", "--progress=json"],
    ));
    out.ok();
    assert!(out.stderr.contains("\"event\":\"done\""), "{}", out.stderr);
    check_result(&c, 4096, 512);
}

#[test]
fn cryptblk_killed_cryptsetup_resumes() {
    cb_killed_cryptsetup_resumes(CRYPTSETUP, "checksum");
}

#[test]
fn cryptblk_killed_cryptsetup27_resumes() {
    cb_killed_cryptsetup_resumes(s(&cryptblk_testutil::cryptsetup27()), "checksum");
}

#[test]
fn cryptblk_killed_cryptsetup_resumes_journal() {
    cb_killed_cryptsetup_resumes(CRYPTSETUP, "journal");
}

fn cb_killed_cryptsetup_resumes(cs: &str, resilience: &str) {
    let c = case();
    let mut cmd = Command::new(bin());
    cmd.args(cryptblk_reencrypt_args(
        &c,
        &[
            &["--hotzone-size", "64K", "--resilience", resilience],
            NEW_LAYOUT,
        ]
        .concat(),
    ));
    kill_midway(cmd, &c.img, 40);
    assert!(in_reencryption(&c.img), "cryptblk finished before the kill");
    // After a crash cryptsetup wants `repair` (its hotzone recovery) before resuming.
    tool(
        cs,
        ["repair", "--batch-mode", "--key-file", s(&c.key), s(&c.img)],
    )
    .ok();
    tool(cs, cs_reencrypt(&c, &["--resume-only"])).ok();
    check_result(&c, 4096, 512);
}

#[test]
fn cryptblk_killed_cryptblk_resumes() {
    let c = case();
    let mut cmd = Command::new(bin());
    cmd.args(cryptblk_reencrypt_args(
        &c,
        &[&["--hotzone-size", "64K"], NEW_LAYOUT].concat(),
    ));
    kill_midway(cmd, &c.img, 40);
    assert!(in_reencryption(&c.img));
    // `convert` reads the half-done image through both segments, or, when the kill
    // interrupted a hotzone (recovery writes, and convert opens read-only), refuses it
    // naming the way out.
    let converted = c.img.with_extension("x");
    let out = cryptblk(argv!(
        "convert -O raw --source-key-file {} {} {}",
        c.key,
        c.img,
        converted
    ));
    if out.code == 0 {
        let what = "convert of the half-done image";
        assert_same_bytes(&read(&converted)[..PLAIN as usize], &c.plain, what);
    } else {
        assert!(
            out.stderr.contains("reencrypt --resume-only"),
            "{}",
            out.stderr
        );
    }
    cryptblk(cryptblk_reencrypt_args(&c, &["--resume-only"])).ok();
    check_result(&c, 4096, 512);
}

/// SIGTERM stops after the current hotzone with the state saved (with `none` too, where the
/// boundary is otherwise only written at the end).
fn sigterm_case(resilience: &str, commits: u64, settle: Duration) {
    let c = case();
    let mut cmd = Command::new(bin());
    cmd.args(cryptblk_reencrypt_args(
        &c,
        &[
            &["--hotzone-size", "64K", "--resilience", resilience],
            NEW_LAYOUT,
        ]
        .concat(),
    ));
    let (code, stderr) = signal_midway(cmd, &c.img, commits, settle, "TERM");
    assert_eq!(code, Some(code::OTHER), "{stderr}");
    assert!(
        stderr.contains("interrupted") && stderr.contains("--resume-only"),
        "{stderr}"
    );
    // Stopped cleanly: no hotzone is left flagged, so cryptsetup resumes without repair.
    assert!(!tool("cryptsetup", ["luksDump", s(&c.img)])
        .stdout
        .contains("in-reencryption"));
    tool("cryptsetup", cs_reencrypt(&c, &["--resume-only"])).ok();
    check_result(&c, 4096, 512);
}

#[test]
fn sigterm_stops_after_the_hotzone_checksum() {
    sigterm_case("checksum", 40, Duration::ZERO);
}

#[test]
fn sigterm_stops_after_the_hotzone_none() {
    // `none` commits once at the start (init), then only when it stops (or ends): signalled
    // right after the init commit, it stops before or after a few hotzones.
    sigterm_case("none", 1, Duration::ZERO);
}

#[test]
fn cryptblk_reencrypts_cryptsetup_reads_checksum() {
    let c = case();
    cryptblk(cryptblk_reencrypt_args(&c, &[NEW_LAYOUT, &["-p"]].concat())).ok();
    check_result(&c, 4096, 512);
    // One keyslot left: the old key is gone.
    let dump = tool("cryptsetup", ["luksDump", s(&c.img)]);
    assert_eq!(dump.stdout.matches(": luks2").count(), 1, "{}", dump.stdout);
}

#[test]
fn cryptblk_reencrypts_cryptsetup_reads_none_same_layout() {
    let c = case();
    cryptblk(cryptblk_reencrypt_args(&c, &["--resilience", "none"])).ok();
    check_result(&c, 512, 256);
}

#[test]
fn cryptblk_init_only_cryptsetup_finishes() {
    let c = case();
    cryptblk(cryptblk_reencrypt_args(
        &c,
        &[&["--init-only"], NEW_LAYOUT].concat(),
    ))
    .ok();
    assert!(in_reencryption(&c.img));
    tool("cryptsetup", cs_reencrypt(&c, &["--resume-only"])).ok();
    check_result(&c, 4096, 512);
}

#[test]
fn refusals_leave_the_image_untouched() {
    let c = case();
    let before = read(&c.img);
    cryptblk(cryptblk_reencrypt_args(
        &c,
        &["--encrypt", "--reduce-device-size", "16M"],
    ))
    .expect_code(code::USAGE);
    cryptblk(cryptblk_reencrypt_args(
        &c,
        &["--reduce-device-size", "16M"],
    ))
    .expect_code(code::UNSUPPORTED);
    cryptblk(cryptblk_reencrypt_args(&c, &["--resilience", "datashift"]))
        .expect_code(code::UNSUPPORTED);
    cryptblk(cryptblk_reencrypt_args(&c, &["--resume-only"])).expect_code(code::USAGE);
    let wrong = key_file(c.img.parent().unwrap(), "wrong", "not the passphrase");
    let mut args = cryptblk_reencrypt_args(&c, &[]);
    args[2] = s(&wrong).to_string();
    cryptblk(args).expect_code(code::WRONG_PASSPHRASE);
    assert!(
        read(&c.img) == before,
        "a refused reencryption changed the image"
    );
}

/// With two passphrases, one must be named: it is the one kept (cryptsetup's --key-slot).
#[test]
fn several_keyslots_need_key_slot() {
    let c = case();
    let other = key_file(c.img.parent().unwrap(), "other", "second passphrase");
    cryptsetup_cheap(argv!(
        "luksAddKey --batch-mode --key-file {} {} {}",
        c.key,
        c.img,
        other
    ))
    .ok();
    let before = read(&c.img);
    let out = cryptblk(cryptblk_reencrypt_args(&c, &[]));
    out.expect_code(code::USAGE);
    assert!(out.stderr.contains("--key-slot"), "{}", out.stderr);
    assert!(
        read(&c.img) == before,
        "a refused reencryption changed the image"
    );
    cryptblk(cryptblk_reencrypt_args(&c, &["--key-slot", "0"])).ok();
    check_result(&c, 512, 256);
    let dump = tool("cryptsetup", ["luksDump", s(&c.img)]);
    assert_eq!(dump.stdout.matches(": luks2").count(), 1, "{}", dump.stdout);
    assert!(
        !cryptsetup_accepts(&c.img, &other),
        "the other passphrase survived"
    );
}
