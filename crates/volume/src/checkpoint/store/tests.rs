use super::*;

const MIB: u64 = 1 << 20;
const G: u64 = GRANULARITY as u64;

fn open(dir: &Path, size: u64) -> (CheckpointStore, Arc<IntentLog>, Vec<String>) {
    let log = Arc::new(IntentLog::default());
    let (store, warnings) = CheckpointStore::open(dir, size, log.clone(), true)
        .unwrap()
        .unwrap();
    (store, log, warnings)
}

fn runs(store: &CheckpointStore, name: &str) -> Vec<(u64, u64)> {
    let size = store.lock().index.covered;
    store.dirty_runs(name, 0, usize::MAX, 0, size).unwrap()
}

#[test]
fn each_checkpoint_holds_what_changed_since_it_was_added() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("img.cryptblk-checkpoints");
    let (store, log, _) = open(&dir, 64 * MIB + 100);
    log.record(0, 1).unwrap();
    assert_eq!(log.active(), 0, "no checkpoint: nothing recorded");
    store.add("c1", 1).unwrap();
    log.record(G + 10, 4096).unwrap(); // region 1
    log.record(5 * G - 1, 2).unwrap(); // regions 4 and 5
    store.add("c2", 2).unwrap();
    log.record(64 * MIB, 100).unwrap(); // the short last region
    assert_eq!(
        runs(&store, "c1"),
        vec![(G, G), (4 * G, 2 * G), (64 * MIB, 100)]
    );
    assert_eq!(runs(&store, "c2"), vec![(64 * MIB, 100)]);
    assert_eq!(
        store.dirty_runs("c2", 0, 1, 3 * G, 64 * MIB + 100).unwrap(),
        vec![(0, 3 * G)],
        "the header counts changed; at most `limit` runs"
    );
    let list = store.list();
    assert_eq!(list.len(), 2);
    assert_eq!(
        (list[0].name.as_str(), list[0].dirty_bytes),
        ("c1", 3 * G + 100)
    );
    assert_eq!((list[1].name.as_str(), list[1].dirty_bytes), ("c2", 100));

    // Removing the newest keeps its changes for the one before, and writes go there.
    store.remove("c2").unwrap();
    log.record(10 * G, 1).unwrap();
    assert_eq!(
        runs(&store, "c1"),
        vec![(G, G), (4 * G, 2 * G), (10 * G, G), (64 * MIB, 100)]
    );
    assert!(!dir.join(format!("{:016x}.bitmap", 2)).exists());
    store.remove("c1").unwrap();
    assert_eq!(log.active(), 0);
    assert!(store.list().is_empty());
}

#[test]
fn a_large_disk_holds_memory_only_for_the_bitmap_blocks_it_wrote() {
    const TIB: u64 = 1 << 40;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("img.cryptblk-checkpoints");
    let allocated = |store: &CheckpointStore| -> Vec<(usize, usize)> {
        let inner = store.lock();
        let g = &inner.generations;
        g.iter()
            .map(|g| (g.wanted.allocated_blocks(), g.durable.allocated_blocks()))
            .collect()
    };
    let (store, log, _) = open(&dir, TIB);
    store.add("c1", 1).unwrap();
    assert_eq!(
        allocated(&store),
        vec![(0, 0)],
        "a new checkpoint costs no bitmap memory"
    );
    log.record(0, 4096).unwrap();
    log.record(600 << 30, 1 << 20).unwrap();
    assert_eq!(allocated(&store), vec![(2, 2)]);
    assert_eq!(runs(&store, "c1"), vec![(0, G), (600 << 30, MIB)]);
    drop((store, log));

    let (store, _, warnings) = open(&dir, TIB);
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(
        allocated(&store),
        vec![(2, 2)],
        "reopened: only the blocks with bits"
    );
    assert_eq!(runs(&store, "c1"), vec![(0, G), (600 << 30, MIB)]);

    // On disk too: the file's 519 blocks are holes but for the two written.
    use std::os::unix::fs::MetadataExt;
    let file = std::fs::metadata(dir.join(format!("{:016x}.bitmap", 1))).unwrap();
    let blocks = super::super::format::blocks_for(TIB / G);
    assert_eq!((blocks, file.len()), (519, (1 + blocks) * 4096));
    let allocated = file.blocks() * 512;
    assert!(allocated <= 16 * 4096, "{allocated} bytes allocated");
}

#[test]
fn removing_the_oldest_keeps_the_younger_ones_exact() {
    let tmp = tempfile::tempdir().unwrap();
    let (store, log, _) = open(tmp.path(), 16 * MIB);
    store.add("a", 1).unwrap();
    log.record(0, 1).unwrap();
    store.add("b", 2).unwrap();
    log.record(2 * G, 1).unwrap();
    store.add("c", 3).unwrap();
    store.remove("b").unwrap();
    assert_eq!(runs(&store, "a"), vec![(0, G), (2 * G, G)]);
    assert_eq!(runs(&store, "c"), vec![]);
    store.remove("a").unwrap();
    assert_eq!(runs(&store, "c"), vec![]);
    log.record(3 * G, 1).unwrap();
    assert_eq!(runs(&store, "c"), vec![(3 * G, G)]);
}

#[test]
fn names_are_checked_and_bounded() {
    let tmp = tempfile::tempdir().unwrap();
    let (store, _, _) = open(tmp.path(), MIB);
    store.add("c1", 1).unwrap();
    let dup = store.add("c1", 1).unwrap_err().to_string();
    assert!(dup.contains("already has a checkpoint c1"), "{dup}");
    let bad = store.add("../x", 1).unwrap_err().to_string();
    assert!(bad.contains("not a checkpoint name"), "{bad}");
    let missing = store.remove("nope").unwrap_err().to_string();
    assert!(missing.contains("no checkpoint nope"), "{missing}");
    for k in 1..MAX_CHECKPOINTS {
        store.add(&format!("n{k}"), 1).unwrap();
    }
    let full = store.add("one-more", 1).unwrap_err().to_string();
    assert!(full.contains("remove one first"), "{full}");
}

/// A crash between recording and writing: the record is durable on its own, so the
/// region reads as changed after a restart though the write never happened. (The reverse
/// — data written, bit lost — cannot happen: the write waits for `record`.)
#[test]
fn what_was_recorded_survives_a_restart_even_if_never_written() {
    let tmp = tempfile::tempdir().unwrap();
    {
        let (store, log, _) = open(tmp.path(), 8 * MIB);
        store.add("c1", 7).unwrap();
        log.record(3 * G, G).unwrap();
        store.add("c2", 8).unwrap();
        log.record(5 * G, 1).unwrap();
        // Dropped without any shutdown step, as a kill -9 would.
    }
    let (store, log, warnings) = open(tmp.path(), 8 * MIB);
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(runs(&store, "c1"), vec![(3 * G, G), (5 * G, G)]);
    assert_eq!(runs(&store, "c2"), vec![(5 * G, G)]);
    assert_eq!(store.list()[0].created, 7);
    assert_ne!(log.active(), 0, "writes are recorded again after a restart");
    log.record(0, 1).unwrap();
    assert_eq!(runs(&store, "c2"), vec![(0, G), (5 * G, G)]);
}

#[test]
fn a_damaged_bitmap_block_counts_its_regions_changed() {
    let tmp = tempfile::tempdir().unwrap();
    // Two bitmap blocks: one holds 32384 regions of 64 KiB, 2024 MiB.
    let size = 3000 * MIB;
    {
        let (store, log, _) = open(tmp.path(), size);
        store.add("c1", 1).unwrap();
        log.record(2100 * MIB, 1).unwrap();
    }
    let path = tmp.path().join(format!("{:016x}.bitmap", 1));
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[4096 + 10] ^= 0xff; // block 0
    std::fs::write(&path, &bytes).unwrap();
    let (store, _, warnings) = open(tmp.path(), size);
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(
        warnings[0].contains("block 0 does not verify"),
        "{warnings:?}"
    );
    let block0 = super::super::format::REGIONS_PER_BLOCK * G;
    assert_eq!(
        runs(&store, "c1"),
        vec![(0, block0), (2100 * MIB - (2100 * MIB % G), G)]
    );
    // Written again whole: the next open finds it sound, still counting them.
    let (store, _, warnings) = open(tmp.path(), size);
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(runs(&store, "c1")[0], (0, block0));
}

#[test]
fn a_damaged_index_is_refused_naming_the_way_out() {
    let tmp = tempfile::tempdir().unwrap();
    {
        let (store, _, _) = open(tmp.path(), MIB);
        store.add("c1", 1).unwrap();
    }
    let index = tmp.path().join("index");
    let mut bytes = std::fs::read(&index).unwrap();
    bytes[45] ^= 1;
    std::fs::write(&index, &bytes).unwrap();
    let err = CheckpointStore::open(tmp.path(), MIB, Arc::default(), true)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("checksum") && err.contains("must then be full"),
        "{err}"
    );
}

#[test]
fn a_grown_image_counts_its_new_bytes_changed() {
    let tmp = tempfile::tempdir().unwrap();
    {
        let (store, log, _) = open(tmp.path(), 4 * MIB);
        store.add("c1", 1).unwrap();
        log.record(G, 1).unwrap();
    }
    let (store, _, warnings) = open(tmp.path(), 6 * MIB);
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert_eq!(runs(&store, "c1"), vec![(G, G), (4 * MIB, 2 * MIB)]);
    // Grown while open (a resize): the new bytes are not recorded, so they are listed.
    assert_eq!(
        store
            .dirty_runs("c1", 0, usize::MAX, 0, 7 * MIB + 1)
            .unwrap(),
        vec![(G, G), (4 * MIB, 3 * MIB + 1)]
    );
    assert_eq!(
        store.dirty_bytes("c1", 0, 7 * MIB + 1).unwrap(),
        G + 3 * MIB + 1
    );
}

#[test]
fn without_a_store_nothing_is_created() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("x.cryptblk-checkpoints");
    assert!(CheckpointStore::open(&dir, MIB, Arc::default(), false)
        .unwrap()
        .is_none());
    assert!(!dir.exists());
    assert_eq!(
        store_dir(Path::new("/v/disk.luks")),
        Path::new("/v/disk.luks.cryptblk-checkpoints")
    );
}

#[test]
fn concurrent_first_writes_share_flushes_and_all_become_durable() {
    let tmp = tempfile::tempdir().unwrap();
    let (store, log, _) = open(tmp.path(), 256 * MIB);
    store.add("c1", 1).unwrap();
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let log = &log;
            s.spawn(move || {
                for k in 0..256u64 {
                    log.record((k * 4 + t) * G, 512).unwrap();
                }
            });
        }
    });
    assert_eq!(runs(&store, "c1"), vec![(0, 1024 * G)]);
    let generation = log.current().unwrap();
    assert!(generation.is_durable(0, 1024 * G));
}
