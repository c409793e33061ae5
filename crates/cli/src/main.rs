//! `cryptblk`: the command-line edge. Libraries return typed errors; here they become one clear
//! line on stderr and a documented exit status.
mod args;
mod cmd;
mod convert;
mod exit;
mod help;
mod options;
mod rbd;
mod secrets;
mod size;

use args::{Cli, Command};
use clap::Parser;

fn main() {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            let code = if e.use_stderr() {
                exit::USAGE
            } else {
                exit::SUCCESS
            };
            std::process::exit(code);
        }
    };
    init_logging(&cli.command);
    if let Err(err) = cryptblk_crypto::force_engine(cli.crypto_engine.as_deref()) {
        // A name clap accepted but this build lacks (vaes off x86-64).
        eprintln!("cryptblk: --crypto-engine: {err}");
        std::process::exit(exit::USAGE);
    }

    let result = match cli.command {
        Command::Format(ref a) => cmd::format::run(&cli, a),
        Command::Dump(ref a) => cmd::dump::run(a),
        Command::Key(ref k) => cmd::key::run(&cli, k),
        Command::Convert(ref a) => convert::run(&cli, a),
        Command::Reencrypt(ref a) => cmd::reencrypt::run(&cli, a),
        Command::Resize(ref a) => cmd::resize::run(a),
        Command::ConvertHeader(ref a) => cmd::convert_header::run(a),
        Command::Backup(ref a) => cmd::backup::run(a),
        Command::Bench(ref a) => cmd::bench::run(&cli, a),
        Command::Demo(ref a) => cmd::demo::run(&cli, a),
        Command::Serve(ref a) => cmd::serve::run(&cli, a),
        Command::Ctl(ref a) => cmd::ctl::run(a),
        Command::Completions(ref a) => cmd::completions::run(a),
        Command::Man(ref a) => cmd::man::run(a),
    };
    if let Err(err) = result {
        eprintln!("cryptblk: {}", exit::one_line(&err));
        std::process::exit(exit::code_for(&err));
    }
}

/// Log lines go to stderr. The daemon (`serve`) reports what it serves at `info`; the other
/// commands only warn. `RUST_LOG` overrides either; `serve --log-format json` writes one JSON
/// object per line for log shippers.
fn init_logging(command: &Command) {
    let (default_level, json) = match command {
        Command::Serve(a) => ("info", a.log_format == args::LogFormat::Json),
        _ => ("warn", false),
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| default_level.into());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false);
    if json {
        builder.json().flatten_event(true).init();
    } else {
        builder.init();
    }
}
