#!/usr/bin/env bash
# Replaced by `cryptblk-bench read-path` (crates/bench/src/read_path.rs; docs/performance.md "The encrypted path against the plain one"), run as root. Arguments go to it (the old environment variables are options now), e.g. --rounds 1 --runtime 2 --size 512M --workloads randread:4096:32 --queues 2 --dir /var/tmp --old OLD/cryptblk --keep-images.
exec cargo run --release --locked -q --manifest-path "$(dirname "$0")/../Cargo.toml" -p cryptblk-bench -- read-path "$@"
