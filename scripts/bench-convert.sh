#!/usr/bin/env bash
# Replaced by `cryptblk-bench convert` (crates/bench/src/convert; docs/benchmarks.md). Arguments go to it, e.g. --size 256M --rounds 1 --parts disk,cipher,tmpfs --cryptblk-before OLD/cryptblk --results FILE.
exec cargo run --release --locked -q --manifest-path "$(dirname "$0")/../Cargo.toml" -p cryptblk-bench -- convert "$@"
