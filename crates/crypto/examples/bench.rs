//! `cargo run --release -p cryptblk-crypto --example bench [-- --json] [seconds-per-cell]`
//! Prints the engine throughput table (or JSON) for this machine.

use cryptblk_crypto::bench::{run_bench, BenchOptions};

fn main() {
    let mut opts = BenchOptions::default();
    let mut json = false;
    for arg in std::env::args().skip(1) {
        if arg == "--json" {
            json = true;
        } else if let Ok(secs) = arg.parse::<f64>() {
            opts.seconds_per_cell = secs;
        } else {
            eprintln!("usage: bench [--json] [seconds-per-cell]");
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
