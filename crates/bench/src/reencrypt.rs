//! `cryptblk-bench reencrypt`: a LUKS2 image's volume key replaced, offline and online.
//!
//! Offline, per round in rotating order on the same image (page cache dropped before each):
//! `cryptsetup reencrypt --force-offline-reencrypt`, `cryptblk reencrypt` (both with the same
//! resilience, `checksum`, and a cheap PBKDF for the new keyslot, so the data is what is
//! timed), and `dd` reading and writing the same bytes in place with O_DIRECT, the device's
//! limit for a pass that reads and rewrites the whole payload. Online: the image served over
//! vhost-user-blk (`cache=none`), 4k random reads at depth 32 from vu_bench without a
//! reencryption and during one at the default rate (`ctl reencrypt-start`, then
//! `reencrypt-pause`), in alternating order per round. One JSON line per measurement.
use crate::config::{Image, Workload};
use crate::{clients, images, peers, procfs};
use anyhow::{bail, Context, Result};
use serde::Serialize;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

pub struct Options {
    pub rounds: u32,
    pub size: u64,
    pub dir: PathBuf,
    pub runtime: f64,
    pub cryptblk: PathBuf,
    pub vu_bench: PathBuf,
    pub results: PathBuf,
    pub keep_images: bool,
}

#[derive(Debug, Serialize)]
pub(crate) struct Sample {
    pub commit: String,
    pub machine: crate::record::Machine,
    pub part: &'static str,
    pub round: u32,
    /// offline: cryptsetup, cryptblk or copy; online: without or during.
    pub what: &'static str,
    pub seconds: Option<f64>,
    pub mib_s: Option<f64>,
    pub iops: Option<f64>,
    pub lat_p99_us: Option<f64>,
    pub lat_p999_us: Option<f64>,
}

const OFFLINE: [&str; 3] = ["cryptsetup", "cryptblk", "copy"];

pub fn run(o: &Options, online_workload: &Workload) -> Result<()> {
    for tool in ["cryptsetup", "dd"] {
        if Command::new(tool).arg("--version").output().is_err() {
            bail!("{tool} is not installed: scripts/install-deps.sh installs it");
        }
    }
    let imgs = images::prepare(
        &o.dir,
        o.size,
        &BTreeSet::from([Image::Luks2]),
        &o.cryptblk,
        o.keep_images,
    )?;
    let image = imgs.path(Image::Luks2);
    let key = imgs.key.to_string_lossy().into_owned();
    let base = Sample {
        commit: procfs::commit(),
        machine: procfs::machine(),
        part: "",
        round: 0,
        what: "",
        seconds: None,
        mib_s: None,
        iops: None,
        lat_p99_us: None,
        lat_p999_us: None,
    };
    let mut offline: Vec<Sample> = Vec::new();
    for round in 1..=o.rounds {
        for k in 0..OFFLINE.len() {
            let what = OFFLINE[(k + round as usize) % OFFLINE.len()];
            procfs::drop_caches(&[&image])?;
            let seconds = timed(&mut offline_command(what, o, &image, &key))?;
            // Every job passes over the whole file (dd over the header too: 16 MiB of GiBs).
            let mib = std::fs::metadata(&image)?.len() as f64 / (1 << 20) as f64;
            eprintln!(
                "  round {round} {what}: {seconds:.2} s, {:.0} MiB/s",
                mib / seconds
            );
            let s = Sample {
                part: "offline",
                round,
                what,
                seconds: Some(seconds),
                mib_s: Some(mib / seconds),
                ..clone_base(&base)
            };
            crate::record::append(&o.results, &s)?;
            offline.push(s);
        }
    }
    let mut online: Vec<Sample> = Vec::new();
    for round in 1..=o.rounds {
        let order = if round % 2 == 1 {
            ["without", "during"]
        } else {
            ["during", "without"]
        };
        let work = o.dir.join("reencrypt-online");
        let (server, socket, ctl) = serve_online(o, &image, &work, Some(&key))?;
        for what in order {
            procfs::drop_caches(&[&image])?;
            if what == "during" {
                ctl_call(
                    &o.cryptblk,
                    &ctl,
                    &[
                        "reencrypt-start",
                        "vol",
                        "--key-file",
                        &key,
                        "--pbkdf",
                        "pbkdf2",
                        "--iter-time",
                        "10",
                    ],
                )?;
            }
            let m = clients::vu_bench(
                &o.vu_bench,
                &socket,
                online_workload,
                o.runtime,
                o.size,
                server.pid(),
                false,
            )?;
            if what == "during" {
                ctl_call(&o.cryptblk, &ctl, &["reencrypt-pause", "vol"])?;
                wait_paused(&o.cryptblk, &ctl)?;
            }
            eprintln!(
                "  round {round} online {what}: {:.0} IOPS, p99 {:.0} µs",
                m.iops.unwrap_or(0.0),
                m.lat_p99_us.unwrap_or(0.0)
            );
            let s = Sample {
                part: "online",
                round,
                what,
                iops: m.iops,
                lat_p99_us: m.lat_p99_us,
                lat_p999_us: m.lat_p999_us,
                ..clone_base(&base)
            };
            crate::record::append(&o.results, &s)?;
            online.push(s);
        }
        server.stop()?;
    }
    // Leave a whole image behind, not one paused mid-way.
    eprintln!("+ finishing the paused reencryption");
    timed(
        Command::new(&o.cryptblk)
            .args(["reencrypt", "--resume-only", "--key-file", &key])
            .arg(&image),
    )?;
    print!("{}", summary(&offline, &online));
    Ok(())
}

fn clone_base(b: &Sample) -> Sample {
    Sample {
        commit: b.commit.clone(),
        machine: b.machine.clone(),
        ..*b
    }
}

fn offline_command(what: &str, o: &Options, image: &Path, key: &str) -> Command {
    let mut cmd;
    match what {
        "cryptsetup" => {
            cmd = Command::new("cryptsetup");
            cmd.args(["reencrypt", "--force-offline-reencrypt", "--batch-mode"])
                .args(["--key-file", key, "--resilience", "checksum"])
                .args(["--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"])
                .arg(image);
        }
        "cryptblk" => {
            cmd = Command::new(&o.cryptblk);
            cmd.args(["reencrypt", "--key-file", key, "--resilience", "checksum"])
                .args(["--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"])
                .arg(image);
        }
        _ => {
            // The payload and the header alike: every byte read and written back in place.
            cmd = Command::new("dd");
            cmd.arg(format!("if={}", image.display()))
                .arg(format!("of={}", image.display()))
                .args([
                    "bs=16M",
                    "iflag=direct",
                    "oflag=direct",
                    "conv=notrunc,fdatasync",
                ])
                .arg("status=none");
        }
    }
    cmd
}

fn timed(cmd: &mut Command) -> Result<f64> {
    clients::show(cmd);
    let start = Instant::now();
    let out = cmd.output().context("running the job")?;
    if !out.status.success() {
        bail!(
            "{} failed ({}): {}",
            cmd.get_program().to_string_lossy(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(start.elapsed().as_secs_f64())
}

/// `image` served as disk "vol" over vhost-user-blk (`cache=none`) with a control socket,
/// for the online measurements; its sockets and log go in `work`. Returns the server and its
/// vhost-user and control sockets.
pub(crate) fn serve_online(
    o: &Options,
    image: &Path,
    work: &Path,
    key: Option<&str>,
) -> Result<(peers::Running, PathBuf, PathBuf)> {
    std::fs::create_dir_all(work)?;
    let socket = work.join("vu.sock");
    let ctl = work.join("ctl.sock");
    let mut serve = Command::new(&o.cryptblk);
    serve
        .args([
            "serve",
            "--name",
            "vol",
            "--cache",
            "none",
            "--unsealed-memory",
        ])
        .args(["--queue-size", "1024"])
        .arg("--image")
        .arg(image)
        .arg("--vhost-user-blk")
        .arg(&socket)
        .arg("--control")
        .arg(&ctl);
    if let Some(key) = key {
        serve.args(["--key-file", key]);
    }
    let server = peers::start(
        serve,
        &socket,
        &work.join("serve.log"),
        crate::config::Transport::Vhost,
        o.size,
    )?;
    Ok((server, socket, ctl))
}

pub(crate) fn ctl_call(cryptblk: &Path, ctl: &Path, args: &[&str]) -> Result<()> {
    let mut cmd = Command::new(cryptblk);
    cmd.arg("ctl").arg("--socket").arg(ctl).args(args);
    timed(&mut cmd).map(drop)
}

/// Waits (up to 30 s) until the reencryption is no longer running: a pause takes effect once
/// the current hotzone commits.
pub(crate) fn wait_paused(cryptblk: &Path, ctl: &Path) -> Result<()> {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(30) {
        let out = Command::new(cryptblk)
            .arg("ctl")
            .arg("--socket")
            .arg(ctl)
            .args(["reencrypt-status", "vol"])
            .output()?;
        let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        if status["phase"] != "running" {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    bail!("the reencryption was still running 30 s after reencrypt-pause")
}

/// Median and worst round of `num(round) / den(round)` over the rounds that have both.
pub(crate) fn ratio(
    samples: &[Sample],
    part: &str,
    f: impl Fn(&Sample) -> Option<f64>,
    num: &str,
    den: &str,
) -> Option<(f64, f64)> {
    let value = |round: u32, what: &str| {
        samples
            .iter()
            .find(|s| s.part == part && s.round == round && s.what == what)
            .and_then(&f)
    };
    let mut r: Vec<f64> = samples
        .iter()
        .map(|s| s.round)
        .collect::<BTreeSet<_>>()
        .into_iter()
        .filter_map(|round| Some(value(round, num)? / value(round, den)?))
        .collect();
    r.sort_by(f64::total_cmp);
    Some((crate::stats::median(&r)?, *r.first()?))
}

fn summary(offline: &[Sample], online: &[Sample]) -> String {
    let show =
        |r: Option<(f64, f64)>| r.map_or("n/a".into(), |(m, w)| format!("{m:.2} (worst {w:.2})"));
    let mut out = String::from("| job | median s | median MiB/s |\n|---|---:|---:|\n");
    for what in OFFLINE {
        let mut secs: Vec<f64> = offline
            .iter()
            .filter(|s| s.what == what)
            .filter_map(|s| s.seconds)
            .collect();
        let mut mibs: Vec<f64> = offline
            .iter()
            .filter(|s| s.what == what)
            .filter_map(|s| s.mib_s)
            .collect();
        secs.sort_by(f64::total_cmp);
        mibs.sort_by(f64::total_cmp);
        out += &format!(
            "| {what} | {:.2} | {:.0} |\n",
            crate::stats::median(&secs).unwrap_or(f64::NAN),
            crate::stats::median(&mibs).unwrap_or(f64::NAN)
        );
    }
    // Speed ratios: time of the other over cryptblk's.
    out += &format!(
        "\n| figure | median of per-round ratios | target |\n|---|---|---|\n\
         | cryptblk / cryptsetup (speed) | {} | >= 3 |\n\
         | cryptblk / in-place copy (speed) | {} | >= 0.8 |\n\
         | 4k randread IOPS during / without a reencryption | {} | >= 0.8 |\n",
        show(ratio(
            offline,
            "offline",
            |s| s.seconds,
            "cryptsetup",
            "cryptblk"
        )),
        show(ratio(offline, "offline", |s| s.seconds, "copy", "cryptblk")),
        show(ratio(online, "online", |s| s.iops, "during", "without")),
    );
    let p99 = |what: &str| {
        let mut v: Vec<f64> = online
            .iter()
            .filter(|s| s.what == what)
            .filter_map(|s| s.lat_p99_us)
            .collect();
        v.sort_by(f64::total_cmp);
        crate::stats::median(&v)
    };
    if let (Some(d), Some(w)) = (p99("during"), p99("without")) {
        out += &format!(
            "| p99 latency during / without (µs) | {d:.0} / {w:.0}: +{:.0} | |\n",
            d - w
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(part: &'static str, round: u32, what: &'static str, v: f64) -> Sample {
        Sample {
            commit: "c".into(),
            machine: procfs::machine(),
            part,
            round,
            what,
            seconds: (part == "offline").then_some(v),
            mib_s: None,
            iops: (part == "online").then_some(v),
            lat_p99_us: (part == "online").then_some(v / 100.0),
            lat_p999_us: None,
        }
    }

    #[test]
    fn the_summary_gives_speed_ratios_as_time_over_time_and_the_worst_round() {
        let offline = [
            sample("offline", 1, "cryptsetup", 30.0),
            sample("offline", 1, "cryptblk", 10.0),
            sample("offline", 1, "copy", 8.0),
            sample("offline", 2, "cryptsetup", 20.0),
            sample("offline", 2, "cryptblk", 10.0),
            sample("offline", 2, "copy", 9.0),
        ];
        let online = [
            sample("online", 1, "without", 1000.0),
            sample("online", 1, "during", 900.0),
            sample("online", 2, "without", 1000.0),
            sample("online", 2, "during", 700.0),
        ];
        let text = summary(&offline, &online);
        // cryptsetup took 3x and 2x as long: cryptblk is 2.5x as fast, worst round 2x.
        assert!(
            text.contains("| cryptblk / cryptsetup (speed) | 2.50 (worst 2.00) |"),
            "{text}"
        );
        assert!(
            text.contains("| cryptblk / in-place copy (speed) | 0.85 (worst 0.80) |"),
            "{text}"
        );
        assert!(text.contains("| 0.80 (worst 0.70) | >= 0.8 |"), "{text}");
    }
}
