//! Recognising image formats by their magic and opening them, including backing chains.

use crate::qcow2::{self, Qcow2};
use crate::{BlockDevice, BlockError, BlockErrorKind, OpenOptions, RawFile};
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// On-disk image formats cryptblk recognises.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Raw,
    Qcow2,
    Luks,
}

impl Format {
    /// Parses a format name as `qemu-img` spells it.
    pub fn from_name(name: &str) -> Option<Format> {
        match name {
            "raw" => Some(Format::Raw),
            "qcow2" => Some(Format::Qcow2),
            "luks" => Some(Format::Luks),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Format::Raw => "raw",
            Format::Qcow2 => "qcow2",
            Format::Luks => "luks",
        }
    }
}

const LUKS_MAGIC: [u8; 6] = *b"LUKS\xba\xbe";
/// Deepest backing chain we follow; deeper chains are almost certainly a mistake or an attack.
pub const MAX_BACKING_DEPTH: usize = 16;

/// Identifies the format of `path` by its first bytes; anything unrecognised is raw.
pub fn probe_format(path: impl AsRef<Path>) -> Result<Format, BlockError> {
    let path = path.as_ref();
    let mut f = File::open(path).map_err(|e| BlockError::io("open", e).with_path(path))?;
    let mut head = [0u8; 6];
    let mut got = 0;
    while got < head.len() {
        match f.read(&mut head[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(BlockError::io("read", e).with_path(path)),
        }
    }
    Ok(if got >= 4 && head[..4] == qcow2::MAGIC {
        Format::Qcow2
    } else if got == 6 && head == LUKS_MAGIC {
        Format::Luks
    } else {
        Format::Raw
    })
}

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

/// The images already opened along one backing chain, to refuse loops and runaway depth.
#[derive(Debug, Default)]
pub(crate) struct BackingChain {
    seen: Vec<PathBuf>,
    /// Backing files are refused outright (for untrusted images, whose backing file name
    /// could make us read any host file into the guest-visible data).
    refuse_backing: bool,
}

impl BackingChain {
    /// A chain that refuses any backing file.
    pub(crate) fn refusing() -> Self {
        BackingChain {
            seen: Vec::new(),
            refuse_backing: true,
        }
    }

    pub(crate) fn enter(&mut self, path: &Path) -> Result<(), BlockError> {
        let canon = path
            .canonicalize()
            .map_err(|e| BlockError::io("open", e).with_path(path))?;
        if self.seen.contains(&canon) {
            return Err(BlockError::corrupt(format!(
                "backing chain loops back to {} ({} levels deep)",
                canon.display(),
                self.seen.len()
            ))
            .with_path(path));
        }
        if self.seen.len() >= MAX_BACKING_DEPTH {
            return Err(BlockError::unsupported(format!(
                "backing chain is deeper than {MAX_BACKING_DEPTH} images"
            ))
            .with_path(path));
        }
        self.seen.push(canon);
        Ok(())
    }
}

/// Opens the backing image `name` of the image at `image`, read-only. Relative names are
/// resolved against the image's directory, as QEMU does.
pub(crate) fn open_backing(
    image: &Path,
    name: &str,
    format: Option<&str>,
    chain: &mut BackingChain,
) -> Result<(Arc<dyn BlockDevice>, PathBuf), BlockError> {
    if chain.refuse_backing {
        return Err(BlockError::unsupported(format!(
            "image has a backing file '{name}' and backing files are not allowed here"
        ))
        .with_path(image));
    }
    if name.starts_with("json:") || (name.contains("://") && !name.starts_with('/')) {
        return Err(BlockError::unsupported(format!(
            "backing file '{name}' is a protocol or JSON specification, only local files are supported"
        ))
        .with_path(image));
    }
    let path = if Path::new(name).is_absolute() {
        PathBuf::from(name)
    } else {
        image.parent().unwrap_or(Path::new("")).join(name)
    };
    if !path.exists() {
        return Err(BlockError::new(
            BlockErrorKind::Io,
            format!(
                "backing file '{name}' not found (looked for {})",
                path.display()
            ),
        )
        .with_op("open backing file")
        .with_path(image));
    }
    let format = match format {
        Some(f) => Format::from_name(f)
            .filter(|f| *f != Format::Luks)
            .ok_or_else(|| {
                BlockError::unsupported(format!(
                    "backing file format '{f}' (only qcow2 and raw are supported)"
                ))
                .with_path(image)
            })?,
        None => match probe_format(&path)? {
            Format::Luks => {
                return Err(
                    BlockError::unsupported("LUKS backing files are not supported")
                        .with_path(&path),
                );
            }
            f => f,
        },
    };
    let dev: Arc<dyn BlockDevice> = match format {
        Format::Qcow2 => Arc::new(Qcow2::open_in_chain(&path, chain)?),
        _ => {
            chain.enter(&path)?;
            Arc::new(RawFile::open(
                &path,
                OpenOptions {
                    writable: false,
                    lock: true,
                },
            )?)
        }
    };
    Ok((dev, path))
}
