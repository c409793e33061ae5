use super::*;
use crate::{engines, CipherSpec, SecretKey};
use rand::{Rng, RngCore, SeedableRng};
use std::sync::mpsc;
use std::time::Duration;

fn ciphers(sector_size: usize) -> Vec<Arc<dyn SectorCipher>> {
    let spec = CipherSpec::parse("aes", "xts-plain64", 64).unwrap();
    let key = SecretKey::random(64).unwrap();
    engines()
        .iter()
        .map(|e| e.new_cipher(&spec, &key, sector_size).unwrap())
        .collect()
}

#[test]
fn split_equals_single_thread() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    for threads in [2, 3, 4] {
        // A tiny threshold forces splitting even for a few sectors.
        let pool = CryptoPool::new(threads).with_inline_threshold(0);
        for ss in [512usize, 4096] {
            for cipher in ciphers(ss) {
                for sectors in [1usize, 2, 3, 7, 16, 33, 64, 129, 300] {
                    let first = rng.gen::<u32>() as u64;
                    let mut plain = vec![0u8; sectors * ss];
                    rng.fill_bytes(&mut plain);
                    let mut want = plain.clone();
                    cipher.crypt(Direction::Encrypt, first, &mut want).unwrap();
                    let mut got = plain.clone();
                    pool.crypt(&cipher, Direction::Encrypt, first, &mut got)
                        .unwrap();
                    assert!(got == want, "threads={threads} ss={ss} sectors={sectors}");
                    pool.crypt(&cipher, Direction::Decrypt, first, &mut got)
                        .unwrap();
                    assert!(got == plain);
                }
            }
        }
    }
}

#[test]
fn crypt_into_equals_in_place_and_leaves_the_source_alone() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(2);
    for threads in [1, 2, 3] {
        let pool = CryptoPool::new(threads).with_inline_threshold(0);
        for ss in [512usize, 4096] {
            for cipher in ciphers(ss) {
                for sectors in [1usize, 3, 16, 129] {
                    let first = rng.gen::<u32>() as u64;
                    let mut plain = vec![0u8; sectors * ss];
                    rng.fill_bytes(&mut plain);
                    let mut want = plain.clone();
                    cipher.crypt(Direction::Encrypt, first, &mut want).unwrap();
                    let mut got = vec![0u8; plain.len()];
                    pool.crypt_into(&cipher, Direction::Encrypt, first, &plain, &mut got)
                        .unwrap();
                    assert!(got == want, "threads={threads} ss={ss} sectors={sectors}");
                    let mut back = vec![0u8; plain.len()];
                    pool.crypt_into(&cipher, Direction::Decrypt, first, &got, &mut back)
                        .unwrap();
                    assert!(back == plain && got == want);
                }
            }
        }
        let cipher = ciphers(512).remove(0);
        let err = pool
            .crypt_into(&cipher, Direction::Encrypt, 0, &[0; 1024], &mut [0; 512])
            .unwrap_err();
        assert!(matches!(err, CryptoError::InvalidLength(_)), "{err}");
    }
}

#[test]
fn chunking_respects_threshold_and_sectors() {
    let pool = CryptoPool::new(4);
    assert_eq!(pool.chunk_size(4096, 4096), None);
    assert_eq!(pool.chunk_size(DEFAULT_INLINE_THRESHOLD - 4096, 4096), None);
    // 1 MiB over 4 threads: four chunks each.
    assert_eq!(pool.chunk_size(1 << 20, 4096), Some(64 * 1024));
    // Small splits are floored so that chunks stay worth claiming.
    assert_eq!(
        pool.chunk_size(DEFAULT_INLINE_THRESHOLD, 4096),
        Some(32 * 1024)
    );
    let tiny = CryptoPool::new(4).with_inline_threshold(0);
    assert_eq!(
        tiny.chunk_size(2 * 512, 512),
        Some(512),
        "splits down to single sectors"
    );
    assert_eq!(
        CryptoPool::new(1).chunk_size(1 << 20, 512),
        None,
        "one thread never splits"
    );
    // Chunks are whole sectors.
    assert_eq!(pool.chunk_size(300 * 4096, 4096).map(|c| c % 4096), Some(0));
}

#[test]
fn bad_length_is_an_error() {
    let pool = CryptoPool::new(2).with_inline_threshold(0);
    for cipher in ciphers(512) {
        let mut buf = vec![0u8; 4 * 512 + 1];
        let err = pool
            .crypt(&cipher, Direction::Encrypt, 0, &mut buf)
            .unwrap_err();
        assert!(matches!(err, CryptoError::InvalidLength(_)), "{err}");
    }
}

#[test]
fn single_thread_pool_works() {
    let pool = CryptoPool::new(1).with_inline_threshold(0);
    let cipher = ciphers(4096).remove(0);
    let plain: Vec<u8> = (0..256 * 1024).map(|i| (i * 13) as u8).collect();
    let mut want = plain.clone();
    cipher.crypt(Direction::Encrypt, 5, &mut want).unwrap();
    let mut got = plain.clone();
    pool.crypt(&cipher, Direction::Encrypt, 5, &mut got)
        .unwrap();
    assert!(got == want);
}

#[test]
fn concurrent_callers_do_not_deadlock() {
    let pool = Arc::new(CryptoPool::new(2).with_inline_threshold(0));
    let cipher = ciphers(4096).remove(0);
    let (tx, rx) = mpsc::channel();
    for t in 0..8u64 {
        let pool = pool.clone();
        let cipher = cipher.clone();
        let tx = tx.clone();
        std::thread::spawn(move || {
            let plain = vec![t as u8; 128 * 1024];
            for i in 0..40 {
                let mut buf = plain.clone();
                pool.crypt(&cipher, Direction::Encrypt, t * 1000 + i, &mut buf)
                    .unwrap();
                pool.crypt(&cipher, Direction::Decrypt, t * 1000 + i, &mut buf)
                    .unwrap();
                assert!(buf == plain);
            }
            tx.send(t).unwrap();
        });
    }
    for _ in 0..8 {
        rx.recv_timeout(Duration::from_secs(60))
            .expect("a caller is stuck");
    }
}

/// A cipher that panics on one sector number, to exercise the worker's unwinding path.
struct Panicky;

impl SectorCipher for Panicky {
    fn sector_size(&self) -> usize {
        512
    }
    fn engine_name(&self) -> &'static str {
        "panicky"
    }
    fn crypt(
        &self,
        _dir: Direction,
        first_sector: u64,
        data: &mut [u8],
    ) -> Result<(), CryptoError> {
        let n = data.len() as u64 / 512;
        if (first_sector..first_sector + n).contains(&1000) {
            panic!("boom");
        }
        data.fill(0xaa);
        Ok(())
    }
}

#[test]
fn worker_panic_becomes_an_error_and_the_pool_survives() {
    let pool = CryptoPool::new(2).with_inline_threshold(0);
    let cipher: Arc<dyn SectorCipher> = Arc::new(Panicky);
    // Sector 1000 is in the first chunk, which a worker gets; the caller does the second.
    let mut buf = vec![0u8; 8 * 512];
    let err = pool
        .crypt(&cipher, Direction::Encrypt, 998, &mut buf)
        .unwrap_err();
    assert!(matches!(err, CryptoError::Worker(_)), "{err}");
    // The same on the caller's own (last) chunk: an error, not an unwind.
    let err = pool
        .crypt(&cipher, Direction::Encrypt, 995, &mut buf)
        .unwrap_err();
    assert!(matches!(err, CryptoError::Worker(_)), "{err}");
    // Both workers still serve.
    let mut ok = vec![0u8; 64 * 512];
    pool.crypt(&cipher, Direction::Encrypt, 0, &mut ok).unwrap();
    assert!(ok.iter().all(|&b| b == 0xaa));
}
