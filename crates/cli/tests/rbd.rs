//! LUKS disks that live in a real (single-node, throwaway) Ceph cluster, checked against
//! librbd's own encryption through the real `rbd` CLI and QEMU's rbd driver with
//! `encrypt.format=`: images either side made open in the other, byte for byte, including
//! never-written areas (zeros through both); serve over NBD; the exclusive lock; format, dump
//! and key changes on `rbd:` names; and the errors a user meets.
mod common;

use common::*;
use cryptblk_testutil::ceph::{self, Cluster};
use std::path::Path;

/// QEMU's rbd driver on `image` with librbd's encryption loaded (`format`: luks or luks2).
fn qemu_rbd_opts(cluster: &Cluster, image: &str, format: &str) -> String {
    format!(
        "driver=rbd,pool=rbd,image={image},conf={},encrypt.format={format},encrypt.key-secret=s0",
        cluster.conf.display()
    )
}

fn secret(key: &Path) -> String {
    format!("secret,id=s0,file={}", s(key))
}

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

fn qemu_io(cluster: &Cluster, image: &str, format: &str, key: &Path, cmds: &[&str]) {
    let opts = qemu_rbd_opts(cluster, image, format);
    qemu_io_cmds(&["--object", &secret(key), "--image-opts", &opts], cmds);
}

#[test]
fn luks_on_rbd_against_librbd_and_qemu() {
    let Some(cluster) = ceph::start() else {
        return;
    };
    let t = TestDir::new();
    let d = &t;
    let key = t.key("key");

    made_by_librbd_opens_in_cryptblk(&cluster, d, &key);
    made_by_cryptblk_opens_in_librbd(&cluster, d, &key);
    raw_images_both_ways(&cluster, d);
    cryptsetup_made_and_rbd_imported(&cluster, d, &key);
    serve_over_nbd_under_the_exclusive_lock(&cluster, d, &key);
    kill_9_keeps_flushed_writes(&cluster, d, &key);
    a_paused_osd_stalls_only_its_disk(&cluster, d, &key);
    migrates_out_of_rbd_into_a_file(&cluster, d, &key);
    migrates_from_a_file_into_rbd(&cluster, d, &key);
    hands_a_shared_image_over_without_copying(&cluster, d, &key);
    format_dump_and_key_change(&cluster, d, &key);
    errors_name_the_problem(&cluster, d, &key);
}

/// `rbd encryption format luks2` + data written through librbd's encryption (QEMU): cryptblk
/// reads what was written, byte for byte, and zeros wherever nothing was; and what cryptblk
/// then writes, librbd reads.
///
/// Where nothing was written librbd is not consistent: it returns zeros for RADOS objects that
/// do not exist and past the written end of one that does, but the decryption of zeros below
/// it (measured on this cluster: payload 4 MiB..7.97 MiB, under a write at 7.97 MiB). cryptblk
/// returns zeros for every never-written sector; the two agree on everything written.
fn made_by_librbd_opens_in_cryptblk(cluster: &Cluster, d: &TestDir, key: &Path) {
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
fn made_by_cryptblk_opens_in_librbd(cluster: &Cluster, d: &TestDir, key: &Path) {
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
fn raw_images_both_ways(cluster: &Cluster, d: &TestDir) {
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
fn cryptsetup_made_and_rbd_imported(cluster: &Cluster, d: &TestDir, key: &Path) {
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

/// `serve --image rbd:...` over NBD: QEMU's NBD client writes and reads, librbd then reads
/// the same data; while served, the image's exclusive lock keeps other writers out.
fn serve_over_nbd_under_the_exclusive_lock(cluster: &Cluster, d: &TestDir, key: &Path) {
    let name = cluster.name("served");
    format_luks2(Path::new(&name), key, "32M");
    let mut daemon = d.serve().image(&name).key(key).nbd().start();
    let uri = daemon.nbd_uri("served");
    let io = [
        "write -P 0x6b 4M 256k",
        "read -P 0x6b 4M 256k",
        "read -P 0 0 64k",
    ];
    daemon.qemu_io("served", &io);
    // Block status: what was never written reads as zeros, and NBD clients are told so (QEMU's
    // mirror and backup jobs, qemu-img convert, skip it); what was written is data.
    let map = tool("qemu-img", ["map", "--output=json", "-f", "raw", &uri]);
    map.ok();
    let extents: Vec<serde_json::Value> = serde_json::from_str(&map.stdout).unwrap();
    let data: Vec<(u64, u64)> = extents
        .iter()
        .filter(|e| e["data"] == true)
        .map(|e| (e["start"].as_u64().unwrap(), e["length"].as_u64().unwrap()))
        .collect();
    assert_eq!(data, [(4 * MIB, 256 << 10)], "{}", map.stdout);
    // A second writer is refused while the daemon holds the lock, naming the reason.
    refused_as_locked(&name, key);
    // So is a second daemon: two daemons never write one image.
    d.serve_as("other")
        .image(&name)
        .key(key)
        .nbd()
        .run()
        .expect_code(code::IN_USE)
        .error_line(&["rbd/served", "locked by"]);
    assert_eq!(daemon.terminate(), 0);
    qemu_io(
        cluster,
        "served",
        "luks2",
        key,
        &["read -P 0x6b 4M 256k", "read -P 0 0 64k"],
    );
}

/// `format` creates (SIZE) or formats in place; `dump` and `key add` work on `rbd:` names and
/// librbd opens the image with the added passphrase.
fn format_dump_and_key_change(cluster: &Cluster, d: &TestDir, key: &Path) {
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

fn errors_name_the_problem(cluster: &Cluster, d: &TestDir, key: &Path) {
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

/// Another writer (`cryptblk key add`) is refused on `name`: a daemon holds its lock.
fn refused_as_locked(name: &str, key: &Path) {
    cryptblk(argv!(
        "key add --key-file {} --new-key-file {} {}",
        key,
        key,
        name
    ))
    .expect_code(code::IN_USE)
    .error_line(&["locked"]);
}

/// `kill -9` of the daemon after a flushed write: a new daemon takes the image's lock (the
/// cluster breaks the dead client's) and the write is there.
fn kill_9_keeps_flushed_writes(cluster: &Cluster, d: &TestDir, key: &Path) {
    let serve = d.serve_as("k9").image(cluster.name("served")).key(key);
    let mut daemon = serve.nbd().start();
    daemon.qemu_io("served", &["write -P 0x9e 7M 96k", "flush"]);
    daemon.kill9();
    // The lock of a dead client is broken once the cluster notices it is gone (measured: ~3 s
    // here); until then a restart is refused as "in use", and systemd's Restart= retries it.
    let start = std::time::Instant::now();
    while let Err(refused) = daemon.try_restart() {
        assert_eq!(refused.code, code::IN_USE, "restart failed: {refused}");
        assert!(
            start.elapsed() < std::time::Duration::from_secs(60),
            "the dead daemon's lock was not broken within 60 s"
        );
        std::thread::sleep(std::time::Duration::from_millis(500));
    }
    daemon.qemu_io("served", &["read -P 0x9e 7M 96k"]);
    daemon.kill9();
}

/// An OSD that stops answering mid-I/O: the RBD disk's requests wait (librados' OSD op
/// timeout is 30 s) and complete when it answers again; the daemon's other disk (a local
/// file) keeps serving meanwhile.
fn a_paused_osd_stalls_only_its_disk(cluster: &Cluster, d: &TestDir, key: &Path) {
    let local = d.path("local.raw");
    random_file(&local, 4 * MIB, 9);
    let config = d.path("two.toml");
    std::fs::write(
        &config,
        format!(
            "[[disk]]\nname = \"remote\"\nimage = \"{}\"\nkey-file = \"{}\"\nnbd = true\n\n\
             [[disk]]\nname = \"local\"\nimage = \"{}\"\nnbd = true\n",
            cluster.name("served"),
            s(key),
            s(&local)
        ),
    )
    .unwrap();
    let mut daemon = d.serve_as("two").config(&config).nbd().start();
    daemon.qemu_io("remote", &["read -P 0x9e 7M 96k"]);
    let paused = cluster.pause_osd();
    let io = ["write -P 0x2f 1M 128k", "flush", "read -P 0x2f 1M 128k"];
    let stalled = {
        let target = argv!(
            "{} {} {}",
            "-f".to_string(),
            "raw".to_string(),
            daemon.nbd_uri("remote")
        );
        std::thread::spawn(move || qemu_io_out(&target, &io))
    };
    std::thread::sleep(std::time::Duration::from_secs(1));
    let started = std::time::Instant::now();
    let out = daemon.qemu_io_out("local", &["read -v 0 16"]);
    out.ok();
    assert!(
        started.elapsed() < std::time::Duration::from_secs(10),
        "the local disk waited for the paused OSD"
    );
    let first: Vec<String> = read(&local)[..16]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let dumped: String = out.stdout.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(
        dumped.contains(&first.join(" ")),
        "local read {}: want {first:?}",
        out.stdout
    );
    assert!(
        !stalled.is_finished(),
        "the RBD request finished with its OSD stopped"
    );
    std::thread::sleep(std::time::Duration::from_secs(2));
    drop(paused);
    assert_io_ok(&stalled.join().unwrap(), &io);
    assert_eq!(daemon.terminate(), 0);
}

/// A disk served from RBD migrates live to a daemon that receives it into a local file (the
/// existing precopy stream, ciphertext only): the destination serves what was written.
fn migrates_out_of_rbd_into_a_file(cluster: &Cluster, d: &TestDir, key: &Path) {
    let received = d.path("received.luks");
    migrate_vol(
        d,
        key,
        "out",
        &cluster.name("served"),
        s(&received),
        &["write -P 0x4d 3M 1M"],
        &["read -P 0x4d 3M 1M", "read -P 0x9e 7M 96k"],
    );
}

/// A local LUKS2 disk migrates live into a new RBD image on the other daemon: the destination
/// serves what was written, and librbd's encryption reads it from the image afterwards.
fn migrates_from_a_file_into_rbd(cluster: &Cluster, d: &TestDir, key: &Path) {
    let local = d.path("local.luks");
    format_luks2(&local, key, "16M");
    migrate_vol(
        d,
        key,
        "in",
        s(&local),
        &cluster.name("received"),
        &["write -P 0x3c 5M 1M"],
        &["read -P 0x3c 5M 1M", "write -P 0x3d 9M 64k"],
    );
    qemu_io(
        cluster,
        "received",
        "luks2",
        key,
        &["read -P 0x3c 5M 1M", "read -P 0x3d 9M 64k"],
    );
}

/// Two daemons reach one RBD image: `migrate-start --shared` copies nothing and hands the
/// image's exclusive lock over at switchover. The destination serves what the source wrote,
/// its own writes land in the image (librbd's encryption reads both afterwards), and the
/// source can no longer write. A mismatched pair (shared source, copying destination, or the
/// other way round) is refused before anything moves.
fn hands_a_shared_image_over_without_copying(cluster: &Cluster, d: &TestDir, key: &Path) {
    let name = cluster.name("shared");
    format_luks2(Path::new(&name), key, "32M");
    let serve = d.serve_as("sh-a").image(&name).name("vol").key(key);
    let mut source = serve.nbd().control().start();
    let mut destination = d.serve_as("sh-b").nbd().control().start();
    source.qemu_io("vol", &["write -P 0x5a 2M 1M", "flush"]);
    // A refused source leaves the destination listening (for the right one): the refusals'
    // listeners get disk names of their own.
    let incoming = |disk: &str, image: &str| {
        let listen = format!("unix:{}", s(&d.path(&format!("sh-{disk}.sock"))));
        destination.ctl_ok(&argv!(
            "migrate-incoming {} --image {} --listen {} --key-file {} --nbd-export",
            disk,
            image,
            &listen,
            key
        ));
        listen
    };
    // A destination that would copy into a new image refuses a shared source...
    let listen = incoming("new-file", s(&d.path("copy.luks")));
    source
        .ctl(&["migrate-start", "vol", "--to", &listen, "--shared"])
        .expect_code(code::OTHER)
        .error_line(&["hands over shared storage", "creates a new image"]);
    // ...and one on the shared image refuses a source that would copy.
    let listen = incoming("copying", &name);
    source
        .ctl(&["migrate-start", "vol", "--to", &listen])
        .expect_code(code::OTHER)
        .error_line(&["takes over the existing image rbd:rbd/shared", "--shared"]);
    assert!(!d.path("copy.luks").exists());
    for refused in ["new-file", "copying"] {
        destination.ctl_ok(&["migrate-cancel", refused]);
    }
    source.qemu_io("vol", &["read -P 0x5a 2M 1M"]);

    let listen = incoming("vol", &name);
    let started = source.ctl_ok(&["migrate-start", "vol", "--to", &listen, "--shared"]);
    assert_eq!(started["shared"], true, "{started}");
    source.ctl_ok(&["migrate-switchover", "vol"]);
    let done = source.wait_migrate("vol", "completed");
    let outgoing = &done["outgoing"];
    assert_eq!(outgoing["bytes-sent"], 0, "nothing is copied: {done}");
    eprintln!("shared hand-off downtime: {} ms", outgoing["downtime-ms"]);
    wait_attached(&destination, "the handed-over disk");
    let io = ["read -P 0x5a 2M 1M", "write -P 0x5b 6M 64k", "flush"];
    destination.qemu_io("vol", &io);
    // The source handed its lock over: it cannot write, and detaching it touches nothing.
    let fenced = source.qemu_io_out("vol", &["write -P 0x66 6M 64k"]);
    assert!(
        fenced.stdout.contains("failed") || fenced.code != 0,
        "the source still wrote after the hand-off: {}",
        fenced.stdout
    );
    source.ctl_ok(&["disk-remove", "vol"]);
    // The destination holds the lock now.
    refused_as_locked(&name, key);
    assert_eq!(destination.terminate(), 0);
    assert_eq!(source.terminate(), 0);
    qemu_io(
        cluster,
        "shared",
        "luks2",
        key,
        &["read -P 0x5a 2M 1M", "read -P 0x5b 6M 64k"],
    );
}

/// Waits (at most 30 s) until the disk "vol" of `daemon` is attached.
fn wait_attached(daemon: &Daemon, what: &str) {
    let bound = std::time::Duration::from_secs(30);
    daemon.wait_ctl(&["disk-list"], &format!("{what} attached"), bound, |list| {
        list["disks"].as_array().is_some_and(|d| {
            d.iter()
                .any(|d| d["name"] == "vol" && d["state"] == "attached")
        })
    });
}

/// Serves `source` as disk "vol" on one daemon, runs `before` on it over NBD, migrates it
/// (precopy, then switchover) into `target` on a second daemon, runs `after` there, and stops
/// both.
fn migrate_vol(
    d: &TestDir,
    key: &Path,
    tag: &str,
    source: &str,
    target: &str,
    before: &[&str],
    after: &[&str],
) {
    let serve = d
        .serve_as(&format!("{tag}-a"))
        .image(source)
        .name("vol")
        .key(key);
    let mut source = serve.nbd().control().start();
    let mut destination = d.serve_as(&format!("{tag}-b")).nbd().control().start();
    let mut before = before.to_vec();
    before.push("flush");
    source.qemu_io("vol", &before);
    let listen = format!("unix:{}", s(&d.path(&format!("{tag}-mig.sock"))));
    destination.ctl_ok(&argv!(
        "migrate-incoming vol --image {} --listen {} --key-file {} --nbd-export",
        target,
        &listen,
        key
    ));
    source.ctl_ok(&["migrate-start", "vol", "--to", &listen]);
    source.ctl_ok(&["migrate-switchover", "vol"]);
    source.wait_migrate("vol", "completed");
    // The received disk is attached (its LUKS volume unlocked) right after the stream ends.
    wait_attached(&destination, "the received disk");
    destination.qemu_io("vol", after);
    assert_eq!(destination.terminate(), 0);
    assert_eq!(source.terminate(), 0);
}
