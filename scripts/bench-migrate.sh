#!/usr/bin/env bash
# Benchmark (not a test): on-demand read latency on a migration destination during postcopy,
# the disk version of the table in QEMU's postcopy-preempt series, plus total time and
# downtime of a precopy migration of a bigger disk. Runs
# crates/migration/examples/postcopy_latency.rs (one process per configuration, source and
# destination in it, loopback TCP, raw images).
#
# Latency: a SIZE raw disk of non-zero data migrates over a link limited to 1 Gbit/s
# (SourceOptions.max_bandwidth = 125000000; one link model shared by both channels, bulk data
# sent in 16 KiB slices), switches over to postcopy at once, and a reader on the destination
# reads random 4 KiB blocks one at a time (every INTERVAL ms, for DURATION s) while the bulk
# stream is still running. Only reads that had to wait for their block count (the
# destination's IncomingStatus.latency histogram). For bulk chunks of 64 KiB, 2 MiB, 64 MiB:
#
#   (a) postcopy without preempt: the answer to an urgent request shares the bulk channel and
#       goes out after the chunk being sent;
#   (b) preempt without breaking chunks: own channel, but still after the whole chunk;
#   (c) full preempt: own channel, between two 16 KiB slices (frames) of the chunk (and
#       between the 256 KiB pieces it is read in).
#
# Reading the ratio: "avg a/c" is how many times faster an on-demand read is with full preempt
# than without; the target is >= 10x at every chunk size with (c)'s p99 under 2 ms. At 64 KiB
# chunks the ratio is small by construction: a chunk is then only four slices (0.5 ms at
# 1 Gbit/s), so (a) waits little more than (c) does. (a) and (b) grow with the chunk size
# (a 64 MiB chunk is 0.54 s on the link); (c) should not.
#
# Big run: precopy migration of BIG_SIZE (default 4G) with one random 4 KiB write per ms on the
# source until the first sweep is done and < 8 MiB is dirty, then switchover(false); total
# time, downtime (SourceStatus.downtime: fence to destination complete), bytes sent, passes.
# Link: BIG_BANDWIDTH bytes/s (default 125000000, i.e. 1 Gbit/s; 'none' for uncapped).
#
# Usage: scripts/bench-migrate.sh [JSON_OUT]   (table on stdout; one JSON object per
# configuration in JSON_OUT if given)
# LINK=proxy models the link with a shaping proxy instead (fair queueing between the two
# connections; the sender's socket buffers fill as on a real network).
# Environment: LINK (pacer), SIZE (default 2G), DURATION (8), INTERVAL (5), BIG_SIZE (4G),
# BIG_BANDWIDTH (125000000), BENCH_DIR (default ${TMPDIR:-/tmp}; avoid tmpfs such as /dev/shm:
# lseek(SEEK_HOLE) there scans every page up to the next hole, ~10 ms per GiB, once per bulk
# chunk), POSTCOPY_LATENCY (prebuilt example binary; default: cargo build --release).
# Takes about 3 minutes with the defaults; needs room for SIZE + 2 * BIG_SIZE in BENCH_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/bench-lib.sh
source scripts/bench-lib.sh

SIZE=${SIZE:-2G}
DURATION=${DURATION:-8}
INTERVAL=${INTERVAL:-5}
BIG_SIZE=${BIG_SIZE:-4G}
BIG_BANDWIDTH=${BIG_BANDWIDTH:-125000000}
JSON_OUT=${1:-}
need numfmt coreutils
SIZE_BYTES=$(bytes "$SIZE")
BIG_BYTES=$(bytes "$BIG_SIZE")
(( SIZE_BYTES % 4096 == 0 && BIG_BYTES % 4096 == 0 )) || die "sizes must be multiples of 4 KiB"

if [[ -n ${POSTCOPY_LATENCY:-} ]]; then
    BIN=$POSTCOPY_LATENCY
else
    need cargo
    log "+ cargo build --release -p cryptblk-migration --example postcopy_latency"
    cargo build --release -p cryptblk-migration --example postcopy_latency
    BIN=${CARGO_TARGET_DIR:-target}/release/examples/postcopy_latency
fi
[[ -x $BIN ]] || die "postcopy_latency binary not found at $BIN"

BENCH_DIR=${BENCH_DIR:-${TMPDIR:-/tmp}}
mkdir -p "$BENCH_DIR"
NEED_KIB=$(( (SIZE_BYTES + 2 * BIG_BYTES + (256 << 20)) / 1024 ))
(( $(df -Pk "$BENCH_DIR" | awk 'NR == 2 { print $4 }') > NEED_KIB )) \
    || die "$BENCH_DIR needs room for $SIZE + 2 x $BIG_SIZE"
[[ $(stat -f -c %T "$BENCH_DIR") == tmpfs ]] \
    && log "bench: warning: $BENCH_DIR is tmpfs; its slow SEEK_HOLE throttles the sender"

args=(--size "$SIZE_BYTES" --duration-secs "$DURATION" --interval-ms "$INTERVAL"
      --big-size "$BIG_BYTES" --big-max-bandwidth "$BIG_BANDWIDTH" --dir "$BENCH_DIR"
      --link "${LINK:-pacer}")
[[ -n $JSON_OUT ]] && args+=(--json-file "$JSON_OUT")
log "+ $BIN ${args[*]}"
echo "# cryptblk migration benchmark, $(date -u +%Y-%m-%dT%H:%M:%SZ), $(nproc) CPUs, $(uname -r)"
"$BIN" "${args[@]}"
[[ -n $JSON_OUT ]] && log "JSON written to $JSON_OUT"
exit 0
