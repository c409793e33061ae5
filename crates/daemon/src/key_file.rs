//! Passphrases the daemon reads itself: a key file named in a disk's configuration (the whole
//! file is the passphrase, as with cryptsetup's `--key-file`), or `-` for the daemon's stdin.
//! Held in zeroizing buffers; never logged. A control request may instead pass the passphrase
//! as a file descriptor (SCM_RIGHTS, `"key-fd": N`), read by [`read_key_fd`] under the same
//! rules, or encrypted with the daemon's master key (`"key-secret"`, see [`crate::secret`]),
//! so a key held by an orchestrator never has to sit in a file.
//!
//! A key file must be a regular file or a pipe (`-`, `/dev/stdin`, a shell's `<(...)`): a
//! directory or a device (`/dev/zero` reads forever) is refused before anything is read, and
//! so is more than [`MAX_KEY_FILE_BYTES`]. A key file its group or others may read is used,
//! with a warning. The bytes are read into buffers that are never reallocated by `Vec`
//! (which would leave the earlier bytes behind in freed memory): a buffer that must grow is
//! copied into a bigger zeroizing one by hand, and the smaller one is wiped.
use crate::error::{Context, Error, Result};
use rustix::event::{poll, PollFd, PollFlags, Timespec};
use rustix::io::Errno;
use std::io::Read;
use std::os::fd::OwnedFd;
use std::os::unix::fs::{FileExt, FileTypeExt, PermissionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use zeroize::Zeroizing;

/// A passphrase, wiped from memory when dropped.
pub type Passphrase = Zeroizing<Vec<u8>>;

/// The largest key file read: cryptsetup's compiled-in default (`Maximum keyfile size:
/// 8192kB` in `cryptsetup --help`), so every key file cryptsetup reads by default opens
/// here too, and a pipe that never ends is cut off.
pub const MAX_KEY_FILE_BYTES: usize = 8192 * 1024;

/// The longest passphrase typed at a prompt or given as one line of stdin (cryptsetup's
/// "maximum interactive passphrase length").
pub const MAX_PASSPHRASE_LINE_BYTES: usize = 512;

/// The first buffer for a source of unknown length (a pipe): most keys fit.
const FIRST_CAPACITY: usize = 4096;

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
    let buf = if path == Path::new("-") {
        claim_stdin()?;
        let mut stdin = raw_stdin().context("reading the key from stdin")?;
        read_capped(&mut stdin, MAX_KEY_FILE_BYTES, 0, None)
            .context("reading the key from stdin")?
            .ok_or_else(|| too_large(path))?
    } else {
        let mut file = std::fs::File::open(path)
            .with_context(|| format!("reading key file {}", path.display()))?;
        let meta = file
            .metadata()
            .with_context(|| format!("reading key file {}", path.display()))?;
        let size_hint = check_key_file(path, &meta)?;
        if let Some(warning) = permission_warning(path, meta.permissions().mode()) {
            tracing::warn!("{warning}");
        }
        read_capped(&mut file, MAX_KEY_FILE_BYTES, size_hint, None)
            .with_context(|| format!("reading key file {}", path.display()))?
            .ok_or_else(|| too_large(path))?
    };
    if buf.is_empty() {
        return Err(Error::usage(format!(
            "the key file {} is empty: put the passphrase in it (every byte counts)",
            path.display()
        )));
    }
    Ok(buf)
}

/// How long a passed pipe may take to deliver the passphrase and close: the passphrase is
/// read to end-of-file, and a writer that never closes must not pin a control connection.
pub const KEY_FD_TIMEOUT: Duration = Duration::from_secs(30);

/// Reads the passphrase in a passed descriptor, which is closed afterwards: a pipe or socket
/// to its end (within [`KEY_FD_TIMEOUT`]), a regular file or memfd whole from its start
/// (whatever its offset). `what` names it in errors (`key-fd 0`).
pub fn read_key_fd(fd: OwnedFd, what: &str) -> Result<Passphrase> {
    let file = std::fs::File::from(fd);
    let context = || format!("reading the passphrase from {what}");
    let meta = file.metadata().with_context(context)?;
    let kind = meta.file_type();
    let buf = if kind.is_file() {
        if meta.len() > MAX_KEY_FILE_BYTES as u64 {
            return Err(fd_too_large(what));
        }
        let mut reader = FromStart { file, offset: 0 };
        read_capped(&mut reader, MAX_KEY_FILE_BYTES, meta.len() as usize, None)
    } else if kind.is_fifo() || kind.is_socket() {
        let mut reader = Bounded {
            file,
            deadline: Instant::now() + KEY_FD_TIMEOUT,
        };
        read_capped(&mut reader, MAX_KEY_FILE_BYTES, 0, None)
    } else {
        return Err(Error::usage(format!(
            "{what} is neither a pipe nor a regular file (nor a memfd): pass a descriptor \
             that holds the passphrase"
        )));
    };
    let buf = buf.map_err(|e| {
        if e.kind() == std::io::ErrorKind::TimedOut {
            Error::usage(format!(
                "{what}: the pipe was not closed within {} s; the passphrase is read to its \
                 end, so the writer must close it",
                KEY_FD_TIMEOUT.as_secs()
            ))
        } else {
            Error::caused(context(), e)
        }
    })?;
    let buf = buf.ok_or_else(|| fd_too_large(what))?;
    if buf.is_empty() {
        return Err(Error::usage(format!(
            "{what} held nothing: write the passphrase into it (every byte counts) and close it"
        )));
    }
    Ok(buf)
}

fn fd_too_large(what: &str) -> Error {
    Error::usage(format!(
        "{what} holds more than {} KiB (cryptsetup's default key file limit): pass only the \
         passphrase",
        MAX_KEY_FILE_BYTES / 1024
    ))
}

/// A regular file (or memfd) read from its start: a client that wrote the key into a memfd
/// leaves its offset at the end.
struct FromStart {
    file: std::fs::File,
    offset: u64,
}

impl Read for FromStart {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.file.read_at(buf, self.offset)?;
        self.offset += n as u64;
        Ok(n)
    }
}

/// A pipe read with a deadline: each read waits in `poll` for at most the time left.
struct Bounded {
    file: std::fs::File,
    deadline: Instant,
}

impl Read for Bounded {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        loop {
            let left = self.deadline.saturating_duration_since(Instant::now());
            let mut pfd = [PollFd::new(&self.file, PollFlags::IN)];
            // Whole milliseconds, as poll(2) counts them: under one left means no wait.
            let millis = left.as_millis().min(i32::MAX as u128) as u64;
            let timeout = Timespec::try_from(Duration::from_millis(millis))
                .expect("at most i32::MAX milliseconds fit a timespec");
            match poll(&mut pfd, Some(&timeout)) {
                Ok(0) => return Err(std::io::ErrorKind::TimedOut.into()),
                Err(Errno::INTR) => {}
                Err(e) => return Err(e.into()),
                // Readable, at end-of-file or in error: the read will not block.
                Ok(_) => return self.file.read(buf),
            }
        }
    }
}

/// Stdin without std's buffer (a static one, never wiped, that would keep a copy of the
/// key): a duplicate of fd 0, read directly.
pub fn raw_stdin() -> std::io::Result<std::fs::File> {
    use std::os::fd::AsFd;
    Ok(std::fs::File::from(
        std::io::stdin().as_fd().try_clone_to_owned()?,
    ))
}

/// Refuses what is not a regular file or a pipe, and a regular file above the cap; the
/// size to read (0 when unknown).
fn check_key_file(path: &Path, meta: &std::fs::Metadata) -> Result<usize> {
    let kind = meta.file_type();
    let what = if kind.is_file() {
        if meta.len() > MAX_KEY_FILE_BYTES as u64 {
            return Err(too_large(path));
        }
        return Ok(meta.len() as usize);
    } else if kind.is_fifo() || kind.is_socket() {
        return Ok(0);
    } else if kind.is_dir() {
        "a directory"
    } else if kind.is_char_device() {
        "a character device"
    } else if kind.is_block_device() {
        "a block device"
    } else {
        "not a regular file"
    };
    Err(Error::usage(format!(
        "key file {} is {what}: give a regular file (or a pipe) that holds the passphrase",
        path.display()
    )))
}

fn too_large(path: &Path) -> Error {
    Error::usage(format!(
        "key file {} is larger than {} KiB (cryptsetup's default key file limit): a key file \
         holds only the passphrase",
        path.display(),
        MAX_KEY_FILE_BYTES / 1024
    ))
}

/// The warning for a key file that its group or other users may read (`mode`: st_mode).
pub fn permission_warning(path: &Path, mode: u32) -> Option<String> {
    (mode & 0o044 != 0).then(|| {
        format!(
            "key file {} is readable by {} (mode {:04o}): chmod 600 it",
            path.display(),
            match (mode & 0o040 != 0, mode & 0o004 != 0) {
                (true, true) => "its group and by other users",
                (true, false) => "its group",
                _ => "other users",
            },
            mode & 0o7777
        )
    })
}

/// Reads `reader` to its end (or, with `line_end`, to the first such byte, which is not kept)
/// into a zeroizing buffer; `None` if it holds more than `cap` bytes. `size_hint` sizes the
/// first buffer (0: unknown). Growing copies into a new buffer and wipes the old one, so no
/// byte read is left behind in freed memory.
pub fn read_capped(
    reader: &mut dyn Read,
    cap: usize,
    size_hint: usize,
    line_end: Option<u8>,
) -> std::io::Result<Option<Passphrase>> {
    // One byte past the cap (or the hint) tells "exactly this long" from "longer".
    let first = if size_hint > 0 {
        size_hint.saturating_add(1)
    } else {
        FIRST_CAPACITY
    };
    let mut buf: Passphrase = Zeroizing::new(Vec::with_capacity(first.min(cap + 1)));
    loop {
        if buf.len() == buf.capacity() {
            if buf.len() > cap {
                return Ok(None);
            }
            let bigger = buf.capacity().saturating_mul(2).min(cap + 1);
            let mut grown: Passphrase = Zeroizing::new(Vec::with_capacity(bigger));
            grown.extend_from_slice(&buf);
            buf = grown;
        }
        let len = buf.len();
        // Within the capacity: no reallocation.
        let want = if line_end.is_some() {
            len + 1
        } else {
            buf.capacity()
        };
        buf.resize(want, 0);
        let n = loop {
            match reader.read(&mut buf[len..]) {
                Ok(n) => break n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    buf.truncate(len);
                    return Err(e);
                }
            }
        };
        buf.truncate(len + n);
        if n == 0 {
            break;
        }
        if let Some(end) = line_end {
            if buf[len] == end {
                buf.truncate(len);
                break;
            }
        }
    }
    Ok((buf.len() <= cap).then_some(buf))
}

#[cfg(test)]
mod tests;
