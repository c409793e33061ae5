//! `cryptblk serve` as a process: the in-repo vhost-user frontend (shared with the
//! vhost-user-blk crate's tests) connects, does I/O, disconnects; SIGTERM stops the daemon with
//! exit 0 and everything acknowledged is in the image.
mod common;

use common::*;
use frontend::{pattern, S_OK};

#[test]
fn serve_raw_reconnect_and_sigterm() {
    let t = TestDir::new();
    let img = t.raw("disk.raw", 4 * MIB);
    let mut daemon = t.serve().vhost_user().disk(&img).start();
    // A second daemon on the same image is refused: the image is locked.
    t.serve_as("other")
        .vhost_user()
        .disk(&img)
        .run()
        .expect_code(code::IN_USE);
    let data = pattern(64 * 1024, 11);
    {
        let mut guest = daemon.frontend(1, 256);
        assert!(
            guest.features & (1 << 13) == 0,
            "DISCARD offered without --discard"
        );
        assert_eq!(guest.write(0, 8, &data), S_OK);
        let (st, id) = guest.get_id(0);
        assert_eq!(st, S_OK);
        assert_eq!(&id[..8], b"disk.raw");
        assert!(id[8..].iter().all(|&b| b == 0));
    }
    {
        // A second frontend after the first went away sees the data.
        let mut guest = daemon.frontend(1, 256);
        assert_eq!(guest.read(0, 8, data.len()), (S_OK, data.clone()));
    }
    assert_eq!(daemon.terminate(), code::OK);
    assert!(!daemon.vhost_socket().exists(), "socket left behind");
    assert_same_bytes(
        &read(&img)[8 * 512..8 * 512 + data.len()],
        &data,
        "raw image",
    );
}

#[test]
fn serve_luks2_two_queues_sigterm_with_requests_in_flight() {
    let t = TestDir::new();
    let img = t.luks2("disk.luks", "8M", &t.key("key"));
    let uuid = img.dump()["uuid"].as_str().unwrap().to_string();

    let serve = t
        .serve()
        .vhost_user()
        .disk(&img)
        .args(&["--num-queues", "2"]);
    let mut daemon = serve.start();
    let mut guest = daemon.frontend(2, 256);
    let (st, id) = guest.get_id(1);
    assert_eq!(st, S_OK);
    assert_eq!(&id[..], &uuid.as_bytes()[..20]);

    // Both queues at once, then verified through the other queue.
    let bs = 32 * 1024;
    let mut expected = vec![0u8; (8 * MIB) as usize];
    for q in 0..2usize {
        for i in 0..8usize {
            let off = (q * 8 + i) * bs;
            let data = pattern(bs, (q * 8 + i) as u64);
            let (descs, _) = guest.out_chain(q, (off / 512) as u64, &data, 4096);
            guest.publish(q, &descs);
            expected[off..off + bs].copy_from_slice(&data);
        }
    }
    guest.kick(0);
    guest.kick(1);
    guest.wait_used(0, 8);
    guest.wait_used(1, 8);
    let (st, back) = guest.read(1, 0, 16 * bs);
    assert_eq!(st, S_OK);
    assert_same_bytes(&back, &expected[..16 * bs], "read back over queue 1");

    // A batch in flight when SIGTERM arrives: every write acknowledged OK must be in the
    // image; one not acknowledged may hold either the old or the new data. The old data of a
    // never-written area of a fresh LUKS image is whatever its zeroed ciphertext decrypts to.
    let (st, old) = guest.read(1, 2 * MIB / 512, 24 * bs);
    assert_eq!(st, S_OK);
    expected[2 * MIB as usize..2 * MIB as usize + 24 * bs].copy_from_slice(&old);
    let mut batch = Vec::new();
    for i in 0..24usize {
        let off = 2 * MIB as usize + i * bs;
        let data = pattern(bs, 1000 + i as u64);
        let (descs, status) = guest.out_chain(0, (off / 512) as u64, &data, 4096);
        guest.publish(0, &descs);
        batch.push((status, off, data));
    }
    guest.kick(0);
    assert_eq!(daemon.terminate(), code::OK);
    let acked: Vec<bool> = batch
        .iter()
        .map(|(status, _, _)| guest.status(*status) == S_OK)
        .collect();
    drop(guest);
    eprintln!(
        "{} of {} in-flight writes acknowledged before exit",
        acked.iter().filter(|&&a| a).count(),
        batch.len()
    );

    let plain = img.decrypt(&t.path("plain.raw"));
    assert_same_bytes(&plain[..16 * bs], &expected[..16 * bs], "decrypted image");
    for ((_, off, data), acked) in batch.iter().zip(&acked) {
        let got = &plain[*off..*off + bs];
        if *acked {
            assert!(got == &data[..], "acknowledged write at {off} lost");
        } else {
            assert!(
                got == &data[..] || got == &expected[*off..*off + bs],
                "block at {off} is neither the old nor the new data"
            );
        }
    }
}

#[test]
fn serve_usage_and_passphrase_errors() {
    let t = TestDir::new();
    let key = t.key("key");
    let img = t.luks2("disk.luks", "4M", &key);
    let serve = t.serve().vhost_user().image(&img.path);
    let with = |extra: &[&str]| serve.clone().args(extra).run();
    with(&["--key-file", s(&t.key("bad"))]).expect_code(code::WRONG_PASSPHRASE);
    with(&["--key-file", s(&key), "--queue-size", "1000"]).expect_code(code::USAGE);
    with(&["--key-file", s(&key), "--num-queues", "0"]).expect_code(code::USAGE);
    let raw = t.raw("disk.raw", MIB);
    let serve = t.serve().vhost_user().image(&raw.path).key(&key);
    serve.run().expect_code(code::USAGE);
    assert!(!t.path("vhost.sock").exists());
}

#[test]
fn serve_discard_punches_holes_in_a_raw_image() {
    let help = cryptblk(["serve", "--help"]).stdout;
    assert!(help.contains("--discard"), "{help}");
    assert!(help.contains("allow_discards"), "{help}");

    let t = TestDir::new();
    let img = t.path("disk.raw");
    std::fs::write(&img, vec![0x5au8; (2 * MIB) as usize]).unwrap();
    let mut daemon = t.serve().vhost_user().image(&img).arg("--discard").start();
    {
        let mut guest = daemon.frontend(1, 256);
        assert!(guest.features & (1 << 13) != 0, "DISCARD not offered");
        // 64 KiB at offset 64 KiB.
        assert_eq!(guest.discard(0, 128, 128, 0), S_OK);
        assert_eq!(guest.read(0, 128, 64 * 1024), (S_OK, vec![0u8; 64 * 1024]));
        assert_eq!(guest.read(0, 0, 512), (S_OK, vec![0x5au8; 512]));
    }
    assert_eq!(daemon.terminate(), code::OK);
    let on_disk = read(&img);
    assert!(on_disk[64 * 1024..128 * 1024].iter().all(|&b| b == 0));
    assert!(on_disk[128 * 1024..].iter().all(|&b| b == 0x5a));
}

#[test]
fn serve_config_two_disks_raw_and_luks() {
    let t = TestDir::new();
    let raw = t.raw("data.raw", 4 * MIB);
    let luks = t.luks2("root.luks", "4M", &t.key("root.key"));
    let raw_sock = t.path("data.sock");
    let luks_sock = t.path("root.sock");
    // Relative paths (the raw disk) resolve against the config file's directory, not the
    // daemon's working directory.
    let config = t.path("serve.toml");
    std::fs::write(
        &config,
        format!(
            r#"# two disks
[[disk]]
name = "vm1-data"
image = "data.raw"
vhost-user-blk = "data.sock"

[[disk]]
name = "vm1-root"
image = "{}"
key-file = "{}"
vhost-user-blk = "{}"
num-queues = 2
queue-size = 128
"#,
            s(&luks),
            s(luks.key()),
            s(&luks_sock)
        ),
    )
    .unwrap();
    let root = std::path::Path::new("/");
    let mut daemon = t.serve().config(&config).current_dir(root).start();

    let raw_data = pattern(64 * 1024, 21);
    let luks_data = pattern(96 * 1024, 22);
    {
        // Both frontends connected at once: each disk has its own server thread.
        let mut data_guest = frontend::Guest::connect(&raw_sock, 1, 256);
        let mut root_guest = frontend::Guest::connect(&luks_sock, 2, 128);
        assert_eq!(data_guest.write(0, 16, &raw_data), S_OK);
        assert_eq!(root_guest.write(1, 64, &luks_data), S_OK);
        assert_eq!(
            data_guest.read(0, 16, raw_data.len()),
            (S_OK, raw_data.clone())
        );
        assert_eq!(
            root_guest.read(0, 64, luks_data.len()),
            (S_OK, luks_data.clone())
        );
        // GET_ID defaults to the disk's name.
        let (st, id) = data_guest.get_id(0);
        assert_eq!(st, S_OK);
        assert_eq!(&id[..8], b"vm1-data");
        assert!(id[8..].iter().all(|&b| b == 0));
        let (st, id) = root_guest.get_id(1);
        assert_eq!(st, S_OK);
        assert_eq!(&id[..8], b"vm1-root");
    }
    assert_eq!(daemon.terminate(), code::OK);
    assert!(!raw_sock.exists(), "socket left behind");
    assert!(!luks_sock.exists(), "socket left behind");
    assert_same_bytes(
        &read(&raw)[16 * 512..16 * 512 + raw_data.len()],
        &raw_data,
        "raw disk",
    );
    let plain = luks.decrypt(&t.path("plain.raw"));
    assert_same_bytes(
        &plain[64 * 512..64 * 512 + luks_data.len()],
        &luks_data,
        "decrypted LUKS disk",
    );
}

#[test]
fn serve_config_errors() {
    let t = TestDir::new();
    let raw = t.raw("a.raw", MIB);
    let key = t.key("b.key");
    let luks = t.luks2("b.luks", "2M", &key);
    let wrong = t.key("wrong");
    let sock_a = t.path("a.sock");
    let sock_b = t.path("b.sock");
    let config = t.path("serve.toml");
    let write_config = |second_extra: &str, key: &Key| {
        std::fs::write(
            &config,
            format!(
                "[[disk]]\nname = \"disk-a\"\nimage = \"a.raw\"\nvhost-user-blk = \"a.sock\"\n\n\
                 [[disk]]\nname = \"disk-b\"\nimage = \"{}\"\nkey-file = \"{}\"\n\
                 vhost-user-blk = \"b.sock\"\n{second_extra}",
                s(&luks),
                s(key)
            ),
        )
        .unwrap();
    };

    // An unknown key: exit 1, the message names the key and the disk.
    write_config("num-queue = 2\n", &key);
    let out = cryptblk(["serve", "--config", s(&config)]);
    out.expect_code(code::USAGE);
    out.error_line(&["num-queue", "disk-b"]);
    assert!(!sock_a.exists() && !sock_b.exists());

    // A wrong key for the second disk: exit 2 naming it; the first disk may have served
    // while the second was being unlocked (each disk serves as soon as it is unlocked), but
    // the start fails as a whole and leaves no socket behind.
    write_config("", &wrong);
    let out = cryptblk(["serve", "--config", s(&config)]);
    out.expect_code(code::WRONG_PASSPHRASE);
    out.error_line(&["disk-b"]);
    assert!(!sock_a.exists(), "the first disk's socket left behind");
    assert!(!sock_b.exists());

    // A missing image fails the start the same way (exit 5, naming the disk).
    std::fs::rename(&raw, t.path("gone.raw")).unwrap();
    write_config("", &key);
    let out = cryptblk(["serve", "--config", s(&config)]);
    out.expect_code(code::IO);
    out.error_line(&["disk-a"]);
    assert!(!sock_a.exists() && !sock_b.exists());
    std::fs::rename(t.path("gone.raw"), &raw).unwrap();

    // Duplicate names and duplicate sockets are refused.
    std::fs::write(
        &config,
        "[[disk]]\nname = \"x\"\nimage = \"a.raw\"\nvhost-user-blk = \"a.sock\"\n\
         [[disk]]\nname = \"x\"\nimage = \"b.raw\"\nvhost-user-blk = \"b.sock\"\n",
    )
    .unwrap();
    let out = cryptblk(["serve", "--config", s(&config)]);
    out.expect_code(code::USAGE);
    out.error_line(&["same name"]);
    std::fs::write(
        &config,
        format!(
            "[[disk]]\nname = \"x\"\nimage = \"a.raw\"\nvhost-user-blk = \"a.sock\"\n\
             [[disk]]\nname = \"y\"\nimage = \"b.raw\"\nvhost-user-blk = \"{}\"\n",
            s(&sock_a)
        ),
    )
    .unwrap();
    let out = cryptblk(["serve", "--config", s(&config)]);
    out.expect_code(code::USAGE);
    out.error_line(&["socket", "\"y\""]);

    // --config is exclusive with the single-disk options, and one of the two forms is needed.
    cryptblk(["serve", "--config", s(&config), "--image", s(&raw)]).expect_code(code::USAGE);
    cryptblk(["serve", "--config", s(&config), "--num-queues", "2"]).expect_code(code::USAGE);
    cryptblk(["serve"]).expect_code(code::USAGE);
    cryptblk(["serve", "--image", s(&raw)]).expect_code(code::USAGE);
    assert!(!sock_a.exists() && !sock_b.exists());

    // The format is documented in --help.
    let help = cryptblk(["serve", "--help"]).stdout;
    for needle in [
        "--config",
        "[[disk]]",
        "key-file",
        "vhost-user-blk =",
        "num-queues =",
    ] {
        assert!(
            help.contains(needle),
            "{needle} missing from serve --help:\n{help}"
        );
    }
}

/// The daemon's peak resident memory (VmHWM), KiB.
fn peak_rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap()
}

/// A guest that fills its queue with the largest writes it may send, every one over the same
/// 16 KiB of its memory (aliased descriptors in an indirect table per request), makes the
/// daemon hold at most the queue's data budget of ciphertext, not queue depth x request size:
/// the writes past the budget wait in the queue, and all of them complete.
#[test]
fn aliased_large_writes_keep_the_daemon_within_the_queue_budget() {
    // At queue size 256 a request has at most 254 data segments of 16 KiB (just under
    // MAX_REQUEST_BYTES); 64 of them would need 254 MiB of ciphertext at once.
    const SEG: u32 = 16 << 10;
    const SEGS: usize = 254;
    const REQUESTS: usize = 64;
    let t = TestDir::new();
    let img = t.luks2("budget.luks", "64M", &t.key("budget.key"));
    let mut daemon = t.serve().vhost_user().disk(&img).start();
    let mut guest = daemon.frontend(1, 256);
    let before = peak_rss_kib(daemon.pid());
    let data = guest.alloc(0, SEG);
    let mut statuses = Vec::new();
    for r in 0..REQUESTS {
        // Eight 4 MiB zones of the 64 MiB disk, written over and over.
        let sector = ((r % 8) * SEGS * SEG as usize / 512) as u64;
        statuses.push(guest.publish_aliased_write(0, sector, data, SEGS, SEG));
    }
    guest.kick(0);
    guest.wait_used(0, REQUESTS);
    for (r, status) in statuses.iter().enumerate() {
        assert_eq!(guest.status(*status), S_OK, "write {r}");
    }
    let grown_mib = (peak_rss_kib(daemon.pid()) - before) / 1024;
    eprintln!("peak RSS grew by {grown_mib} MiB for {REQUESTS} writes of 4 MiB");
    // The budget is 32 MiB per queue; the rest is the buffer cache's kept buffers and noise.
    assert!(
        grown_mib < 80,
        "the daemon's peak RSS grew by {grown_mib} MiB: more than one queue's data budget"
    );
    drop(guest);
    assert_eq!(daemon.terminate(), code::OK);
}
