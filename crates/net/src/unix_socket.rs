//! Creating a listening UNIX socket with its final owner and mode and no moment where it is
//! more open, for every listener of the daemon (control, vhost-user-blk, NBD, metrics).
//!
//! `bind(2)` creates the socket file with mode `0777 & ~umask`, and anyone who can write to a
//! UNIX socket file can connect to it. The usual fixes all have a flaw here:
//! - setting the umask around `bind` changes it for the whole process, so another thread
//!   creating a file at that moment (an image, a log) gets the wrong mode;
//! - `chmod`/`chown` by path after `bind` leaves a window, and follows a symlink someone put
//!   at the path in between; `fchmod` on the socket fd changes the socket's own inode rather
//!   than the file `bind` created (or, on Linux, only seeds its mode at bind time, which is
//!   not portable or documented behaviour).
//!
//! So the socket is bound (and listening) inside a fresh directory created with mode 0700 next
//! to the target, given its owner and mode there (nobody else can reach it, or swap it, in the
//! private directory), then renamed onto the target. The rename is atomic and replaces a stale
//! socket in one step, and the first moment anyone else can see the file it already has its
//! final owner and mode.
use nix::sys::socket::{getsockopt, sockopt};
use std::collections::hash_map::RandomState;
use std::fs::{self, DirBuilder, Permissions};
use std::hash::{BuildHasher, Hasher};
use std::io::{self, ErrorKind};
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

/// Why a socket could not be created; each names the path.
#[derive(Debug, thiserror::Error)]
pub enum SocketFileError {
    #[error("another server is already listening on {}", path.display())]
    InUse { path: PathBuf },
    #[error("refusing to replace {}: it exists and is not a socket", path.display())]
    NotASocket { path: PathBuf },
    #[error(
        "socket path {} is too long: UNIX socket paths here are limited to {max} bytes",
        path.display()
    )]
    PathTooLong { path: PathBuf, max: usize },
    #[error("{what} {}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

impl SocketFileError {
    /// The underlying error as an `io::Error` (for callers with an io-only error type).
    pub fn into_io(self) -> io::Error {
        let kind = match &self {
            SocketFileError::InUse { .. } => ErrorKind::AddrInUse,
            SocketFileError::NotASocket { .. } => ErrorKind::AlreadyExists,
            SocketFileError::PathTooLong { .. } => ErrorKind::InvalidInput,
            SocketFileError::Io { source, .. } => source.kind(),
        };
        io::Error::new(kind, self)
    }
}

/// The owner, group and mode the socket file gets before anyone can see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SocketFile {
    /// Permission bits; connecting needs write permission.
    pub mode: u32,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
}

impl Default for SocketFile {
    /// The creating user only (0600).
    fn default() -> Self {
        SocketFile {
            mode: 0o600,
            uid: None,
            gid: None,
        }
    }
}

impl SocketFile {
    pub fn with_mode(mode: u32) -> SocketFile {
        SocketFile {
            mode,
            ..SocketFile::default()
        }
    }
}

/// Who is on the other end of a UNIX socket (`SO_PEERCRED`: as of its `connect`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerCredentials {
    pub pid: i32,
    pub uid: u32,
    pub gid: u32,
}

/// The credentials of the process that connected `stream`.
///
/// Through nix rather than rustix: rustix's `UCred` holds the pid as a non-zero type, and the
/// kernel reports pid 0 for a peer in a pid namespace we cannot see.
pub fn peer_credentials(stream: &UnixStream) -> io::Result<PeerCredentials> {
    let cred = getsockopt(stream, sockopt::PeerCredentials)?;
    Ok(PeerCredentials {
        pid: cred.pid(),
        uid: cred.uid(),
        gid: cred.gid(),
    })
}

/// `sizeof(sun_path) - 1` on Linux: longer paths cannot be bound or connected to.
const MAX_SOCKET_PATH: usize = 107;

/// Identifies the socket file we created, so cleanup never removes a socket that another
/// server has since put at the same path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileId {
    dev: u64,
    ino: u64,
}

impl FileId {
    /// Device and inode numbers, e.g. to tell a successor daemon which file is the socket's.
    pub fn parts(&self) -> (u64, u64) {
        (self.dev, self.ino)
    }

    pub fn from_parts(dev: u64, ino: u64) -> FileId {
        FileId { dev, ino }
    }

    pub fn of(path: &Path) -> Option<FileId> {
        let meta = fs::symlink_metadata(path).ok()?;
        Some(FileId {
            dev: meta.dev(),
            ino: meta.ino(),
        })
    }
}

/// Binds and listens on `path` (absolute), with the owner and mode of `file`; see the module
/// comment. A stale socket at `path` (nobody accepting) is replaced; a live one, or anything
/// that is not a socket, is refused.
pub fn bind_private(
    path: &Path,
    file: &SocketFile,
) -> Result<(UnixListener, FileId), SocketFileError> {
    let len = path.as_os_str().len();
    if len > MAX_SOCKET_PATH {
        return Err(SocketFileError::PathTooLong {
            path: path.to_owned(),
            max: MAX_SOCKET_PATH,
        });
    }
    let (Some(parent), Some(_)) = (path.parent(), path.file_name()) else {
        return Err(SocketFileError::Io {
            what: "cannot create a socket at",
            path: path.to_owned(),
            source: ErrorKind::InvalidInput.into(),
        });
    };
    let dir = PrivateDir::create(parent)?;
    let temp = dir.path.join("s");
    if temp.as_os_str().len() > MAX_SOCKET_PATH {
        // The temporary path is a few bytes longer than the final one.
        return Err(SocketFileError::PathTooLong {
            path: path.to_owned(),
            max: MAX_SOCKET_PATH - (temp.as_os_str().len() - len),
        });
    }
    let io = |what, source| SocketFileError::Io {
        what,
        path: path.to_owned(),
        source,
    };
    let listener = UnixListener::bind(&temp).map_err(|e| io("cannot bind", e))?;
    if file.uid.is_some() || file.gid.is_some() {
        // In the private directory nobody can have swapped the file for a symlink; lchown
        // would not follow one anyway.
        std::os::unix::fs::lchown(&temp, file.uid, file.gid)
            .map_err(|e| io("cannot set the owner of", e))?;
    }
    fs::set_permissions(&temp, Permissions::from_mode(file.mode))
        .map_err(|e| io("cannot set the mode of", e))?;
    let id = FileId::of(&temp).ok_or_else(|| io("cannot stat", ErrorKind::NotFound.into()))?;
    // Checked after binding so the window in which a server starting concurrently could
    // slip in between the check and the rename is as short as possible.
    check_replaceable(path)?;
    fs::rename(&temp, path).map_err(|e| io("cannot create", e))?;
    Ok((listener, id))
}

/// Removes the socket file at `path` if it is still the one `id` names (another server may
/// have put its own there since).
pub fn remove_if_ours(path: &Path, id: FileId) {
    if FileId::of(path) == Some(id) {
        let _ = fs::remove_file(path);
    }
}

/// Ok if nothing is at `path` or only a stale socket (nobody accepts on it).
fn check_replaceable(path: &Path) -> Result<(), SocketFileError> {
    let meta = match fs::symlink_metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
        Err(e) => {
            return Err(SocketFileError::Io {
                what: "cannot inspect",
                path: path.to_owned(),
                source: e,
            })
        }
    };
    // Never clobber a regular file, directory or symlink that a typo pointed us at.
    if !meta.file_type().is_socket() {
        return Err(SocketFileError::NotASocket {
            path: path.to_owned(),
        });
    }
    match UnixStream::connect(path) {
        Ok(_) => Err(SocketFileError::InUse {
            path: path.to_owned(),
        }),
        // Refused: the file outlived its server (crash, SIGKILL). Gone: removed meanwhile.
        Err(e) if matches!(e.kind(), ErrorKind::ConnectionRefused | ErrorKind::NotFound) => Ok(()),
        // E.g. permission denied: we cannot tell whether it is live, so leave it alone.
        Err(e) => Err(SocketFileError::Io {
            what: "cannot check whether a server is listening on",
            path: path.to_owned(),
            source: e,
        }),
    }
}

/// A directory only we can enter, removed (with a leftover socket) when dropped.
struct PrivateDir {
    path: PathBuf,
}

impl PrivateDir {
    fn create(parent: &Path) -> Result<PrivateDir, SocketFileError> {
        // Short names keep the temporary socket path within sun_path; random ones avoid
        // colliding with a concurrent bind in the same directory.
        let random = RandomState::new();
        let mut last = None;
        for attempt in 0u64..16 {
            let mut hasher = random.build_hasher();
            hasher.write_u64(attempt);
            hasher.write_u32(std::process::id());
            let path = parent.join(format!(".cb{:06x}", hasher.finish() & 0xff_ffff));
            // The mode is applied before the directory is visible; umask can only remove bits.
            match DirBuilder::new().mode(0o700).create(&path) {
                Ok(()) => {
                    let dir = PrivateDir { path };
                    // A umask removing owner bits would make the directory useless to us.
                    fs::set_permissions(&dir.path, Permissions::from_mode(0o700)).map_err(|e| {
                        SocketFileError::Io {
                            what: "cannot set the mode of",
                            path: dir.path.clone(),
                            source: e,
                        }
                    })?;
                    return Ok(dir);
                }
                Err(e) if e.kind() == ErrorKind::AlreadyExists => last = Some(e),
                Err(e) => {
                    return Err(SocketFileError::Io {
                        what: "cannot create a temporary directory in",
                        path: parent.to_owned(),
                        source: e,
                    })
                }
            }
        }
        Err(SocketFileError::Io {
            what: "cannot create a temporary directory in",
            path: parent.to_owned(),
            source: last.unwrap_or_else(|| ErrorKind::AlreadyExists.into()),
        })
    }
}

impl Drop for PrivateDir {
    fn drop(&mut self) {
        // The socket is only still here when something failed before the rename.
        let _ = fs::remove_file(self.path.join("s"));
        let _ = fs::remove_dir(&self.path);
    }
}
