#!/usr/bin/env bash
# Replaced by `cryptblk-bench control` (crates/bench/src/control; docs/benchmarks.md). Arguments go to it, e.g. --rounds 1 --runtime 2 --loops 4 --size 256M --results FILE.
exec cargo run --release --locked -q --manifest-path "$(dirname "$0")/../Cargo.toml" -p cryptblk-bench -- control "$@"
