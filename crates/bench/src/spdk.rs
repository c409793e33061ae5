//! SPDK's vhost target as a peer: (e) a crypto vbdev (AES_XTS through SPDK's accel framework)
//! over an aio bdev on the raw image, (e-plain) the aio bdev alone, exported as a
//! vhost-user-blk controller. SPDK's crypto vbdev has its own on-disk format (none: the
//! ciphertext of each block, no header), so it serves the raw twin image file the way
//! cryptblk's LUKS2 serves its payload: every block read is decrypted, every block written
//! encrypted, with a 512-bit AES-XTS key, like the LUKS2 image's.
//!
//! Built by scripts/build-spdk.sh; found through `SPDK_DIR`. The reactor busy-polls its core:
//! the server's CPU is ~100 % whether loaded or idle, and the records say so as they are.
use crate::peers::Running;
use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// 2 MiB hugepages SPDK gets (as its README runs it): DPDK takes its memory from them, and the
/// client (vu_bench --hugepages) a few more.
pub const HUGEPAGES: u64 = 1024;

/// An SPDK build usable here: its vhost binary and the libraries it loads.
#[derive(Debug, Clone)]
pub struct Spdk {
    dir: PathBuf,
}

impl Spdk {
    /// The build under `SPDK_DIR`, with at least [`HUGEPAGES`] hugepages in the pool (raised
    /// through /proc/sys/vm/nr_hugepages when fewer). The error says what is missing and how
    /// to get it; the caller skips the SPDK peers with it.
    pub fn find() -> std::result::Result<Spdk, String> {
        let dir = std::env::var_os("SPDK_DIR").map(PathBuf::from).ok_or(
            "SPDK_DIR is not set (build SPDK with scripts/build-spdk.sh and set SPDK_DIR to its tree)",
        )?;
        let spdk = Spdk { dir };
        if !spdk.vhost().is_file() {
            return Err(format!(
                "{} not found: build it with SPDK_DIR={} scripts/build-spdk.sh",
                spdk.vhost().display(),
                spdk.dir.display()
            ));
        }
        ensure_hugepages(HUGEPAGES)?;
        Ok(spdk)
    }

    fn vhost(&self) -> PathBuf {
        self.dir.join("build/bin/vhost")
    }

    /// Starts `vhost` on one core without PCI, has it serve `image` (a crypto vbdev over it
    /// when `crypto`) as controller `vhost.0` in `dir`, and returns once the socket is there.
    pub fn start(&self, image: &Path, crypto: bool, dir: &Path, log: &Path) -> Result<Running> {
        std::fs::create_dir_all(dir)?;
        let rpc = dir.join("rpc.sock");
        let socket = dir.join("vhost.0");
        for stale in [&rpc, &socket] {
            let _ = std::fs::remove_file(stale);
        }
        let libs = ["build/lib", "isa-l/.libs", "isa-l-crypto/.libs"]
            .map(|l| self.dir.join(l).display().to_string())
            .join(":");
        let mut cmd = Command::new(self.vhost());
        cmd.args(["-m", "0x1", "--no-pci", "-S"])
            .arg(dir)
            .arg("-r")
            .arg(&rpc)
            .env("LD_LIBRARY_PATH", libs);
        crate::command::show(&cmd);
        let out = std::fs::File::create(log)?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .with_context(|| format!("starting {}", self.vhost().display()))?;
        let mut running = Running::new(child, socket.clone(), log.to_path_buf());
        let mut conn = wait_for_rpc(&mut running, &rpc)?;
        let mut call = |method: &str, params: Value| {
            conn.call(method, params)
                .with_context(|| format!("SPDK RPC {method}; its log:\n{}", running.log_tail()))
        };
        call(
            "bdev_aio_create",
            json!({"filename": image, "name": "base0", "block_size": 4096}),
        )?;
        let bdev = if crypto {
            // A throwaway key for a benchmark image, sent over the RPC socket (not on argv).
            let mut key = [0u8; 64];
            std::fs::File::open("/dev/urandom")?.read_exact(&mut key)?;
            let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
            call(
                "accel_crypto_key_create",
                json!({"cipher": "AES_XTS", "key": hex(&key[..32]), "key2": hex(&key[32..]), "name": "key0"}),
            )?;
            call(
                "bdev_crypto_create",
                json!({"base_bdev_name": "base0", "name": "crypto0", "key_name": "key0"}),
            )?;
            "crypto0"
        } else {
            "base0"
        };
        call(
            "vhost_create_blk_controller",
            json!({"ctrlr": "vhost.0", "dev_name": bdev, "cpumask": "0x1"}),
        )?;
        crate::wait::until(
            Duration::from_secs(30),
            Duration::from_millis(20),
            || {
                format!(
                    "SPDK did not create {}; its log:\n{}",
                    socket.display(),
                    running.log_tail()
                )
            },
            || Ok(socket.exists().then_some(())),
        )?;
        Ok(running)
    }
}

/// Raises the hugepage pool to `want` pages when it is smaller (root only).
fn ensure_hugepages(want: u64) -> std::result::Result<(), String> {
    const KNOB: &str = "/proc/sys/vm/nr_hugepages";
    let read = || -> u64 {
        std::fs::read_to_string(KNOB)
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0)
    };
    if read() < want {
        let _ = std::fs::write(KNOB, want.to_string());
    }
    let have = read();
    if have < want {
        return Err(format!(
            "{have} hugepages of 2 MiB, {want} needed (as root: echo {want} > {KNOB}; \
             the machine may be short of contiguous memory)"
        ));
    }
    // DPDK finds its hugepages through a hugetlbfs mount; a container may have none.
    let mounted = || {
        std::fs::read_to_string("/proc/mounts")
            .is_ok_and(|m| m.lines().any(|l| l.split(' ').nth(2) == Some("hugetlbfs")))
    };
    if !mounted() {
        let _ = std::fs::create_dir_all("/dev/hugepages");
        let _ = Command::new("mount")
            .args(["-t", "hugetlbfs", "nodev", "/dev/hugepages"])
            .status();
    }
    if !mounted() {
        return Err(
            "no hugetlbfs mounted (as root: mount -t hugetlbfs nodev /dev/hugepages)".into(),
        );
    }
    Ok(())
}

/// Connects to the RPC socket once SPDK listens on it (it does after its subsystems start).
fn wait_for_rpc(running: &mut Running, rpc: &Path) -> Result<Rpc> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(stream) = UnixStream::connect(rpc) {
            stream.set_read_timeout(Some(Duration::from_secs(30)))?;
            return Ok(Rpc { stream, id: 0 });
        }
        if let Some(status) = running.exited()? {
            bail!(
                "SPDK exited ({status}) before serving RPCs; its log:\n{}",
                running.log_tail()
            );
        }
        if Instant::now() > deadline {
            bail!(
                "SPDK did not listen on {} within 60 s; its log:\n{}",
                rpc.display(),
                running.log_tail()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// SPDK's JSON-RPC 2.0 on its UNIX socket (what scripts/rpc.py speaks): one request, one reply.
struct Rpc {
    stream: UnixStream,
    id: u64,
}

impl Rpc {
    fn call(&mut self, method: &str, params: Value) -> Result<Value> {
        self.id += 1;
        let request = json!({"jsonrpc": "2.0", "method": method, "params": params, "id": self.id});
        self.stream.write_all(request.to_string().as_bytes())?;
        let reply: Value = serde_json::Deserializer::from_reader(&self.stream)
            .into_iter::<Value>()
            .next()
            .context("SPDK closed the RPC socket without a reply")?
            .context("reading SPDK's RPC reply")?;
        if let Some(err) = reply.get("error") {
            bail!("SPDK refused {method}: {err}");
        }
        Ok(reply.get("result").cloned().unwrap_or(Value::Null))
    }
}
