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
    #[error("rbd: {op} {image}: {}", std::io::Error::from_raw_os_error(*.errno))]
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
