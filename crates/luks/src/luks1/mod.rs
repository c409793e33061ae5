//! LUKS1: read, unlock, format, keyslot management and dump of the 592-byte `phdr` format.
mod dump;
mod layout;
pub(crate) mod phdr;

use crate::af::{af_merge, af_split};
use crate::ct::ct_eq;
use crate::io::HeaderIo;
use crate::io::{read_at, write_at, zero_range};
use crate::kdf::{self, Kdf};
use crate::kdf_cost;
use crate::keyslot_area::{decrypt_area, encrypt_area};
use crate::{
    DigestFingerprint, FormatOptions, HashAlg, LuksError, PbkdfKind, PbkdfOptions, Result,
    UnlockOptions, Unlocker,
};
use cryptblk_crypto::{CipherSpec, CryptoError, SecretKey};
use phdr::{Keyslot, Phdr, DIGEST_LEN, NUM_KEYSLOTS, PHDR_SIZE, SALT_LEN, SECTOR};
use zeroize::Zeroizing;

pub use phdr::is_luks1;

/// A parsed LUKS1 header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Luks1Header {
    phdr: Phdr,
}

/// Map the crypto crate's refusal into the LUKS error that names the cipher, so callers can
/// match on `Unsupported` for both LUKS versions.
pub(crate) fn cipher_error(e: CryptoError) -> LuksError {
    match e {
        CryptoError::Unsupported { what, name } => LuksError::Unsupported {
            what,
            name,
            hint: "cryptblk supports aes in xts-plain64, xts-plain, cbc-plain, cbc-plain64 and cbc-essiv:sha256"
                .into(),
        },
        other => LuksError::Crypto(other),
    }
}

impl Luks1Header {
    pub fn read(file: &dyn HeaderIo) -> Result<(Self, Vec<String>)> {
        let mut buf = [0u8; PHDR_SIZE];
        read_at(file, 0, &mut buf, "LUKS1 header")?;
        let phdr = Phdr::decode(&buf)?;
        let mut warnings = Vec::new();
        if uuid::Uuid::parse_str(&phdr.uuid).is_err() {
            warnings.push(format!(
                "UUID '{}' is not in the standard format",
                phdr.uuid
            ));
        }
        Ok((Luks1Header { phdr }, warnings))
    }

    pub fn uuid(&self) -> &str {
        &self.phdr.uuid
    }

    pub(crate) fn phdr(&self) -> &Phdr {
        &self.phdr
    }

    pub fn label(&self) -> Option<&str> {
        None
    }

    pub fn cipher_spec(&self) -> Result<CipherSpec> {
        CipherSpec::parse(
            &self.phdr.cipher_name,
            &self.phdr.cipher_mode,
            self.phdr.key_bytes as usize,
        )
        .map_err(cipher_error)
    }

    pub fn hash(&self) -> Result<HashAlg> {
        HashAlg::parse(&self.phdr.hash_spec)
    }

    pub fn sector_size(&self) -> u32 {
        512
    }

    pub fn data_offset(&self) -> u64 {
        u64::from(self.phdr.payload_offset) * SECTOR
    }

    pub fn data_size(&self, file_len: u64) -> Result<u64> {
        file_len.checked_sub(self.data_offset()).ok_or_else(|| {
            LuksError::Truncated(format!(
                "the file is {file_len} bytes but the LUKS1 payload starts at {}",
                self.data_offset()
            ))
        })
    }

    pub fn active_keyslots(&self) -> Vec<usize> {
        (0..NUM_KEYSLOTS)
            .filter(|&i| self.phdr.keyslots[i].active)
            .collect()
    }

    pub fn read_only_reason(&self) -> Option<String> {
        None
    }

    pub fn key_bytes(&self) -> usize {
        self.phdr.key_bytes as usize
    }

    /// Everything an unlock needs, checked before any costly KDF run: a header naming a
    /// cipher or hash we cannot run is refused up front with its name.
    fn usable(&self) -> Result<(CipherSpec, HashAlg)> {
        let spec = self.cipher_spec()?;
        let hash = self.hash()?;
        // Building a throwaway cipher catches IV generators the spec parser accepts but no
        // engine implements (e.g. essiv:sha1).
        let probe = SecretKey::new(vec![0u8; spec.key_bytes()]);
        cryptblk_crypto::portable_engine()
            .new_cipher(&spec, &probe, 512)
            .map_err(cipher_error)?;
        Ok((spec, hash))
    }

    pub fn unlock(
        &self,
        file: &dyn HeaderIo,
        passphrase: &[u8],
        opts: &UnlockOptions,
    ) -> Result<(usize, SecretKey)> {
        // LUKS1 has only PBKDF2 keyslots: no memory limit, but an iteration limit.
        let (spec, hash) = self.usable()?;
        if self.active_keyslots().is_empty() {
            return Err(LuksError::NoKeyslots);
        }
        // Every candidate key is checked against the digest, so its cost applies to all slots.
        opts.check_pbkdf2("volume-key digest", self.phdr.mk_digest_iter)?;
        let mut first_error = None;
        let mut tried_cleanly = false;
        for slot in self.active_keyslots() {
            let place = format!("keyslot {slot}");
            let tried = opts
                .check_pbkdf2(&place, self.phdr.keyslots[slot].iterations)
                .and_then(|()| self.try_slot(file, slot, &spec, hash, passphrase));
            match tried {
                Ok(Some(key)) => return Ok((slot, key)),
                Ok(None) => tried_cleanly = true,
                Err(e) => {
                    tracing::warn!(slot, error = %e, "LUKS1 keyslot unusable");
                    first_error.get_or_insert(e);
                }
            }
        }
        match first_error {
            // A slot refused for its cost might be the one this passphrase opens: say so
            // rather than "wrong passphrase".
            Some(e) if !tried_cleanly || matches!(e, LuksError::PbkdfCostLimit { .. }) => Err(e),
            _ => Err(LuksError::WrongPassphrase),
        }
    }

    /// Opens the volume key with a passphrase or a known key (`Unlocker`); the keyslot is
    /// `None` for a known key.
    pub fn unlock_with(
        &self,
        file: &dyn HeaderIo,
        unlocker: Unlocker<'_>,
        opts: &UnlockOptions,
    ) -> Result<(Option<usize>, SecretKey)> {
        match unlocker {
            Unlocker::Passphrase(passphrase) => self
                .unlock(file, passphrase, opts)
                .map(|(slot, key)| (Some(slot), key)),
            Unlocker::Keys(_) => {
                self.usable()?;
                match unlocker.known(self.volume_key_fingerprint()?) {
                    Some(Some(key)) if key.len() == self.key_bytes() => Ok((None, key)),
                    _ => Err(LuksError::KnownKeyStale("(LUKS1)")),
                }
            }
        }
    }

    /// The fingerprint of the header's volume-key digest (`known_key`).
    pub fn volume_key_fingerprint(&self) -> Result<DigestFingerprint> {
        Ok(DigestFingerprint::of(&[
            b"luks1",
            self.hash()?.name().as_bytes(),
            &self.phdr.mk_digest_iter.to_le_bytes(),
            &self.phdr.mk_digest_salt,
            &self.phdr.mk_digest,
        ]))
    }

    fn try_slot(
        &self,
        file: &dyn HeaderIo,
        slot: usize,
        spec: &CipherSpec,
        hash: HashAlg,
        passphrase: &[u8],
    ) -> Result<Option<SecretKey>> {
        let ks = &self.phdr.keyslots[slot];
        let key_len = self.key_bytes();
        let (offset, len) = self.phdr.area(slot)?;
        let mut area = Zeroizing::new(vec![0u8; len as usize]);
        read_at(file, offset, &mut area, &format!("keyslot {slot} material"))?;
        let kdf = Kdf::Pbkdf2 {
            hash,
            iterations: ks.iterations,
        };
        let slot_key = kdf::derive(&kdf, passphrase, &ks.salt, key_len)?;
        decrypt_area(spec, &slot_key, &mut area)?;
        let material_len = key_len * ks.stripes as usize;
        let candidate = af_merge(&area[..material_len], key_len, ks.stripes, hash);
        Ok(self.key_matches(&candidate)?.then_some(candidate))
    }

    /// Check a volume key against the header's digest.
    pub fn verify_volume_key(&self, key: &SecretKey) -> Result<()> {
        if self.key_matches(key)? {
            Ok(())
        } else {
            Err(LuksError::InvalidArgument(
                "the volume key does not match the header's digest".into(),
            ))
        }
    }

    fn key_matches(&self, key: &SecretKey) -> Result<bool> {
        if key.len() != self.key_bytes() {
            return Ok(false);
        }
        let digest = mk_digest(
            self.hash()?,
            key,
            &self.phdr.mk_digest_salt,
            self.phdr.mk_digest_iter,
        )?;
        Ok(ct_eq(&digest, &self.phdr.mk_digest))
    }

    pub fn dump(&self) -> serde_json::Value {
        dump::json(&self.phdr)
    }

    /// `cryptsetup luksDump`-style text.
    pub fn dump_text(&self) -> String {
        dump::text(&self.phdr)
    }

    pub fn format(
        file: &dyn HeaderIo,
        opts: &FormatOptions,
        passphrase: &[u8],
        volume_key: &SecretKey,
        payload_size: Option<u64>,
    ) -> Result<Self> {
        if opts.version != crate::LuksVersion::V1 {
            return Err(LuksError::InvalidArgument(
                "Luks1Header::format called for a LUKS2 image".into(),
            ));
        }
        if opts.label.is_some() {
            return Err(LuksError::InvalidArgument(
                "LUKS1 headers have no label (use LUKS2)".into(),
            ));
        }
        if opts.sector_size != 512 {
            return Err(LuksError::InvalidArgument(format!(
                "LUKS1 always encrypts 512-byte sectors (asked for {})",
                opts.sector_size
            )));
        }
        if volume_key.len() != opts.cipher.key_bytes() {
            return Err(LuksError::InvalidArgument(format!(
                "volume key is {} bytes but {} needs {}",
                volume_key.len(),
                opts.cipher,
                opts.cipher.key_bytes()
            )));
        }
        check_pbkdf2(&opts.pbkdf)?;
        let key_bytes = u32::try_from(volume_key.len())
            .map_err(|_| LuksError::InvalidArgument("volume key too long".into()))?;
        let lay = layout::Layout::new(key_bytes)?;
        let uuid = opts.resolve_uuid()?;
        let mk_digest_iter = kdf_cost::digest_iterations(opts.hash, &opts.pbkdf, DIGEST_LEN)?;
        let mk_digest_salt = random_salt()?;
        let mk_digest = mk_digest(opts.hash, volume_key, &mk_digest_salt, mk_digest_iter)?;
        let keyslots = std::array::from_fn(|i| Keyslot {
            active: false,
            iterations: 0,
            salt: [0u8; SALT_LEN],
            key_material_offset: lay.keyslot_offsets[i],
            stripes: phdr::STRIPES,
        });
        let mut hdr = Luks1Header {
            phdr: Phdr {
                cipher_name: opts.cipher.cipher_name().to_string(),
                cipher_mode: opts.cipher.cipher_mode(),
                hash_spec: opts.hash.name().to_string(),
                payload_offset: lay.payload_offset,
                key_bytes,
                mk_digest,
                mk_digest_salt,
                mk_digest_iter,
                uuid,
                keyslots,
            },
        };
        // Old key material from a previous format of this file must not survive in unused
        // slots; clear the whole metadata region before anything becomes active.
        zero_range(file, 0, hdr.data_offset())?;
        hdr.write_header(file)?;
        hdr.add_keyslot(file, volume_key, passphrase, Some(0), &opts.pbkdf)?;
        let data_offset = hdr.data_offset();
        match payload_size {
            Some(size) => {
                let total = data_offset.checked_add(size).ok_or_else(|| {
                    LuksError::InvalidArgument(format!(
                        "payload size {size} overflows the file size"
                    ))
                })?;
                file.set_len(total)?;
            }
            None if file.size()? < data_offset => file.set_len(data_offset)?,
            None => {}
        }
        file.sync_all()?;
        Ok(hdr)
    }

    pub fn add_keyslot(
        &mut self,
        file: &dyn HeaderIo,
        volume_key: &SecretKey,
        passphrase: &[u8],
        slot: Option<usize>,
        pbkdf: &PbkdfOptions,
    ) -> Result<usize> {
        check_pbkdf2(pbkdf)?;
        self.verify_volume_key(volume_key)?;
        let (spec, hash) = self.usable()?;
        let slot = match slot {
            Some(s) if s >= NUM_KEYSLOTS => {
                return Err(LuksError::InvalidArgument(format!(
                    "LUKS1 has keyslots 0..{NUM_KEYSLOTS}, not {s}"
                )))
            }
            Some(s) if self.phdr.keyslots[s].active => {
                return Err(LuksError::InvalidArgument(format!(
                    "keyslot {s} is already in use"
                )))
            }
            Some(s) => s,
            None => (0..NUM_KEYSLOTS)
                .find(|&i| !self.phdr.keyslots[i].active)
                .ok_or_else(|| {
                    LuksError::InvalidArgument("all 8 LUKS1 keyslots are in use".into())
                })?,
        };
        // LUKS1 has one hash for everything: the header's hash-spec wins over pbkdf.hash.
        let opts = PbkdfOptions {
            hash,
            ..pbkdf.clone()
        };
        let Kdf::Pbkdf2 { iterations, .. } = kdf_cost::resolve(&opts, self.key_bytes())? else {
            return Err(LuksError::InvalidArgument(
                "LUKS1 keyslots use PBKDF2 only".into(),
            ));
        };
        let mut candidate = self.phdr.clone();
        {
            let ks = &mut candidate.keyslots[slot];
            ks.active = true;
            ks.iterations = iterations;
            ks.salt = random_salt()?;
            // Inactive slots of foreign headers may carry junk geometry; the checks in encode()
            // refuse anything that would overlap another slot, the header or the payload.
            if ks.stripes == 0 {
                ks.stripes = phdr::STRIPES;
            }
        }
        candidate.encode()?;
        let ks = &candidate.keyslots[slot];
        let (offset, len) = candidate.area(slot)?;
        let slot_key = kdf::derive(
            &Kdf::Pbkdf2 { hash, iterations },
            passphrase,
            &ks.salt,
            self.key_bytes(),
        )?;
        let material = af_split(volume_key, ks.stripes, hash)?;
        let mut area = Zeroizing::new(vec![0u8; len as usize]);
        area[..material.len()].copy_from_slice(&material);
        encrypt_area(&spec, &slot_key, &mut area)?;
        // Material first, durable, and only then the header that makes it reachable: a crash
        // in between leaves an unused area with junk, never an active slot without material.
        write_at(file, offset, &area)?;
        file.sync_data()?;
        let previous = std::mem::replace(&mut self.phdr, candidate);
        if let Err(e) = self.write_header(file) {
            self.phdr = previous;
            return Err(e);
        }
        Ok(slot)
    }

    pub fn remove_keyslot(&mut self, file: &dyn HeaderIo, slot: usize) -> Result<()> {
        if slot >= NUM_KEYSLOTS || !self.phdr.keyslots[slot].active {
            return Err(LuksError::InvalidArgument(format!(
                "keyslot {slot} is not active"
            )));
        }
        let (offset, len) = self.phdr.area(slot)?;
        // As cryptsetup: the material is wiped and synced first, then the header says the slot
        // is inactive. A crash in between leaves a slot that no longer opens, never an
        // inactive slot whose key material is still on disk.
        zero_range(file, offset, len)?;
        file.sync_data()?;
        let mut candidate = self.phdr.clone();
        candidate.keyslots[slot].active = false;
        candidate.keyslots[slot].iterations = 0;
        candidate.keyslots[slot].salt = [0u8; SALT_LEN];
        let previous = std::mem::replace(&mut self.phdr, candidate);
        if let Err(e) = self.write_header(file) {
            self.phdr = previous;
            return Err(e);
        }
        Ok(())
    }

    fn write_header(&self, file: &dyn HeaderIo) -> Result<()> {
        let buf = self.phdr.encode()?;
        write_at(file, 0, &buf)?;
        file.sync_data()?;
        Ok(())
    }
}

fn check_pbkdf2(pbkdf: &PbkdfOptions) -> Result<()> {
    match pbkdf.kind {
        PbkdfKind::Pbkdf2 => Ok(()),
        PbkdfKind::Argon2(v) => Err(LuksError::InvalidArgument(format!(
            "LUKS1 keyslots support only PBKDF2, not {} (use LUKS2 for argon2)",
            v.name()
        ))),
    }
}

fn mk_digest(
    hash: HashAlg,
    key: &SecretKey,
    salt: &[u8],
    iterations: u32,
) -> Result<[u8; DIGEST_LEN]> {
    let d = kdf::derive(
        &Kdf::Pbkdf2 { hash, iterations },
        key.as_bytes(),
        salt,
        DIGEST_LEN,
    )?;
    let mut out = [0u8; DIGEST_LEN];
    out.copy_from_slice(d.as_bytes());
    Ok(out)
}

fn random_salt() -> Result<[u8; SALT_LEN]> {
    let mut salt = [0u8; SALT_LEN];
    salt.copy_from_slice(SecretKey::random(SALT_LEN)?.as_bytes());
    Ok(salt)
}
