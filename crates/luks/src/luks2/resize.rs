//! Resizing the data segment: a `dynamic` segment follows the device, a fixed-length one is
//! rewritten in both header copies (the crash-safe commit of `write`).
use super::json::SegmentSize;
use super::Luks2Header;
use crate::io::HeaderIo;
use crate::{LuksError, Result};

impl Luks2Header {
    /// Makes the data segment `size` bytes long. Returns whether the header was rewritten:
    /// only a fixed-length segment is (a `dynamic` one already ends where the device does).
    /// The caller checks that the image is writable (`read_only_reason`: one segment, no
    /// reencryption) and that `size` is a whole number of encryption sectors.
    pub fn set_data_size(&mut self, file: &dyn HeaderIo, size: u64) -> Result<bool> {
        let id = {
            let (id, seg) = self.segment()?;
            match seg.size {
                SegmentSize::Dynamic => return Ok(false),
                SegmentSize::Fixed(n) if n == size => return Ok(false),
                SegmentSize::Fixed(_) => id.to_string(),
            }
        };
        let sector = u64::from(self.sector_size());
        if size == 0 || !size.is_multiple_of(sector) {
            return Err(LuksError::InvalidArgument(format!(
                "a data segment of {size} bytes is not a positive whole number of {sector}-byte \
                 sectors"
            )));
        }
        let seg = self.meta.segments.get_mut(&id).ok_or_else(|| {
            LuksError::Corrupt(format!("segment {id} vanished from the metadata"))
        })?;
        seg.size = SegmentSize::Fixed(size);
        self.commit(file)?;
        Ok(true)
    }
}
