//! The `rbd` preset's storage: a throwaway single-node Ceph cluster (testutil's launcher: one
//! monitor, one memstore OSD, pool `rbd`, loopback, auth off) holding the same images as on a
//! file, each with the raw image's payload: the plain one imported, the LUKS ones filled through
//! their own server over NBD (nothing else writes every format: librbd's LUKS2 is only
//! writable through librbd).
use crate::command::run;
use crate::config::{Cache, Image, Transport};
use crate::images::{self, Images, RbdStore, POOL};
use crate::peers;
use anyhow::{bail, Result};
use cryptblk_testutil::ceph::Cluster;
use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

/// LUKS2 data offset of both `cryptblk format rbd:` and `rbd encryption format`.
const LUKS2_HEADER: u64 = 16 << 20;

/// Starts the cluster (kept alive by the returned value) and makes the images `which` asks
/// for, each holding the payload of the raw image made in `local` (which is removed after).
pub fn prepare(
    local: &Path,
    size: u64,
    which: &BTreeSet<Image>,
    cryptblk: &Path,
    work: &Path,
) -> Result<(Cluster, Images)> {
    if Command::new("ceph-mon").arg("--version").output().is_err() {
        bail!("ceph-mon is not installed: scripts/install-deps.sh installs the Ceph daemons");
    }
    eprintln!("+ starting a single-node Ceph cluster (memstore OSD)");
    let cluster = Cluster::start();
    let store = RbdStore {
        conf: cluster.conf.clone(),
    };
    // The raw payload and the key, made locally first.
    let mut files = images::prepare(local, size, &BTreeSet::from([Image::Raw]), cryptblk, false)?;
    let raw_file = files.path(Image::Raw);
    let rbd = |args: &[&str]| -> Result<()> {
        let mut cmd = Command::new("rbd");
        cmd.arg("-c").arg(&store.conf).args(args);
        run(&mut cmd)
    };
    rbd(&[
        "import",
        "--no-progress",
        &raw_file.to_string_lossy(),
        &format!("{POOL}/plain"),
    ])?;
    for &image in which.iter().filter(|i| **i != Image::Raw) {
        let name = format!("{POOL}/{}", RbdStore::image_name(image));
        match image {
            Image::Raw => unreachable!("filtered out"),
            Image::Luks2 => run(Command::new(cryptblk)
                .args(["format", "--batch-mode", "--key-file"])
                .arg(&files.key)
                .args(["--pbkdf", "pbkdf2", "--iter-time", "10"])
                .arg(store.cryptblk_name(image))
                .arg(size.to_string()))?,
            Image::RbdLuks2Librbd => {
                // No PBKDF options here: argon2id with ~1 GiB, 10-20 s on a small machine.
                rbd(&[
                    "create",
                    "--size",
                    &format!("{}B", size + LUKS2_HEADER),
                    &name,
                ])?;
                rbd(&[
                    "encryption",
                    "format",
                    &name,
                    "luks2",
                    &files.key.to_string_lossy(),
                ])?;
            }
            Image::Luks1 => {
                let file = local.join("luks1-for-rbd.img");
                images::qemu_luks1(&file, size, &files.key)?;
                rbd(&["import", "--no-progress", &file.to_string_lossy(), &name])?;
                let _ = std::fs::remove_file(&file);
            }
        }
    }
    // QEMU 7.2's NBD server asks the rbd driver for block status when fast-diff is on and
    // answers holes for what librbd's encryption wrote: both off on every image.
    for &image in which {
        let name = format!("{POOL}/{}", RbdStore::image_name(image));
        let _ = rbd(&["feature", "disable", &name, "fast-diff", "object-map"]);
    }
    files.rbd = Some(store);
    // Fill every LUKS payload through its own server.
    for &image in which.iter().filter(|i| **i != Image::Raw) {
        let peer = crate::config::Peer {
            name: String::new(),
            server: if image == Image::Luks2 {
                crate::config::Server::Cryptblk
            } else {
                crate::config::Server::Qsd
            },
            image,
            serve_args: Vec::new(),
            checkpoint: false,
            baseline: false,
        };
        let socket = work.join("fill.sock");
        let cmd = peers::command(
            &peer,
            cryptblk,
            &files,
            Transport::Nbd,
            1,
            Cache::Default,
            &socket,
        )?;
        let server = peers::start(cmd, &socket, &work.join("fill.log"), Transport::Nbd, size)?;
        run(Command::new("nbdcopy")
            .arg("--flush")
            .arg(&raw_file)
            .arg(server.uri()))?;
        server.stop()?;
    }
    let _ = std::fs::remove_file(&raw_file);
    Ok((cluster, files))
}
