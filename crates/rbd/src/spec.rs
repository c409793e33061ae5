//! The `rbd:POOL/IMAGE[@SNAP][:conf=PATH][:id=USER][:keyring=PATH]` image name (QEMU's syntax).

use crate::RbdError;
use std::path::PathBuf;

/// A parsed `rbd:` image name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RbdSpec {
    pub pool: String,
    pub image: String,
    /// A snapshot: opened read-only.
    pub snapshot: Option<String>,
    /// ceph.conf to read; `None` means librados' default search (`CEPH_CONF`, /etc/ceph).
    pub conf: Option<PathBuf>,
    /// The client id (`admin` for `client.admin`); `None` means librados' default.
    pub id: Option<String>,
    pub keyring: Option<PathBuf>,
}

impl RbdSpec {
    /// The prefix that marks an RBD image name.
    pub const PREFIX: &'static str = "rbd:";

    /// Whether `name` names an RBD image rather than a file.
    pub fn is_rbd(name: &str) -> bool {
        name.starts_with(Self::PREFIX)
    }

    pub fn parse(name: &str) -> Result<RbdSpec, RbdError> {
        let bad = |reason: &str| RbdError::BadName {
            name: name.to_owned(),
            reason: reason.to_owned(),
        };
        let rest = name
            .strip_prefix(Self::PREFIX)
            .ok_or_else(|| bad("it must start with rbd:"))?;
        let mut parts = rest.split(':');
        let location = parts.next().unwrap_or_default();
        let (pool, image) = location
            .split_once('/')
            .ok_or_else(|| bad("expected rbd:POOL/IMAGE"))?;
        let (image, snapshot) = match image.split_once('@') {
            Some((image, snap)) => (image, Some(snap.to_owned())),
            None => (image, None),
        };
        if pool.is_empty() || image.is_empty() || image.contains('/') {
            return Err(bad("expected rbd:POOL/IMAGE with non-empty names"));
        }
        if snapshot.as_deref() == Some("") {
            return Err(bad("empty snapshot name after @"));
        }
        let mut spec = RbdSpec {
            pool: pool.to_owned(),
            image: image.to_owned(),
            snapshot,
            conf: None,
            id: None,
            keyring: None,
        };
        for option in parts {
            match option.split_once('=') {
                Some(("conf", v)) if !v.is_empty() => spec.conf = Some(v.into()),
                Some(("id", v)) if !v.is_empty() => spec.id = Some(v.to_owned()),
                Some(("keyring", v)) if !v.is_empty() => spec.keyring = Some(v.into()),
                _ => {
                    return Err(bad(&format!(
                    "unknown or empty option {option:?} (known: conf=PATH, id=USER, keyring=PATH)"
                )))
                }
            }
        }
        Ok(spec)
    }

    /// `POOL/IMAGE[@SNAP]`, for messages.
    pub fn display_name(&self) -> String {
        match &self.snapshot {
            Some(snap) => format!("{}/{}@{snap}", self.pool, self.image),
            None => format!("{}/{}", self.pool, self.image),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_name_parses() {
        let spec =
            RbdSpec::parse("rbd:vms/disk1@snap:conf=/etc/c.conf:id=cinder:keyring=/k").unwrap();
        assert_eq!(spec.pool, "vms");
        assert_eq!(spec.image, "disk1");
        assert_eq!(spec.snapshot.as_deref(), Some("snap"));
        assert_eq!(spec.conf, Some(PathBuf::from("/etc/c.conf")));
        assert_eq!(spec.id.as_deref(), Some("cinder"));
        assert_eq!(spec.keyring, Some(PathBuf::from("/k")));
        assert_eq!(spec.display_name(), "vms/disk1@snap");
    }

    #[test]
    fn bad_names_say_why() {
        for name in [
            "rbd:nopool",
            "rbd:/img",
            "rbd:p/",
            "rbd:p/i@",
            "rbd:p/i:x=1",
            "disk.img",
        ] {
            let err = RbdSpec::parse(name).unwrap_err().to_string();
            assert!(err.contains(name), "{err}");
        }
    }
}
