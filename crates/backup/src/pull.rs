//! `backup pull`: one new entry of the chain from an NBD export of the image's bytes.
//!
//! A full pull copies the extents `base:allocation` reports allocated (not reading as
//! zeroes); an incremental copies those `qemu:dirty-bitmap:NAME` reports dirty. Block status is
//! asked for one window (1 GiB) at a time and the data read in 4 MiB requests, on a thread
//! that reads ahead of the one storing (`read_ahead`), so memory stays the same whatever the
//! disk's size. Data that reads as zeroes (per 64 KiB) is recorded as a
//! zero extent and not stored.
//!
//! Resuming: the entry is written to `pull.extents.partial` and `pull.data.partial`; every
//! 256 MiB (and when interrupted) both are made durable and `pull.progress` records how far
//! they are good, and from which export. The same command run again continues from there
//! when the export is the same one (`resume`: the same size and non-empty NBD description);
//! otherwise the partial files are discarded (said on the notes callback).
//!
//! What is durable is released on an export that takes releases (`release`: cryptblk's
//! backup export then stops keeping it), unless [`PullOptions::release`] is false.
use crate::durable;
use crate::error::{Error, IoContext};
use crate::extents::{Kind, Record, Writer};
use crate::manifest::{self, Entry, EntryKind, FileDigest, Manifest};
use crate::read_ahead::{Pulled, ReadAhead};
use crate::release::Releaser;
use crate::resume::{load_resume, why_not_continue, Recorded, Resume, PROGRESS_FILE};
use cryptblk_nbd_client::{
    Client, NbdUri, BASE_ALLOCATION, DIRTY_BITMAP_PREFIX, STATE_DIRTY, STATE_ZERO,
};
use sha2::{Digest, Sha256};
use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Read, Write};
use std::ops::ControlFlow;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

const ZERO_BLOCK: usize = 64 << 10;
const DURABLE_EVERY: u64 = 256 << 20;

const EXTENTS_PARTIAL: &str = "pull.extents.partial";
const DATA_PARTIAL: &str = "pull.data.partial";
const LOCK_FILE: &str = "pull.lock";

/// What to pull.
#[derive(Debug, Clone)]
pub struct PullOptions {
    pub uri: String,
    pub dir: PathBuf,
    /// Pull only what a dirty bitmap reports changed since the chain's last checkpoint.
    pub incremental: bool,
    /// The dirty bitmap of an incremental (default: the name of the chain's last checkpoint).
    pub bitmap: Option<String>,
    /// The new entry's checkpoint name (default: the time, `YYYYMMDDTHHMMSSZ`).
    pub checkpoint: Option<String>,
    /// Release what is stored, on an export that takes releases (`release`): false when
    /// another client reads the same export.
    pub release: bool,
}

/// How far a pull is.
#[derive(Debug, Clone, Copy)]
pub struct Progress {
    /// Bytes of the export looked at so far, of `total`.
    pub position: u64,
    pub total: u64,
    /// Bytes of data stored so far.
    pub copied: u64,
}

/// What a finished pull did.
#[derive(Debug, Clone)]
pub struct PullReport {
    pub entry: Entry,
    /// Where an interrupted pull was continued from.
    pub resumed_at: Option<u64>,
}

/// Pulls one entry into the chain in `options.dir`. `progress` is called after every read;
/// returning `Break` stops the pull durably (an [`Error::Interrupted`]; the same call
/// continues it). `note` receives what the user should know (a pull continued or discarded).
pub fn pull(
    options: &PullOptions,
    mut progress: impl FnMut(&Progress) -> ControlFlow<()>,
    mut note: impl FnMut(&str),
) -> Result<PullReport, Error> {
    let dir = options.dir.as_path();
    std::fs::create_dir_all(dir).at(dir)?;
    let _lock = lock(dir)?;
    let mut chain = Manifest::load(dir)?.unwrap_or_else(Manifest::empty);
    let uri = NbdUri::parse(&options.uri)?;

    let (kind, since, bitmap, context) = if options.incremental {
        let last = chain.entries.last().ok_or_else(|| {
            Error::Usage(format!(
                "{} holds no backup yet: an incremental needs a full pull first",
                dir.display()
            ))
        })?;
        let bitmap = options
            .bitmap
            .clone()
            .unwrap_or_else(|| last.checkpoint.clone());
        let context = format!("{DIRTY_BITMAP_PREFIX}{bitmap}");
        (
            EntryKind::Incremental,
            Some(last.checkpoint.clone()),
            Some(bitmap),
            context,
        )
    } else {
        if options.bitmap.is_some() {
            return Err(Error::Usage(
                "--bitmap names the dirty bitmap of an --incremental pull".into(),
            ));
        }
        (EntryKind::Full, None, None, BASE_ALLOCATION.to_string())
    };
    if let Some(name) = &options.checkpoint {
        manifest::check_name(name).map_err(Error::Usage)?;
    }

    let client = Client::connect(&uri, &[&context])?;
    let mut releaser = Releaser::connect(&uri, &client, options.release, &mut note);
    let disk_size = client.info().size;
    let index = chain.entries.len();

    let wanted = Resume {
        index,
        checkpoint: String::new(),
        kind,
        since: since.clone(),
        bitmap: bitmap.clone(),
        disk_size,
        export: client
            .description()
            .filter(|d| !d.is_empty())
            .map(str::to_owned),
        cursor: 0,
        extents_bytes: 0,
        data_bytes: 0,
        zero_bytes: 0,
    };
    let resume = match load_resume(dir) {
        Recorded::Nothing => None,
        Recorded::Unreadable(why) => {
            note(&format!(
                "discarding the interrupted pull recorded in {PROGRESS_FILE}: {why}"
            ));
            None
        }
        Recorded::Pull(r) => match why_not_continue(&r, &wanted, options.checkpoint.as_deref()) {
            None if partial_files_hold(dir, &r) => Some(r),
            None => {
                note(&format!(
                    "discarding the interrupted pull of checkpoint {:?}: its partial files are missing or shorter than recorded",
                    r.checkpoint
                ));
                None
            }
            Some(why) => {
                note(&format!(
                    "discarding the interrupted pull of checkpoint {:?} ({} of {} bytes looked at) and starting over: {why}",
                    r.checkpoint, r.cursor, r.disk_size
                ));
                None
            }
        },
    };
    let checkpoint = match (&resume, &options.checkpoint) {
        (Some(r), _) => r.checkpoint.clone(),
        (None, Some(name)) => name.clone(),
        (None, None) => manifest::utc_stamp(now()),
    };
    if chain.entries.iter().any(|e| e.checkpoint == checkpoint) {
        return Err(Error::Usage(format!(
            "the backup chain in {} already has checkpoint {checkpoint:?}: choose another --checkpoint",
            dir.display()
        )));
    }
    let mut state = match resume {
        Some(r) => {
            note(&format!(
                "continuing the interrupted pull of checkpoint {:?} at byte {} of {}",
                r.checkpoint, r.cursor, r.disk_size
            ));
            Partial::reopen(dir, r)?
        }
        None => Partial::create(
            dir,
            Resume {
                checkpoint: checkpoint.clone(),
                ..wanted
            },
        )?,
    };
    let resumed_at = (state.record.cursor > 0).then_some(state.record.cursor);

    let want = move |flags: u32| match kind {
        EntryKind::Full => flags & STATE_ZERO == 0,
        EntryKind::Incremental => flags & STATE_DIRTY != 0,
    };
    let start = state.record.cursor;
    let client = std::thread::scope(|scope| -> Result<Client, Error> {
        let reader = ReadAhead::start(scope, client, context, start, disk_size, want);
        let mut since_durable = 0u64;
        while let Some(pulled) = reader.next() {
            let report_now = match pulled? {
                Pulled::Data { pos, buf, len } => {
                    state.append(pos, &buf[..len])?;
                    reader.recycle(buf);
                    state.start_writeback()?;
                    state.record.cursor = pos + len as u64;
                    since_durable += len as u64;
                    true
                }
                Pulled::Skipped { to, window_end } => {
                    state.record.cursor = to;
                    window_end
                }
            };
            if !report_now {
                continue;
            }
            let report = Progress {
                position: state.record.cursor,
                total: disk_size,
                copied: state.record.data_bytes,
            };
            if progress(&report).is_break() {
                state.make_durable()?;
                releaser.release_below(state.record.cursor, &mut note);
                return Err(Error::Interrupted {
                    copied: state.record.data_bytes,
                });
            }
            if since_durable >= DURABLE_EVERY {
                state.make_durable()?;
                since_durable = 0;
                releaser.release_below(state.record.cursor, &mut note);
            }
        }
        Ok(reader.finish())
    })?;
    let entry = state.finish(dir, uri.to_string())?;
    chain.entries.push(entry.clone());
    chain.disk_size = disk_size;
    chain.store(dir)?;
    remove_if_present(&dir.join(PROGRESS_FILE))?;
    durable::sync_dir(&Manifest::path(dir))?;
    // Only now: until the manifest names the entry, a pull run again starts over and reads
    // everything.
    releaser.release_below(disk_size, &mut note);
    releaser.disconnect();
    client.disconnect();
    Ok(PullReport { entry, resumed_at })
}

/// Whether the partial files still hold at least what `r` says is durable.
fn partial_files_hold(dir: &Path, r: &Resume) -> bool {
    let len = |name: &str| std::fs::metadata(dir.join(name)).map(|m| m.len()).ok();
    len(EXTENTS_PARTIAL).is_some_and(|l| l >= r.extents_bytes && r.extents_bytes >= 8)
        && len(DATA_PARTIAL).is_some_and(|l| l >= r.data_bytes)
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn remove_if_present(path: &Path) -> Result<(), Error> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e).at(path),
        _ => Ok(()),
    }
}

/// One pull per chain directory at a time: an exclusive `flock` on `pull.lock`.
fn lock(dir: &Path) -> Result<File, Error> {
    let path = dir.join(LOCK_FILE);
    let f = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .at(&path)?;
    match f.try_lock() {
        Ok(()) => Ok(f),
        Err(std::fs::TryLockError::WouldBlock) => Err(Error::Usage(format!(
            "another pull is writing the backup chain in {} (it holds {})",
            dir.display(),
            path.display()
        ))),
        Err(std::fs::TryLockError::Error(e)) => Err(e).at(&path),
    }
}

/// The entry being written.
struct Partial {
    dir: PathBuf,
    record: Resume,
    extents: Writer<BufWriter<File>>,
    data: BufWriter<File>,
    data_hash: Sha256,
    /// The data file's bytes below this were handed to the disk's writeback
    /// (`start_writeback`).
    written_back: u64,
}

impl Partial {
    fn create(dir: &Path, record: Resume) -> Result<Partial, Error> {
        remove_if_present(&dir.join(PROGRESS_FILE))?;
        let open = |name: &str| {
            let path = dir.join(name);
            File::create(&path).at(&path)
        };
        let extents_path = dir.join(EXTENTS_PARTIAL);
        let extents = Writer::new(BufWriter::new(open(EXTENTS_PARTIAL)?), 0).at(&extents_path)?;
        let data = BufWriter::with_capacity(1 << 20, open(DATA_PARTIAL)?);
        Ok(Partial {
            dir: dir.to_path_buf(),
            record,
            extents,
            data,
            data_hash: Sha256::new(),
            written_back: 0,
        })
    }

    /// Reopens the partial files at the lengths `record` says are durable.
    fn reopen(dir: &Path, record: Resume) -> Result<Partial, Error> {
        let open = |name: &str, len: u64| -> Result<File, Error> {
            let path = dir.join(name);
            let f = OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
                .at(&path)?;
            let have = f.metadata().at(&path)?.len();
            if have < len {
                return Err(Error::Usage(format!(
                    "{} is shorter than its progress record: remove {} to start this pull afresh",
                    path.display(),
                    dir.join(PROGRESS_FILE).display()
                )));
            }
            f.set_len(len).at(&path)?;
            Ok(f)
        };
        let mut extents_file = open(EXTENTS_PARTIAL, record.extents_bytes)?;
        let mut data_file = open(DATA_PARTIAL, record.data_bytes)?;
        let data_path = dir.join(DATA_PARTIAL);
        let mut data_hash = Sha256::new();
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = data_file.read(&mut buf).at(&data_path)?;
            if n == 0 {
                break;
            }
            data_hash.update(&buf[..n]);
        }
        use std::io::Seek;
        let extents_path = dir.join(EXTENTS_PARTIAL);
        extents_file
            .seek(std::io::SeekFrom::End(0))
            .at(&extents_path)?;
        let extents =
            Writer::new(BufWriter::new(extents_file), record.extents_bytes).at(&extents_path)?;
        Ok(Partial {
            dir: dir.to_path_buf(),
            written_back: record.data_bytes,
            record,
            extents,
            data: BufWriter::with_capacity(1 << 20, data_file),
            data_hash,
        })
    }

    /// Starts the disk writing the data appended since the last call, without waiting for
    /// it: the disk then writes while the export is read, and the next `make_durable` finds
    /// little left to wait for (a pull that only synced every 256 MiB stalled there).
    #[allow(unsafe_code)] // sync_file_range: rustix and std have no wrapper
    fn start_writeback(&mut self) -> Result<(), Error> {
        self.data.flush().at(&self.dir.join(DATA_PARTIAL))?;
        let end = self.record.data_bytes;
        let from = std::mem::replace(&mut self.written_back, end);
        if end > from {
            let (Ok(start), Ok(len)) = (
                libc::off64_t::try_from(from),
                libc::off64_t::try_from(end - from),
            ) else {
                return Ok(());
            };
            // SAFETY: sync_file_range takes a descriptor we own (borrowed for the call) and
            // two integers; it touches no memory of ours. Its result is advice only: an error
            // here shows again, and is reported, at `make_durable`'s fdatasync.
            unsafe {
                libc::sync_file_range(
                    self.data.get_ref().as_raw_fd(),
                    start,
                    len,
                    libc::SYNC_FILE_RANGE_WRITE,
                )
            };
        }
        Ok(())
    }

    /// Adds what the export holds at `offset`: zero blocks as zero extents, the rest as data.
    fn append(&mut self, offset: u64, bytes: &[u8]) -> Result<(), Error> {
        let mut at = offset;
        for block in bytes.chunks(ZERO_BLOCK) {
            let len = block.len() as u64;
            let kind = if is_zero(block) {
                Kind::Zero
            } else {
                Kind::Data
            };
            if kind == Kind::Data {
                self.data
                    .write_all(block)
                    .at(&self.dir.join(DATA_PARTIAL))?;
                self.data_hash.update(block);
                self.record.data_bytes += len;
            } else {
                self.record.zero_bytes += len;
            }
            self.extents
                .push(Record {
                    offset: at,
                    length: len,
                    kind,
                })
                .at(&self.dir.join(EXTENTS_PARTIAL))?;
            at += len;
        }
        Ok(())
    }

    /// Everything so far reaches stable storage, then the progress record says so.
    fn make_durable(&mut self) -> Result<(), Error> {
        let extents_path = self.dir.join(EXTENTS_PARTIAL);
        let data_path = self.dir.join(DATA_PARTIAL);
        self.extents.settle().at(&extents_path)?;
        self.extents.flush().at(&extents_path)?;
        self.extents
            .get_mut()
            .get_ref()
            .sync_data()
            .at(&extents_path)?;
        self.data.flush().at(&data_path)?;
        self.data.get_ref().sync_data().at(&data_path)?;
        self.record.extents_bytes = self.extents.written;
        let json = serde_json::to_vec(&self.record).expect("a progress record serializes");
        durable::replace(&self.dir.join(PROGRESS_FILE), &json)
    }

    /// Renames the partial files to the entry's names and describes the entry.
    fn finish(mut self, dir: &Path, source: String) -> Result<Entry, Error> {
        self.make_durable()?;
        let r = self.record.clone();
        let extents_name = format!("{:04}-{}.extents", r.index, r.checkpoint);
        let data_name = format!("{:04}-{}.data", r.index, r.checkpoint);
        let extents_sha = sha256_file(&dir.join(EXTENTS_PARTIAL))?;
        let data_sha = hex::encode(self.data_hash.finalize());
        for (from, to) in [(EXTENTS_PARTIAL, &extents_name), (DATA_PARTIAL, &data_name)] {
            std::fs::rename(dir.join(from), dir.join(to)).at(&dir.join(to))?;
        }
        durable::sync_dir(&dir.join(&data_name))?;
        let time = now();
        Ok(Entry {
            checkpoint: r.checkpoint,
            kind: r.kind,
            since: r.since,
            bitmap: r.bitmap,
            time,
            time_utc: manifest::utc_stamp(time),
            source,
            disk_size: r.disk_size,
            data_bytes: r.data_bytes,
            zero_bytes: r.zero_bytes,
            extents: FileDigest {
                file: extents_name,
                bytes: r.extents_bytes,
                sha256: extents_sha,
            },
            data: FileDigest {
                file: data_name,
                bytes: r.data_bytes,
                sha256: data_sha,
            },
        })
    }
}

/// The SHA-256 of a file's bytes, in lowercase hex.
pub(crate) fn sha256_file(path: &Path) -> Result<String, Error> {
    let mut f = File::open(path).at(path)?;
    let mut hash = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).at(path)?;
        if n == 0 {
            break;
        }
        hash.update(&buf[..n]);
    }
    Ok(hex::encode(hash.finalize()))
}

/// Whether a block is all zero bytes (stops at the first 4 KiB that is not).
pub(crate) fn is_zero(block: &[u8]) -> bool {
    block
        .chunks(4096)
        .all(|page| page.iter().fold(0u8, |acc, &b| acc | b) == 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_pull_into_the_same_chain_is_refused_until_the_first_ends() {
        let dir = tempfile::tempdir().unwrap();
        let first = lock(dir.path()).unwrap();
        let err = lock(dir.path()).unwrap_err();
        assert!(matches!(err, Error::Usage(_)), "{err}");
        assert!(err.to_string().contains("another pull"), "{err}");
        drop(first);
        lock(dir.path()).unwrap();
    }
}
