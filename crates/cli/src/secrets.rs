//! Passphrases come from a file, a file descriptor path, stdin, or a no-echo terminal prompt;
//! never from argv. Everything read is held in zeroizing buffers.
use anyhow::{bail, Context, Result};
use std::io::{IsTerminal, Read, Write};
use std::path::Path;
use zeroize::Zeroizing;

/// Where a passphrase comes from: `--key-file PATH` (`-` = stdin) or, when absent, a prompt on
/// the terminal (or one line of stdin when stdin is not a terminal).
pub fn read_passphrase(key_file: Option<&Path>, prompt: &str) -> Result<Zeroizing<Vec<u8>>> {
    let from_stdin = match key_file {
        Some(path) => path == Path::new("-"),
        None => !std::io::stdin().is_terminal(),
    };
    // A second secret read from stdin would silently get nothing (or the rest of the first);
    // the daemon library reads key files `-` too, so the claim is its.
    if from_stdin {
        cryptblk_daemon::key_file::claim_stdin()?;
    }
    let secret = match key_file {
        // Like cryptsetup's --key-file: the whole file is the key, newlines included.
        Some(path) if path == Path::new("-") => {
            let mut buf = Zeroizing::new(Vec::new());
            std::io::stdin()
                .lock()
                .read_to_end(&mut buf)
                .context("reading the key from stdin")?;
            buf
        }
        Some(path) => {
            let mut buf = Zeroizing::new(Vec::new());
            std::fs::File::open(path)
                .and_then(|mut f| f.read_to_end(&mut buf))
                .with_context(|| format!("reading key file {}", path.display()))?;
            buf
        }
        None if std::io::stdin().is_terminal() => prompt_no_echo(prompt)?,
        None => read_line_from_stdin()?,
    };
    if secret.is_empty() {
        bail!("the passphrase is empty: put the passphrase in the key file (cryptblk uses every byte of it)");
    }
    Ok(secret)
}

fn read_line_from_stdin() -> Result<Zeroizing<Vec<u8>>> {
    let mut buf = Zeroizing::new(Vec::new());
    let mut byte = [0u8; 1];
    let mut stdin = std::io::stdin().lock();
    while stdin
        .read(&mut byte)
        .context("reading the passphrase from stdin")?
        == 1
    {
        if byte[0] == b'\n' {
            break;
        }
        buf.push(byte[0]);
    }
    Ok(buf)
}

fn prompt_no_echo(prompt: &str) -> Result<Zeroizing<Vec<u8>>> {
    let tty = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/tty")
        .context("opening /dev/tty to ask for the passphrase (use --key-file instead)")?;
    let echo_off = EchoGuard::new(&tty)?;
    (&tty).write_all(prompt.as_bytes())?;
    let mut line = Zeroizing::new(Vec::new());
    let mut byte = [0u8; 1];
    while (&tty).read(&mut byte)? == 1 && byte[0] != b'\n' {
        line.push(byte[0]);
    }
    drop(echo_off);
    (&tty).write_all(b"\n")?;
    Ok(line)
}

/// Turns terminal echo off for its lifetime and restores it on drop, even on error paths.
struct EchoGuard {
    fd: std::os::fd::RawFd,
    saved: libc::termios,
}

impl EchoGuard {
    fn new(tty: &std::fs::File) -> Result<Self> {
        use std::os::fd::AsRawFd;
        let fd = tty.as_raw_fd();
        // SAFETY: termios is plain old data; tcgetattr fully initialises it on success, and we
        // only use it after checking the return value.
        let mut saved: libc::termios = unsafe { std::mem::zeroed() };
        // SAFETY: fd is an open terminal descriptor owned by `tty`, `saved` is a valid pointer.
        if unsafe { libc::tcgetattr(fd, &mut saved) } != 0 {
            bail!(
                "cannot read terminal settings: {}",
                std::io::Error::last_os_error()
            );
        }
        let mut quiet = saved;
        quiet.c_lflag &= !libc::ECHO;
        quiet.c_lflag |= libc::ECHONL;
        // SAFETY: same descriptor; `quiet` is a valid termios derived from the current one.
        if unsafe { libc::tcsetattr(fd, libc::TCSAFLUSH, &quiet) } != 0 {
            bail!(
                "cannot turn off terminal echo: {}",
                std::io::Error::last_os_error()
            );
        }
        Ok(EchoGuard { fd, saved })
    }
}

impl Drop for EchoGuard {
    fn drop(&mut self) {
        // SAFETY: restores the settings read in `new` on the same, still-open descriptor.
        unsafe {
            libc::tcsetattr(self.fd, libc::TCSAFLUSH, &self.saved);
        }
    }
}
