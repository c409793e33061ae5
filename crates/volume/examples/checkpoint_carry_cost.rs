//! What carrying a disk's checkpoints costs a live migration: the source's
//! `CheckpointStore::export` (in memory, the disk fenced: part of the switchover's downtime)
//! and the destination's `CheckpointImport::finish` (every bitmap written and fsynced, then
//! the index; done while the disk serves, its writes in the interim bitmap), for the
//! most checkpoints a disk keeps (32), each with RUNS changed 64 KiB regions scattered over a
//! disk of SIZE_GIB. Per round: both times, the payload's size on the wire, and as the
//! hardware floor the time of one 4 KiB write + fdatasync in the same directory (the import
//! needs at least one per checkpoint); then medians and worst rounds.
//!
//! ```sh
//! cargo run --release -p cryptblk-volume --example checkpoint_carry_cost -- [ROUNDS] [RUNS] [SIZE_GIB] [DIR]
//! ```

use cryptblk_volume::checkpoint::{CheckpointImport, GRANULARITY, MAX_CHECKPOINTS};
use cryptblk_volume::{CheckpointStore, IntentLog};
use rand::{Rng, SeedableRng};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1000.0
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// One 4 KiB write and fdatasync of a file in `dir`: the least a durable bitmap costs.
fn fsync_floor(dir: &Path) -> f64 {
    let path = dir.join("floor");
    let file = std::fs::File::create(&path).unwrap();
    file.write_all_at(&[0x5a; 4096], 0).unwrap();
    file.sync_all().unwrap();
    let start = Instant::now();
    file.write_all_at(&[0xa5; 4096], 0).unwrap();
    file.sync_data().unwrap();
    let t = ms(start);
    std::fs::remove_file(path).unwrap();
    t
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |i: usize, default: u64| args.get(i).map_or(default, |a| a.parse().unwrap());
    let rounds = arg(1, 5) as usize;
    let runs = arg(2, 1000);
    let size = arg(3, 1024) << 30;
    let base = args
        .get(4)
        .map_or_else(std::env::temp_dir, std::path::PathBuf::from);
    let tmp = tempfile::tempdir_in(&base).unwrap();
    let g = u64::from(GRANULARITY);
    let regions = size / g;
    let mut rng = rand::rngs::StdRng::seed_from_u64(36);

    // The source: 32 checkpoints, RUNS scattered writes after each.
    let src_log = Arc::new(IntentLog::default());
    let (src, _) = CheckpointStore::open(&tmp.path().join("src"), size, src_log.clone(), true)
        .unwrap()
        .unwrap();
    for k in 0..MAX_CHECKPOINTS {
        src.add(&format!("c{k}"), k as u64).unwrap();
        for _ in 0..runs {
            src_log.record(rng.gen_range(0..regions) * g, 1).unwrap();
        }
    }

    println!("round export_ms import_ms wire_bytes fsync_floor_ms import/floor");
    let (mut export, mut import, mut ratio) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..rounds {
        let start = Instant::now();
        let carried = src.export();
        let export_ms = ms(start);
        let wire: usize = 16
            + carried
                .checkpoints
                .iter()
                .map(|c| 13 + c.name.len() + 16 * c.runs.len())
                .sum::<usize>();
        let dir = tmp.path().join(format!("dst{round}"));
        let log = Arc::new(IntentLog::default());
        let pending = CheckpointImport::begin(&dir, size, log).unwrap();
        let start = Instant::now();
        let store = pending.finish(&carried).unwrap().unwrap();
        let import_ms = ms(start);
        assert_eq!(store.list().len(), MAX_CHECKPOINTS);
        drop(store);
        std::fs::remove_dir_all(&dir).unwrap();
        let floor = fsync_floor(tmp.path());
        println!(
            "{round} {export_ms:.2} {import_ms:.2} {wire} {floor:.3} {:.1}",
            import_ms / floor
        );
        std::io::stdout().flush().unwrap();
        export.push(export_ms);
        import.push(import_ms);
        ratio.push(import_ms / floor);
    }
    let worst = |v: &[f64]| v.iter().copied().fold(0.0, f64::max);
    println!(
        "median: export {:.2} ms (worst {:.2}), import {:.2} ms (worst {:.2}), import/fsync \
         floor {:.1} (worst {:.1}); {MAX_CHECKPOINTS} checkpoints x {runs} runs, {} GiB disk",
        median(&mut export.clone()),
        worst(&export),
        median(&mut import.clone()),
        worst(&import),
        median(&mut ratio.clone()),
        worst(&ratio),
        size >> 30
    );
}
