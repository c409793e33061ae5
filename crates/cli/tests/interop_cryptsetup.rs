//! Interoperability with the real cryptsetup (2.6): images it makes open in cryptblk with the
//! right plaintext, and images and data cryptblk writes are accepted and decrypted by it.
mod common;

use common::*;
use std::path::Path;

/// Plaintext put into each cryptsetup-encrypted image.
const PLAIN: u64 = 4 * MIB;

/// cryptsetup encrypts known plaintext in place (reencrypt --encrypt); cryptblk must decrypt
/// the payload to exactly that plaintext.
fn check_known_plaintext(name: &str, extra: &[&str], expect_cipher: &str, expect_sector: u64) {
    let dir = tempdir();
    let key = key_file(dir.path(), "key", &passphrase(name));
    let mut plain = vec![0u8; PLAIN as usize];
    rand::RngCore::fill_bytes(&mut rand::thread_rng(), &mut plain);
    let img = cryptsetup_encrypt_in_place(dir.path(), "img", &plain, &key, extra);

    let dump = dump_json(&img);
    assert_eq!(dump["version"], 2, "{name}: {dump}");
    assert_eq!(
        dump["sector_size"].as_u64(),
        Some(expect_sector),
        "{name}: sector size in dump: {dump}"
    );
    assert_eq!(
        dump["segments"][0]["cipher"].as_str(),
        Some(expect_cipher),
        "{name}: cipher in dump: {dump}"
    );
    let data_offset = dump["data_offset"].as_u64().expect("data_offset in dump");

    let out = cryptblk_decrypt(&img, &key, &dir.path().join("out.raw"));
    let img_len = std::fs::metadata(&img).unwrap().len();
    assert_eq!(
        out.len() as u64,
        img_len - data_offset,
        "{name}: decrypted payload size"
    );
    assert_same_bytes(
        &out[..PLAIN as usize],
        &plain,
        &format!("{name}: cryptblk's decryption of cryptsetup's image"),
    );

    // And a wrong passphrase is refused with the documented status, writing nothing.
    let wrong = key_file(dir.path(), "wrong", &passphrase(&format!("{name}-wrong")));
    let target = dir.path().join("wrong.raw");
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

const PBKDF2: &[&str] = &["--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"];

#[test]
fn luks2_pbkdf2_sha256_xts512_sector512() {
    check_known_plaintext(
        "p2-sha256-xts512-s512",
        &[PBKDF2, &["--hash", "sha256", "--key-size", "512"]].concat(),
        "aes-xts-plain64",
        512,
    );
}

#[test]
fn luks2_pbkdf2_sha1_xts256_sector4096() {
    check_known_plaintext(
        "p2-sha1-xts256-s4096",
        &[
            PBKDF2,
            &[
                "--hash",
                "sha1",
                "--key-size",
                "256",
                "--sector-size",
                "4096",
            ],
        ]
        .concat(),
        "aes-xts-plain64",
        4096,
    );
}

#[test]
fn luks2_pbkdf2_sha512_xts512_sector4096() {
    check_known_plaintext(
        "p2-sha512-xts512-s4096",
        &[
            PBKDF2,
            &[
                "--hash",
                "sha512",
                "--key-size",
                "512",
                "--sector-size",
                "4096",
            ],
        ]
        .concat(),
        "aes-xts-plain64",
        4096,
    );
}

#[test]
fn luks2_argon2i_xts256_sector512() {
    check_known_plaintext(
        "a2i-xts256-s512",
        &[
            "--pbkdf",
            "argon2i",
            "--pbkdf-memory",
            "32",
            "--pbkdf-force-iterations",
            "4",
            "--key-size",
            "256",
        ],
        "aes-xts-plain64",
        512,
    );
}

#[test]
fn luks2_argon2id_xts512_sector4096() {
    check_known_plaintext(
        "a2id-xts512-s4096",
        &[
            "--pbkdf",
            "argon2id",
            "--pbkdf-memory",
            "32",
            "--pbkdf-force-iterations",
            "4",
            "--key-size",
            "512",
            "--sector-size",
            "4096",
        ],
        "aes-xts-plain64",
        4096,
    );
}

#[test]
fn luks2_argon2id_sha512_xts256_sector4096() {
    check_known_plaintext(
        "a2id-sha512-xts256-s4096",
        &[
            "--pbkdf",
            "argon2id",
            "--pbkdf-memory",
            "32",
            "--pbkdf-force-iterations",
            "4",
            "--hash",
            "sha512",
            "--key-size",
            "256",
            "--sector-size",
            "4096",
        ],
        "aes-xts-plain64",
        4096,
    );
}

#[test]
fn luks2_cbc_essiv_sha256() {
    check_known_plaintext(
        "cbc-essiv",
        &[
            PBKDF2,
            &["--cipher", "aes-cbc-essiv:sha256", "--key-size", "256"],
        ]
        .concat(),
        "aes-cbc-essiv:sha256",
        512,
    );
}

#[test]
fn luks2_cbc_plain64_sector4096() {
    check_known_plaintext(
        "cbc-plain64-s4096",
        &[
            PBKDF2,
            &[
                "--cipher",
                "aes-cbc-plain64",
                "--key-size",
                "256",
                "--sector-size",
                "4096",
            ],
        ]
        .concat(),
        "aes-cbc-plain64",
        4096,
    );
}

/// cryptsetup-made LUKS1 header, data written through QEMU's luks driver: cryptblk reads the
/// same bytes as `qemu-img convert`, including the patterns written.
fn check_luks1_qemu_data(name: &str, format_opts: &[&str]) {
    let dir = tempdir();
    let key = key_file(dir.path(), "key", &passphrase(name));
    let img = dir.path().join("img");
    std::fs::File::create(&img)
        .unwrap()
        .set_len(8 * MIB)
        .unwrap();
    let mut args = vec![
        "luksFormat",
        "--type",
        "luks1",
        "--batch-mode",
        "--key-file",
        s(&key),
        "--pbkdf-force-iterations",
        "1000",
    ];
    args.extend_from_slice(format_opts);
    args.push(s(&img));
    tool("cryptsetup", &args).ok();

    let qemu = qemu_luks(&img, &key);
    let writes = [
        "write -P 0x5a 0 64k",
        "write -P 0xa5 1M 512",
        "write -P 0x3c 2M 96k",
        "write -z 2144k 4k",
    ];
    qemu_io_cmds(&qemu, &writes);
    let by_qemu = dir.path().join("qemu.raw");
    let (secret, opts) = (qemu_secret(&key), qemu_luks_opts(&img));
    let convert = argv!(
        "convert --object {} --image-opts {} -O raw {}",
        secret,
        opts,
        by_qemu
    );
    tool("qemu-img", convert).ok();
    let by_cryptblk = cryptblk_decrypt(&img, &key, &dir.path().join("cryptblk.raw"));
    let expected = read(&by_qemu);
    assert_same_bytes(
        &by_cryptblk,
        &expected,
        &format!("{name}: cryptblk vs qemu-img reading QEMU-written LUKS1"),
    );
    // The patterns are where QEMU put them (guards against both tools reading garbage alike).
    assert!(
        by_cryptblk[..64 * 1024].iter().all(|&b| b == 0x5a),
        "{name}: pattern 0x5a at 0"
    );
    assert!(
        by_cryptblk[MIB as usize..MIB as usize + 512]
            .iter()
            .all(|&b| b == 0xa5),
        "{name}: pattern 0xa5 at 1M"
    );
    let at = 2 * MIB as usize;
    assert!(
        by_cryptblk[at..at + 96 * 1024].iter().all(|&b| b == 0x3c),
        "{name}: pattern 0x3c at 2M"
    );
    assert!(
        by_cryptblk[at + 96 * 1024..at + 100 * 1024]
            .iter()
            .all(|&b| b == 0),
        "{name}: zeros at 2112k"
    );
}

#[test]
fn luks1_xts_plain64_256_sha256_qemu_data() {
    check_luks1_qemu_data(
        "l1-xts256-sha256",
        &[
            "--cipher",
            "aes-xts-plain64",
            "--key-size",
            "256",
            "--hash",
            "sha256",
        ],
    );
}

#[test]
fn luks1_xts_plain64_512_sha1_qemu_data() {
    check_luks1_qemu_data(
        "l1-xts512-sha1",
        &[
            "--cipher",
            "aes-xts-plain64",
            "--key-size",
            "512",
            "--hash",
            "sha1",
        ],
    );
}

#[test]
fn luks1_cbc_essiv_sha256_qemu_data() {
    check_luks1_qemu_data(
        "l1-cbc-essiv",
        &[
            "--cipher",
            "aes-cbc-essiv:sha256",
            "--key-size",
            "256",
            "--hash",
            "sha256",
        ],
    );
}

#[test]
fn luks1_cbc_essiv_sha1_hash_qemu_data() {
    check_luks1_qemu_data(
        "l1-cbc-essiv-sha1",
        &[
            "--cipher",
            "aes-cbc-essiv:sha256",
            "--key-size",
            "128",
            "--hash",
            "sha1",
        ],
    );
}

fn slot_ids(dump: &serde_json::Value) -> Vec<String> {
    let slots = dump["keyslots"]
        .as_array()
        .expect("keyslots array in dump --json");
    if dump["version"] == 1 {
        slots
            .iter()
            .filter(|k| k["active"] == true)
            .map(|k| k["slot"].to_string())
            .collect()
    } else {
        slots
            .iter()
            .map(|k| k["id"].as_str().expect("keyslot id").to_string())
            .collect()
    }
}

/// Keyslot 0 killed, the passphrase only in slot 5: cryptblk finds it, and the old one is refused.
#[test]
fn keyslot_gaps_luks2() {
    let dir = tempdir();
    let k0 = key_file(dir.path(), "k0", &passphrase("gap2-k0"));
    let k5 = key_file(dir.path(), "k5", &passphrase("gap2-k5"));
    let mut plain = vec![0u8; PLAIN as usize];
    rand::RngCore::fill_bytes(&mut rand::thread_rng(), &mut plain);
    let img = cryptsetup_encrypt_in_place(dir.path(), "img", &plain, &k0, PBKDF2);
    let mut add = vec![
        "luksAddKey",
        "--batch-mode",
        "--key-file",
        s(&k0),
        "--key-slot",
        "5",
    ];
    add.extend_from_slice(PBKDF2);
    add.extend([s(&img), s(&k5)]);
    tool("cryptsetup", &add).ok();
    tool(
        "cryptsetup",
        argv!("luksKillSlot --batch-mode --key-file {} {} 0", k5, img),
    )
    .ok();

    assert_eq!(slot_ids(&dump_json(&img)), vec!["5".to_string()]);
    let out = cryptblk_decrypt(&img, &k5, &dir.path().join("out.raw"));
    assert_same_bytes(
        &out[..PLAIN as usize],
        &plain,
        "payload unlocked through keyslot 5",
    );
    let target = dir.path().join("old.raw");
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
    let dir = tempdir();
    let k0 = key_file(dir.path(), "k0", &passphrase("gap1-k0"));
    let k5 = key_file(dir.path(), "k5", &passphrase("gap1-k5"));
    let img = dir.path().join("img");
    std::fs::File::create(&img)
        .unwrap()
        .set_len(6 * MIB)
        .unwrap();
    tool(
        "cryptsetup",
        argv!(
            "luksFormat --type luks1 --batch-mode --key-file {} --pbkdf-force-iterations 1000 {}",
            k0,
            img
        ),
    )
    .ok();
    // Known data through QEMU, read back through keyslot 5 after slot 0 is gone.
    qemu_io_cmds(&qemu_luks(&img, &k0), &["write -P 0x77 0 1M"]);
    tool(
        "cryptsetup",
        argv!("luksAddKey --batch-mode --key-file {} --key-slot 5 --pbkdf-force-iterations 1000 {} {}", k0, img, k5),
    )
    .ok();
    tool(
        "cryptsetup",
        argv!("luksKillSlot --batch-mode --key-file {} {} 0", k5, img),
    )
    .ok();

    assert_eq!(slot_ids(&dump_json(&img)), vec!["5".to_string()]);
    let out = cryptblk_decrypt(&img, &k5, &dir.path().join("out.raw"));
    assert!(
        out[..MIB as usize].iter().all(|&b| b == 0x77),
        "QEMU's pattern read through keyslot 5"
    );
    cryptblk(argv!(
        "convert -O raw --source-key-file {} {} {}",
        k0,
        img,
        dir.path().join("old.raw")
    ))
    .expect_code(code::WRONG_PASSPHRASE);
}

/// Data cryptblk writes into a LUKS2 image survives cryptsetup's offline re-key, which decrypts
/// every sector with the old volume key: proof cryptsetup reads cryptblk's ciphertext.
fn check_rekey_roundtrip(img: &Path, key: &Path, dir: &Path, payload_len: u64) {
    let src = dir.join("src.raw");
    let data_len = payload_len - 512 * 1024;
    mixed_file(&src, data_len, 7);
    cryptblk(argv!(
        "convert -n -O luks --key-file {} {} {}",
        key,
        src,
        img
    ))
    .ok();
    let before = cryptblk_decrypt(img, key, &dir.join("before.raw"));
    assert_same_bytes(
        &before[..data_len as usize],
        &read(&src),
        "cryptblk reads back what it wrote",
    );
    let data_offset = dump_json(img)["data_offset"].as_u64().unwrap();
    let cipher_before = read(img)[data_offset as usize..].to_vec();

    let mut rekey = vec![
        "reencrypt",
        "--force-offline-reencrypt",
        "--key-file",
        s(key),
        "--batch-mode",
    ];
    rekey.extend_from_slice(PBKDF2);
    rekey.push(s(img));
    tool("cryptsetup", &rekey).ok();

    let cipher_after = read(img)[data_offset as usize..].to_vec();
    assert_ne!(
        cipher_before[..MIB as usize],
        cipher_after[..MIB as usize],
        "cryptsetup reencrypt changed the ciphertext"
    );
    let after = cryptblk_decrypt(img, key, &dir.join("after.raw"));
    assert_same_bytes(&after, &before, "payload after cryptsetup's re-key");
    assert!(cryptsetup_accepts(img, key));
}

#[test]
fn cryptblk_data_in_cryptsetup_luks2_survives_rekey() {
    let dir = tempdir();
    let key = key_file(dir.path(), "key", &passphrase("rekey-cs"));
    let img = cryptsetup_encrypt_in_place(
        dir.path(),
        "img",
        &vec![0u8; PLAIN as usize],
        &key,
        &[PBKDF2, &["--sector-size", "4096"]].concat(),
    );
    let payload =
        std::fs::metadata(&img).unwrap().len() - dump_json(&img)["data_offset"].as_u64().unwrap();
    check_rekey_roundtrip(&img, &key, dir.path(), payload);
}

#[test]
fn cryptblk_formatted_luks2_data_survives_cryptsetup_rekey() {
    check_cryptblk_format_rekey("rekey-cb-512", &["--sector-size", "512"]);
}

/// The default LUKS2 format (4096-byte sectors): cryptsetup must decrypt every sector, not
/// only the first (the IV numbering of large sectors must match dm-crypt's).
#[test]
fn cryptblk_default_luks2_4096_data_survives_cryptsetup_rekey() {
    check_cryptblk_format_rekey("rekey-cb-4096", &[]);
}

fn check_cryptblk_format_rekey(name: &str, extra: &[&str]) {
    let dir = tempdir();
    let key = key_file(dir.path(), "key", &passphrase(name));
    let img = dir.path().join("img");
    let mut fmt = vec!["format", "-q", "--type", "luks2", "--key-file", s(&key)];
    fmt.extend_from_slice(extra);
    fmt.extend_from_slice(CHEAP_PBKDF2);
    fmt.extend([s(&img), "6M"]);
    cryptblk(&fmt).ok();
    check_rekey_roundtrip(&img, &key, dir.path(), 6 * MIB);
}

/// cryptblk-formatted images: cryptsetup parses the header and accepts exactly the passphrase.
fn check_cryptsetup_accepts_format(name: &str, opts: &[&str], expect_dump: &[&str]) {
    let dir = tempdir();
    let key = key_file(dir.path(), "key", &passphrase(name));
    let wrong = key_file(dir.path(), "wrong", &passphrase(&format!("{name}-wrong")));
    let img = dir.path().join("img");
    let mut fmt = vec!["format", "-q", "--key-file", s(&key)];
    fmt.extend_from_slice(opts);
    fmt.extend([s(&img), "4M"]);
    cryptblk(&fmt).ok();
    let dump = tool("cryptsetup", ["luksDump", s(&img)]);
    dump.ok();
    for needle in expect_dump {
        assert!(
            dump.stdout.contains(needle),
            "{name}: cryptsetup luksDump lacks {needle:?}:\n{}",
            dump.stdout
        );
    }
    let uuid = dump_json(&img)["uuid"].as_str().unwrap().to_string();
    assert!(
        dump.stdout.contains(&uuid),
        "{name}: cryptsetup sees a different UUID than cryptblk ({uuid})"
    );
    assert!(
        cryptsetup_accepts(&img, &key),
        "{name}: cryptsetup refuses the passphrase of a cryptblk image"
    );
    assert!(
        !cryptsetup_accepts(&img, &wrong),
        "{name}: cryptsetup accepts a wrong passphrase"
    );
}

#[test]
fn cryptblk_luks1_passes_cryptsetup() {
    check_cryptsetup_accepts_format(
        "fmt-l1",
        &["--type", "luks1", "--pbkdf-force-iterations", "1000"],
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
        &[
            "--type",
            "luks1",
            "--cipher",
            "aes-cbc-essiv:sha256",
            "--key-size",
            "256",
            "--hash",
            "sha1",
            "--pbkdf-force-iterations",
            "1000",
        ],
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
        &[&["--type", "luks2", "--label", "cbtest"], CHEAP_PBKDF2].concat(),
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
        &[
            &[
                "--type",
                "luks2",
                "--sector-size",
                "512",
                "--key-size",
                "256",
            ],
            CHEAP_ARGON2ID,
        ]
        .concat(),
        &[
            "PBKDF:      argon2id",
            "sector: 512 [bytes]",
            "Key:        256 bits",
        ],
    );
}

/// After cryptblk's key add / change / remove, cryptsetup accepts exactly the expected passphrases.
fn check_key_commands(version: &str) {
    let dir = tempdir();
    let k: Vec<_> = (0..3)
        .map(|i| {
            key_file(
                dir.path(),
                &format!("k{i}"),
                &passphrase(&format!("keys-{version}-{i}")),
            )
        })
        .collect();
    let img = dir.path().join("img");
    let mut fmt = vec!["format", "-q", "--type", version, "--key-file", s(&k[0])];
    fmt.extend_from_slice(CHEAP_PBKDF2);
    fmt.extend([s(&img), "4M"]);
    cryptblk(&fmt).ok();
    let accepted =
        |img: &Path| -> Vec<bool> { k.iter().map(|key| cryptsetup_accepts(img, key)).collect() };
    assert_eq!(
        accepted(&img),
        [true, false, false],
        "{version}: after format"
    );

    let mut add = vec![
        "key",
        "add",
        "--key-file",
        s(&k[0]),
        "--new-key-file",
        s(&k[1]),
    ];
    add.extend_from_slice(CHEAP_PBKDF2);
    add.push(s(&img));
    cryptblk(&add).ok();
    assert_eq!(
        accepted(&img),
        [true, true, false],
        "{version}: after key add k1"
    );

    let mut change = vec![
        "key",
        "change",
        "--key-file",
        s(&k[1]),
        "--new-key-file",
        s(&k[2]),
    ];
    change.extend_from_slice(CHEAP_PBKDF2);
    change.push(s(&img));
    cryptblk(&change).ok();
    assert_eq!(
        accepted(&img),
        [true, false, true],
        "{version}: after key change k1 -> k2"
    );

    cryptblk(["key", "remove", "--key-file", s(&k[0]), s(&img)]).ok();
    assert_eq!(
        accepted(&img),
        [false, false, true],
        "{version}: after key remove k0"
    );
    tool("cryptsetup", ["luksDump", s(&img)]).ok();
}

#[test]
fn key_commands_luks2_seen_by_cryptsetup() {
    check_key_commands("luks2");
}

#[test]
fn key_commands_luks1_seen_by_cryptsetup() {
    check_key_commands("luks1");
}
