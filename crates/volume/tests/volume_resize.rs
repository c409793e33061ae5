//! `Volume::resize`: a disk grown or shrunk while it serves, LUKS (image and header follow
//! the payload) or raw (the image is the disk); and the same steps on an image not open
//! (`resize_luks`, `resize_raw`), as the CLI's offline `cryptblk resize` runs them.
mod common;

use common::{container, PW};
use cryptblk_luks::{LuksVersion, Unlocker};
use cryptblk_volume::{resize_luks, resize_raw, Key, ResizeError, Volume, VolumeOptions};
use std::path::Path;

const MIB: u64 = 1 << 20;

fn open_luks(path: &Path) -> Volume {
    let opts = VolumeOptions {
        writable: true,
        ..Default::default()
    };
    Volume::open(container(path), Key::Given(Unlocker::Passphrase(PW), &opts)).unwrap()
}

/// A served LUKS2 disk grows: the guest sees the new size at once, the header says it (a
/// reopen sees it), and what was written before reads back; a shrink not allowed and a size
/// off the sector grid are refused with the disk unchanged.
#[test]
fn a_served_luks_volume_grows_and_refuses_a_shrink_not_allowed() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("disk.luks");
    common::luks(&img, LuksVersion::V2, MIB);
    let data = vec![0x5a; 4096];
    {
        let volume = open_luks(&img);
        volume.device.write_at(&data, MIB - 4096).unwrap();
        let resized = volume.resize(2 * MIB, false).unwrap();
        assert_eq!((resized.old, resized.new), (MIB, 2 * MIB));
        assert_eq!(volume.device.size(), 2 * MIB);
        volume.device.write_at(&data, 2 * MIB - 4096).unwrap();
        volume.device.flush().unwrap();

        let shrink = volume.resize(MIB, false).unwrap_err();
        assert!(matches!(shrink, ResizeError::Shrink { .. }), "{shrink:?}");
        assert!(shrink.is_bad_request());
        let unaligned = volume.resize(2 * MIB + 100, false).unwrap_err();
        assert!(unaligned.to_string().contains("use 2097664"), "{unaligned}");
        assert_eq!(volume.device.size(), 2 * MIB, "refusals leave the size");
    }
    let volume = open_luks(&img);
    assert_eq!(
        volume.device.size(),
        2 * MIB,
        "the header says the new size"
    );
    let mut back = vec![0; 4096];
    for offset in [MIB - 4096, 2 * MIB - 4096] {
        volume.device.read_at(&mut back, offset).unwrap();
        assert_eq!(back, data, "at {offset}");
    }
    // Allowed, the shrink cuts the image to the payload's new end.
    let resized = volume.resize(MIB, true).unwrap();
    assert_eq!((resized.old, resized.new), (2 * MIB, MIB));
    let data_offset = volume.container.size() - MIB;
    drop(volume);
    assert_eq!(std::fs::metadata(&img).unwrap().len(), data_offset + MIB);
}

/// A served raw disk is its image: grown and shrunk, the file follows.
#[test]
fn a_served_raw_volume_is_resized_with_its_image() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("disk.raw");
    std::fs::write(&img, vec![7u8; MIB as usize]).unwrap();
    let volume = Volume::open(container(&img), Key::None).unwrap();
    volume.resize(3 * MIB, false).unwrap();
    assert_eq!(volume.device.size(), 3 * MIB);
    assert_eq!(std::fs::metadata(&img).unwrap().len(), 3 * MIB);
    let refused = volume.resize(MIB, false).unwrap_err();
    assert!(matches!(refused, ResizeError::Shrink { .. }), "{refused:?}");
    volume.resize(MIB / 2, true).unwrap();
    assert_eq!(volume.device.size(), MIB / 2);
    assert_eq!(std::fs::metadata(&img).unwrap().len(), MIB / 2);
}

/// Not open, a LUKS image is resized without a key and a raw one by its length; a served
/// volume opened afterwards sees the new sizes.
#[test]
fn images_not_open_are_resized_by_the_same_steps() {
    let dir = tempfile::tempdir().unwrap();
    let luks = dir.path().join("disk.luks");
    common::luks(&luks, LuksVersion::V2, MIB);
    let resized = resize_luks(container(&luks).as_ref(), 4 * MIB, false).unwrap();
    assert_eq!((resized.old, resized.new), (MIB, 4 * MIB));
    assert_eq!(open_luks(&luks).device.size(), 4 * MIB);

    let raw = dir.path().join("disk.raw");
    std::fs::write(&raw, vec![1u8; MIB as usize]).unwrap();
    let image = container(&raw);
    assert!(matches!(
        resize_raw(image.as_ref(), MIB / 2, false),
        Err(ResizeError::Shrink { .. })
    ));
    let resized = resize_raw(image.as_ref(), 2 * MIB, false).unwrap();
    assert_eq!((resized.old, resized.new), (MIB, 2 * MIB));
    drop(image);
    assert_eq!(std::fs::metadata(&raw).unwrap().len(), 2 * MIB);
}
