//! The `vaes` engine against OpenSSL and the portable engine: the same bytes for random keys,
//! every sector size, sector numbers near 0 and near 2^64, every IV generator XTS allows,
//! runs longer than one batch of tweaks, unaligned buffers, in place and out of place and
//! through raw pointers. Skipped (with the reason) on a CPU without VAES.

use cryptblk_crypto::{engines, CipherSpec, CryptoError, Direction, Engine, RawSectors, SecretKey};
use cryptblk_testutil::skip;
use rand::{Rng, RngCore, SeedableRng};
use std::sync::Arc;

const SECTOR_SIZES: [usize; 4] = [512, 1024, 2048, 4096];

fn engine(name: &str) -> Arc<dyn Engine> {
    engines()
        .into_iter()
        .find(|e| e.name() == name)
        .unwrap_or_else(|| panic!("no {name} engine"))
}

/// The CPU features the engine needs, asked independently of the engine itself.
#[cfg(target_arch = "x86_64")]
fn cpu_has_vaes() -> bool {
    std::arch::is_x86_feature_detected!("aes")
        && std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("vaes")
        && std::arch::is_x86_feature_detected!("vpclmulqdq")
}

#[cfg(not(target_arch = "x86_64"))]
fn cpu_has_vaes() -> bool {
    false
}

/// The `vaes` engine, or `None` after reporting the skip.
fn vaes() -> Option<Arc<dyn Engine>> {
    if !cpu_has_vaes() {
        skip("this CPU lacks AES-NI, AVX2, VAES or VPCLMULQDQ: the vaes engine cannot run");
        return None;
    }
    Some(engine("vaes"))
}

/// Sector numbers that matter: 0, small, around 2^32 (plain's truncation) and the top of
/// the 64-bit range, where `first + i` and the 512-byte IV units wrap.
fn first_sectors(rng: &mut impl Rng) -> Vec<u64> {
    vec![
        0,
        1,
        rng.gen_range(2..1000),
        u64::from(u32::MAX) - 3,
        rng.gen(),
        u64::MAX / 8 - 2,
        u64::MAX - 20,
        u64::MAX - 2,
        u64::MAX,
    ]
}

#[test]
fn vaes_matches_openssl_and_rustcrypto() {
    let Some(vaes) = vaes() else { return };
    let references = [engine("openssl"), engine("rustcrypto")];
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x7ae5);
    for (mode, key_bytes) in [
        ("xts-plain64", 32),
        ("xts-plain64", 64),
        ("xts-plain", 64),
        ("xts-plain64be", 32),
        ("xts-plain64be", 64),
    ] {
        let spec = CipherSpec::parse("aes", mode, key_bytes).unwrap();
        assert!(vaes.supports(&spec), "{spec}");
        for ss in SECTOR_SIZES {
            let mut key = vec![0u8; key_bytes];
            rng.fill_bytes(&mut key);
            let key = SecretKey::new(key);
            let ours = vaes.new_cipher(&spec, &key, ss).unwrap();
            assert_eq!(ours.engine_name(), "vaes");
            let theirs: Vec<_> = references
                .iter()
                .filter(|e| e.supports(&spec))
                .map(|e| e.new_cipher(&spec, &key, ss).unwrap())
                .collect();
            assert!(!theirs.is_empty());
            for first in first_sectors(&mut rng) {
                // Runs of one sector, of one and more than one batch of 16 tweaks.
                let sectors = [1, 3, 16, 17, 40][rng.gen_range(0..5)];
                let mut plain = vec![0u8; sectors * ss];
                rng.fill_bytes(&mut plain);
                let what = format!("{spec} ss={ss} first={first} sectors={sectors}");
                let mut ct = plain.clone();
                ours.crypt(Direction::Encrypt, first, &mut ct).unwrap();
                assert_ne!(ct, plain, "encryption changed nothing: {what}");
                for reference in &theirs {
                    let mut want = plain.clone();
                    reference
                        .crypt(Direction::Encrypt, first, &mut want)
                        .unwrap();
                    assert!(ct == want, "{} disagrees: {what}", reference.engine_name());
                    // And decryption of the other engine's ciphertext.
                    let mut back = want.clone();
                    ours.crypt(Direction::Decrypt, first, &mut back).unwrap();
                    assert!(back == plain, "decrypt {}: {what}", reference.engine_name());
                }
                check_buffers(&*ours, first, &plain, &ct, &mut rng, &what);
            }
        }
    }
}

/// `crypt_into` and `crypt_raw` at unaligned addresses, in place and out of place.
fn check_buffers(
    c: &dyn cryptblk_crypto::SectorCipher,
    first: u64,
    plain: &[u8],
    ct: &[u8],
    rng: &mut impl Rng,
    what: &str,
) {
    let len = plain.len();
    let (src_off, dst_off) = (rng.gen_range(0..32), rng.gen_range(0..32));
    let mut src_buf = vec![0u8; len + 32];
    let mut dst_buf = vec![0u8; len + 32];
    src_buf[src_off..src_off + len].copy_from_slice(plain);
    c.crypt_into(
        Direction::Encrypt,
        first,
        &src_buf[src_off..src_off + len],
        &mut dst_buf[dst_off..dst_off + len],
    )
    .unwrap();
    assert!(dst_buf[dst_off..dst_off + len] == *ct, "crypt_into: {what}");
    assert!(
        src_buf[src_off..src_off + len] == *plain,
        "crypt_into wrote its source"
    );
    // Nothing outside the destination range changed.
    assert!(dst_buf[..dst_off].iter().all(|&b| b == 0), "{what}");
    assert!(dst_buf[dst_off + len..].iter().all(|&b| b == 0), "{what}");

    let dst = RawSectors::from_mut(&mut dst_buf[dst_off..dst_off + len]);
    c.crypt_raw(Direction::Decrypt, first, dst).unwrap();
    assert!(
        dst_buf[dst_off..dst_off + len] == *plain,
        "crypt_raw in place: {what}"
    );
    let between = RawSectors::between(
        &src_buf[src_off..src_off + len],
        &mut dst_buf[dst_off..dst_off + len],
    );
    c.crypt_raw(Direction::Encrypt, first, between.unwrap())
        .unwrap();
    assert!(
        dst_buf[dst_off..dst_off + len] == *ct,
        "crypt_raw out of place: {what}"
    );
    let mut back = vec![0u8; len];
    c.crypt_into(Direction::Decrypt, first, ct, &mut back)
        .unwrap();
    assert!(back == plain, "crypt_into decrypt: {what}");
}

/// Each sector of a run is the sector alone under its own number, across the 16-sector
/// batches in which the engine encrypts tweaks.
#[test]
fn runs_equal_sectors_one_by_one() {
    let Some(vaes) = vaes() else { return };
    let spec = CipherSpec::parse_luks2("aes-xts-plain64", 64).unwrap();
    let key = SecretKey::random(64).unwrap();
    for ss in SECTOR_SIZES {
        let c = vaes.new_cipher(&spec, &key, ss).unwrap();
        let plain: Vec<u8> = (0..35 * ss).map(|i| (i * 13 + i / 7) as u8).collect();
        let mut run = plain.clone();
        c.crypt(Direction::Encrypt, u64::MAX - 17, &mut run)
            .unwrap();
        for (i, sector) in plain.chunks(ss).enumerate() {
            let mut one = sector.to_vec();
            c.crypt(
                Direction::Encrypt,
                (u64::MAX - 17).wrapping_add(i as u64),
                &mut one,
            )
            .unwrap();
            assert!(one == run[i * ss..(i + 1) * ss], "ss={ss} sector {i}");
        }
    }
}

/// XTS keys whose halves are equal (OpenSSL 3 refuses them; cryptsetup outside FIPS mode and
/// test suites use them): the same bytes as the portable engine.
#[test]
fn equal_key_halves() {
    let Some(vaes) = vaes() else { return };
    for key_bytes in [32, 64] {
        let spec = CipherSpec::parse("aes", "xts-plain64", key_bytes).unwrap();
        let key = SecretKey::new(vec![0x11; key_bytes]);
        let mut want = vec![0x42u8; 2048];
        cryptblk_crypto::portable_engine()
            .new_cipher(&spec, &key, 512)
            .unwrap()
            .crypt(Direction::Encrypt, 9, &mut want)
            .unwrap();
        let mut got = vec![0x42u8; 2048];
        let c = vaes.new_cipher(&spec, &key, 512).unwrap();
        assert_eq!(c.engine_name(), "vaes");
        c.crypt(Direction::Encrypt, 9, &mut got).unwrap();
        assert_eq!(got, want, "{key_bytes}-byte key");
    }
}

#[test]
fn refuses_what_it_cannot_run() {
    let Some(vaes) = vaes() else { return };
    // AES-192-XTS and CBC are not this engine's: refused by name, not mis-encrypted.
    for (mode, key_bytes) in [("xts-plain64", 48), ("cbc-essiv:sha256", 32)] {
        let spec = CipherSpec::parse("aes", mode, key_bytes).unwrap();
        assert!(!vaes.supports(&spec), "{spec}");
        let err = vaes
            .new_cipher(&spec, &SecretKey::random(key_bytes).unwrap(), 512)
            .err()
            .expect("accepted");
        assert!(matches!(err, CryptoError::Unsupported { .. }), "{err}");
        assert!(err.to_string().contains("vaes"), "{err}");
    }
    let spec = CipherSpec::parse_luks2("aes-xts-plain64", 64).unwrap();
    let c = vaes
        .new_cipher(&spec, &SecretKey::random(64).unwrap(), 4096)
        .unwrap();
    for len in [512usize, 4095, 4097] {
        let mut buf = vec![7u8; len];
        let err = c.crypt(Direction::Encrypt, 0, &mut buf).unwrap_err();
        assert!(matches!(err, CryptoError::InvalidLength(_)), "{err}");
        assert!(buf.iter().all(|&b| b == 7), "a refused run was changed");
    }
    let mut dst = vec![0u8; 4096];
    let err = c
        .crypt_into(Direction::Encrypt, 0, &[0u8; 8192], &mut dst)
        .unwrap_err();
    assert!(matches!(err, CryptoError::InvalidLength(_)), "{err}");
    c.crypt(Direction::Decrypt, 0, &mut []).unwrap();
}

/// On a CPU without the features, the engine says so instead of running.
#[test]
fn without_the_cpu_features_the_engine_says_which_are_missing() {
    if cpu_has_vaes() {
        skip("this CPU has VAES: the refusal for CPUs without it cannot be observed here");
        return;
    }
    let Some(vaes) = engines().into_iter().find(|e| e.name() == "vaes") else {
        // Not x86-64: the engine is not compiled in at all.
        return;
    };
    let spec = CipherSpec::parse_luks2("aes-xts-plain64", 64).unwrap();
    assert!(!vaes.supports(&spec));
    let err = vaes
        .new_cipher(&spec, &SecretKey::random(64).unwrap(), 512)
        .err()
        .expect("vaes cipher made on a CPU without VAES");
    assert!(err.to_string().contains("missing"), "{err}");
}
