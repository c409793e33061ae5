//! The control socket of `cryptblk serve --control`: disks attached and detached at run time,
//! statistics, keyslot changes on an attached disk, concurrent clients, malformed requests;
//! through `cryptblk ctl` and raw JSON-RPC lines.
mod common;
use cryptblk_testutil::vhost_user as frontend;

use common::*;
use frontend::{pattern, Guest, S_OK};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

struct Daemon {
    process: ServeProcess,
    control: PathBuf,
}

impl Daemon {
    fn start(dir: &Path, extra: &[&str]) -> Daemon {
        let control = dir.join("ctl.sock");
        let mut args = vec!["--control", s(&control)];
        args.extend_from_slice(extra);
        let process = ServeProcess::start(&args, &control);
        Daemon { process, control }
    }

    fn ctl(&self, args: &[&str]) -> Out {
        ctl(&self.control, args)
    }

    /// `ctl` that must succeed; returns its JSON result.
    fn ctl_ok(&self, args: &[&str]) -> Value {
        ctl_json(&self.control, args)
    }

    /// SIGTERM; returns the exit code.
    fn stop(self) -> i32 {
        self.process.terminate()
    }
}

/// One JSON-RPC connection speaking raw lines.
struct Rpc {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
    next_id: u64,
}

impl Rpc {
    fn connect(path: &Path) -> Rpc {
        let stream = UnixStream::connect(path).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(60)))
            .unwrap();
        Rpc {
            reader: BufReader::new(stream.try_clone().unwrap()),
            writer: stream,
            next_id: 1,
        }
    }

    fn line(&mut self, line: &str) -> Value {
        self.writer.write_all(line.as_bytes()).unwrap();
        self.writer.write_all(b"\n").unwrap();
        let mut reply = String::new();
        self.reader.read_line(&mut reply).unwrap();
        serde_json::from_str(&reply).unwrap_or_else(|e| panic!("{e}: {reply:?}"))
    }

    /// Calls `method`; Ok(result) or Err(error object).
    fn call(&mut self, method: &str, params: Value) -> Result<Value, Value> {
        let id = self.next_id;
        self.next_id += 1;
        let reply = self.line(
            &json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params}).to_string(),
        );
        assert_eq!(reply["jsonrpc"], "2.0");
        assert_eq!(reply["id"], id);
        match reply.get("error") {
            Some(e) => Err(e.clone()),
            None => Ok(reply["result"].clone()),
        }
    }
}

fn raw_image(dir: &Path, name: &str, size: u64) -> PathBuf {
    let p = dir.join(name);
    std::fs::File::create(&p).unwrap().set_len(size).unwrap();
    p
}

fn luks2_image(dir: &Path, name: &str, key: &Path) -> PathBuf {
    let img = dir.join(name);
    format_luks2(&img, key, "8M");
    img
}

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
    let dir = tempdir();
    let key = key_file(dir.path(), "key", &passphrase("ctl"));
    let wrong = key_file(dir.path(), "wrong", &passphrase("ctl-wrong"));
    let new_key = key_file(dir.path(), "new", &passphrase("ctl-new"));
    let raw = raw_image(dir.path(), "a.raw", 4 * MIB);
    let luks = luks2_image(dir.path(), "c.luks", &key);
    let other_luks = luks2_image(dir.path(), "d.luks", &key);
    let daemon = Daemon::start(dir.path(), &[]);

    // Only the owner may talk to the daemon.
    let mode = std::fs::metadata(&daemon.control)
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600, "control socket mode {mode:o}");
    assert!(disk_names(&daemon.ctl_ok(&["disk-list"])).is_empty());

    let va = dir.path().join("a.sock");
    let added = daemon.ctl_ok(&[
        "disk-add",
        "a",
        "--image",
        s(&raw),
        "--vhost-user-blk",
        s(&va),
    ]);
    assert_eq!(added["name"], "a");
    assert_eq!(added["format"], "raw");
    let vc = dir.path().join("c.sock");
    let added = daemon.ctl_ok(&[
        "disk-add",
        "c",
        "--image",
        s(&luks),
        "--key-file",
        s(&key),
        "--vhost-user-blk",
        s(&vc),
    ]);
    assert_eq!(added["block-size"], 4096);
    assert!(added["engine"].is_string(), "{added}");

    // A wrong key fails that disk-add with the wrong-passphrase code; nothing else changes.
    let mut guest = Guest::connect(&va, 1, 256);
    let data = pattern(64 * 1024, 7);
    assert_eq!(guest.write(0, 0, &data), S_OK);
    let out = daemon.ctl(&[
        "disk-add",
        "c2",
        "--image",
        s(&other_luks),
        "--key-file",
        s(&wrong),
        "--vhost-user-blk",
        s(&dir.path().join("c2.sock")),
    ]);
    out.expect_code(code::WRONG_PASSPHRASE);
    out.error_line(&["passphrase"]);
    let mut rpc = Rpc::connect(&daemon.control);
    let err = rpc
        .call(
            "disk-add",
            json!({"name": "c3", "image": s(&other_luks), "key-file": s(&wrong),
                   "vhost-user-blk": s(&dir.path().join("c3.sock"))}),
        )
        .unwrap_err();
    assert_eq!(err["code"], -32002, "{err}");
    // The image of disk "c" is locked by it: a second attach is refused as in use.
    let err = rpc
        .call(
            "disk-add",
            json!({"name": "c4", "image": s(&luks), "key-file": s(&key),
                   "vhost-user-blk": s(&dir.path().join("c4.sock"))}),
        )
        .unwrap_err();
    assert_eq!(err["code"], -32006, "{err}");
    assert!(!dir.path().join("c4.sock").exists());
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
    daemon.ctl_ok(&[
        "disk-add",
        "a",
        "--image",
        s(&raw),
        "--vhost-user-blk",
        s(&va),
    ]);
    let mut guest = Guest::connect(&va, 1, 256);
    let (st, back) = guest.read(0, 0, data.len());
    assert_eq!(st, S_OK);
    assert_same_bytes(&back, &data, "disk a after re-attach");
    drop(guest);

    // Keyslots of an attached LUKS disk: add a passphrase, remove the old one.
    let cheap = ["--pbkdf", "pbkdf2", "--iter-time", "50"];
    let mut args = vec![
        "key-add",
        "c",
        "--key-file",
        s(&key),
        "--new-key-file",
        s(&new_key),
    ];
    args.extend(cheap);
    let r = daemon.ctl_ok(&args);
    assert!(r["keyslot"].is_u64(), "{r}");
    let mut args = vec![
        "key-add",
        "c",
        "--key-file",
        s(&wrong),
        "--new-key-file",
        s(&new_key),
    ];
    args.extend(cheap);
    let out = daemon.ctl(&args);
    assert_ne!(out.code, 0);
    daemon.ctl_ok(&["key-remove", "c", "--key-file", s(&key)]);
    // The last keyslot is never removed.
    let out = daemon.ctl(&["key-remove", "c", "--key-file", s(&new_key)]);
    assert_ne!(out.code, 0);
    assert!(out.stderr.contains("last"), "{}", out.stderr);

    assert_eq!(daemon.stop(), code::OK);
    assert!(
        !daemon_socket_exists(dir.path()),
        "sockets left after SIGTERM"
    );
    // Only the new passphrase opens the image now.
    assert!(cryptsetup_accepts(&luks, &new_key));
    assert!(!cryptsetup_accepts(&luks, &key));
}

fn daemon_socket_exists(dir: &Path) -> bool {
    ["ctl.sock", "a.sock", "c.sock"]
        .iter()
        .any(|n| dir.join(n).exists())
}

#[test]
fn malformed_requests_get_json_rpc_errors() {
    let dir = tempdir();
    let daemon = Daemon::start(dir.path(), &[]);
    let mut rpc = Rpc::connect(&daemon.control);
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
                                "vhost-user-blk": s(&dir.path().join("x.sock"))}),
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
    let precious = dir.path().join("precious.raw");
    std::fs::write(&precious, b"keep me").unwrap();
    let img = raw_image(dir.path(), "x.raw", MIB);
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
    assert_eq!(daemon.stop(), code::OK);
}

/// Several clients attach and detach disks at once while a VM-like client keeps doing
/// verified I/O on another disk: every control request succeeds, and the I/O never fails or
/// stalls behind them.
#[test]
fn concurrent_control_clients_while_io_runs() {
    let dir = tempdir();
    let steady = raw_image(dir.path(), "steady.raw", 8 * MIB);
    let vs = dir.path().join("steady.sock");
    let daemon = Daemon::start(
        dir.path(),
        &[
            "--image",
            s(&steady),
            "--name",
            "steady",
            "--vhost-user-blk",
            s(&vs),
        ],
    );
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
                .map(|r| raw_image(dir.path(), &format!("d{c}-{r}.raw"), MIB))
                .collect()
        })
        .collect();
    let clients: Vec<_> = images
        .into_iter()
        .enumerate()
        .map(|(c, imgs)| {
            let control = daemon.control.clone();
            let dir = dir.path().to_path_buf();
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
    assert_eq!(daemon.stop(), code::OK);
}
