//! Crash safety of `cryptblk serve`'s writes: the daemon is killed with SIGKILL in the middle
//! of writes over NBD (raw and LUKS2 images) and restarted on the same image. Every write
//! acknowledged as durable (a FUA write that completed, or a write covered by a completed
//! FLUSH sent after it completed) is still there after the restart, and every block holds a
//! complete record of some generation that was actually sent. (Keyslot changes killed midway:
//! `crash_keyslots.rs`.)
//!
//! Every test prints its seed and timings; `CRYPTBLK_CRASH_SEED=N` replays a run.
//! The NBD test client is checked against `qemu-nbd` first.
mod common;

use common::crash::*;
use common::*;
use cryptblk_nbd::protocol as nbd_protocol;
use cryptblk_testutil::nbd::{NbdClient, NbdError};
use rand::rngs::StdRng;
use rand::{Rng, RngCore, SeedableRng};
use std::collections::HashMap;
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

/// The checker itself: the failures the crash test looks for are recognised.
#[test]
fn block_checker_rejects_lost_torn_and_foreign_blocks() {
    let r5 = record(9, 5);
    assert_eq!(decode(&r5), Ok((9, 5)));
    assert!(check_block(&r5, 9, Some(5), Some(6)).is_ok());
    assert!(check_block(&r5, 9, Some(4), Some(5)).is_ok());
    // An acknowledged write lost: the block holds an older generation.
    let e = check_block(&r5, 9, Some(6), Some(7)).unwrap_err();
    assert!(e.contains("acknowledged write was lost"), "{e}");
    // A generation never sent.
    assert!(check_block(&r5, 9, Some(3), Some(4)).is_err());
    // Another block's record (misdirected write).
    assert!(check_block(&record(10, 5), 9, Some(5), Some(5)).is_err());
    // Torn: the first half of generation 6 over generation 5.
    let mut torn = r5.clone();
    torn[..BLOCK / 2].copy_from_slice(&record(9, 6)[..BLOCK / 2]);
    assert!(check_block(&torn, 9, Some(5), Some(6))
        .unwrap_err()
        .contains("torn"));
    // A flipped byte in the fill.
    let mut flipped = r5.clone();
    flipped[1000] ^= 1;
    assert!(check_block(&flipped, 9, Some(5), Some(5)).is_err());
    // Zeros: fine only while nothing was acknowledged.
    let zeros = vec![0u8; BLOCK];
    assert!(check_block(&zeros, 9, None, Some(3)).is_ok());
    assert!(check_block(&zeros, 9, None, None).is_ok());
    assert!(check_block(&zeros, 9, Some(1), Some(3)).is_err());
    // Garbage (an unwritten LUKS block) is never a record.
    let mut garbage = vec![0u8; BLOCK];
    StdRng::seed_from_u64(1).fill_bytes(&mut garbage);
    assert!(check_block(&garbage, 9, None, None).is_err());
}

// ---------------------------------------------------------------------------------------------
// The NBD client against qemu-nbd
// ---------------------------------------------------------------------------------------------

/// The test client speaks NBD correctly: checked against qemu-nbd, the reference server.
#[test]
fn nbd_client_against_qemu_nbd() {
    let t = TestDir::new();
    let img = t.raw("q.raw", 4 * MIB);
    let sock = t.path("q.sock");
    let mut cmd = Command::new(cryptblk_testutil::tool("qemu-nbd"));
    cmd.arg(format!("--socket={}", s(&sock)))
        .args(argv!("-f raw -x disk --persistent --shared=8 {}", img));
    let mut qemu = Process::spawn(cmd, t.path("qemu-nbd.log"));
    qemu.wait_for_socket(&sock);

    // An unknown export is refused with NBD_REP_ERR_UNKNOWN.
    match NbdClient::connect(&sock, "nope") {
        Err(NbdError::OptionRejected { option, reply, .. }) => {
            assert_eq!(option, nbd_protocol::OPT_GO);
            assert_eq!(
                reply,
                nbd_protocol::REP_ERR_UNKNOWN,
                "{}",
                NbdError::rep_err_name(reply)
            );
        }
        other => panic!("export \"nope\": expected NBD_REP_ERR_UNKNOWN, got {other:?}"),
    }

    let mut c = NbdClient::connect(&sock, "disk").unwrap();
    eprintln!("qemu-nbd export: {:?}", c.export);
    assert_eq!(c.export.size, 4 * MIB);
    for flag in [
        nbd_protocol::TFLAG_SEND_FLUSH,
        nbd_protocol::TFLAG_SEND_FUA,
        nbd_protocol::TFLAG_CAN_MULTI_CONN,
    ] {
        assert!(c.export.has(flag), "flag {flag:#x} missing: {:?}", c.export);
    }
    assert!(!c.export.has(nbd_protocol::TFLAG_READ_ONLY));

    // Pipelined writes (some FUA), a flush, pipelined reads; replies matched by handle.
    let mut sent = HashMap::new();
    for i in 0..32u64 {
        let data = record(i, 7);
        c.send_write(100 + i, i * BLOCK as u64 * 3, &data, i % 2 == 0)
            .unwrap();
        sent.insert(100 + i, data);
    }
    let mut acked = 0;
    while c.in_flight() > 0 {
        let (h, err, data) = c.recv_reply().unwrap();
        assert!(sent.contains_key(&h), "reply to unknown handle {h}");
        assert_eq!(err, 0);
        assert!(data.is_none());
        acked += 1;
    }
    assert_eq!(acked, 32);
    c.flush().unwrap();
    for i in 0..32u64 {
        c.send_read(500 + i, i * BLOCK as u64 * 3, BLOCK as u32)
            .unwrap();
    }
    let mut seen = 0;
    while c.in_flight() > 0 {
        let (h, err, data) = c.recv_reply().unwrap();
        assert_eq!(err, 0);
        let i = h - 500;
        assert_eq!(decode(&data.expect("read data")).unwrap(), (i, 7));
        seen += 1;
    }
    assert_eq!(seen, 32);
    // A read reply of a different length than the next one: lengths are kept per handle.
    c.send_read(1, 0, 512).unwrap();
    c.send_read(2, 0, 8192).unwrap();
    let (h1, _, d1) = c.recv_reply().unwrap();
    let (h2, _, d2) = c.recv_reply().unwrap();
    let lens: HashMap<u64, usize> = [(h1, d1.unwrap().len()), (h2, d2.unwrap().len())].into();
    assert_eq!(lens, HashMap::from([(1, 512), (2, 8192)]));
    // The client refuses what the export forbids instead of sending it.
    assert!(matches!(
        c.send_read(3, 4 * MIB, 512),
        Err(NbdError::Protocol(_))
    ));
    assert!(matches!(c.send_read(4, 0, 0), Err(NbdError::Protocol(_))));
    assert_eq!(c.in_flight(), 0);
    let whole = c.read_range(0, 4 * MIB, 64 * 1024, 8).unwrap();
    assert_same_bytes(&whole, &read(&img), "qemu-nbd export vs image file");
    c.disconnect().unwrap();
    // A second connection sees the same data (and qemu-nbd is still there: --persistent).
    let mut c2 = NbdClient::connect(&sock, "disk").unwrap();
    assert_eq!(
        decode(&c2.read(3 * 3 * BLOCK as u64, BLOCK as u32).unwrap()).unwrap(),
        (3, 7)
    );
    c2.disconnect().unwrap();
    qemu.terminate();
}

// ---------------------------------------------------------------------------------------------
// Acknowledged writes survive SIGKILL
// ---------------------------------------------------------------------------------------------

const CONNECTIONS: usize = 4;
const DEPTH: usize = 8;
const FLUSH_EVERY: usize = 16;

#[derive(Debug, Clone, Copy)]
enum Op {
    Write { idx: usize, generation: u64 },
    Flush,
}

/// What one writer connection did.
#[derive(Debug, Default)]
struct WriterReport {
    conn: usize,
    fua: bool,
    /// Global block numbers of this connection's blocks.
    blocks: Vec<u64>,
    last_acked: Vec<Option<u64>>,
    highest_sent: Vec<Option<u64>>,
    writes_sent: u64,
    writes_completed: u64,
    writes_acked: u64,
    flushes_completed: u64,
    /// How the run ended (normally: the connection broke when the daemon was killed).
    ended: String,
    /// Time from the start barrier to the end.
    ran_for: Duration,
    failure: Option<String>,
}

fn writer(
    mut client: NbdClient,
    mut report: WriterReport,
    seed: u64,
    start: Arc<Barrier>,
    acked_counter: Arc<AtomicU64>,
) -> WriterReport {
    let mut rng = StdRng::seed_from_u64(seed);
    let n = report.blocks.len();
    let mut in_flight_block = vec![false; n];
    let mut ops: HashMap<u64, Op> = HashMap::new();
    let mut writes_in_flight = 0usize;
    let mut flush_in_flight = false;
    let mut since_flush = 0usize;
    // Writes completed but not yet covered by a flush sent after their completion.
    let mut unflushed: Vec<(usize, u64)> = Vec::new();
    // The writes the flush in flight covers.
    let mut flush_covers: Vec<(usize, u64)> = Vec::new();
    let mut next_handle = (report.conn as u64) << 40;
    start.wait();
    let started = Instant::now();
    let give_up = started + Duration::from_secs(20);
    let end = |report: &mut WriterReport, why: String| {
        report.ended = why;
        report.ran_for = started.elapsed();
    };
    loop {
        if Instant::now() > give_up {
            report.failure = Some("the connection was still working 20 s after the start".into());
            end(&mut report, "timeout".into());
            return report;
        }
        // Fill the pipeline.
        let mut send_error = None;
        while writes_in_flight < DEPTH && send_error.is_none() {
            if !report.fua && since_flush >= FLUSH_EVERY && !flush_in_flight {
                next_handle += 1;
                if let Err(e) = client.send_flush(next_handle) {
                    send_error = Some(e);
                    break;
                }
                ops.insert(next_handle, Op::Flush);
                flush_in_flight = true;
                flush_covers = std::mem::take(&mut unflushed);
                since_flush = 0;
            }
            let mut idx = rng.gen_range(0..n);
            while in_flight_block[idx] {
                idx = (idx + 1) % n;
            }
            let generation = report.highest_sent[idx].map_or(1, |g| g + 1);
            let data = record(report.blocks[idx], generation);
            next_handle += 1;
            let offset = report.blocks[idx] * BLOCK as u64;
            if let Err(e) = client.send_write(next_handle, offset, &data, report.fua) {
                send_error = Some(e);
                break;
            }
            // Sent (possibly partly): from now on the block may hold this generation.
            report.highest_sent[idx] = Some(generation);
            report.writes_sent += 1;
            ops.insert(next_handle, Op::Write { idx, generation });
            in_flight_block[idx] = true;
            writes_in_flight += 1;
            since_flush += 1;
        }
        if let Some(e) = send_error {
            if e.is_disconnect() {
                end(&mut report, format!("send: {e}"));
            } else {
                report.failure = Some(format!("sending a request: {e}"));
                end(&mut report, "send error".into());
            }
            return report;
        }
        let (handle, error, _) = match client.recv_reply() {
            Ok(r) => r,
            Err(e) => {
                if e.is_disconnect() {
                    end(&mut report, format!("receive: {e}"));
                } else {
                    report.failure = Some(format!("receiving a reply: {e}"));
                    end(&mut report, "receive error".into());
                }
                return report;
            }
        };
        let op = ops.remove(&handle).expect("the client checks handles");
        if error != 0 {
            report.failure = Some(format!("{op:?} failed with NBD error {error}"));
            end(&mut report, "error reply".into());
            return report;
        }
        match op {
            Op::Write { idx, generation } => {
                in_flight_block[idx] = false;
                writes_in_flight -= 1;
                report.writes_completed += 1;
                if report.fua {
                    let acked = &mut report.last_acked[idx];
                    *acked = Some(acked.map_or(generation, |a| a.max(generation)));
                    report.writes_acked += 1;
                    acked_counter.fetch_add(1, Ordering::Relaxed);
                } else {
                    unflushed.push((idx, generation));
                }
            }
            Op::Flush => {
                flush_in_flight = false;
                report.flushes_completed += 1;
                for (idx, generation) in std::mem::take(&mut flush_covers) {
                    let acked = &mut report.last_acked[idx];
                    *acked = Some(acked.map_or(generation, |a| a.max(generation)));
                    report.writes_acked += 1;
                    acked_counter.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }
}

/// Checks one block read back after the restart against what its writer recorded.
fn check_block(
    data: &[u8],
    block: u64,
    last_acked: Option<u64>,
    highest_sent: Option<u64>,
) -> Result<(), String> {
    match decode(data) {
        Ok((b, g)) => {
            if b != block {
                return Err(format!("holds the record of block {b} (generation {g})"));
            }
            if last_acked.is_some_and(|a| g < a) {
                return Err(format!(
                    "generation {g} is older than the last acknowledged {} (highest sent {:?}): \
                     an acknowledged write was lost",
                    last_acked.unwrap(),
                    highest_sent
                ));
            }
            if highest_sent.is_none_or(|h| g > h) {
                return Err(format!(
                    "generation {g} was never sent (highest sent {highest_sent:?})"
                ));
            }
            Ok(())
        }
        Err(why) if why == "all zeros" && last_acked.is_none() => Ok(()),
        Err(why) => Err(format!(
            "{why} (last acknowledged {last_acked:?}, highest sent {highest_sent:?})"
        )),
    }
}

fn crash_writes(kind: &str, cache: &str, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed ^ fnv1a(kind.as_bytes()) ^ fnv1a(cache.as_bytes()));
    let t = TestDir::new();
    let img = if kind == "luks2" {
        t.luks2("disk.luks", "4M", &t.key("key"))
    } else {
        t.raw("disk.raw", 4 * MIB)
    };
    let name = "crashdisk";
    let serve = t.serve().disk(&img).name(name).nbd();
    let mut daemon = serve.args(&["--cache", cache]).start();

    let mut first = daemon.nbd(name);
    let export = first.export.clone();
    eprintln!("[{kind}] export {export:?}");
    assert!(
        export.has(nbd_protocol::TFLAG_SEND_FLUSH),
        "no FLUSH: {export:?}"
    );
    assert!(
        export.has(nbd_protocol::TFLAG_SEND_FUA),
        "no FUA: {export:?}"
    );
    assert!(!export.has(nbd_protocol::TFLAG_READ_ONLY));
    assert_eq!(export.size % BLOCK as u64, 0);
    assert!(
        (BLOCK as u32).is_multiple_of(export.min_block()),
        "{export:?}"
    );
    if kind == "luks2" {
        assert_eq!(
            export.min_block(),
            4096,
            "LUKS2 with 4096-byte sectors: {export:?}"
        );
    }
    let blocks = export.size / BLOCK as u64;
    let per_conn = blocks / CONNECTIONS as u64;
    assert!(
        per_conn >= 64,
        "export of {} bytes is too small",
        export.size
    );

    // LUKS: an unwritten block decrypts to garbage, so every block starts as a generation 0
    // record, written and flushed through NBD.
    let prefilled = kind == "luks2";
    if prefilled {
        let t = Instant::now();
        let mut next = 0u64;
        while next < blocks || first.in_flight() > 0 {
            while next < blocks && first.in_flight() < 16 {
                first
                    .send_write(next, next * BLOCK as u64, &record(next, 0), false)
                    .unwrap();
                next += 1;
            }
            let (h, err, _) = first.recv_reply().unwrap();
            assert_eq!(err, 0, "pre-fill write of block {h} failed");
        }
        first.flush().unwrap();
        eprintln!("[{kind}] pre-filled {blocks} blocks in {:?}", t.elapsed());
    }
    first.disconnect().unwrap();

    // The writers: connection c owns blocks [c*per_conn, (c+1)*per_conn); even ones use FUA,
    // odd ones FLUSH every 16 writes.
    let start = Arc::new(Barrier::new(CONNECTIONS + 1));
    // Writes acknowledged so far, per connection.
    let acked: Vec<Arc<AtomicU64>> = (0..CONNECTIONS)
        .map(|_| Arc::new(AtomicU64::new(0)))
        .collect();
    let threads: Vec<_> = (0..CONNECTIONS)
        .map(|c| {
            let client = daemon.nbd(name);
            let blocks: Vec<u64> = (c as u64 * per_conn..(c as u64 + 1) * per_conn).collect();
            let initial = prefilled.then_some(0);
            let report = WriterReport {
                conn: c,
                fua: c % 2 == 0,
                last_acked: vec![initial; blocks.len()],
                highest_sent: vec![initial; blocks.len()],
                blocks,
                ..Default::default()
            };
            let (start, wseed, counter) = (start.clone(), rng.next_u64(), acked[c].clone());
            std::thread::spawn(move || writer(client, report, wseed, start, counter))
        })
        .collect();
    let delay = Duration::from_millis(rng.gen_range(200..=1500));
    start.wait();
    let t0 = Instant::now();
    std::thread::sleep(delay);
    // Not vacuous even on a slow, loaded machine: every connection has had a write
    // acknowledged before the kill (this only waits when the machine is very slow).
    let deadline = Instant::now() + Duration::from_secs(20);
    while acked.iter().any(|a| a.load(Ordering::Relaxed) == 0) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    let killed_at = t0.elapsed();
    daemon.kill9();
    let reports: Vec<WriterReport> = threads
        .into_iter()
        .map(|t| t.join().expect("a writer thread panicked"))
        .collect();
    let summary: String = reports
        .iter()
        .map(|r| {
            format!(
                "  conn {} ({}): sent {} completed {} acknowledged {} flushes {} ran {:?}, ended: {}{}\n",
                r.conn,
                if r.fua { "FUA" } else { "FLUSH" },
                r.writes_sent,
                r.writes_completed,
                r.writes_acked,
                r.flushes_completed,
                r.ran_for,
                r.ended,
                r.failure.as_deref().map(|f| format!(" FAILURE: {f}")).unwrap_or_default()
            )
        })
        .collect();
    let context = format!(
        "[{kind}] seed {seed}: SIGKILL {killed_at:?} after the writers started (planned {delay:?})\n{summary}"
    );
    eprintln!("{context}");
    for r in &reports {
        assert!(
            r.failure.is_none(),
            "a writer failed before the kill\n{context}"
        );
    }
    let fua_acked: u64 = reports
        .iter()
        .filter(|r| r.fua)
        .map(|r| r.writes_acked)
        .sum();
    let flush_acked: u64 = reports
        .iter()
        .filter(|r| !r.fua)
        .map(|r| r.writes_acked)
        .sum();
    assert!(
        fua_acked > 0,
        "no FUA write was acknowledged before the kill\n{context}"
    );
    assert!(
        flush_acked > 0,
        "no flushed write was acknowledged before the kill\n{context}"
    );
    for r in &reports {
        assert!(
            r.writes_acked > 0,
            "connection {} had no write acknowledged before the kill\n{context}",
            r.conn
        );
    }

    // Restart on the same image and read every block back.
    daemon.restart();
    let mut reader = daemon.nbd(name);
    assert_eq!(reader.export.size, export.size);
    let data = reader
        .read_range(0, export.size, 64 * 1024, 8)
        .unwrap_or_else(|e| panic!("reading back after the restart: {e}\n{context}"));
    reader.disconnect().unwrap();
    let mut bad = Vec::new();
    let mut checked = 0u64;
    let mut newer_than_acked = 0u64;
    for r in &reports {
        for (i, &block) in r.blocks.iter().enumerate() {
            let at = block as usize * BLOCK;
            let got = &data[at..at + BLOCK];
            checked += 1;
            if let Err(why) = check_block(got, block, r.last_acked[i], r.highest_sent[i]) {
                bad.push(format!("  block {block} (conn {}): {why}", r.conn));
            } else if let Ok((_, g)) = decode(got) {
                if r.last_acked[i].is_none_or(|a| g > a) {
                    newer_than_acked += 1;
                }
            }
        }
    }
    // Blocks beyond the writers' ranges (when the size is not a multiple) are not checked.
    assert_eq!(checked, per_conn * CONNECTIONS as u64);
    assert!(
        bad.is_empty(),
        "{} of {checked} blocks are wrong after SIGKILL and restart:\n{}\n{context}\n--- first serve log\n{}",
        bad.len(),
        bad.iter().take(30).cloned().collect::<Vec<_>>().join("\n"),
        std::fs::read_to_string(t.path("serve-0.log")).unwrap_or_default()
    );
    eprintln!(
        "[{kind}] all {checked} blocks hold a record at least as new as acknowledged \
         ({newer_than_acked} newer than acknowledged)"
    );
    assert_eq!(daemon.terminate(), code::OK);

    // The same bytes through an independent path: the image file itself, or cryptblk convert.
    match &img.key {
        None => {
            let file = read(&img);
            assert_same_bytes(
                &file[..data.len()],
                &data,
                "raw image file vs NBD read-back",
            );
        }
        Some(_) => {
            let plain = img.decrypt(&t.path("plain.raw"));
            assert_same_bytes(
                &plain[..data.len()],
                &data,
                "cryptblk convert vs NBD read-back",
            );
        }
    }
}

/// Writes acknowledged over NBD (FUA, or completed before a FLUSH that completed) survive a
/// SIGKILL of the daemon, for a raw and a LUKS2 image, in every cache mode (with `none` the
/// image bypasses the page cache, so what is acknowledged went through io_uring straight to
/// the device); no block is torn or from the future.
#[test]
fn acknowledged_writes_survive_kill_9() {
    let seed = seed_for("acknowledged_writes_survive_kill_9");
    for cache in ["none", "writeback", "writethrough", "directsync", "unsafe"] {
        for kind in ["raw", "luks2"] {
            eprintln!("[{kind}] cache={cache}");
            crash_writes(kind, cache, seed);
        }
    }
}
