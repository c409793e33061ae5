//! The chain against QEMU's own NBD server (`qemu-nbd`): a full pull of a qcow2 disk's
//! allocated extents, interrupted and continued only once the export has a description
//! (`qemu-nbd -D`) that names its point in time; incrementals through persistent dirty
//! bitmaps (`qemu-img bitmap`, `qemu-nbd -B`); each checkpoint restored equals the disk as
//! `qemu-img convert` saw it then; verify names a damaged entry.
use cryptblk_backup::{pull, restore, verify, Error, PullOptions};
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;

fn run(program: &str, args: &[&str]) {
    let out = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{program} (scripts/install-deps.sh installs it): {e}"));
    assert!(
        out.status.success(),
        "{program} {args:?}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// qemu-nbd serving `image` read-only (with `bitmap` and `description`, if any) until
/// dropped.
struct QemuNbd {
    child: Child,
    uri: String,
}

impl QemuNbd {
    fn start(dir: &Path, image: &Path, bitmap: Option<&str>) -> QemuNbd {
        QemuNbd::described(dir, image, bitmap, None)
    }

    fn described(
        dir: &Path,
        image: &Path,
        bitmap: Option<&str>,
        description: Option<&str>,
    ) -> QemuNbd {
        let socket = dir.join("nbd.sock");
        let _ = std::fs::remove_file(&socket);
        let mut cmd = Command::new("qemu-nbd");
        cmd.args(["-r", "-t", "-f", "qcow2", "-x", "disk", "-k", s(&socket)]);
        if let Some(b) = bitmap {
            cmd.args(["-B", b]);
        }
        if let Some(d) = description {
            cmd.args(["-D", d]);
        }
        let child = cmd.arg(image).spawn().expect("qemu-nbd");
        let deadline = Instant::now() + Duration::from_secs(30);
        while !socket.exists() {
            assert!(Instant::now() < deadline, "qemu-nbd did not listen");
            std::thread::sleep(Duration::from_millis(20));
        }
        QemuNbd {
            child,
            uri: format!("nbd+unix:///disk?socket={}", s(&socket)),
        }
    }
}

impl Drop for QemuNbd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn qemu_io(image: &Path, cmds: &[&str]) {
    let mut args = vec!["-f", "qcow2"];
    for c in cmds {
        args.extend(["-c", c]);
    }
    args.push(s(image));
    run("qemu-io", &args);
}

/// The disk's bytes as QEMU reads them.
fn snapshot(image: &Path, out: &Path) -> Vec<u8> {
    run(
        "qemu-img",
        &["convert", "-f", "qcow2", "-O", "raw", s(image), s(out)],
    );
    std::fs::read(out).unwrap()
}

fn options(uri: &str, dir: &Path, incremental: bool, checkpoint: &str) -> PullOptions {
    PullOptions {
        uri: uri.into(),
        dir: dir.into(),
        incremental,
        bitmap: None,
        checkpoint: Some(checkpoint.into()),
        release: true,
    }
}

fn restored(chain: &Path, out: PathBuf, checkpoint: &str) -> Vec<u8> {
    restore(chain, &out, Some(checkpoint), |_, _| {}).unwrap();
    std::fs::read(out).unwrap()
}

fn allocated(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).unwrap().blocks() * 512
}

#[test]
fn a_chain_pulled_from_qemu_nbd_restores_every_checkpoint() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path();
    let image = dir.join("disk.qcow2");
    let chain = dir.join("chain");
    run("qemu-img", &["create", "-f", "qcow2", s(&image), "64M"]);
    // Data in three places (one of them zeroes written as data), then the checkpoint c0.
    qemu_io(
        &image,
        &[
            "write -P 0x11 0 9M",
            "write -P 0x22 20M 4k",
            "write -z 30M 1M",
            "write -P 0x33 63M 1M",
        ],
    );
    run("qemu-img", &["bitmap", "--add", s(&image), "c0"]);
    let at_c0 = snapshot(&image, &dir.join("c0.raw"));

    // A full pull stopped after its first two reads (1 MiB each), by `stop_early`, with the
    // notes it made.
    let stop_early = |uri: &str| {
        let mut reads = 0;
        let mut notes = Vec::new();
        let stopped = pull(
            &options(uri, &chain, false, "c0"),
            |_| {
                reads += 1;
                if reads == 2 {
                    ControlFlow::Break(())
                } else {
                    ControlFlow::Continue(())
                }
            },
            |n| notes.push(n.to_string()),
        );
        assert!(
            matches!(stopped, Err(Error::Interrupted { .. })),
            "{stopped:?}"
        );
        notes
    };
    // Without a description nothing says the export is the same point in time as the one
    // the interrupted pull read: the same command starts over ...
    {
        let nbd = QemuNbd::start(dir, &image, None);
        assert_eq!(stop_early(&nbd.uri), Vec::<String>::new());
        let notes = stop_early(&nbd.uri);
        assert!(
            notes.len() == 1
                && notes[0].contains("no description")
                && notes[0].contains("starting over"),
            "{notes:?}"
        );
    }
    // ... and with one (`qemu-nbd -D`), the same description is continued, after the pull
    // recorded without one is discarded.
    {
        let nbd = QemuNbd::described(dir, &image, None, Some("disk.qcow2 at c0"));
        let notes = stop_early(&nbd.uri);
        assert!(
            notes.len() == 1 && notes[0].contains("does not say which export"),
            "{notes:?}"
        );
        let mut notes = Vec::new();
        let report = pull(
            &options(&nbd.uri, &chain, false, "c0"),
            |_| ControlFlow::Continue(()),
            |n| notes.push(n.to_string()),
        )
        .unwrap();
        assert_eq!(report.resumed_at, Some(2 * MIB), "{notes:?}");
        assert!(notes[0].contains("continuing"), "{notes:?}");
        // 9 MiB + 1 MiB + the 64 KiB qcow2 cluster holding the 4 KiB write; the zeroes
        // written as data are not stored.
        assert_eq!(report.entry.data_bytes, 10 * MIB + 65536);
    }

    // Three incrementals: write, close the bitmap, start the next, pull the closed one.
    let mut expected = vec![("c0", at_c0)];
    let writes = [
        ["write -P 0x44 1M 64k", "write -z 63M 512k"],
        ["write -P 0x55 40M 3M", "write -P 0x66 20M 512"],
        ["write -P 0x77 0 4k", "write -P 0x78 50M 4k"],
    ];
    for (i, cmds) in writes.iter().enumerate() {
        let (from, to) = (format!("c{i}"), format!("c{}", i + 1));
        qemu_io(&image, cmds);
        run("qemu-img", &["bitmap", "--disable", s(&image), &from]);
        run("qemu-img", &["bitmap", "--add", s(&image), &to]);
        expected.push((
            ["c1", "c2", "c3"][i],
            snapshot(&image, &dir.join(format!("{to}.raw"))),
        ));
        let nbd = QemuNbd::start(dir, &image, Some(&from));
        let report = pull(
            &options(&nbd.uri, &chain, true, &to),
            |_| ControlFlow::Continue(()),
            |_| {},
        )
        .unwrap();
        // An incremental moves what changed (the bitmap's 64 KiB granularity), not the disk.
        assert!(report.entry.data_bytes <= 4 * MIB, "{:?}", report.entry);
        assert_eq!(report.entry.since.as_deref(), Some(from.as_str()));
    }

    for (name, bytes) in &expected {
        let out = dir.join(format!("restored-{name}.img"));
        assert!(
            restored(&chain, out.clone(), name) == *bytes,
            "checkpoint {name} restored differs from the disk then"
        );
        // Sparse: only what the chain holds is allocated.
        assert!(
            allocated(&out) <= 20 * MIB,
            "{name}: {} allocated",
            allocated(&out)
        );
    }
    assert!(verify(&chain, |_, _| {})
        .unwrap()
        .iter()
        .all(|c| c.problem.is_none()));

    // A flipped byte in c2's data: verify names c2 alone; restoring c3 refuses, naming c2,
    // and leaves no image behind; c1 still restores.
    let data = chain.join("0002-c2.data");
    let mut bytes = std::fs::read(&data).unwrap();
    bytes[100] ^= 1;
    std::fs::write(&data, bytes).unwrap();
    let checks = verify(&chain, |_, _| {}).unwrap();
    let damaged: Vec<&str> = checks
        .iter()
        .filter(|c| c.problem.is_some())
        .map(|c| c.checkpoint.as_str())
        .collect();
    assert_eq!(damaged, ["c2"]);
    let out = dir.join("broken.img");
    let err = restore(&chain, &out, Some("c3"), |_, _| {}).unwrap_err();
    assert!(
        err.to_string().contains("entry \"c2\"") && err.to_string().contains("checksum"),
        "{err}"
    );
    assert!(!out.exists());
    assert!(!dir.join("broken.img.restore-partial").exists());
    assert!(restored(&chain, dir.join("again-c1.img"), "c1") == expected[1].1);
}
