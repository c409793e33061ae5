//! The serving matrix's driver (`run`): servers (peers) of the preset's images over
//! vhost-user-blk and NBD, a fresh server per run, measured by vu_bench, fio and nbdcopy; the
//! ceiling is fio on the image itself.
use crate::config::{parse_size, Cache, Config, Image, Preset, Rw, Server, StorageKind, Transport};
use crate::engine::{self, Driver, Measured};
use crate::images::{self, Images};
use crate::plan::{Fits, Step};
use crate::sample::{Sample, WorkloadRecord};
use crate::spdk::Spdk;
use crate::{checkpoint, clients, fio, peers, procfs, rbd};
use anyhow::{bail, Context, Result};
use cryptblk_testutil::ceph::Cluster;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// `cryptblk-bench run`: a preset of the matrix, narrowed to some of its peers, transports and
/// workloads.
#[derive(clap::Args)]
pub struct Args {
    /// disk, serve, nbd, rbd, demo, spdk, checkpoint, ... (see `list`).
    #[arg(long)]
    pub preset: String,
    #[arg(long, default_value = "bench-results.jsonl")]
    pub results: PathBuf,
    /// Rounds instead of the preset's.
    #[arg(long)]
    pub rounds: Option<u32>,
    /// Seconds per measurement instead of the preset's.
    #[arg(long)]
    pub runtime: Option<f64>,
    /// Image size instead of the preset's (256M, 8G, ...).
    #[arg(long)]
    pub size: Option<String>,
    /// Where the images go instead of the preset's directory.
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// The cryptblk binary to measure (default: `cargo build --release`, then target/release).
    #[arg(long)]
    pub cryptblk: Option<PathBuf>,
    /// An older cryptblk binary to measure beside --cryptblk: every cryptblk peer X gets a
    /// twin X-base served by it, run right after X in each round, and the ratio X/X-base.
    #[arg(long, value_name = "CRYPTBLK")]
    pub baseline: Option<PathBuf>,
    /// The vu_bench example binary (default: built like --cryptblk).
    #[arg(long)]
    pub vu_bench: Option<PathBuf>,
    /// Only these of the preset's peers (comma-separated; the ceiling is always measured).
    #[arg(long, value_delimiter = ',')]
    pub peers: Option<Vec<String>>,
    /// Only these of the preset's transports (vhost, nbd).
    #[arg(long, value_delimiter = ',', value_parser = transport)]
    pub transports: Option<Vec<Transport>>,
    /// Only these of the preset's workloads.
    #[arg(long, value_delimiter = ',')]
    pub workloads: Option<Vec<String>>,
    /// Keep the images for the next run (and reuse ones kept by an earlier run).
    #[arg(long)]
    pub keep_images: bool,
}

fn transport(s: &str) -> Result<Transport, String> {
    match s {
        "vhost" => Ok(Transport::Vhost),
        "nbd" => Ok(Transport::Nbd),
        _ => Err(format!("'{s}' is not a transport (vhost, nbd)")),
    }
}

/// Which peers run which workloads over which transports.
pub struct MatrixFits<'a> {
    pub config: &'a Config,
    pub preset: &'a Preset,
}

impl Fits for MatrixFits<'_> {
    fn transports(&self, _: &str) -> Vec<String> {
        self.preset
            .transports
            .iter()
            .map(|t| t.name().into())
            .collect()
    }

    /// Idle clients are vhost-user ones (libblkio); nbdcopy is an NBD client.
    fn fits(&self, _: &str, transport: &str, workload: &str) -> bool {
        match self.config.workloads[workload].rw {
            Rw::Idle => transport == "vhost",
            Rw::Copy => transport == "nbd",
            _ => true,
        }
    }

    fn has_ceiling(&self, workload: &str) -> bool {
        self.config.workloads[workload].rw.is_io()
    }
}

struct Bench<'a> {
    fits: MatrixFits<'a>,
    opts: &'a Args,
    cryptblk: &'a Path,
    vu_bench: &'a Path,
    images: Images,
    image_files: Vec<PathBuf>,
    work: PathBuf,
    runtime: f64,
    cache: Cache,
    drop_caches: bool,
    storage: String,
    /// The SPDK build, when the preset has SPDK peers and it is usable here.
    spdk: Option<Spdk>,
}

/// Measures the preset; returns the samples taken (also appended to the results file).
pub fn run(
    config: &Config,
    preset: &Preset,
    opts: &Args,
    cryptblk: &Path,
    vu_bench: &Path,
) -> Result<Vec<Sample>> {
    let size = parse_size(opts.size.as_deref().unwrap_or(&preset.storage.size))?;
    if !size.is_multiple_of(65536) {
        bail!("the image size must be a multiple of 64 KiB (got {size} bytes)");
    }
    for tool in [cryptblk, vu_bench]
        .into_iter()
        .chain(opts.baseline.as_deref())
    {
        if !tool.is_file() {
            bail!("{} not found: build it (cargo build --release -p cryptblk -p cryptblk-vhost-user-blk --bin cryptblk --example vu_bench) or name it with --cryptblk / --vu-bench", tool.display());
        }
    }
    let (spdk, without_spdk);
    let preset = if preset
        .peers
        .iter()
        .any(|p| config.peers[p].server.is_spdk())
    {
        match Spdk::find() {
            Ok(found) => {
                spdk = Some(found);
                preset
            }
            Err(why) => {
                spdk = None;
                without_spdk = skip_spdk(config, preset, &why);
                &without_spdk
            }
        }
    } else {
        spdk = None;
        preset
    };
    let mut which: BTreeSet<Image> = preset.peers.iter().map(|p| config.peers[p].image).collect();
    which.insert(Image::Raw);
    // Sockets need short paths (108 bytes): a private directory under /tmp.
    let work = std::env::temp_dir().join(format!("cryptblk-bench.{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    let prepared = match preset.storage.kind {
        StorageKind::File => on_files(preset, opts, cryptblk, size, &which),
        StorageKind::Rbd => on_rbd(opts, cryptblk, size, &which, &work),
    };
    let prepared = match prepared {
        Ok(p) => p,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&work);
            return Err(e);
        }
    };
    let mut cx = Bench {
        fits: MatrixFits { config, preset },
        opts,
        cryptblk,
        vu_bench,
        image_files: if prepared.drop_caches {
            prepared.images.all(&which)
        } else {
            Vec::new()
        },
        images: prepared.images,
        work: work.clone(),
        runtime: opts.runtime.unwrap_or(preset.runtime),
        cache: preset.storage.cache,
        drop_caches: prepared.drop_caches,
        storage: prepared.storage,
        spdk,
    };
    let rounds = opts.rounds.unwrap_or(preset.rounds);
    let outcome = engine::run(&opts.preset, preset, rounds, &mut cx, &opts.results);
    let _ = std::fs::remove_dir_all(&work);
    if !opts.keep_images {
        let _ = std::fs::remove_dir_all(&cx.images.dir);
    }
    // Stops the Ceph daemons (rbd preset) only now.
    drop(prepared.cluster);
    outcome
}

/// The preset without its SPDK peers (and the ratios naming them), saying so and why.
fn skip_spdk(config: &Config, preset: &Preset, why: &str) -> Preset {
    let is_spdk = |p: &String| config.peers[p].server.is_spdk();
    let skipped: Vec<&String> = preset.peers.iter().filter(|p| is_spdk(p)).collect();
    eprintln!("skipping the SPDK peers {skipped:?}: {why}");
    let mut kept = preset.clone();
    kept.peers.retain(|p| !is_spdk(p));
    kept.ratios
        .retain(|f| !std::iter::once(&f.x).chain(&f.y).any(&is_spdk));
    kept
}

/// The images, where they are, and what belongs to the storage.
struct Prepared {
    images: Images,
    drop_caches: bool,
    storage: String,
    cluster: Option<Cluster>,
}

fn on_files(
    preset: &Preset,
    opts: &Args,
    cryptblk: &Path,
    size: u64,
    which: &BTreeSet<Image>,
) -> Result<Prepared> {
    let dir = opts
        .dir
        .clone()
        .or_else(|| preset.storage.dir.as_ref().map(PathBuf::from))
        .context("no storage directory")?;
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let fs = procfs::fs_type(&dir)?;
    match preset.storage.tmpfs {
        Some(true) if fs != "tmpfs" => eprintln!(
            "note: {} is {fs}, not tmpfs as preset '{}' expects",
            dir.display(),
            opts.preset
        ),
        Some(false) if fs == "tmpfs" => bail!(
            "{} is tmpfs: preset '{}' measures a real device (give --dir on a disk filesystem)",
            dir.display(),
            opts.preset
        ),
        _ => {}
    }
    let images = images::prepare(
        &dir.join(format!("cryptblk-bench-{}", opts.preset)),
        size,
        which,
        cryptblk,
        opts.keep_images,
    )?;
    Ok(Prepared {
        images,
        // Dropping the page cache means nothing for files in memory.
        drop_caches: fs != "tmpfs",
        storage: format!(
            "{fs} {}, {} MiB, cache {}",
            dir.display(),
            size >> 20,
            if preset.storage.cache == Cache::None {
                "none"
            } else {
                "default"
            }
        ),
        cluster: None,
    })
}

fn on_rbd(
    opts: &Args,
    cryptblk: &Path,
    size: u64,
    which: &BTreeSet<Image>,
    work: &Path,
) -> Result<Prepared> {
    if opts.keep_images {
        bail!("--keep-images: the rbd preset's cluster lives only as long as the run");
    }
    let local = opts.dir.clone().unwrap_or_else(|| work.join("local"));
    let (cluster, images) = rbd::prepare(&local, size, which, cryptblk, work)?;
    Ok(Prepared {
        images,
        drop_caches: false,
        storage: format!(
            "Ceph RBD (one monitor, one memstore OSD, this machine), {} MiB",
            size >> 20
        ),
        cluster: Some(cluster),
    })
}

impl Fits for Bench<'_> {
    fn transports(&self, w: &str) -> Vec<String> {
        self.fits.transports(w)
    }
    fn fits(&self, p: &str, t: &str, w: &str) -> bool {
        self.fits.fits(p, t, w)
    }
    fn has_ceiling(&self, w: &str) -> bool {
        self.fits.has_ceiling(w)
    }
}

impl Driver for Bench<'_> {
    fn storage(&self) -> String {
        self.storage.clone()
    }

    fn peer_name(&self, peer: &str) -> String {
        self.fits
            .config
            .peers
            .get(peer)
            .map_or(peer.into(), |p| p.name.clone())
    }

    fn workload(&self, name: &str) -> WorkloadRecord {
        let w = &self.fits.config.workloads[name];
        WorkloadRecord {
            name: name.into(),
            rw: w.rw.name().into(),
            bs: w.bs,
            depth: w.depth,
            queues: w.queues,
        }
    }

    fn measure(&mut self, step: &Step) -> Result<Measured> {
        measure(self, step)
    }
}

fn measure(cx: &Bench, step: &Step) -> Result<Measured> {
    let w = cx.fits.config.workload(&step.workload)?;
    let peer = cx.fits.config.peer(&step.peer)?;
    if cx.drop_caches {
        let files: Vec<&Path> = cx.image_files.iter().map(PathBuf::as_path).collect();
        procfs::drop_caches(&files)?;
    }
    let transport = match step.transport.as_str() {
        "vhost" => Some(Transport::Vhost),
        "nbd" => Some(Transport::Nbd),
        _ => None,
    };
    Ok(match transport {
        None => {
            let path = cx.images.path(peer.image);
            let target = match &cx.images.rbd {
                Some(store) => fio::Target::Rbd {
                    conf: &store.conf,
                    pool: images::POOL,
                    image: images::RbdStore::image_name(peer.image),
                },
                None => fio::Target::File {
                    path: &path,
                    direct: cx.cache == Cache::None,
                },
            };
            fio::run(&cx.work, &target, w, cx.runtime, None)?
        }
        Some(t) => {
            let socket = cx.work.join(format!("{}.sock", step.peer));
            let binary = match (&cx.opts.baseline, peer.baseline) {
                (Some(baseline), true) => baseline,
                (None, true) => bail!("peer {} needs --baseline", step.peer),
                (_, false) => cx.cryptblk,
            };
            let log = cx.work.join(format!("{}.log", step.peer));
            let hugepages = peer.server.is_spdk();
            let server = if hugepages {
                let spdk = cx
                    .spdk
                    .as_ref()
                    .context("SPDK peer without an SPDK build")?;
                let crypto = peer.server == Server::SpdkCrypto;
                let image = cx.images.path(peer.image);
                spdk.start(&image, crypto, &cx.work.join(&step.peer), &log)?
            } else {
                if peer.server == Server::Cryptblk && cx.images.rbd.is_none() {
                    checkpoint::forget(&cx.images.path(peer.image))?;
                }
                let cmd = peers::command(peer, binary, &cx.images, t, w.queues, cx.cache, &socket)?;
                peers::start(cmd, &socket, &log, t, cx.images.size)?
            };
            let socket = server.socket.clone();
            let pid = server.pid();
            if peer.checkpoint {
                checkpoint::record_everywhere(binary, cx.vu_bench, &socket, cx.images.size)?;
            }
            let m = match (t, w.rw) {
                (Transport::Vhost, Rw::Idle) => {
                    clients::idle(cx.vu_bench, &socket, cx.runtime, pid, hugepages)?
                }
                (Transport::Vhost, _) => clients::vu_bench(
                    cx.vu_bench,
                    &socket,
                    w,
                    cx.runtime,
                    cx.images.size,
                    pid,
                    hugepages,
                )?,
                (Transport::Nbd, Rw::Copy) => clients::nbdcopy(&server.uri(), cx.images.size, pid)?,
                (Transport::Nbd, _) => fio::run(
                    &cx.work,
                    &fio::Target::Nbd { uri: server.uri() },
                    w,
                    cx.runtime,
                    Some(pid),
                )?,
            };
            if hugepages {
                server.stop_or_kill(std::time::Duration::from_secs(10))?;
            } else {
                server.stop()?;
            }
            m
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::expand;

    fn names(steps: &[Step]) -> Vec<String> {
        steps
            .iter()
            .map(|s| format!("{}:{}:{}", s.group, s.peer, s.transport))
            .collect()
    }

    fn matrix(c: &Config, preset: &str, rounds: u32) -> Vec<Step> {
        let p = c.preset(preset).unwrap();
        expand(
            p,
            rounds,
            &MatrixFits {
                config: c,
                preset: p,
            },
        )
    }

    #[test]
    fn every_group_sits_between_two_ceilings_in_interleaved_rounds() {
        let c = Config::load(None).unwrap();
        let steps = matrix(&c, "demo", 2);
        // 2 rounds x 2 transports x 2 workloads x (f a d f).
        assert_eq!(steps.len(), 2 * 2 * 2 * 4);
        assert_eq!(
            names(&steps[..8]),
            [
                "r1/vhost/rr4k-d32-q1:f:file",
                "r1/vhost/rr4k-d32-q1:a:vhost",
                "r1/vhost/rr4k-d32-q1:d:vhost",
                "r1/vhost/rr4k-d32-q1:f:file",
                "r1/nbd/rr4k-d32-q1:f:file",
                "r1/nbd/rr4k-d32-q1:a:nbd",
                "r1/nbd/rr4k-d32-q1:d:nbd",
                "r1/nbd/rr4k-d32-q1:f:file",
            ]
        );
        assert!(steps[16..].iter().all(|s| s.round == 2));
        // The second round runs the arms the other way round, between the same ceilings.
        assert_eq!(
            names(&steps[16..20]),
            [
                "r2/vhost/rr4k-d32-q1:f:file",
                "r2/vhost/rr4k-d32-q1:d:vhost",
                "r2/vhost/rr4k-d32-q1:a:vhost",
                "r2/vhost/rr4k-d32-q1:f:file",
            ]
        );
    }

    #[test]
    fn a_shared_ceiling_surrounds_every_transport_of_the_workload() {
        let c = Config::load(None).unwrap();
        let first = names(&matrix(&c, "rbd", 1)[..12]);
        assert_eq!(first[0], "r1/rr4k-d32-q1:f:file");
        assert_eq!(first[1], "r1/rr4k-d32-q1:a:nbd");
        assert_eq!(first[6], "r1/rr4k-d32-q1:a:vhost");
        assert_eq!(first[11], "r1/rr4k-d32-q1:f:file");
        // 4 workloads x (2 ceilings + 5 peers x 2 transports).
        assert_eq!(matrix(&c, "rbd", 1).len(), 4 * 12);
    }

    #[test]
    fn idle_and_copy_run_without_ceiling_on_their_transport_only() {
        let c = Config::load(None).unwrap();
        let serve = matrix(&c, "serve", 1);
        let idle: Vec<&Step> = serve.iter().filter(|s| s.workload == "idle").collect();
        assert_eq!(idle.len(), 4);
        assert!(idle.iter().all(|s| s.transport == "vhost"));
        let nbd = matrix(&c, "nbd", 1);
        let copy: Vec<&Step> = nbd.iter().filter(|s| s.workload == "copy").collect();
        assert_eq!(copy.len(), 4);
        assert!(copy.iter().all(|s| !s.ceiling));
    }

    #[test]
    fn without_spdk_its_peers_and_their_ratios_are_skipped() {
        let c = Config::load(None).unwrap();
        let kept = skip_spdk(&c, c.preset("spdk").unwrap(), "SPDK_DIR is not set");
        assert_eq!(kept.peers, ["a", "d"]);
        assert_eq!(kept.ratios, [crate::figure::Figure::pair("a", "f")]);
        let fits = MatrixFits {
            config: &c,
            preset: &kept,
        };
        assert!(!expand(&kept, 1, &fits)
            .iter()
            .any(|s| s.peer.starts_with('e')));
    }
}
