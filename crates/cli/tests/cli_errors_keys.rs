//! Passphrases and key files: a wrong passphrase (exit 2), missing, empty or unsafe key files,
//! passphrases on stdin, the last keyslot kept without `--force`; and key material never shown
//! (`dump`, `dump --json`, trace logs).
mod common;

use common::cli_errors::*;
use common::*;
use std::path::Path;

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
