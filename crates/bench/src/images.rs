//! The images every peer serves, all holding the same incompressible payload: the raw image is
//! written here, and copied into each LUKS image with `cryptblk convert -n` (so reads hit
//! written ciphertext, never holes).
use crate::command::run;
use crate::config::Image;
use anyhow::{bail, Context, Result};
use std::collections::BTreeSet;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

/// A keyslot that opens in a millisecond: no experiment here measures a KDF.
pub const CHEAP_KDF: &[&str] = &["--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"];

#[derive(Clone)]
pub struct Images {
    pub dir: PathBuf,
    pub key: PathBuf,
    pub size: u64,
    /// Set when the images live in a Ceph pool (`rbd` preset) instead of `dir`.
    pub rbd: Option<RbdStore>,
}

impl Images {
    pub fn path(&self, image: Image) -> PathBuf {
        self.dir.join(format!("{}.img", image.label()))
    }

    /// Every image file (for dropping their cached pages).
    pub fn all(&self, which: &BTreeSet<Image>) -> Vec<PathBuf> {
        which.iter().map(|i| self.path(*i)).collect()
    }
}

/// The Ceph pool of the `rbd` preset's images.
pub const POOL: &str = "rbd";

/// Where an image of the cluster is, for the tools that open it.
#[derive(Debug, Clone)]
pub struct RbdStore {
    pub conf: PathBuf,
}

impl RbdStore {
    /// The RBD image name of `image`.
    pub fn image_name(image: Image) -> &'static str {
        match image {
            Image::Raw => "plain",
            Image::Luks2 => "luks2-cryptblk",
            Image::Luks1 => "luks1-qemu",
            Image::RbdLuks2Librbd => "luks2-librbd",
        }
    }

    /// `rbd:POOL/IMAGE:conf=...`, as cryptblk opens it.
    pub fn cryptblk_name(&self, image: Image) -> String {
        format!(
            "rbd:{POOL}/{}:conf={}",
            Self::image_name(image),
            self.conf.display()
        )
    }
}

/// Makes the images in `dir` (or reuses them with `keep`, when the raw one has the size).
pub fn prepare(
    dir: &Path,
    size: u64,
    which: &BTreeSet<Image>,
    cryptblk: &Path,
    keep: bool,
) -> Result<Images> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let images = Images {
        dir: dir.to_path_buf(),
        key: dir.join("key"),
        size,
        rbd: None,
    };
    let raw = images.path(Image::Raw);
    let reuse = keep
        && images.key.exists()
        && std::fs::metadata(&raw).is_ok_and(|m| m.len() == size)
        && which.iter().all(|i| images.path(*i).exists());
    if reuse {
        eprintln!("reusing the images in {}", dir.display());
        return Ok(images);
    }
    let mut key = [0u8; 24];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut key))?;
    let hex: String = key.iter().map(|b| format!("{b:02x}")).collect();
    std::fs::write(&images.key, hex)?;
    eprintln!(
        "+ writing {size} bytes of incompressible data to {}",
        raw.display()
    );
    random_file(&raw, size)?;
    for &image in which.iter().filter(|i| **i != Image::Raw) {
        let path = images.path(image);
        let _ = std::fs::remove_file(&path);
        match image {
            Image::Raw => unreachable!("filtered out"),
            Image::Luks2 => run(Command::new(cryptblk)
                .args(["format", "-q", "--type", "luks2", "--cipher", "aes-xts-plain64"])
                .args(["--key-size", "512", "--sector-size", "4096"])
                .args(CHEAP_KDF)
                .arg("--key-file")
                .arg(&images.key)
                .arg(&path)
                .arg(size.to_string()))?,
            Image::Luks1 => qemu_luks1(&path, size, &images.key)?,
            Image::RbdLuks2Librbd => bail!("rbd-luks2-librbd images live in Ceph: the rbd preset is not run by this harness yet"),
        }
        run(Command::new(cryptblk)
            .args(["convert", "-n", "-f", "raw", "-O", "luks", "--key-file"])
            .arg(&images.key)
            .arg(&raw)
            .arg(&path))?;
    }
    crate::procfs::sync_fs(dir)?;
    Ok(images)
}

/// `size` bytes of xorshift output: does not compress, ~1 GB/s to write.
pub(crate) fn random_file(path: &Path, size: u64) -> Result<()> {
    let mut f = std::io::BufWriter::new(
        std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?,
    );
    let mut seed = [0u8; 8];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut u| std::io::Read::read_exact(&mut u, &mut seed))?;
    let mut x = u64::from_le_bytes(seed) | 1;
    let mut buf = vec![0u8; 1 << 20];
    let mut left = size;
    while left > 0 {
        for word in buf.chunks_exact_mut(8) {
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            word.copy_from_slice(&x.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes());
        }
        let n = left.min(buf.len() as u64) as usize;
        f.write_all(&buf[..n])?;
        left -= n as u64;
    }
    f.into_inner()
        .map_err(|e| e.into_error())?
        .sync_all()
        .with_context(|| format!("writing {}", path.display()))
}

/// A LUKS1 aes-xts-plain64 image made by qemu-img (QEMU's own encryption, the peer). Its KDF
/// calibration fails now and then on a busy machine ("Unable to get accurate CPU usage"); a
/// failed try ends in milliseconds, so that error alone is retried, many times.
pub fn qemu_luks1(path: &Path, size: u64, key: &Path) -> Result<()> {
    let mut cmd = Command::new("qemu-img");
    cmd.args(["create", "-q", "-f", "luks", "--object"])
        .arg(format!("secret,id=sec0,file={}", key.display()))
        .args(["-o", "key-secret=sec0,cipher-alg=aes-256,cipher-mode=xts,ivgen-alg=plain64,hash-alg=sha256,iter-time=10"])
        .arg(path)
        .arg(size.to_string());
    crate::command::show(&cmd);
    for _ in 0..400 {
        let out = cmd
            .output()
            .context("running qemu-img (Debian: apt-get install qemu-utils)")?;
        if out.status.success() {
            return Ok(());
        }
        let err = String::from_utf8_lossy(&out.stderr);
        if !err.contains("accurate CPU usage") {
            bail!("qemu-img create failed: {}", err.trim());
        }
        let _ = std::fs::remove_file(path);
    }
    bail!("qemu-img create failed 400 times with 'Unable to get accurate CPU usage'")
}
