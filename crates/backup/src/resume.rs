//! Continuing an interrupted pull: what `pull.progress` records (how far the partial entry's
//! files are good, and which export they were read from) and whether a new pull may continue
//! it.
//!
//! A pull continues only when it pulls the same kind of entry from the same export: the same
//! size and the same non-empty NBD description. Mixing the bytes of two points in time would
//! make an entry that restores to neither, silently, so sameness is not guessed: cryptblk's
//! backup export names each `backup-start` in its description (`backup ID ...`, a random
//! id), so an export started again (after `backup-end --failed`, a crash) is another one;
//! an export without a description (qemu-nbd without `-D`, nbdkit) is never continued; a
//! record of an older cryptblk (no export in it) is not either.
use crate::manifest::EntryKind;
use serde::{Deserialize, Serialize};
use std::path::Path;

pub(crate) const PROGRESS_FILE: &str = "pull.progress";

/// The state `pull.progress` records: the partial files are good up to these lengths.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub(crate) struct Resume {
    pub(crate) index: usize,
    pub(crate) checkpoint: String,
    pub(crate) kind: EntryKind,
    pub(crate) since: Option<String>,
    pub(crate) bitmap: Option<String>,
    pub(crate) disk_size: u64,
    /// The export's NBD description, which tells one point in time from another (None: it
    /// had none, or an older cryptblk wrote this record without it; never continued).
    #[serde(default)]
    pub(crate) export: Option<String>,
    pub(crate) cursor: u64,
    pub(crate) extents_bytes: u64,
    pub(crate) data_bytes: u64,
    pub(crate) zero_bytes: u64,
}

/// Why the pull `previous` records cannot be continued by the one `wanted` describes (None:
/// it can). Only an export that says which point in time it is (its description) and says the
/// same as before is continued: the partial entry's bytes and the rest must be of one moment.
pub(crate) fn why_not_continue(
    previous: &Resume,
    wanted: &Resume,
    checkpoint: Option<&str>,
) -> Option<String> {
    let same_entry = previous.index == wanted.index
        && previous.kind == wanted.kind
        && previous.since == wanted.since
        && previous.bitmap == wanted.bitmap
        && previous.disk_size == wanted.disk_size
        && checkpoint.is_none_or(|c| c == previous.checkpoint);
    if !same_entry {
        return Some("this pull is a different one".into());
    }
    let Some(now) = &wanted.export else {
        return Some(
            "the export has no description to tell its point in time from another's, so a \
             pull from it is never continued (cryptblk's backup export has one; qemu-nbd: -D)"
                .into(),
        );
    };
    let Some(before) = &previous.export else {
        return Some(format!(
            "{PROGRESS_FILE} does not say which export it read (it had no description, or an \
             older cryptblk wrote the record)"
        ));
    };
    if before == now {
        return None;
    }
    Some(match (backup_id(before), backup_id(now)) {
        (Some(before), Some(now)) => format!(
            "it read backup {before}, this export is backup {now} (a backup started again \
             serves the disk as it is then)"
        ),
        _ => format!(
            "it read another export (described as {}; this one: {})",
            shown(before),
            shown(now)
        ),
    })
}

/// The id of a cryptblk backup export, from its description (`backup ID of disk ...`).
fn backup_id(description: &str) -> Option<&str> {
    let id = description.strip_prefix("backup ")?.split(' ').next()?;
    (id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit())).then_some(id)
}

/// A description a server sent, quoted and cut short for a one-line note.
fn shown(description: &str) -> String {
    const LONGEST: usize = 120;
    match description.char_indices().nth(LONGEST) {
        Some((cut, _)) => format!("{:?}...", &description[..cut]),
        None => format!("{description:?}"),
    }
}

/// What `pull.progress` holds.
pub(crate) enum Recorded {
    /// No interrupted pull (or none made durable yet).
    Nothing,
    Pull(Resume),
    /// A record this pull cannot use (damaged, or of another version): why.
    Unreadable(String),
}

pub(crate) fn load_resume(dir: &Path) -> Recorded {
    let path = dir.join(PROGRESS_FILE);
    match std::fs::read(&path) {
        Ok(bytes) => match serde_json::from_slice(&bytes) {
            Ok(record) => Recorded::Pull(record),
            Err(e) => Recorded::Unreadable(format!("it is not a progress record: {e}")),
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Recorded::Nothing,
        Err(e) => Recorded::Unreadable(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::durable;

    const BACKUP_A: &str = "backup 5d41402abc4b2a76b9719d911017c592 of disk vol at checkpoint c0: \
                            the image's bytes (LUKS header and ciphertext) as they were when it started";
    const BACKUP_B: &str = "backup 7d793037a0760186574b0282f2f435e7 of disk vol at checkpoint c0: \
                            the image's bytes (LUKS header and ciphertext) as they were when it started";

    /// An interrupted full pull of checkpoint c0, 100 MiB into a 512 MiB export.
    fn recorded(export: Option<&str>) -> Resume {
        Resume {
            index: 0,
            checkpoint: "c0".into(),
            kind: EntryKind::Full,
            since: None,
            bitmap: None,
            disk_size: 512 << 20,
            export: export.map(str::to_owned),
            cursor: 100 << 20,
            extents_bytes: 8 + 24 * 1600,
            data_bytes: 100 << 20,
            zero_bytes: 0,
        }
    }

    /// What a new pull of the same kind from an export described as `export` looks for.
    fn wanted(export: Option<&str>) -> Resume {
        Resume {
            checkpoint: String::new(),
            cursor: 0,
            extents_bytes: 0,
            data_bytes: 0,
            ..recorded(export)
        }
    }

    #[test]
    fn only_the_same_backup_export_is_continued() {
        let same = why_not_continue(&recorded(Some(BACKUP_A)), &wanted(Some(BACKUP_A)), None);
        assert_eq!(same, None);
        let named = why_not_continue(
            &recorded(Some(BACKUP_A)),
            &wanted(Some(BACKUP_A)),
            Some("c0"),
        );
        assert_eq!(named, None);

        let again = why_not_continue(&recorded(Some(BACKUP_A)), &wanted(Some(BACKUP_B)), None)
            .expect("a backup started again was continued");
        assert!(
            again.contains("5d41402abc4b2a76b9719d911017c592"),
            "{again}"
        );
        assert!(
            again.contains("7d793037a0760186574b0282f2f435e7"),
            "{again}"
        );
        assert!(again.contains("started again"), "{again}");

        let other = why_not_continue(
            &recorded(Some("nightly snapshot 1")),
            &wanted(Some("nightly snapshot 2")),
            None,
        )
        .expect("another third-party export was continued");
        assert!(other.contains("\"nightly snapshot 1\""), "{other}");
        assert!(other.contains("\"nightly snapshot 2\""), "{other}");
        let third = why_not_continue(
            &recorded(Some("nightly snapshot 1")),
            &wanted(Some("nightly snapshot 1")),
            None,
        );
        assert_eq!(
            third, None,
            "the same description names the same point in time"
        );
    }

    #[test]
    fn an_export_without_a_description_is_never_continued() {
        for before in [None, Some(BACKUP_A)] {
            let why = why_not_continue(&recorded(before), &wanted(None), None)
                .expect("an export without a description was continued");
            assert!(why.contains("no description"), "{why}");
        }
    }

    #[test]
    fn a_different_entry_is_not_continued_whatever_the_export() {
        let mut other_size = wanted(Some(BACKUP_A));
        other_size.disk_size += 1 << 20;
        let mut incremental = wanted(Some(BACKUP_A));
        incremental.kind = EntryKind::Incremental;
        incremental.since = Some("c0".into());
        incremental.bitmap = Some("c0".into());
        for w in [other_size, incremental] {
            let why = why_not_continue(&recorded(Some(BACKUP_A)), &w, None).unwrap();
            assert!(why.contains("different one"), "{why}");
        }
        let renamed = why_not_continue(
            &recorded(Some(BACKUP_A)),
            &wanted(Some(BACKUP_A)),
            Some("c9"),
        );
        assert!(renamed.unwrap().contains("different one"));
    }

    #[test]
    fn a_progress_record_of_an_older_cryptblk_starts_over() {
        // pull.progress as cryptblk wrote it before records named their export.
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join(PROGRESS_FILE),
            r#"{"index":0,"checkpoint":"c0","kind":"full","since":null,"bitmap":null,"disk_size":536870912,"cursor":104857600,"extents_bytes":38408,"data_bytes":104857600,"zero_bytes":0}"#,
        )
        .unwrap();
        let Recorded::Pull(old) = load_resume(dir.path()) else {
            panic!("an older progress record was not read");
        };
        assert_eq!(old.export, None);
        assert_eq!(old.cursor, 100 << 20);
        let why = why_not_continue(&old, &wanted(Some(BACKUP_A)), None)
            .expect("an older progress record was continued");
        assert!(why.contains("older cryptblk"), "{why}");
    }

    #[test]
    fn a_progress_record_round_trips_with_its_export_and_damage_is_named() {
        let dir = tempfile::tempdir().unwrap();
        assert!(matches!(load_resume(dir.path()), Recorded::Nothing));
        let record = recorded(Some(BACKUP_A));
        durable::replace(
            &dir.path().join(PROGRESS_FILE),
            &serde_json::to_vec(&record).unwrap(),
        )
        .unwrap();
        match load_resume(dir.path()) {
            Recorded::Pull(read) => assert_eq!(read, record),
            _ => panic!("a progress record did not read back"),
        }
        std::fs::write(dir.path().join(PROGRESS_FILE), b"{\"index\": 0, \"check").unwrap();
        let Recorded::Unreadable(why) = load_resume(dir.path()) else {
            panic!("a damaged progress record was read");
        };
        assert!(why.contains("not a progress record"), "{why}");
    }

    #[test]
    fn a_backup_id_is_read_only_from_a_cryptblk_backup_description() {
        assert_eq!(
            backup_id(BACKUP_A),
            Some("5d41402abc4b2a76b9719d911017c592")
        );
        assert_eq!(backup_id("backup of disk vol"), None);
        assert_eq!(backup_id("backup 5d41 of disk vol"), None);
        assert_eq!(backup_id(""), None);
        let long = "x".repeat(1000);
        assert!(shown(&long).len() < 130, "{}", shown(&long));
    }
}
