//! Recognising image formats by their names and magic numbers. It knows every format's magic
//! so that it needs none of their readers (the qcow2 reader asks it to identify backing files).

use crate::BlockError;
use std::fs::File;
use std::io::Read;
use std::path::Path;

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

/// The first bytes of a qcow2 image (docs/interop/qcow2.txt).
pub(crate) const QCOW2_MAGIC: [u8; 4] = *b"QFI\xfb";
const LUKS_MAGIC: [u8; 6] = *b"LUKS\xba\xbe";

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
    Ok(if got >= 4 && head[..4] == QCOW2_MAGIC {
        Format::Qcow2
    } else if got == 6 && head == LUKS_MAGIC {
        Format::Luks
    } else {
        Format::Raw
    })
}
