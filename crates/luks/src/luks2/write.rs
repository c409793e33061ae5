//! Creating headers and changing keyslots. Order matters for crash safety: key material is
//! written and synced before the header that refers to it; a removal rewrites the header
//! before wiping the area; the primary copy is synced before the secondary is touched.
use super::binary::{compute_checksum, BinaryHeader, HeaderCopy, BINARY_SIZE, CSUM_LEN, SALT_LEN};
use super::json::{Af, Area, Config, Digest, KdfJson, Keyslot, Metadata, Segment, SegmentSize};
use super::unlock::{digest_matches, material_len};
use super::validate::{keyslots_range, validate, MAX_KEYSLOTS};
use super::{ensure_writable, parse_cipher, Luks2Header};
use crate::kdf::{self, Argon2Variant, Kdf};
use crate::{
    af, keyslot_area, FormatOptions, HashAlg, LuksError, LuksVersion, PbkdfKind, PbkdfOptions,
    Result,
};
use base64::Engine as _;
use cryptblk_crypto::SecretKey;
use std::collections::BTreeMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use zeroize::Zeroizing;

/// cryptsetup 2.x defaults.
const HDR_SIZE: u64 = 16 * 1024;
const DATA_OFFSET: u64 = 16 * 1024 * 1024;
const STRIPES: u32 = 4000;
const SALT_BYTES: usize = 32;
const DIGEST_MIN_ITERATIONS: u32 = 1000;
/// cryptsetup spends 1/8 of a one-second budget on the volume-key digest.
const DIGEST_ITER_TIME_MS: u32 = 125;

fn random_bytes(n: usize) -> Vec<u8> {
    // Salts are public; SecretKey is just the crate's handle on the OS RNG.
    SecretKey::random(n).as_bytes().to_vec()
}

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

fn round_up(n: u64, to: u64) -> Option<u64> {
    n.checked_add(to - 1).map(|v| v / to * to)
}

impl Luks2Header {
    /// Serialize one copy: binary header, JSON padded with NULs, checksum over both.
    fn encode_copy(&self, copy: HeaderCopy) -> Result<Vec<u8>> {
        let json = serde_json::to_vec(&self.meta)
            .map_err(|e| LuksError::InvalidArgument(format!("JSON: {e}")))?;
        let hdr_size = usize::try_from(self.bin.hdr_size)
            .map_err(|_| LuksError::InvalidArgument("header size".into()))?;
        // The JSON must leave room for at least one terminating NUL.
        if json.len() >= hdr_size - BINARY_SIZE {
            return Err(LuksError::InvalidArgument(format!(
                "metadata JSON ({} bytes) does not fit the {} byte JSON area",
                json.len(),
                hdr_size - BINARY_SIZE
            )));
        }
        let idx = match copy {
            HeaderCopy::Primary => 0,
            HeaderCopy::Secondary => 1,
        };
        let mut bin = BinaryHeader {
            hdr_offset: if idx == 0 { 0 } else { self.bin.hdr_size },
            salt: self.salts[idx],
            checksum: [0; CSUM_LEN],
            ..self.bin.clone()
        };
        let alg = HashAlg::parse(&bin.checksum_alg)?;
        let mut area = vec![0u8; hdr_size];
        area[..BINARY_SIZE]
            .copy_from_slice(&bin.serialize(copy).map_err(LuksError::InvalidArgument)?);
        area[BINARY_SIZE..BINARY_SIZE + json.len()].copy_from_slice(&json);
        bin.checksum = compute_checksum(alg, &area).map_err(LuksError::InvalidArgument)?;
        area[..BINARY_SIZE]
            .copy_from_slice(&bin.serialize(copy).map_err(LuksError::InvalidArgument)?);
        Ok(area)
    }

    /// Write one copy and sync it. Exposed for crash-simulation tests.
    #[doc(hidden)]
    pub fn write_copy(&self, file: &File, copy: HeaderCopy) -> Result<()> {
        let area = self.encode_copy(copy)?;
        let offset = if copy == HeaderCopy::Primary {
            0
        } else {
            self.bin.hdr_size
        };
        file.write_all_at(&area, offset)?;
        file.sync_data()?;
        Ok(())
    }

    /// Commit the in-memory metadata: bump seqid, primary, sync, secondary, sync. The metadata
    /// is validated first so we never write a header we would refuse to read.
    fn commit(&mut self, file: &File) -> Result<()> {
        validate(&self.meta, self.bin.hdr_size).map_err(|e| {
            LuksError::InvalidArgument(format!("refusing to write invalid metadata: {e}"))
        })?;
        self.bin.seqid = self
            .bin
            .seqid
            .checked_add(1)
            .ok_or_else(|| LuksError::Corrupt("seqid overflow".into()))?;
        self.write_copy(file, HeaderCopy::Primary)?;
        self.write_copy(file, HeaderCopy::Secondary)
    }

    /// Create a LUKS2 header with the volume key in keyslot 0.
    pub fn format(
        file: &File,
        opts: &FormatOptions,
        passphrase: &[u8],
        volume_key: &SecretKey,
        payload_size: Option<u64>,
    ) -> Result<Self> {
        if opts.version != LuksVersion::V2 {
            return Err(LuksError::InvalidArgument(
                "luks2::format called for a LUKS1 image".into(),
            ));
        }
        let key_len = volume_key.len();
        if key_len != opts.cipher.key_bytes() {
            return Err(LuksError::InvalidArgument(format!(
                "volume key is {} bytes, {} needs {}",
                key_len,
                opts.cipher,
                opts.cipher.key_bytes()
            )));
        }
        let sector = opts.sector_size;
        if !(512..=4096).contains(&sector) || !sector.is_power_of_two() {
            return Err(LuksError::InvalidArgument(format!(
                "sector size {sector} is not a power of two from 512 to 4096"
            )));
        }
        if let Some(size) = payload_size {
            if !size.is_multiple_of(u64::from(sector)) {
                return Err(LuksError::InvalidArgument(format!(
                    "payload size {size} is not a multiple of the {sector} byte sector size"
                )));
            }
        }
        let uuid = match &opts.uuid {
            Some(u) => uuid::Uuid::parse_str(u)
                .map_err(|e| LuksError::InvalidArgument(format!("uuid '{u}': {e}")))?
                .hyphenated()
                .to_string(),
            None => uuid::Uuid::new_v4().hyphenated().to_string(),
        };

        let digest_iterations = match opts.pbkdf.force_iterations {
            // Forced costs are for tests and scripted setups: use the cheapest digest allowed.
            Some(_) => DIGEST_MIN_ITERATIONS,
            None => {
                let bench = PbkdfOptions {
                    kind: PbkdfKind::Pbkdf2,
                    hash: opts.hash,
                    iter_time_ms: DIGEST_ITER_TIME_MS,
                    force_iterations: None,
                    ..opts.pbkdf.clone()
                };
                match kdf::resolve(&bench, key_len)? {
                    Kdf::Pbkdf2 { iterations, .. } => iterations.max(DIGEST_MIN_ITERATIONS),
                    Kdf::Argon2 { .. } => DIGEST_MIN_ITERATIONS,
                }
            }
        };
        let digest_salt = random_bytes(SALT_BYTES);
        let digest_value = kdf::derive(
            &Kdf::Pbkdf2 {
                hash: opts.hash,
                iterations: digest_iterations,
            },
            volume_key.as_bytes(),
            &digest_salt,
            opts.hash.digest_len(),
        )?;

        let segment = Segment {
            kind: "crypt".into(),
            offset: DATA_OFFSET,
            size: SegmentSize::Dynamic,
            iv_tweak: Some(0),
            encryption: Some(opts.cipher.to_luks2_string()),
            sector_size: Some(sector),
            extra: Default::default(),
        };
        let digest = Digest {
            kind: "pbkdf2".into(),
            keyslots: Vec::new(),
            segments: vec!["0".into()],
            hash: opts.hash.name().into(),
            iterations: digest_iterations,
            salt: b64(&digest_salt),
            digest: b64(digest_value.as_bytes()),
            extra: Default::default(),
        };
        let meta = Metadata {
            keyslots: BTreeMap::new(),
            tokens: BTreeMap::new(),
            segments: BTreeMap::from([("0".to_string(), segment)]),
            digests: BTreeMap::from([("0".to_string(), digest)]),
            config: Config {
                json_size: HDR_SIZE - BINARY_SIZE as u64,
                keyslots_size: DATA_OFFSET - 2 * HDR_SIZE,
                flags: None,
                requirements: None,
                extra: Default::default(),
            },
            extra: Default::default(),
        };
        let mut salts = [[0u8; SALT_LEN]; 2];
        for s in &mut salts {
            s.copy_from_slice(&random_bytes(SALT_LEN));
        }
        let mut hdr = Luks2Header {
            bin: BinaryHeader {
                hdr_size: HDR_SIZE,
                seqid: 0,
                label: opts.label.clone().unwrap_or_default(),
                checksum_alg: "sha256".into(),
                salt: salts[0],
                uuid,
                subsystem: String::new(),
                hdr_offset: 0,
                checksum: [0; CSUM_LEN],
            },
            salts,
            meta,
        };
        // Check label length etc. before touching the file.
        hdr.encode_copy(HeaderCopy::Primary)?;

        let min_len = match payload_size {
            Some(size) => DATA_OFFSET
                .checked_add(size)
                .ok_or_else(|| LuksError::InvalidArgument("payload size overflows".into()))?,
            None => DATA_OFFSET.max(file.metadata()?.len()),
        };
        file.set_len(min_len)?;
        // Old headers or keyslots (of any format) must not survive in the metadata area.
        let zeros = vec![0u8; 1024 * 1024];
        let mut off = 0;
        while off < DATA_OFFSET {
            file.write_all_at(&zeros, off)?;
            off += zeros.len() as u64;
        }
        hdr.add_keyslot_with_hash(
            file,
            volume_key,
            passphrase,
            Some(0),
            &opts.pbkdf,
            opts.hash,
        )?;
        Ok(hdr)
    }

    /// Add a keyslot holding `volume_key` under `passphrase`; returns its id.
    pub fn add_keyslot(
        &mut self,
        file: &File,
        volume_key: &SecretKey,
        passphrase: &[u8],
        slot: Option<usize>,
        pbkdf: &PbkdfOptions,
    ) -> Result<usize> {
        self.add_keyslot_with_hash(file, volume_key, passphrase, slot, pbkdf, pbkdf.hash)
    }

    fn add_keyslot_with_hash(
        &mut self,
        file: &File,
        volume_key: &SecretKey,
        passphrase: &[u8],
        slot: Option<usize>,
        pbkdf: &PbkdfOptions,
        af_hash: HashAlg,
    ) -> Result<usize> {
        ensure_writable(self)?;
        let (digest_id, digest) = self.segment_digest()?;
        let digest_id = digest_id.to_string();
        if !digest_matches(digest, volume_key)? {
            return Err(LuksError::InvalidArgument(
                "the volume key does not match the header's digest".into(),
            ));
        }
        let id = match slot {
            Some(id) if id >= MAX_KEYSLOTS => {
                return Err(LuksError::InvalidArgument(format!(
                    "keyslot {id} out of range (0..{MAX_KEYSLOTS})"
                )))
            }
            Some(id) if self.meta.keyslots.contains_key(&id.to_string()) => {
                return Err(LuksError::InvalidArgument(format!(
                    "keyslot {id} is already in use"
                )))
            }
            Some(id) => id,
            None => (0..MAX_KEYSLOTS)
                .find(|id| !self.meta.keyslots.contains_key(&id.to_string()))
                .ok_or_else(|| LuksError::InvalidArgument("all keyslots are in use".into()))?,
        };
        let key_len = volume_key.len();
        let (_, seg) = self.segment()?;
        let spec = parse_cipher(seg.encryption.as_deref().unwrap_or_default(), key_len)?;
        let material = material_len(key_len, STRIPES)
            .ok_or_else(|| LuksError::InvalidArgument("key too long".into()))?;
        let area_size = round_up(material as u64, 4096)
            .ok_or_else(|| LuksError::InvalidArgument("key too long".into()))?;
        let offset = self.allocate_area(area_size)?;

        let kdf = kdf::resolve(pbkdf, key_len)?;
        let salt = random_bytes(SALT_BYTES);
        let slot_key = kdf::derive(&kdf, passphrase, &salt, key_len)?;
        let split = af::af_split(volume_key, STRIPES, af_hash);
        let mut buf = Zeroizing::new(vec![0u8; material]);
        let n = split.len().min(material);
        buf[..n].copy_from_slice(&split[..n]);
        keyslot_area::encrypt_area(&spec, &slot_key, &mut buf)?;
        file.write_all_at(&buf, offset)?;
        file.sync_data()?;

        let kdf_json = match kdf {
            Kdf::Pbkdf2 { hash, iterations } => KdfJson {
                kind: "pbkdf2".into(),
                hash: Some(hash.name().into()),
                iterations: Some(iterations),
                time: None,
                memory: None,
                cpus: None,
                salt: b64(&salt),
                extra: Default::default(),
            },
            Kdf::Argon2 {
                variant,
                time,
                memory_kib,
                parallel,
            } => KdfJson {
                kind: match variant {
                    Argon2Variant::Argon2i => "argon2i",
                    Argon2Variant::Argon2id => "argon2id",
                }
                .into(),
                hash: None,
                iterations: None,
                time: Some(time),
                memory: Some(memory_kib),
                cpus: Some(parallel),
                salt: b64(&salt),
                extra: Default::default(),
            },
        };
        let keyslot = Keyslot {
            kind: "luks2".into(),
            key_size: key_len as u32,
            af: Some(Af {
                kind: "luks1".into(),
                stripes: STRIPES,
                hash: af_hash.name().into(),
                extra: Default::default(),
            }),
            area: Area {
                kind: "raw".into(),
                offset,
                size: area_size,
                encryption: Some(spec.to_luks2_string()),
                key_size: Some(key_len as u32),
                extra: Default::default(),
            },
            kdf: Some(kdf_json),
            priority: None,
            extra: Default::default(),
        };
        let before = self.meta.clone();
        self.meta.keyslots.insert(id.to_string(), keyslot);
        if let Some(d) = self.meta.digests.get_mut(&digest_id) {
            d.keyslots.push(id.to_string());
        }
        if let Err(e) = self.commit(file) {
            self.meta = before;
            return Err(e);
        }
        Ok(id)
    }

    /// Lowest 4096-aligned gap in the keyslots area that fits `size` bytes.
    fn allocate_area(&self, size: u64) -> Result<u64> {
        let (start, end) = keyslots_range(self.bin.hdr_size, &self.meta)
            .ok_or_else(|| LuksError::Corrupt("keyslots area overflows".into()))?;
        let mut used: Vec<(u64, u64)> = self
            .meta
            .keyslots
            .values()
            .map(|k| (k.area.offset, k.area.offset.saturating_add(k.area.size)))
            .collect();
        used.sort_unstable();
        let mut candidate = start;
        for (s, e) in used {
            if candidate.checked_add(size).is_some_and(|c| c <= s) {
                break;
            }
            candidate = candidate.max(round_up(e, 4096).unwrap_or(u64::MAX));
        }
        match candidate.checked_add(size) {
            Some(c) if c <= end => Ok(candidate),
            _ => Err(LuksError::InvalidArgument(format!(
                "no room for a {size} byte keyslot area in the keyslots area"
            ))),
        }
    }

    /// Remove a keyslot: the header stops referring to it first, then its area is wiped.
    pub fn remove_keyslot(&mut self, file: &File, slot: usize) -> Result<()> {
        ensure_writable(self)?;
        let key = slot.to_string();
        let area = match self.meta.keyslots.get(&key) {
            Some(k) => k.area.clone(),
            None => {
                return Err(LuksError::InvalidArgument(format!(
                    "keyslot {slot} is not in use"
                )))
            }
        };
        let before = self.meta.clone();
        self.meta.keyslots.remove(&key);
        for d in self.meta.digests.values_mut() {
            d.keyslots.retain(|k| *k != key);
        }
        // Tokens name the keyslots they unlock; drop the dangling reference as cryptsetup does.
        for tok in self.meta.tokens.values_mut() {
            if let Some(list) = tok.get_mut("keyslots").and_then(|v| v.as_array_mut()) {
                list.retain(|v| v.as_str() != Some(key.as_str()));
            }
        }
        if let Err(e) = self.commit(file) {
            self.meta = before;
            return Err(e);
        }
        // Validation bounded the area by the keyslots area (at most 128 MiB).
        let zeros = vec![0u8; 64 * 1024];
        let mut off = area.offset;
        let end = area.offset.saturating_add(area.size);
        while off < end {
            let n = (end - off).min(zeros.len() as u64) as usize;
            file.write_all_at(&zeros[..n], off)?;
            off += n as u64;
        }
        file.sync_data()?;
        Ok(())
    }
}
