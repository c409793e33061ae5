//! Who may connect to a disk's vhost-user-blk socket: its owner, group and mode (set on the
//! socket file before it appears at its path, see `cryptblk_net::unix_socket`), and the
//! frontend's user and group checked with SO_PEERCRED at accept. QEMU under libvirt runs as
//! `libvirt-qemu`, and libvirt does not relabel vhost-user sockets, so without an owner a
//! root-owned socket needs a manual `chown`; the peer check pins a disk to one VM's QEMU when
//! several may open the socket.
use crate::error::InvalidConfig;
use cryptblk_control::api::DiskConfig;
use cryptblk_vhost_user_blk::{AllowedPeer, SocketFile};
use nix::unistd::{Group, User};

/// The owner, group and mode to give a socket (`None`: leave as created).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SocketAccess {
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub mode: Option<u32>,
    /// The frontend's user and group (`socket-peer-uid`, `socket-peer-gid`).
    pub peer: AllowedPeer,
}

impl SocketAccess {
    /// From `socket-owner` (`USER`, `USER:GROUP` or `:GROUP`; names or numeric ids) and
    /// `socket-mode` (octal, e.g. `0660`).
    pub fn parse(owner: Option<&str>, mode: Option<&str>) -> Result<SocketAccess, InvalidConfig> {
        let mut access = SocketAccess::default();
        if let Some(owner) = owner {
            let (user, group) = match owner.split_once(':') {
                Some((u, g)) => (u, Some(g)),
                None => (owner, None),
            };
            if !user.is_empty() {
                access.uid = Some(lookup_user(user)?);
            }
            match group {
                Some("") | None => {}
                Some(g) => access.gid = Some(lookup_group(g)?),
            }
            if access.uid.is_none() && access.gid.is_none() {
                return Err(InvalidConfig(format!(
                    "socket-owner {owner:?}: give USER, USER:GROUP or :GROUP"
                )));
            }
        }
        if let Some(mode) = mode {
            let bits = u32::from_str_radix(mode, 8).ok().filter(|m| *m <= 0o777);
            access.mode = Some(bits.ok_or_else(|| {
                InvalidConfig(format!(
                    "socket-mode {mode:?}: give permission bits in octal, e.g. 0660"
                ))
            })?);
        }
        Ok(access)
    }

    pub fn is_default(&self) -> bool {
        *self == SocketAccess::default()
    }

    /// Every socket setting of a disk: `socket-owner`, `socket-mode`, `socket-peer-uid`,
    /// `socket-peer-gid`.
    pub fn of(config: &DiskConfig) -> Result<SocketAccess, InvalidConfig> {
        let mut access = SocketAccess::parse(
            config.socket_owner.as_deref(),
            config.socket_mode.as_deref(),
        )?;
        if let Some(user) = &config.socket_peer_uid {
            access.peer.uid = Some(
                lookup_user(user)
                    .map_err(|e| InvalidConfig(e.0.replace("socket-owner", "socket-peer-uid")))?,
            );
        }
        if let Some(group) = &config.socket_peer_gid {
            access.peer.gid = Some(
                lookup_group(group)
                    .map_err(|e| InvalidConfig(e.0.replace("socket-owner", "socket-peer-gid")))?,
            );
        }
        Ok(access)
    }

    /// The socket file's owner, group and mode (default: the daemon's user, 0600).
    pub fn socket_file(&self) -> SocketFile {
        SocketFile {
            mode: self.mode.unwrap_or(SocketFile::default().mode),
            uid: self.uid,
            gid: self.gid,
        }
    }
}

fn lookup_user(name: &str) -> Result<u32, InvalidConfig> {
    if let Ok(id) = name.parse() {
        return Ok(id);
    }
    if name.contains('\0') {
        return Err(InvalidConfig(format!("user {name:?}: NUL in the name")));
    }
    match User::from_name(name) {
        Ok(Some(user)) => Ok(user.uid.as_raw()),
        _ => Err(InvalidConfig(format!(
            "socket-owner: no user {name:?} on this system (e.g. libvirt's QEMU runs as libvirt-qemu)"
        ))),
    }
}

fn lookup_group(name: &str) -> Result<u32, InvalidConfig> {
    if let Ok(id) = name.parse() {
        return Ok(id);
    }
    if name.contains('\0') {
        return Err(InvalidConfig(format!("group {name:?}: NUL in the name")));
    }
    match Group::from_name(name) {
        Ok(Some(group)) => Ok(group.gid.as_raw()),
        _ => Err(InvalidConfig(format!(
            "socket-owner: no group {name:?} on this system"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owners_and_modes() {
        let a = SocketAccess::parse(Some("root:root"), Some("0660")).unwrap();
        assert_eq!((a.uid, a.gid, a.mode), (Some(0), Some(0), Some(0o660)));
        let a = SocketAccess::parse(Some(":0"), None).unwrap();
        assert_eq!((a.uid, a.gid, a.mode), (None, Some(0), None));
        let a = SocketAccess::parse(Some("1234"), Some("600")).unwrap();
        assert_eq!((a.uid, a.gid, a.mode), (Some(1234), None, Some(0o600)));
        assert!(SocketAccess::parse(None, None).unwrap().is_default());
        let e = SocketAccess::parse(Some("no-such-user-cryptblk"), None).unwrap_err();
        assert!(e.0.contains("no user \"no-such-user-cryptblk\""), "{}", e.0);
        let e = SocketAccess::parse(Some("root:no-such-group-cryptblk"), None).unwrap_err();
        assert!(e.0.contains("no group"), "{}", e.0);
        for bad in ["0999", "rw-rw----", "01777", ""] {
            let e = SocketAccess::parse(None, Some(bad)).unwrap_err();
            assert!(e.0.contains("octal"), "{bad}: {}", e.0);
        }
        assert!(SocketAccess::parse(Some(":"), None).is_err());
    }

    #[test]
    fn peers_by_name_or_id() {
        let mut config = DiskConfig::new("d", cryptblk_control::api::ImageName::new("/i"));
        assert_eq!(SocketAccess::of(&config).unwrap().socket_file().mode, 0o600);
        config.socket_peer_uid = Some("root".into());
        config.socket_peer_gid = Some("4242".into());
        let a = SocketAccess::of(&config).unwrap();
        assert_eq!((a.peer.uid, a.peer.gid), (Some(0), Some(4242)));
        config.socket_peer_uid = Some("no-such-user-cryptblk".into());
        let e = SocketAccess::of(&config).unwrap_err();
        assert!(
            e.0.starts_with("socket-peer-uid: no user \"no-such-user-cryptblk\""),
            "{}",
            e.0
        );
    }
}
