//! Running a tool to its end: the command line shown first (so that every figure can be
//! reproduced by hand), its stdout, or an error that names the command, its exit status and
//! what it wrote to stderr.
use anyhow::{bail, Context, Result};
use std::process::Command;

/// Prints a command line before it runs, so every figure can be reproduced by hand.
pub fn show(cmd: &Command) {
    eprintln!("+ {}", command_line(cmd));
}

/// `cmd` as one line: the program and its arguments, space-separated.
pub fn command_line(cmd: &Command) -> String {
    let args: Vec<String> = cmd
        .get_args()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    format!("{} {}", cmd.get_program().to_string_lossy(), args.join(" "))
}

/// Runs `cmd` to its end, shown first; its stdout, or an error with its command line, exit
/// status and stderr.
pub fn output(cmd: &mut Command) -> Result<String> {
    show(cmd);
    quiet_output(cmd)
}

/// [`output`] without showing the command (one of many alike, or one timed).
pub fn quiet_output(cmd: &mut Command) -> Result<String> {
    let out = cmd
        .output()
        .with_context(|| format!("running {}", cmd.get_program().to_string_lossy()))?;
    if !out.status.success() {
        bail!(
            "{} failed ({}): {}",
            command_line(cmd),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// [`output`] for a set-up step, whose stdout nobody reads.
pub fn run(cmd: &mut Command) -> Result<()> {
    output(cmd).map(drop)
}
