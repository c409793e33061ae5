//! The hand-over channel: a datagram socket pair between the running daemon and its successor
//! (the successor's end inherited across `exec`). Each datagram is one message: a 4-byte
//! little-endian length, that many bytes of JSON (what is not secret), then the message's
//! secret bytes (volume keys), with the message's descriptors as SCM_RIGHTS. Datagrams keep
//! each message and its descriptors together; volume keys cross only kernel socket buffers
//! (never swapped, freed once read) into zeroized, locked buffers on the other side.
use super::Message;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
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
        let raw: Vec<RawFd> = fds.iter().map(|fd| fd.as_raw_fd()).collect();
        send_with_fds(&self.socket, &datagram, &raw)
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

fn send_with_fds(socket: &UnixDatagram, data: &[u8], fds: &[RawFd]) -> io::Result<()> {
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    };
    let fd_bytes = std::mem::size_of_val(fds);
    // SAFETY: CMSG_SPACE only computes a size from its argument.
    let space = unsafe { libc::CMSG_SPACE(fd_bytes as u32) } as usize;
    // u64s keep the control buffer aligned for `cmsghdr`.
    let mut control = vec![0u64; space.div_ceil(8).max(1)];
    // SAFETY: msghdr is plain data; every field is set below or left zero (no name).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        // SAFETY: `msg` points at a control buffer of `space` bytes, enough for one header
        // and `fds.len()` descriptors (CMSG_SPACE), so the first header and its data lie
        // inside it; the buffer outlives these writes.
        unsafe {
            let header = libc::CMSG_FIRSTHDR(&msg);
            (*header).cmsg_level = libc::SOL_SOCKET;
            (*header).cmsg_type = libc::SCM_RIGHTS;
            (*header).cmsg_len = libc::CMSG_LEN(fd_bytes as u32) as _;
            std::ptr::copy_nonoverlapping(
                fds.as_ptr().cast::<u8>(),
                libc::CMSG_DATA(header),
                fd_bytes,
            );
        }
    }
    loop {
        // SAFETY: `msg` and everything it points at (iov, data, control) are alive for the
        // call; the socket is ours.
        let sent = unsafe { libc::sendmsg(socket.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        if sent >= 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

fn recv_with_fds(socket: &UnixDatagram, buf: &mut [u8]) -> io::Result<(usize, Vec<OwnedFd>)> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: CMSG_SPACE only computes a size from its argument.
    let space =
        unsafe { libc::CMSG_SPACE((MAX_FDS * std::mem::size_of::<RawFd>()) as u32) } as usize;
    let mut control = vec![0u64; space.div_ceil(8)];
    // SAFETY: msghdr is plain data; the fields used are set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    let received = loop {
        // SAFETY: `msg` points at `buf` and `control`, both alive and writable for the call.
        let n = unsafe { libc::recvmsg(socket.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n >= 0 {
            break n as usize;
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    };
    let mut fds = Vec::new();
    // SAFETY: the kernel filled `control` up to `msg_controllen`; CMSG_FIRSTHDR/NXTHDR stay
    // within it, and each SCM_RIGHTS header's data holds `(cmsg_len - CMSG_LEN(0)) / 4`
    // descriptors that are now ours (each taken exactly once).
    unsafe {
        let mut header = libc::CMSG_FIRSTHDR(&msg);
        while !header.is_null() {
            if (*header).cmsg_level == libc::SOL_SOCKET && (*header).cmsg_type == libc::SCM_RIGHTS {
                let bytes = (*header).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                let data = libc::CMSG_DATA(header).cast::<RawFd>();
                for i in 0..bytes / std::mem::size_of::<RawFd>() {
                    fds.push(OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(i))));
                }
            }
            header = libc::CMSG_NXTHDR(&msg, header);
        }
    }
    if msg.msg_flags & (libc::MSG_TRUNC | libc::MSG_CTRUNC) != 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "a hand-over message was cut short (too large, or too many descriptors)",
        ));
    }
    Ok((received, fds))
}
