//! `cryptblk convert-header --type luks2` against the real cryptsetup 2.6 and QEMU: a LUKS1
//! image becomes the LUKS2 image `cryptsetup convert --type luks2` makes of it (or, for
//! QEMU-made images cryptsetup refuses, one with the keyslots moved to free space), every
//! passphrase still opens it and the payload decrypts to the same plaintext; `reencrypt` on a
//! LUKS1 image converts first. Refusals leave the image untouched.
mod common;

use common::xts::{check_sampled_sectors, cryptsetup_volume_key};
use common::*;
use std::path::{Path, PathBuf};

const PLAIN: u64 = 6 * MIB;

struct Case {
    t: TestDir,
    img: PathBuf,
    keys: Vec<Key>,
    plain: Vec<u8>,
}

impl Case {
    /// A copy of the image next to it, to convert with cryptsetup or to compare against.
    fn copy(&self, name: &str) -> PathBuf {
        let p = self.t.path(name);
        std::fs::copy(&self.img, &p).unwrap();
        p
    }
}

/// Random plaintext written into a LUKS1 image through QEMU's luks driver (so no tool of
/// ours touches the payload), plus `extra_keys` more keyslots added by cryptsetup.
fn fill(t: TestDir, img: PathBuf, key: Key, extra_keys: usize) -> Case {
    let plain = random_data(PLAIN);
    let raw = t.path("plain.raw");
    std::fs::write(&raw, &plain).unwrap();
    let target = format!("driver=luks,key-secret=s0,file.filename={}", s(&img));
    let convert = "convert -n --object {} -f raw {} --target-image-opts {}";
    tool("qemu-img", argv!(convert, qemu_secret(&key), raw, target)).ok();
    let mut keys = vec![key];
    for i in 0..extra_keys {
        let k = t.key(&format!("key{i}"));
        let add = "luksAddKey --batch-mode --pbkdf-force-iterations 1000 --key-file {} {} {}";
        cryptsetup(argv!(add, keys[0], img, k)).ok();
        keys.push(k);
    }
    Case {
        t,
        img,
        keys,
        plain,
    }
}

/// `qemu-img create -f luks` (LUKS1, 512-byte sectors, the payload right after the eighth
/// keyslot area), `opts` choosing the cipher.
fn qemu_case(opts: &str, extra_keys: usize) -> Case {
    let t = TestDir::new();
    let (key, img) = (t.key("key"), t.path("img.luks"));
    qemu_img_kdf(argv!(
        "create -q -f luks --object {} -o {} {} {}",
        &qemu_secret(&key),
        &format!("key-secret=s0,iter-time=10{opts}"),
        img,
        &PLAIN.to_string()
    ))
    .ok();
    fill(t, img, key, extra_keys)
}

/// `cryptsetup luksFormat --type luks1` (payload at 2 MiB: room for cryptsetup's shift).
fn cryptsetup_case(extra_keys: usize) -> Case {
    let t = TestDir::new();
    let (key, img) = (t.key("key"), t.path("img.luks"));
    std::fs::write(&img, vec![0u8; (PLAIN + 2 * MIB) as usize]).unwrap();
    let format = argv!(
        "luksFormat --type luks1 --batch-mode --pbkdf-force-iterations 1000 --key-file {} {}",
        key,
        img
    );
    cryptsetup(format).ok();
    fill(t, img, key, extra_keys)
}

fn luks_version(img: &Path) -> String {
    let out = cryptsetup(argv!("luksDump {}", img));
    out.ok();
    let line = out
        .stdout
        .lines()
        .find(|l| l.starts_with("Version:"))
        .unwrap();
    line.split_whitespace().last().unwrap().to_string()
}

fn json_metadata(img: &Path) -> serde_json::Value {
    let out = cryptsetup(argv!("luksDump --dump-json-metadata {}", img));
    out.ok();
    serde_json::from_str(&out.stdout).unwrap()
}

/// Every passphrase opens the image (cryptsetup), cryptblk decrypts the payload to the
/// plaintext, and so does openssl with the volume key cryptsetup recovers.
fn check_opens_with_plaintext(c: &Case, img: &Path, sector: u64) {
    for k in &c.keys {
        assert!(cryptsetup_accepts(img, k), "cryptsetup refuses {}", s(k));
    }
    let ours = cryptblk_decrypt(img, &c.keys[0], &c.t.path("out.raw"));
    assert_same_bytes(
        &ours,
        &c.plain,
        "cryptblk's decryption of the converted image",
    );
    let vk = cryptsetup_volume_key(img, c.keys.last().unwrap());
    check_sampled_sectors(img, &vk, sector, &c.plain);
}

#[test]
fn cryptsetup_luks1_converts_as_cryptsetup_converts_it() {
    let c = cryptsetup_case(1);
    let by_cryptsetup = c.copy("by-cryptsetup.img");
    cryptsetup(argv!("convert --type luks2 -q {}", by_cryptsetup)).ok();

    let out = cryptblk(argv!("convert-header --type luks2 {}", c.img));
    out.ok();
    assert!(out.stdout.contains("moved up 28 KiB"), "{}", out.stdout);
    assert_eq!(luks_version(&c.img), "2");
    check_opens_with_plaintext(&c, &c.img, 512);

    // The same metadata: keyslots (KDF, AF, areas at the LUKS1 offsets + 28 KiB), segment,
    // digest, config. Only the JSON text's key order differs (serde's field order vs
    // json-c's insertion order), so compare it parsed.
    assert_eq!(json_metadata(&c.img), json_metadata(&by_cryptsetup));
    // Byte for byte from the secondary header's end on: keyslot areas (moved the same way,
    // inactive slots' bytes included) and payload.
    let (ours, theirs) = (read(&c.img), read(&by_cryptsetup));
    assert_same_bytes(
        &ours[32768..],
        &theirs[32768..],
        "keyslot areas and payload",
    );
    // Binary headers: equal but for the random salt (104..168) and the checksum over it
    // (448..512); magic, version, size, seqid (2), label, checksum algorithm, UUID equal.
    for copy in [0, 16384] {
        assert_eq!(ours[copy..copy + 104], theirs[copy..copy + 104]);
        assert_eq!(ours[copy + 168..copy + 448], theirs[copy + 168..copy + 448]);
    }
}

#[test]
fn qemu_luks1_converts_where_cryptsetup_refuses() {
    let c = qemu_case("", 1);
    let by_cryptsetup = c.copy("by-cryptsetup.img");
    let refused = cryptsetup(argv!("convert --type luks2 -q {}", by_cryptsetup));
    assert_ne!(
        refused.code, 0,
        "cryptsetup converted a QEMU layout: {refused:?}"
    );
    assert_same_files(&by_cryptsetup, &c.img);

    let out = cryptblk(argv!("convert-header --type luks2 {}", c.img));
    out.ok();
    assert!(
        out.stdout.contains("copied to free space"),
        "{}",
        out.stdout
    );
    assert_eq!(luks_version(&c.img), "2");
    check_opens_with_plaintext(&c, &c.img, 512);

    // QEMU's default: aes-xts-plain64 with a 512-bit key, slots every 258048 bytes from 4 KiB,
    // payload right after the eighth.
    let meta = json_metadata(&c.img);
    let payload = 4096 + 8 * 258048u64;
    assert_eq!(
        meta["segments"]["0"],
        serde_json::json!({"type": "crypt", "offset": payload.to_string(), "iv_tweak": "0",
            "size": "dynamic", "encryption": "aes-xts-plain64", "sector_size": 512})
    );
    assert_eq!(
        meta["digests"]["0"]["keyslots"],
        serde_json::json!(["0", "1"])
    );
    assert_eq!(
        meta["config"]["keyslots_size"],
        (payload - 32768).to_string()
    );
    let area = |k: &str| {
        let a = &meta["keyslots"][k]["area"];
        let off: u64 = a["offset"].as_str().unwrap().parse().unwrap();
        assert_eq!(a["size"], "258048");
        off
    };
    // Both copied past the LUKS1 material still in use at the time of the copy.
    assert_eq!(
        (area("0"), area("1")),
        (4096 + 2 * 258048, 4096 + 3 * 258048)
    );
    let kdf = &meta["keyslots"]["0"]["kdf"];
    assert_eq!(
        (kdf["type"].as_str(), kdf["hash"].as_str()),
        (Some("pbkdf2"), Some("sha256"))
    );
    // The old copies of the key material are wiped.
    let bytes = read(&c.img);
    assert_filled(&bytes[32768..4096 + 256000], 0, "old slot 0 copy left");
    let old1 = 4096 + 258048;
    assert_filled(&bytes[old1..old1 + 256000], 0, "old slot 1 copy left");
}

#[test]
fn reencrypt_turns_a_qemu_luks1_disk_into_luks2_with_4k_sectors() {
    // aes-xts with a 256-bit key, as older QEMU made them.
    let c = qemu_case(",cipher-alg=aes-128,cipher-mode=xts", 0);
    let old_key = cryptsetup_volume_key(&c.img, &c.keys[0]);
    let out = cryptblk_cheap(argv!(
        "reencrypt --key-file {} --sector-size 4096 {}",
        c.keys[0],
        c.img
    ));
    out.ok();
    assert!(
        out.stderr
            .contains("converted the LUKS1 header to LUKS2 first"),
        "{}",
        out.stderr
    );
    let meta = json_metadata(&c.img);
    assert_eq!(meta["segments"]["0"]["sector_size"], 4096);
    assert_eq!(meta["segments"]["0"]["encryption"], "aes-xts-plain64");
    let new_key = cryptsetup_volume_key(&c.img, &c.keys[0]);
    assert_ne!(new_key, old_key, "the volume key was not replaced");
    assert_eq!(new_key.len(), 64, "key size kept (256 bits)");
    check_opens_with_plaintext(&c, &c.img, 4096);
}

#[test]
fn refusals_leave_the_image_untouched() {
    // Five active keyslots in QEMU's layout: no place to copy them to without overwriting
    // material still in use (and no room for cryptsetup's shift either).
    let c = qemu_case("", 4);
    let before = c.copy("before.img");
    let out = cryptblk(argv!("convert-header --type luks2 {}", c.img));
    out.expect_code(3);
    out.error_line(&["no room", "cryptblk key remove"]);
    assert_same_files(&c.img, &before);
    let refused = cryptsetup(argv!("convert --type luks2 -q {}", before));
    assert_ne!(refused.code, 0);

    // reencrypt with a wrong passphrase: refused before the conversion.
    let wrong = c.t.key("wrong");
    cryptblk(argv!("reencrypt --key-file {} {}", wrong, c.img)).expect_code(2);
    assert_same_files(&c.img, &before);

    // Already LUKS2: a usage error.
    let t = TestDir::new();
    let (img, before) = (t.luks2("v2.img", "4M", &t.key("key")), t.path("before.img"));
    std::fs::copy(&img, &before).unwrap();
    let out = cryptblk(argv!("convert-header --type luks2 {}", img));
    out.expect_code(1).error_line(&["already LUKS2"]);
    assert_same_files(&img, &before);
}
