//! Passphrases come from a file, a file descriptor path, stdin, or a no-echo terminal prompt;
//! never from argv. Everything read is held in zeroizing buffers.
use anyhow::{bail, Context, Result};
use rustix::termios::{tcgetattr, tcsetattr, LocalModes, OptionalActions, Termios};
use std::io::{IsTerminal, Read, Write};
use std::os::fd::{AsFd, BorrowedFd};
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
    let tty = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/tty")
        .context("opening /dev/tty to ask for the passphrase (use --key-file instead)")?;
    let echo_off = EchoGuard::new(&tty)?;
    (&tty).write_all(prompt.as_bytes())?;
    let line = read_line(&mut &tty);
    drop(echo_off);
    (&tty).write_all(b"\n")?;
    line
}

/// Turns terminal echo off for its lifetime and restores it on drop, even on error paths.
struct EchoGuard<'tty> {
    tty: BorrowedFd<'tty>,
    saved: Termios,
}

impl<'tty> EchoGuard<'tty> {
    fn new(tty: &'tty std::fs::File) -> Result<Self> {
        let tty = tty.as_fd();
        let saved = match tcgetattr(tty) {
            Ok(saved) => saved,
            Err(e) => bail!("cannot read terminal settings: {}", std::io::Error::from(e)),
        };
        let mut quiet = saved.clone();
        quiet.local_modes.remove(LocalModes::ECHO);
        quiet.local_modes.insert(LocalModes::ECHONL);
        if let Err(e) = tcsetattr(tty, OptionalActions::Flush, &quiet) {
            bail!("cannot turn off terminal echo: {}", std::io::Error::from(e));
        }
        Ok(EchoGuard { tty, saved })
    }
}

impl Drop for EchoGuard<'_> {
    fn drop(&mut self) {
        // Nothing to do about a failure here: the prompt has been answered either way.
        let _ = tcsetattr(self.tty, OptionalActions::Flush, &self.saved);
    }
}
