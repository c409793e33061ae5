//! A served disk that an online reencryption or encryption changes while an NBD client reads
//! and writes it: the daemon's start and `reencrypt-status`, and a model of what the client
//! wrote, checked around the boundary as it moves.
use super::{assert_same_bytes, Daemon, Key, Serve, TestDir, MIB};
use cryptblk_testutil::nbd::NbdClient;
use rand::{Rng, RngCore, SeedableRng};
use serde_json::Value;
use std::path::PathBuf;

/// A disk's image and passphrase in a directory of their own, served as disk "vol".
pub struct OnlineDisk {
    pub t: TestDir,
    pub img: PathBuf,
    pub key: Key,
}

impl OnlineDisk {
    pub fn path(&self, name: &str) -> PathBuf {
        self.t.path(name)
    }

    /// `serve` with the image as disk "vol", NBD and a control socket (no key: add one).
    pub fn serve(&self) -> Serve {
        self.t.serve().image(&self.img).name("vol").nbd().control()
    }
}

/// `reencrypt-status vol`.
pub fn status(daemon: &Daemon) -> Value {
    daemon.ctl_ok(&["reencrypt-status", "vol"])
}

/// Runs rounds of `model`'s I/O around the boundary `boundary(status)` until the run
/// finishes; returns how many rounds overlapped it.
pub fn io_until_finished(
    daemon: &Daemon,
    c: &mut NbdClient,
    model: &mut Model,
    boundary: impl Fn(&Value) -> u64,
) -> usize {
    let mut rounds = 0;
    loop {
        let st = status(daemon);
        if st["phase"] == "finished" {
            return rounds;
        }
        assert!(st["last-error"].is_null(), "{st}");
        model.round(c, boundary(&st));
        c.flush().unwrap();
        rounds += 1;
    }
}

pub fn done_bytes(st: &Value) -> u64 {
    st["bytes-done"].as_u64().unwrap()
}

/// What the disk holds, as the client wrote it.
pub struct Model {
    pub data: Vec<u8>,
    rng: rand::rngs::StdRng,
    /// Offsets checked in every round besides the boundary (where a layout changes for good:
    /// an encryption's moved part ends there).
    also: Vec<u64>,
}

impl Model {
    pub fn new(size: u64, seed: u64, also: &[u64]) -> Model {
        Model {
            data: vec![0; size as usize],
            rng: rand::rngs::StdRng::seed_from_u64(seed),
            also: also.to_vec(),
        }
    }

    fn size(&self) -> u64 {
        self.data.len() as u64
    }

    /// Writes random bytes at `offset` (512-byte aligned, so requests that are not whole
    /// 4096-byte sectors take the read-modify-write path where the sectors are 4096).
    pub fn write(&mut self, c: &mut NbdClient, offset: u64, len: usize) {
        let mut buf = vec![0u8; len];
        self.rng.fill_bytes(&mut buf);
        c.write(offset, &buf, false).unwrap();
        self.data[offset as usize..offset as usize + len].copy_from_slice(&buf);
    }

    /// A new client of disk "vol" on `daemon` that fills it with random data, and the model of
    /// what it wrote.
    pub fn filled(daemon: &Daemon, size: u64, seed: u64, also: &[u64]) -> (NbdClient, Model) {
        let (mut c, mut model) = (daemon.nbd("vol"), Model::new(size, seed, also));
        model.fill(&mut c);
        (c, model)
    }

    pub fn fill(&mut self, c: &mut NbdClient) {
        for off in (0..self.size()).step_by(MIB as usize) {
            self.write(c, off, MIB as usize);
        }
        c.flush().unwrap();
    }

    /// Reads `len` bytes at `offset` and compares them with what was written.
    pub fn check(&self, c: &mut NbdClient, offset: u64, len: usize, when: &str) {
        let got = c.read(offset, len as u32).unwrap();
        assert_same_bytes(
            &got,
            &self.data[offset as usize..offset as usize + len],
            &format!("{len} bytes at {offset} {when}"),
        );
    }

    pub fn check_all(&self, c: &mut NbdClient, when: &str) {
        for off in (0..self.size()).step_by(MIB as usize) {
            self.check(c, off, MIB as usize, when);
        }
    }

    /// A round of mixed I/O: around the boundary `at` and the model's other offsets (below,
    /// across, above), and at random.
    pub fn round(&mut self, c: &mut NbdClient, at: u64) {
        let size = self.size();
        let around =
            |p: u64, d: i64| (p as i64 + d).clamp(0, (size - 64 * 1024) as i64) as u64 / 512 * 512;
        let points: Vec<u64> = std::iter::once(at).chain(self.also.clone()).collect();
        for p in points {
            for d in [-(MIB as i64), -4096, -512, 0, 512, 4096, MIB as i64] {
                let off = around(p, d);
                self.write(c, off, 8192 + 512);
                self.check(c, off, 16384, "near a boundary");
            }
        }
        for _ in 0..8 {
            let len = self.rng.gen_range(1..=32) * 512;
            let off = self.rng.gen_range(0..(size - len as u64) / 512) * 512;
            if self.rng.gen_bool(0.5) {
                self.write(c, off, len);
            } else {
                self.check(c, off, len, "at random");
            }
        }
    }
}
