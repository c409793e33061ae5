//! How close does the `openssl` engine get to OpenSSL used directly? Compares `SectorCipher::crypt`
//! with the leanest direct loop (one context keyed once, IV reset per sector, one in-place
//! update per sector) for AES-256-XTS. Best of several rounds, so other load on the host
//! disturbs it less. `cargo run --release -p cryptblk-crypto --example openssl_baseline`

use cryptblk_crypto::{engines, CipherSpec, Direction, SecretKey};
use openssl::cipher::Cipher;
use openssl::cipher_ctx::CipherCtx;
use std::time::Instant;

const BUF: usize = 1 << 20;
const ROUNDS: usize = 30;

fn best_gbps(mut f: impl FnMut(&mut [u8])) -> f64 {
    let mut buf = vec![0x33u8; BUF];
    f(&mut buf);
    let mut best = f64::MAX;
    for _ in 0..ROUNDS {
        let t = Instant::now();
        for _ in 0..8 {
            f(&mut buf);
        }
        best = best.min(t.elapsed().as_secs_f64());
    }
    (8 * BUF) as f64 / best / 1e9
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let key = SecretKey::random(64)?;
    let spec = CipherSpec::parse_luks2("aes-xts-plain64", 64)?;
    let engine = engines()
        .into_iter()
        .find(|e| e.name() == "openssl")
        .ok_or("no openssl engine")?;
    println!(
        "{:>6} {:>12} {:>12} {:>7}",
        "sector", "direct GB/s", "engine GB/s", "ratio"
    );
    for ss in [512usize, 4096] {
        let mut ctx = CipherCtx::new()?;
        ctx.encrypt_init(Some(Cipher::aes_256_xts()), Some(key.as_bytes()), None)?;
        let direct = best_gbps(|buf| {
            for (i, sector) in buf.chunks_exact_mut(ss).enumerate() {
                let mut iv = [0u8; 16];
                iv[..8].copy_from_slice(&(i as u64).to_le_bytes());
                ctx.encrypt_init(None, None, Some(&iv)).expect("iv");
                ctx.cipher_update_inplace(sector, ss).expect("update");
            }
        });
        let cipher = engine.new_cipher(&spec, &key, ss)?;
        let ours = best_gbps(|buf| cipher.crypt(Direction::Encrypt, 0, buf).expect("crypt"));
        println!(
            "{ss:>6} {direct:>12.2} {ours:>12.2} {:>6.0}%",
            100.0 * ours / direct
        );
    }
    Ok(())
}
