//! Resizing a disk: the image (file or RBD image) and, for LUKS, the payload the header
//! describes, so that what a guest sees is the size asked for.
//!
//! The order keeps every moment consistent for requests in flight and for a crash: growing,
//! the image grows first, then a fixed-length LUKS2 segment is rewritten (both copies), then
//! the payload's range check admits the new sectors; shrinking, the range check refuses the
//! cut sectors first, then the header, then the image is cut. A step that fails undoes the
//! ones before it, so a refused resize (a full filesystem, a file size limit, a pool quota)
//! leaves the disk at its old size.
// `ResizeError::Image` carries its `BlockError` unboxed, so that whoever walks the error chain
// (the daemon's error kinds, the CLI's exit statuses) finds it by its type; a resize is rare,
// so the size of its `Result` does not matter.
#![allow(clippy::result_large_err)]

use crate::{CryptDevice, LuksVolume, Volume};
use cryptblk_block::{BlockDevice, BlockError, Container};
use cryptblk_luks::{LuksError, LuksImage};
use std::path::{Path, PathBuf};

/// The sector of a raw disk: virtio-blk and NBD clients count in 512-byte units.
pub const RAW_SECTOR: u64 = 512;

/// What a resize did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resized {
    /// The size the guest saw before, in bytes.
    pub old: u64,
    /// The size it sees now.
    pub new: u64,
    /// A fixed-length LUKS2 data segment was rewritten in both header copies.
    pub header_updated: bool,
}

/// Why a resize was refused; the disk keeps its old size.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ResizeError {
    #[error(
        "{}: shrinking from {old} to {new} bytes discards the data past {new}; allow the shrink \
         (cryptblk resize --allow-shrink, ctl disk-resize --allow-shrink) if that is meant",
        name.display()
    )]
    Shrink { name: PathBuf, old: u64, new: u64 },
    #[error(
        "{}: {new} bytes is not a positive multiple of the disk's {sector}-byte sector size; \
         use {rounded} (the next multiple up)",
        name.display()
    )]
    Unaligned {
        name: PathBuf,
        new: u64,
        sector: u64,
        rounded: u64,
    },
    // The cause is not repeated here: error chains print it after this.
    #[error("{}: resizing the image to {len} bytes", name.display())]
    Image {
        name: PathBuf,
        len: u64,
        #[source]
        source: BlockError,
    },
    #[error("{}: updating the LUKS header", name.display())]
    Header {
        name: PathBuf,
        #[source]
        source: LuksError,
    },
}

impl ResizeError {
    /// The request itself is wrong (a shrink not allowed, a size off the sector grid), as
    /// opposed to the storage refusing it.
    pub fn is_bad_request(&self) -> bool {
        matches!(
            self,
            ResizeError::Shrink { .. } | ResizeError::Unaligned { .. }
        )
    }
}

/// Checks a resize of a disk of `old` bytes in `sector`-byte sectors to `new` bytes.
fn check(
    name: &Path,
    old: u64,
    new: u64,
    sector: u64,
    allow_shrink: bool,
) -> Result<(), ResizeError> {
    if new == 0 || !new.is_multiple_of(sector) {
        return Err(ResizeError::Unaligned {
            name: name.to_path_buf(),
            new,
            sector,
            rounded: new.div_ceil(sector).max(1).saturating_mul(sector),
        });
    }
    if new < old && !allow_shrink {
        return Err(ResizeError::Shrink {
            name: name.to_path_buf(),
            old,
            new,
        });
    }
    Ok(())
}

/// Resizes a raw image (no encryption) that is not served to `size` bytes: the steps of a
/// served one ([`Volume::resize`]) without a payload's range check to follow.
pub fn resize_raw(
    image: &dyn Container,
    size: u64,
    allow_shrink: bool,
) -> Result<Resized, ResizeError> {
    resize_plaintext(image, None, size, allow_shrink)
}

impl Volume {
    /// Resizes the disk while it serves to `size` bytes as the guest sees them: a LUKS
    /// payload (the image to the payload's end, a fixed-length LUKS2 segment rewritten) or a
    /// raw image. Its queues see the new size at once, in the order the module's head tells;
    /// a step that fails undoes the ones before it. Refused while a reencryption's parts are
    /// served.
    pub fn resize(&self, size: u64, allow_shrink: bool) -> Result<Resized, ResizeError> {
        self.crypt
            .resize(self.container.as_ref(), size, allow_shrink)
    }
}

impl CryptDevice {
    /// Resizes the volume this device serves to `size` bytes: a LUKS payload as
    /// `LuksVolume::resize` does (`file` is its image), a plaintext one (a raw image) by the
    /// image itself. Refused while a reencryption's parts are served.
    pub fn resize(
        &self,
        file: &dyn Container,
        size: u64,
        allow_shrink: bool,
    ) -> Result<Resized, ResizeError> {
        if self.segments().is_split() {
            return Err(ResizeError::Image {
                name: file.name().to_path_buf(),
                len: size,
                source: BlockError::unsupported(
                    "the volume is in mid-reencryption: finish it (`cryptblk ctl reencrypt-start`) before resizing",
                ),
            });
        }
        if self.segments().is_plaintext() {
            resize_plaintext(file, Some(self), size, allow_shrink)
        } else {
            resize_luks_payload(file, Some(self), size, allow_shrink)
        }
    }
}

/// A raw image, served as a plaintext volume (`open`) or not: growing, the image grows before
/// the volume's range check admits the new bytes; shrinking, the range check refuses the cut
/// bytes before the image is cut.
fn resize_plaintext(
    file: &dyn Container,
    open: Option<&CryptDevice>,
    size: u64,
    allow_shrink: bool,
) -> Result<Resized, ResizeError> {
    let name = file.name().to_path_buf();
    let old = match open {
        Some(device) => device.size(),
        None => file.size(),
    };
    check(&name, old, size, RAW_SECTOR, allow_shrink)?;
    let image_err = |len, source| ResizeError::Image {
        name: name.clone(),
        len,
        source,
    };
    let set_open_size = |size| match open {
        Some(device) => device.set_size(size),
        None => Ok(()),
    };
    if size > old {
        let old_len = file.size();
        if size > old_len {
            file.set_len(size).map_err(|e| image_err(size, e))?;
        }
        if let Err(e) = set_open_size(size) {
            if size > old_len {
                undo(file.set_len(old_len), &name);
            }
            return Err(image_err(size, e));
        }
    } else if size < old {
        set_open_size(size).map_err(|e| image_err(size, e))?;
        if let Err(e) = file.set_len(size) {
            undo(set_open_size(old), &name);
            return Err(image_err(size, e));
        }
    }
    Ok(Resized {
        old,
        new: size,
        header_updated: false,
    })
}

impl LuksVolume {
    /// Resizes the decrypted payload to `size` bytes (a whole number of encryption sectors):
    /// the image grows or shrinks to the payload's end, and a fixed-length LUKS2 segment is
    /// rewritten. Safe while the volume serves: its queues see the new size at once. The
    /// header is read again first, so keyslots changed since the volume opened are kept.
    pub fn resize(&self, size: u64, allow_shrink: bool) -> Result<Resized, ResizeError> {
        resize_luks_payload(
            self.container().as_ref(),
            Some(self.device()),
            size,
            allow_shrink,
        )
    }
}

/// Resizes a LUKS image that is not open (no key needed: the payload's ciphertext is not
/// touched, only the image's length and the header's segment size).
pub fn resize_luks(
    file: &dyn Container,
    size: u64,
    allow_shrink: bool,
) -> Result<Resized, ResizeError> {
    resize_luks_payload(file, None, size, allow_shrink)
}

/// The steps of a LUKS resize; `open` is the payload served meanwhile, whose range check
/// follows.
fn resize_luks_payload(
    file: &dyn Container,
    open: Option<&CryptDevice>,
    size: u64,
    allow_shrink: bool,
) -> Result<Resized, ResizeError> {
    let name = file.name().to_path_buf();
    let header_err = |source| ResizeError::Header {
        name: name.clone(),
        source,
    };
    let image_err = |len, source| ResizeError::Image {
        name: name.clone(),
        len,
        source,
    };
    let (mut header, _) = LuksImage::read(file.header_io()).map_err(header_err)?;
    let old_len = file.size();
    let old = match open {
        Some(device) => device.size(),
        None => header.data_size(old_len).map_err(header_err)?,
    };
    let sector = u64::from(header.sector_size());
    check(&name, old, size, sector, allow_shrink)?;
    if size == old {
        return Ok(Resized {
            old,
            new: size,
            header_updated: false,
        });
    }
    // The range check of the open payload, if any.
    let set_open_size = |size| match open {
        Some(device) => device.set_size(size),
        None => Ok(()),
    };
    let new_len = header.data_offset().checked_add(size).ok_or_else(|| {
        image_err(
            u64::MAX,
            BlockError::unsupported(format!("a payload of {size} bytes is too large")),
        )
    })?;
    let header_updated = if size > old {
        let grow = new_len > old_len;
        if grow {
            file.set_len(new_len).map_err(|e| image_err(new_len, e))?;
        }
        let updated = match header.set_data_size(file.header_io(), size) {
            Ok(updated) => updated,
            Err(e) => {
                if grow {
                    undo(file.set_len(old_len), &name);
                }
                return Err(header_err(e));
            }
        };
        set_open_size(size).map_err(|e| image_err(new_len, e))?;
        updated
    } else {
        set_open_size(size).map_err(|e| image_err(new_len, e))?;
        let updated = match header.set_data_size(file.header_io(), size) {
            Ok(updated) => updated,
            Err(e) => {
                undo(set_open_size(old), &name);
                return Err(header_err(e));
            }
        };
        if new_len < old_len {
            if let Err(e) = file.set_len(new_len) {
                if updated {
                    let restored = header
                        .set_data_size(file.header_io(), old)
                        .map(|_| ())
                        .map_err(|e| BlockError::unsupported(e.to_string()));
                    undo(restored, &name);
                }
                undo(set_open_size(old), &name);
                return Err(image_err(new_len, e));
            }
        }
        updated
    };
    Ok(Resized {
        old,
        new: size,
        header_updated,
    })
}

/// A step undoing a failed resize; its own failure can only be logged (the error returned is
/// the one that made the resize fail).
fn undo(result: Result<(), BlockError>, name: &Path) {
    if let Err(e) = result {
        tracing::error!(image = %name.display(), "undoing a failed resize: {e}");
    }
}
