//! `cargo run --release -p cryptblk-crypto --example bench [-- [--json] [--engine NAME]... [seconds-per-cell]]`
//! Prints the engine throughput table (or JSON) for this machine.

use cryptblk_crypto::bench::{run_bench, BenchOptions};

fn main() {
    let mut opts = BenchOptions::default();
    let mut json = false;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        if arg == "--engine" {
            let Some(name) = args.next() else {
                eprintln!("--engine needs a name (openssl, rustcrypto)");
                std::process::exit(2);
            };
            opts.engines.get_or_insert_with(Vec::new).push(name);
        } else if arg == "--json" {
            json = true;
        } else if let Ok(secs) = arg.parse::<f64>() {
            opts.seconds_per_cell = secs;
        } else {
            eprintln!("usage: bench [--json] [--engine NAME]... [seconds-per-cell]");
            std::process::exit(2);
        }
    }
    let report = run_bench(&opts);
    if json {
        match serde_json::to_string_pretty(&report) {
            Ok(s) => println!("{s}"),
            Err(e) => {
                eprintln!("cannot serialise report: {e}");
                std::process::exit(1);
            }
        }
    } else {
        print!("{report}");
    }
}
