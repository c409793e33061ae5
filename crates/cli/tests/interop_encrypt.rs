//! `cryptblk reencrypt --encrypt --reduce-device-size` (in-place encryption of a plaintext
//! image, cryptsetup's datashift layout) against the real cryptsetup 2.6 (and 2.7, Debian 13's,
//! built by scripts/build-cryptsetup27.sh, for the three hand-overs): the same bytes
//! survive in the same place as with cryptsetup, either tool finishes what the other started
//! or left after SIGKILL, and the payload always decrypts to the original plaintext through
//! cryptblk and through an independent path (cryptsetup's volume key + openssl's AES-XTS).
mod common;

use common::reencrypt::{self, in_reencryption, kill_midway};
use common::*;
use std::path::PathBuf;
use std::process::Command;

struct Case {
    t: TestDir,
    img: PathBuf,
    key: Key,
    /// The plaintext file as it was.
    plain: Vec<u8>,
}

/// A plaintext image of `size` random bytes, its first 4 KiB zero (so the header's seqid
/// reads 0 until a header is written, see `kill_midway`).
fn case(size: u64) -> Case {
    let t = TestDir::new();
    let key = t.key("key");
    let mut plain = random_data(size);
    plain[..4096].fill(0);
    let img = t.path("img");
    std::fs::write(&img, &plain).unwrap();
    Case { t, img, key, plain }
}

fn cb_encrypt(c: &Case, extra: &[&str]) -> Vec<String> {
    reencrypt::cryptblk_args(&c.key, &c.img, extra)
}

fn cs_reencrypt(c: &Case, extra: &[&str]) -> Vec<String> {
    reencrypt::cryptsetup_args(&c.key, &c.img, extra)
}

/// The image is a plain LUKS2 image whose data starts at half of `reduce`; cryptblk,
/// cryptsetup and openssl read the first `size - reduce` bytes of the original plaintext
/// from it, and the plaintext copy init moved to the end is gone.
fn check_result(c: &Case, reduce: u64, sector: u64) {
    assert!(!in_reencryption(&c.img), "encryption not finished");
    let dump = dump_json(&c.img);
    let shift = reduce / 2;
    assert_eq!(dump["data_offset"].as_u64(), Some(shift), "{dump}");
    assert_eq!(dump["sector_size"].as_u64(), Some(sector), "{dump}");
    assert!(
        cryptsetup_accepts(&c.img, &c.key),
        "cryptsetup refuses the passphrase"
    );
    let kept = (c.plain.len() as u64 - reduce) as usize;
    let out = cryptblk_decrypt(&c.img, &c.key, &c.img.with_extension("raw"));
    let what = "volume size (cryptsetup's: the image minus the header)";
    assert_eq!(out.len() as u64, c.plain.len() as u64 - shift, "{what}");
    assert_same_bytes(&out[..kept], &c.plain[..kept], "cryptblk's decryption");
    let key_hex = xts::cryptsetup_volume_key(&c.img, &c.key);
    xts::check_sampled_sectors(&c.img, &key_hex, sector, &c.plain[..kept]);
    let image = read(&c.img);
    let tail = &image[image.len() - shift as usize..];
    let what = "the moved plaintext copy was left at the end of the image";
    assert!(tail != &c.plain[..shift as usize], "{what}");
}

#[test]
fn cryptblk_encrypts_like_cryptsetup() {
    let c = case(40 * MIB);
    // The same plaintext encrypted by cryptsetup: same data offset, same volume size.
    let twin = c.img.with_extension("cs");
    std::fs::write(&twin, &c.plain).unwrap();
    let mut args = cs_reencrypt(&c, &["--encrypt", "--reduce-device-size", "8M"]);
    *args.last_mut().unwrap() = s(&twin).to_string();
    tool("cryptsetup", &args).ok();

    let out = cryptblk(cb_encrypt(
        &c,
        &["--encrypt", "--reduce-device-size", "8M", "-p"],
    ));
    out.ok();
    check_result(&c, 8 * MIB, 512);
    let (ours, theirs) = (dump_json(&c.img), dump_json(&twin));
    assert_eq!(ours["data_offset"], theirs["data_offset"]);
    let cs_plain = cryptblk_decrypt(&twin, &c.key, &twin.with_extension("raw"));
    let cb_plain = cryptblk_decrypt(&c.img, &c.key, &c.img.with_extension("raw2"));
    assert_eq!(cs_plain.len(), cb_plain.len(), "volume sizes differ");
    let kept = (40 - 8) * MIB as usize;
    assert_same_bytes(
        &cb_plain[..kept],
        &cs_plain[..kept],
        "cryptblk vs cryptsetup",
    );
}

#[test]
fn cryptblk_encrypts_with_4k_sectors_and_a_256_bit_key() {
    let c = case(24 * MIB);
    cryptblk(cb_encrypt(
        &c,
        &[
            "--encrypt",
            "--reduce-device-size",
            "2M",
            "--sector-size",
            "4096",
            "--key-size",
            "256",
        ],
    ))
    .ok();
    check_result(&c, 2 * MIB, 4096);
    assert_eq!(xts::cryptsetup_volume_key(&c.img, &c.key).len() * 4, 256);
}

#[test]
fn cryptsetup_init_only_cryptblk_finishes() {
    cs_init_only_cryptblk_finishes("cryptsetup");
}

#[test]
fn cryptsetup27_init_only_cryptblk_finishes() {
    cs_init_only_cryptblk_finishes(s(&cryptblk_testutil::cryptsetup27()));
}

fn cs_init_only_cryptblk_finishes(cs: &str) {
    let c = case(24 * MIB);
    tool(
        cs,
        cs_reencrypt(
            &c,
            &["--encrypt", "--reduce-device-size", "4M", "--init-only"],
        ),
    )
    .ok();
    assert!(in_reencryption(&c.img));
    cryptblk(cb_encrypt(&c, &["--resume-only"])).ok();
    check_result(&c, 4 * MIB, 512);
}

#[test]
fn cryptblk_init_only_cryptsetup_finishes() {
    let c = case(24 * MIB);
    cryptblk(cb_encrypt(
        &c,
        &["--encrypt", "--reduce-device-size", "4M", "--init-only"],
    ))
    .ok();
    assert!(in_reencryption(&c.img));
    let dump = tool("cryptsetup", ["luksDump", s(&c.img)]);
    for want in [
        "Mode:       encrypt",
        "Direction:  backward",
        "Resilience: datashift",
        "backup-moved-segment",
    ] {
        assert!(dump.stdout.contains(want), "{want}:\n{}", dump.stdout);
    }
    tool("cryptsetup", cs_reencrypt(&c, &["--resume-only"])).ok();
    check_result(&c, 4 * MIB, 512);
}

/// 1M of reduce: 512 KiB hotzones, hundreds of commits to land a kill among.
const KILL_SIZE: u64 = 96 * MIB;

#[test]
fn cryptblk_killed_cryptsetup_resumes() {
    cb_killed_cryptsetup_resumes("cryptsetup");
}

#[test]
fn cryptblk_killed_cryptsetup27_resumes() {
    cb_killed_cryptsetup_resumes(s(&cryptblk_testutil::cryptsetup27()));
}

fn cb_killed_cryptsetup_resumes(cs: &str) {
    let c = case(KILL_SIZE);
    let mut cmd = Command::new(bin());
    cmd.args(cb_encrypt(&c, &["--encrypt", "--reduce-device-size", "1M"]));
    kill_midway(cmd, &c.img, 40);
    assert!(in_reencryption(&c.img), "cryptblk finished before the kill");
    tool(
        cs,
        ["repair", "--batch-mode", "--key-file", s(&c.key), s(&c.img)],
    )
    .ok();
    tool(cs, cs_reencrypt(&c, &["--resume-only"])).ok();
    check_result(&c, MIB, 512);
}

#[test]
fn cryptsetup_killed_cryptblk_resumes() {
    cs_killed_cryptblk_resumes("cryptsetup");
}

#[test]
fn cryptsetup27_killed_cryptblk_resumes() {
    cs_killed_cryptblk_resumes(s(&cryptblk_testutil::cryptsetup27()));
}

fn cs_killed_cryptblk_resumes(cs: &str) {
    let c = case(KILL_SIZE);
    let mut cmd = Command::new(cs);
    cmd.args(cs_reencrypt(
        &c,
        &["--encrypt", "--reduce-device-size", "1M"],
    ));
    kill_midway(cmd, &c.img, 40);
    assert!(
        in_reencryption(&c.img),
        "cryptsetup finished before the kill"
    );
    cryptblk(cb_encrypt(&c, &["--resume-only"])).ok();
    check_result(&c, MIB, 512);
}

#[test]
fn cryptblk_killed_then_served_converted_and_resumed() {
    let c = case(KILL_SIZE);
    let mut cmd = Command::new(bin());
    cmd.args(cb_encrypt(&c, &["--encrypt", "--reduce-device-size", "1M"]));
    kill_midway(cmd, &c.img, 40);
    assert!(in_reencryption(&c.img));
    // The daemon serves it as it is (recovering a hotzone the kill interrupted): the volume
    // the encryption keeps, the image minus the reduction, reads as the plaintext.
    let serve = c.t.serve().image(&c.img).key(&c.key).name("vol");
    let mut daemon = serve.nbd().control().start();
    let kept = c.plain.len() - MIB as usize;
    let mut client = daemon.nbd("vol");
    assert_eq!(client.export.size, kept as u64);
    for off in (0..kept).step_by(MIB as usize) {
        let len = MIB.min((kept - off) as u64) as u32;
        let got = client.read(off as u64, len).unwrap();
        assert_same_bytes(&got, &c.plain[off..off + len as usize], "served mid-way");
    }
    drop(client);
    let st = daemon.ctl_ok(&["reencrypt-status", "vol"]);
    assert_eq!(st["phase"], "paused", "{st}");
    assert_eq!(st["mode"], "encrypt", "{st}");
    assert_eq!(daemon.terminate(), 0);
    // `convert` reads it the same way, and leaves it as it is.
    let before = read(&c.img);
    let out = cryptblk_decrypt(&c.img, &c.key, &c.img.with_extension("raw"));
    assert_same_bytes(&out, &c.plain[..kept], "convert mid-way");
    assert!(read(&c.img) == before, "convert changed the image");
    cryptblk(cb_encrypt(&c, &["--resume-only"])).ok();
    check_result(&c, MIB, 512);
}

#[test]
fn encrypt_refusals_leave_the_image_untouched() {
    let c = case(8 * MIB);
    let before = read(&c.img);
    let out = cryptblk(cb_encrypt(&c, &["--encrypt"]));
    out.expect_code(code::USAGE);
    assert!(
        out.stderr.contains("--reduce-device-size"),
        "{}",
        out.stderr
    );
    let out = cryptblk(cb_encrypt(
        &c,
        &["--encrypt", "--reduce-device-size", "256K"],
    ));
    out.expect_code(code::USAGE);
    assert!(out.stderr.contains("from 589824"), "{}", out.stderr);
    let out = cryptblk(cb_encrypt(&c, &["--encrypt", "--reduce-device-size", "8M"]));
    out.expect_code(code::USAGE);
    assert!(out.stderr.contains("too small"), "{}", out.stderr);
    let out = cryptblk(cb_encrypt(&c, &["--resume-only"]));
    assert_ne!(out.code, 0);
    let out = cryptblk(cb_encrypt(
        &c,
        &["--encrypt", "--resume-only", "--reduce-device-size", "1M"],
    ));
    out.expect_code(code::USAGE);
    assert!(out.stderr.contains("no LUKS header"), "{}", out.stderr);
    assert!(
        read(&c.img) == before,
        "a refused --encrypt changed the image"
    );

    // An image that is already LUKS is not encrypted again.
    cryptblk(cb_encrypt(&c, &["--encrypt", "--reduce-device-size", "2M"])).ok();
    let done = read(&c.img);
    let out = cryptblk(cb_encrypt(&c, &["--encrypt", "--reduce-device-size", "2M"]));
    out.expect_code(code::USAGE);
    assert!(
        out.stderr.contains("already has a LUKS header"),
        "{}",
        out.stderr
    );
    assert!(
        read(&c.img) == done,
        "a refused --encrypt changed the image"
    );
}
