//! `cryptblk man`: man pages generated from the command-line definitions, so they cannot drift
//! from `--help`: cryptblk(1) and one page per command and subcommand (cryptblk-serve(1),
//! cryptblk-key-add(1), cryptblk-ctl-disk-add(1), ...).
use crate::args::{Cli, ManArgs};
use anyhow::{Context, Result};
use clap::CommandFactory;

pub fn run(args: &ManArgs) -> Result<()> {
    let command = Cli::command();
    match &args.dir {
        Some(dir) => {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
            clap_mangen::generate_to(command, dir)
                .with_context(|| format!("writing man pages into {}", dir.display()))?;
            eprintln!(
                "man pages written to {} (read one with: man -l {}/cryptblk.1)",
                dir.display(),
                dir.display()
            );
        }
        None => {
            let mut out = std::io::stdout().lock();
            clap_mangen::Man::new(command)
                .render(&mut out)
                .context("writing the man page to stdout")?;
        }
    }
    Ok(())
}
