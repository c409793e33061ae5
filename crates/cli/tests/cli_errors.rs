//! Bad input: one clear `cryptblk: ` line, the documented exit status, and data left intact.
mod common;

use common::*;
use std::path::{Path, PathBuf};

/// A small LUKS image made by cryptblk, with its key file and known payload.
struct Fixture {
    t: TestDir,
    key: Key,
    img: PathBuf,
    payload: Vec<u8>,
}

/// A `version` image made by `cryptblk convert` with `kdf` (its options).
fn fixture(version: &str, kdf: &str) -> Fixture {
    let t = TestDir::new();
    let key = t.key("key");
    let (src, img) = (t.path("src.raw"), t.path("img"));
    mixed_file(&src, 2 * MIB, 17);
    let mut args = argv!("convert -O {} --key-file {}", version, key);
    args.extend(kdf.split_whitespace().map(Into::into));
    args.extend([src.clone().into(), img.clone().into()]);
    cryptblk(&args).ok();
    let payload = read(&src);
    std::fs::remove_file(&src).unwrap();
    Fixture {
        t,
        key,
        img,
        payload,
    }
}

const LUKS1_CHEAP: &str = "--pbkdf-force-iterations 1000";

fn luks2_fixture() -> Fixture {
    fixture("luks2", "--pbkdf pbkdf2 --pbkdf-force-iterations 1000")
}

impl Fixture {
    fn path(&self, name: &str) -> PathBuf {
        self.t.path(name)
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

    /// The image's bytes are `before`.
    #[track_caller]
    fn assert_unchanged(&self, before: &[u8], what: &str) {
        assert!(read(&self.img) == before, "{what}");
    }
}

#[test]
fn wrong_passphrase_exit_2() {
    let f = luks2_fixture();
    let (wrong, new, img) = (f.t.key("wrong"), f.t.key("new"), &f.img);
    let before = read(img);
    cryptblk(f.decrypt_cmd(&wrong))
        .expect_code(code::WRONG_PASSPHRASE)
        .error_line(&["no keyslot matches"]);
    assert!(!f.path("out.raw").exists());
    cryptblk_cheap(argv!(
        "key add --key-file {} --new-key-file {} {}",
        wrong,
        new,
        img
    ))
    .expect_code(code::WRONG_PASSPHRASE)
    .error_line(&["no keyslot matches"]);
    cryptblk(argv!("key remove --key-file {} {}", wrong, img)).expect_code(code::WRONG_PASSPHRASE);
    cryptblk_cheap(argv!(
        "key change --key-file {} --new-key-file {} {}",
        wrong,
        new,
        img
    ))
    .expect_code(code::WRONG_PASSPHRASE);
    f.assert_unchanged(&before, "refused key commands must not modify the image");
    // A trailing newline is part of the key, like cryptsetup: the message hints at it.
    let newline = f.path("newline");
    std::fs::write(&newline, format!("{}\n", f.key.passphrase)).unwrap();
    let line = cryptblk(f.decrypt_cmd(&newline))
        .expect_code(code::WRONG_PASSPHRASE)
        .error_line(&["no keyslot matches"]);
    let what = "the wrong-passphrase message should mention trailing newlines";
    assert!(line.contains("newline"), "{what}: {line}");
    f.assert_intact();
}

#[test]
fn unsupported_cipher_at_format_exit_3() {
    let t = TestDir::new();
    let (key, img) = (t.key("key"), t.path("img"));
    for cipher in ["serpent-xts-plain64", "twofish-cbc-essiv:sha256"] {
        let out = cryptblk_cheap(argv!(
            "format -q --cipher {} --key-file {} {} 4M",
            cipher,
            key,
            img
        ));
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
    let t = TestDir::new();
    let d = corpus.unpack(t.root(), "luks1-images.tar.xz");
    let keyfile = d.join("keyfile1");
    for (image, name) in [
        ("luks1_serpent-xts-plain64-sha256.img", "serpent"),
        ("luks1_twofish-xts-plain64-sha1.img", "twofish"),
        ("luks1_aes-xts-plain64-whirlpool.img", "whirlpool"),
        ("luks1_aes-lrw-plain64-sha1.img", "lrw"),
    ] {
        let (img, out_path) = (d.join(image), t.path("out.raw"));
        let before = read(&img);
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
    let f = fixture("luks1", LUKS1_CHEAP);
    let (img, key) = (&f.img, &f.key);
    let mut bytes = read(img);
    bytes[..6].fill(0);
    std::fs::write(img, &bytes).unwrap();
    cryptblk(argv!("dump {}", img))
        .expect_code(code::DAMAGED)
        .error_line(&[s(img)]);
    // Told it is LUKS (-f luks), convert reports the damage; probing alone sees a raw file.
    let out = f.path("out.raw");
    cryptblk(argv!(
        "convert -f luks -O raw --source-key-file {} {} {}",
        key,
        img,
        out
    ))
    .expect_code(code::DAMAGED)
    .error_line(&["not a LUKS"]);
    assert!(!out.exists());
    // Without -f, the magic-less file probes as raw: refused, because a key was given for it.
    let probed = cryptblk(f.decrypt_cmd(key));
    assert_ne!(probed.code, 0, "{probed:?}");
    probed.error_line(&["not LUKS"]);
    assert!(!out.exists());
    f.assert_unchanged(&bytes, "the damaged image must not be modified");
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
    let f = luks2_fixture();
    corrupt_luks2_copy(&f.img, 0);
    let out = cryptblk(f.decrypt_cmd(&f.key));
    out.ok();
    let warned = out
        .stderr
        .lines()
        .any(|l| l.starts_with("cryptblk: warning:"));
    let what = "opening with a damaged primary header should warn on stderr";
    assert!(warned, "{what}:\n{}", out.stderr);
    let what = "payload read through the secondary header";
    assert_same_bytes(&read(&f.path("out.raw")), &f.payload, what);
    let dump = cryptblk(argv!("dump {}", f.img));
    dump.ok();
    let what = "dump should warn about the damaged copy";
    assert!(dump.stderr.contains("warning"), "{what}:\n{}", dump.stderr);
}

#[test]
fn luks2_both_headers_damaged_exit_4() {
    let f = luks2_fixture();
    let area = dump_json(&f.img)["metadata_area"]
        .as_u64()
        .expect("metadata_area in dump");
    corrupt_luks2_copy(&f.img, 0);
    corrupt_luks2_copy(&f.img, area);
    let before = read(&f.img);
    cryptblk(argv!("dump {}", f.img))
        .expect_code(code::DAMAGED)
        .error_line(&[]);
    cryptblk(f.decrypt_cmd(&f.key))
        .expect_code(code::DAMAGED)
        .error_line(&[]);
    assert!(!f.path("out.raw").exists());
    f.assert_unchanged(&before, "the damaged image must not be modified");
}

#[test]
fn truncated_below_data_offset_exit_4() {
    for (version, kdf) in [
        ("luks2", "--pbkdf pbkdf2 --pbkdf-force-iterations 1000"),
        ("luks1", LUKS1_CHEAP),
    ] {
        let f = fixture(version, kdf);
        let dump = dump_json(&f.img);
        let data_offset = dump["data_offset"].as_u64();
        let data_offset =
            data_offset.or_else(|| dump["payload_offset_sectors"].as_u64().map(|n| n * 512));
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(&f.img)
            .unwrap();
        file.set_len(data_offset.unwrap() - 4096).unwrap();
        cryptblk(f.decrypt_cmd(&f.key))
            .expect_code(code::DAMAGED)
            .error_line(&["truncated"]);
        assert!(!f.path("out.raw").exists(), "{version}");
    }
}

#[test]
fn argon2_memory_above_limit_exit_7() {
    let f = fixture(
        "luks2",
        "--pbkdf argon2id --pbkdf-memory 2048 --pbkdf-force-iterations 4",
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
    let f = fixture("luks1", "--pbkdf-force-iterations 2000");
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
    let took = start.elapsed();
    assert!(
        took < std::time::Duration::from_secs(30),
        "refusal took {took:?}"
    );
    assert!(!f.path("out.raw").exists());
}

#[test]
fn missing_file_exit_5_names_path() {
    let t = TestDir::new();
    let (key, missing, out) = (
        t.key("key"),
        t.path("no-such-image.luks"),
        t.path("out.raw"),
    );
    cryptblk(argv!("dump {}", missing))
        .expect_code(code::IO)
        .error_line(&[s(&missing)]);
    cryptblk(argv!(
        "convert -O raw --source-key-file {} {} {}",
        key,
        missing,
        out
    ))
    .expect_code(code::IO)
    .error_line(&[s(&missing)]);
    assert!(!out.exists());
    cryptblk(argv!("key remove --key-file {} {}", key, missing))
        .expect_code(code::IO)
        .error_line(&[s(&missing)]);
}

#[test]
fn missing_key_file_is_a_clear_error() {
    let f = luks2_fixture();
    let nokey = f.path("no-such-key");
    cryptblk(f.decrypt_cmd(&nokey))
        .expect_code(code::IO)
        .error_line(&[s(&nokey)]);
    assert!(!f.path("out.raw").exists());
    // No --key-file at all and nothing on stdin: refused, nothing created.
    let img = f.path("new.img");
    let out = cryptblk_cheap(argv!("format -q {} 4M", img));
    assert_ne!(
        out.code, 0,
        "format without any passphrase succeeded: {out:?}"
    );
    out.error_line(&["passphrase"]);
    assert!(!img.exists(), "a refused format left {}", img.display());
    // An empty key file is refused too.
    let empty = f.path("empty");
    std::fs::write(&empty, b"").unwrap();
    let out = cryptblk(argv!("format -q --key-file {} {} 4M", empty, img));
    assert_ne!(out.code, 0);
    out.error_line(&["empty"]);
    assert!(!img.exists());
}

/// Key files are checked before they are read: a directory, a device (`/dev/zero` would
/// read forever) and a file above cryptsetup's 8 MiB limit are usage errors naming the
/// problem; one its group or others may read works, with a warning.
#[test]
fn key_files_are_checked_before_reading() {
    let t = TestDir::new();
    let img = t.path("new.img");
    let format = |key: &Path| cryptblk_cheap(argv!("format -q --key-file {} {} 4M", key, img));
    format(t.root())
        .expect_code(code::USAGE)
        .error_line(&["is a directory", "regular file"]);
    format(Path::new("/dev/zero"))
        .expect_code(code::USAGE)
        .error_line(&["/dev/zero is a character device", "regular file"]);
    let big = t.path("big.key");
    std::fs::write(&big, vec![b'k'; (8 << 20) + 1]).unwrap();
    format(&big)
        .expect_code(code::USAGE)
        .error_line(&["larger than 8192 KiB", "cryptsetup"]);
    assert!(!img.exists(), "a refused key file left {}", img.display());

    let shared = t.key("shared.key");
    std::fs::set_permissions(&shared, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
    let out = format(&shared);
    out.ok();
    let warning = "is readable by its group and by other users (mode 0644): chmod 600 it";
    assert!(out.stderr.contains(warning), "{}", out.stderr);
}

#[test]
fn passphrase_from_stdin() {
    let f = luks2_fixture();
    let (out, pass) = (f.path("stdin.raw"), f.key.passphrase.as_bytes());
    cryptblk_stdin(
        argv!("convert -O raw --source-key-file - {} {}", f.img, out),
        pass,
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
        pass,
    );
    assert_ne!(res.code, 0);
    res.error_line(&["stdin"]);
}

#[test]
fn removing_last_keyslot_needs_force() {
    let f = luks2_fixture();
    let before = read(&f.img);
    let out = cryptblk(argv!("key remove --key-file {} {}", f.key, f.img));
    assert_ne!(
        out.code, 0,
        "removing the last keyslot without --force succeeded"
    );
    out.error_line(&["--force"]);
    f.assert_unchanged(&before, "the refused removal modified the image");
    f.assert_intact();
    cryptblk(argv!("key remove --force --key-file {} {}", f.key, f.img)).ok();
    cryptblk(f.decrypt_cmd(&f.key)).expect_code(code::WRONG_PASSPHRASE);
}

#[test]
fn format_existing_file_with_size_refused() {
    let t = TestDir::new();
    let (key, img) = (t.key("key"), t.path("data.img"));
    let content: Vec<u8> = (0..(2 * MIB as usize))
        .map(|i| (i * 7 % 251) as u8)
        .collect();
    std::fs::write(&img, &content).unwrap();
    cryptblk_cheap(argv!("format -q --key-file {} {} 4M", key, img))
        .expect_code(code::USAGE)
        .error_line(&["exists"]);
    assert!(
        read(&img) == content,
        "a refused format changed the existing file"
    );
}

#[test]
fn usage_errors_exit_1() {
    let t = TestDir::new();
    let (key, img) = (t.key("key"), t.path("u.img"));
    let cases = [
        argv!("no-such-command"),
        argv!("convert"),
        argv!("--threads 0 bench"),
        argv!("--threads 100000 convert -O raw {} {}", key, img),
        argv!("format --key-file {}", key),
        argv!("format -q --sector-size 1000 --key-file {} {} 4M", key, img),
        argv!(
            "format -q --type luks1 --sector-size 4096 --key-file {} {} 4M",
            key,
            img
        ),
        argv!(
            "format -q --type luks1 --pbkdf argon2id --key-file {} {} 4M",
            key,
            img
        ),
        argv!("format -q --key-file {} {} 12Q", key, img),
        argv!("format -q --key-size 511 --key-file {} {} 4M", key, img),
        argv!("convert -O luks --key-file {} {} {}", key, key, img),
        argv!("convert -O qcow2 {} {}", key, img),
        argv!("dump --bogus {}", img),
        argv!("--threads many bench"),
        argv!("--crypto-engine qat bench"),
        argv!("--crypto-engine vaes,qat bench"),
    ];
    for args in cases {
        let out = cryptblk(&args);
        out.expect_code(code::USAGE);
        let what = &out.what;
        assert!(
            !out.stderr.trim().is_empty(),
            "`{what}`: usage error without a message"
        );
        assert!(!img.exists(), "`{what}` created the image");
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
    let f = fixture(
        "luks2",
        "--pbkdf argon2id --pbkdf-memory 64 --pbkdf-force-iterations 4",
    );
    let k1 = f.t.key("k1");
    cryptblk_cheap(argv!(
        "key add --key-file {} --new-key-file {} --key-slot 3 {}",
        f.key,
        k1,
        f.img
    ))
    .ok();

    let dump = dump_json(&f.img);
    let slots = dump["keyslots"].as_array().expect("keyslots array");
    let kdf = |k: &serde_json::Value| {
        let id = k["id"].as_str().unwrap_or("?").to_string();
        (id, k["pbkdf"].as_str().unwrap_or("missing").to_string())
    };
    let kdfs: Vec<(String, String)> = slots.iter().map(kdf).collect();
    let want = [
        ("0".into(), "argon2id".into()),
        ("3".into(), "pbkdf2".into()),
    ];
    assert_eq!(kdfs, want, "{dump}");
    assert_eq!(slots[0]["memory_kib"], 64);
    assert_eq!(slots[1]["iterations"], 1000);

    let vk = common::xts::cryptsetup_volume_key(&f.img, &f.key);
    let text = cryptblk(argv!("dump {}", f.img));
    text.ok();
    let json = serde_json::to_string(&dump).unwrap();
    for (what, out) in [
        ("dump --json", json.as_str()),
        ("dump", text.stdout.as_str()),
    ] {
        let compact: String = out.chars().filter(|c| !c.is_whitespace()).collect();
        let compact = compact.to_lowercase();
        assert!(
            !compact.contains(&vk[..32]),
            "{what} contains the volume key"
        );
    }
    let mut keys = Vec::new();
    json_keys(&dump, &mut keys);
    for forbidden in ["volume_key", "master_key", "key", "passphrase", "mk"] {
        let found = keys.iter().any(|k| k == forbidden);
        assert!(!found, "dump --json has a {forbidden:?} field: {dump}");
    }
}

#[test]
fn dump_json_luks1_without_key_material() {
    let f = fixture("luks1", LUKS1_CHEAP);
    let dump = dump_json(&f.img);
    assert_eq!(dump["version"], 1);
    let slots = dump["keyslots"].as_array().unwrap().iter();
    let active = slots.filter(|k| k["active"] == true);
    let active: Vec<u64> = active.map(|k| k["iterations"].as_u64().unwrap()).collect();
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
    let t = TestDir::new();
    let (key, key2, img) = (t.key("key"), t.key("key2"), t.path("img"));
    let run = |args: Vec<std::ffi::OsString>| {
        let out = std::process::Command::new(bin())
            .args(&args)
            .env("RUST_LOG", "trace")
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap();
        let all = [out.stdout, out.stderr].concat();
        let text = String::from_utf8_lossy(&all);
        let command = args
            .iter()
            .map(|a| a.to_string_lossy())
            .collect::<Vec<_>>()
            .join(" ");
        for p in [&key.passphrase, &key2.passphrase] {
            let what = format!("`cryptblk {command}` with RUST_LOG=trace printed a passphrase");
            assert!(!text.contains(p.as_str()), "{what}");
            let hex: String = p.bytes().map(|b| format!("{b:02x}")).collect();
            assert!(
                !text.contains(&hex),
                "`cryptblk {command}` printed a passphrase in hex"
            );
        }
        out.status.code()
    };
    assert_eq!(
        run(argv!("format -q --key-file {} {} 4M", key, img; CHEAP_PBKDF2)),
        Some(0)
    );
    let add = argv!("key add --key-file {} --new-key-file {} {}", key, key2, img; CHEAP_PBKDF2);
    assert_eq!(run(add), Some(0));
    assert_eq!(run(argv!("dump --json {}", img)), Some(0));
    let (o, p) = (t.path("o.raw"), t.path("p.raw"));
    assert_eq!(
        run(argv!(
            "convert -O raw --source-key-file {} {} {}",
            key2,
            img,
            o
        )),
        Some(0)
    );
    assert_eq!(run(argv!("key remove --key-file {} {}", key, img)), Some(0));
    assert_eq!(
        run(argv!(
            "convert -O raw --source-key-file {} {} {}",
            key,
            img,
            p
        )),
        Some(2)
    );
}

/// An image locked by another process (e.g. a daemon serving it) is refused with exit 6, and
/// the header is not touched.
#[test]
fn locked_image_exit_6() {
    let f = luks2_fixture();
    let new = f.t.key("new");
    let holder = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&f.img)
        .unwrap();
    holder.try_lock().expect("taking the test's exclusive lock");
    let before = read(&f.img);
    let add = || {
        cryptblk_cheap(argv!(
            "key add --key-file {} --new-key-file {} {}",
            f.key,
            new,
            f.img
        ))
    };
    add().expect_code(code::IN_USE).error_line(&["in use"]);
    let src = f.path("src.raw");
    std::fs::write(&src, vec![1u8; 4096]).unwrap();
    cryptblk(argv!(
        "convert -n -O luks --key-file {} {} {}",
        f.key,
        src,
        f.img
    ))
    .expect_code(code::IN_USE);
    f.assert_unchanged(&before, "a locked image was modified");
    drop(holder);
    // Another test of this binary may have forked a child while `holder` was open; the
    // child holds a copy of the lock until it execs (O_CLOEXEC), so allow a moment.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        let out = add();
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
            let stdout = &out.stdout;
            assert!(
                stdout.contains(needle),
                "`cryptblk {flag}` lacks {needle:?}:\n{stdout}"
            );
        }
    }
    let out = cryptblk(["convert", "--help"]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    let stdout = &out.stdout;
    assert!(
        stdout.contains("Memory:"),
        "convert --help states no memory bound:\n{stdout}"
    );
    assert!(stdout.contains("-t <CACHE>"), "{stdout}");
}
