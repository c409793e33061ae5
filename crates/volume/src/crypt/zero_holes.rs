//! Never-written sectors read as zeros, for containers whose other users expect it.
//!
//! librbd's own LUKS encryption (`rbd encryption format`, QEMU's `encrypt.format=`) returns
//! zeros where nothing was ever written, instead of the decryption of the zeros RADOS returns
//! there. A disk shared with librbd must look the same through cryptblk, so on such containers
//! a sector whose ciphertext is all zeros is left as zeros rather than decrypted. Real
//! ciphertext is never all zeros (a 512-byte sector would have to hit one value in 2^4096), so
//! the test only ever fires on sectors nothing wrote: holes and unallocated objects.
//!
//! The check stops at the first non-zero word, so on written data it costs a few loads per
//! sector; on holes it saves the decryption.

use cryptblk_block::Container;
use cryptblk_crypto::{CryptoError, Direction, RawSectors, SectorCipher};
use std::sync::Arc;

/// The cipher a volume on `file` uses: never-written sectors read as zeros where the
/// container says other clients see them so (RBD).
pub fn data_cipher(file: &dyn Container, cipher: Arc<dyn SectorCipher>) -> Arc<dyn SectorCipher> {
    if file.unwritten_reads_as_zeros() {
        ZeroHolesCipher::wrap(cipher)
    } else {
        cipher
    }
}

/// `inner`, except that decryption leaves all-zero sectors as zeros.
struct ZeroHolesCipher {
    inner: Arc<dyn SectorCipher>,
}

impl ZeroHolesCipher {
    fn wrap(inner: Arc<dyn SectorCipher>) -> Arc<dyn SectorCipher> {
        Arc::new(ZeroHolesCipher { inner })
    }
}

impl SectorCipher for ZeroHolesCipher {
    fn sector_size(&self) -> usize {
        self.inner.sector_size()
    }

    fn engine_name(&self) -> &'static str {
        self.inner.engine_name()
    }

    fn crypt(&self, dir: Direction, first_sector: u64, data: &mut [u8]) -> Result<(), CryptoError> {
        if dir == Direction::Encrypt {
            return self.inner.crypt(dir, first_sector, data);
        }
        cryptblk_crypto::crypt_via_raw(self, dir, first_sector, data)
    }

    fn crypt_into(
        &self,
        dir: Direction,
        first_sector: u64,
        src: &[u8],
        dst: &mut [u8],
    ) -> Result<(), CryptoError> {
        if dir == Direction::Encrypt || src.len() != dst.len() {
            return self.inner.crypt_into(dir, first_sector, src, dst);
        }
        cryptblk_crypto::crypt_into_via_raw(self, dir, first_sector, src, dst)
    }

    /// Decrypts each run of non-zero sectors with one call to the inner cipher, and leaves
    /// (or, out of place, writes) zeros for the zero sectors between them.
    fn crypt_raw(
        &self,
        dir: Direction,
        first_sector: u64,
        bytes: RawSectors<'_>,
    ) -> Result<(), CryptoError> {
        let ss = self.inner.sector_size();
        if dir == Direction::Encrypt || ss == 0 || !bytes.len().is_multiple_of(ss) {
            return self.inner.crypt_raw(dir, first_sector, bytes);
        }
        let mut sector = first_sector;
        let mut rest = bytes;
        while !rest.is_empty() {
            // The run of non-zero sectors at the start of `rest`, then one zero sector.
            let mut run = 0;
            while run < rest.len() && !rest.src_is_zero(run, ss) {
                run += ss;
            }
            let (nonzero, tail) = rest.split_at(run);
            if !nonzero.is_empty() {
                self.inner.crypt_raw(dir, sector, nonzero)?;
                sector = sector.wrapping_add((run / ss) as u64);
            }
            if tail.is_empty() {
                break;
            }
            let (mut zero, tail) = tail.split_at(ss);
            if !zero.is_in_place() {
                zero.zero_dst();
            }
            sector = sector.wrapping_add(1);
            rest = tail;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cryptblk_crypto::{default_engine_for, CipherSpec, SecretKey};

    fn xts(sector: usize) -> Arc<dyn SectorCipher> {
        let spec = CipherSpec::parse_luks2("aes-xts-plain64", 64).unwrap();
        let key = SecretKey::new(vec![7u8; 64]);
        default_engine_for(&spec)
            .unwrap()
            .new_cipher(&spec, &key, sector)
            .unwrap()
    }

    #[test]
    fn zero_sectors_stay_zero_and_others_decrypt_as_before() {
        for sector in [512usize, 4096] {
            let plain = xts(sector);
            let holes = ZeroHolesCipher::wrap(plain.clone());
            // Sectors: data, hole, hole, data, hole (as RADOS returns an object with holes).
            let mut disk = vec![0u8; 5 * sector];
            for i in [0usize, 3] {
                let s = &mut disk[i * sector..(i + 1) * sector];
                s.fill(i as u8 + 1);
                plain.crypt(Direction::Encrypt, 40 + i as u64, s).unwrap();
            }
            let mut want = disk.clone();
            plain.crypt(Direction::Decrypt, 40, &mut want).unwrap();
            for i in [1usize, 2, 4] {
                want[i * sector..(i + 1) * sector].fill(0);
            }
            let mut in_place = disk.clone();
            holes.crypt(Direction::Decrypt, 40, &mut in_place).unwrap();
            assert_eq!(in_place, want, "in place, {sector}-byte sectors");
            let mut out = vec![0xeeu8; disk.len()];
            holes
                .crypt_into(Direction::Decrypt, 40, &disk, &mut out)
                .unwrap();
            assert_eq!(out, want, "out of place, {sector}-byte sectors");
            assert!(want[..sector].iter().all(|&b| b == 1));
            assert!(want[3 * sector..4 * sector].iter().all(|&b| b == 4));
        }
    }

    #[test]
    fn encryption_is_unchanged() {
        let plain = xts(4096);
        let holes = ZeroHolesCipher::wrap(plain.clone());
        let mut a = vec![0u8; 8192];
        let mut b = a.clone();
        plain.crypt(Direction::Encrypt, 3, &mut a).unwrap();
        holes.crypt(Direction::Encrypt, 3, &mut b).unwrap();
        assert_eq!(a, b);
        assert!(
            a.iter().any(|&x| x != 0),
            "zeros encrypt to ciphertext, not zeros"
        );
    }
}
