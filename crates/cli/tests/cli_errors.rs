//! Bad input: one clear `cryptblk: ` line, the documented exit status, and data left intact.
mod common;

use common::*;
use std::path::{Path, PathBuf};

/// A small LUKS image made by cryptblk, with its key file and known payload.
struct Fixture {
    dir: tempfile::TempDir,
    key: PathBuf,
    img: PathBuf,
    payload: Vec<u8>,
}

fn fixture(name: &str, version: &str, kdf: &[&str]) -> Fixture {
    let dir = tempdir();
    let key = key_file(dir.path(), "key", &passphrase(name));
    let src = dir.path().join("src.raw");
    mixed_file(&src, 2 * MIB, 17);
    let img = dir.path().join("img");
    let mut args = vec!["convert", "-O", version, "--key-file", s(&key)];
    args.extend_from_slice(kdf);
    args.extend([s(&src), s(&img)]);
    cryptblk(&args).ok();
    let payload = read(&src);
    std::fs::remove_file(&src).unwrap();
    Fixture {
        dir,
        key,
        img,
        payload,
    }
}

impl Fixture {
    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// The image still decrypts to its payload.
    #[track_caller]
    fn assert_intact(&self) {
        let out = cryptblk_decrypt(&self.img, &self.key, &self.path("check.raw"));
        assert_same_bytes(&out, &self.payload, "the image after a refused command");
        std::fs::remove_file(self.path("check.raw")).unwrap();
    }

    fn decrypt_cmd(&self, key: &Path) -> Vec<std::ffi::OsString> {
        let out = self.path("out.raw");
        argv!(
            "convert -O raw --source-key-file {} {} {}",
            key,
            self.img,
            out
        )
    }
}

fn luks2_fixture(name: &str) -> Fixture {
    fixture(name, "luks2", CHEAP_PBKDF2)
}

#[test]
fn wrong_passphrase_exit_2() {
    let f = luks2_fixture("err-wrong");
    let wrong = key_file(f.dir.path(), "wrong", &passphrase("err-wrong-bad"));
    let before = read(&f.img);
    cryptblk(f.decrypt_cmd(&wrong))
        .expect_code(code::WRONG_PASSPHRASE)
        .error_line(&["no keyslot matches"]);
    assert!(!f.path("out.raw").exists());
    let new = key_file(f.dir.path(), "new", &passphrase("err-wrong-new"));
    cryptblk(argv!(
        "key add --key-file {} --new-key-file {} --pbkdf pbkdf2 --pbkdf-force-iterations 1000 {}",
        wrong,
        new,
        f.img
    ))
    .expect_code(code::WRONG_PASSPHRASE)
    .error_line(&["no keyslot matches"]);
    cryptblk(["key", "remove", "--key-file", s(&wrong), s(&f.img)])
        .expect_code(code::WRONG_PASSPHRASE);
    cryptblk(argv!("key change --key-file {} --new-key-file {} --pbkdf pbkdf2 --pbkdf-force-iterations 1000 {}", wrong, new, f.img))
    .expect_code(code::WRONG_PASSPHRASE);
    assert!(
        read(&f.img) == before,
        "refused key commands must not modify the image"
    );
    // A trailing newline is part of the key, like cryptsetup: the message hints at it.
    let newline = f.path("newline");
    std::fs::write(&newline, format!("{}\n", passphrase("err-wrong"))).unwrap();
    let line = cryptblk(f.decrypt_cmd(&newline))
        .expect_code(code::WRONG_PASSPHRASE)
        .error_line(&["no keyslot matches"]);
    assert!(
        line.contains("newline"),
        "the wrong-passphrase message should mention trailing newlines: {line}"
    );
    f.assert_intact();
}

#[test]
fn unsupported_cipher_at_format_exit_3() {
    let dir = tempdir();
    let key = key_file(dir.path(), "key", &passphrase("serpent-fmt"));
    let img = dir.path().join("img");
    for cipher in ["serpent-xts-plain64", "twofish-cbc-essiv:sha256"] {
        let out = cryptblk(argv!("format -q --cipher {} --pbkdf pbkdf2 --pbkdf-force-iterations 1000 --key-file {} {} 4M", cipher, key, img));
        out.expect_code(code::UNSUPPORTED)
            .error_line(&[cipher.split('-').next().unwrap()]);
        assert!(
            !img.exists(),
            "a refused format must not leave {}",
            img.display()
        );
    }
    let out = cryptblk(argv!(
        "format -q --hash whirlpool --key-file {} {} 4M",
        key,
        img
    ));
    out.expect_code(code::UNSUPPORTED)
        .error_line(&["whirlpool"]);
    assert!(!img.exists());
}

#[test]
fn unsupported_cipher_in_corpus_image_exit_3() {
    // cryptsetup's own images with ciphers and hashes no installed tool can make here.
    let Some(corpus) = cryptblk_testutil::corpus::Corpus::find_or_skip() else {
        return;
    };
    let dir = tempdir();
    let d = corpus.unpack(dir.path(), "luks1-images.tar.xz");
    let keyfile = d.join("keyfile1");
    for (image, name) in [
        ("luks1_serpent-xts-plain64-sha256.img", "serpent"),
        ("luks1_twofish-xts-plain64-sha1.img", "twofish"),
        ("luks1_aes-xts-plain64-whirlpool.img", "whirlpool"),
        ("luks1_aes-lrw-plain64-sha1.img", "lrw"),
    ] {
        let img = d.join(image);
        let before = read(&img);
        let out_path = dir.path().join("out.raw");
        let out = cryptblk(argv!(
            "convert -O raw --source-key-file {} {} {}",
            keyfile,
            img,
            out_path
        ));
        out.expect_code(code::UNSUPPORTED).error_line(&[name]);
        assert!(!out_path.exists());
        assert!(read(&img) == before, "{image} was modified");
    }
}

#[test]
fn zeroed_luks1_magic_exit_4() {
    let f = fixture("err-magic", "luks1", &["--pbkdf-force-iterations", "1000"]);
    let mut bytes = read(&f.img);
    bytes[..6].fill(0);
    std::fs::write(&f.img, &bytes).unwrap();
    cryptblk(["dump", s(&f.img)])
        .expect_code(code::DAMAGED)
        .error_line(&[s(&f.img)]);
    // Told it is LUKS (-f luks), convert reports the damage; probing alone sees a raw file.
    let out = f.path("out.raw");
    cryptblk(argv!(
        "convert -f luks -O raw --source-key-file {} {} {}",
        f.key,
        f.img,
        out
    ))
    .expect_code(code::DAMAGED)
    .error_line(&["not a LUKS"]);
    assert!(!out.exists());
    // Without -f, the magic-less file probes as raw: refused, because a key was given for it.
    let probed = cryptblk(f.decrypt_cmd(&f.key));
    assert_ne!(probed.code, 0, "{probed:?}");
    probed.error_line(&["not LUKS"]);
    assert!(!out.exists());
    assert!(
        read(&f.img) == bytes,
        "the damaged image must not be modified"
    );
}

/// Flips a byte inside the JSON area of the LUKS2 header copy at `hdr_offset`.
fn corrupt_luks2_copy(img: &Path, hdr_offset: u64) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(img)
        .unwrap();
    let at = hdr_offset + 4096 + 40;
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, at).unwrap();
    f.write_all_at(&[b[0] ^ 0x20], at).unwrap();
}

#[test]
fn luks2_primary_header_damaged_opens_with_warning() {
    let f = luks2_fixture("err-primary");
    corrupt_luks2_copy(&f.img, 0);
    let out = cryptblk(f.decrypt_cmd(&f.key));
    out.ok();
    assert!(
        out.stderr
            .lines()
            .any(|l| l.starts_with("cryptblk: warning:")),
        "opening with a damaged primary header should warn on stderr:\n{}",
        out.stderr
    );
    assert_same_bytes(
        &read(&f.path("out.raw")),
        &f.payload,
        "payload read through the secondary header",
    );
    let dump = cryptblk(["dump", s(&f.img)]);
    dump.ok();
    assert!(
        dump.stderr.contains("warning"),
        "dump should warn about the damaged copy:\n{}",
        dump.stderr
    );
}

#[test]
fn luks2_both_headers_damaged_exit_4() {
    let f = luks2_fixture("err-both");
    let area = dump_json(&f.img)["metadata_area"]
        .as_u64()
        .expect("metadata_area in dump");
    corrupt_luks2_copy(&f.img, 0);
    corrupt_luks2_copy(&f.img, area);
    let before = read(&f.img);
    cryptblk(["dump", s(&f.img)])
        .expect_code(code::DAMAGED)
        .error_line(&[]);
    cryptblk(f.decrypt_cmd(&f.key))
        .expect_code(code::DAMAGED)
        .error_line(&[]);
    assert!(!f.path("out.raw").exists());
    assert!(
        read(&f.img) == before,
        "the damaged image must not be modified"
    );
}

#[test]
fn truncated_below_data_offset_exit_4() {
    for (version, kdf) in [
        ("luks2", CHEAP_PBKDF2),
        ("luks1", &["--pbkdf-force-iterations", "1000"][..]),
    ] {
        let f = fixture(&format!("err-trunc-{version}"), version, kdf);
        let dump = dump_json(&f.img);
        let data_offset = dump["data_offset"]
            .as_u64()
            .or_else(|| dump["payload_offset_sectors"].as_u64().map(|n| n * 512))
            .unwrap();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&f.img)
            .unwrap()
            .set_len(data_offset - 4096)
            .unwrap();
        cryptblk(f.decrypt_cmd(&f.key))
            .expect_code(code::DAMAGED)
            .error_line(&["truncated"]);
        assert!(!f.path("out.raw").exists(), "{version}");
    }
}

#[test]
fn argon2_memory_above_limit_exit_7() {
    let f = fixture(
        "err-argon",
        "luks2",
        &[
            "--pbkdf",
            "argon2id",
            "--pbkdf-memory",
            "2048",
            "--pbkdf-force-iterations",
            "4",
        ],
    );
    let mut args = argv!("--max-pbkdf-memory 1024");
    args.extend(f.decrypt_cmd(&f.key));
    cryptblk(&args)
        .expect_code(code::RESOURCE_LIMIT)
        .error_line(&["2048", "1024"]);
    assert!(!f.path("out.raw").exists());
    // The same image opens when the limit allows it.
    f.assert_intact();
}

#[test]
fn pbkdf_iterations_above_limit_exit_7() {
    let f = fixture("err-iter", "luks1", &["--pbkdf-force-iterations", "2000"]);
    let mut args = argv!("--max-pbkdf-iterations 1999");
    args.extend(f.decrypt_cmd(&f.key));
    cryptblk(&args)
        .expect_code(code::RESOURCE_LIMIT)
        .error_line(&["keyslot 0", "2000", "1999", "--max-pbkdf-iterations"]);
    assert!(!f.path("out.raw").exists());
    f.assert_intact();

    // A hostile header naming 2^32-1 iterations (hours of PBKDF2) is refused at once under
    // the default limit. LUKS1 keyslot 0's iteration count is the big-endian u32 at 212.
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&f.img)
        .unwrap();
    std::os::unix::fs::FileExt::write_all_at(&file, &u32::MAX.to_be_bytes(), 212).unwrap();
    let start = std::time::Instant::now();
    cryptblk(f.decrypt_cmd(&f.key))
        .expect_code(code::RESOURCE_LIMIT)
        .error_line(&["keyslot 0", &u32::MAX.to_string(), "--max-pbkdf-iterations"]);
    assert!(
        start.elapsed() < std::time::Duration::from_secs(30),
        "refusal took {:?}",
        start.elapsed()
    );
    assert!(!f.path("out.raw").exists());
}

#[test]
fn missing_file_exit_5_names_path() {
    let dir = tempdir();
    let key = key_file(dir.path(), "key", &passphrase("err-missing"));
    let missing = dir.path().join("no-such-image.luks");
    cryptblk(["dump", s(&missing)])
        .expect_code(code::IO)
        .error_line(&[s(&missing)]);
    let out = dir.path().join("out.raw");
    cryptblk(argv!(
        "convert -O raw --source-key-file {} {} {}",
        key,
        missing,
        out
    ))
    .expect_code(code::IO)
    .error_line(&[s(&missing)]);
    assert!(!out.exists());
    cryptblk(["key", "remove", "--key-file", s(&key), s(&missing)])
        .expect_code(code::IO)
        .error_line(&[s(&missing)]);
}

#[test]
fn missing_key_file_is_a_clear_error() {
    let f = luks2_fixture("err-nokey");
    let nokey = f.path("no-such-key");
    cryptblk(f.decrypt_cmd(&nokey))
        .expect_code(code::IO)
        .error_line(&[s(&nokey)]);
    assert!(!f.path("out.raw").exists());
    // No --key-file at all and nothing on stdin: refused, nothing created.
    let img = f.path("new.img");
    let out = cryptblk(argv!(
        "format -q --pbkdf pbkdf2 --pbkdf-force-iterations 1000 {} 4M",
        img
    ));
    assert_ne!(
        out.code, 0,
        "format without any passphrase succeeded: {out:?}"
    );
    out.error_line(&["passphrase"]);
    assert!(!img.exists(), "a refused format left {}", img.display());
    // An empty key file is refused too.
    let empty = f.path("empty");
    std::fs::write(&empty, b"").unwrap();
    let out = cryptblk(["format", "-q", "--key-file", s(&empty), s(&img), "4M"]);
    assert_ne!(out.code, 0);
    out.error_line(&["empty"]);
    assert!(!img.exists());
}

/// Key files are checked before they are read: a directory, a device (`/dev/zero` would
/// read forever) and a file above cryptsetup's 8 MiB limit are usage errors naming the
/// problem; one its group or others may read works, with a warning.
#[test]
fn key_files_are_checked_before_reading() {
    let dir = tempdir();
    let img = dir.path().join("new.img");
    let format = |key: &Path| {
        cryptblk(argv!(
            "format -q --pbkdf pbkdf2 --pbkdf-force-iterations 1000 --key-file {} {} 4M",
            key,
            img
        ))
    };
    format(dir.path())
        .expect_code(code::USAGE)
        .error_line(&["is a directory", "regular file"]);
    format(Path::new("/dev/zero"))
        .expect_code(code::USAGE)
        .error_line(&["/dev/zero is a character device", "regular file"]);
    let big = dir.path().join("big.key");
    std::fs::write(&big, vec![b'k'; (8 << 20) + 1]).unwrap();
    format(&big)
        .expect_code(code::USAGE)
        .error_line(&["larger than 8192 KiB", "cryptsetup"]);
    assert!(!img.exists(), "a refused key file left {}", img.display());

    let shared = key_file(dir.path(), "shared.key", &passphrase("err-readable"));
    std::fs::set_permissions(&shared, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
    let out = format(&shared);
    out.ok();
    assert!(
        out.stderr
            .contains("is readable by its group and by other users (mode 0644): chmod 600 it"),
        "{}",
        out.stderr
    );
}

#[test]
fn passphrase_from_stdin() {
    let f = luks2_fixture("err-stdin");
    let out = f.path("stdin.raw");
    let pass = passphrase("err-stdin");
    cryptblk_stdin(
        argv!("convert -O raw --source-key-file - {} {}", f.img, out),
        pass.as_bytes(),
    )
    .ok();
    assert_same_bytes(
        &read(&out),
        &f.payload,
        "decrypted with the passphrase on stdin",
    );
    // Both passphrases from stdin cannot work: refused as a usage problem before anything runs.
    let res = cryptblk_stdin(
        argv!("key add --key-file - --new-key-file - {}", f.img),
        pass.as_bytes(),
    );
    assert_ne!(res.code, 0);
    res.error_line(&["stdin"]);
}

#[test]
fn removing_last_keyslot_needs_force() {
    let f = luks2_fixture("err-last");
    let before = read(&f.img);
    let out = cryptblk(["key", "remove", "--key-file", s(&f.key), s(&f.img)]);
    assert_ne!(
        out.code, 0,
        "removing the last keyslot without --force succeeded"
    );
    out.error_line(&["--force"]);
    assert!(
        read(&f.img) == before,
        "the refused removal modified the image"
    );
    f.assert_intact();
    cryptblk(argv!("key remove --force --key-file {} {}", f.key, f.img)).ok();
    cryptblk(f.decrypt_cmd(&f.key)).expect_code(code::WRONG_PASSPHRASE);
}

#[test]
fn format_existing_file_with_size_refused() {
    let dir = tempdir();
    let key = key_file(dir.path(), "key", &passphrase("err-exists"));
    let img = dir.path().join("data.img");
    let content: Vec<u8> = (0..(2 * MIB as usize))
        .map(|i| (i * 7 % 251) as u8)
        .collect();
    std::fs::write(&img, &content).unwrap();
    cryptblk(argv!(
        "format -q --pbkdf pbkdf2 --pbkdf-force-iterations 1000 --key-file {} {} 4M",
        key,
        img
    ))
    .expect_code(code::USAGE)
    .error_line(&["exists"]);
    assert!(
        read(&img) == content,
        "a refused format changed the existing file"
    );
}

#[test]
fn usage_errors_exit_1() {
    let dir = tempdir();
    let key = key_file(dir.path(), "key", &passphrase("err-usage"));
    let k = s(&key);
    let img = dir.path().join("u.img");
    let i = s(&img);
    let cases: Vec<Vec<&str>> = vec![
        vec!["no-such-command"],
        vec!["convert"],
        vec!["--threads", "0", "bench"],
        vec!["--threads", "100000", "convert", "-O", "raw", k, i],
        vec!["format", "--key-file", k],
        vec![
            "format",
            "-q",
            "--sector-size",
            "1000",
            "--key-file",
            k,
            i,
            "4M",
        ],
        vec![
            "format",
            "-q",
            "--type",
            "luks1",
            "--sector-size",
            "4096",
            "--key-file",
            k,
            i,
            "4M",
        ],
        vec![
            "format",
            "-q",
            "--type",
            "luks1",
            "--pbkdf",
            "argon2id",
            "--key-file",
            k,
            i,
            "4M",
        ],
        vec!["format", "-q", "--key-file", k, i, "12Q"],
        vec![
            "format",
            "-q",
            "--key-size",
            "511",
            "--key-file",
            k,
            i,
            "4M",
        ],
        vec!["convert", "-O", "luks", "--key-file", k, k, i],
        vec!["convert", "-O", "qcow2", k, i],
        vec!["dump", "--bogus", i],
        vec!["--threads", "many", "bench"],
        vec!["--crypto-engine", "qat", "bench"],
        vec!["--crypto-engine", "vaes,qat", "bench"],
    ];
    for args in cases {
        let out = cryptblk(&args);
        out.expect_code(code::USAGE);
        assert!(
            !out.stderr.trim().is_empty(),
            "`{}`: usage error without a message",
            out.what
        );
        assert!(!img.exists(), "`{}` created the image", out.what);
    }
}

fn json_keys(v: &serde_json::Value, out: &mut Vec<String>) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, v) in m {
                out.push(k.to_lowercase());
                json_keys(v, out);
            }
        }
        serde_json::Value::Array(a) => a.iter().for_each(|v| json_keys(v, out)),
        _ => {}
    }
}

/// `dump --json` parses, lists each keyslot with its KDF, and never contains the volume key.
#[test]
fn dump_json_lists_keyslots_without_key_material() {
    let f = fixture("dump-l2", "luks2", CHEAP_ARGON2ID);
    let k1 = key_file(f.dir.path(), "k1", &passphrase("dump-l2-k1"));
    let mut add = vec![
        "key",
        "add",
        "--key-file",
        s(&f.key),
        "--new-key-file",
        s(&k1),
        "--key-slot",
        "3",
    ];
    add.extend_from_slice(CHEAP_PBKDF2);
    add.push(s(&f.img));
    cryptblk(&add).ok();

    let dump = dump_json(&f.img);
    let slots = dump["keyslots"].as_array().expect("keyslots array");
    let kdfs: Vec<(String, String)> = slots
        .iter()
        .map(|k| {
            (
                k["id"].as_str().unwrap_or("?").to_string(),
                k["pbkdf"].as_str().unwrap_or("missing").to_string(),
            )
        })
        .collect();
    assert_eq!(
        kdfs,
        [
            ("0".into(), "argon2id".into()),
            ("3".into(), "pbkdf2".into())
        ],
        "{dump}"
    );
    assert_eq!(slots[0]["memory_kib"], 64);
    assert_eq!(slots[1]["iterations"], 1000);

    let vk = common::xts::cryptsetup_volume_key(&f.img, &f.key);
    let text = cryptblk(["dump", s(&f.img)]);
    text.ok();
    let json = serde_json::to_string(&dump).unwrap();
    for (what, out) in [
        ("dump --json", json.as_str()),
        ("dump", text.stdout.as_str()),
    ] {
        let compact: String = out
            .chars()
            .filter(|c| !c.is_whitespace())
            .collect::<String>()
            .to_lowercase();
        assert!(
            !compact.contains(&vk[..32]),
            "{what} contains the volume key"
        );
    }
    let mut keys = Vec::new();
    json_keys(&dump, &mut keys);
    for forbidden in ["volume_key", "master_key", "key", "passphrase", "mk"] {
        assert!(
            !keys.iter().any(|k| k == forbidden),
            "dump --json has a {forbidden:?} field: {dump}"
        );
    }
}

#[test]
fn dump_json_luks1_without_key_material() {
    let f = fixture("dump-l1", "luks1", &["--pbkdf-force-iterations", "1000"]);
    let dump = dump_json(&f.img);
    assert_eq!(dump["version"], 1);
    let active: Vec<u64> = dump["keyslots"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|k| k["active"] == true)
        .map(|k| k["iterations"].as_u64().unwrap())
        .collect();
    assert_eq!(active, [1000], "{dump}");
    let vk = common::xts::cryptsetup_volume_key(&f.img, &f.key);
    let json = serde_json::to_string(&dump).unwrap().to_lowercase();
    assert!(
        !json.contains(&vk[..32]),
        "dump --json contains the volume key"
    );
}

/// Verbose logging must not leak the passphrase either (every run checks stdout and stderr).
#[test]
fn passphrase_not_in_debug_output() {
    let dir = tempdir();
    let d = dir.path();
    let key = key_file(d, "key", &passphrase("leak-check"));
    let key2 = key_file(d, "key2", &passphrase("leak-check-2"));
    let img = d.join("img");
    let run = |args: &[&str]| {
        let out = std::process::Command::new(bin())
            .args(args)
            .env("RUST_LOG", "trace")
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap();
        let all = [out.stdout, out.stderr].concat();
        let text = String::from_utf8_lossy(&all);
        for p in [passphrase("leak-check"), passphrase("leak-check-2")] {
            assert!(
                !text.contains(&p),
                "`cryptblk {}` with RUST_LOG=trace printed a passphrase",
                args.join(" ")
            );
            let hex: String = p.bytes().map(|b| format!("{b:02x}")).collect();
            assert!(
                !text.contains(&hex),
                "`cryptblk {}` printed a passphrase in hex",
                args.join(" ")
            );
        }
        out.status.code()
    };
    assert_eq!(
        run(&[
            "format",
            "-q",
            "--pbkdf",
            "pbkdf2",
            "--pbkdf-force-iterations",
            "1000",
            "--key-file",
            s(&key),
            s(&img),
            "4M"
        ]),
        Some(0)
    );
    assert_eq!(
        run(&[
            "key",
            "add",
            "--pbkdf",
            "pbkdf2",
            "--pbkdf-force-iterations",
            "1000",
            "--key-file",
            s(&key),
            "--new-key-file",
            s(&key2),
            s(&img)
        ]),
        Some(0)
    );
    assert_eq!(run(&["dump", "--json", s(&img)]), Some(0));
    assert_eq!(
        run(&[
            "convert",
            "-O",
            "raw",
            "--source-key-file",
            s(&key2),
            s(&img),
            s(&d.join("o.raw"))
        ]),
        Some(0)
    );
    assert_eq!(
        run(&["key", "remove", "--key-file", s(&key), s(&img)]),
        Some(0)
    );
    assert_eq!(
        run(&[
            "convert",
            "-O",
            "raw",
            "--source-key-file",
            s(&key),
            s(&img),
            s(&d.join("p.raw"))
        ]),
        Some(2)
    );
}

/// An image locked by another process (e.g. a daemon serving it) is refused with exit 6, and
/// the header is not touched.
#[test]
fn locked_image_exit_6() {
    let f = luks2_fixture("err-locked");
    let new = key_file(f.dir.path(), "new", &passphrase("err-locked-new"));
    let holder = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&f.img)
        .unwrap();
    holder.try_lock().expect("taking the test's exclusive lock");
    let before = read(&f.img);
    let mut add = vec![
        "key",
        "add",
        "--key-file",
        s(&f.key),
        "--new-key-file",
        s(&new),
    ];
    add.extend_from_slice(CHEAP_PBKDF2);
    add.push(s(&f.img));
    cryptblk(&add)
        .expect_code(code::IN_USE)
        .error_line(&["in use"]);
    let src = f.path("src.raw");
    std::fs::write(&src, vec![1u8; 4096]).unwrap();
    cryptblk(argv!(
        "convert -n -O luks --key-file {} {} {}",
        f.key,
        src,
        f.img
    ))
    .expect_code(code::IN_USE);
    assert!(read(&f.img) == before, "a locked image was modified");
    drop(holder);
    // Another test of this binary may have forked a child while `holder` was open; the
    // child holds a copy of the lock until it execs (O_CLOEXEC), so allow a moment.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        let out = cryptblk(&add);
        if out.code != code::IN_USE || std::time::Instant::now() > deadline {
            out.ok();
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

#[test]
fn help_documents_exit_codes_and_convert_memory_bound() {
    for flag in ["-h", "--help"] {
        let out = cryptblk([flag]);
        assert_eq!(out.code, 0, "{}", out.stderr);
        for needle in [
            "Exit status:",
            "2  wrong passphrase",
            "4  damaged",
            "7  resource limit",
        ] {
            assert!(
                out.stdout.contains(needle),
                "`cryptblk {flag}` lacks {needle:?}:\n{}",
                out.stdout
            );
        }
    }
    let out = cryptblk(["convert", "--help"]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(
        out.stdout.contains("Memory:"),
        "convert --help states no memory bound:\n{}",
        out.stdout
    );
    assert!(out.stdout.contains("-t <CACHE>"), "{}", out.stdout);
}
