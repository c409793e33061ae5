#!/usr/bin/env bash
# Replaced by cryptblk-bench (crates/bench; docs/benchmarks.md): the throughput part is preset 'rbd' (arguments go to `cryptblk-bench run`, e.g. --rounds 1 --runtime 2), the shared-storage hand-off part is `cryptblk-bench handoff` (HANDOFF_ROUNDS idle and loaded hand-offs, default 5; 0 skips it).
set -euo pipefail
bench() { cargo run --release --locked -q --manifest-path "$(dirname "$0")/../Cargo.toml" -p cryptblk-bench -- "$@"; }
bench run --preset rbd "$@"
[[ ${HANDOFF_ROUNDS:-5} == 0 ]] || bench handoff --rounds "${HANDOFF_ROUNDS:-5}"
