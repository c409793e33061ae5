//! Idle workers must sleep, not poll. Its own test binary so that no other test burns CPU in
//! the same process while the process CPU clock is read.

use cryptblk_crypto::{engines, CipherSpec, CryptoPool, Direction, SecretKey};
use std::time::Duration;

fn process_cpu_time() -> Duration {
    // utime + stime of this process from /proc, in clock ticks (100 Hz on Linux).
    let stat = std::fs::read_to_string("/proc/self/stat").expect("read /proc/self/stat");
    let after_comm = &stat[stat.rfind(')').expect("stat format") + 2..];
    let fields: Vec<&str> = after_comm.split_whitespace().collect();
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    Duration::from_millis(ticks * 10)
}

#[test]
fn idle_pool_uses_no_cpu() {
    let pool = CryptoPool::new(4).with_inline_threshold(0);
    // Wake every worker once so they are all parked on the queue afterwards.
    let spec = CipherSpec::parse_luks2("aes-xts-plain64", 64).unwrap();
    let cipher = engines()[0]
        .new_cipher(&spec, &SecretKey::random(64).unwrap(), 512)
        .unwrap();
    let mut buf = vec![0u8; 1 << 20];
    pool.crypt(&cipher, Direction::Encrypt, 0, &mut buf)
        .unwrap();

    let before = process_cpu_time();
    std::thread::sleep(Duration::from_millis(1500));
    let used = process_cpu_time() - before;
    // Spinning workers would burn ~4 × 1.5 s; allow scheduler noise only.
    assert!(
        used < Duration::from_millis(150),
        "idle pool used {used:?} of CPU in 1.5 s"
    );
    drop(pool);
}
