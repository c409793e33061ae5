//! The crypto engines per CPU-second (preset `engine-cpu`, was crates/crypto's
//! `engine_ratio` example): two sector-crypto engines encrypt and decrypt the same buffer in
//! this process, alternating which goes first each round; the figure is GB per CPU-second of
//! the measuring thread, which a shared machine's other load changes far less than wall-clock
//! throughput.
use crate::config::Config;
use crate::engine::{self, Driver, Measured};
use crate::plan::{Fits, Step};
use crate::sample::{Metrics, Sample};
use anyhow::{bail, Context, Result};
use cryptblk_crypto::{engines, CipherSpec, Direction, SecretKey, SectorCipher};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub struct Args {
    /// The candidate engine, then the reference.
    #[arg(long, value_delimiter = ',', default_value = "vaes,openssl")]
    engines: Vec<String>,
    /// AES-XTS key bits (256 or 512).
    #[arg(long, default_value_t = 512)]
    bits: usize,
    #[arg(long, default_value_t = 4096)]
    sector: usize,
    /// Bytes per call.
    #[arg(long, default_value_t = 1 << 20)]
    buffer: usize,
    #[arg(long, default_value_t = 9)]
    rounds: u32,
    /// Milliseconds of calls per measurement.
    #[arg(long, default_value_t = 100)]
    ms: u64,
    #[arg(long, default_value = "engine-cpu-results.jsonl")]
    results: PathBuf,
}

struct EngineCpu<'a> {
    a: &'a Args,
    ciphers: Vec<(String, Arc<dyn SectorCipher>)>,
    buf: Vec<u8>,
}

pub fn run(a: &Args, config: &Config) -> Result<Vec<Sample>> {
    if a.engines.len() != 2 || a.engines[0] == a.engines[1] {
        bail!("--engines takes two different names: the candidate, then the reference");
    }
    if a.sector == 0 || a.buffer < a.sector || a.ms == 0 {
        bail!("--sector, --ms and --buffer (at least one sector) must be positive");
    }
    let spec = CipherSpec::parse_luks2("aes-xts-plain64", a.bits / 8)
        .with_context(|| format!("--bits {}", a.bits))?;
    let key = SecretKey::random(a.bits / 8)?;
    let mut ciphers = Vec::new();
    for name in &a.engines {
        let engine = engines()
            .into_iter()
            .find(|e| e.name() == name)
            .with_context(|| format!("no engine {name} (cryptblk bench lists them)"))?;
        let cipher = engine
            .new_cipher(&spec, &key, a.sector)
            .with_context(|| format!("engine {name} cannot run this cipher here"))?;
        ciphers.push((name.clone(), cipher));
    }
    let mut preset = config.preset("engine-cpu")?.clone();
    preset.peers = a.engines.clone();
    let mut d = EngineCpu {
        a,
        ciphers,
        buf: vec![0x5a; a.buffer / a.sector * a.sector],
    };
    engine::run("engine-cpu", &preset, a.rounds, &mut d, &a.results)
}

fn thread_cpu() -> Duration {
    let ts = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

impl Fits for EngineCpu<'_> {
    fn transports(&self, _: &str) -> Vec<String> {
        vec!["local".into()]
    }
    fn fits(&self, _: &str, _: &str, _: &str) -> bool {
        true
    }
    fn has_ceiling(&self, _: &str) -> bool {
        false
    }
}

impl Driver for EngineCpu<'_> {
    fn storage(&self) -> String {
        format!(
            "aes-xts-plain64 {} bits, {}-byte sectors, {} KiB per call, in memory",
            self.a.bits,
            self.a.sector,
            self.buf.len() / 1024
        )
    }

    fn peer_name(&self, peer: &str) -> String {
        format!("engine {peer}")
    }

    fn measure(&mut self, step: &Step) -> Result<Measured> {
        let dir = match step.workload.as_str() {
            "encrypt" => Direction::Encrypt,
            "decrypt" => Direction::Decrypt,
            other => bail!("workload {other}: encrypt or decrypt"),
        };
        let (_, c) = self
            .ciphers
            .iter()
            .find(|(name, _)| *name == step.peer)
            .context("an engine not given")?;
        let (len, sectors) = (self.buf.len(), (self.buf.len() / self.a.sector) as u64);
        let budget = Duration::from_millis(self.a.ms);
        let mut sector = 0u64;
        c.crypt(dir, sector, &mut self.buf)?;
        let (t0, c0) = (Instant::now(), thread_cpu());
        let mut bytes = 0usize;
        while t0.elapsed() < budget {
            c.crypt(dir, sector, &mut self.buf)?;
            sector = sector.wrapping_add(sectors);
            bytes += len;
        }
        let cpu = (thread_cpu() - c0).as_secs_f64();
        Ok(Measured {
            window_s: t0.elapsed().as_secs_f64(),
            metrics: Metrics::default().with("gb_per_cpu_s", Some(bytes as f64 / cpu / 1e9)),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_engines_alternate_and_their_ratio_is_summarised_per_round() {
        let config = Config::load(None).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let a = Args {
            engines: vec!["openssl".into(), "rustcrypto".into()],
            bits: 512,
            sector: 4096,
            buffer: 64 << 10,
            rounds: 2,
            ms: 5,
            results: dir.path().join("r.jsonl"),
        };
        let samples = run(&a, &config).unwrap();
        let order: Vec<&str> = samples.iter().map(|s| s.peer.as_str()).collect();
        // Encrypt rounds, then decrypt rounds; who goes first alternates.
        assert_eq!(
            order,
            ["openssl", "rustcrypto", "rustcrypto", "openssl"].repeat(2)
        );
        assert!(samples.iter().all(|s| s.get("gb_per_cpu_s").unwrap() > 0.0));
        let kept = crate::sample::load(&a.results).unwrap();
        assert_eq!(kept.len(), samples.len());
        assert!(kept
            .iter()
            .zip(&samples)
            .all(|(k, s)| k.group == s.group && k.peer == s.peer));
        let md = crate::report::markdown(&config, &samples);
        assert!(
            md.contains("| openssl/rustcrypto GB per CPU-second |"),
            "{md}"
        );
        assert!(
            md.contains("| encrypt | ") && md.contains("| decrypt | "),
            "{md}"
        );
    }
}
