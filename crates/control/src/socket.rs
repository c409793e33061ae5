//! Creating the listening socket with mode 0600 and no moment where it is more open.
//!
//! `bind(2)` creates the socket file with mode `0777 & ~umask`, and anyone who can write to a
//! UNIX socket file can connect to it. The usual fixes all have a flaw here:
//! - setting the umask around `bind` changes it for the whole process, so another thread
//!   creating a file at that moment (an image, a log) gets the wrong mode;
//! - `chmod` after `bind` leaves a window, and `fchmod` on the socket fd changes the socket's
//!   own inode rather than the file `bind` created (or, on Linux, only seeds its mode at bind
//!   time, which is not portable or documented behaviour).
//!
//! So the socket is bound (and listening) inside a fresh directory created with mode 0700 next
//! to the target, made 0600 there (nobody else can reach it through the private directory),
//! then renamed onto the target. The rename is atomic and replaces a stale socket in one step,
//! and the first moment anyone else can see the file it already has its final mode.
use crate::server::Error;
use std::collections::hash_map::RandomState;
use std::fs::{self, DirBuilder, Permissions};
use std::hash::{BuildHasher, Hasher};
use std::io::ErrorKind;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

/// `sizeof(sun_path) - 1` on Linux: longer paths cannot be bound or connected to.
const MAX_SOCKET_PATH: usize = 107;

/// Identifies the socket file we created, so cleanup never removes a socket that another
/// server has since put at the same path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FileId {
    dev: u64,
    ino: u64,
}

impl FileId {
    pub(crate) fn of(path: &Path) -> Option<FileId> {
        let meta = fs::symlink_metadata(path).ok()?;
        Some(FileId {
            dev: meta.dev(),
            ino: meta.ino(),
        })
    }
}

/// Binds and listens on `path` (absolute) with mode 0600; see the module comment.
pub(crate) fn bind_private(path: &Path) -> Result<(UnixListener, FileId), Error> {
    let len = path.as_os_str().len();
    if len > MAX_SOCKET_PATH {
        return Err(Error::PathTooLong {
            path: path.to_owned(),
            max: MAX_SOCKET_PATH,
        });
    }
    let (Some(parent), Some(_)) = (path.parent(), path.file_name()) else {
        return Err(Error::Io {
            what: "cannot create a socket at",
            path: path.to_owned(),
            source: ErrorKind::InvalidInput.into(),
        });
    };
    let dir = PrivateDir::create(parent)?;
    let temp = dir.path.join("s");
    if temp.as_os_str().len() > MAX_SOCKET_PATH {
        // The temporary path is a few bytes longer than the final one.
        return Err(Error::PathTooLong {
            path: path.to_owned(),
            max: MAX_SOCKET_PATH - (temp.as_os_str().len() - len),
        });
    }
    let io = |what, source| Error::Io {
        what,
        path: path.to_owned(),
        source,
    };
    let listener = UnixListener::bind(&temp).map_err(|e| io("cannot bind", e))?;
    fs::set_permissions(&temp, Permissions::from_mode(0o600))
        .map_err(|e| io("cannot set the mode of", e))?;
    let id = FileId::of(&temp).ok_or_else(|| io("cannot stat", ErrorKind::NotFound.into()))?;
    // Checked after binding so the window in which a server starting concurrently could
    // slip in between the check and the rename is as short as possible.
    check_replaceable(path)?;
    fs::rename(&temp, path).map_err(|e| io("cannot create", e))?;
    Ok((listener, id))
}

/// Ok if nothing is at `path` or only a stale socket (nobody accepts on it).
fn check_replaceable(path: &Path) -> Result<(), Error> {
    let meta = match fs::symlink_metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
        Err(e) => {
            return Err(Error::Io {
                what: "cannot inspect",
                path: path.to_owned(),
                source: e,
            })
        }
    };
    // Never clobber a regular file, directory or symlink that a typo pointed us at.
    if !meta.file_type().is_socket() {
        return Err(Error::NotASocket {
            path: path.to_owned(),
        });
    }
    match UnixStream::connect(path) {
        Ok(_) => Err(Error::InUse {
            path: path.to_owned(),
        }),
        // Refused: the file outlived its server (crash, SIGKILL). Gone: removed meanwhile.
        Err(e) if matches!(e.kind(), ErrorKind::ConnectionRefused | ErrorKind::NotFound) => Ok(()),
        // E.g. permission denied: we cannot tell whether it is live, so leave it alone.
        Err(e) => Err(Error::Io {
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
    fn create(parent: &Path) -> Result<PrivateDir, Error> {
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
                        Error::Io {
                            what: "cannot set the mode of",
                            path: dir.path.clone(),
                            source: e,
                        }
                    })?;
                    return Ok(dir);
                }
                Err(e) if e.kind() == ErrorKind::AlreadyExists => last = Some(e),
                Err(e) => {
                    return Err(Error::Io {
                        what: "cannot create a temporary directory in",
                        path: parent.to_owned(),
                        source: e,
                    })
                }
            }
        }
        Err(Error::Io {
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
