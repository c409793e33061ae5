//! cryptblk-bench: the benchmark harness (not a test). Every experiment is an entry of the
//! table in `presets.toml`; the engine runs it in interleaved rounds and appends one sample
//! per measurement to a results file; `report` renders markdown tables, SVG charts and the
//! target checks from such files and compares two of them.
mod ceiling;
mod chart;
mod checkpoint;
mod clients;
mod command;
mod config;
mod control;
mod convert;
mod docs;
mod engine;
mod engine_cpu;
mod figure;
mod fio;
mod handoff;
mod images;
mod matrix;
mod metric;
mod migrate;
mod peers;
mod plan;
mod procfs;
mod rbd;
mod read_path;
mod reencrypt;
mod report;
mod sample;
mod soak;
mod spdk;
mod summary;
mod wait;
mod workdir;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use config::Config;
use std::path::{Path, PathBuf};
use std::process::Command;

#[derive(Parser)]
#[command(
    name = "cryptblk-bench",
    version,
    about = "cryptblk's benchmark harness: interleaved rounds of every peer, transport and workload of a preset; JSON records; tables and charts"
)]
struct Cli {
    /// The matrix (peers, workloads, presets) to use instead of the built-in presets.toml.
    #[arg(long, global = true)]
    config: Option<PathBuf>,
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Measures a preset; appends one JSON line per measurement to the results file.
    Run(matrix::Args),
    /// Markdown tables (and with --charts, SVG charts) from one or more results files.
    Report {
        #[arg(required_unless_present = "docs")]
        results: Vec<PathBuf>,
        /// Render the tables of this markdown page again from the records its markers name
        /// (`<!-- cryptblk-bench report [--targets] FILE... -->`), in place.
        #[arg(long, value_name = "PAGE", conflicts_with_all = ["results", "compare", "charts", "targets"])]
        docs: Option<PathBuf>,
        /// Write SVG charts (IOPS and server CPU per I/O, per preset and transport) here.
        #[arg(long)]
        charts: Option<PathBuf>,
        /// Print new/old ratios per row against this older results file instead.
        #[arg(long, value_name = "OLD.jsonl")]
        compare: Option<PathBuf>,
        /// Check the speed targets instead: each target on each row it names, its median
        /// and worst round against the limit, and by how much a missed one misses.
        #[arg(long, conflicts_with_all = ["compare", "charts"])]
        targets: bool,
        /// With --targets: one JSON object per line instead of a table.
        #[arg(long, requires = "targets")]
        json: bool,
    },
    /// The presets, their peers, transports and workloads.
    List,
    /// A LUKS2 image's volume key replaced: offline against `cryptsetup reencrypt` and an
    /// in-place copy, and online, the 4k random-read IOPS and p99 of a served disk during a
    /// reencryption against without (as root: the page cache is dropped before every job).
    Reencrypt(reencrypt::Args),
    /// Shared-storage hand-offs of a LUKS2 RBD disk between two daemons (`migrate-start
    /// --shared`), idle and under a 4k write load, on a throwaway Ceph cluster: each
    /// hand-off's downtime, one JSON line per hand-off, and a summary against the targets.
    Handoff(handoff::Args),
    /// `cryptblk convert` against `qemu-img convert` (raw -> LUKS and raw -> raw on disk,
    /// raw -> LUKS on tmpfs against cp), single-thread AES-XTS against openssl, peak RSS.
    Convert(convert::Args),
    /// The control socket under churn: fio's 4k random reads alone, beside loops of `ctl`
    /// disk-add/disk-list/stats/disk-remove, beside bare process starts; the round trips.
    Control(control::Args),
    /// The encrypted path against the plain one on a real disk: fio on each file, the
    /// encryptor's ceiling, cryptblk serving the raw twin and the LUKS2 image (and an older
    /// binary); one JSON line per run, ratios per workload (as root).
    ReadPath(read_path::Args),
    /// Postcopy on-demand read latency and a precopy migration, one run of
    /// crates/migration/examples/postcopy_latency per configuration; one JSON line each.
    Migrate(migrate::Args),
    /// Two sector-crypto engines against each other in this process, in interleaved rounds,
    /// per CPU-second of the measuring thread (a shared machine's load changes wall-clock
    /// figures, far less the thread's own CPU time).
    EngineCpu(engine_cpu::Args),
    /// One daemon serving many disks for a long while: clients arriving and leaving with
    /// verified data, upgrades, kills and attach/detach churn; RSS, threads and descriptors
    /// every second (JSON records, an SVG chart, a summary; non-zero exit past a tolerance).
    Soak(soak::Args),
    /// The device's ceiling for an encryptor: O_DIRECT reads with io_uring on one thread, each
    /// completed buffer left alone, read once, or decrypted in place before the next read
    /// into it (JSON on stdout).
    Ceiling(ceiling::Args),
}

fn main() {
    if let Err(e) = run() {
        eprintln!("cryptblk-bench: {e:#}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let cli = Cli::parse();
    let config = Config::load(cli.config.as_deref())?;
    match cli.command {
        Cmd::Ceiling(a) => ceiling::main(&a),
        Cmd::Convert(args) => {
            let cryptblk = cryptblk_binary(args.cryptblk.clone())?;
            let samples = convert::run(&args.options(cryptblk)?, &config)?;
            summarize(&config, &samples)
        }
        Cmd::Control(args) => {
            let cryptblk = cryptblk_binary(args.cryptblk.clone())?;
            let workload = *config.workload("rr4k-d32-q1")?;
            let samples = control::run(&args.options(cryptblk)?, &config, &workload)?;
            summarize(&config, &samples)
        }
        Cmd::ReadPath(mut a) => {
            let (cryptblk, vu_bench) = binaries(a.cryptblk.take(), a.vu_bench.take())?;
            let samples = read_path::run(&a, &config, cryptblk, vu_bench)?;
            summarize(&config, &samples)
        }
        Cmd::Migrate(a) => summarize(&config, &migrate::run(&a, &config)?),
        Cmd::EngineCpu(a) => summarize(&config, &engine_cpu::run(&a, &config)?),
        Cmd::Soak(a) => match &a.from {
            Some(results) => soak::report_again(&a, results),
            None => soak::run(&a, &cryptblk_binary(a.cryptblk.clone())?),
        },
        Cmd::Handoff(mut a) => {
            let cryptblk = cryptblk_binary(a.cryptblk.take())?;
            summarize(&config, &handoff::run(&a, &cryptblk, &config)?)
        }
        Cmd::Reencrypt(mut a) => {
            let (cryptblk, vu_bench) = binaries(a.cryptblk.take(), a.vu_bench.take())?;
            let workload = *config.workload("rr4k-d32-q1")?;
            let samples = reencrypt::run(&a, (&cryptblk, &vu_bench), &config, &workload)?;
            summarize(&config, &samples)
        }
        Cmd::List => {
            for (name, p) in &config.presets {
                println!("{name}: {}", p.description);
                if p.driver != config::Driver::Matrix {
                    println!(
                        "  `cryptblk-bench {}`: arms {}; workloads {}; {} round(s)",
                        p.driver.command(),
                        p.peers.join(" "),
                        p.workloads.join(" "),
                        p.rounds
                    );
                    continue;
                }
                println!(
                    "  peers {} (ceiling {}), transports {}, {} round(s) of {} s, storage {:?} {} {}",
                    p.peers.join(" "),
                    p.ceiling,
                    p.transports.iter().map(|t| t.name()).collect::<Vec<_>>().join(" "),
                    p.rounds,
                    p.runtime,
                    p.storage.kind,
                    p.storage.dir.as_deref().unwrap_or("-"),
                    p.storage.size
                );
                for w in &p.workloads {
                    println!("  {w}: {}", config.workload(w)?.describe());
                }
            }
            Ok(())
        }
        Cmd::Run(mut a) => {
            let table = config.preset(&a.preset)?;
            if table.driver != config::Driver::Matrix {
                bail!(
                    "preset '{}' is run by `cryptblk-bench {}` (with its own options)",
                    a.preset,
                    table.driver.command()
                );
            }
            let mut chosen = table.narrowed(
                a.peers.as_deref(),
                a.transports.as_deref(),
                a.workloads.as_deref(),
            )?;
            let mut config = config;
            if a.baseline.is_some() {
                config.add_baseline(&mut chosen);
            }
            let (cryptblk, vu_bench) = binaries(a.cryptblk.take(), a.vu_bench.take())?;
            let samples = matrix::run(&config, &chosen, &a, &cryptblk, &vu_bench)?;
            // The tables of this run; `report` renders any set of result files.
            summarize(&config, &samples)
        }
        Cmd::Report {
            docs: Some(page), ..
        } => {
            let text = std::fs::read_to_string(&page)
                .with_context(|| format!("reading {}", page.display()))?;
            let root = page
                .canonicalize()
                .with_context(|| format!("{}", page.display()))?
                .parent()
                .and_then(Path::parent)
                .map(Path::to_path_buf)
                .context("the page has no directory above its own")?;
            let rendered = docs::render_page(&text, &|b| render_block(&config, &root, b))
                .with_context(|| format!("in {}", page.display()))?;
            if rendered == text {
                eprintln!("{}: up to date", page.display());
            } else {
                std::fs::write(&page, rendered)
                    .with_context(|| format!("writing {}", page.display()))?;
                eprintln!("{}: tables rendered again", page.display());
            }
            Ok(())
        }
        Cmd::Report {
            results,
            charts,
            compare,
            targets,
            json,
            docs: None,
        } => {
            let mut samples = Vec::new();
            for path in &results {
                samples.extend(sample::load(path)?);
            }
            if samples.is_empty() {
                bail!(
                    "no samples in {}",
                    results
                        .iter()
                        .map(|p| p.display().to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                );
            }
            if targets {
                let verdicts = summary::verdicts(&samples, &config.targets);
                if json {
                    for v in &verdicts {
                        println!("{}", serde_json::to_string(v)?);
                    }
                } else {
                    print!("{}", report::targets(&verdicts));
                }
                return Ok(());
            }
            if let Some(old) = compare {
                print!(
                    "{}",
                    report::compare(&config, &sample::load(&old)?, &samples)
                );
                return Ok(());
            }
            print!("{}", report::markdown(&config, &samples));
            if let Some(dir) = charts {
                let rows = summary::rows(&samples, false);
                let rows: Vec<&summary::Row> = rows.iter().map(|(_, r)| r).collect();
                for file in chart::write_all(&rows, &dir)? {
                    eprintln!("wrote {}", file.display());
                }
            }
            Ok(())
        }
    }
}

/// What a run prints: the tables of its samples and the targets they meet or miss.
fn summarize(config: &Config, samples: &[sample::Sample]) -> Result<()> {
    print!("{}", report::markdown(config, samples));
    let verdicts = summary::verdicts(samples, &config.targets);
    if !verdicts.is_empty() {
        print!("\n{}", report::targets(&verdicts));
    }
    Ok(())
}

/// One block of a `--docs` page: what `report [--targets] FILE...` prints for its files
/// (relative to `root`), headings moved down to sit under the page's own.
fn render_block(config: &Config, root: &Path, block: &docs::Block) -> Result<String> {
    let mut samples = Vec::new();
    for file in &block.files {
        samples.extend(sample::load(&root.join(file))?);
    }
    if block.targets {
        return Ok(report::targets(&summary::verdicts(
            &samples,
            &config.targets,
        )));
    }
    Ok(docs::demote_headings(&report::markdown(config, &samples)))
}

/// The cryptblk binary named, or a release build of it (and vu_bench) from this workspace.
fn cryptblk_binary(cryptblk: Option<PathBuf>) -> Result<PathBuf> {
    match cryptblk {
        Some(c) => Ok(c),
        None => Ok(binaries(None, None)?.0),
    }
}

/// `cargo build --release ARGS` in this workspace; the directory the binaries are in.
fn release_build(args: &[&str]) -> Result<PathBuf> {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut cmd = Command::new("cargo");
    cmd.current_dir(&workspace)
        .args(["build", "--release"])
        .args(args);
    crate::command::show(&cmd);
    if !cmd.status().context("running cargo")?.success() {
        bail!("cargo build --release {} failed", args.join(" "));
    }
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map_or_else(|| workspace.join("target"), PathBuf::from);
    Ok(target.join("release"))
}

/// The binaries named, or a release build of both from this workspace.
fn binaries(cryptblk: Option<PathBuf>, vu_bench: Option<PathBuf>) -> Result<(PathBuf, PathBuf)> {
    if let (Some(c), Some(v)) = (&cryptblk, &vu_bench) {
        return Ok((c.clone(), v.clone()));
    }
    let release = release_build(&[
        "-p",
        "cryptblk",
        "-p",
        "cryptblk-vhost-user-blk",
        "--bin",
        "cryptblk",
        "--example",
        "vu_bench",
    ])?;
    Ok((
        cryptblk.unwrap_or_else(|| release.join("cryptblk")),
        vu_bench.unwrap_or_else(|| release.join("examples/vu_bench")),
    ))
}
