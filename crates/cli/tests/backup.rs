//! `cryptblk backup` against QEMU's own NBD server: a LUKS2 image (made by `cryptblk format`)
//! served as its raw bytes by `qemu-storage-daemon`, with dirty bitmaps added, closed and
//! exported over QMP as a backup tool would. A full pull and three incrementals; each
//! checkpoint restored is byte for byte the image file at that point, opens with the
//! passphrase and decrypts to what was written; the chain holds neither the passphrase nor
//! the plaintext; verify and restore name a damaged entry and a broken chain.
//!
//! The writer: what a VM writes reaches the served image as ciphertext. Here the plaintext is
//! encrypted with the image's own volume key by `cryptblk convert -n` into a copy of the image
//! (the "shadow"), and the changed sectors' ciphertext is written with `qemu-io` through the
//! daemon's writable export, so QEMU's dirty bitmaps see exactly the writes an encrypting
//! frontend makes. (QEMU 7.2's own LUKS driver reads LUKS1 only.)
mod common;

use common::backup::{chain_extents, manifest};
use common::*;
use serde_json::json;
use std::path::{Path, PathBuf};
use std::process::Command;

const PAYLOAD: usize = 16 << 20;

/// The LUKS2 image served by qemu-storage-daemon, and the plaintext it holds.
struct Source {
    t: TestDir,
    image: Image,
    shadow: PathBuf,
    key: Key,
    plain: Vec<u8>,
    data_offset: u64,
    qmp: Qmp,
    nbd_socket: PathBuf,
    _qsd: Process,
}

impl Source {
    fn new() -> Source {
        let t = TestDir::new();
        let key = t.key("key");
        let image = t.luks2("disk.luks", "16M", &key);
        let data_offset = image.dump()["segments"][0]["offset"].as_u64().unwrap();
        let plain = image.decrypt(&t.path("initial.raw"));
        assert_eq!(plain.len(), PAYLOAD);
        let shadow = t.path("shadow.luks");
        std::fs::copy(&*image, &shadow).unwrap();
        let nbd_socket = t.path("nbd.sock");
        let qmp_socket = t.path("qmp.sock");
        let mut cmd = Command::new("qemu-storage-daemon");
        cmd.args([
            "--blockdev",
            &format!("driver=file,node-name=file0,filename={}", s(&image)),
            "--blockdev",
            "driver=raw,node-name=disk0,file=file0",
            "--nbd-server",
            &format!("addr.type=unix,addr.path={}", s(&nbd_socket)),
            "--export",
            "type=nbd,id=writer,node-name=disk0,name=writer,writable=on",
            "--chardev",
            &format!("socket,id=qmp,path={},server=on,wait=off", s(&qmp_socket)),
            "--monitor",
            "chardev=qmp",
        ]);
        let mut qsd = Process::spawn(cmd, t.path("qsd.log"));
        // Probe the NBD socket, not the QMP one: the QMP chardev serves one client, and a
        // probe's connection still held there makes it close ours ("QMP connection closed").
        qsd.wait_for_socket(&nbd_socket);
        let qmp = Qmp::connect(&qmp_socket);
        Source {
            t,
            image,
            shadow,
            key,
            plain,
            data_offset,
            qmp,
            nbd_socket,
            _qsd: qsd,
        }
    }

    fn uri(&self, export: &str) -> String {
        format!("nbd+unix:///{export}?socket={}", s(&self.nbd_socket))
    }

    /// Writes `pattern` repeated over `len` bytes at payload offset `at` (4 KiB sectors), as an
    /// encrypting frontend would: ciphertext through the served export.
    fn write_plain(&mut self, at: usize, len: usize, pattern: &[u8]) {
        assert!(at.is_multiple_of(4096) && len.is_multiple_of(4096));
        for (i, b) in self.plain[at..at + len].iter_mut().enumerate() {
            *b = pattern[i % pattern.len()];
        }
        let plain = self.t.path("plain.raw");
        std::fs::write(&plain, &self.plain).unwrap();
        cryptblk(argv!(
            "convert -f raw -O luks -n -d {} {} {}",
            &*self.key,
            &plain,
            &self.shadow
        ))
        .ok();
        let cipher = std::fs::read(&self.shadow).unwrap();
        let at = self.data_offset as usize + at;
        self.write_cipher(at, &cipher[at..at + len]);
    }

    /// Copies the header bytes that differ in the shadow (after a keyslot change there).
    fn copy_header_changes(&mut self) {
        let shadow = std::fs::read(&self.shadow).unwrap();
        let live = std::fs::read(&*self.image).unwrap();
        for at in (0..self.data_offset as usize).step_by(4096) {
            if shadow[at..at + 4096] != live[at..at + 4096] {
                self.write_cipher(at, &shadow[at..at + 4096]);
            }
        }
    }

    fn write_cipher(&self, at: usize, bytes: &[u8]) {
        let chunk = self.t.path("chunk.bin");
        std::fs::write(&chunk, bytes).unwrap();
        let cmd = format!("write -s {} {at} {}", s(&chunk), bytes.len());
        qemu_io_cmds(&["-f", "raw", &self.uri("writer")], &[&cmd]);
    }

    fn qmp(&mut self, command: &str, arguments: serde_json::Value) {
        self.qmp.execute(command, arguments);
    }

    /// The image file's bytes now (what a restore of this moment must give back).
    fn snapshot(&self) -> Vec<u8> {
        std::fs::read(&*self.image).unwrap()
    }
}

fn pull(args: &[&str]) -> Out {
    let out = cryptblk(argv!("backup pull --progress=json"; args));
    out.ok();
    assert!(
        out.stderr.contains("\"event\":\"done\""),
        "no progress:\n{}",
        out.stderr
    );
    out
}

/// The dirty extents `nbdinfo --map` reads from the export, merged.
fn nbdinfo_dirty(uri: &str, bitmap: &str) -> Vec<(u64, u64)> {
    let out = tool(
        "nbdinfo",
        ["--json", &format!("--map=qemu:dirty-bitmap:{bitmap}"), uri],
    );
    out.ok();
    let map: serde_json::Value = serde_json::from_str(&out.stdout).unwrap();
    let mut dirty: Vec<(u64, u64)> = Vec::new();
    for e in map.as_array().unwrap() {
        if e["type"].as_u64().unwrap() & 1 == 0 {
            continue;
        }
        let (offset, length) = (e["offset"].as_u64().unwrap(), e["length"].as_u64().unwrap());
        match dirty.last_mut() {
            Some(last) if last.0 + last.1 == offset => last.1 += length,
            _ => dirty.push((offset, length)),
        }
    }
    dirty
}

fn allocated(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).unwrap().blocks() * 512
}

#[test]
fn a_chain_of_a_luks2_image_restores_every_checkpoint_without_the_key() {
    let mut src = Source::new();
    let chain = src.t.path("chain");
    let pattern = |n: u8| format!("cryptblk backup plaintext pattern {n} ").into_bytes();

    // Before the full backup: data in two places.
    src.write_plain(0, 1 << 20, &pattern(1));
    src.write_plain(9 << 20, 256 << 10, &pattern(2));
    src.qmp(
        "block-dirty-bitmap-add",
        json!({"node": "disk0", "name": "c0"}),
    );
    src.qmp("block-export-add", json!({"type": "nbd", "id": "full", "node-name": "disk0", "name": "full", "writable": false}));
    pull(&[&src.uri("full"), s(&chain), "--checkpoint", "c0"]);
    src.qmp("block-export-del", json!({"id": "full"}));
    let mut moments = vec![("c0", src.snapshot(), src.plain.clone())];

    // Three incrementals; the second also adds a keyslot (a header change).
    let second = src.t.key("second");
    for i in 1..=3u8 {
        let (from, to) = (format!("c{}", i - 1), format!("c{i}"));
        src.write_plain(usize::from(i) * (2 << 20), 64 << 10, &pattern(10 + i));
        src.write_plain(15 << 20, 4096, &pattern(20 + i));
        if i == 2 {
            let add = "key add -d {} --new-key-file {} {}";
            cryptblk_cheap(argv!(add, src.key, second, src.shadow)).ok();
            src.copy_header_changes();
        }
        // The checkpoint: close bitmap FROM and start TO at the same instant, export FROM.
        src.qmp(
            "transaction",
            json!({"actions": [
                {"type": "block-dirty-bitmap-disable", "data": {"node": "disk0", "name": from}},
                {"type": "block-dirty-bitmap-add", "data": {"node": "disk0", "name": to}},
            ]}),
        );
        let export = format!("inc{i}");
        src.qmp("block-export-add", json!({"type": "nbd", "id": export, "node-name": "disk0", "name": export, "writable": false, "bitmaps": [from]}));
        let out = pull(&[
            "--incremental",
            &src.uri(&export),
            s(&chain),
            "--checkpoint",
            &to,
        ]);
        assert!(
            out.stdout.contains(&format!("incremental since {from}")),
            "{}",
            out.stdout
        );
        // The entry covers exactly the extents the third-party client reads from the bitmap.
        let entry = manifest(&chain)["entries"][usize::from(i)].clone();
        assert_eq!(
            chain_extents(&chain, &entry),
            nbdinfo_dirty(&src.uri(&export), &from),
            "{to}"
        );
        // 64 KiB + 4 KiB written (and a keyslot): a few 64 KiB bitmap granules, not the disk.
        let moved = entry["data_bytes"].as_u64().unwrap();
        assert!(moved <= 1 << 20, "{to} moved {moved} bytes");
        src.qmp("block-export-del", json!({"id": export}));
        src.qmp(
            "block-dirty-bitmap-remove",
            json!({"node": "disk0", "name": from}),
        );
        moments.push((
            ["c1", "c2", "c3"][usize::from(i) - 1],
            src.snapshot(),
            src.plain.clone(),
        ));
    }

    // Every checkpoint: the image file as it was, sparse, opening with its passphrases and
    // decrypting to what had been written.
    for (name, image, plain) in &moments {
        let out = src.t.path(&format!("restored-{name}.luks"));
        cryptblk([
            "backup",
            "restore",
            "--checkpoint",
            name,
            s(&chain),
            s(&out),
        ])
        .ok();
        assert_same_bytes(&read(&out), image, &format!("checkpoint {name}"));
        assert!(
            allocated(&out) <= allocated(&src.image) + (1 << 20),
            "{name} not sparse"
        );
        assert!(cryptsetup_accepts(&out, &src.key), "{name}");
        assert_eq!(
            cryptsetup_accepts(&out, &second),
            *name >= "c2",
            "{name}: second key"
        );
        let decrypted = cryptblk_decrypt(&out, &src.key, &src.t.path(&format!("plain-{name}.raw")));
        assert!(decrypted == *plain, "{name}: the plaintext differs");
    }

    // No key on the backup side: neither the passphrase nor any written plaintext.
    let secret = std::fs::read(&*src.key).unwrap();
    for f in std::fs::read_dir(&chain).unwrap() {
        let bytes = std::fs::read(f.unwrap().path()).unwrap();
        for needle in (1..=23).map(pattern).chain([secret.clone()]) {
            assert!(
                !bytes.windows(needle.len()).any(|w| w == needle),
                "the chain holds {:?}",
                String::from_utf8_lossy(&needle)
            );
        }
    }

    cryptblk(["backup", "verify", s(&chain)]).ok();
    // A flipped byte in c1's data: verify names c1 (exit 4); restoring c3 needs c1 and
    // refuses, leaving no file; c0 still restores.
    let m = manifest(&chain);
    let c1_data = chain.join(m["entries"][1]["data"]["file"].as_str().unwrap());
    let mut bytes = std::fs::read(&c1_data).unwrap();
    bytes[7] ^= 0x40;
    std::fs::write(&c1_data, &bytes).unwrap();
    let out = cryptblk(["backup", "verify", s(&chain)]);
    out.expect_code(code::DAMAGED)
        .error_line(&["entry \"c1\"", "checksum"]);
    assert!(
        out.stdout.contains("c0: ok") && out.stdout.contains("c2: ok"),
        "{}",
        out.stdout
    );
    let broken = src.t.path("broken.luks");
    cryptblk(["backup", "restore", s(&chain), s(&broken)])
        .expect_code(code::DAMAGED)
        .error_line(&["entry \"c1\""]);
    assert!(!broken.exists());
    cryptblk([
        "backup",
        "restore",
        "--checkpoint",
        "c0",
        s(&chain),
        s(&broken),
    ])
    .ok();
    // A missing file is named too.
    std::fs::remove_file(chain.join(m["entries"][3]["extents"]["file"].as_str().unwrap())).unwrap();
    cryptblk(["backup", "verify", s(&chain)])
        .expect_code(code::DAMAGED)
        .error_line(&["2 damaged entries", "entry \"c1\""]);
    // An entry taken out of the chain breaks it; restore names the entry that lost its base.
    let mut m = manifest(&chain);
    m["entries"].as_array_mut().unwrap().remove(1);
    std::fs::write(chain.join("manifest.json"), m.to_string()).unwrap();
    cryptblk(["backup", "restore", s(&chain), s(&src.t.path("gap.luks"))])
        .expect_code(code::DAMAGED)
        .error_line(&["entry \"c2\"", "since \"c1\"", "broken"]);
}

#[test]
fn bad_arguments_and_unreachable_servers_get_one_clear_line() {
    let t = TestDir::new();
    let chain = t.path("chain");
    cryptblk(["backup", "pull", "nbds://h/e", s(&chain)])
        .expect_code(code::USAGE)
        .error_line(&["TLS"]);
    cryptblk([
        "backup",
        "pull",
        "--incremental",
        "nbd+unix:///e?socket=/nonexistent",
        s(&chain),
    ])
    .expect_code(code::USAGE)
    .error_line(&["full pull first"]);
    cryptblk([
        "backup",
        "pull",
        "nbd+unix:///e?socket=/nonexistent/sock",
        s(&chain),
    ])
    .expect_code(code::OTHER)
    .error_line(&["cannot connect", "/nonexistent/sock"]);
    cryptblk(["backup", "restore", s(&chain), s(&t.path("x.img"))])
        .expect_code(code::USAGE)
        .error_line(&["no backup chain"]);
    cryptblk([
        "backup",
        "pull",
        "--checkpoint",
        "../x",
        "nbd+unix:///e?socket=/s",
        s(&chain),
    ])
    .expect_code(code::USAGE)
    .error_line(&["not a checkpoint name"]);
}
