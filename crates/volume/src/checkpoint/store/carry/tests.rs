use super::*;
use crate::checkpoint::GRANULARITY;

const MIB: u64 = 1 << 20;
const G: u64 = GRANULARITY as u64;
const SIZE: u64 = 64 * MIB + 100;

fn store_in(dir: &Path) -> (CheckpointStore, Arc<IntentLog>) {
    let log = Arc::new(IntentLog::default());
    let (store, _) = CheckpointStore::open(dir, SIZE, log.clone(), true)
        .unwrap()
        .unwrap();
    (store, log)
}

fn runs(store: &CheckpointStore, name: &str) -> Vec<(u64, u64)> {
    store.dirty_runs(name, 0, usize::MAX, 0, SIZE).unwrap()
}

/// A source with c0 (then writes A), c1 (then writes B).
fn source(dir: &Path) -> (CheckpointStore, Arc<IntentLog>) {
    let (store, log) = store_in(dir);
    store.add("c0", 100).unwrap();
    log.record(G, 10).unwrap(); // A: region 1
    log.record(63 * G, 2 * G).unwrap(); // A: regions 63, 64 (across a word)
    store.add("c1", 200).unwrap();
    log.record(10 * G, 3 * G).unwrap(); // B: regions 10..13
    log.record(64 * MIB, 100).unwrap(); // B: the short last region
    (store, log)
}

#[test]
fn a_store_is_carried_with_its_names_order_and_regions() {
    let tmp = tempfile::tempdir().unwrap();
    let (src, _) = source(&tmp.path().join("src"));
    let carried = src.export();
    assert_eq!(carried.granularity, GRANULARITY);
    assert_eq!(carried.covered, SIZE);
    let names: Vec<_> = carried.checkpoints.iter().map(|c| &c.name[..]).collect();
    assert_eq!(names, ["c0", "c1"]);
    assert_eq!(carried.checkpoints[0].runs, vec![(1, 1), (63, 2)]);
    assert_eq!(carried.checkpoints[1].runs, vec![(10, 3), (1024, 1)]);
    carried.validate().unwrap();

    // The destination: a write recorded before the carried store arrives (it waited at the
    // gate), then the import, then a write after it.
    let dst_dir = tmp.path().join("dst");
    let log = Arc::new(IntentLog::default());
    let import = CheckpointImport::begin(&dst_dir, SIZE, log.clone()).unwrap();
    assert_ne!(log.active(), 0, "writes are recorded from the start");
    log.record(30 * G, 1).unwrap(); // C, before the switch
    let dst = import.finish(&carried).unwrap().expect("two checkpoints");
    log.record(40 * G, 1).unwrap(); // C, after it
    let list: Vec<_> = dst
        .list()
        .into_iter()
        .map(|c| (c.name, c.created))
        .collect();
    assert_eq!(list, [("c0".to_string(), 100), ("c1".to_string(), 200)]);
    let c0 = vec![
        (G, G),
        (10 * G, 3 * G),
        (30 * G, G),
        (40 * G, G),
        (63 * G, 2 * G),
        (64 * MIB, 100),
    ];
    assert_eq!(runs(&dst, "c0"), c0);
    let c1 = vec![(10 * G, 3 * G), (30 * G, G), (40 * G, G), (64 * MIB, 100)];
    assert_eq!(runs(&dst, "c1"), c1);

    // All of it durable: a restart (or crash) reads the same, and records on.
    drop(dst);
    let (again, log) = store_in(&dst_dir);
    assert_eq!(runs(&again, "c0"), c0);
    assert_eq!(runs(&again, "c1"), c1);
    again.add("c2", 300).unwrap();
    log.record(50 * G, 1).unwrap();
    assert_eq!(runs(&again, "c2"), vec![(50 * G, G)]);
    let leftovers: Vec<_> = std::fs::read_dir(&dst_dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.starts_with("ffff"))
        .collect();
    assert!(leftovers.is_empty(), "interim bitmap left: {leftovers:?}");
}

#[test]
fn nothing_carried_leaves_no_store_and_an_idle_log() {
    let tmp = tempfile::tempdir().unwrap();
    let (src, _) = store_in(&tmp.path().join("src"));
    let dir = tmp.path().join("dst");
    let log = Arc::new(IntentLog::default());
    let import = CheckpointImport::begin(&dir, SIZE, log.clone()).unwrap();
    assert!(import.finish(&src.export()).unwrap().is_none());
    assert_eq!(log.active(), 0);
    assert!(!dir.exists());
    // Abandoned: the same.
    let import = CheckpointImport::begin(&dir, SIZE, log.clone()).unwrap();
    import.abandon().unwrap();
    assert_eq!(log.active(), 0);
    assert!(!dir.exists());
    // An existing directory is not taken over.
    std::fs::create_dir(&dir).unwrap();
    assert!(CheckpointImport::begin(&dir, SIZE, log).is_err());
}

#[test]
fn hostile_carried_checkpoints_are_refused_by_what_is_wrong() {
    let good = CarriedCheckpoints {
        granularity: GRANULARITY,
        covered: 10 * G,
        checkpoints: vec![CarriedCheckpoint {
            name: "a".into(),
            created: 1,
            runs: vec![(0, 2), (5, 5)],
        }],
    };
    good.validate().unwrap();
    let refused = |f: &dyn Fn(&mut CarriedCheckpoints), needle: &str| {
        let mut c = good.clone();
        f(&mut c);
        let e = c.validate().unwrap_err();
        assert!(e.contains(needle), "{e:?} does not mention {needle:?}");
    };
    refused(&|c| c.granularity = 3000, "granularity");
    refused(&|c| c.granularity = 0, "granularity");
    refused(&|c| c.checkpoints[0].name = ".x".into(), "name");
    refused(&|c| c.checkpoints[0].name = "a/b".into(), "name");
    refused(&|c| c.checkpoints.push(c.checkpoints[0].clone()), "twice");
    refused(&|c| c.checkpoints[0].runs = vec![(0, 0)], "empty");
    refused(&|c| c.checkpoints[0].runs = vec![(5, 1), (0, 1)], "order");
    refused(&|c| c.checkpoints[0].runs = vec![(0, 2), (2, 1)], "order");
    refused(&|c| c.checkpoints[0].runs = vec![(9, 2)], "past");
    refused(&|c| c.checkpoints[0].runs = vec![(u64::MAX, 2)], "past");
    refused(
        &|c| {
            c.checkpoints = (0..=MAX_CHECKPOINTS)
                .map(|k| CarriedCheckpoint {
                    name: format!("c{k}"),
                    created: 0,
                    runs: Vec::new(),
                })
                .collect()
        },
        "more than",
    );
    refused(
        &|c| {
            c.covered = u64::MAX;
            c.checkpoints[0].runs = (0..=MAX_CARRIED_RUNS as u64).map(|k| (2 * k, 1)).collect()
        },
        "runs",
    );
    // Valid, but larger than the image receiving it.
    let tmp = tempfile::tempdir().unwrap();
    let log = Arc::new(IntentLog::default());
    let import = CheckpointImport::begin(&tmp.path().join("d"), 5 * G, log).unwrap();
    let e = import.finish(&good).unwrap_err();
    assert!(e.to_string().contains("more than"), "{e}");
    // Valid, in regions of another size than this side's.
    let coarser = CarriedCheckpoints {
        granularity: 2 * GRANULARITY,
        covered: 20 * G,
        ..good.clone()
    };
    coarser.validate().unwrap();
    let e = import.finish(&coarser).unwrap_err();
    assert!(e.to_string().contains("131072-byte regions"), "{e}");
    import.abandon().unwrap();
}

#[test]
fn too_many_runs_are_carried_coarser_never_smaller() {
    let runs: Vec<(u64, u64)> = (0..1000).map(|k| (k * 10 + (k % 7), 1)).collect();
    let coarse = coarsen(runs.clone(), 100);
    assert!(coarse.len() <= 100 && !coarse.is_empty());
    for (first, count) in runs {
        assert!(
            coarse
                .iter()
                .any(|&(f, n)| f <= first && first + count <= f + n),
            "region {first} lost"
        );
    }
    assert!(coarse.windows(2).all(|w| w[0].0 + w[0].1 < w[1].0));
}

#[test]
fn regions_in_bitmap_blocks_past_quiet_ones_are_carried() {
    let tmp = tempfile::tempdir().unwrap();
    let size = 10 << 30; // 5 bitmap blocks of 32384 regions
    let log = Arc::new(IntentLog::default());
    let (store, _) = CheckpointStore::open(&tmp.path().join("s"), size, log.clone(), true)
        .unwrap()
        .unwrap();
    store.add("c", 0).unwrap();
    let far = 3 * 32384 + 7;
    log.record(5 * G, 1).unwrap();
    log.record(far * G, 2 * G).unwrap();
    log.record(size - 1, 1).unwrap();
    let last = size / G - 1;
    assert_eq!(
        store.export().checkpoints[0].runs,
        vec![(5, 1), (far, 2), (last, 1)]
    );
}
