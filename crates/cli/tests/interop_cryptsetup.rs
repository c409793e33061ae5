//! Interoperability with the real cryptsetup (2.6): images it makes open in cryptblk with the
//! right plaintext, and images and data cryptblk writes are accepted and decrypted by it.
mod common;

use common::*;
use std::path::Path;

/// Plaintext put into each cryptsetup-encrypted image.
const PLAIN: u64 = 4 * MIB;
/// cryptsetup's cheap PBKDF2 keyslot, for option strings.
const P2: &str = "--pbkdf pbkdf2 --pbkdf-force-iterations 1000";
/// cryptsetup's cheap Argon2 keyslots.
const A2I: &str = "--pbkdf argon2i --pbkdf-memory 32 --pbkdf-force-iterations 4";
const A2ID: &str = "--pbkdf argon2id --pbkdf-memory 32 --pbkdf-force-iterations 4";

/// cryptsetup encrypts known plaintext in place (reencrypt --encrypt) with `options`; cryptblk
/// must decrypt the payload to exactly that plaintext.
fn check_known_plaintext(name: &str, options: &str, expect_cipher: &str, expect_sector: u64) {
    let t = TestDir::new();
    let key = t.key("key");
    let plain = random_data(PLAIN);
    let options: Vec<&str> = options.split_whitespace().collect();
    let img = cryptsetup_encrypt_in_place(t.root(), "img", &plain, &key, &options);

    let dump = dump_json(&img);
    assert_eq!(dump["version"], 2, "{name}: {dump}");
    let sector = dump["sector_size"].as_u64();
    assert_eq!(sector, Some(expect_sector), "{name}: sector size: {dump}");
    let cipher = dump["segments"][0]["cipher"].as_str();
    assert_eq!(
        cipher,
        Some(expect_cipher),
        "{name}: cipher in dump: {dump}"
    );
    let data_offset = dump["data_offset"].as_u64().expect("data_offset in dump");

    let out = cryptblk_decrypt(&img, &key, &t.path("out.raw"));
    let img_len = std::fs::metadata(&img).unwrap().len();
    let what = format!("{name}: decrypted payload size");
    assert_eq!(out.len() as u64, img_len - data_offset, "{what}");
    let what = format!("{name}: cryptblk's decryption of cryptsetup's image");
    assert_same_bytes(&out[..PLAIN as usize], &plain, &what);

    // And a wrong passphrase is refused with the documented status, writing nothing.
    let (wrong, target) = (t.key("wrong"), t.path("wrong.raw"));
    cryptblk(argv!(
        "convert -O raw --source-key-file {} {} {}",
        wrong,
        img,
        target
    ))
    .expect_code(code::WRONG_PASSPHRASE);
    assert!(
        !target.exists(),
        "a failed convert left {}",
        target.display()
    );
}

#[test]
fn luks2_pbkdf2_sha256_xts512_sector512() {
    let options = format!("{P2} --hash sha256 --key-size 512");
    check_known_plaintext("p2-sha256-xts512-s512", &options, "aes-xts-plain64", 512);
}

#[test]
fn luks2_pbkdf2_sha1_xts256_sector4096() {
    let options = format!("{P2} --hash sha1 --key-size 256 --sector-size 4096");
    check_known_plaintext("p2-sha1-xts256-s4096", &options, "aes-xts-plain64", 4096);
}

#[test]
fn luks2_pbkdf2_sha512_xts512_sector4096() {
    let options = format!("{P2} --hash sha512 --key-size 512 --sector-size 4096");
    check_known_plaintext("p2-sha512-xts512-s4096", &options, "aes-xts-plain64", 4096);
}

#[test]
fn luks2_argon2i_xts256_sector512() {
    let options = format!("{A2I} --key-size 256");
    check_known_plaintext("a2i-xts256-s512", &options, "aes-xts-plain64", 512);
}

#[test]
fn luks2_argon2id_xts512_sector4096() {
    let options = format!("{A2ID} --key-size 512 --sector-size 4096");
    check_known_plaintext("a2id-xts512-s4096", &options, "aes-xts-plain64", 4096);
}

#[test]
fn luks2_argon2id_sha512_xts256_sector4096() {
    let options = format!("{A2ID} --hash sha512 --key-size 256 --sector-size 4096");
    check_known_plaintext(
        "a2id-sha512-xts256-s4096",
        &options,
        "aes-xts-plain64",
        4096,
    );
}

#[test]
fn luks2_cbc_essiv_sha256() {
    let options = format!("{P2} --cipher aes-cbc-essiv:sha256 --key-size 256");
    check_known_plaintext("cbc-essiv", &options, "aes-cbc-essiv:sha256", 512);
}

#[test]
fn luks2_cbc_plain64_sector4096() {
    let options = format!("{P2} --cipher aes-cbc-plain64 --key-size 256 --sector-size 4096");
    check_known_plaintext("cbc-plain64-s4096", &options, "aes-cbc-plain64", 4096);
}

/// cryptsetup-made LUKS1 header (`format_options`), data written through QEMU's luks driver:
/// cryptblk reads the same bytes as `qemu-img convert`, including the patterns written.
fn check_luks1_qemu_data(name: &str, format_options: &str) {
    let t = TestDir::new();
    let key = t.key("key");
    let img = t.raw("img", 8 * MIB);
    let mut format = argv!(
        "luksFormat --type luks1 --batch-mode --key-file {} --pbkdf-force-iterations 1000",
        key
    );
    format.extend(format_options.split_whitespace().map(Into::into));
    format.push(img.as_os_str().into());
    cryptsetup(&format).ok();

    let writes = [
        "write -P 0x5a 0 64k",
        "write -P 0xa5 1M 512",
        "write -P 0x3c 2M 96k",
        "write -z 2144k 4k",
    ];
    qemu_io_cmds(&qemu_luks(&img, &key), &writes);
    let by_qemu = t.path("qemu.raw");
    let (secret, opts) = (qemu_secret(&key), qemu_luks_opts(&img));
    let convert = argv!(
        "convert --object {} --image-opts {} -O raw {}",
        secret,
        opts,
        by_qemu
    );
    tool("qemu-img", convert).ok();
    let by_cryptblk = cryptblk_decrypt(&img, &key, &t.path("cryptblk.raw"));
    let what = format!("{name}: cryptblk vs qemu-img reading QEMU-written LUKS1");
    assert_same_bytes(&by_cryptblk, &read(&by_qemu), &what);
    // The patterns are where QEMU put them (guards against both tools reading garbage alike).
    let (m, at) = (MIB as usize, 2 * MIB as usize);
    assert_filled(
        &by_cryptblk[..64 * 1024],
        0x5a,
        &format!("{name}: pattern 0x5a at 0"),
    );
    assert_filled(
        &by_cryptblk[m..m + 512],
        0xa5,
        &format!("{name}: pattern 0xa5 at 1M"),
    );
    let what = format!("{name}: pattern 0x3c at 2M");
    assert_filled(&by_cryptblk[at..at + 96 * 1024], 0x3c, &what);
    let what = format!("{name}: zeros at 2112k");
    assert_filled(&by_cryptblk[at + 96 * 1024..at + 100 * 1024], 0, &what);
}

#[test]
fn luks1_xts_plain64_256_sha256_qemu_data() {
    let options = "--cipher aes-xts-plain64 --key-size 256 --hash sha256";
    check_luks1_qemu_data("l1-xts256-sha256", options);
}

#[test]
fn luks1_xts_plain64_512_sha1_qemu_data() {
    check_luks1_qemu_data(
        "l1-xts512-sha1",
        "--cipher aes-xts-plain64 --key-size 512 --hash sha1",
    );
}

#[test]
fn luks1_cbc_essiv_sha256_qemu_data() {
    let options = "--cipher aes-cbc-essiv:sha256 --key-size 256 --hash sha256";
    check_luks1_qemu_data("l1-cbc-essiv", options);
}

#[test]
fn luks1_cbc_essiv_sha1_hash_qemu_data() {
    let options = "--cipher aes-cbc-essiv:sha256 --key-size 128 --hash sha1";
    check_luks1_qemu_data("l1-cbc-essiv-sha1", options);
}

fn slot_ids(dump: &serde_json::Value) -> Vec<String> {
    let slots = dump["keyslots"]
        .as_array()
        .expect("keyslots array in dump --json");
    let slots = slots.iter();
    if dump["version"] == 1 {
        let active = slots.filter(|k| k["active"] == true);
        active.map(|k| k["slot"].to_string()).collect()
    } else {
        slots
            .map(|k| k["id"].as_str().expect("keyslot id").to_string())
            .collect()
    }
}

/// Keyslot 0 killed, the passphrase only in slot 5: cryptblk finds it, and the old one is refused.
#[test]
fn keyslot_gaps_luks2() {
    let t = TestDir::new();
    let (k0, k5) = (t.key("k0"), t.key("k5"));
    let plain = random_data(PLAIN);
    let p2: Vec<&str> = P2.split_whitespace().collect();
    let img = cryptsetup_encrypt_in_place(t.root(), "img", &plain, &k0, &p2);
    let add = argv!(
        "luksAddKey --batch-mode --key-file {} --key-slot 5 {} {}",
        k0,
        img,
        k5
    );
    cryptsetup_cheap(add).ok();
    cryptsetup(argv!(
        "luksKillSlot --batch-mode --key-file {} {} 0",
        k5,
        img
    ))
    .ok();

    assert_eq!(slot_ids(&dump_json(&img)), vec!["5".to_string()]);
    let out = cryptblk_decrypt(&img, &k5, &t.path("out.raw"));
    assert_same_bytes(
        &out[..PLAIN as usize],
        &plain,
        "payload unlocked through keyslot 5",
    );
    let target = t.path("old.raw");
    cryptblk(argv!(
        "convert -O raw --source-key-file {} {} {}",
        k0,
        img,
        target
    ))
    .expect_code(code::WRONG_PASSPHRASE)
    .error_line(&["no keyslot matches"]);
}

#[test]
fn keyslot_gaps_luks1() {
    let t = TestDir::new();
    let (k0, k5) = (t.key("k0"), t.key("k5"));
    let img = t.raw("img", 6 * MIB);
    let format = argv!(
        "luksFormat --type luks1 --batch-mode --pbkdf-force-iterations 1000 --key-file {} {}",
        k0,
        img
    );
    cryptsetup(format).ok();
    // Known data through QEMU, read back through keyslot 5 after slot 0 is gone.
    qemu_io_cmds(&qemu_luks(&img, &k0), &["write -P 0x77 0 1M"]);
    let add = argv!(
        "luksAddKey --batch-mode --key-slot 5 --pbkdf-force-iterations 1000 --key-file {} {} {}",
        k0,
        img,
        k5
    );
    cryptsetup(add).ok();
    cryptsetup(argv!(
        "luksKillSlot --batch-mode --key-file {} {} 0",
        k5,
        img
    ))
    .ok();

    assert_eq!(slot_ids(&dump_json(&img)), vec!["5".to_string()]);
    let out = cryptblk_decrypt(&img, &k5, &t.path("out.raw"));
    assert_filled(
        &out[..MIB as usize],
        0x77,
        "QEMU's pattern read through keyslot 5",
    );
    let target = t.path("old.raw");
    cryptblk(argv!(
        "convert -O raw --source-key-file {} {} {}",
        k0,
        img,
        target
    ))
    .expect_code(code::WRONG_PASSPHRASE);
}

/// Data cryptblk writes into a LUKS2 image survives cryptsetup's offline re-key, which decrypts
/// every sector with the old volume key: proof cryptsetup reads cryptblk's ciphertext.
fn check_rekey_roundtrip(t: &TestDir, img: &Path, key: &Key, payload_len: u64) {
    let src = t.path("src.raw");
    let data_len = payload_len - 512 * 1024;
    mixed_file(&src, data_len, 7);
    cryptblk(argv!(
        "convert -n -O luks --key-file {} {} {}",
        key,
        src,
        img
    ))
    .ok();
    let before = cryptblk_decrypt(img, key, &t.path("before.raw"));
    let what = "cryptblk reads back what it wrote";
    assert_same_bytes(&before[..data_len as usize], &read(&src), what);
    let data_offset = dump_json(img)["data_offset"].as_u64().unwrap() as usize;
    let cipher_before = read(img)[data_offset..].to_vec();

    let rekey = "reencrypt --force-offline-reencrypt --key-file {} --batch-mode {}";
    cryptsetup_cheap(argv!(rekey, key, img)).ok();

    let cipher_after = read(img)[data_offset..].to_vec();
    let m = MIB as usize;
    let what = "cryptsetup reencrypt changed the ciphertext";
    assert_ne!(cipher_before[..m], cipher_after[..m], "{what}");
    let after = cryptblk_decrypt(img, key, &t.path("after.raw"));
    assert_same_bytes(&after, &before, "payload after cryptsetup's re-key");
    assert!(cryptsetup_accepts(img, key));
}

#[test]
fn cryptblk_data_in_cryptsetup_luks2_survives_rekey() {
    let t = TestDir::new();
    let key = t.key("key");
    let options: Vec<&str> = P2
        .split_whitespace()
        .chain(["--sector-size", "4096"])
        .collect();
    let zeros = vec![0u8; PLAIN as usize];
    let img = cryptsetup_encrypt_in_place(t.root(), "img", &zeros, &key, &options);
    let payload =
        std::fs::metadata(&img).unwrap().len() - dump_json(&img)["data_offset"].as_u64().unwrap();
    check_rekey_roundtrip(&t, &img, &key, payload);
}

#[test]
fn cryptblk_formatted_luks2_data_survives_cryptsetup_rekey() {
    check_cryptblk_format_rekey(&["--sector-size", "512"]);
}

/// The default LUKS2 format (4096-byte sectors): cryptsetup must decrypt every sector, not
/// only the first (the IV numbering of large sectors must match dm-crypt's).
#[test]
fn cryptblk_default_luks2_4096_data_survives_cryptsetup_rekey() {
    check_cryptblk_format_rekey(&[]);
}

fn check_cryptblk_format_rekey(options: &[&str]) {
    let t = TestDir::new();
    let key = t.key("key");
    let img = t.luks2_with("img", "6M", &key, &[&["--type", "luks2"], options].concat());
    check_rekey_roundtrip(&t, &img, &key, 6 * MIB);
}

/// cryptblk-formatted images (`format_options`): cryptsetup parses the header and accepts
/// exactly the passphrase.
fn check_cryptsetup_accepts_format(name: &str, format_options: &str, expect_dump: &[&str]) {
    let t = TestDir::new();
    let (key, wrong) = (t.key("key"), t.key("wrong"));
    let img = t.path("img");
    let mut format = argv!("format -q --key-file {}", key);
    format.extend(format_options.split_whitespace().map(Into::into));
    format.extend([img.as_os_str().into(), "4M".into()]);
    cryptblk(&format).ok();
    let dump = cryptsetup(["luksDump", s(&img)]);
    dump.ok();
    for needle in expect_dump {
        let (found, stdout) = (dump.stdout.contains(needle), &dump.stdout);
        assert!(
            found,
            "{name}: cryptsetup luksDump lacks {needle:?}:\n{stdout}"
        );
    }
    let uuid = dump_json(&img)["uuid"].as_str().unwrap().to_string();
    let what = format!("{name}: cryptsetup sees a different UUID than cryptblk ({uuid})");
    assert!(dump.stdout.contains(&uuid), "{what}");
    let what = format!("{name}: cryptsetup refuses the passphrase of a cryptblk image");
    assert!(cryptsetup_accepts(&img, &key), "{what}");
    let what = format!("{name}: cryptsetup accepts a wrong passphrase");
    assert!(!cryptsetup_accepts(&img, &wrong), "{what}");
}

#[test]
fn cryptblk_luks1_passes_cryptsetup() {
    check_cryptsetup_accepts_format(
        "fmt-l1",
        "--type luks1 --pbkdf-force-iterations 1000",
        &[
            "Version:       \t1",
            "Cipher name:   \taes",
            "Cipher mode:   \txts-plain64",
            "MK bits:       \t512",
            "Key Slot 0: ENABLED",
        ],
    );
}

#[test]
fn cryptblk_luks1_cbc_essiv_sha1_passes_cryptsetup() {
    check_cryptsetup_accepts_format(
        "fmt-l1-cbc",
        "--type luks1 --cipher aes-cbc-essiv:sha256 --key-size 256 --hash sha1 \
         --pbkdf-force-iterations 1000",
        &[
            "Cipher mode:   \tcbc-essiv:sha256",
            "Hash spec:     \tsha1",
            "MK bits:       \t256",
        ],
    );
}

#[test]
fn cryptblk_luks2_pbkdf2_passes_cryptsetup() {
    check_cryptsetup_accepts_format(
        "fmt-l2-p2",
        "--type luks2 --label cbtest --pbkdf pbkdf2 --pbkdf-force-iterations 1000",
        &[
            "Version:       \t2",
            "Label:         \tcbtest",
            "cipher: aes-xts-plain64",
            "sector: 4096 [bytes]",
            "PBKDF:      pbkdf2",
        ],
    );
}

#[test]
fn cryptblk_luks2_argon2id_passes_cryptsetup() {
    check_cryptsetup_accepts_format(
        "fmt-l2-a2",
        "--type luks2 --sector-size 512 --key-size 256 \
         --pbkdf argon2id --pbkdf-memory 64 --pbkdf-force-iterations 4",
        &[
            "PBKDF:      argon2id",
            "sector: 512 [bytes]",
            "Key:        256 bits",
        ],
    );
}

/// After cryptblk's key add / change / remove, cryptsetup accepts exactly the expected passphrases.
fn check_key_commands(version: &str) {
    let t = TestDir::new();
    let k = [t.key("k0"), t.key("k1"), t.key("k2")];
    let img = t.path("img");
    cryptblk_cheap(argv!(
        "format -q --type {} --key-file {} {} 4M",
        version,
        k[0],
        img
    ))
    .ok();
    let accepted = || -> Vec<bool> { k.iter().map(|key| cryptsetup_accepts(&img, key)).collect() };
    assert_eq!(accepted(), [true, false, false], "{version}: after format");

    cryptblk_cheap(argv!(
        "key add --key-file {} --new-key-file {} {}",
        k[0],
        k[1],
        img
    ))
    .ok();
    assert_eq!(
        accepted(),
        [true, true, false],
        "{version}: after key add k1"
    );

    cryptblk_cheap(argv!(
        "key change --key-file {} --new-key-file {} {}",
        k[1],
        k[2],
        img
    ))
    .ok();
    assert_eq!(
        accepted(),
        [true, false, true],
        "{version}: after key change k1 -> k2"
    );

    cryptblk(argv!("key remove --key-file {} {}", k[0], img)).ok();
    assert_eq!(
        accepted(),
        [false, false, true],
        "{version}: after key remove k0"
    );
    cryptsetup(["luksDump", s(&img)]).ok();
}

#[test]
fn key_commands_luks2_seen_by_cryptsetup() {
    check_key_commands("luks2");
}

#[test]
fn key_commands_luks1_seen_by_cryptsetup() {
    check_key_commands("luks1");
}
