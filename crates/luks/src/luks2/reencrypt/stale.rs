//! Which blocks of an interrupted hotzone still hold old ciphertext, found as cryptsetup finds
//! them on its next run: with `checksum`, each block whose hash still matches the stored one
//! holds old ciphertext, the others are new already; with `journal`, the whole hotzone counts
//! as old, its old ciphertext saved in the keyslot area. Until recovery writes, reads use the
//! same classification, so a read-only open returns the right data.
use super::layout::SegmentExtent;
use super::{unsupported, ReencryptState, Resilience};
use crate::io::HeaderIo;
use crate::{LuksError, Result};

/// Which blocks of an interrupted hotzone still hold old ciphertext (read-only view before
/// recovery has rewritten them).
#[derive(Debug, Clone)]
pub(super) struct StaleBlocks {
    pub(super) start: u64,
    pub(super) block: u64,
    pub(super) old: Vec<bool>,
    /// Resilience `journal`: the old ciphertext of the whole hotzone is at this image offset
    /// (the reencrypt keyslot area), whatever the hotzone itself holds now.
    pub(super) journal: Option<u64>,
}

impl StaleBlocks {
    /// Sorts the blocks of the interrupted hotzone `hot` into old and new: with resilience
    /// `journal` all are old (the journal holds their old ciphertext, in blocks of
    /// `alignment`), with `checksum` those whose hash still matches the stored one. The
    /// checksums are in the header's keyslots area (`file`), the hotzone on `data`.
    pub(super) fn classify(
        file: &dyn HeaderIo,
        data: &dyn HeaderIo,
        state: &ReencryptState,
        hot: &SegmentExtent,
        alignment: u64,
    ) -> Result<StaleBlocks> {
        // A decryption's moved segment may be journalled too (datashift-journal).
        if matches!(
            state.resilience,
            Resilience::Journal | Resilience::DatashiftJournal { .. }
        ) {
            let block = alignment;
            if hot.len > state.area_size || !hot.len.is_multiple_of(block) {
                return Err(LuksError::Corrupt(format!(
                    "hotzone of {} bytes does not fit the {}-byte journal in whole {block}-byte sectors",
                    hot.len, state.area_size
                )));
            }
            return Ok(StaleBlocks {
                start: hot.logical_start,
                block,
                old: vec![true; (hot.len / block) as usize],
                journal: Some(state.area_offset),
            });
        }
        // A decryption's moved segment is protected by checksums too (datashift-checksum).
        let (Resilience::Checksum { hash, block_size }
        | Resilience::DatashiftChecksum {
            hash, block_size, ..
        }) = state.resilience
        else {
            return Err(unsupported(
                "recovery of an interrupted hotzone with resilience",
                state.resilience.name(),
                "only checksum and journal hotzones can be recovered (with `none` the interrupted hotzone is lost, as in cryptsetup)",
            ));
        };
        let block = u64::from(block_size);
        if !hot.len.is_multiple_of(block) {
            return Err(LuksError::Corrupt(format!(
                "hotzone of {} bytes is not whole {block}-byte checksum blocks",
                hot.len
            )));
        }
        let count = (hot.len / block) as usize;
        let hlen = hash.digest_len();
        let need = (count as u64) * hlen as u64;
        if need > state.area_size {
            return Err(LuksError::Corrupt(format!(
                "hotzone needs {need} bytes of checksums, the area holds {}",
                state.area_size
            )));
        }
        let mut sums = vec![0u8; need as usize];
        crate::io::read_at(file, state.area_offset, &mut sums, "reencryption checksums")?;
        let mut old = Vec::with_capacity(count);
        let mut buf = vec![0u8; block as usize];
        for i in 0..count {
            crate::io::read_at(
                data,
                hot.device_offset + i as u64 * block,
                &mut buf,
                "hotzone",
            )?;
            let got = hash.digest(&[&buf]);
            old.push(got[..] == sums[i * hlen..(i + 1) * hlen]);
        }
        Ok(StaleBlocks {
            start: hot.logical_start,
            block,
            old,
            journal: None,
        })
    }
}
