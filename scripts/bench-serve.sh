#!/usr/bin/env bash
# Replaced by cryptblk-bench (crates/bench, preset 'serve' in crates/bench/presets.toml; docs/benchmarks.md). Arguments go to `cryptblk-bench run`, e.g. --rounds 1 --runtime 2 --size 256M --results FILE.
exec cargo run --release --locked -q --manifest-path "$(dirname "$0")/../Cargo.toml" -p cryptblk-bench -- run --preset serve "$@"
