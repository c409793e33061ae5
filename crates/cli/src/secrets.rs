//! Passphrases come from a file, a file descriptor path, stdin, or a no-echo terminal prompt;
//! never from argv. Everything read is held in zeroizing buffers.
use anyhow::{bail, Context, Result};
use std::io::{IsTerminal, Read, Write};
use std::path::Path;
use zeroize::Zeroizing;

/// Where a passphrase comes from: `--key-file PATH` (`-` = stdin) or, when absent, a prompt on
/// the terminal (or one line of stdin when stdin is not a terminal).
pub fn read_passphrase(key_file: Option<&Path>, prompt: &str) -> Result<Zeroizing<Vec<u8>>> {
    let secret = match key_file {
        // Like cryptsetup's --key-file: the whole file is the key, newlines included. The
        // daemon library's reader checks the file (a regular file or a pipe, at most 8 MiB),
        // warns when others may read it, and claims stdin for `-`.
        Some(path) => cryptblk_daemon::key_file::read_key_file(path)?,
        None if std::io::stdin().is_terminal() => prompt_no_echo(prompt)?,
        None => {
            // A second secret read from stdin would silently get nothing.
            cryptblk_daemon::key_file::claim_stdin()?;
            let mut stdin = cryptblk_daemon::key_file::raw_stdin()
                .context("reading the passphrase from stdin")?;
            read_line(&mut stdin).context("reading the passphrase from stdin")?
        }
    };
    if secret.is_empty() {
        bail!("the passphrase is empty: put the passphrase in the key file (cryptblk uses every byte of it)");
    }
    Ok(secret)
}

/// One line (without its newline) of at most `MAX_PASSPHRASE_LINE_BYTES`, as cryptsetup
/// limits a typed passphrase; read a byte at a time so nothing after the line is consumed.
fn read_line(from: &mut dyn Read) -> Result<Zeroizing<Vec<u8>>> {
    use cryptblk_daemon::key_file::{read_capped, MAX_PASSPHRASE_LINE_BYTES};
    match read_capped(from, MAX_PASSPHRASE_LINE_BYTES, 0, Some(b'\n'))? {
        Some(line) => Ok(line),
        None => bail!(
            "the passphrase is longer than {MAX_PASSPHRASE_LINE_BYTES} bytes: put a longer \
             one in a key file (--key-file)"
        ),
    }
}

fn prompt_no_echo(prompt: &str) -> Result<Zeroizing<Vec<u8>>> {
    let mut tty = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/tty")
        .context("opening /dev/tty to ask for the passphrase (use --key-file instead)")?;
    let echo_off = EchoGuard::new(&tty)?;
    (&tty).write_all(prompt.as_bytes())?;
    let line = read_line(&mut tty);
    drop(echo_off);
    (&tty).write_all(b"\n")?;
    line
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
