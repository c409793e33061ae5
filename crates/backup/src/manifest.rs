//! The chain's manifest (`manifest.json`): the disk's size and the entries in order. It is
//! replaced atomically and written last, after the files it names are durable, so it only
//! ever names complete entries.
use crate::durable;
use crate::error::{Error, IoContext};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

pub const FILE: &str = "manifest.json";
pub const FORMAT: &str = "cryptblk-backup-chain";
pub const VERSION: u64 = 1;
/// A manifest larger than this is not one cryptblk wrote (about 300 bytes per entry).
const MAX_MANIFEST: u64 = 64 << 20;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// Always [`FORMAT`].
    pub format: String,
    pub version: u64,
    /// The disk's size at the last entry.
    pub disk_size: u64,
    pub entries: Vec<Entry>,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum EntryKind {
    /// Every allocated extent of the export.
    Full,
    /// The extents a dirty bitmap reports changed since the previous entry's checkpoint.
    Incremental,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Entry {
    /// The checkpoint this entry restores to (unique in the chain).
    pub checkpoint: String,
    pub kind: EntryKind,
    /// For an incremental: the checkpoint whose changes it holds (the previous entry's), which
    /// is also the name of the dirty bitmap it was pulled with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since: Option<String>,
    /// For an incremental: the dirty bitmap it was pulled with (`qemu:dirty-bitmap:NAME`),
    /// which its puller stated records every change since `since`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bitmap: Option<String>,
    /// When the pull finished, in seconds since 1970 (UTC), and the same as text.
    pub time: u64,
    pub time_utc: String,
    /// The NBD URI it was pulled from.
    pub source: String,
    /// The disk's size at this checkpoint.
    pub disk_size: u64,
    /// Bytes of data (copied) and of zeroes (recorded, not stored) this entry holds.
    pub data_bytes: u64,
    pub zero_bytes: u64,
    pub extents: FileDigest,
    pub data: FileDigest,
}

/// A file of an entry, its length and the SHA-256 of its bytes (lowercase hex).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct FileDigest {
    pub file: String,
    pub bytes: u64,
    pub sha256: String,
}

impl Manifest {
    pub fn empty() -> Manifest {
        Manifest {
            format: FORMAT.into(),
            version: VERSION,
            disk_size: 0,
            entries: Vec::new(),
        }
    }

    pub fn path(dir: &Path) -> PathBuf {
        dir.join(FILE)
    }

    /// The chain in `dir`, or `None` when `dir` has no manifest yet.
    pub fn load(dir: &Path) -> Result<Option<Manifest>, Error> {
        let path = Manifest::path(dir);
        let damaged = |problem: String| Error::Manifest {
            dir: dir.to_path_buf(),
            problem,
        };
        let file = match std::fs::File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e).at(&path),
        };
        let len = file.metadata().at(&path)?.len();
        if len > MAX_MANIFEST {
            return Err(damaged(format!("{FILE} is {len} bytes long")));
        }
        let value: serde_json::Value = serde_json::from_reader(std::io::BufReader::new(file))
            .map_err(|e| damaged(format!("{FILE} is not valid JSON: {e}")))?;
        if value.get("format").and_then(|f| f.as_str()) != Some(FORMAT) {
            return Err(damaged(format!("{FILE} is not a {FORMAT} manifest")));
        }
        match value.get("version").and_then(|v| v.as_u64()) {
            Some(VERSION) => {}
            Some(v) if v > VERSION => {
                return Err(Error::NewerFormat {
                    dir: dir.to_path_buf(),
                    version: v,
                })
            }
            _ => return Err(damaged(format!("{FILE} has no known version"))),
        }
        let manifest: Manifest = serde_json::from_value(value)
            .map_err(|e| damaged(format!("{FILE} does not describe a chain: {e}")))?;
        manifest.check(dir)?;
        Ok(Some(manifest))
    }

    /// Writes the manifest crash-safely (the files it names must already be durable).
    pub fn store(&self, dir: &Path) -> Result<(), Error> {
        let mut json = serde_json::to_vec_pretty(self).expect("a manifest serializes");
        json.push(b'\n');
        durable::replace(&Manifest::path(dir), &json)
    }

    /// The chain's continuity: it starts with a full entry, each incremental holds the
    /// changes since the entry before it, names are unique and files are plain names in the
    /// chain's directory.
    pub fn check(&self, dir: &Path) -> Result<(), Error> {
        let damaged = |entry: &Entry, problem: String| Error::Damaged {
            dir: dir.to_path_buf(),
            entry: entry.checkpoint.clone(),
            problem,
        };
        let mut previous: Option<&Entry> = None;
        for (i, e) in self.entries.iter().enumerate() {
            if let Err(problem) = check_name(&e.checkpoint) {
                return Err(Error::Manifest {
                    dir: dir.to_path_buf(),
                    problem: format!("entry {i}: {problem}"),
                });
            }
            if self.entries[..i]
                .iter()
                .any(|o| o.checkpoint == e.checkpoint)
            {
                return Err(damaged(e, "the checkpoint name appears twice".into()));
            }
            match (e.kind, &e.since, previous) {
                (EntryKind::Full, None, _) => {}
                (EntryKind::Full, Some(_), _) => {
                    return Err(damaged(e, "a full entry names a base".into()))
                }
                (EntryKind::Incremental, _, None) => {
                    return Err(damaged(
                        e,
                        "the chain starts with an incremental, not a full entry".into(),
                    ))
                }
                (EntryKind::Incremental, since, Some(p)) => {
                    if since.as_deref() != Some(p.checkpoint.as_str()) {
                        return Err(damaged(
                            e,
                            format!(
                                "it holds the changes since {:?}, but the entry before it is {:?}: the chain is broken",
                                since.as_deref().unwrap_or(""),
                                p.checkpoint
                            ),
                        ));
                    }
                }
            }
            for f in [&e.extents, &e.data] {
                if !is_plain_file_name(&f.file) {
                    return Err(damaged(
                        e,
                        format!("{:?} is not a file of this directory", f.file),
                    ));
                }
            }
            previous = Some(e);
        }
        if let Some(last) = self.entries.last() {
            if last.disk_size != self.disk_size {
                return Err(damaged(last, "its disk size is not the chain's".into()));
            }
        }
        Ok(())
    }

    /// The index of checkpoint `name`, or of the last entry.
    pub fn find(&self, dir: &Path, name: Option<&str>) -> Result<usize, Error> {
        match name {
            None => self
                .entries
                .len()
                .checked_sub(1)
                .ok_or_else(|| Error::Manifest {
                    dir: dir.to_path_buf(),
                    problem: "it has no entries".into(),
                }),
            Some(n) => self
                .entries
                .iter()
                .position(|e| e.checkpoint == n)
                .ok_or_else(|| {
                    let names: Vec<&str> =
                        self.entries.iter().map(|e| e.checkpoint.as_str()).collect();
                    Error::Usage(format!(
                        "the backup chain in {} has no checkpoint {n:?} (it has: {})",
                        dir.display(),
                        names.join(", ")
                    ))
                }),
        }
    }
}

/// Checkpoint names: 1 to 64 of `A-Za-z0-9._-`, not starting with a dot (they become file
/// names and QEMU bitmap names).
pub fn check_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{name:?} is not a checkpoint name (1-64 of A-Z a-z 0-9 . _ -, not starting with a dot)"
        ))
    }
}

fn is_plain_file_name(name: &str) -> bool {
    !name.is_empty() && !name.contains('/') && name != "." && name != ".." && !name.contains('\0')
}

/// `YYYYMMDDTHHMMSSZ` for seconds since 1970 (UTC).
pub fn utc_stamp(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Civil date from days since 1970-01-01 (H. Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}{month:02}{day:02}T{:02}{:02}{:02}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stamps_are_utc_dates() {
        assert_eq!(utc_stamp(0), "19700101T000000Z");
        assert_eq!(utc_stamp(951_782_400), "20000229T000000Z");
        assert_eq!(utc_stamp(1_795_921_262), "20261129T030102Z");
    }

    #[test]
    fn names_that_would_escape_or_hide_are_refused() {
        for bad in ["", ".hidden", "a/b", "..", "a b", &"x".repeat(65)] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
        for good in ["c0", "daily-2026.11.29", "A_b"] {
            check_name(good).unwrap();
        }
    }
}
