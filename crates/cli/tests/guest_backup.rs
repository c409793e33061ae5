//! Guest end-to-end: key-less backups of a running VM's disk (issue 36). The test guest (see
//! guest_e2e.rs) boots under QEMU (TCG) on a LUKS2 disk served by `cryptblk serve` over
//! vhost-user-blk and runs `marks-verify` (scripts/guest/init.sh): rounds of a mixed fio job
//! with crc32c verify over the disk's first 32 MiB in the background, and meanwhile numbered
//! 4 KiB marks past them, each reported on the console once written and flushed. While it
//! writes, a full backup (c0) and three incrementals (c1..c3) are taken through `ctl
//! backup-start` / `cryptblk backup pull` over a UNIX-socket NBD export / `ctl backup-end`.
//! Then the daemon is killed (SIGKILL) while the pull of a fourth (c4) copies it: the pull
//! fails and adds no entry, the restarted daemon (QEMU reconnects) has removed the scratch and
//! kept c4, which is removed as docs/backup.md says; c4 is then taken again from c3 by the same
//! commands, and must hold what the guest wrote around the kill.
//!
//! The image at each checkpoint: the test pauses the VM through QMP (`stop`: QEMU stops the
//! vhost-user-blk rings, and the daemon answers every request it took from a ring before it
//! acknowledges the stop, so nothing is in flight), calls `backup-start` (which would also
//! wait for requests under way), copies the image file, and resumes the VM (`cont`). The
//! console, settled after the stop, says which marks were written by then. The pull then
//! runs while the guest writes again (it waits for two more marks first), so the export must
//! serve the regions the guest overwrites from the copy-before-write scratch.
//!
//! For every checkpoint: `backup restore --checkpoint ci` is byte for byte the image copied at
//! ci; `cryptsetup open --test-passphrase` (key file) accepts it; an independent decryption
//! (the volume key from `cryptsetup luksDump --dump-volume-key`, the data segment's offset and
//! sector size from `cryptsetup luksDump`, AES-XTS with openssl doing the AES) finds every mark
//! the guest had reported by then, and not the mark two after the last one reported (it was
//! not begun). The chain holds no mark's text and no passphrase; every incremental holds the
//! header and the marks written since the previous checkpoint. For c1, at backup-start (the
//! guest paused) `nbdinfo --map=qemu:dirty-bitmap:c0`, `qemu-img map` with `x-dirty-bitmap`
//! and `ctl checkpoint-list --extents` read the same extents from the export, and the pull
//! stores exactly them although the guest writes on (the export's bitmap is fixed at
//! backup-start, as QEMU's is). Every fio round must pass.
mod common;

use common::backup::{
    chain_extents, checkpoint_extents, covers, merged, nbdinfo_dirty, qemu_img_dirty,
};
use common::*;
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The disk (the LUKS2 payload): fio's rounds over the first `FIO_SIZE` bytes, marks after.
const DISK: &str = "64M";
const FIO_SIZE: u64 = 32 * MIB;
/// The checkpoints' granularity.
const REGION: u64 = 64 << 10;
/// What copy-before-write copies at once.
const COPY_BLOCK: u64 = 4096;
/// Mark n starts at `FIO_SIZE + (n - 1) * MARK_STRIDE` of the disk (a region each).
const MARK_STRIDE: u64 = REGION;
const MARK_LEN: usize = 4096;
/// What every mark's text starts with: searched for in the chain.
const MARK_TEXT: &[u8] = b"cryptblk guest mark ";
/// The incrementals after the full backup.
const INCREMENTALS: usize = 3;
/// The backup during which the daemon is killed, taken again under the same name.
const KILLED: &str = "c4";
/// How long the guest may take to write the marks a step waits for (TCG on a busy machine).
const MARKS_BOUND: Duration = Duration::from_secs(120);

/// Mark `n` as the guest writes it: 64 lines of its name padded to 63 characters.
fn mark(n: u64) -> Vec<u8> {
    format!("{:<63}\n", format!("cryptblk guest mark {n}"))
        .repeat(MARK_LEN / 64)
        .into_bytes()
}

/// The highest mark the console reports written (0: none yet).
fn marks_written(console: &str) -> u64 {
    console
        .lines()
        .filter_map(|l| l.split("GUEST-MARK ").nth(1))
        .filter_map(|n| n.trim().parse().ok())
        .max()
        .unwrap_or(0)
}

/// Waits until the guest reports mark `n` written.
#[track_caller]
fn wait_for_mark(guest: &mut Vm, n: u64) {
    let deadline = Instant::now() + MARKS_BOUND;
    while marks_written(&guest.console()) < n {
        guest.assert_running();
        assert!(
            Instant::now() < deadline,
            "the guest did not write mark {n} within {MARKS_BOUND:?}:\n{}",
            tail(&guest.console(), 40)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The console of a paused guest once what it printed before the pause has all arrived (two
/// reads 300 ms apart agree).
fn settled_console(guest: &Vm) -> String {
    let mut last = guest.console();
    loop {
        std::thread::sleep(Duration::from_millis(300));
        let now = guest.console();
        if now == last {
            return now;
        }
        last = now;
    }
}

/// The data segment of a LUKS2 image as cryptsetup reads its header: offset, sector size.
fn cryptsetup_segment(img: &Path) -> (u64, u64) {
    let dump = tool("cryptsetup", ["luksDump", s(img)]);
    dump.ok();
    let text = dump.stdout;
    let segment = text
        .split("Data segments:")
        .nth(1)
        .unwrap_or_else(|| panic!("no data segment in cryptsetup luksDump:\n{text}"));
    let field = |name: &str| -> u64 {
        let line = segment
            .lines()
            .find_map(|l| l.trim().strip_prefix(name))
            .unwrap_or_else(|| panic!("no {name} in the data segment:\n{text}"));
        line.split_whitespace().next().unwrap().parse().unwrap()
    };
    assert!(segment.contains("aes-xts-plain64"), "{text}");
    (field("offset:"), field("sector:"))
}

/// The restored image's marks `1..=written` decrypt (independently of cryptblk) to what the
/// guest wrote, and mark `written + 2`, never begun before the checkpoint, does not.
fn assert_marks(restored: &Path, key: &Key, written: u64, what: &str) {
    let key_hex = xts::cryptsetup_volume_key(restored, key);
    let (data_offset, sector) = cryptsetup_segment(restored);
    assert_eq!(sector, MARK_LEN as u64, "{what}: the sector size");
    let image = read(restored);
    let dir = restored.parent().unwrap();
    let decrypted = |n: u64| {
        let at = FIO_SIZE + (n - 1) * MARK_STRIDE;
        let start = (data_offset + at) as usize;
        // plain64 counts 512-byte sectors whatever the sector size.
        xts::openssl_xts_decrypt(dir, &key_hex, at / 512, &image[start..start + MARK_LEN])
    };
    for n in 1..=written {
        assert_same_bytes(&decrypted(n), &mark(n), &format!("{what}: mark {n}"));
    }
    assert!(
        decrypted(written + 2) != mark(written + 2),
        "{what}: mark {} is there, written after the checkpoint",
        written + 2
    );
}

/// The 64 KiB regions (checkpoint granularity) `ranges` cover, by index.
fn regions(ranges: &[(u64, u64)]) -> BTreeSet<u64> {
    ranges
        .iter()
        .flat_map(|&(offset, len)| {
            assert!(offset % REGION == 0 && len % REGION == 0, "{ranges:?}");
            offset / REGION..(offset + len) / REGION
        })
        .collect()
}

/// One checkpoint taken: its name, the image file copied at it, the marks written by then.
struct Taken {
    name: String,
    image: PathBuf,
    marks: u64,
}

/// A backup started: its checkpoint, `backup-start`'s answer, the export's URI, and what
/// nbdinfo read of its dirty bitmap at the start (when asked).
struct Started {
    taken: Taken,
    answer: Value,
    uri: String,
    dirty_by_nbdinfo: Option<Vec<(u64, u64)>>,
}

impl Started {
    fn scratch(&self) -> PathBuf {
        PathBuf::from(self.answer["scratch"].as_str().unwrap())
    }
}

/// The guest writing, its disk's daemon, and the chain the test takes of the disk.
struct Backups {
    t: TestDir,
    img: Image,
    payload: u64,
    daemon: Daemon,
    guest: Vm,
    qmp: Qmp,
    chain: PathBuf,
    taken: Vec<Taken>,
}

impl Backups {
    /// The last checkpoint taken (an incremental's FROM), and the marks written by then.
    fn previous(&self) -> Option<(String, u64)> {
        self.taken.last().map(|c| (c.name.clone(), c.marks))
    }

    /// Once the guest has written two marks since the last checkpoint (one surely after it),
    /// pauses it, starts backup `name` (incremental from the last checkpoint, if any), copies
    /// the image file, reads the export's dirty bitmap with nbdinfo if `read_nbdinfo` (and
    /// checks that qemu-img and `checkpoint-list` read the same), and resumes the guest;
    /// returns once the guest has written two more marks (regions it changed under the
    /// export).
    fn start(&mut self, name: &str, read_nbdinfo: bool) -> Started {
        self.start_with(name, read_nbdinfo, &[])
    }

    /// [`start`](Self::start) with more `backup-start` options.
    fn start_with(&mut self, name: &str, read_nbdinfo: bool, options: &[&str]) -> Started {
        let previous = self.previous();
        wait_for_mark(&mut self.guest, previous.as_ref().map_or(0, |p| p.1) + 3);
        self.qmp.execute("stop", json!({}));
        let marks = marks_written(&settled_console(&self.guest));
        let socket = self.t.path(&format!("backup-{name}.sock"));
        let listen = format!("unix:{}", s(&socket));
        let mut args = vec!["backup-start", "vol", "--checkpoint", name];
        if let Some((from, _)) = &previous {
            args.extend(["--incremental", from]);
        }
        args.extend(["--nbd", &listen]);
        args.extend_from_slice(options);
        let answer = self.daemon.ctl_ok(&args);
        let image = self.t.path(&format!("at-{name}.luks"));
        std::fs::copy(&self.img.path, &image).unwrap();
        let uri = format!("nbd+unix:///vol?socket={}", s(&socket));
        let dirty_by_nbdinfo = previous.filter(|_| read_nbdinfo).map(|(from, _)| {
            assert_eq!(answer["bitmap"], format!("qemu:dirty-bitmap:{from}"));
            let by_nbdinfo = nbdinfo_dirty(&uri, &from);
            // The guest paused: every reader sees the same map.
            assert_eq!(
                qemu_img_dirty(&socket, "vol", &from),
                by_nbdinfo,
                "qemu-img's map of {from} (x-dirty-bitmap) and nbdinfo's"
            );
            assert_eq!(
                merged(checkpoint_extents(&self.daemon, "vol", &from)),
                by_nbdinfo,
                "checkpoint-list's extents of {from} and nbdinfo's map"
            );
            by_nbdinfo
        });
        self.qmp.execute("cont", json!({}));
        wait_for_mark(&mut self.guest, marks + 2);
        Started {
            taken: Taken {
                name: name.to_string(),
                image,
                marks,
            },
            answer,
            uri,
            dirty_by_nbdinfo,
        }
    }

    /// `backup pull` of a started backup into the chain.
    fn pull_args<'a>(&'a self, started: &'a Started) -> Vec<&'a str> {
        let mut args = vec!["backup", "pull"];
        if !self.taken.is_empty() {
            args.push("--incremental");
        }
        let name = started.taken.name.as_str();
        args.extend([started.uri.as_str(), s(&self.chain), "--checkpoint", name]);
        args
    }

    /// Pulls a started backup (while the guest writes), ends it, and checks the chain's new
    /// entry; returns the pull's output.
    fn finish(&mut self, started: Started) -> Out {
        let full = self.taken.is_empty();
        let pulled = cryptblk(self.pull_args(&started));
        pulled.ok();
        let name = &started.taken.name;
        // A full backup copies every block the guest writes during it; an incremental only
        // those of the regions it serves, which the guest's writes may miss.
        assert!(
            !full || std::fs::metadata(started.scratch()).unwrap().len() >= COPY_BLOCK,
            "{name}: the guest's writes during the backup copied no block to the scratch"
        );
        let ended = self.daemon.ctl_ok(&["backup-end", "vol"]);
        assert_eq!(ended["kept"], true, "{ended}");

        let manifest: Value =
            serde_json::from_slice(&read(&self.chain.join("manifest.json"))).unwrap();
        let entry = &manifest["entries"][self.taken.len()];
        assert_eq!(entry["checkpoint"], name.as_str(), "{manifest}");
        if let Some((from, previous_marks)) = self.previous() {
            assert_eq!(entry["kind"], "incremental", "{manifest}");
            assert_eq!(entry["since"], from.as_str(), "{manifest}");
            let pulled = chain_extents(&self.chain, entry);
            if let Some(by_nbdinfo) = &started.dirty_by_nbdinfo {
                self.compare_with_nbdinfo(name, &from, by_nbdinfo, &pulled);
            }
            // The header, and every mark surely written after the previous checkpoint.
            assert!(covers(&pulled, 0, self.payload), "{name}: {pulled:?}");
            for n in previous_marks + 2..=started.taken.marks {
                let at = self.payload + FIO_SIZE + (n - 1) * MARK_STRIDE;
                assert!(covers(&pulled, at, 4096), "{name}: mark {n}: {pulled:?}");
            }
        }
        self.taken.push(started.taken);
        pulled
    }

    /// The export's bitmap is fixed at backup-start: the pull copied exactly the regions
    /// nbdinfo's map of FROM listed then, although the guest wrote on during the pull.
    fn compare_with_nbdinfo(
        &self,
        name: &str,
        from: &str,
        by_nbdinfo: &[(u64, u64)],
        pulled: &[(u64, u64)],
    ) {
        assert_eq!(
            regions(pulled),
            regions(by_nbdinfo),
            "{name}: the pull's regions and nbdinfo's map of {from} at backup-start"
        );
        eprintln!(
            "{name}: nbdinfo's map of {from} at backup-start and the pull: {} KiB",
            regions(pulled).len() as u64 * REGION / 1024
        );
    }

    /// Starts backup `name`, and SIGKILLs the daemon while `backup pull` copies it (the
    /// pull held stopped meanwhile, so it has begun and not finished); the pull fails. The
    /// daemon starts again, QEMU reconnects to it, the scratch is gone, and the backup's
    /// checkpoint is removed as docs/backup.md says (what changed since it stays recorded
    /// for the one before).
    fn kill_daemon_during_a_pull(&mut self, name: &str) {
        // Paced, so the pull is still reading when the daemon dies: unpaced, it may have all
        // it needs in flight or in its buffers (eight 1 MiB reads) before it is stopped.
        let started = self.start_with(name, false, &["--max-bandwidth", "1M"]);
        let mut pull = Command::new(bin())
            .args(self.pull_args(&started))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let partial = self.chain.join("pull.extents.partial");
        let deadline = Instant::now() + BOUND;
        while !partial.exists() {
            assert!(
                pull.try_wait().unwrap().is_none(),
                "the pull ended before it began an entry"
            );
            assert!(Instant::now() < deadline, "the pull began no entry");
            std::thread::sleep(Duration::from_millis(1));
        }
        let pid = pull.id().to_string();
        tool("kill", ["-STOP", &pid]).ok();
        self.daemon.kill9();
        tool("kill", ["-CONT", &pid]).ok();
        let out = pull.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code::OTHER), "{stderr}");
        let manifest: Value =
            serde_json::from_slice(&read(&self.chain.join("manifest.json"))).unwrap();
        assert_eq!(
            manifest["entries"].as_array().unwrap().len(),
            self.taken.len(),
            "a pull cut short made an entry: {manifest}"
        );
        let scratch = started.scratch();
        assert!(scratch.exists(), "no scratch left by the killed daemon");

        self.daemon.restart();
        self.daemon.wait_log(QUEUES_STARTED, BOUND);
        assert!(!scratch.exists(), "the restarted daemon kept the scratch");
        // Still there, counting the header (and whatever the guest wrote since, which may
        // join it into one extent).
        let kept = checkpoint_extents(&self.daemon, "vol", name);
        assert!(
            covers(&kept, 0, self.payload),
            "{name} is gone after the crash: {kept:?}"
        );
        self.daemon.ctl_ok(&["checkpoint-remove", "vol", name]);
    }
}

#[test]
fn a_running_guests_disk_backed_up_full_and_incrementally_restores_at_every_checkpoint() {
    let t = TestDir::new();
    let key = t.key("key");
    let img = t.luks2("disk.luks", DISK, &key);
    let payload = img.dump()["segments"][0]["offset"].as_u64().unwrap();
    let serve = t.serve().vhost_user().disk(&img).name("vol").control();
    let mut daemon = serve.log_level("info").start();
    let qmp_socket = t.path("guest.qmp");
    let vm = VmConfig::vhost_user(daemon.vhost_socket())
        .reconnect(1)
        .qmp(&qmp_socket)
        .console_input()
        .job("marks-verify", FIO_SIZE)
        .timeout(600);
    let mut guest = vm.boot(t.root(), "guest");
    daemon.wait_log(QUEUES_STARTED, BOUND);
    let qmp = Qmp::connect(&qmp_socket);
    wait_for_mark(&mut guest, 1);
    let chain = t.path("chain");
    let mut b = Backups {
        t,
        img,
        payload,
        daemon,
        guest,
        qmp,
        chain,
        taken: Vec::new(),
    };

    // A full backup, then incrementals; nbdinfo reads the first incremental's bitmap.
    for i in 0..=INCREMENTALS {
        let started = b.start(&format!("c{i}"), i == 1);
        b.finish(started);
    }
    // The daemon killed during the next backup; the backup taken again (the same checkpoint
    // from the same FROM, the same pull command) copies what changed since FROM, including
    // what the guest wrote around the kill. It is a new point in time: nothing of the pull
    // cut short may be continued into it.
    b.kill_daemon_during_a_pull(KILLED);
    let started = b.start(KILLED, false);
    let pulled = b.finish(started);
    assert!(!pulled.stderr.contains("continuing"), "{}", pulled.stderr);

    // fio has written and verified the disk through two rounds at least (the backups fell in
    // them); the guest finishes the round under way: every round passed.
    b.guest.wait_for_console(
        "guest: fio round 2 passed",
        "fio's second round did not pass",
        MARKS_BOUND,
    );
    let console = b.guest.stop_and_assert_passed();
    assert_eq!(b.daemon.terminate(), code::OK, "{}", b.daemon.log());
    cryptblk(["backup", "verify", s(&b.chain)]).ok();

    for c in &b.taken {
        let restored = b.t.path(&format!("restored-{}.luks", c.name));
        cryptblk([
            "backup",
            "restore",
            "--checkpoint",
            &c.name,
            s(&b.chain),
            s(&restored),
        ])
        .ok();
        assert_same_bytes(&read(&restored), &read(&c.image), &c.name);
        assert!(cryptsetup_accepts(&restored, &key), "{}", c.name);
        assert_marks(&restored, &key, c.marks, &c.name);
        std::fs::remove_file(&restored).unwrap();
        std::fs::remove_file(&c.image).unwrap();
    }

    // Nothing on the backup side holds the guest's plaintext or the passphrase.
    let secret = read(&key);
    for file in std::fs::read_dir(&b.chain).unwrap() {
        let path = file.unwrap().path();
        let bytes = read(&path);
        assert!(
            !bytes.windows(MARK_TEXT.len()).any(|w| w == MARK_TEXT),
            "a mark's plaintext is in {}",
            path.display()
        );
        assert!(!bytes.windows(secret.len()).any(|w| w == secret.as_slice()));
    }
    let marks: Vec<String> = b
        .taken
        .iter()
        .map(|c| format!("{} {}", c.name, c.marks))
        .collect();
    eprintln!(
        "marks written at each checkpoint: {}; {}",
        marks.join(", "),
        console
            .lines()
            .find(|l| l.contains("fio rounds passed"))
            .unwrap_or("")
    );
}
