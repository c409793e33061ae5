//! What a disk is: the one configuration written in a `serve --config` file's `[[disk]]`
//! table, sent as `disk-add`'s params and built from `serve`'s single-disk options.
use super::passphrase_params::params_with_passphrases;
use super::{AioEngine, CacheMode};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::path::{Path, PathBuf};

/// Where a disk's image is: a file path (a LUKS1, LUKS2 or raw image), or a Ceph RBD image
/// named as QEMU names it, `rbd:POOL/IMAGE[@SNAP][:conf=PATH][:id=USER][:keyring=PATH]`. Kept
/// a type of its own so that the kinds of names are told apart in this one place.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ImageName(PathBuf);

/// The prefix of an RBD image name.
pub const RBD_PREFIX: &str = "rbd:";

impl ImageName {
    pub fn new(path: impl Into<PathBuf>) -> ImageName {
        ImageName(path.into())
    }

    /// The image file, or the whole `rbd:` name.
    pub fn path(&self) -> &Path {
        &self.0
    }

    /// The `rbd:...` name when this names an RBD image rather than a file.
    pub fn rbd(&self) -> Option<&str> {
        rbd_name(&self.0)
    }

    /// Relative file names are taken relative to `base` (a config file's directory); an RBD
    /// name is not a path and stays as it is.
    pub fn resolved_against(&self, base: &Path) -> ImageName {
        if self.rbd().is_some() {
            return self.clone();
        }
        ImageName(resolve(base, &self.0))
    }

    /// The default disk name: a file's last component (`/var/lib/vm1.luks` -> `vm1.luks`), an
    /// RBD image's name (`rbd:vms/vm1@s:conf=/etc/c.conf` -> `vm1`).
    pub fn file_name(&self) -> String {
        if let Some(name) = self.rbd() {
            let location = name[RBD_PREFIX.len()..]
                .split(':')
                .next()
                .unwrap_or_default();
            let image = location.rsplit('/').next().unwrap_or(location);
            return image.split('@').next().unwrap_or(image).to_owned();
        }
        self.0
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| self.0.display().to_string())
    }
}

/// `name` as a string when it is an `rbd:` image name.
pub fn rbd_name(name: &Path) -> Option<&str> {
    name.to_str().filter(|s| s.starts_with(RBD_PREFIX))
}

impl fmt::Display for ImageName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0.display())
    }
}

/// `path` itself when absolute, else `base` joined with it.
pub fn resolve(base: &Path, path: &Path) -> PathBuf {
    if path.is_absolute() {
        path.to_path_buf()
    } else {
        base.join(path)
    }
}

params_with_passphrases! {
    /// One disk to attach. Unknown keys are errors; every key but `name` and `image` is optional
    /// and its default is here (and only here).
    ///
    /// The LUKS passphrase comes from `key_file` (`-` is the daemon's stdin), `key_fd`
    /// (`disk-add` only, not a config file) or `key_secret` with `key_secret_iv` (a config file
    /// may give it too, so the file holds no passphrase in clear).
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    #[serde(deny_unknown_fields, rename_all = "kebab-case")]
    pub struct DiskConfig {
        /// The disk's name: its NBD export name, in logs, stats and control requests.
        pub name: String,
        /// The image: LUKS1, LUKS2 or raw.
        pub image: ImageName,
        passphrase key_params(key_file, key_fd, key_secret, key_secret_iv);
        /// Export the disk over vhost-user-blk on this UNIX socket.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub vhost_user_blk: Option<PathBuf>,
        /// Export the disk over the daemon's NBD server; absent: exported when the daemon has one.
        /// A config file may write it `nbd`.
        #[serde(default, alias = "nbd", skip_serializing_if = "Option::is_none")]
        pub nbd_export: Option<bool>,
        /// Virtqueues offered to the guest, each with its own worker thread.
        #[serde(default = "DiskConfig::default_num_queues")]
        pub num_queues: u16,
        /// Largest virtqueue size (a power of two).
        #[serde(default = "DiskConfig::default_queue_size")]
        pub queue_size: u16,
        /// Export read-only (the image is opened read-only).
        #[serde(default)]
        pub readonly: bool,
        /// Pass guest discards to the image as punched holes (reveals which blocks are unused).
        #[serde(default)]
        pub discard: bool,
        /// The vhost-user GET_ID answer (first 20 bytes); absent: the LUKS UUID or the image's
        /// file name.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub serial: Option<String>,
        /// Host cache mode, with QEMU's names and meaning.
        #[serde(default)]
        pub cache: CacheMode,
        /// The engine doing the disk's asynchronous I/O.
        #[serde(default)]
        pub aio: AioEngine,
        /// Busy-poll each queue's completions this many microseconds before sleeping, like
        /// QEMU's aio-poll; 0 never polls.
        #[serde(default)]
        pub poll_us: u32,
        /// Owner of the vhost-user-blk socket: `USER`, `USER:GROUP` or `:GROUP` (e.g.
        /// `libvirt-qemu:kvm`); absent: the daemon's user.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub socket_owner: Option<String>,
        /// Permission bits of the vhost-user-blk socket in octal (e.g. `0660`); absent: as
        /// created (the daemon's umask).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub socket_mode: Option<String>,
        /// On a TLS NBD server: the client certificate names (subject CN or DNS subjectAltName),
        /// comma-separated, allowed to use this disk's export, instead of the daemon's
        /// `--tls-authz` list.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub tls_authz: Option<String>,
        /// The only user (name or uid) whose process may use the vhost-user-blk socket, checked
        /// with SO_PEERCRED at accept; others are disconnected and logged. Absent: anyone who can
        /// open the socket.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub socket_peer_uid: Option<String>,
        /// The only (primary) group, by name or gid, whose process may use the vhost-user-blk
        /// socket; with `socket_peer_uid`, both must match.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub socket_peer_gid: Option<String>,
        /// Map guest memory that is not sealed against shrinking (libblkio clients; QEMU's
        /// memory-backend-file): such a frontend can crash the daemon. Off by default.
        #[serde(default)]
        pub unsealed_memory: bool,
    }
}

impl DiskConfig {
    pub const DEFAULT_NUM_QUEUES: u16 = 1;
    pub const DEFAULT_QUEUE_SIZE: u16 = 256;

    fn default_num_queues() -> u16 {
        Self::DEFAULT_NUM_QUEUES
    }

    fn default_queue_size() -> u16 {
        Self::DEFAULT_QUEUE_SIZE
    }

    /// A disk with every optional setting at its default.
    pub fn new(name: impl Into<String>, image: ImageName) -> DiskConfig {
        DiskConfig {
            name: name.into(),
            image,
            key_file: None,
            key_fd: None,
            key_secret: None,
            key_secret_iv: None,
            vhost_user_blk: None,
            nbd_export: None,
            num_queues: Self::DEFAULT_NUM_QUEUES,
            queue_size: Self::DEFAULT_QUEUE_SIZE,
            readonly: false,
            discard: false,
            serial: None,
            cache: CacheMode::default(),
            aio: AioEngine::default(),
            poll_us: 0,
            socket_owner: None,
            socket_mode: None,
            tls_authz: None,
            socket_peer_uid: None,
            socket_peer_gid: None,
            unsealed_memory: false,
        }
    }

    /// Every path of the disk (image, key file, socket), for checks such as "absolute".
    /// The file paths in the configuration (an `rbd:` image name is not one).
    pub fn paths(&self) -> impl Iterator<Item = &Path> {
        [
            self.image.rbd().is_none().then(|| self.image.path()),
            self.key_file.as_deref(),
            self.vhost_user_blk.as_deref(),
        ]
        .into_iter()
        .flatten()
    }

    /// Resolves relative paths against `base` (a key file `-`, stdin, stays as it is).
    pub fn resolve_paths(&mut self, base: &Path) {
        self.image = self.image.resolved_against(base);
        if let Some(k) = &mut self.key_file {
            if k != Path::new("-") {
                *k = resolve(base, k);
            }
        }
        if let Some(s) = &mut self.vhost_user_blk {
            *s = resolve(base, s);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn defaults_come_from_one_place() {
        let c: DiskConfig = serde_json::from_value(json!({"name": "a", "image": "/i"})).unwrap();
        assert_eq!(c, DiskConfig::new("a", ImageName::new("/i")));
        assert_eq!((c.num_queues, c.queue_size), (1, 256));
        assert_eq!((c.cache, c.aio), (CacheMode::None, AioEngine::IoUring));
    }

    #[test]
    fn rbd_names_are_not_paths() {
        let name = "rbd:vms/vm1@snap:conf=etc/ceph.conf:id=cinder";
        let image = ImageName::new(name);
        assert_eq!(image.rbd(), Some(name));
        assert_eq!(image.file_name(), "vm1");
        assert_eq!(ImageName::new("rbd:vms/vm2").file_name(), "vm2");
        // Never joined to a config file's directory, and not among the paths that must be
        // absolute.
        assert_eq!(image.resolved_against(Path::new("/srv")), image);
        let mut c = DiskConfig::new("a", image.clone());
        c.key_file = Some("k".into());
        c.resolve_paths(Path::new("/srv"));
        assert_eq!(c.image, image);
        let paths: Vec<&Path> = c.paths().collect();
        assert_eq!(paths, [Path::new("/srv/k")]);
        assert_eq!(ImageName::new("/var/lib/rbd:x").rbd(), None);
    }

    #[test]
    fn both_spellings_of_nbd_and_the_io_options() {
        let c: DiskConfig = serde_json::from_value(json!({
            "name": "a", "image": "/i", "nbd": false, "cache": "writeback", "aio": "threads"
        }))
        .unwrap();
        assert_eq!(c.nbd_export, Some(false));
        assert_eq!((c.cache, c.aio), (CacheMode::Writeback, AioEngine::Threads));
        let e = serde_json::from_value::<DiskConfig>(json!({"name": "a", "image": "/i", "x": 1}))
            .unwrap_err();
        assert!(e.to_string().contains("unknown field `x`"), "{e}");
        let e = serde_json::from_value::<DiskConfig>(
            json!({"name": "a", "image": "/i", "cache": "direct"}),
        )
        .unwrap_err();
        assert!(e.to_string().contains("direct"), "{e}");
    }

    #[test]
    fn relative_paths_resolve_against_the_base() {
        let mut c = DiskConfig::new("a", ImageName::new("a.raw"));
        c.key_file = Some("-".into());
        c.vhost_user_blk = Some("/run/a.sock".into());
        c.resolve_paths(Path::new("/etc/cryptblk"));
        assert_eq!(c.image.path(), Path::new("/etc/cryptblk/a.raw"));
        assert_eq!(c.key_file.as_deref(), Some(Path::new("-")));
        assert_eq!(c.vhost_user_blk.as_deref(), Some(Path::new("/run/a.sock")));
    }
}
