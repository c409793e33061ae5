//! The soak's disks: images made in the run's directory (raw, LUKS2 with a cheap pbkdf2
//! keyslot, a few at `cryptblk format`'s default argon2id if asked), the `--config` file that
//! serves the fixed ones, and the table the clients and the churn share: which disks are
//! attached, which client holds which, and each disk's model.
use super::model::{Model, BLOCK};
use crate::command::{quiet_output, show};
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Kind {
    Raw,
    Luks2Pbkdf2,
    Luks2Argon2id,
}

pub struct Disk {
    pub name: String,
    pub image: PathBuf,
    pub socket: PathBuf,
    pub kind: Kind,
    /// One of the extra disks `ctl disk-add` / `disk-remove` churn (not in the config file).
    pub pool: bool,
    pub attached: AtomicBool,
    /// Bumped before and after every detach or attach of this disk: a client whose request
    /// hangs reconnects when it changed since it connected, or while it is odd (under way).
    pub changes: AtomicU64,
    /// The disk's model while no client holds it; `None` while one does.
    pub slot: Mutex<Option<Model>>,
}

impl Disk {
    pub fn is_held(&self) -> bool {
        self.slot.lock().unwrap().is_none()
    }

    /// The disk for a client alone, if it is attached and no other client holds it.
    pub fn take(&self) -> Option<Model> {
        if !self.attached.load(Ordering::SeqCst) {
            return None;
        }
        self.slot.lock().unwrap().take()
    }

    pub fn give_back(&self, model: Model) {
        *self.slot.lock().unwrap() = Some(model);
    }

    pub fn is_luks(&self) -> bool {
        self.kind != Kind::Raw
    }
}

/// What `create` makes.
pub struct Layout<'a> {
    pub dir: &'a Path,
    pub cryptblk: &'a Path,
    pub key: &'a Path,
    pub disks: usize,
    pub pool: usize,
    pub argon2id: usize,
    pub size: u64,
}

/// A directory the soak may fill: new, empty, or one an earlier soak left (its marker file),
/// whose files are removed first.
pub fn prepare_dir(dir: &Path) -> Result<()> {
    let marker = dir.join(".cryptblk-soak");
    if dir.exists() {
        let nonempty = std::fs::read_dir(dir)
            .with_context(|| format!("reading {}", dir.display()))?
            .next()
            .is_some();
        if nonempty && !marker.exists() {
            bail!(
                "{} holds files an earlier soak did not make; give an empty or new --dir",
                dir.display()
            );
        }
        std::fs::remove_dir_all(dir).with_context(|| format!("emptying {}", dir.display()))?;
    }
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    std::fs::write(
        &marker,
        "made by cryptblk-bench soak; removed by the next soak\n",
    )?;
    Ok(())
}

/// The images: of the fixed disks, every third raw, the first `argon2id` LUKS2 ones at the
/// default KDF, the rest LUKS2 with a cheap pbkdf2 keyslot; the pool alternates raw and cheap
/// LUKS2.
pub fn create(l: &Layout) -> Result<Vec<Disk>> {
    if l.size < 64 * BLOCK as u64 {
        bail!("--disk-size must be at least 256K");
    }
    let mut disks = Vec::new();
    let mut argon_left = l.argon2id;
    for i in 0..l.disks + l.pool {
        let pool = i >= l.disks;
        let name = if pool {
            format!("p{}", i - l.disks)
        } else {
            format!("d{i}")
        };
        let kind = if i % 3 == 2 {
            Kind::Raw
        } else if !pool && argon_left > 0 {
            argon_left -= 1;
            Kind::Luks2Argon2id
        } else {
            Kind::Luks2Pbkdf2
        };
        let image = l.dir.join(format!("{name}.img"));
        match kind {
            Kind::Raw => std::fs::File::create(&image)
                .and_then(|f| f.set_len(l.size))
                .with_context(|| format!("creating {}", image.display()))?,
            Kind::Luks2Pbkdf2 | Kind::Luks2Argon2id => {
                let mut cmd = Command::new(l.cryptblk);
                cmd.args(["format", "-q", "--key-file"]).arg(l.key);
                if kind == Kind::Luks2Pbkdf2 {
                    cmd.args(crate::images::CHEAP_KDF);
                }
                cmd.arg(&image).arg(l.size.to_string());
                if i < 2 || kind == Kind::Luks2Argon2id {
                    show(&cmd);
                }
                quiet_output(&mut cmd)?;
            }
        }
        let blocks = l.size / BLOCK as u64;
        disks.push(Disk {
            socket: l.dir.join(format!("{name}.sock")),
            name,
            image,
            kind,
            pool,
            attached: AtomicBool::new(!pool),
            changes: AtomicU64::new(0),
            slot: Mutex::new(Some(Model::new(i as u32, blocks))),
        });
    }
    Ok(disks)
}

/// The `--config` file: the memory budget and a `[[disk]]` per fixed disk, each on its own
/// vhost-user socket (one queue) and exported over NBD. libblkio cannot seal its memory, so
/// the disks map it unsealed (docs/security.md).
pub fn config_toml(disks: &[Disk], key: &Path, memory_budget: &str) -> String {
    let mut out = format!("memory-budget = {:?}\n", memory_budget);
    for d in disks.iter().filter(|d| !d.pool) {
        out.push_str(&format!(
            "\n[[disk]]\nname = {:?}\nimage = {:?}\nvhost-user-blk = {:?}\nnbd-export = true\nunsealed-memory = true\n",
            d.name,
            d.image.display().to_string(),
            d.socket.display().to_string()
        ));
        if d.is_luks() {
            out.push_str(&format!("key-file = {:?}\n", key.display().to_string()));
        }
    }
    out
}

/// `ctl disk-add` arguments for a pool disk, the same settings as the config's.
pub fn add_args(d: &Disk, key: &Path) -> Vec<String> {
    let mut args = vec![
        "disk-add".to_string(),
        "--image".into(),
        d.image.display().to_string(),
        "--vhost-user-blk".into(),
        d.socket.display().to_string(),
        "--nbd-export".into(),
        "--unsealed-memory".into(),
    ];
    if d.is_luks() {
        args.extend(["--key-file".into(), key.display().to_string()]);
    }
    args.push(d.name.clone());
    args
}
