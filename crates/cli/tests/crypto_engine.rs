//! `--crypto-engine` and `CRYPTBLK_ENGINE`: each engine this CPU can run serves a LUKS2 disk
//! when forced (the daemon reports the engine it uses) and is the one `bench` marks as the
//! default; each writes LUKS2 images that cryptsetup's volume key and openssl's AES read back
//! (AES-128 and AES-256, 512- and 4096-byte sectors); the option wins over the variable; an
//! engine that cannot run an image's cipher refuses it by name with exit 3, and a list
//! (vaes,openssl) hands such a cipher to the next engine; an unknown name is a usage error.
mod common;

use common::xts::{check_sampled_sectors, cryptsetup_volume_key};
use common::*;
use cryptblk_crypto::{engines, CipherSpec};
use std::path::Path;

/// The engines that can run LUKS2's default cipher on this CPU (vaes only with VAES).
fn runnable() -> Vec<&'static str> {
    let spec = CipherSpec::parse_luks2("aes-xts-plain64", 64).unwrap();
    engines().into_iter().filter(|e| e.supports(&spec)).map(|e| e.name()).collect()
}

fn serve_engine(dir: &Path, img: &Path, key: &Path, args: &[&str], env: Option<&str>) -> String {
    let t = TestDir::new();
    let mut serve = t.serve().control().args(args);
    if let Some(name) = env {
        serve = serve.env("CRYPTBLK_ENGINE", name);
    }
    let mut daemon = serve.start();
    let sock = dir.join("d.sock");
    let added = daemon.ctl_ok(&[
        "disk-add",
        "d",
        "--image",
        s(img),
        "--key-file",
        s(key),
        "--vhost-user-blk",
        s(&sock),
    ]);
    assert_eq!(daemon.terminate(), code::OK);
    added["engine"].as_str().unwrap_or("none").to_string()
}

#[test]
fn every_runnable_engine_can_be_forced_for_served_disks() {
    let names = runnable();
    if !names.contains(&"vaes") {
        cryptblk_testutil::skip(&format!(
            "this CPU lacks VAES: forcing covers only {names:?} here"
        ));
    }
    let dir = tempdir();
    let key = key_file(dir.path(), "key", &passphrase("crypto-engine"));
    let img = dir.path().join("d.luks");
    format_luks2(&img, &key, "8M");
    for name in &names {
        let used = serve_engine(dir.path(), &img, &key, &["--crypto-engine", name], None);
        assert_eq!(used, *name, "serve --crypto-engine {name}");
    }
    // The variable alone forces too, and the option wins over it.
    let used = serve_engine(dir.path(), &img, &key, &[], Some("rustcrypto"));
    assert_eq!(used, "rustcrypto", "CRYPTBLK_ENGINE=rustcrypto");
    let used =
        serve_engine(dir.path(), &img, &key, &["--crypto-engine", "openssl"], Some("rustcrypto"));
    assert_eq!(used, "openssl", "--crypto-engine over CRYPTBLK_ENGINE");
}

#[test]
fn bench_marks_the_forced_engine_as_default() {
    for name in runnable() {
        let out = cryptblk(["--crypto-engine", name, "bench", "--json", "--seconds", "0.01"]);
        out.ok();
        let report: serde_json::Value = serde_json::from_str(&out.stdout).unwrap();
        let defaults: Vec<&str> = report["results"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["is_default"] == true)
            .map(|r| r["engine"].as_str().unwrap())
            .collect();
        // Two key sizes × two sector sizes, all on the forced engine.
        assert_eq!(defaults, [name; 4], "{}", out.stdout);
    }
}

#[test]
fn a_forced_engine_refuses_a_cipher_it_cannot_run() {
    if !runnable().contains(&"vaes") {
        cryptblk_testutil::skip("this CPU lacks VAES: the vaes engine cannot be forced here");
        return;
    }
    let dir = tempdir();
    let key = key_file(dir.path(), "key", &passphrase("crypto-engine-cbc"));
    let img = dir.path().join("cbc.luks");
    let mut args = vec![
        "format",
        "-q",
        "--cipher",
        "aes-cbc-essiv:sha256",
        "--key-size",
        "256",
        "--key-file",
        s(&key),
    ];
    args.extend_from_slice(CHEAP_PBKDF2);
    args.extend([s(&img), "4M"]);
    cryptblk(&args).ok();
    let out_img = dir.path().join("out.raw");
    let convert = [
        "--crypto-engine",
        "vaes",
        "convert",
        "-O",
        "raw",
        "--source-key-file",
        s(&key),
        s(&img),
        s(&out_img),
    ];
    cryptblk(convert).expect_code(code::UNSUPPORTED).error_line(&[
        "vaes",
        "aes-cbc-essiv:sha256",
        "forced",
    ]);
    // A list takes the first engine that runs each cipher: openssl for this one.
    let mut convert = convert;
    convert[1] = "vaes,openssl";
    cryptblk(convert).ok();
}

#[test]
fn images_each_engine_writes_read_back_independently() {
    let names = runnable();
    if !names.contains(&"vaes") {
        cryptblk_testutil::skip(&format!("this CPU lacks VAES: only {names:?} are checked here"));
    }
    let dir = tempdir();
    let key = key_file(dir.path(), "key", &passphrase("crypto-engine-interop"));
    let raw = dir.path().join("plain.raw");
    random_file(&raw, 4 * MIB, 34);
    let plain = read(&raw);
    for name in &names {
        for (key_bits, sector) in [("512", "4096"), ("256", "512")] {
            let img = dir.path().join(format!("{name}-{key_bits}-{sector}.luks"));
            let mut args = vec![
                "--crypto-engine",
                name,
                "convert",
                "-O",
                "luks2",
                "--key-file",
                s(&key),
                "--key-size",
                key_bits,
                "--sector-size",
                sector,
            ];
            args.extend_from_slice(CHEAP_PBKDF2);
            args.extend([s(&raw), s(&img)]);
            cryptblk(&args).ok();
            let what = format!("{name}, {key_bits}-bit key, {sector}-byte sectors");
            // Independent of every cryptblk engine: cryptsetup recovers the volume key,
            // openssl does the AES of sampled sectors.
            let vk = cryptsetup_volume_key(&img, &key);
            assert_eq!(vk.len() * 4, key_bits.parse::<usize>().unwrap(), "{what}");
            check_sampled_sectors(&img, &vk, sector.parse().unwrap(), &plain);
            // And back through the same engine.
            let back = dir.path().join("back.raw");
            cryptblk([
                "--crypto-engine",
                name,
                "convert",
                "-O",
                "raw",
                "--source-key-file",
                s(&key),
                s(&img),
                s(&back),
            ])
            .ok();
            assert!(read(&back) == plain, "{what}: decrypted image differs");
            std::fs::remove_file(&back).unwrap();
            std::fs::remove_file(&img).unwrap();
        }
    }
}
