//! Who may connect to a disk's vhost-user-blk socket: its owner, group and mode, set right
//! after the socket is bound and before the daemon accepts on it. QEMU under libvirt runs as
//! `libvirt-qemu`, and libvirt does not relabel vhost-user sockets, so without this a
//! root-owned socket needs a manual `chown`. Until the change lands the socket has the
//! daemon's default (its owner only may connect: connecting needs write permission), so the
//! moment in between never lets anyone in who should not be.
use crate::config::InvalidConfig;
use std::ffi::CString;
use std::path::Path;

/// The owner, group and mode to give a socket (`None`: leave as created).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SocketAccess {
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub mode: Option<u32>,
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

    /// Applies the owner and group, then the mode, to the socket at `path`.
    pub fn apply(&self, path: &Path) -> std::io::Result<()> {
        if self.uid.is_some() || self.gid.is_some() {
            std::os::unix::fs::lchown(path, self.uid, self.gid)?;
        }
        if let Some(mode) = self.mode {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))?;
        }
        Ok(())
    }
}

fn lookup_user(name: &str) -> Result<u32, InvalidConfig> {
    if let Ok(id) = name.parse() {
        return Ok(id);
    }
    let cname =
        CString::new(name).map_err(|_| InvalidConfig(format!("user {name:?}: NUL in the name")))?;
    let mut entry: libc::passwd = unsafe_zeroed();
    let mut result: *mut libc::passwd = std::ptr::null_mut();
    let mut buf = vec![0 as libc::c_char; 16 * 1024];
    // SAFETY: every pointer is valid for the call; `buf` backs the strings `entry` points to
    // and outlives the use of `entry.pw_uid` below.
    let rc = unsafe {
        libc::getpwnam_r(
            cname.as_ptr(),
            &mut entry,
            buf.as_mut_ptr(),
            buf.len(),
            &mut result,
        )
    };
    if rc != 0 || result.is_null() {
        return Err(InvalidConfig(format!(
            "socket-owner: no user {name:?} on this system (e.g. libvirt's QEMU runs as libvirt-qemu)"
        )));
    }
    Ok(entry.pw_uid)
}

fn lookup_group(name: &str) -> Result<u32, InvalidConfig> {
    if let Ok(id) = name.parse() {
        return Ok(id);
    }
    let cname = CString::new(name)
        .map_err(|_| InvalidConfig(format!("group {name:?}: NUL in the name")))?;
    let mut entry: libc::group = unsafe_zeroed();
    let mut result: *mut libc::group = std::ptr::null_mut();
    let mut buf = vec![0 as libc::c_char; 64 * 1024];
    // SAFETY: as in lookup_user.
    let rc = unsafe {
        libc::getgrnam_r(
            cname.as_ptr(),
            &mut entry,
            buf.as_mut_ptr(),
            buf.len(),
            &mut result,
        )
    };
    if rc != 0 || result.is_null() {
        return Err(InvalidConfig(format!(
            "socket-owner: no group {name:?} on this system"
        )));
    }
    Ok(entry.gr_gid)
}

/// A zeroed C struct of plain integers and pointers, for the `_r` lookups to fill.
fn unsafe_zeroed<T: Copy>() -> T {
    // SAFETY: only used for libc::passwd and libc::group, whose fields are integers and raw
    // pointers, for which all-zero bytes are valid values.
    unsafe { std::mem::zeroed() }
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
}
