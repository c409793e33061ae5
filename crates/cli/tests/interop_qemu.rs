//! Interoperability with QEMU 7.2's `luks` and `qcow2` drivers through the real qemu-img and
//! qemu-io: LUKS1 both ways, and qcow2 sources (compressed, zero, backing) into LUKS2.
mod common;

use common::*;

/// An image made by `qemu-img create -f luks`, written by qemu-io: cryptblk's raw conversion is
/// byte-identical to qemu-img's.
fn check_qemu_made_luks1(name: &str, create_opts: &str) {
    let t = TestDir::new();
    let key = t.key("key");
    let options = format!("{create_opts},iter-time=10");
    let img = t.luks1_by_qemu("img.luks", "6M", &key, &options);
    let writes = [
        "write -P 0x5a 0 128k",
        "write -P 0xc3 3M 4k",
        "write -P 0x01 6143k 1k",
    ];
    qemu_io_cmds(&qemu_luks(&img, &key), &writes);
    let by_qemu = t.path("qemu.raw");
    let (secret, opts) = (qemu_secret(&key), qemu_luks_opts(&img));
    tool(
        "qemu-img",
        argv!(
            "convert --object {} --image-opts {} -O raw {}",
            secret,
            opts,
            by_qemu
        ),
    )
    .ok();
    let expected = read(&by_qemu);
    assert_eq!(expected.len() as u64, 6 * MIB);
    let ours = img.decrypt(&t.path("cryptblk.raw"));
    assert_same_bytes(
        &ours,
        &expected,
        &format!("{name}: cryptblk vs qemu-img decryption"),
    );
    assert_filled(
        &ours[..128 * 1024],
        0x5a,
        &format!("{name}: QEMU's pattern at 0"),
    );
    let at = 3 * MIB as usize;
    assert_filled(
        &ours[at..at + 4096],
        0xc3,
        &format!("{name}: QEMU's pattern at 3M"),
    );
    let what = format!("{name}: QEMU's pattern in the last KiB");
    assert_filled(&ours[6143 * 1024..], 0x01, &what);
    let dump = dump_json(&img);
    assert_eq!(dump["version"], 1, "{name}: {dump}");
}

#[test]
fn qemu_luks1_aes256_xts_plain64_sha256() {
    check_qemu_made_luks1(
        "q-xts256",
        "cipher-alg=aes-256,cipher-mode=xts,ivgen-alg=plain64,hash-alg=sha256",
    );
}

#[test]
fn qemu_luks1_aes128_xts_plain64_sha1() {
    check_qemu_made_luks1(
        "q-xts128-sha1",
        "cipher-alg=aes-128,cipher-mode=xts,ivgen-alg=plain64,hash-alg=sha1",
    );
}

#[test]
fn qemu_luks1_aes256_cbc_essiv_sha256() {
    check_qemu_made_luks1(
        "q-cbc-essiv",
        "cipher-alg=aes-256,cipher-mode=cbc,ivgen-alg=essiv,ivgen-hash-alg=sha256,hash-alg=sha256",
    );
}

/// cryptblk's LUKS1 output reads in QEMU equal to the source, and QEMU's writes into it read
/// back in cryptblk.
fn check_cryptblk_luks1_in_qemu(name: &str, size: u64, options: &[&str]) {
    let t = TestDir::new();
    let (key, src, img) = (t.key("key"), t.path("src.raw"), t.path("img.luks"));
    mixed_file(&src, size, 11);
    let mut args = argv!(
        "convert -O luks1 --key-file {} --pbkdf-force-iterations 1000",
        key
    );
    args.extend(options.iter().map(Into::into));
    args.extend([src.clone().into(), img.clone().into()]);
    cryptblk(&args).ok();

    let raw_opts = format!("driver=raw,file.filename={}", s(&src));
    let (secret, opts) = (qemu_secret(&key), qemu_luks_opts(&img));
    let cmp = tool(
        "qemu-img",
        argv!(
            "compare --object {} --image-opts {} {}",
            secret,
            opts,
            raw_opts
        ),
    );
    assert_eq!(
        cmp.code, 0,
        "{name}: qemu-img compare of cryptblk's LUKS1 and the source: {cmp:?}"
    );

    // QEMU writes into cryptblk's image; cryptblk reads QEMU's ciphertext.
    qemu_io_cmds(&qemu_luks(&img, &key), &["write -P 0x9e 512k 8k"]);
    let mut expected = read(&src);
    expected[512 * 1024..520 * 1024].fill(0x9e);
    let ours = cryptblk_decrypt(&img, &key, &t.path("back.raw"));
    let what = format!("{name}: cryptblk reading QEMU's writes");
    assert_same_bytes(&ours[..size as usize], &expected, &what);
}

#[test]
fn cryptblk_luks1_xts_reads_in_qemu() {
    check_cryptblk_luks1_in_qemu("cb-l1-xts", 5 * MIB, &[]);
}

#[test]
fn cryptblk_luks1_odd_size_cbc_essiv_reads_in_qemu() {
    // Not a multiple of 4096: exercises the partial last chunk.
    check_cryptblk_luks1_in_qemu(
        "cb-l1-cbc",
        3 * MIB + 3 * 512,
        &[
            "--cipher",
            "aes-cbc-essiv:sha256",
            "--key-size",
            "256",
            "--hash",
            "sha1",
        ],
    );
}

/// Builds the qcow2 chain in `t`; returns the overlay and qemu-img's raw bytes of it.
fn qcow2_fixture(t: &TestDir) -> (std::path::PathBuf, Vec<u8>) {
    // A base image with compressible and random data, compressed by qemu-img convert -c.
    let (base_raw, base_qcow2) = (t.path("base.raw"), t.path("base.qcow2"));
    let text = b"cryptblk compressible text 0123456789\n".iter().copied();
    let mut base: Vec<u8> = std::iter::repeat_n(text, 60_000)
        .flatten()
        .take(2 * MIB as usize)
        .collect();
    base.extend_from_slice(&random_data(2 * MIB));
    base.resize(6 * MIB as usize, 0);
    base.extend(std::iter::repeat_n(0xabu8, 2 * MIB as usize));
    std::fs::write(&base_raw, &base).unwrap();
    tool(
        "qemu-img",
        argv!("convert -q -c -f raw -O qcow2 {} {}", base_raw, base_qcow2),
    )
    .ok();
    let map = tool("qemu-img", argv!("map --output=json {}", base_qcow2));
    map.ok();
    assert!(
        map.stdout
            .lines()
            .any(|l| l.contains("\"data\": true") && !l.contains("\"offset\"")),
        "the base image should hold compressed clusters (data without a host offset):\n{}",
        map.stdout
    );

    // An overlay: new data, zero clusters masking backing data, untouched regions from the base.
    let overlay = t.path("overlay.qcow2");
    tool(
        "qemu-img",
        argv!("create -q -f qcow2 -b {} -F qcow2 {}", base_qcow2, overlay),
    )
    .ok();
    let writes = [
        "write -P 0x33 1M 64k",
        "write -z 2M 256k",
        "write -z 7M 128k",
        "write -P 0x44 5M 4k",
    ];
    qemu_io_cmds(&[&overlay], &writes);

    let by_qemu = t.path("qemu.raw");
    tool("qemu-img", argv!("convert -O raw {} {}", overlay, by_qemu)).ok();
    let expected = read(&by_qemu);
    assert_eq!(expected.len() as u64, 8 * MIB);
    let at = 2 * MIB as usize;
    assert_filled(
        &expected[at..at + 256 * 1024],
        0,
        "zero clusters read as zeros",
    );
    (overlay, expected)
}

/// qcow2 with a backing file, zero clusters over backing data, and compressed clusters:
/// cryptblk's qcow2 -> LUKS2 -> raw equals qemu-img's qcow2 -> raw.
#[test]
fn qcow2_backing_zero_and_compressed_clusters_to_luks2() {
    let t = TestDir::new();
    let (overlay, expected) = qcow2_fixture(&t);
    let (key, enc) = (t.key("key"), t.path("img.luks2"));
    let convert = "convert -f qcow2 -O luks2 --key-file {} {} {}";
    cryptblk(argv!(convert, key, overlay, enc; CHEAP_ARGON2ID)).ok();
    let ours = cryptblk_decrypt(&enc, &key, &t.path("cryptblk.raw"));
    assert_same_bytes(
        &ours,
        &expected,
        "qcow2 -> LUKS2 -> raw vs qemu-img convert -O raw",
    );

    // Probing (no -f) takes the same path.
    let enc2 = t.path("probed.luks2");
    cryptblk_cheap(argv!(
        "convert -O luks2 --key-file {} {} {}",
        key,
        overlay,
        enc2
    ))
    .ok();
    let ours = cryptblk_decrypt(&enc2, &key, &t.path("cryptblk2.raw"));
    assert_same_bytes(&ours, &expected, "probed qcow2 -> LUKS2 -> raw");
}

/// The same qcow2 chain straight to raw, without any passphrase.
#[test]
fn qcow2_backing_zero_and_compressed_clusters_to_raw() {
    let t = TestDir::new();
    let (overlay, expected) = qcow2_fixture(&t);
    let direct = t.path("direct.raw");
    cryptblk(argv!("convert -O raw {} {}", overlay, direct)).ok();
    assert_same_bytes(&read(&direct), &expected, "qcow2 -> raw vs qemu-img");
}
