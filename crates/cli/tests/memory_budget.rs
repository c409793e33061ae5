//! One memory budget for the whole daemon (`--memory-budget`, `memory-budget` in a config
//! file): many queues that each fill up with the largest writes make the daemon hold at most
//! the budget (plus its buffer cache and a small fixed part), not queues x their own bound; no
//! request fails; and what the burst took goes back to the system within seconds once the
//! queues are idle.
mod common;

use common::frontend::{Guest, S_OK};
use common::*;
use std::time::{Duration, Instant};

const BUDGET_MIB: u64 = 64;
/// What the buffer cache keeps under a 64 MiB budget (an eighth of it).
const CACHE_MIB: u64 = 8;
/// Room for what is not request data: thread stacks, rings, slot tables, allocator slack.
const FIXED_MIB: u64 = 24;

/// A field of /proc/PID/status, in KiB.
fn status_kib(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
}

/// Starts counting the peak resident set (VmHWM) from the current one.
fn reset_peak(pid: u32) {
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5").unwrap();
}

/// Waits until the daemon's private memory is back within `slack_mib` of `idle_kib`; returns
/// how long that took, or fails with the figure after `limit`.
fn wait_for_give_back(pid: u32, idle_kib: u64, slack_mib: u64, limit: Duration) -> Duration {
    let start = Instant::now();
    loop {
        let anon = status_kib(pid, "RssAnon:");
        if anon <= idle_kib + slack_mib * 1024 {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < limit,
            "{} s after the burst the daemon still holds {} MiB of private memory, {} MiB idle",
            limit.as_secs(),
            anon / 1024,
            idle_kib / 1024
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Eight disks, one queue each, every queue filled with 64 writes of almost 4 MiB (aliased
/// descriptors over 16 KiB of guest memory): 254 MiB of ciphertext at once without a
/// daemon-wide budget (each queue's own bound is 32 MiB), at most 64 MiB with one.
#[test]
fn busy_vhost_queues_share_one_budget_and_give_it_back() {
    const DISKS: usize = 8;
    const SEG: u32 = 16 << 10;
    const SEGS: usize = 254;
    const REQUESTS: usize = 64;
    let t = TestDir::new();
    let mut config = format!("memory-budget = \"{BUDGET_MIB}M\"\n");
    let mut sockets = Vec::new();
    for d in 0..DISKS {
        let image = t.luks2(&format!("d{d}.luks"), "64M", &t.key(&format!("d{d}.key")));
        let sock = t.path(&format!("d{d}.sock"));
        config.push_str(&format!(
            "[[disk]]\nname = \"d{d}\"\nimage = \"{}\"\nkey-file = \"{}\"\nvhost-user-blk = \"{}\"\n",
            s(&image.path),
            s(image.key()),
            s(&sock)
        ));
        sockets.push(sock);
    }
    std::fs::write(t.path("disks.toml"), config).unwrap();
    let mut daemon = t.serve().config(&t.path("disks.toml")).start();
    let pid = daemon.pid();
    let mut guests: Vec<Guest> = sockets.iter().map(|s| Guest::connect(s, 1, 256)).collect();
    let mut statuses = Vec::new();
    for guest in &mut guests {
        let data = guest.alloc(0, SEG);
        let mut mine = Vec::new();
        for r in 0..REQUESTS {
            let sector = ((r % 8) * SEGS * SEG as usize / 512) as u64;
            mine.push(guest.publish_aliased_write(0, sector, data, SEGS, SEG));
        }
        statuses.push(mine);
    }
    let idle_kib = status_kib(pid, "RssAnon:");
    let before_kib = status_kib(pid, "VmRSS:");
    reset_peak(pid);
    for guest in &guests {
        guest.kick(0);
    }
    for (d, guest) in guests.iter_mut().enumerate() {
        guest.wait_used(0, REQUESTS);
        for (r, status) in statuses[d].iter().enumerate() {
            assert_eq!(guest.status(*status), S_OK, "disk d{d}, write {r}");
        }
    }
    let grown_mib = (status_kib(pid, "VmHWM:") - before_kib) / 1024;
    eprintln!(
        "{DISKS} queues x {REQUESTS} writes of {} KiB: peak RSS {grown_mib} MiB over {} MiB",
        SEGS as u32 * SEG / 1024,
        before_kib / 1024
    );
    assert!(
        grown_mib <= BUDGET_MIB + CACHE_MIB + FIXED_MIB,
        "the daemon's peak RSS grew by {grown_mib} MiB: more than the {BUDGET_MIB} MiB budget, \
         its {CACHE_MIB} MiB cache and {FIXED_MIB} MiB of fixed costs"
    );
    // The guests stay connected, their queues idle: the buffers go back all the same.
    let took = wait_for_give_back(pid, idle_kib, 8, Duration::from_secs(10));
    eprintln!("private memory back within 8 MiB of idle after {took:?}");
    drop(guests);
    assert_eq!(daemon.terminate(), code::OK);
}

/// Six NBD connections, each keeping four 16 MiB writes in flight (what one connection may
/// hold is 64 MiB of payloads, and as much again in ciphertext): they wait for the budget in
/// turn, every write succeeds, and the daemon stays within the budget.
#[test]
fn nbd_connections_wait_for_the_budget_and_all_writes_succeed() {
    const CONNECTIONS: usize = 6;
    const WRITES: usize = 12;
    const WINDOW: usize = 4;
    const LEN: usize = 16 << 20;
    let t = TestDir::new();
    let image = t.luks2("nbd.luks", "64M", &t.key("nbd.key"));
    let mut daemon = t
        .serve()
        .disk(&image)
        .name("nbd")
        .nbd()
        .args(&["--memory-budget", &format!("{BUDGET_MIB}M")])
        .start();
    let pid = daemon.pid();
    let clients: Vec<NbdClient> = (0..CONNECTIONS).map(|_| daemon.nbd("nbd")).collect();
    let idle_kib = status_kib(pid, "RssAnon:");
    let before_kib = status_kib(pid, "VmRSS:");
    reset_peak(pid);
    let writers: Vec<_> = clients
        .into_iter()
        .enumerate()
        .map(|(c, mut client)| {
            std::thread::spawn(move || {
                let data = vec![c as u8 + 1; LEN];
                let mut sent = 0;
                let mut answered = 0;
                while answered < WRITES {
                    while sent < WRITES && sent - answered < WINDOW {
                        // Each connection its own 16 MiB of the 64 MiB disk, written over.
                        let offset = ((c % 4) * LEN) as u64;
                        client
                            .send_write(sent as u64 + 1, offset, &data, false)
                            .unwrap();
                        sent += 1;
                    }
                    let (handle, error, _) = client.recv_reply().unwrap();
                    assert_eq!(error, 0, "connection {c}, write {handle} failed");
                    answered += 1;
                }
                client.disconnect().unwrap();
            })
        })
        .collect();
    for writer in writers {
        writer.join().unwrap();
    }
    let grown_mib = (status_kib(pid, "VmHWM:") - before_kib) / 1024;
    eprintln!(
        "{CONNECTIONS} NBD connections x {WINDOW} writes of 16 MiB in flight: peak RSS {grown_mib} MiB over {} MiB",
        before_kib / 1024
    );
    assert!(
        grown_mib <= BUDGET_MIB + CACHE_MIB + FIXED_MIB,
        "the daemon's peak RSS grew by {grown_mib} MiB: more than the {BUDGET_MIB} MiB budget, \
         its {CACHE_MIB} MiB cache and {FIXED_MIB} MiB of fixed costs"
    );
    let took = wait_for_give_back(pid, idle_kib, 8, Duration::from_secs(10));
    eprintln!("private memory back within 8 MiB of idle after {took:?}");
    assert_eq!(daemon.terminate(), code::OK);
}
