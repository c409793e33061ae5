//! Who gets a disk's socket. The socket file is created with its final owner and mode before
//! it appears at its path (`cryptblk_net::unix_socket`: private directory, then rename), and
//! with an [`AllowedPeer`] set, a process whose credentials (`SO_PEERCRED`, taken at its
//! `connect`) do not match is disconnected at once and logged: the disk stays free for its
//! own VM's QEMU. File permissions say which users may connect at all; the peer check pins a
//! disk to one VM when several VMs' QEMUs could reach its socket (e.g. libvirt with a
//! per-domain `<seclabel model='dac'>` user or group).
use cryptblk_net::unix_socket::{peer_credentials, PeerCredentials};
use std::io;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;

pub use cryptblk_net::unix_socket::SocketFile;

/// The frontend a disk accepts: its effective uid and/or gid (the primary one: `SO_PEERCRED`
/// does not carry supplementary groups). Both unset: anyone who can open the socket.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AllowedPeer {
    pub uid: Option<u32>,
    pub gid: Option<u32>,
}

impl AllowedPeer {
    pub fn allows(&self, peer: &PeerCredentials) -> bool {
        self.uid.is_none_or(|uid| uid == peer.uid) && self.gid.is_none_or(|gid| gid == peer.gid)
    }

    fn describe(&self) -> String {
        match (self.uid, self.gid) {
            (Some(uid), Some(gid)) => format!("uid {uid} and gid {gid}"),
            (Some(uid), None) => format!("uid {uid}"),
            (None, Some(gid)) => format!("gid {gid}"),
            (None, None) => "anyone".into(),
        }
    }
}

/// Takes the pending connection on `listener` (non-blocking): `Some` if it comes from an
/// allowed peer, `None` if there was none or it was refused (closed and logged).
pub(crate) fn accept_allowed(
    listener: &UnixListener,
    allowed: &AllowedPeer,
    path: &Path,
) -> io::Result<Option<UnixStream>> {
    let stream = match listener.accept() {
        Ok((stream, _)) => stream,
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::WouldBlock
                    | io::ErrorKind::Interrupted
                    | io::ErrorKind::ConnectionAborted
            ) =>
        {
            return Ok(None)
        }
        Err(e) => return Err(e),
    };
    if *allowed != AllowedPeer::default() {
        let peer = peer_credentials(&stream)?;
        if !allowed.allows(&peer) {
            tracing::warn!(
                socket = %path.display(),
                "refused a vhost-user connection from pid {} (uid {}, gid {}): this disk \
                 accepts only {}",
                peer.pid,
                peer.uid,
                peer.gid,
                allowed.describe()
            );
            return Ok(None);
        }
    }
    // Accepted sockets do not inherit the listener's O_NONBLOCK on Linux; say it anyway.
    stream.set_nonblocking(false)?;
    Ok(Some(stream))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uid_and_gid_both_must_match_when_given() {
        let peer = PeerCredentials {
            pid: 1,
            uid: 107,
            gid: 36,
        };
        assert!(AllowedPeer::default().allows(&peer));
        let by_uid = AllowedPeer {
            uid: Some(107),
            gid: None,
        };
        assert!(by_uid.allows(&peer));
        assert!(!AllowedPeer {
            uid: Some(0),
            ..by_uid
        }
        .allows(&peer));
        let both = AllowedPeer {
            uid: Some(107),
            gid: Some(36),
        };
        assert!(both.allows(&peer));
        assert!(!AllowedPeer {
            gid: Some(0),
            ..both
        }
        .allows(&peer));
        assert_eq!(both.describe(), "uid 107 and gid 36");
    }
}
