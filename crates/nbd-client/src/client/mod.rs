//! One connection to one export: the handshake (`handshake.rs`), then BLOCK_STATUS
//! (`block_status.rs`), READs, several in flight (`reads.rs`), and releases of what was
//! stored (`release.rs`), whose replies `reply.rs` reads. This file holds the connection and what all of them use.

mod block_status;
mod handshake;
mod reads;
mod release;
mod reply;

pub use reads::{CompletedRead, MAX_READS_IN_FLIGHT};

use crate::uri::{NbdUri, Transport};
use crate::wire::*;
use crate::Error;
use std::collections::VecDeque;
use std::io::{BufReader, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::time::Duration;

/// How long one read or write on the socket may block before the pull fails.
const IO_TIMEOUT: Duration = Duration::from_secs(120);

/// What the server said about the export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExportInfo {
    /// Size in bytes.
    pub size: u64,
    /// Transmission flags (`NBD_FLAG_*`).
    pub flags: u16,
}

/// One extent of a block-status reply: `length` bytes with the context's `flags`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    pub length: u64,
    pub flags: u32,
}

/// A byte stream to a server.
pub trait Connection: Read + Write + Send {}
impl<T: Read + Write + Send> Connection for T {}

/// A negotiated connection to one export.
pub struct Client<S: Read + Write = Box<dyn Connection>> {
    stream: BufReader<S>,
    info: ExportInfo,
    /// The export's NBD_INFO_DESCRIPTION, if the server sent one.
    description: Option<String>,
    contexts: Vec<(String, u32)>,
    next_cookie: u64,
    /// READs sent and not yet answered in full, oldest first.
    reads: VecDeque<reads::PendingRead>,
    /// Emptied coverage lists of finished READs, to be used again.
    spare_covered: Vec<Vec<(u64, u64)>>,
    /// Set once the byte stream lost its framing: later calls fail at once.
    broken: bool,
}

impl Client {
    /// Connects to `uri` and negotiates its export with the metadata `contexts` selected
    /// (each must be offered, or [`Error::NoContext`]).
    pub fn connect(uri: &NbdUri, contexts: &[&str]) -> Result<Client, Error> {
        let stream: Box<dyn Connection> = match &uri.transport {
            Transport::Unix(path) => {
                let s = UnixStream::connect(path).map_err(|source| Error::Connect {
                    address: path.display().to_string(),
                    source,
                })?;
                s.set_read_timeout(Some(IO_TIMEOUT))?;
                s.set_write_timeout(Some(IO_TIMEOUT))?;
                Box::new(s)
            }
            Transport::Tcp(host, port) => {
                let s = TcpStream::connect((host.as_str(), *port)).map_err(|source| {
                    Error::Connect {
                        address: format!("{host}:{port}"),
                        source,
                    }
                })?;
                s.set_read_timeout(Some(IO_TIMEOUT))?;
                s.set_write_timeout(Some(IO_TIMEOUT))?;
                s.set_nodelay(true)?;
                Box::new(s)
            }
        };
        Client::handshake(stream, &uri.export, contexts)
    }
}

impl<S: Read + Write> Client<S> {
    /// The export's size and flags.
    pub fn info(&self) -> ExportInfo {
        self.info
    }

    /// The export's description (NBD_INFO_DESCRIPTION), if the server sent one; at most
    /// an option reply's bound (64 KiB) long.
    pub fn description(&self) -> Option<&str> {
        self.description.as_deref()
    }

    /// The id the server gave a selected metadata context.
    pub fn context_id(&self, name: &str) -> Option<u32> {
        self.contexts
            .iter()
            .find(|(n, _)| n == name)
            .map(|&(_, id)| id)
    }

    fn send_request(&mut self, command: u16, offset: u64, length: u32) -> Result<u64, Error> {
        self.check_usable()?;
        let cookie = self.next_cookie;
        self.next_cookie += 1;
        let mut msg = [0u8; 28];
        msg[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        msg[6..8].copy_from_slice(&command.to_be_bytes());
        msg[8..16].copy_from_slice(&cookie.to_be_bytes());
        msg[16..24].copy_from_slice(&offset.to_be_bytes());
        msg[24..28].copy_from_slice(&length.to_be_bytes());
        self.stream.get_mut().write_all(&msg)?;
        Ok(cookie)
    }

    /// Refuses to go on once the byte stream lost its framing.
    fn check_usable(&self) -> Result<(), Error> {
        if self.broken {
            return Err(Error::protocol(
                "the connection is unusable after an earlier protocol error",
            ));
        }
        Ok(())
    }

    fn check_range(&self, offset: u64, length: u64) -> Result<(), Error> {
        if length == 0
            || offset
                .checked_add(length)
                .is_none_or(|end| end > self.info.size)
        {
            return Err(Error::Request(format!(
                "{length} bytes at offset {offset} are not inside the export ({} bytes)",
                self.info.size
            )));
        }
        Ok(())
    }

    fn mark_if_broken<T>(&mut self, result: &Result<T, Error>) {
        if matches!(result, Err(Error::Protocol(_) | Error::Io(_))) {
            self.broken = true;
        }
    }

    /// Says goodbye (NBD_CMD_DISC) so the server logs a clean end.
    pub fn disconnect(mut self) {
        let _ = self.send_request(CMD_DISC, 0, 0);
        let _ = self.stream.get_mut().flush();
    }
}
