//! File descriptors passed with a request as SCM_RIGHTS ancillary data, so a client can hand
//! the daemon a passphrase in a pipe or a memfd instead of a file that would hold the key.
//!
//! A request names a passed descriptor by its index (`"key-fd": 0`). The descriptors belong to
//! the request line whose bytes arrived with them: the kernel ends a `recvmsg` at the message
//! that carried descriptors, so the last byte such a read returns lies in the line the client
//! sent with them (the client sends each request line, with its descriptors, in one
//! `sendmsg`). At most [`MAX_FDS_PER_REQUEST`] are taken per request; a request that came with
//! more is refused and all of them are closed. Descriptors a request does not claim are closed
//! when it has been answered. The server never reads from them itself; the handler does.
//!
//! Written on rustix's `recvmsg` rather than vmm-sys-util's `ScmSocket`: that one reports
//! truncated ancillary data as an error and drops the bytes read with it, which would lose the
//! frame boundary of a stream socket; rustix hands back the bytes and the `MSG_CTRUNC` flag.
use crate::rpc_error::RpcError;
use rustix::io::Errno;
use rustix::net::{
    recvmsg, sendmsg, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags,
    SendAncillaryBuffer, SendAncillaryMessage, SendFlags,
};
use std::io::{self, IoSlice, IoSliceMut, Read};
use std::mem::MaybeUninit;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;

/// The most descriptors one request may carry.
pub const MAX_FDS_PER_REQUEST: usize = 4;
/// The most descriptors (and messages carrying them) held for lines not read yet.
const MAX_FDS_WAITING: usize = 4 * MAX_FDS_PER_REQUEST;

/// The descriptors passed with one request; those not taken are closed when it is dropped.
#[derive(Debug, Default)]
pub struct PassedFds {
    fds: Vec<Option<OwnedFd>>,
    /// More than [`MAX_FDS_PER_REQUEST`] arrived (they were all closed).
    too_many: bool,
}

impl PassedFds {
    pub fn new(fds: Vec<OwnedFd>) -> PassedFds {
        let too_many = fds.len() > MAX_FDS_PER_REQUEST;
        PassedFds {
            fds: if too_many {
                Vec::new()
            } else {
                fds.into_iter().map(Some).collect()
            },
            too_many,
        }
    }

    /// How many descriptors came with the request.
    pub fn len(&self) -> usize {
        self.fds.len()
    }

    pub fn is_empty(&self) -> bool {
        self.fds.is_empty()
    }

    /// Takes descriptor `index`, which the request's `param` names; an invalid-params error
    /// when no such descriptor came with the request or another param already took it.
    pub fn take(&mut self, index: u32, param: &str) -> Result<OwnedFd, RpcError> {
        let passed = self.fds.len();
        match self.fds.get_mut(index as usize) {
            Some(slot) => slot.take().ok_or_else(|| {
                RpcError::invalid_params(format!(
                    "{param} {index}: that descriptor is already used by another param; pass \
                     one descriptor per key"
                ))
            }),
            None if passed == 0 => Err(RpcError::invalid_params(format!(
                "{param} {index}: no file descriptor was passed with this request; send the \
                 descriptor with the request line as SCM_RIGHTS ancillary data (`cryptblk ctl \
                 --{param} N` does), or give a key file instead"
            ))),
            None => Err(RpcError::invalid_params(format!(
                "{param} {index}: only {passed} file descriptor(s) were passed with this \
                 request (indexes from 0)"
            ))),
        }
    }

    /// The refusal of a request that came with too many descriptors.
    pub(crate) fn refusal(&self) -> Option<RpcError> {
        self.too_many.then(|| {
            RpcError::invalid_request(format!(
                "more than {MAX_FDS_PER_REQUEST} file descriptors were passed with this \
                 request; all were closed and the request was not run"
            ))
        })
    }
}

/// Descriptors received together, and the stream offset of the last byte that came with them.
struct Arrival {
    last_byte: u64,
    fds: Vec<OwnedFd>,
    truncated: bool,
}

/// Reads a UNIX stream socket with `recvmsg`, keeping the descriptors that arrive with the
/// bytes until [`FdReader::take_until`] hands them to the request they came with.
pub(crate) struct FdReader {
    stream: UnixStream,
    received: u64,
    arrivals: Vec<Arrival>,
}

impl FdReader {
    pub(crate) fn new(stream: UnixStream) -> FdReader {
        FdReader {
            stream,
            received: 0,
            arrivals: Vec::new(),
        }
    }

    /// The descriptors that arrived with bytes before stream offset `end` (the end of the
    /// line just read, newline included).
    pub(crate) fn take_until(&mut self, end: u64) -> PassedFds {
        let mut fds = Vec::new();
        let mut truncated = false;
        self.arrivals.retain_mut(|a| {
            if a.last_byte >= end {
                return true;
            }
            fds.append(&mut a.fds);
            truncated |= a.truncated;
            false
        });
        if truncated {
            // Dropping them closes them; the request is refused as carrying too many.
            return PassedFds {
                fds: Vec::new(),
                too_many: true,
            };
        }
        PassedFds::new(fds)
    }
}

impl Read for FdReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let mut space =
            [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS_PER_REQUEST))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let received = recvmsg(
            &self.stream,
            &mut [IoSliceMut::new(buf)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        )?;
        let n = received.bytes;
        let mut fds = Vec::new();
        for message in control.drain() {
            if let RecvAncillaryMessage::ScmRights(rights) = message {
                fds.extend(rights);
            }
        }
        let truncated = received.flags.contains(ReturnFlags::CTRUNC);
        self.received += n as u64;
        if !fds.is_empty() || truncated {
            self.arrivals.push(Arrival {
                // A read that brought descriptors returned at least one byte of their message.
                last_byte: self.received.saturating_sub(1),
                fds,
                truncated,
            });
        }
        // A client that keeps sending descriptors without ending its line must not fill the
        // daemon's descriptor table (every disk needs descriptors): past a few requests'
        // worth, all waiting ones are closed and their requests refused as carrying too many.
        let waiting: usize = self.arrivals.iter().map(|a| a.fds.len()).sum();
        if waiting > MAX_FDS_WAITING || self.arrivals.len() > MAX_FDS_WAITING {
            let last_byte = self.arrivals.last().map_or(0, |a| a.last_byte);
            self.arrivals.clear();
            self.arrivals.push(Arrival {
                last_byte,
                fds: Vec::new(),
                truncated: true,
            });
        }
        Ok(n)
    }
}

#[cfg(test)]
impl FdReader {
    /// Descriptors received and held for requests not yet taken.
    fn fds_waiting(&self) -> usize {
        self.arrivals.iter().map(|a| a.fds.len()).sum()
    }
}

/// Writes `data` to `stream` with `fds` attached to its first byte (SCM_RIGHTS).
pub(crate) fn send_with_fds(
    stream: &UnixStream,
    data: &[u8],
    fds: &[BorrowedFd<'_>],
) -> io::Result<()> {
    use std::io::Write;
    if fds.is_empty() {
        return (&mut &*stream).write_all(data);
    }
    if fds.len() > MAX_FDS_PER_REQUEST {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("at most {MAX_FDS_PER_REQUEST} file descriptors go with one request"),
        ));
    }
    let mut space =
        [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS_PER_REQUEST))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    let fit = control.push(SendAncillaryMessage::ScmRights(fds));
    debug_assert!(fit, "the buffer holds MAX_FDS_PER_REQUEST descriptors");
    let sent = loop {
        match sendmsg(
            stream,
            &[IoSlice::new(data)],
            &mut control,
            SendFlags::NOSIGNAL,
        ) {
            Ok(sent) => break sent,
            Err(Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    };
    // The descriptors went with the first part; the rest of the line follows plainly.
    (&mut &*stream).write_all(&data[sent..])
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufRead, BufReader, Write};
    use std::os::fd::AsFd;

    fn pipe() -> (OwnedFd, OwnedFd) {
        rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).unwrap()
    }

    #[test]
    fn descriptors_belong_to_the_line_they_came_with() {
        let (a, b) = UnixStream::pair().unwrap();
        let (r1, w1) = pipe();
        (&a).write_all(b"first\n").unwrap();
        send_with_fds(&a, b"second\n", &[r1.as_fd()]).unwrap();
        (&a).write_all(b"third\n").unwrap();
        drop(a);
        let mut reader = BufReader::new(FdReader::new(b));
        let mut consumed = 0u64;
        let mut line = Vec::new();
        let mut per_line = Vec::new();
        loop {
            line.clear();
            let n = reader.read_until(b'\n', &mut line).unwrap();
            if n == 0 {
                break;
            }
            consumed += n as u64;
            per_line.push(reader.get_mut().take_until(consumed).len());
        }
        assert_eq!(per_line, [0, 1, 0]);
        drop(w1);
    }

    #[test]
    fn too_many_descriptors_refuse_the_request() {
        let (a, b) = UnixStream::pair().unwrap();
        let pipes: Vec<_> = (0..MAX_FDS_PER_REQUEST + 1).map(|_| pipe()).collect();
        let fds: Vec<BorrowedFd<'_>> = pipes.iter().map(|(r, _)| r.as_fd()).collect();
        assert!(send_with_fds(&a, b"x\n", &fds).is_err());
        // Sent directly, past the client's own check.
        let mut space =
            [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS_PER_REQUEST + 1))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        assert!(control.push(SendAncillaryMessage::ScmRights(&fds)));
        let sent = sendmsg(
            &a,
            &[IoSlice::new(b"x\n")],
            &mut control,
            SendFlags::empty(),
        );
        assert_eq!(sent.unwrap(), 2);
        let mut reader = BufReader::new(FdReader::new(b));
        let mut line = Vec::new();
        let n = reader.read_until(b'\n', &mut line).unwrap();
        let passed = reader.get_mut().take_until(n as u64);
        assert!(passed.is_empty());
        assert!(passed.refusal().unwrap().message.contains("more than 4"));
    }

    #[test]
    fn a_line_that_never_ends_cannot_pile_up_descriptors() {
        let (a, b) = UnixStream::pair().unwrap();
        let (r, _w) = pipe();
        let mut reader = BufReader::new(FdReader::new(b));
        // One descriptor per byte, far more than any request may carry, then the newline.
        for _ in 0..(MAX_FDS_WAITING * 4) {
            send_with_fds(&a, b"x", &[r.as_fd()]).unwrap();
            let mut byte = [0u8; 1];
            reader.get_mut().read_exact(&mut byte).unwrap();
        }
        // What the reader holds, not the process's count: tests running beside this one
        // open and close descriptors of their own.
        assert!(
            reader.get_ref().fds_waiting() <= MAX_FDS_WAITING,
            "{} descriptors held for an unfinished line",
            reader.get_ref().fds_waiting()
        );
        (&a).write_all(b"\n").unwrap();
        let mut line = Vec::new();
        reader.read_until(b'\n', &mut line).unwrap();
        let end = reader.get_ref().received;
        let passed = reader.get_mut().take_until(end);
        assert!(passed.is_empty() && passed.refusal().is_some());
        assert_eq!(reader.get_ref().fds_waiting(), 0);
    }

    #[test]
    fn taking_names_the_problem() {
        let (r, _w) = pipe();
        let mut none = PassedFds::default();
        let e = none.take(0, "key-fd").unwrap_err();
        assert_eq!(e.code, crate::INVALID_PARAMS);
        assert!(e.message.contains("no file descriptor was passed"), "{e}");
        let mut one = PassedFds::new(vec![r]);
        assert!(one
            .take(1, "new-key-fd")
            .unwrap_err()
            .message
            .contains("only 1"));
        assert!(one.take(0, "key-fd").is_ok());
        assert!(one
            .take(0, "new-key-fd")
            .unwrap_err()
            .message
            .contains("already used"));
    }
}
