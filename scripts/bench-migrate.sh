#!/usr/bin/env bash
# Replaced by `cryptblk-bench migrate` (crates/bench/src/migrate.rs; docs/performance.md "Live migration"). Arguments go to it (the old environment variables are options now), e.g. --link proxy --size 2G --duration 8 --big-size 4G --results out.jsonl.
exec cargo run --release --locked -q --manifest-path "$(dirname "$0")/../Cargo.toml" -p cryptblk-bench -- migrate "$@"
