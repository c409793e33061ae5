//! `cryptblk completions SHELL`: a completion script for the shell, generated from the
//! command-line definitions (every command, `ctl` verb and option).
use crate::args::{Cli, CompletionsArgs};
use anyhow::{Context, Result};
use clap::CommandFactory;
use std::io::Write;

pub fn run(args: &CompletionsArgs) -> Result<()> {
    let mut command = Cli::command();
    // clap_complete panics when its writer fails; a script in memory is written with our own
    // error (e.g. `cryptblk completions bash | head` closing the pipe).
    let mut script = Vec::new();
    clap_complete::generate(args.shell, &mut command, "cryptblk", &mut script);
    std::io::stdout()
        .lock()
        .write_all(&script)
        .context("writing the completion script to stdout")
}
