//! Opening an image of a known format as a block device of its guest-visible contents.

use crate::{BlockDevice, BlockError, BlockErrorKind, Format, OpenOptions, Qcow2, RawFile};
use std::path::Path;
use std::sync::Arc;

/// Opens an image as a block device of its guest-visible contents. qcow2 is read-only. A LUKS
/// image opens as its raw container (header and ciphertext); decrypting it is the job of the
/// encrypted volume layer.
pub fn open_image(
    path: impl AsRef<Path>,
    format: Format,
    writable: bool,
) -> Result<Arc<dyn BlockDevice>, BlockError> {
    let path = path.as_ref();
    match format {
        Format::Raw | Format::Luks => Ok(Arc::new(RawFile::open(
            path,
            OpenOptions {
                writable,
                lock: true,
            },
        )?)),
        Format::Qcow2 if writable => Err(BlockError::new(
            BlockErrorKind::Unsupported,
            "qcow2 images can only be opened read-only by cryptblk",
        )
        .with_path(path)),
        Format::Qcow2 => Ok(Arc::new(Qcow2::open(path)?)),
    }
}
