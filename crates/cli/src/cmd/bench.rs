use crate::args::{BenchArgs, Cli};
use anyhow::Result;
use cryptblk_crypto::bench::{run_bench, BenchOptions};

pub fn run(cli: &Cli, args: &BenchArgs) -> Result<()> {
    if !(0.01..=60.0).contains(&args.seconds) {
        return Err(crate::exit::UsageError("--seconds must be between 0.01 and 60".into()).into());
    }
    let opts = BenchOptions {
        seconds_per_cell: args.seconds,
        threads: Some(crate::options::pool_threads(cli)?),
        ..BenchOptions::default()
    };
    let report = run_bench(&opts);
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{report}");
    }
    Ok(())
}
