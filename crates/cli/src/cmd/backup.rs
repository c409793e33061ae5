//! `cryptblk backup pull|restore|verify`: the chain library (crates/backup) with progress on
//! stderr, notes and a summary line, and signals that stop a pull durably.
use crate::args::{BackupCommand, BackupPullArgs, BackupRestoreArgs, BackupVerifyArgs};
use crate::convert::interrupt::InterruptFlag;
use crate::convert::progress::Reporter;
use anyhow::Result;
use cryptblk_backup::{EntryKind, PullOptions};
use std::ops::ControlFlow;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

pub fn run(command: &BackupCommand) -> Result<()> {
    match command {
        BackupCommand::Pull(a) => pull(a),
        BackupCommand::Restore(a) => restore(a),
        BackupCommand::Verify(a) => verify(a),
    }
}

/// Calls `show` at most ten times a second.
struct Pace {
    last: Option<Instant>,
}

impl Pace {
    fn due(&mut self) -> bool {
        let now = Instant::now();
        let due = self
            .last
            .is_none_or(|t| now.duration_since(t) >= Duration::from_millis(100));
        if due {
            self.last = Some(now);
        }
        due
    }
}

fn pull(args: &BackupPullArgs) -> Result<()> {
    let options = PullOptions {
        uri: args.uri.clone(),
        dir: args.dir.clone(),
        incremental: args.incremental,
        bitmap: args.bitmap.clone(),
        checkpoint: args.checkpoint.clone(),
        release: !args.no_release,
    };
    let interrupt = InterruptFlag::register()?;
    let mut reporter: Option<Reporter> = None;
    let mut pace = Pace { last: None };
    let mut last_position = 0;
    let report = cryptblk_backup::pull(
        &options,
        |p| {
            let r = reporter.get_or_insert_with(|| Reporter::new(args.progress, p.total));
            last_position = p.position;
            if pace.due() {
                r.show(p.position);
            }
            if interrupt.flag.load(Ordering::Relaxed) {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            }
        },
        |note| eprintln!("cryptblk: note: {note}"),
    );
    if let Some(r) = &reporter {
        r.finish(last_position);
    }
    let report = report?;
    let e = &report.entry;
    let what = match e.kind {
        EntryKind::Full => "full".to_string(),
        EntryKind::Incremental => format!("incremental since {}", e.since.as_deref().unwrap_or("")),
    };
    println!(
        "{}: {what}, {} bytes of data and {} of zeroes of a {}-byte disk, in {}",
        e.checkpoint,
        e.data_bytes,
        e.zero_bytes,
        e.disk_size,
        args.dir.display()
    );
    Ok(())
}

fn restore(args: &BackupRestoreArgs) -> Result<()> {
    let mut reporter: Option<Reporter> = None;
    let mut pace = Pace { last: None };
    let mut last_done = 0;
    let report = cryptblk_backup::restore(
        &args.dir,
        &args.image,
        args.checkpoint.as_deref(),
        |done, total| {
            let r = reporter.get_or_insert_with(|| Reporter::new(args.progress, total));
            last_done = done;
            if pace.due() {
                r.show(done);
            }
        },
    );
    if let Some(r) = &reporter {
        r.finish(last_done);
    }
    let report = report?;
    println!(
        "{}: restored as of checkpoint {} ({} bytes) from {}",
        args.image.display(),
        report.checkpoint,
        report.disk_size,
        report.entries.join(" + ")
    );
    Ok(())
}

fn verify(args: &BackupVerifyArgs) -> Result<()> {
    let checks = cryptblk_backup::verify(&args.dir, |_, _| {})?;
    let mut damaged = Vec::new();
    for c in checks {
        match c.problem {
            None => println!("{}: ok", c.checkpoint),
            Some(e) => {
                println!("{}: DAMAGED: {e}", c.checkpoint);
                damaged.push(e);
            }
        }
    }
    if damaged.is_empty() {
        return Ok(());
    }
    let count = damaged.len();
    let first = anyhow::Error::from(damaged.swap_remove(0));
    if count == 1 {
        return Err(first);
    }
    Err(first.context(format!("{count} damaged entries (listed above); the first")))
}
