//! Removing a keyslot wipes its key material first and only then writes the header that
//! says the slot is inactive, as cryptsetup does (LUKS1 and LUKS2). A crash or a failed
//! header write in between must never leave the material of a "removed" key on disk.
mod common_core;

use common_core::*;
use cryptblk_luks::{HeaderIo, LuksImage};
use std::fs::File;
use std::path::Path;
use std::sync::Mutex;

#[derive(Debug, Clone, Copy, PartialEq)]
enum Event {
    Write { offset: u64, len: u64 },
    Sync,
}

/// A file that records every write and sync, in order.
struct Recording {
    file: File,
    events: Mutex<Vec<Event>>,
}

impl HeaderIo for Recording {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        HeaderIo::read_exact_at(&self.file, buf, offset)
    }
    fn write_all_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        self.events.lock().unwrap().push(Event::Write {
            offset,
            len: buf.len() as u64,
        });
        HeaderIo::write_all_at(&self.file, buf, offset)
    }
    fn size(&self) -> std::io::Result<u64> {
        HeaderIo::size(&self.file)
    }
    fn set_len(&self, len: u64) -> std::io::Result<()> {
        HeaderIo::set_len(&self.file, len)
    }
    fn sync_data(&self) -> std::io::Result<()> {
        self.events.lock().unwrap().push(Event::Sync);
        HeaderIo::sync_data(&self.file)
    }
}

/// The value after `key` on the first line of `dump` after `section` that starts with it.
fn dump_value(dump: &str, section: &str, key: &str) -> u64 {
    let rest = &dump[dump
        .find(section)
        .unwrap_or_else(|| panic!("{section}: {dump}"))..];
    let line = rest
        .lines()
        .map(str::trim)
        .find(|l| l.starts_with(key))
        .unwrap_or_else(|| panic!("{key} after {section}: {dump}"));
    line[key.len()..]
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

/// Formats with cryptsetup (`version`), adds a second key in slot 1, removes slot 1 with
/// cryptblk and checks the order of writes, the wiped area and cryptsetup's view.
fn remove_wipes_before_the_header(version: &str) {
    let dir = tempfile::tempdir().unwrap();
    let k0 = write_key(dir.path(), "k0", b"zero");
    let k1 = write_key(dir.path(), "k1", b"one");
    let cheap: &[&str] = match version {
        "luks1" => &["--iter-time", "1"],
        _ => &["--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"],
    };
    let mut fmt = vec!["--type", version, "--hash", "sha256"];
    fmt.extend_from_slice(cheap);
    let img = cs_format(dir.path(), 24 << 20, &k0, &fmt);
    let mut add = vec![
        "luksAddKey",
        "--batch-mode",
        "--key-file",
        s(&k0),
        "--key-slot",
        "1",
    ];
    add.extend_from_slice(cheap);
    add.extend_from_slice(&[s(&img), s(&k1)]);
    run("cryptsetup", &add);

    // Slot 1's area, as cryptsetup describes it.
    let dump = run("cryptsetup", &["luksDump", s(&img)]);
    let (area_offset, area_len, header_end) = if version == "luks1" {
        let sectors = dump_value(&dump, "Key Slot 1: ENABLED", "Key material offset:");
        let stripes = dump_value(&dump, "Key Slot 1: ENABLED", "AF stripes:");
        let key_bytes = dump_value(&dump, "MK bits:", "MK bits:") / 8;
        let len = (key_bytes * stripes).div_ceil(512) * 512;
        // The phdr lies before slot 0's material (sector 8).
        (sectors * 512, len, 4096)
    } else {
        let at = dump_value(&dump, "  1: luks2", "Area offset:");
        let len = dump_value(&dump, "  1: luks2", "Area length:");
        // Both binary headers with their JSON areas lie before the keyslots area.
        let slot0 = dump_value(&dump, "  0: luks2", "Area offset:");
        (at, len, slot0)
    };
    assert!(read_range(&img, area_offset, area_len as usize)
        .iter()
        .any(|&b| b != 0));

    let io = Recording {
        file: open_rw(&img),
        events: Mutex::new(Vec::new()),
    };
    let (mut image, _) = LuksImage::read(&io).unwrap();
    image.remove_keyslot(&io, 1).unwrap();
    let events = io.events.into_inner().unwrap();

    let first_header_write = events
        .iter()
        .position(|e| matches!(e, Event::Write { offset, .. } if *offset < header_end))
        .unwrap_or_else(|| panic!("no header write: {events:?}"));
    let wiped_before: u64 = events[..first_header_write]
        .iter()
        .map(|e| match *e {
            Event::Write { offset, len } if offset >= area_offset => {
                (offset + len).min(area_offset + area_len) - offset
            }
            _ => 0,
        })
        .sum();
    assert_eq!(
        wiped_before, area_len,
        "{version}: the header was written before the keyslot area was wiped: {events:?}"
    );
    assert!(
        events[..first_header_write].last() == Some(&Event::Sync),
        "{version}: the wipe was not synced before the header write: {events:?}"
    );

    // The material is gone, the header says so, cryptsetup agrees and only key 0 opens.
    assert!(
        read_range(&img, area_offset, area_len as usize)
            .iter()
            .all(|&b| b == 0),
        "{version}: the removed keyslot's area is not wiped"
    );
    assert_eq!(image.active_keyslots(), vec![0]);
    let (reread, _) = LuksImage::read(&open_rw(&img)).unwrap();
    assert_eq!(reread.active_keyslots(), vec![0]);
    let dump = run("cryptsetup", &["luksDump", s(&img)]);
    if version == "luks1" {
        assert!(dump.contains("Key Slot 1: DISABLED"), "{dump}");
    } else {
        assert!(!dump.contains("  1: luks2"), "{dump}");
    }
    let opens = |key: &Path| {
        succeeds(
            "cryptsetup",
            &["open", "--test-passphrase", "--key-file", s(key), s(&img)],
        )
    };
    assert!(opens(&k0), "{version}: the remaining key no longer opens");
    assert!(!opens(&k1), "{version}: the removed key still opens");
}

#[test]
fn luks1_remove_wipes_the_area_before_the_header() {
    remove_wipes_before_the_header("luks1");
}

#[test]
fn luks2_remove_wipes_the_area_before_the_header() {
    remove_wipes_before_the_header("luks2");
}
