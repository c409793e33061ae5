//! What an incremental backup moves (issue 36: "an incremental after changing 1 % of a disk
//! moves at most 2 % of its size plus the header"). A 256 MiB LUKS2 disk served over NBD is
//! backed up in full; then 1 % of it is written the way files are (runs of 4 KiB to 1 MiB at
//! 4 KiB-aligned places, seeded), and an incremental is pulled. Each run costs whole 64 KiB
//! regions of the checkpoint, so the incremental holds a little more than was written, never
//! less: what the incremental covers of the payload must be at least what was written and at
//! most 2 % of the disk, what it stores at most that plus the header, and the restore must be
//! the image. Single 4 KiB writes scattered over the
//! disk are the bound's worst case (each costs a whole region, up to 16 times what was
//! written): docs/backup.md states that limit, this test does not try it.
mod common;

use common::backup::{chain_extents, manifest};
use common::*;

const DISK: u64 = 256 << 20;

/// xorshift64*: the same runs on every machine.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n
    }
}

#[test]
fn an_incremental_after_one_percent_written_in_runs_moves_at_most_two_percent() {
    let t = TestDir::new();
    let key = t.key("key");
    let img = t.luks2("disk.luks", "256M", &key);
    let daemon = t.serve().disk(&img).name("vol").nbd().control().start();
    let header = img.dump()["segments"][0]["offset"].as_u64().unwrap();
    let chain = t.path("chain");
    let backup = |checkpoint: &str, since: Option<&str>| {
        let sock = t.path(&format!("{checkpoint}.sock"));
        let mut start = vec!["backup-start", "vol", "--checkpoint", checkpoint];
        if let Some(since) = since {
            start.extend(["--incremental", since]);
        }
        let nbd = format!("unix:{}", s(&sock));
        start.extend(["--nbd", &nbd]);
        daemon.ctl_ok(&start);
        let uri = format!("nbd+unix:///vol?socket={}", s(&sock));
        let mut pull = vec![
            "backup",
            "pull",
            &uri,
            s(&chain),
            "--checkpoint",
            checkpoint,
        ];
        if since.is_some() {
            pull.push("--incremental");
        }
        cryptblk(&pull).ok();
        daemon.ctl_ok(&["backup-end", "vol"]);
    };
    backup("c0", None);

    // 1 % of the disk in runs, as a file system writes files.
    let mut rng = Rng(0x5eed_1b0c_4a11_2026);
    let mut written = 0;
    let mut commands = Vec::new();
    while written < DISK / 100 {
        // The last run stops at 1 % (rounded up to 4 KiB).
        let len = ((1 + rng.below(256)) * 4096).min((DISK / 100 - written).div_ceil(4096) * 4096);
        let at = rng.below((DISK - len) / 4096) * 4096;
        commands.push(format!("write -P {} {at} {len}", 1 + rng.below(250)));
        written += len;
    }
    let commands: Vec<&str> = commands.iter().map(String::as_str).collect();
    daemon.qemu_io("vol", &commands);
    let listed = daemon.ctl_ok(&["checkpoint-list", "vol"]);
    backup("c1", Some("c0"));

    // What the incremental holds of the payload (its extents past the header, data or
    // zeroes) and in all (the data it stores; the header's zeroes are recorded, not stored).
    let incremental = manifest(&chain)["entries"][1].clone();
    let payload: u64 = chain_extents(&chain, &incremental)
        .iter()
        .map(|&(at, len)| (at + len).saturating_sub(at.max(header)))
        .sum();
    let stored = incremental["data_bytes"].as_u64().unwrap();
    eprintln!(
        "{} runs, {written} bytes written ({:.2} % of the disk); the incremental covers \
         {payload} bytes of the payload ({:.2} %) and stores {stored} bytes of data with the \
         header's; checkpoint-list said {}",
        commands.len(),
        written as f64 * 100.0 / DISK as f64,
        payload as f64 * 100.0 / DISK as f64,
        listed["checkpoints"][0]["dirty-bytes"],
    );
    assert!(
        payload >= written,
        "the incremental covers {payload} bytes of the payload, less than the {written} written"
    );
    assert!(
        payload <= DISK / 50,
        "the incremental covers {payload} bytes of the payload, more than 2 % of the disk \
         ({written} were written)"
    );
    assert!(stored <= DISK / 50 + header, "{stored} bytes stored");

    let restored = t.path("restored.luks");
    cryptblk(["backup", "restore", s(&chain), s(&restored)]).ok();
    assert_same_bytes(&read(&restored), &read(&img.path), "c1");
}
