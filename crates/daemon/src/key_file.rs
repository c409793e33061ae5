//! Passphrases the daemon reads itself: a key file named in a disk's configuration (the whole
//! file is the passphrase, as with cryptsetup's `--key-file`), or `-` for the daemon's stdin.
//! Held in zeroizing buffers; never logged.
use crate::error::{Context, Error, Result};
use std::io::Read;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use zeroize::Zeroizing;

/// A passphrase, wiped from memory when dropped.
pub type Passphrase = Zeroizing<Vec<u8>>;

static STDIN_TAKEN: AtomicBool = AtomicBool::new(false);

/// Claims the process's stdin for one passphrase: a second secret read from it would
/// silently get nothing (or the rest of the first).
pub fn claim_stdin() -> Result<()> {
    if STDIN_TAKEN.swap(true, Ordering::SeqCst) {
        return Err(Error::usage(
            "stdin already supplied another passphrase: pass this one with a key file",
        ));
    }
    Ok(())
}

/// Reads the passphrase in `path` (`-`: all of stdin).
pub fn read_key_file(path: &Path) -> Result<Passphrase> {
    let mut buf = Zeroizing::new(Vec::new());
    if path == Path::new("-") {
        claim_stdin()?;
        std::io::stdin()
            .lock()
            .read_to_end(&mut buf)
            .context("reading the key from stdin")?;
    } else {
        std::fs::File::open(path)
            .and_then(|mut f| f.read_to_end(&mut buf))
            .with_context(|| format!("reading key file {}", path.display()))?;
    }
    if buf.is_empty() {
        return Err(Error::usage(format!(
            "the key file {} is empty: put the passphrase in it (every byte counts)",
            path.display()
        )));
    }
    Ok(buf)
}

#[cfg(test)]
mod tests {
    use super::*;
    use cryptblk_control::api::ErrorKind;

    #[test]
    fn whole_file_newlines_included_and_clear_errors() {
        let dir = tempfile::tempdir().unwrap();
        let key = dir.path().join("k");
        std::fs::write(&key, b"secret\n").unwrap();
        assert_eq!(read_key_file(&key).unwrap().as_slice(), b"secret\n");
        let missing = read_key_file(&dir.path().join("none")).unwrap_err();
        assert_eq!(missing.kind(), ErrorKind::Io);
        assert!(crate::error::chain(&missing).contains("reading key file"));
        std::fs::write(&key, b"").unwrap();
        assert_eq!(read_key_file(&key).unwrap_err().kind(), ErrorKind::Usage);
    }
}
