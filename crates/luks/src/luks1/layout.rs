//! Where cryptsetup puts LUKS1 keyslots and the payload, so our images look like its own.
use super::phdr::{NUM_KEYSLOTS, PHDR_SIZE, SECTOR, STRIPES};
use crate::{LuksError, Result};

/// Keyslot areas start on 4 KiB boundaries (cryptsetup's LUKS_ALIGN_KEYSLOTS).
const KEYSLOT_ALIGN: u64 = 4096;
/// The payload starts on a 1 MiB boundary (cryptsetup's default data alignment).
const PAYLOAD_ALIGN: u64 = 1 << 20;

pub(super) struct Layout {
    /// In 512-byte sectors.
    pub keyslot_offsets: [u32; NUM_KEYSLOTS],
    pub payload_offset: u32,
}

impl Layout {
    pub fn new(key_bytes: u32) -> Result<Self> {
        let area = (u64::from(key_bytes) * u64::from(STRIPES)).next_multiple_of(KEYSLOT_ALIGN);
        let first = (PHDR_SIZE as u64).next_multiple_of(KEYSLOT_ALIGN);
        let mut offsets = [0u32; NUM_KEYSLOTS];
        for (i, o) in offsets.iter_mut().enumerate() {
            *o = to_sectors(first + area * i as u64)?;
        }
        let end = first + area * NUM_KEYSLOTS as u64;
        let payload_offset = to_sectors(end.next_multiple_of(PAYLOAD_ALIGN))?;
        Ok(Layout {
            keyslot_offsets: offsets,
            payload_offset,
        })
    }
}

fn to_sectors(bytes: u64) -> Result<u32> {
    u32::try_from(bytes / SECTOR)
        .map_err(|_| LuksError::InvalidArgument("LUKS1 layout too large".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_cryptsetup_offsets() {
        // Values from `cryptsetup luksDump` of images it formatted with default alignment.
        let l = Layout::new(64).unwrap();
        assert_eq!(
            l.keyslot_offsets,
            [8, 512, 1016, 1520, 2024, 2528, 3032, 3536]
        );
        assert_eq!(l.payload_offset, 4096);
        let l = Layout::new(32).unwrap();
        assert_eq!(l.keyslot_offsets[..3], [8, 264, 520]);
        assert_eq!(l.payload_offset, 4096);
        let l = Layout::new(16).unwrap();
        assert_eq!(l.keyslot_offsets[1], 136);
        assert_eq!(l.payload_offset, 2048);
    }
}
