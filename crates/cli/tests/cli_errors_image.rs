//! Bad images: one clear `cryptblk: ` line, the documented exit status, and data left intact.
//! Ciphers and hashes cryptblk does not support (exit 3), damaged or truncated headers (exit 4,
//! or a warning when one LUKS2 copy survives), and headers asking for more key-derivation
//! memory or iterations than allowed (exit 7).
mod common;

use common::cli_errors::*;
use common::*;
use std::path::Path;

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
