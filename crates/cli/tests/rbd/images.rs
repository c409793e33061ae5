//! Images in RBD, made and read by either side: by librbd's encryption (`rbd encryption
//! format`, QEMU's rbd driver), QEMU's `luks` driver over rbd, cryptsetup plus `rbd import`,
//! and `cryptblk convert`, byte for byte; raw images both ways; `format`, `dump` and `key add`
//! on `rbd:` names; and the errors a user meets. Steps of `rbd.rs`'s test.
use super::{qemu_io, qemu_rbd_opts, secret};
use crate::common::*;
use cryptblk_testutil::ceph::Cluster;
use std::path::Path;

/// The whole decrypted disk as librbd's encryption (through QEMU) reads it. `qemu-img dd`,
/// not `convert`: QEMU 7.2's rbd block status ignores the encryption header's offset (measured:
/// a written 4 KiB at payload offset 40 MiB came out as zeros from `convert`).
fn qemu_decrypt(cluster: &Cluster, image: &str, format: &str, key: &Path, out: &Path) -> Vec<u8> {
    let _ = std::fs::remove_file(out);
    tool(
        "qemu-img",
        argv!(
            "dd --object {} --image-opts -O raw bs=1M {} of={}",
            &secret(key),
            &format!("if={}", qemu_rbd_opts(cluster, image, format)),
            out
        ),
    )
    .ok();
    read(out)
}

/// The whole decrypted disk as cryptblk reads it.
fn cryptblk_decrypt_rbd(cluster: &Cluster, image: &str, key: &Path, out: &Path) -> Vec<u8> {
    let _ = std::fs::remove_file(out);
    cryptblk(argv!(
        "convert -O raw --source-key-file {} {} {}",
        key,
        &cluster.name(image),
        out
    ))
    .ok();
    read(out)
}

/// `rbd encryption format luks2` + data written through librbd's encryption (QEMU): cryptblk
/// reads what was written, byte for byte, and zeros wherever nothing was; and what cryptblk
/// then writes, librbd reads.
///
/// Where nothing was written librbd is not consistent: it returns zeros for RADOS objects that
/// do not exist and past the written end of one that does, but the decryption of zeros below
/// it (measured on this cluster: payload 4 MiB..7.97 MiB, under a write at 7.97 MiB). cryptblk
/// returns zeros for every never-written sector; the two agree on everything written.
pub fn made_by_librbd_opens_in_cryptblk(cluster: &Cluster, d: &TestDir, key: &Path) {
    cluster.rbd(&["create", "--size", "64M", "rbd/lib2"]);
    cluster.rbd(&["encryption", "format", "rbd/lib2", "luks2", s(key)]);
    // Written: the first MiB, 4 KiB inside an otherwise unwritten object, and a 64 KiB run
    // across an object boundary (4 MiB objects; the payload starts 16 MiB into the image).
    let writes: [(u8, usize, usize); 3] = [
        (0x5a, 0, 1 << 20),
        (0x33, 40 << 20, 4 << 10),
        (0xc1, 8160 << 10, 64 << 10),
    ];
    let cmds: Vec<String> = writes
        .iter()
        .map(|(p, off, len)| format!("write -P {p:#x} {off} {len}"))
        .collect();
    let cmds: Vec<&str> = cmds.iter().map(String::as_str).collect();
    qemu_io(cluster, "lib2", "luks2", key, &cmds);
    let mut expected = vec![0u8; 48 << 20];
    for (p, off, len) in writes {
        expected[off..off + len].fill(p);
    }
    let by_librbd = qemu_decrypt(cluster, "lib2", "luks2", key, &d.path("lib2.qemu"));
    let by_us = cryptblk_decrypt_rbd(cluster, "lib2", key, &d.path("lib2.ours"));
    // convert skipped what was never written (it reads as zeros): the copy is sparse.
    let allocated = {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(d.path("lib2.ours")).unwrap().blocks() * 512
    };
    assert!(
        allocated < 16 * MIB,
        "{allocated} bytes allocated for ~1 MiB written"
    );
    assert_eq!(
        by_librbd.len(),
        48 * MIB as usize,
        "64 MiB image, 16 MiB header"
    );
    assert_same_bytes(
        &by_us,
        &expected,
        "cryptblk: what librbd wrote, zeros elsewhere",
    );
    for (_, off, len) in writes {
        assert_same_bytes(
            &by_librbd[off..off + len],
            &expected[off..off + len],
            "librbd reads what it wrote",
        );
    }
    // An object nothing was written to (payload 12..16 MiB = image 28..32 MiB): zeros in both.
    assert!(by_librbd[12 << 20..16 << 20].iter().all(|&b| b == 0));
    let info = dump_json(Path::new(&cluster.name("lib2")));
    assert_eq!(info["data_offset"], 16 * MIB, "{info}");

    // cryptblk writes into it (-n), librbd reads it.
    let patch = d.path("patch.raw");
    let mut data = by_librbd.clone();
    data[20 * MIB as usize..21 * MIB as usize].fill(0x77);
    std::fs::write(&patch, &data).unwrap();
    cryptblk(argv!(
        "convert -n -O luks --key-file {} {} {}",
        key,
        patch,
        &cluster.name("lib2")
    ))
    .ok();
    let after = qemu_decrypt(cluster, "lib2", "luks2", key, &d.path("lib2.after"));
    assert_same_bytes(
        &after,
        &data,
        "librbd reads what cryptblk wrote into its image",
    );

    // LUKS1 by librbd (512-byte sectors, its own data offset).
    cluster.rbd(&["create", "--size", "32M", "rbd/lib1"]);
    cluster.rbd(&["encryption", "format", "rbd/lib1", "luks1", s(key)]);
    qemu_io(cluster, "lib1", "luks", key, &["write -P 0x1e 512 7k"]);
    let by_librbd = qemu_decrypt(cluster, "lib1", "luks", key, &d.path("lib1.qemu"));
    let by_us = cryptblk_decrypt_rbd(cluster, "lib1", key, &d.path("lib1.ours"));
    assert_eq!(by_us.len(), by_librbd.len(), "the same payload size");
    let written = 512..512 + 7 * 1024;
    assert!(by_us[written.clone()].iter().all(|&b| b == 0x1e));
    assert_same_bytes(
        &by_librbd[written.clone()],
        &by_us[written],
        "LUKS1 written data",
    );
    assert!(
        by_us[8192..].iter().all(|&b| b == 0),
        "never written: zeros"
    );
}

/// `cryptblk convert -O luks2|luks1` into a new RBD image: librbd (QEMU `encrypt.format=`)
/// decrypts the source back, holes and zero runs included.
pub fn made_by_cryptblk_opens_in_librbd(cluster: &Cluster, d: &TestDir, key: &Path) {
    let src = d.path("mixed.raw");
    mixed_file(&src, 24 * MIB, 5);
    for (target, format, qemu_format) in [("ours2", "luks2", "luks2"), ("ours1", "luks1", "luks")] {
        cryptblk(argv!(
            "convert -O {} --key-file {} --pbkdf pbkdf2 --iter-time 10 {} {}",
            format,
            key,
            src,
            &cluster.name(target)
        ))
        .ok();
        let by_librbd = qemu_decrypt(cluster, target, qemu_format, key, &d.path("back.raw"));
        assert_same_bytes(&by_librbd, &read(&src), "librbd decrypts cryptblk's image");
        let by_us = cryptblk_decrypt_rbd(cluster, target, key, &d.path("back2.raw"));
        assert_same_bytes(&by_us, &read(&src), "cryptblk reads its own RBD image back");
    }
    // QEMU's own LUKS1 layered over rbd (no librbd encryption) reads the LUKS1 image too.
    let out = d.path("layered.raw");
    tool(
        "qemu-img",
        [
            "dd",
            "--object",
            &secret(key),
            "--image-opts",
            "-O",
            "raw",
            "bs=1M",
            &format!(
                "if=driver=luks,key-secret=s0,file.driver=rbd,file.pool=rbd,file.image=ours1,\
                 file.conf={}",
                cluster.conf.display()
            ),
            &format!("of={}", s(&out)),
        ],
    )
    .ok();
    assert_same_bytes(
        &read(&out),
        &read(&src),
        "QEMU luks over rbd reads cryptblk's LUKS1",
    );
    let info = dump_json(Path::new(&cluster.name("ours2")));
    assert_eq!(info["data_offset"], 16 * MIB, "{info}");
}

/// Raw images in and out of RBD, compared with `rbd export` / `rbd import`.
pub fn raw_images_both_ways(cluster: &Cluster, d: &TestDir) {
    let src = d.path("plain.raw");
    mixed_file(&src, 12 * MIB, 6);
    cryptblk(["convert", "-O", "raw", s(&src), &cluster.name("plain")]).ok();
    let exported = d.path("plain.export");
    cluster.rbd(&["export", "rbd/plain", s(&exported)]);
    assert_same_files(&exported, &src);
    // A hole of whole RADOS objects (4 MiB) in the source stays unallocated: the image is thin.
    let sparse = d.path("sparse.raw");
    random_file(&sparse, 4 * MIB, 7);
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&sparse)
            .unwrap();
        f.write_all_at(&vec![0xa5u8; MIB as usize], 15 * MIB)
            .unwrap();
    }
    cryptblk(["convert", "-O", "raw", s(&sparse), &cluster.name("sparse")]).ok();
    let du = cluster.rbd(&["du", "--format", "json", "rbd/sparse"]);
    let du: serde_json::Value = serde_json::from_str(&du).unwrap();
    assert_eq!(du["images"][0]["provisioned_size"], 16 * MIB, "{du}");
    assert_eq!(
        du["images"][0]["used_size"],
        8 * MIB,
        "two objects of four: {du}"
    );
    cluster.rbd(&["import", s(&src), "rbd/imported"]);
    let back = d.path("imported.raw");
    cryptblk(["convert", "-O", "raw", &cluster.name("imported"), s(&back)]).ok();
    assert_same_files(&back, &src);
}

/// A LUKS2 image made by cryptsetup and `rbd import`ed serves over NBD, and `qemu-img
/// compare` finds the plaintext cryptsetup encrypted.
pub fn cryptsetup_made_and_rbd_imported(cluster: &Cluster, d: &TestDir, key: &Path) {
    let plain = d.path("cs.plain");
    mixed_file(&plain, 8 * MIB, 8);
    let img = cryptsetup_encrypt_in_place(d.root(), "cs.luks", &read(&plain), key, CS_CHEAP_PBKDF2);
    cluster.rbd(&["import", s(&img), "rbd/cs"]);
    let serve = d.serve_as("cs").image(cluster.name("cs")).key(key);
    let mut daemon = serve.arg("--readonly").nbd().start();
    // cryptsetup's payload is 8 MiB longer than the plaintext (the data offset is half the
    // 16 MiB it reserved): compare the plaintext's length.
    let served = format!(
        "driver=raw,size={},file.driver=nbd,file.server.type=unix,file.server.path={},\
         file.export=cs",
        8 * MIB,
        s(daemon.nbd_socket())
    );
    let plain_opts = format!("driver=raw,file.filename={}", s(&plain));
    let out = tool(
        "qemu-img",
        ["compare", "--image-opts", &plain_opts, &served],
    );
    out.ok();
    assert!(
        out.stdout.contains("Images are identical"),
        "{}",
        out.stdout
    );
    assert_eq!(daemon.terminate(), 0);
}

/// `format` creates (SIZE) or formats in place; `dump` and `key add` work on `rbd:` names and
/// librbd opens the image with the added passphrase.
pub fn format_dump_and_key_change(cluster: &Cluster, d: &TestDir, key: &Path) {
    format_luks2(Path::new(&cluster.name("fmt")), key, "8M");
    let info = dump_json(Path::new(&cluster.name("fmt")));
    assert_eq!(info["data_offset"], 16 * MIB, "{info}");
    let second = d.key("second");
    cryptblk(argv!(
        "key add --key-file {} --new-key-file {} --pbkdf pbkdf2 --iter-time 10 {}",
        key,
        second,
        &cluster.name("fmt")
    ))
    .ok();
    qemu_io(cluster, "fmt", "luks2", &second, &["write -P 0x44 0 4k"]);
    let by_us = cryptblk_decrypt_rbd(cluster, "fmt", &second, &d.path("fmt.raw"));
    assert_eq!(by_us.len(), 8 * MIB as usize);
    assert!(by_us[..4096].iter().all(|&b| b == 0x44));
    assert!(by_us[4096..].iter().all(|&b| b == 0));

    // In place, as `rbd encryption format` does: payload = image - header.
    cluster.rbd(&["create", "--size", "20M", "rbd/inplace"]);
    cryptblk(argv!(
        "format --batch-mode --key-file {} --pbkdf pbkdf2 --iter-time 10 {}",
        key,
        &cluster.name("inplace")
    ))
    .ok();
    let by_librbd = qemu_decrypt(cluster, "inplace", "luks2", key, &d.path("inplace.raw"));
    assert_eq!(by_librbd.len(), 4 * MIB as usize);
}

pub fn errors_name_the_problem(cluster: &Cluster, d: &TestDir, key: &Path) {
    let out = d.path("never.raw");
    // A wrong passphrase.
    let wrong = d.key("wrong");
    cryptblk(argv!(
        "convert -O raw --source-key-file {} {} {}",
        wrong,
        &cluster.name("lib2"),
        out
    ))
    .expect_code(code::WRONG_PASSPHRASE);
    // A missing image names itself.
    cryptblk(["dump", &cluster.name("missing")])
        .expect_code(code::IO)
        .error_line(&["rbd/missing", "No such file"]);
    // A malformed name is a usage error.
    cryptblk(["dump", "rbd:only-a-pool"])
        .expect_code(code::USAGE)
        .error_line(&["rbd:POOL/IMAGE"]);
    // A new target never overwrites an existing image.
    let src = d.path("mixed.raw");
    cryptblk(argv!(
        "convert -O luks2 --key-file {} {} {}",
        key,
        src,
        &cluster.name("ours2")
    ))
    .expect_code(code::USAGE)
    .error_line(&["already exists"]);
    assert!(!out.exists());
}
