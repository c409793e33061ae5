//! Creating a new LUKS2 header with cryptsetup 2.x's default layout.
use super::binary::{BinaryHeader, HeaderCopy, BINARY_SIZE, CSUM_LEN, SALT_LEN};
use super::json::{Config, Digest, Metadata, Segment, SegmentSize};
use super::write::{b64, random_bytes, SALT_BYTES};
use super::Luks2Header;
use crate::io::HeaderIo;
use crate::kdf::{self, Kdf};
use crate::kdf_cost;
use crate::{FormatOptions, LuksError, LuksVersion, Result};
use cryptblk_crypto::SecretKey;
use std::collections::BTreeMap;

const HDR_SIZE: u64 = 16 * 1024;
const DATA_OFFSET: u64 = 16 * 1024 * 1024;

impl Luks2Header {
    /// Create a LUKS2 header with the volume key in keyslot 0.
    pub fn format(
        file: &dyn HeaderIo,
        opts: &FormatOptions,
        passphrase: &[u8],
        volume_key: &SecretKey,
        payload_size: Option<u64>,
    ) -> Result<Self> {
        Self::format_at(
            file,
            opts,
            passphrase,
            volume_key,
            payload_size,
            DATA_OFFSET,
        )
    }

    /// As `format`, with the data (and so the end of the keyslots area) at `data_offset`
    /// instead of cryptsetup's default 16 MiB (`reencrypt --encrypt` puts the header in the
    /// room `--reduce-device-size` makes).
    pub(crate) fn format_at(
        file: &dyn HeaderIo,
        opts: &FormatOptions,
        passphrase: &[u8],
        volume_key: &SecretKey,
        payload_size: Option<u64>,
        data_offset: u64,
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
        let uuid = opts.resolve_uuid()?;

        let digest_iterations = kdf_cost::digest_iterations(opts.hash, &opts.pbkdf, key_len)?;
        let digest_salt = random_bytes(SALT_BYTES)?;
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
            offset: data_offset,
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
                keyslots_size: data_offset.saturating_sub(2 * HDR_SIZE) / 4096 * 4096,
                flags: None,
                requirements: None,
                extra: Default::default(),
            },
            extra: Default::default(),
        };
        let mut salts = [[0u8; SALT_LEN]; 2];
        for s in &mut salts {
            s.copy_from_slice(&random_bytes(SALT_LEN)?);
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
            placement: super::validate::Placement::Attached,
        };
        // Check label length etc. before touching the file.
        hdr.encode_copy(HeaderCopy::Primary)?;

        let min_len = match payload_size {
            Some(size) => data_offset
                .checked_add(size)
                .ok_or_else(|| LuksError::InvalidArgument("payload size overflows".into()))?,
            None => data_offset.max(file.size()?),
        };
        file.set_len(min_len)?;
        // Old headers or keyslots (of any format) must not survive in the metadata area.
        let zeros = vec![0u8; 1024 * 1024];
        let mut off = 0;
        while off < data_offset {
            let n = (data_offset - off).min(zeros.len() as u64) as usize;
            file.write_all_at(&zeros[..n], off)?;
            off += n as u64;
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
}
