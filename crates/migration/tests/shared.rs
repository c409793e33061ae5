//! Shared-storage migration (`SourceMigration::start_shared`) in one process: two "hosts" open
//! one image file, and a lock decides which of them may write, as an RBD image's exclusive lock
//! does for two daemons (the real thing is tested against a Ceph cluster in the cli crate's
//! `rbd` tests). What is checked here is the hand-off's logic, including the failures a real
//! cluster makes hard to stage: a destination that cannot take the lock, and a third client
//! that takes it first.

mod common;

use common::*;
use cryptblk_block::{
    BlockDevice, BlockError, BlockErrorKind, Container, OpenOptions, RawFile, SharedStorage,
};
use cryptblk_luks::HeaderIo;
use cryptblk_migration::{
    IncomingMigration, IncomingStore, MigrationAddress, Phase, SourceMigration, SourceOptions,
};
use cryptblk_volume::DirtyTracker;
use cryptblk_volume::{open_luks_volume_on, LuksVolume, VolumeOptions};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(60);
const PAYLOAD: u64 = 8 << 20;

/// Who holds the image's lock (a host id), shared by every host's view of the image.
type Holder = Arc<Mutex<Option<u32>>>;

/// One host's view of the shared image: writes need the lock, like librbd's with the
/// exclusive-lock feature.
struct HostImage {
    file: RawFile,
    path: PathBuf,
    host: u32,
    holder: Holder,
    identity: String,
    /// Taking the lock fails (a cluster that refuses this client).
    refuse_acquire: AtomicBool,
    /// The moment this host releases the lock, host 3 takes it.
    stolen_on_release: AtomicBool,
}

impl HostImage {
    fn open(path: &Path, host: u32, holder: &Holder, identity: &str) -> Arc<HostImage> {
        let opts = OpenOptions {
            writable: true,
            // Both hosts open the file; the lock below decides who writes.
            lock: false,
        };
        Arc::new(HostImage {
            file: RawFile::open(path, opts).unwrap(),
            path: path.to_path_buf(),
            host,
            holder: holder.clone(),
            identity: identity.into(),
            refuse_acquire: AtomicBool::new(false),
            stolen_on_release: AtomicBool::new(false),
        })
    }

    fn holds_lock(&self) -> bool {
        *self.holder.lock().unwrap() == Some(self.host)
    }
}

fn not_holder(op: &'static str) -> BlockError {
    BlockError::new(BlockErrorKind::Locked, "another host holds the lock").with_op(op)
}

impl BlockDevice for HostImage {
    fn size(&self) -> u64 {
        BlockDevice::size(&self.file)
    }
    fn read_only(&self) -> bool {
        false
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), BlockError> {
        self.file.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), BlockError> {
        if !self.holds_lock() {
            return Err(not_holder("write"));
        }
        self.file.write_at(buf, offset)
    }
    fn flush(&self) -> Result<(), BlockError> {
        self.file.flush()
    }
}

impl Container for HostImage {
    fn name(&self) -> &Path {
        &self.path
    }
    fn header_io(&self) -> &dyn HeaderIo {
        Container::header_io(&self.file)
    }
    fn shared_storage(&self) -> Option<&dyn SharedStorage> {
        Some(self)
    }
}

impl SharedStorage for HostImage {
    fn identity(&self) -> Result<String, BlockError> {
        Ok(self.identity.clone())
    }
    fn release(&self) -> Result<(), BlockError> {
        self.file.flush()?;
        let mut holder = self.holder.lock().unwrap();
        if *holder == Some(self.host) {
            *holder = None;
            if self.stolen_on_release.load(Ordering::SeqCst) {
                *holder = Some(3);
            }
        }
        Ok(())
    }
    fn acquire(&self) -> Result<(), BlockError> {
        let mut holder = self.holder.lock().unwrap();
        if self.refuse_acquire.load(Ordering::SeqCst) {
            return Err(not_holder("take the lock"));
        }
        match *holder {
            None => {
                *holder = Some(self.host);
                Ok(())
            }
            Some(h) if h == self.host => Ok(()),
            Some(_) => Err(not_holder("take the lock")),
        }
    }
}

/// The destination's store: the image the source serves, opened by host 2.
struct SharedStore(Arc<HostImage>);

impl IncomingStore for SharedStore {
    fn name(&self) -> &Path {
        &self.0.path
    }
    fn exists(&self) -> bool {
        true
    }
    fn create(&self, size: u64) -> Result<Arc<dyn Container>, String> {
        assert_eq!(size, self.0.size(), "the source's image size");
        Ok(self.0.clone())
    }
    fn remove(&self) -> bool {
        true
    }
    fn is_shared(&self) -> bool {
        true
    }
}

struct Setup {
    _dir: tempfile::TempDir,
    source_image: Arc<HostImage>,
    destination_image: Arc<HostImage>,
    tracker: Arc<DirtyTracker>,
    model: Vec<u8>,
    incoming: Arc<IncomingMigration>,
}

/// A LUKS2 image with data, served by host 1 (holding the lock); host 2 listens on it, and
/// names it `destination_identity`.
fn setup(destination_identity: &str) -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("shared.luks");
    // The formatted image, with the data written by host 1 below.
    drop(luks2_source(&path, PAYLOAD, 7));
    let holder: Holder = Arc::new(Mutex::new(Some(1)));
    let source_image = HostImage::open(&path, 1, &holder, "cluster/1/image");
    let writable = VolumeOptions {
        writable: true,
        ..Default::default()
    };
    let volume: LuksVolume = open_luks_volume_on(source_image.clone(), PW, &writable).unwrap();
    let data_offset = volume.header().data_offset();
    let tracker =
        Arc::new(DirtyTracker::new(Arc::new(volume), data_offset, SECTOR as u64).unwrap());
    let model: Vec<u8> = (0..PAYLOAD).map(|i| (i * 7 % 251) as u8).collect();
    tracker.write_at(&model, 0).unwrap();
    let destination_image = HostImage::open(&path, 2, &holder, destination_identity);
    let addr: MigrationAddress = "tcp:127.0.0.1:0".parse().unwrap();
    let incoming = IncomingMigration::listen_into(
        &addr,
        Arc::new(SharedStore(destination_image.clone())),
        None,
    )
    .unwrap();
    Setup {
        _dir: dir,
        source_image,
        destination_image,
        tracker,
        model,
        incoming,
    }
}

fn start(s: &Setup) -> Result<Arc<SourceMigration>, cryptblk_migration::MigrationError> {
    SourceMigration::start_shared(
        s.source_image.clone(),
        s.tracker.clone(),
        s.incoming.address(),
        SourceOptions::default(),
    )
}

#[test]
fn the_lock_changes_hands_and_nothing_is_copied() {
    let s = setup("cluster/1/image");
    let mig = start(&s).unwrap();
    let disk = destination_disk(&s.incoming);
    // Until the switchover the destination does not write: its I/O waits.
    let early_read = {
        let disk = disk.clone();
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 4096];
            disk.read_at(&mut buf, 0).map(|()| buf)
        })
    };
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        !early_read.is_finished(),
        "the destination served before the hand-off"
    );
    // The source keeps serving meanwhile.
    s.tracker.write_at(&[0xa5; 4096], 4096).unwrap();
    let mut model = s.model.clone();
    model[4096..8192].fill(0xa5);
    mig.switchover(false).unwrap();
    assert_eq!(mig.wait(WAIT), Phase::Completed, "{:?}", mig.status().error);
    assert_eq!(
        s.incoming.wait_for(Phase::Completed, WAIT),
        Phase::Completed
    );
    let status = mig.status();
    assert_eq!(
        (status.bytes_sent, status.chunks),
        (0, 0),
        "nothing is copied"
    );
    assert!(status.shared && status.downtime.is_some());
    assert!(s.destination_image.holds_lock() && mig.handed_over());
    assert_eq!(early_read.join().unwrap().unwrap(), model[..4096]);
    assert_matches_model(&*disk, &model);
    disk.write_at(&[0x5b; 8192], 1 << 20).unwrap();
    // The source is fenced, and could not write without the lock anyway.
    assert!(s.tracker.write_at(&[1; 4096], 0).is_err());
    assert!(s.source_image.write_at(&[1; 4096], 0).is_err());
}

#[test]
fn another_image_is_refused_before_anything_moves() {
    let s = setup("cluster/1/another-image");
    let e = start(&s).unwrap_err().to_string();
    assert!(
        e.contains("is not the one the source serves") && e.contains("another-image"),
        "{e}"
    );
    assert!(s.source_image.holds_lock());
    s.tracker.write_at(&[2; 4096], 0).unwrap();
}

#[test]
fn a_destination_that_cannot_take_the_lock_gives_it_back() {
    let s = setup("cluster/1/image");
    s.destination_image
        .refuse_acquire
        .store(true, Ordering::SeqCst);
    let mig = start(&s).unwrap();
    let disk = destination_disk(&s.incoming);
    mig.switchover(false).unwrap();
    assert_eq!(mig.wait(WAIT), Phase::Failed);
    let error = mig.status().error.unwrap();
    assert!(error.contains("took the image's lock back"), "{error}");
    // The source has its lock again and serves on; the destination never does.
    assert!(s.source_image.holds_lock() && !mig.handed_over());
    s.tracker.write_at(&[3; 4096], 0).unwrap();
    assert_eq!(s.incoming.wait_for(Phase::Completed, WAIT), Phase::Failed);
    let mut buf = [0u8; 4096];
    assert!(disk.read_at(&mut buf, 0).is_err());
}

#[test]
fn a_lock_another_client_took_keeps_the_source_fenced() {
    let s = setup("cluster/1/image");
    s.source_image
        .stolen_on_release
        .store(true, Ordering::SeqCst);
    let mig = start(&s).unwrap();
    let _disk = destination_disk(&s.incoming);
    mig.switchover(false).unwrap();
    assert_eq!(mig.wait(WAIT), Phase::Failed);
    let error = mig.status().error.unwrap();
    assert!(error.contains("could not be taken back"), "{error}");
    // Neither daemon may write: the source stays fenced rather than write without the lock.
    assert!(mig.handed_over());
    assert!(s.tracker.write_at(&[4; 4096], 0).is_err());
    assert_eq!(*s.source_image.holder.lock().unwrap(), Some(3));
}

#[test]
fn an_image_only_this_host_reaches_is_not_handed_over() {
    let s = setup("cluster/1/image");
    let local: Arc<RawFile> = Arc::new(rw(&s.source_image.path));
    let e = SourceMigration::start_shared(
        local,
        s.tracker.clone(),
        s.incoming.address(),
        SourceOptions::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("is not shared storage") && e.contains("without --shared"),
        "{e}"
    );
    let postcopy = SourceOptions {
        postcopy: true,
        ..SourceOptions::default()
    };
    let e = SourceMigration::start_shared(
        s.source_image.clone(),
        s.tracker.clone(),
        s.incoming.address(),
        postcopy,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("no postcopy"), "{e}");
}
