//! Errors of the RBD client, each naming the image and what to do.

/// An error talking to librbd or the cluster.
#[derive(Debug, thiserror::Error)]
pub enum RbdError {
    /// librbd1/librados2 are not installed (or lack a function this client needs).
    #[error("rbd: images need librbd1 (apt install librbd1): {0}")]
    LibraryMissing(String),
    /// The `rbd:` image name does not parse.
    #[error("rbd: bad image name {name:?}: {reason}")]
    BadName { name: String, reason: String },
    /// Another client holds the image's exclusive lock.
    #[error("rbd: image {image} is locked by {owner}; stop that client first (or wait for its lock to expire if it died)")]
    Locked { image: String, owner: String },
    /// A librados/librbd call failed with a negative errno.
    #[error("rbd: {op} {image}: {}{}", std::io::Error::from_raw_os_error(*.errno), hint(op, *.errno))]
    Call {
        op: &'static str,
        image: String,
        errno: i32,
    },
}

impl RbdError {
    /// The errno of a failed call, if this error came from one.
    pub fn errno(&self) -> Option<i32> {
        match self {
            RbdError::Call { errno, .. } => Some(*errno),
            _ => None,
        }
    }
}

/// What to do about the common failures, after the errno's text.
fn hint(op: &str, errno: i32) -> &'static str {
    match (op, errno) {
        ("read the ceph.conf for", libc::ENOENT) => {
            ": pass conf=PATH in the image name or set CEPH_CONF"
        }
        ("connect to the cluster of", libc::ETIMEDOUT) => {
            ": no monitor answered within 30 s; check mon_host in the ceph.conf and the network"
        }
        ("connect to the cluster of", libc::EACCES | libc::EPERM) => {
            ": the cluster refused the client; check id=USER and keyring=PATH"
        }
        ("open the pool of", libc::ENOENT) => ": no such pool (ceph osd pool ls)",
        ("open", libc::ENOENT) => ": no such image (rbd ls POOL)",
        (_, libc::ETIMEDOUT) => ": the cluster did not answer within 30 s",
        _ => "",
    }
}
