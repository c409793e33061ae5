//! An independent decryption of a LUKS2 image's payload: cryptsetup recovers the volume key
//! with the passphrase, openssl does the AES of sampled AES-XTS sectors.
use super::{dump_json, read, s, tool};
use std::path::Path;

/// The volume key of `img` as hex, as `cryptsetup luksDump --dump-volume-key` shows it.
pub fn cryptsetup_volume_key(img: &Path, key: &Path) -> String {
    let out = tool(
        "cryptsetup",
        [
            "luksDump",
            "--dump-volume-key",
            "--batch-mode",
            "--key-file",
            s(key),
            s(img),
        ],
    );
    out.ok();
    let mut hexs = String::new();
    let mut in_dump = false;
    for line in out.stdout.lines() {
        if let Some(rest) = line.strip_prefix("MK dump:") {
            in_dump = true;
            hexs.push_str(rest);
        } else if in_dump && line.starts_with(char::is_whitespace) {
            hexs.push_str(line);
        } else if in_dump {
            break;
        }
    }
    let hex: String = hexs.split_whitespace().collect();
    assert!(
        hex.len() >= 32,
        "could not read the volume key from cryptsetup:\n{}",
        out.stdout
    );
    hex
}

/// openssl's decryption of sampled `sector`-byte sectors of `img` (first, last, and spread in
/// between) equals `plain`.
pub fn check_sampled_sectors(img: &Path, key_hex: &str, sector: u64, plain: &[u8]) {
    let data_offset = dump_json(img)["data_offset"].as_u64().unwrap();
    let image = read(img);
    let sectors = plain.len() as u64 / sector;
    let dir = img.parent().unwrap();
    for n in [0, 1, sectors / 3, sectors / 2 + 7, sectors - 2, sectors - 1] {
        let pos = n * sector;
        let ct = &image[(data_offset + pos) as usize..(data_offset + pos + sector) as usize];
        let pt = openssl_xts_decrypt(dir, key_hex, pos / 512, ct);
        super::assert_same_bytes(
            &pt,
            &plain[pos as usize..(pos + sector) as usize],
            &format!("openssl's decryption of sector {n}"),
        );
    }
}

/// AES-XTS decryption of one sector with openssl doing the AES (`openssl enc` has no XTS mode):
/// the tweak is AES-ECB of the little-endian sector number under the second key half, each
/// 16-byte block is tweak-xored, ECB-decrypted under the first half and xored again, the tweak
/// doubling in GF(2^128) from block to block.
pub fn openssl_xts_decrypt(dir: &Path, key_hex: &str, iv_sector: u64, ct: &[u8]) -> Vec<u8> {
    let half = key_hex.len() / 2;
    let ecb = if half == 64 {
        "-aes-256-ecb"
    } else {
        "-aes-128-ecb"
    };
    let aes = |mode: &str, key: &str, input: &[u8]| -> Vec<u8> {
        let inp = dir.join("xts.in");
        let out = dir.join("xts.out");
        std::fs::write(&inp, input).unwrap();
        tool(
            "openssl",
            [
                "enc",
                mode,
                ecb,
                "-nopad",
                "-K",
                key,
                "-in",
                s(&inp),
                "-out",
                s(&out),
            ],
        )
        .ok();
        read(&out)
    };
    let mut iv = [0u8; 16];
    iv[..8].copy_from_slice(&iv_sector.to_le_bytes());
    let mut tweak: [u8; 16] = aes("-e", &key_hex[half..], &iv).try_into().unwrap();
    let mut tweaks = Vec::with_capacity(ct.len());
    for _ in 0..ct.len() / 16 {
        tweaks.extend_from_slice(&tweak);
        let carry = tweak[15] >> 7;
        for i in (1..16).rev() {
            tweak[i] = (tweak[i] << 1) | (tweak[i - 1] >> 7);
        }
        tweak[0] = (tweak[0] << 1) ^ (0x87 * carry);
    }
    let masked: Vec<u8> = ct.iter().zip(&tweaks).map(|(a, b)| a ^ b).collect();
    aes("-d", &key_hex[..half], &masked)
        .iter()
        .zip(&tweaks)
        .map(|(a, b)| a ^ b)
        .collect()
}
