//! `cryptblk-bench reencrypt --encrypt`: a served raw disk encrypted in place
//! (`ctl reencrypt-start --encrypt`). A copy of the raw image is served over vhost-user-blk
//! (`cache=none`); the encryption is started and paused at once (the image is LUKS2 from then
//! on, its first part moved to the end); then, per round in alternating order, vu_bench's 4k
//! random reads at depth 32 run with the encryption paused ("without") and resumed at the
//! default rate ("during"). The ratio of the two is what the guest loses to the work; the p99
//! shows what requests that hit a hotzone wait. One JSON line per measurement.
use crate::config::{Image, Workload};
use crate::reencrypt::{ctl_call, ratio, serve_online, wait_paused, Options, Sample};
use crate::{clients, images, procfs};
use anyhow::{Context, Result};
use std::collections::BTreeSet;

pub fn run(o: &Options, workload: &Workload) -> Result<()> {
    let imgs = images::prepare(
        &o.dir,
        o.size,
        &BTreeSet::from([Image::Raw]),
        &o.cryptblk,
        o.keep_images,
    )?;
    let key = imgs.key.to_string_lossy().into_owned();
    let work = o.dir.join("encrypt-online");
    std::fs::create_dir_all(&work)?;
    let image = work.join("disk.img");
    eprintln!("+ copying the raw image to {}", image.display());
    std::fs::copy(imgs.path(Image::Raw), &image).context("copying the raw image")?;
    let (server, socket, ctl) = serve_online(o, &image, &work, None)?;
    let start = |first: bool| {
        let mut args = vec!["reencrypt-start", "vol", "--key-file", key.as_str()];
        if first {
            args.extend(["--encrypt", "--pbkdf", "pbkdf2", "--iter-time", "10"]);
        }
        ctl_call(&o.cryptblk, &ctl, &args)
    };
    let pause = || {
        ctl_call(&o.cryptblk, &ctl, &["reencrypt-pause", "vol"])?;
        wait_paused(&o.cryptblk, &ctl)
    };
    start(true)?;
    pause()?;
    let base = Sample {
        commit: procfs::commit(),
        machine: procfs::machine(),
        part: "online-encrypt",
        round: 0,
        what: "",
        seconds: None,
        mib_s: None,
        iops: None,
        lat_p99_us: None,
        lat_p999_us: None,
    };
    let mut samples = Vec::new();
    for round in 1..=o.rounds {
        let order = if round % 2 == 1 {
            ["without", "during"]
        } else {
            ["during", "without"]
        };
        for what in order {
            procfs::drop_caches(&[&image])?;
            if what == "during" {
                start(false)?;
            }
            let m = clients::vu_bench(
                &o.vu_bench,
                &socket,
                workload,
                o.runtime,
                o.size,
                server.pid(),
                false,
            )?;
            if what == "during" {
                pause()?;
            }
            eprintln!(
                "  round {round} {what}: {:.0} IOPS, p99 {:.0} µs",
                m.iops.unwrap_or(0.0),
                m.lat_p99_us.unwrap_or(0.0)
            );
            let s = Sample {
                round,
                what,
                iops: m.iops,
                lat_p99_us: m.lat_p99_us,
                lat_p999_us: m.lat_p999_us,
                commit: base.commit.clone(),
                machine: base.machine.clone(),
                ..base
            };
            crate::record::append(&o.results, &s)?;
            samples.push(s);
        }
    }
    server.stop()?;
    if !o.keep_images {
        std::fs::remove_file(&image)?;
    }
    print!("{}", summary(&samples));
    Ok(())
}

fn summary(samples: &[Sample]) -> String {
    let show =
        |r: Option<(f64, f64)>| r.map_or("n/a".into(), |(m, w)| format!("{m:.2} (worst {w:.2})"));
    let p99 = |what: &str| {
        let mut v: Vec<f64> = samples
            .iter()
            .filter(|s| s.what == what)
            .filter_map(|s| s.lat_p99_us)
            .collect();
        v.sort_by(f64::total_cmp);
        crate::stats::median(&v)
    };
    let mut out = format!(
        "| figure | median of per-round ratios (worst round) | target |\n|---|---|---|\n\
         | 4k randread IOPS during / without an encryption in place | {} | >= 0.8 |\n",
        show(ratio(
            samples,
            "online-encrypt",
            |s| s.iops,
            "during",
            "without"
        ))
    );
    if let (Some(d), Some(w)) = (p99("during"), p99("without")) {
        out += &format!(
            "| p99 latency during / without (µs) | {d:.0} / {w:.0}: +{:.0} | |\n",
            d - w
        );
    }
    out
}
