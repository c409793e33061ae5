//! Where does splitting across the pool start to pay? Prints inline vs split time per call for
//! a range of run sizes (AES-256-XTS, 4 KiB sectors, default engine), to choose
//! `DEFAULT_INLINE_THRESHOLD`. `cargo run --release -p cryptblk-crypto --example pool_threshold`

use cryptblk_crypto::{default_engine_for, CipherSpec, CryptoPool, Direction, SecretKey};
use std::time::{Duration, Instant};

fn per_call(mut f: impl FnMut()) -> Duration {
    let mut best = Duration::MAX;
    for _ in 0..5 {
        let start = Instant::now();
        let n = 200;
        for _ in 0..n {
            f();
        }
        best = best.min(start.elapsed() / n);
    }
    best
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let spec = CipherSpec::parse_luks2("aes-xts-plain64", 64)?;
    let cipher = default_engine_for(&spec)?.new_cipher(&spec, &SecretKey::random(64)?, 4096)?;
    let pool = CryptoPool::with_default_threads().with_inline_threshold(0);
    println!(
        "engine {}, {} threads",
        cipher.engine_name(),
        pool.threads()
    );
    println!("{:>8} {:>12} {:>12}", "KiB", "inline µs", "split µs");
    for kib in [8usize, 16, 32, 64, 128, 256, 1024] {
        let mut buf = vec![0u8; kib * 1024];
        let inline = per_call(|| {
            cipher
                .crypt(Direction::Encrypt, 0, &mut buf)
                .expect("crypt")
        });
        let split = per_call(|| {
            pool.crypt(&cipher, Direction::Encrypt, 0, &mut buf)
                .expect("crypt")
        });
        println!(
            "{kib:>8} {:>12.1} {:>12.1}",
            inline.as_secs_f64() * 1e6,
            split.as_secs_f64() * 1e6
        );
    }
    Ok(())
}
