use std::io;
use std::path::PathBuf;

/// What a backup command's failure is, for exit statuses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// Wrong arguments for this chain (a name taken, an incremental without a base, ...).
    Usage,
    /// The chain or one of its files is damaged or inconsistent.
    Damaged,
    /// A chain written by a newer cryptblk.
    Unsupported,
    /// Reading or writing a local file failed.
    Io,
    /// Anything else: the NBD server, an interruption.
    Other,
}

/// A backup chain operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: io::Error },
    #[error(transparent)]
    Nbd(#[from] cryptblk_nbd_client::Error),
    /// One entry of the chain is damaged or does not follow the one before it.
    #[error("the backup chain in {} is damaged: entry {entry:?}: {problem}", dir.display())]
    Damaged {
        dir: PathBuf,
        entry: String,
        problem: String,
    },
    /// The chain as a whole (its manifest) is unusable.
    #[error("the backup chain in {} is damaged: {problem}", dir.display())]
    Manifest { dir: PathBuf, problem: String },
    #[error("the backup chain in {} has format version {version}, newer than this cryptblk reads (1): use a newer cryptblk", dir.display())]
    NewerFormat { dir: PathBuf, version: u64 },
    #[error("{0}")]
    Usage(String),
    /// The pull was stopped; what was copied is kept and the same command continues it, as
    /// long as the export is the same one (the same backup-start).
    #[error("interrupted after {copied} bytes: the same command continues this pull from the same export")]
    Interrupted { copied: u64 },
}

impl Error {
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::Io { .. } => ErrorKind::Io,
            Error::Damaged { .. } | Error::Manifest { .. } => ErrorKind::Damaged,
            Error::NewerFormat { .. } => ErrorKind::Unsupported,
            Error::Usage(_) => ErrorKind::Usage,
            Error::Nbd(cryptblk_nbd_client::Error::Uri { .. }) => ErrorKind::Usage,
            Error::Nbd(_) | Error::Interrupted { .. } => ErrorKind::Other,
        }
    }
}

/// Attaches a path to an I/O error.
pub(crate) trait IoContext<T> {
    fn at(self, path: &std::path::Path) -> Result<T, Error>;
}

impl<T> IoContext<T> for io::Result<T> {
    fn at(self, path: &std::path::Path) -> Result<T, Error> {
        self.map_err(|source| Error::Io {
            path: path.to_path_buf(),
            source,
        })
    }
}
