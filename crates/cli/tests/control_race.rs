//! Control requests racing on one disk never hang the daemon: several clients fire
//! `migrate-start` (at a destination that answers, one that never answers, one that hangs up
//! and one that is not there), `migrate-cancel`, `key-add`, `key-remove` and
//! `disk-remove`/`disk-add` for hundreds of rounds. Every call must be answered within a
//! bound (an error is fine: "busy" is the expected answer to most collisions); a call that is
//! not, or a daemon that no longer answers or stops on SIGTERM, fails the test.
//!
//! Before the fix of issue 13 this hung: `migrate-start` held the disk's migration lock
//! across the connect and the handshake (which had no timeout) and then took the header lock,
//! while `key-add` took the header lock and then the migration lock.
mod common;

use common::*;
use cryptblk_control::Client;
use cryptblk_migration::wire::{read_frame, write_frame, Frame};
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use std::net::TcpListener;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const CLIENTS: usize = 4;
const ROUNDS_PER_CLIENT: usize = 100;
/// Longest any one request may take: a start to a silent peer gives up after its connect
/// timeout (twice, with preempt), a cancel or remove waits for that and for the sender to
/// stop. Far above what any answer needs; only a hang reaches it.
const CALL_BOUND: Duration = Duration::from_secs(30);
const CONNECT_TIMEOUT_MS: u64 = 300;

/// A destination that answers the hello and swallows whatever comes after, until told to
/// stop: migrations to it run (precopy) until cancelled.
fn sink_destination(stop: Arc<AtomicBool>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = format!("tcp:{}", listener.local_addr().unwrap());
    listener.set_nonblocking(true).unwrap();
    std::thread::spawn(move || {
        while !stop.load(Ordering::Relaxed) {
            let Ok((mut socket, _)) = listener.accept() else {
                std::thread::sleep(Duration::from_millis(5));
                continue;
            };
            socket.set_nonblocking(false).unwrap();
            std::thread::spawn(move || {
                let _ = socket.set_read_timeout(Some(Duration::from_secs(60)));
                if let Ok(Frame::Hello(hello)) = read_frame(&mut socket) {
                    if write_frame(&mut socket, &Frame::Hello(hello)).is_ok() {
                        let _ = std::io::copy(&mut socket, &mut std::io::sink());
                    }
                }
            });
        }
    });
    addr
}

/// Accepts and hangs up after a moment, before any hello.
fn hang_up_destination(stop: Arc<AtomicBool>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = format!("tcp:{}", listener.local_addr().unwrap());
    listener.set_nonblocking(true).unwrap();
    std::thread::spawn(move || {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        while !stop.load(Ordering::Relaxed) {
            match listener.accept() {
                Ok((socket, _)) => {
                    std::thread::sleep(Duration::from_millis(rng.gen_range(0..30)));
                    drop(socket);
                }
                Err(_) => std::thread::sleep(Duration::from_millis(5)),
            }
        }
    });
    addr
}

struct Setup {
    control: PathBuf,
    image: PathBuf,
    key: PathBuf,
    key2: PathBuf,
    destinations: Vec<String>,
}

fn disk_add(client: &mut Client, setup: &Setup) -> Result<Value, cryptblk_control::ClientError> {
    client.call(
        "disk-add",
        json!({"name": "vol", "image": setup.image, "key-file": setup.key, "nbd-export": false,
               "vhost-user-blk": setup.control.with_extension("vhost")}),
    )
}

/// One client's rounds; panics on a call that is not answered within the bound.
fn client_rounds(setup: &Setup, seed: u64) -> Vec<String> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut client = Client::connect(&setup.control).unwrap();
    client.set_timeout(Some(CALL_BOUND)).unwrap();
    let mut answers = Vec::new();
    for round in 0..ROUNDS_PER_CLIENT {
        let (method, params) = match rng.gen_range(0..20) {
            0..=5 => {
                let to = &setup.destinations[rng.gen_range(0..setup.destinations.len())];
                let postcopy = rng.gen_bool(0.5);
                (
                    "migrate-start",
                    json!({"name": "vol", "to": to, "postcopy": postcopy,
                           "preempt": postcopy && rng.gen_bool(0.5),
                           "connect-timeout": CONNECT_TIMEOUT_MS}),
                )
            }
            6..=9 => ("migrate-cancel", json!({"name": "vol"})),
            10..=12 => (
                "key-add",
                json!({"name": "vol", "key-file": setup.key, "new-key-file": setup.key2,
                       "pbkdf": "pbkdf2", "iter-time": 1}),
            ),
            13..=15 => ("key-remove", json!({"name": "vol", "key-file": setup.key2})),
            16..=18 => ("migrate-status", json!({"name": "vol"})),
            _ => ("disk-remove", json!({"name": "vol", "force": true})),
        };
        let started = Instant::now();
        let answer = client.call(method, params);
        let took = started.elapsed();
        let outcome = match &answer {
            Ok(_) => "ok".to_string(),
            Err(cryptblk_control::ClientError::Rpc(e)) => format!("error {}", e.code),
            Err(e) => panic!(
                "client {seed} round {round}: {method} got no answer after {took:?} \
                 (the daemon hangs): {e}"
            ),
        };
        answers.push(format!("{method}: {outcome}"));
        // A removed disk comes back, so the others have something to race on. (Right after
        // a removal the image may still be held by a request that was under way, and the
        // add answers "in use"; a later round tries again.)
        let gone = match &answer {
            Ok(_) => method == "disk-remove",
            Err(cryptblk_control::ClientError::Rpc(e)) => e.code == -32010,
            Err(_) => false,
        };
        if gone {
            let added = disk_add(&mut client, setup);
            let outcome = match &added {
                Ok(_) => "ok".to_string(),
                Err(cryptblk_control::ClientError::Rpc(e)) => format!("error {}", e.code),
                Err(e) => panic!("client {seed} round {round}: disk-add got no answer: {e}"),
            };
            answers.push(format!("disk-add: {outcome}"));
        }
    }
    answers
}

#[test]
fn racing_control_requests_never_hang() {
    let t = TestDir::new();
    let key = t.key("key");
    let key2 = t.key("key2");
    let image = t.luks2("vol.luks", "4M", &key).path;
    let mut daemon = t.serve().control().start();
    let control = daemon.control().to_path_buf();
    let stop = Arc::new(AtomicBool::new(false));
    // Accepts into the backlog and never answers.
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let setup = Setup {
        destinations: vec![
            sink_destination(stop.clone()),
            format!("tcp:{}", silent.local_addr().unwrap()),
            hang_up_destination(stop.clone()),
            format!("unix:{}", t.path("nobody.sock").display()),
        ],
        control: control.clone(),
        image,
        key: key.path,
        key2: key2.path,
    };
    disk_add(&mut Client::connect(&control).unwrap(), &setup).unwrap();

    let started = Instant::now();
    let answers: Vec<Vec<String>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..CLIENTS)
            .map(|c| {
                let setup = &setup;
                scope.spawn(move || client_rounds(setup, 1000 + c as u64))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let took = started.elapsed();

    eprintln!(
        "{} requests in {took:?}",
        answers.iter().map(Vec::len).sum::<usize>()
    );
    for method in [
        "migrate-start",
        "migrate-cancel",
        "key-add",
        "key-remove",
        "disk-remove",
    ] {
        let n = answers
            .iter()
            .flatten()
            .filter(|a| a.starts_with(&format!("{method}:")))
            .count();
        assert!(n >= 10, "only {n} {method} requests were made");
    }

    // Still answering; whatever the rounds left running lets go of the image soon, so the
    // disk can be attached (again), and it stops cleanly.
    let mut client = Client::connect(&control).unwrap();
    client.set_timeout(Some(CALL_BOUND)).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match disk_add(&mut client, &setup) {
            Ok(_) => break,
            Err(cryptblk_control::ClientError::Rpc(e)) if e.code == -32011 => break,
            Err(e) => assert!(
                Instant::now() < deadline,
                "the disk cannot be attached: {e}"
            ),
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let t = Instant::now();
    client.call("migrate-cancel", json!({"name": "vol"})).ok();
    client
        .call("disk-remove", json!({"name": "vol", "force": true}))
        .unwrap();
    disk_add(&mut client, &setup).unwrap_or_else(|e| {
        panic!(
            "disk-add right after disk-remove ({:?} later): {e}",
            t.elapsed()
        )
    });
    // Nothing is left half-done: every verb works again.
    client
        .call(
            "key-add",
            json!({"name": "vol", "key-file": setup.key, "new-key-file": setup.key2,
                   "pbkdf": "pbkdf2", "iter-time": 1}),
        )
        .unwrap();
    client
        .call("key-remove", json!({"name": "vol", "key-file": setup.key2}))
        .unwrap();
    let started = client
        .call(
            "migrate-start",
            json!({"name": "vol", "to": setup.destinations[0], "connect-timeout": 5000}),
        )
        .unwrap();
    assert_eq!(started["phase"], "precopy", "{started}");
    let cancelled = client
        .call("migrate-cancel", json!({"name": "vol"}))
        .unwrap();
    assert_eq!(cancelled["phase"], "cancelled", "{cancelled}");
    client.call("stats", json!({})).unwrap();
    client.call("disk-list", json!({})).unwrap();
    drop(client);
    assert_eq!(daemon.terminate(), 0);
    stop.store(true, Ordering::Relaxed);
    drop(silent);
}
