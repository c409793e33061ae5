//! Following a qcow2 image's backing file: resolving its name, identifying its format, and
//! refusing loops, runaway depth and (for untrusted images) any backing file at all.

use super::Qcow2;
use crate::format::{probe_format, Format};
use crate::{BlockDevice, BlockError, BlockErrorKind, OpenOptions, RawFile};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Deepest backing chain we follow; deeper chains are almost certainly a mistake or an attack.
pub const MAX_BACKING_DEPTH: usize = 16;

/// The images already opened along one backing chain, to refuse loops and runaway depth.
#[derive(Debug, Default)]
pub(super) struct BackingChain {
    seen: Vec<PathBuf>,
    /// Backing files are refused outright (for untrusted images, whose backing file name
    /// could make us read any host file into the guest-visible data).
    refuse_backing: bool,
}

impl BackingChain {
    /// A chain that refuses any backing file.
    pub(super) fn refusing() -> Self {
        BackingChain {
            seen: Vec::new(),
            refuse_backing: true,
        }
    }

    pub(super) fn enter(&mut self, path: &Path) -> Result<(), BlockError> {
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
pub(super) fn open_backing(
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
