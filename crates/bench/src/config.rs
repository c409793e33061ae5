//! The experiment table (`presets.toml`, shipped in the binary; another file with `--config`):
//! every experiment is a preset, a table entry that names the driver that runs it, its arms
//! (peers) and workloads, the metrics its report shows, the per-round ratios it compares and
//! how its rounds interleave; the speed targets are entries of the same file.
use crate::figure::{figures, Figure, Target};
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;

/// The presets shipped with the harness.
pub const DEFAULT_CONFIG: &str = include_str!("../presets.toml");

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub peers: BTreeMap<String, Peer>,
    pub workloads: BTreeMap<String, Workload>,
    pub presets: BTreeMap<String, Preset>,
    #[serde(default)]
    pub targets: Vec<Target>,
}

/// What runs an experiment's steps.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Driver {
    /// Servers (peers) over transports, measured by fio and vu_bench (`run`).
    #[default]
    Matrix,
    ReadPath,
    Reencrypt,
    EncryptOnline,
    Convert,
    Control,
    Handoff,
    Migrate,
    /// Two crypto engines per CPU-second of the measuring thread, in this process.
    EngineCpu,
}

impl Driver {
    /// The command that runs an experiment of this driver.
    pub fn command(self) -> &'static str {
        match self {
            Driver::Matrix => "run --preset NAME",
            Driver::ReadPath => "read-path",
            Driver::Reencrypt => "reencrypt",
            Driver::EncryptOnline => "reencrypt --encrypt",
            Driver::Convert => "convert",
            Driver::Control => "control",
            Driver::Handoff => "handoff",
            Driver::Migrate => "migrate",
            Driver::EngineCpu => "engine-cpu",
        }
    }
}

/// How the arms of a round follow each other.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Order {
    /// Ceiling, every arm, ceiling: each run has a ceiling measured next to it; the arms run
    /// the other way round every other round, so no arm always has the same place.
    #[default]
    Around,
    /// Every arm once, each round starting one arm later (two arms: alternating), so that a
    /// slow spell of the machine hits no arm more than another.
    Rotate,
}

/// What serves the disk, and which image it serves.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Peer {
    pub name: String,
    pub server: Server,
    pub image: Image,
    /// More arguments for `cryptblk serve` (a cryptblk peer only), e.g. `["--poll-us", "50"]`.
    #[serde(default)]
    pub serve_args: Vec<String>,
    /// A checkpoint (the dirty log of incremental backups) added once the disk serves, and
    /// the whole disk written once before the measurement, so every measured write finds
    /// its region recorded: the log's steady state. A cryptblk peer over vhost-user-blk on
    /// a file only.
    #[serde(default)]
    pub checkpoint: bool,
    /// Served by the baseline binary (`run --baseline`), not the one measured.
    #[serde(skip)]
    pub baseline: bool,
}

/// The id of a cryptblk peer's twin served by the baseline binary.
pub fn baseline_id(peer: &str) -> String {
    format!("{peer}{BASELINE_SUFFIX}")
}

/// What `baseline_id` appends.
pub const BASELINE_SUFFIX: &str = "-base";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Server {
    /// No server: fio on the image itself, the device's ceiling.
    Fio,
    Cryptblk,
    Qsd,
    /// SPDK's vhost target, an aio bdev on the image (vhost-user-blk only).
    Spdk,
    /// SPDK's vhost target, a crypto vbdev (AES_XTS, accel framework) over an aio bdev.
    SpdkCrypto,
}

impl Server {
    pub fn is_spdk(self) -> bool {
        matches!(self, Server::Spdk | Server::SpdkCrypto)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Image {
    Raw,
    Luks2,
    Luks1,
    /// An RBD image encrypted by `rbd encryption format ... luks2`, opened by librbd.
    RbdLuks2Librbd,
}

impl Image {
    pub fn label(self) -> &'static str {
        match self {
            Image::Raw => "raw",
            Image::Luks2 => "luks2",
            Image::Luks1 => "luks1",
            Image::RbdLuks2Librbd => "rbd-luks2-librbd",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Rw {
    Randread,
    Randwrite,
    Read,
    Write,
    /// A connected client that submits nothing: the server's idle CPU and memory.
    Idle,
    /// `nbdcopy URI null:` of the whole disk.
    Copy,
}

impl Rw {
    pub fn name(self) -> &'static str {
        match self {
            Rw::Randread => "randread",
            Rw::Randwrite => "randwrite",
            Rw::Read => "read",
            Rw::Write => "write",
            Rw::Idle => "idle",
            Rw::Copy => "copy",
        }
    }

    /// A fio-style load with a ceiling to compare against.
    pub fn is_io(self) -> bool {
        !matches!(self, Rw::Idle | Rw::Copy)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Workload {
    pub rw: Rw,
    pub bs: u64,
    pub depth: u32,
    pub queues: u32,
}

impl Workload {
    pub fn describe(&self) -> String {
        match self.rw {
            Rw::Idle => "idle client".to_string(),
            Rw::Copy => "nbdcopy to null:".to_string(),
            rw => format!(
                "{}k {}, depth {}, {} queue{}",
                self.bs / 1024,
                rw.name(),
                self.depth,
                self.queues,
                if self.queues == 1 { "" } else { "s" }
            ),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Transport {
    /// vhost-user-blk, driven by libblkio (`vu_bench`).
    Vhost,
    /// NBD on a UNIX socket, driven by fio's nbd engine.
    Nbd,
}

impl Transport {
    pub fn name(self) -> &'static str {
        match self {
            Transport::Vhost => "vhost",
            Transport::Nbd => "nbd",
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Preset {
    pub description: String,
    #[serde(default)]
    pub driver: Driver,
    #[serde(default)]
    pub order: Order,
    /// Every round of a workload before the next workload (else rounds outermost).
    #[serde(default)]
    pub workload_major: bool,
    /// The metrics the report shows, in order (the first is the main one); default: the
    /// matrix's.
    #[serde(default = "crate::metric::matrix")]
    pub metrics: Vec<String>,
    /// The peer measured before and after every group of runs ("" for none).
    #[serde(default)]
    pub ceiling: String,
    /// One ceiling per round and workload around every transport's runs (else one per
    /// transport).
    #[serde(default)]
    pub shared_ceiling: bool,
    pub peers: Vec<String>,
    #[serde(default)]
    pub transports: Vec<Transport>,
    #[serde(default)]
    pub workloads: Vec<String>,
    /// Figures (x over y per round, IOPS unless named) the report shows, next to every
    /// peer's ratio to the ceiling.
    #[serde(default, deserialize_with = "figures")]
    pub ratios: Vec<Figure>,
    #[serde(default = "three")]
    pub rounds: u32,
    /// Seconds per measurement.
    #[serde(default = "five")]
    pub runtime: f64,
    #[serde(default)]
    pub storage: Storage,
}

fn three() -> u32 {
    3
}

fn five() -> f64 {
    5.0
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Storage {
    pub kind: StorageKind,
    /// Where the images go (`kind = "file"`).
    #[serde(default)]
    pub dir: Option<String>,
    /// Payload size of every image: `256M`, `8G`, or bytes.
    #[serde(default)]
    pub size: String,
    #[serde(default)]
    pub cache: Cache,
    /// Whether `dir` must (true) or must not (false) be tmpfs.
    #[serde(default)]
    pub tmpfs: Option<bool>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum StorageKind {
    #[default]
    File,
    Rbd,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Cache {
    #[default]
    /// Page cache bypassed everywhere: cryptblk `--cache none`, QEMU `cache.direct=on,
    /// aio=io_uring`, fio `--direct=1`.
    None,
    /// Each tool's default (the page cache is used).
    Default,
}

impl Config {
    pub fn load(path: Option<&Path>) -> Result<Config> {
        let (text, from) = match path {
            Some(p) => (
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?,
                p.display().to_string(),
            ),
            None => (
                DEFAULT_CONFIG.to_string(),
                "the built-in presets".to_string(),
            ),
        };
        let config: Config = toml::from_str(&text).with_context(|| format!("parsing {from}"))?;
        for name in config.presets.keys() {
            config
                .check(name)
                .with_context(|| format!("preset '{name}' in {from}"))?;
        }
        Ok(config)
    }

    pub fn preset(&self, name: &str) -> Result<&Preset> {
        self.presets.get(name).with_context(|| {
            let known: Vec<&str> = self.presets.keys().map(String::as_str).collect();
            format!("no preset '{name}' (known: {})", known.join(", "))
        })
    }

    /// Adds, next to every cryptblk peer of `preset`, its twin served by the baseline binary
    /// (measured right after it in every round), and the ratio of the two.
    pub fn add_baseline(&mut self, preset: &mut Preset) {
        let mut peers = Vec::new();
        for id in &preset.peers {
            peers.push(id.clone());
            let Some(peer) = self.peers.get(id).cloned() else {
                continue;
            };
            if peer.server != Server::Cryptblk {
                continue;
            }
            let twin = baseline_id(id);
            self.peers.insert(
                twin.clone(),
                Peer {
                    name: format!("{} (baseline binary)", peer.name),
                    baseline: true,
                    ..peer
                },
            );
            preset.ratios.push(Figure::pair(id, &twin));
            peers.push(twin);
        }
        preset.peers = peers;
    }

    pub fn peer(&self, id: &str) -> Result<&Peer> {
        self.peers
            .get(id)
            .with_context(|| format!("no peer '{id}' in [peers]"))
    }

    pub fn workload(&self, id: &str) -> Result<&Workload> {
        self.workloads
            .get(id)
            .with_context(|| format!("no workload '{id}' in [workloads]"))
    }

    /// Every name a preset uses exists and fits: ratios name the preset's peers; a matrix's
    /// ceiling is fio, its servers are not.
    fn check(&self, name: &str) -> Result<()> {
        let p = self.preset(name)?;
        for f in &p.ratios {
            for id in std::iter::once(&f.x).chain(&f.y) {
                if *id != p.ceiling && !p.peers.contains(id) && !id.starts_with('@') {
                    bail!(
                        "ratio {} names '{id}', which is not one of the preset's peers",
                        f.label()
                    );
                }
            }
        }
        if p.rounds == 0 || p.runtime <= 0.0 {
            bail!("rounds and runtime must not be zero");
        }
        if p.driver != Driver::Matrix {
            return Ok(());
        }
        if self.peer(&p.ceiling)?.server != Server::Fio {
            bail!(
                "the ceiling '{}' must be a peer with server = \"fio\"",
                p.ceiling
            );
        }
        for id in &p.peers {
            let peer = self.peer(id)?;
            if peer.server == Server::Fio {
                bail!("peer '{id}' is fio: only the ceiling may be");
            }
            if !peer.serve_args.is_empty() && peer.server != Server::Cryptblk {
                bail!("peer '{id}' has serve_args, which only a cryptblk peer takes");
            }
            if peer.checkpoint
                && (peer.server != Server::Cryptblk
                    || p.storage.kind != StorageKind::File
                    || p.transports != [Transport::Vhost])
            {
                bail!("peer '{id}' has a checkpoint: only a cryptblk peer over vhost-user-blk on a file keeps one here (server = \"cryptblk\", storage.kind = \"file\", transports = [\"vhost\"])");
            }
            if peer.server.is_spdk()
                && (peer.image != Image::Raw
                    || p.storage.kind != StorageKind::File
                    || p.transports != [Transport::Vhost])
            {
                bail!("peer '{id}' is SPDK: it serves the raw image file over vhost only (image = \"raw\", storage.kind = \"file\", transports = [\"vhost\"])");
            }
        }
        for w in &p.workloads {
            self.workload(w)?;
        }
        if p.transports.is_empty() {
            bail!("a matrix preset names its transports");
        }
        parse_size(&p.storage.size)?;
        if p.storage.kind == StorageKind::File && p.storage.dir.is_none() {
            bail!("storage.dir is required with kind = \"file\"");
        }
        Ok(())
    }
}

impl Preset {
    /// The preset with only the peers, transports and workloads named (each list: None keeps
    /// the preset's); a name the preset does not have is an error naming it.
    pub fn narrowed(
        &self,
        peers: Option<&[String]>,
        transports: Option<&[Transport]>,
        workloads: Option<&[String]>,
    ) -> Result<Preset> {
        fn pick<T: PartialEq + Clone + std::fmt::Debug>(
            all: &[T],
            only: Option<&[T]>,
            what: &str,
        ) -> Result<Vec<T>> {
            let Some(only) = only else {
                return Ok(all.to_vec());
            };
            if let Some(x) = only.iter().find(|x| !all.contains(x)) {
                bail!("{what} {x:?} is not in the preset (it has {all:?})");
            }
            Ok(all.iter().filter(|x| only.contains(x)).cloned().collect())
        }
        let mut p = self.clone();
        p.peers = pick(&self.peers, peers, "peer")?;
        p.transports = pick(&self.transports, transports, "transport")?;
        p.workloads = pick(&self.workloads, workloads, "workload")?;
        if p.transports.is_empty() || p.workloads.is_empty() {
            bail!("nothing left to measure");
        }
        p.ratios.retain(|f| {
            std::iter::once(&f.x)
                .chain(&f.y)
                .all(|id| *id == p.ceiling || p.peers.contains(id))
        });
        Ok(p)
    }
}

/// `4096`, `4k`, `256M`, `8G` (binary suffixes, as qemu-img reads them) -> bytes.
pub fn parse_size(s: &str) -> Result<u64> {
    let t = s.trim();
    let (num, shift) = match t.chars().last().map(|c| c.to_ascii_uppercase()) {
        Some('K') => (&t[..t.len() - 1], 10),
        Some('M') => (&t[..t.len() - 1], 20),
        Some('G') => (&t[..t.len() - 1], 30),
        Some('T') => (&t[..t.len() - 1], 40),
        _ => (t, 0),
    };
    num.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(1 << shift))
        .filter(|&n| n > 0)
        .with_context(|| format!("invalid size '{s}': give bytes or a number with K, M, G or T"))
}

#[cfg(test)]
mod tests;
