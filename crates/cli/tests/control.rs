//! The control socket of `cryptblk serve --control`: disks attached and detached at run time,
//! statistics, keyslot changes on an attached disk, concurrent clients, malformed requests;
//! through `cryptblk ctl` and raw JSON-RPC lines.
mod common;

use common::*;
use frontend::{pattern, Guest, S_OK};
use serde_json::{json, Value};
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn disk_names(list: &Value) -> Vec<String> {
    list["disks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["name"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn attach_detach_stats_and_keys_at_run_time() {
    let t = TestDir::new();
    let key = t.key("key");
    let wrong = t.key("wrong");
    let new_key = t.key("new");
    let raw = t.raw("a.raw", 4 * MIB);
    let luks = t.luks2("c.luks", "8M", &key);
    let other_luks = t.luks2("d.luks", "8M", &key);
    let mut daemon = t.serve().control().start();

    // Only the owner may talk to the daemon.
    let mode = std::fs::metadata(daemon.control())
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600, "control socket mode {mode:o}");
    assert!(disk_names(&daemon.ctl_ok(&["disk-list"])).is_empty());

    let va = t.path("a.sock");
    let added = daemon.ctl_ok(&argv!("disk-add a --image {} --vhost-user-blk {}", raw, va));
    assert_eq!(added["name"], "a");
    assert_eq!(added["format"], "raw");
    let vc = t.path("c.sock");
    let added = daemon.ctl_ok(&argv!(
        "disk-add c --image {} --key-file {} --vhost-user-blk {}",
        luks,
        key,
        vc
    ));
    assert_eq!(added["block-size"], 4096);
    assert!(added["engine"].is_string(), "{added}");

    // A wrong key fails that disk-add with the wrong-passphrase code; nothing else changes.
    let mut guest = Guest::connect(&va, 1, 256);
    let data = pattern(64 * 1024, 7);
    assert_eq!(guest.write(0, 0, &data), S_OK);
    let out = daemon.ctl(&argv!(
        "disk-add c2 --image {} --key-file {} --vhost-user-blk {}",
        other_luks,
        wrong,
        t.path("c2.sock")
    ));
    out.expect_code(code::WRONG_PASSPHRASE);
    out.error_line(&["passphrase"]);
    let mut rpc = daemon.rpc();
    let err = rpc
        .call(
            "disk-add",
            json!({"name": "c3", "image": s(&other_luks), "key-file": s(&wrong),
                   "vhost-user-blk": s(&t.path("c3.sock"))}),
        )
        .unwrap_err();
    assert_eq!(err["code"], -32002, "{err}");
    // The image of disk "c" is locked by it: a second attach is refused as in use.
    let err = rpc
        .call(
            "disk-add",
            json!({"name": "c4", "image": s(&luks), "key-file": s(&key),
                   "vhost-user-blk": s(&t.path("c4.sock"))}),
        )
        .unwrap_err();
    assert_eq!(err["code"], -32006, "{err}");
    assert!(!t.path("c4.sock").exists());
    let (st, back) = guest.read(0, 0, data.len());
    assert_eq!(st, S_OK);
    assert_same_bytes(&back, &data, "disk a after failed disk-adds");
    assert_eq!(
        disk_names(&daemon.ctl_ok(&["disk-list"])),
        ["a".to_string(), "c".to_string()]
    );

    // Statistics count what the guest did.
    let stats = daemon.ctl_ok(&["stats", "a"]);
    let a = &stats["disks"][0];
    assert_eq!(a["name"], "a");
    assert_eq!(a["vhost-user-blk"]["connected"], true);
    let q0 = &a["vhost-user-blk"]["queues"][0];
    assert!(q0["write-ops"].as_u64().unwrap() >= 1, "{q0}");
    assert!(
        q0["read-bytes"].as_u64().unwrap() >= data.len() as u64,
        "{q0}"
    );
    assert!(q0["read-latency-us"]["p50"].as_f64().unwrap() > 0.0, "{q0}");
    assert!(stats["crypto-pool"]["threads"].as_u64().unwrap() >= 1);

    // A connected VM blocks a plain disk-remove; force cuts it off.
    let out = daemon.ctl(&["disk-remove", "a"]);
    assert_ne!(out.code, 0);
    assert!(out.stderr.contains("connected"), "{}", out.stderr);
    daemon.ctl_ok(&["disk-remove", "a", "--force"]);
    assert!(!va.exists(), "socket of a removed disk left behind");
    drop(guest);
    let err = rpc.call("stats", json!({"name": "a"})).unwrap_err();
    assert_eq!(err["code"], -32010, "{err}");
    // The image is closed and unlocked: it can be attached again.
    daemon.ctl_ok(&argv!("disk-add a --image {} --vhost-user-blk {}", raw, va));
    let mut guest = Guest::connect(&va, 1, 256);
    let (st, back) = guest.read(0, 0, data.len());
    assert_eq!(st, S_OK);
    assert_same_bytes(&back, &data, "disk a after re-attach");
    drop(guest);

    // Keyslots of an attached LUKS disk: add a passphrase, remove the old one.
    let add =
        |old: &Key| argv!("key-add c --key-file {} --new-key-file {}", old, new_key; CTL_CHEAP_KDF);
    let r = daemon.ctl_ok(&add(&key));
    assert!(r["keyslot"].is_u64(), "{r}");
    assert_ne!(daemon.ctl(&add(&wrong)).code, 0);
    daemon.ctl_ok(&["key-remove", "c", "--key-file", s(&key)]);
    // The last keyslot is never removed.
    let out = daemon.ctl(&["key-remove", "c", "--key-file", s(&new_key)]);
    assert_ne!(out.code, 0);
    assert!(out.stderr.contains("last"), "{}", out.stderr);

    assert_eq!(daemon.terminate(), code::OK);
    assert!(
        ["ctl.sock", "a.sock", "c.sock"]
            .iter()
            .all(|n| !t.path(n).exists()),
        "sockets left after SIGTERM"
    );
    // Only the new passphrase opens the image now.
    assert!(cryptsetup_accepts(&luks, &new_key));
    assert!(!cryptsetup_accepts(&luks, &key));
}

#[test]
fn malformed_requests_get_json_rpc_errors() {
    let t = TestDir::new();
    let mut daemon = t.serve().control().start();
    let mut rpc = daemon.rpc();
    let r = rpc.line("{not json");
    assert_eq!(r["error"]["code"], -32700, "{r}");
    let r = rpc.line(r#"{"jsonrpc":"2.0","id":1,"method":7}"#);
    assert_eq!(r["error"]["code"], -32600, "{r}");
    let err = rpc.call("disk-explode", json!({})).unwrap_err();
    assert_eq!(err["code"], -32601, "{err}");
    let err = rpc.call("disk-add", json!({"name": "x"})).unwrap_err();
    assert_eq!(err["code"], -32602, "{err}");
    let err = rpc
        .call(
            "disk-add",
            json!({"name": "x", "image": "relative.raw", "vhost-user-blk": "/tmp/x"}),
        )
        .unwrap_err();
    assert_eq!(err["code"], -32602, "{err}");
    assert!(
        err["message"].as_str().unwrap().contains("relative"),
        "{err}"
    );
    let err = rpc
        .call(
            "disk-add",
            json!({"name": "x", "image": "/nonexistent/x.raw",
                                "vhost-user-blk": "/tmp/x.sock", "bogus": 1}),
        )
        .unwrap_err();
    assert_eq!(err["code"], -32602, "{err}");
    let err = rpc
        .call(
            "disk-add",
            json!({"name": "x", "image": "/nonexistent/x.raw",
                                "vhost-user-blk": s(&t.path("x.sock"))}),
        )
        .unwrap_err();
    assert!(
        err["message"]
            .as_str()
            .unwrap()
            .contains("/nonexistent/x.raw"),
        "{err}"
    );
    // A socket path that names an existing file is refused; the file is untouched.
    let precious = t.path("precious.raw");
    std::fs::write(&precious, b"keep me").unwrap();
    let img = t.raw("x.raw", MIB);
    let err = rpc
        .call(
            "disk-add",
            json!({"name": "x", "image": s(&img), "vhost-user-blk": s(&precious)}),
        )
        .unwrap_err();
    assert!(
        err["message"].as_str().unwrap().contains("not a socket"),
        "{err}"
    );
    assert_eq!(std::fs::read(&precious).unwrap(), b"keep me");
    let err = rpc
        .call("disk-remove", json!({"name": "nope"}))
        .unwrap_err();
    assert_eq!(err["code"], -32010, "{err}");
    // The connection still works after all that.
    assert!(disk_names(&rpc.call("disk-list", json!({})).unwrap()).is_empty());
    assert_eq!(daemon.terminate(), code::OK);
}

/// Several clients attach and detach disks at once while a VM-like client keeps doing
/// verified I/O on another disk: every control request succeeds, and the I/O never fails or
/// stalls behind them.
#[test]
fn concurrent_control_clients_while_io_runs() {
    let t = TestDir::new();
    let steady = t.raw("steady.raw", 8 * MIB);
    let vs = t.path("steady.sock");
    let serve = t.serve().control().disk(&steady).name("steady");
    let mut daemon = serve.vhost_user_at(&vs).start();
    let stop = Arc::new(AtomicBool::new(false));
    let io_rounds = Arc::new(AtomicU64::new(0));
    let io = {
        let (stop, rounds, vs) = (stop.clone(), io_rounds.clone(), vs.clone());
        std::thread::spawn(move || {
            let mut guest = Guest::connect(&vs, 1, 256);
            let mut seed = 0u64;
            while !stop.load(Ordering::Relaxed) {
                seed += 1;
                let sector = (seed % 64) * 128;
                let data = pattern(64 * 1024, seed);
                assert_eq!(guest.write(0, sector, &data), S_OK, "write {seed}");
                let (st, back) = guest.read(0, sector, data.len());
                assert_eq!(st, S_OK, "read {seed}");
                assert!(back == data, "data mismatch in round {seed}");
                rounds.fetch_add(1, Ordering::Relaxed);
            }
        })
    };

    const CLIENTS: usize = 4;
    const ROUNDS: usize = 6;
    let images: Vec<Vec<PathBuf>> = (0..CLIENTS)
        .map(|c| {
            (0..ROUNDS)
                .map(|r| t.raw(&format!("d{c}-{r}.raw"), MIB).path)
                .collect()
        })
        .collect();
    let clients: Vec<_> = images
        .into_iter()
        .enumerate()
        .map(|(c, imgs)| {
            let control = daemon.control().to_path_buf();
            let dir = t.root().to_path_buf();
            std::thread::spawn(move || {
                let mut rpc = Rpc::connect(&control);
                for (r, img) in imgs.iter().enumerate() {
                    let name = format!("d{c}-{r}");
                    let sock = dir.join(format!("{name}.sock"));
                    rpc.call(
                        "disk-add",
                        json!({"name": name, "image": s(img), "vhost-user-blk": s(&sock)}),
                    )
                    .unwrap_or_else(|e| panic!("disk-add {name}: {e}"));
                    assert!(sock.exists());
                    let list = rpc.call("disk-list", json!({})).unwrap();
                    assert!(disk_names(&list).contains(&name));
                    rpc.call("stats", json!({"name": name})).unwrap();
                    rpc.call("disk-remove", json!({"name": name}))
                        .unwrap_or_else(|e| panic!("disk-remove {name}: {e}"));
                    assert!(!sock.exists());
                }
            })
        })
        .collect();
    for c in clients {
        c.join().expect("a control client failed");
    }
    // Let the I/O run a little after the churn too, then check it made progress throughout.
    let before = io_rounds.load(Ordering::Relaxed);
    let deadline = Instant::now() + Duration::from_secs(30);
    while io_rounds.load(Ordering::Relaxed) < before + 10 {
        assert!(Instant::now() < deadline, "I/O on the steady disk stalled");
        std::thread::sleep(Duration::from_millis(10));
    }
    stop.store(true, Ordering::Relaxed);
    io.join().expect("I/O on the steady disk failed");
    assert_eq!(
        disk_names(&daemon.ctl_ok(&["disk-list"])),
        ["steady".to_string()]
    );
    assert_eq!(daemon.terminate(), code::OK);
}
