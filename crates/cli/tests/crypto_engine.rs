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

/// The engines that can run LUKS2's default cipher on this CPU (vaes only with VAES).
fn runnable() -> Vec<&'static str> {
    let spec = CipherSpec::parse_luks2("aes-xts-plain64", 64).unwrap();
    engines()
        .into_iter()
        .filter(|e| e.supports(&spec))
        .map(|e| e.name())
        .collect()
}

/// The engine a daemon started with `args` (and `CRYPTBLK_ENGINE=env`) uses for `img`.
fn serve_engine(t: &TestDir, img: &Image, args: &[&str], env: Option<&str>) -> String {
    let mut serve = t.serve().control().args(args);
    if let Some(name) = env {
        serve = serve.env("CRYPTBLK_ENGINE", name);
    }
    let mut daemon = serve.start();
    let (key, sock) = (img.key(), t.path("d.sock"));
    let add = argv!(
        "disk-add d --image {} --key-file {} --vhost-user-blk {}",
        img,
        key,
        sock
    );
    let added = daemon.ctl_ok(&add);
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
    let t = TestDir::new();
    let img = t.luks2("d.luks", "8M", &t.key("key"));
    for name in &names {
        let used = serve_engine(&t, &img, &["--crypto-engine", name], None);
        assert_eq!(used, *name, "serve --crypto-engine {name}");
    }
    // The variable alone forces too, and the option wins over it.
    let used = serve_engine(&t, &img, &[], Some("rustcrypto"));
    assert_eq!(used, "rustcrypto", "CRYPTBLK_ENGINE=rustcrypto");
    let used = serve_engine(
        &t,
        &img,
        &["--crypto-engine", "openssl"],
        Some("rustcrypto"),
    );
    assert_eq!(used, "openssl", "--crypto-engine over CRYPTBLK_ENGINE");
}

#[test]
fn bench_marks_the_forced_engine_as_default() {
    for name in runnable() {
        let out = cryptblk(argv!(
            "--crypto-engine {} bench --json --seconds 0.01",
            name
        ));
        out.ok();
        let report: serde_json::Value = serde_json::from_str(&out.stdout).unwrap();
        let results = report["results"].as_array().unwrap().iter();
        let defaults = results.filter(|r| r["is_default"] == true);
        let defaults: Vec<&str> = defaults.map(|r| r["engine"].as_str().unwrap()).collect();
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
    let t = TestDir::new();
    let key = t.key("key");
    let options = ["--cipher", "aes-cbc-essiv:sha256", "--key-size", "256"];
    let img = t.luks2_with("cbc.luks", "4M", &key, &options);
    let out_img = t.path("out.raw");
    let convert = |engines: &str| {
        cryptblk(argv!(
            "--crypto-engine {} convert -O raw --source-key-file {} {} {}",
            engines,
            key,
            img,
            out_img
        ))
    };
    convert("vaes").expect_code(code::UNSUPPORTED).error_line(&[
        "vaes",
        "aes-cbc-essiv:sha256",
        "forced",
    ]);
    // A list takes the first engine that runs each cipher: openssl for this one.
    convert("vaes,openssl").ok();
}

#[test]
fn images_each_engine_writes_read_back_independently() {
    let names = runnable();
    if !names.contains(&"vaes") {
        cryptblk_testutil::skip(&format!(
            "this CPU lacks VAES: only {names:?} are checked here"
        ));
    }
    let t = TestDir::new();
    let (key, raw, back) = (t.key("key"), t.path("plain.raw"), t.path("back.raw"));
    random_file(&raw, 4 * MIB, 34);
    let plain = read(&raw);
    for name in &names {
        for (key_bits, sector) in [("512", "4096"), ("256", "512")] {
            let img = t.path(&format!("{name}-{key_bits}-{sector}.luks"));
            cryptblk_cheap(argv!(
                "--crypto-engine {} convert -O luks2 --key-file {} --key-size {} --sector-size {} {} {}",
                name,
                key,
                key_bits,
                sector,
                raw,
                img
            ))
            .ok();
            let what = format!("{name}, {key_bits}-bit key, {sector}-byte sectors");
            // Independent of every cryptblk engine: cryptsetup recovers the volume key,
            // openssl does the AES of sampled sectors.
            let vk = cryptsetup_volume_key(&img, &key);
            assert_eq!(vk.len() * 4, key_bits.parse::<usize>().unwrap(), "{what}");
            check_sampled_sectors(&img, &vk, sector.parse().unwrap(), &plain);
            // And back through the same engine.
            let to_raw = "--crypto-engine {} convert -O raw --source-key-file {} {} {}";
            cryptblk(argv!(to_raw, name, key, img, back)).ok();
            assert!(read(&back) == plain, "{what}: decrypted image differs");
            std::fs::remove_file(&back).unwrap();
            std::fs::remove_file(&img).unwrap();
        }
    }
}
