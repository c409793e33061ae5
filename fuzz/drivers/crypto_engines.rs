//! Every sector-crypto engine this CPU runs against the portable one (RustCrypto), on
//! fuzzer-chosen keys, sector sizes, sector numbers (all of u64, so runs that wrap past 2^64
//! and IVs whose 512-byte units overflow), IV generators and buffer misalignments. Shared by
//! the `crypto_engines` fuzz target and the stable replay in
//! crates/crypto/tests/fuzz_engines_replay.rs.
//!
//! Checks: each engine's ciphertext equals the portable engine's, through `crypt` in place,
//! `crypt_into` and `crypt_raw` out of place between misaligned buffers and `crypt_raw` in
//! place; decryption gives the input back; nothing is written outside the destination.
//!
//! Input (missing bytes read as zero):
//! - byte 0: bit 0 key size (0: AES-128-XTS, 32 bytes; 1: AES-256-XTS, 64 bytes), bits 1-2 IV
//!   generator (plain64, plain, plain64be, plain64), bits 3-4 sector size (512 << n), bit 5
//!   direction (encrypt or decrypt first), bits 6-7 unused;
//! - bytes 1..9: the first sector number (u64 LE);
//! - byte 9: source misalignment (0..31), byte 10: destination misalignment (0..31);
//! - byte 11: number of sectors, 1 + (byte % 8);
//! - the next 32 or 64 bytes: the key;
//! - the rest: the data, repeated to fill the sectors (zeros if none).

use cryptblk_crypto::{engines, portable_engine, CipherSpec, Direction, RawSectors, SecretKey};

/// The number of engines compared with the portable one (for the replay's own checks).
pub fn run(input: &[u8]) -> usize {
    let at = |i: usize| input.get(i).copied().unwrap_or(0);
    let flags = at(0);
    let key_bytes = if flags & 1 == 0 { 32 } else { 64 };
    let mode =
        ["xts-plain64", "xts-plain", "xts-plain64be", "xts-plain64"][usize::from((flags >> 1) & 3)];
    let sector_size = 512usize << ((flags >> 3) & 3);
    let dir = if flags & 0x20 == 0 {
        Direction::Encrypt
    } else {
        Direction::Decrypt
    };
    let mut first = [0u8; 8];
    for (i, b) in first.iter_mut().enumerate() {
        *b = at(1 + i);
    }
    let first = u64::from_le_bytes(first);
    let (src_off, dst_off) = (usize::from(at(9) % 32), usize::from(at(10) % 32));
    let sectors = 1 + usize::from(at(11) % 8);
    let key: Vec<u8> = (0..key_bytes).map(|i| at(12 + i)).collect();
    let rest = input.get(12 + key_bytes..).unwrap_or(&[]);
    let len = sectors * sector_size;
    let data: Vec<u8> = if rest.is_empty() {
        vec![0; len]
    } else {
        rest.iter().copied().cycle().take(len).collect()
    };

    let spec = CipherSpec::parse("aes", mode, key_bytes).expect("an XTS spec");
    let key = SecretKey::new(key);
    let reference = portable_engine()
        .new_cipher(&spec, &key, sector_size)
        .expect("the portable engine runs every XTS spec");
    let mut want = data.clone();
    reference.crypt(dir, first, &mut want).unwrap();
    let back_dir = match dir {
        Direction::Encrypt => Direction::Decrypt,
        Direction::Decrypt => Direction::Encrypt,
    };
    let what = |engine: &str, how: &str| {
        format!(
            "{engine} {how}: {spec} sector size {sector_size}, first {first}, {sectors} sectors"
        )
    };

    let mut compared = 0;
    for engine in engines().into_iter().filter(|e| e.supports(&spec)) {
        let name = engine.name();
        let c = engine.new_cipher(&spec, &key, sector_size).unwrap();

        let mut got = data.clone();
        c.crypt(dir, first, &mut got).unwrap();
        assert!(got == want, "{}", what(name, "crypt"));

        let mut src = vec![0u8; len + 32];
        src[src_off..src_off + len].copy_from_slice(&data);
        let mut dst = vec![0u8; len + 32];
        c.crypt_into(
            dir,
            first,
            &src[src_off..src_off + len],
            &mut dst[dst_off..dst_off + len],
        )
        .unwrap();
        assert!(
            dst[dst_off..dst_off + len] == want,
            "{}",
            what(name, "crypt_into")
        );
        assert!(
            dst[..dst_off]
                .iter()
                .chain(&dst[dst_off + len..])
                .all(|&b| b == 0),
            "{}",
            what(name, "crypt_into wrote outside its destination")
        );

        dst.fill(0);
        let between = RawSectors::between(
            &src[src_off..src_off + len],
            &mut dst[dst_off..dst_off + len],
        );
        c.crypt_raw(dir, first, between.unwrap()).unwrap();
        assert!(
            dst[dst_off..dst_off + len] == want,
            "{}",
            what(name, "crypt_raw")
        );
        let in_place = RawSectors::from_mut(&mut dst[dst_off..dst_off + len]);
        c.crypt_raw(back_dir, first, in_place).unwrap();
        assert!(
            dst[dst_off..dst_off + len] == data,
            "{}",
            what(name, "crypt_raw back")
        );

        c.crypt(back_dir, first, &mut got).unwrap();
        assert!(got == data, "{}", what(name, "round trip"));
        compared += 1;
    }
    compared
}
