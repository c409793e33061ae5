//! The hand-over channel: a datagram socket pair between the running daemon and its successor
//! (the successor's end inherited across `exec`). Each datagram is one message: a 4-byte
//! little-endian length, that many bytes of JSON (what is not secret), then the message's
//! secret bytes (volume keys), with the message's descriptors as SCM_RIGHTS. Datagrams keep
//! each message and its descriptors together; volume keys cross only kernel socket buffers
//! (never swapped, freed once read) into zeroized, locked buffers on the other side.
use super::Message;
use rustix::io::Errno;
use rustix::net::{
    recvmsg, sendmsg, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags,
    SendAncillaryBuffer, SendAncillaryMessage, SendFlags,
};
use std::io;
use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::net::UnixDatagram;
use std::time::Duration;
use zeroize::Zeroizing;

/// The largest message (JSON and secret): a disk's configuration and keys fit many times.
const MAX_MESSAGE: usize = 64 * 1024;
/// The most descriptors one message carries (a disk's listener and image).
pub(super) const MAX_FDS: usize = 4;

/// One end of the hand-over channel.
pub(super) struct Channel {
    socket: UnixDatagram,
}

/// A message as it arrived.
pub(super) struct Received {
    pub message: Message,
    /// The secret bytes that followed the JSON (empty when none).
    pub secret: Zeroizing<Vec<u8>>,
    pub fds: Vec<OwnedFd>,
}

impl Channel {
    /// A connected pair: this end, and the descriptor of the other one (close-on-exec
    /// cleared only in the child that inherits it).
    pub fn pair() -> io::Result<(Channel, OwnedFd)> {
        let (ours, theirs) = UnixDatagram::pair()?;
        Ok((Channel { socket: ours }, OwnedFd::from(theirs)))
    }

    /// The end a predecessor daemon passed down.
    pub fn from_fd(fd: OwnedFd) -> Channel {
        Channel {
            socket: UnixDatagram::from(fd),
        }
    }

    /// Waits at most `timeout` for each `recv` (`None`: forever).
    pub fn set_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        self.socket.set_read_timeout(timeout)
    }

    pub fn send(&self, message: &Message, secret: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
        assert!(fds.len() <= MAX_FDS, "too many descriptors for one message");
        let json = serde_json::to_vec(message).map_err(io::Error::other)?;
        let mut datagram = Zeroizing::new(Vec::with_capacity(4 + json.len() + secret.len()));
        datagram.extend_from_slice(&(json.len() as u32).to_le_bytes());
        datagram.extend_from_slice(&json);
        datagram.extend_from_slice(secret);
        if datagram.len() > MAX_MESSAGE {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "a hand-over message is too large",
            ));
        }
        send_with_fds(&self.socket, &datagram, fds)
    }

    pub fn recv(&self) -> io::Result<Received> {
        let mut datagram = Zeroizing::new(vec![0u8; MAX_MESSAGE]);
        let (len, fds) = recv_with_fds(&self.socket, &mut datagram)?;
        if len == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        let bad = |why: &str| io::Error::new(io::ErrorKind::InvalidData, why.to_string());
        let datagram = &datagram[..len];
        let (head, rest) = datagram
            .split_first_chunk::<4>()
            .ok_or_else(|| bad("a hand-over message without its length"))?;
        let json_len = u32::from_le_bytes(*head) as usize;
        if json_len > rest.len() {
            return Err(bad("a hand-over message shorter than its length says"));
        }
        let (json, secret) = rest.split_at(json_len);
        let message = serde_json::from_slice(json).map_err(|e| {
            bad(&format!(
                "a hand-over message this version does not understand: {e}"
            ))
        })?;
        Ok(Received {
            message,
            secret: Zeroizing::new(secret.to_vec()),
            fds,
        })
    }
}

fn send_with_fds(socket: &UnixDatagram, data: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "too many descriptors for one hand-over message",
        ));
    }
    let iov = [IoSlice::new(data)];
    loop {
        match sendmsg(socket, &iov, &mut control, SendFlags::NOSIGNAL) {
            Ok(_) => return Ok(()),
            Err(Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

fn recv_with_fds(socket: &UnixDatagram, buf: &mut [u8]) -> io::Result<(usize, Vec<OwnedFd>)> {
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let mut iov = [IoSliceMut::new(buf)];
    let received = loop {
        match recvmsg(socket, &mut iov, &mut control, RecvFlags::CMSG_CLOEXEC) {
            Ok(received) => break received,
            Err(Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    };
    let mut fds = Vec::new();
    for message in control.drain() {
        if let RecvAncillaryMessage::ScmRights(rights) = message {
            fds.extend(rights);
        }
    }
    if received
        .flags
        .intersects(ReturnFlags::TRUNC | ReturnFlags::CTRUNC)
    {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "a hand-over message was cut short (too large, or too many descriptors)",
        ));
    }
    Ok((received.bytes, fds))
}
