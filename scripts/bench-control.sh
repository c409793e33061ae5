#!/usr/bin/env bash
# Benchmark (not a test): the control plane of `cryptblk serve --control` and what it costs the
# data path. One daemon serves a raw image "steady" over NBD and listens on a control socket:
#
#   (1) quiet: fio --ioengine=nbd 4k randread, iodepth 32, numjobs 1 on "steady" for RUNTIME s;
#   (2) churn: the same fio run while N parallel loops each repeat, back to back,
#         cryptblk ctl -s CTL disk-add dK --image IMG_K --nbd-export
#         cryptblk ctl -s CTL disk-list
#         cryptblk ctl -s CTL stats
#         cryptblk ctl -s CTL disk-remove dK
#       on their own small raw image; every completed (exit 0) command counts as one control op,
#       control ops/s = ops / wall time of the loops (they stop when fio ends and finish the
#       command in progress); failed commands are counted and reported separately;
#   (2b) spawn: the same fio run while N loops only start the binary (`cryptblk --version`, no
#       daemon involved) back to back: the share of the churn's cost that is just process starts
#       competing with fio and the daemon for the CPUs;
#   (3) the round trip of one `cryptblk ctl stats` (a new process each time, as an operator or
#       a management tool runs it), median of 50, next to the cost of starting the binary at all
#       (`cryptblk --version`) and, with python3, the JSON-RPC round trip of "stats" on one open
#       connection (no process start).
# Quiet, churn and spawn runs alternate over ROUNDS rounds; the tables show medians. Daemon CPU% is
# its utime+stime delta (/proc/PID/stat) over the run's wall time (100% = one core).
#
# Environment: RUNTIME (seconds per fio run, default 10), N (churn loops, 4), ROUNDS (3),
# SIZE (steady image, 1G), SMALL (churn images, 16M), BENCH_DIR (default /dev/shm if it has
# room, else ${TMPDIR:-/tmp}), CRYPTBLK (a prebuilt binary; default: cargo build --release).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/bench-lib.sh
source scripts/bench-lib.sh

RUNTIME=${RUNTIME:-10}
N=${N:-4}
ROUNDS=${ROUNDS:-3}
SIZE=${SIZE:-1G}
SMALL=${SMALL:-16M}
SIZE_BYTES=$(bytes "$SIZE")
SMALL_BYTES=$(bytes "$SMALL")
(( SIZE_BYTES % 4096 == 0 && SMALL_BYTES % 4096 == 0 )) || die "SIZE and SMALL must be multiples of 4096 bytes"

need fio
need nbdinfo libnbd-bin
need openssl
need numfmt coreutils
need jq
need awk gawk
fio --enghelp=nbd >/dev/null 2>&1 || die "this fio has no nbd ioengine (Debian's fio 3.33 has it)"

cryptblk_bin
BIN_ORIG=$BIN

NEED_KIB=$(( (SIZE_BYTES + SMALL_BYTES * N + (64 << 20)) / 1024 ))
if [[ -z ${BENCH_DIR:-} ]]; then
    BENCH_DIR=${TMPDIR:-/tmp}
    if [[ -d /dev/shm ]] && (( $(df -Pk /dev/shm | awk 'NR == 2 { print $4 }') > NEED_KIB )); then
        BENCH_DIR=/dev/shm
    fi
fi
mkdir -p "$BENCH_DIR"
# The daemon takes absolute paths only.
BENCH_WORK=$(cd "$(mktemp -d "$BENCH_DIR/cryptblk-bench-control.XXXXXX")" && pwd -P)
export BENCH_WORK
(( $(df -Pk "$BENCH_WORK" | awk 'NR == 2 { print $4 }') > NEED_KIB )) \
    || die "$BENCH_WORK needs room for the $SIZE image and $N $SMALL images"

DAEMON=
LOOP_PIDS=()
cleanup() {
    local pid
    touch "$BENCH_WORK/stop" 2>/dev/null || true
    for pid in "${LOOP_PIDS[@]}"; do
        kill "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
    [[ -n $DAEMON ]] && kill "$DAEMON" 2>/dev/null && wait "$DAEMON" 2>/dev/null
    rm -rf "$BENCH_WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
# Work on a private copy: other builds in this tree may replace target/release/cryptblk mid-run.
cp "$BIN" "$BENCH_WORK/cryptblk"
BIN=$BENCH_WORK/cryptblk

LOADS=("$(load1)")
STEADY=$BENCH_WORK/steady.raw
random_file "$STEADY" "$SIZE_BYTES"
for k in $(seq "$N"); do
    truncate -s "$SMALL_BYTES" "$BENCH_WORK/img$k.raw"
done

CTL=$BENCH_WORK/ctl.sock
SOCK=$BENCH_WORK/nbd.sock
URI="nbd+unix:///steady?socket=$SOCK"
cmd=("$BIN" serve --control "$CTL" --nbd "unix:$SOCK" --image "$STEADY" --name steady)
log "+ ${cmd[*]}"
"${cmd[@]}" >"$BENCH_WORK/serve.log" 2>&1 &
DAEMON=$!
wait_nbd "$URI" "$DAEMON" "$BENCH_WORK/serve.log"
for _ in $(seq 100); do [[ -S $CTL ]] && break; sleep 0.1; done
[[ -S $CTL ]] || { cat "$BENCH_WORK/serve.log" >&2; die "no control socket at $CTL"; }
ctl() { "$BIN" ctl -s "$CTL" "$@"; }

# churn_loop K MODE: the control loop (MODE churn) on disk dK, or the same number of bare
# process starts (MODE spawn), until $BENCH_WORK/stop exists; writes "OPS ERRORS" to
# $BENCH_WORK/loopK.count and the first failures to loopK.err.
churn_loop() {
    local k=$1 ops=0 errs=0 c
    local -a cmds=(
        "disk-add d$k --image $BENCH_WORK/img$k.raw --nbd-export"
        "disk-list"
        "stats"
        "disk-remove d$k"
    )
    [[ $2 == spawn ]] && cmds=(--version --version --version --version)
    : >"$BENCH_WORK/loop$k.err"
    while [[ ! -e $BENCH_WORK/stop ]]; do
        for c in "${cmds[@]}"; do
            # shellcheck disable=SC2086 # each entry is a word list
            # shellcheck disable=SC2086
            if { if [[ $2 == spawn ]]; then "$BIN" $c; else ctl $c; fi; } >/dev/null 2>>"$BENCH_WORK/loop$k.err.tmp"; then
                ops=$((ops + 1))
            else
                errs=$((errs + 1))
                (( errs <= 5 )) && { echo "ctl $c:"; cat "$BENCH_WORK/loop$k.err.tmp"; } >>"$BENCH_WORK/loop$k.err"
            fi
            rm -f "$BENCH_WORK/loop$k.err.tmp"
        done
    done
    echo "$ops $errs" >"$BENCH_WORK/loop$k.count"
}

FIO_ARGS=(--name=randread-4k --rw=randread --bs=4k --iodepth=32 --numjobs=1 --time_based --runtime="$RUNTIME")
declare -A IOPS CPU
CTL_OPS_S=() CTL_ERRS=() CTL_OPS=() SPAWN_S=()
# measure quiet|churn|spawn
measure() {
    local mode=$1 c0 c1 t0 t1 l0 l1 res iops k ops=0 errs=0 o e
    LOADS+=("$(load1)")
    rm -f "$BENCH_WORK/stop" "$BENCH_WORK"/loop*.count
    LOOP_PIDS=()
    c0=$(proc_cpu_ticks "$DAEMON"); t0=$(now_s)
    if [[ $mode != quiet ]]; then
        l0=$(now_s)
        for k in $(seq "$N"); do
            churn_loop "$k" "$mode" &
            LOOP_PIDS+=($!)
        done
    fi
    res=$(fio_nbd "$URI" "$BENCH_WORK/fio.json" "${FIO_ARGS[@]}")
    t1=$(now_s); c1=$(proc_cpu_ticks "$DAEMON")
    if [[ $mode != quiet ]]; then
        touch "$BENCH_WORK/stop"
        for k in "${LOOP_PIDS[@]}"; do wait "$k"; done
        l1=$(now_s)
        LOOP_PIDS=()
        for k in $(seq "$N"); do
            read -r o e <"$BENCH_WORK/loop$k.count"
            ops=$((ops + o)); errs=$((errs + e))
            [[ -s $BENCH_WORK/loop$k.err ]] && { log "bench: loop $k failures:"; cat "$BENCH_WORK/loop$k.err" >&2; }
        done
        local rate
        rate=$(awk -v n="$ops" -v s="$(elapsed "$l0" "$l1")" 'BEGIN { printf "%.1f", n / s }')
        if [[ $mode == churn ]]; then
            CTL_OPS+=("$ops")
            CTL_ERRS+=("$errs")
            CTL_OPS_S+=("$rate")
        else
            SPAWN_S+=("$rate")
        fi
    fi
    read -r iops _ <<<"$res"
    local cpu
    cpu=$(cpu_pct_of $((c1 - c0)) "$(elapsed "$t0" "$t1")")
    IOPS[$mode]="${IOPS[$mode]:-} $iops"
    CPU[$mode]="${CPU[$mode]:-} $cpu"
    log "  $mode: $(printf '%.0f' "$iops") IOPS, daemon CPU ${cpu}%$([[ $mode != quiet ]] && echo ", $ops $mode ops ($errs failed), $rate ops/s"), load $(load1)"
}

for round in $(seq "$ROUNDS"); do
    log "round $round of $ROUNDS (load average $(cut -d' ' -f1-3 /proc/loadavg))"
    measure quiet
    measure churn
    measure spawn
done
# Every churn disk must be gone again.
left=$(ctl disk-list | jq -r '[.disks[].name | select(. != "steady")] | join(" ")')
[[ -z $left ]] || log "bench: disks left after the churn: $left"

# (3) Round trips, 50 each: ctl stats (new process), cryptblk --version (process start only).
# ms_of CMD...: median wall milliseconds of 50 runs.
ms_of() {
    local -a t=()
    local i t0 t1
    for i in $(seq 50); do
        t0=$EPOCHREALTIME
        "$@" >/dev/null || die "failed: $*"
        t1=$EPOCHREALTIME
        t+=("$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.3f", (b - a) * 1e3 }')")
    done
    median "${t[@]}"
}
LOADS+=("$(load1)")
log "+ 50 x $BIN ctl -s $CTL stats"
STATS_MS=$(ms_of "$BIN" ctl -s "$CTL" stats)
log "+ 50 x $BIN --version"
VERSION_MS=$(ms_of "$BIN" --version)
RPC_US=n/a
if command -v python3 >/dev/null 2>&1; then
    log "+ python3: 50 x {\"method\":\"stats\"} on one connection to $CTL"
    RPC_US=$(python3 - "$CTL" <<'EOF'
import json, socket, statistics, sys, time
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
f = s.makefile("rwb")
times = []
for i in range(51):
    t0 = time.perf_counter()
    f.write((json.dumps({"jsonrpc": "2.0", "id": i, "method": "stats", "params": {}}) + "\n").encode())
    f.flush()
    reply = json.loads(f.readline())
    t1 = time.perf_counter()
    if reply.get("id") != i or "result" not in reply:
        sys.exit("bad reply: %r" % reply)
    if i:  # the first one pays for the connection's warm-up
        times.append((t1 - t0) * 1e6)
print("%.0f" % statistics.median(times))
EOF
) || RPC_US=failed
fi
LOADS+=("$(load1)")

# shellcheck disable=SC2086 # word splitting of the recorded lists is intended
Q_IOPS=$(median ${IOPS[quiet]})
# shellcheck disable=SC2086
C_IOPS=$(median ${IOPS[churn]})
# shellcheck disable=SC2086
S_IOPS=$(median ${IOPS[spawn]})
CPU_MODEL=$(awk -F': ' '/^model name/ { print $2; exit }' /proc/cpuinfo)
LOAD_MED=$(median "${LOADS[@]}")
LOAD_MAX=$(max "${LOADS[@]}")
echo
echo "## cryptblk serve --control: control-plane throughput and its cost to the data path"
echo
echo "- Machine: ${CPU_MODEL:-unknown CPU}, $(nproc) CPUs; $(fio --version)"
echo "- cryptblk: $BIN_ORIG ($(git rev-parse --short HEAD 2>/dev/null || echo unknown commit)$(git diff --quiet HEAD -- crates 2>/dev/null || echo ', uncommitted changes in crates/'))"
echo "- Data path: fio --ioengine=nbd 4k randread iodepth 32 numjobs 1 on \"steady\" ($SIZE raw, random data, $BENCH_DIR), RUNTIME=${RUNTIME}s."
echo "- Churn: $N loops of ctl disk-add (raw $SMALL, --nbd-export) / disk-list / stats / disk-remove, each a new \`cryptblk ctl\` process."
echo "- ROUNDS=$ROUNDS (quiet, churn and spawn-only runs alternate), medians shown; daemon CPU: utime+stime / wall, 100% = one core."
echo "- 1-minute load average sampled before each run: median $LOAD_MED, max $LOAD_MAX on $(nproc) CPUs$(awk -v l="$LOAD_MED" -v n="$(nproc)" 'BEGIN { if (l > n * 0.75) printf " -- HIGH: other work shared the CPUs, figures are noisy" }')."
echo
echo "| measurement | value |"
echo "|---|---:|"
echo "| data-path IOPS, no control traffic | $(printf '%.0f' "$Q_IOPS") |"
echo "| data-path IOPS during churn | $(printf '%.0f' "$C_IOPS") |"
echo "| IOPS ratio churn / quiet | $(ratio "$C_IOPS" "$Q_IOPS") |"
echo "| data-path IOPS during spawn-only loops (cryptblk --version, no control traffic) | $(printf '%.0f' "$S_IOPS") |"
echo "| IOPS ratio spawn-only / quiet | $(ratio "$S_IOPS" "$Q_IOPS") |"
echo "| IOPS ratio churn / spawn-only (the control traffic's own cost) | $(ratio "$C_IOPS" "$S_IOPS") |"
# shellcheck disable=SC2086
echo "| daemon CPU %, quiet / churn / spawn-only | $(median ${CPU[quiet]}) / $(median ${CPU[churn]}) / $(median ${CPU[spawn]}) |"
echo "| control ops/s during churn ($N loops) | $(median "${CTL_OPS_S[@]}") |"
echo "| process starts/s in the spawn-only loops | $(median "${SPAWN_S[@]}") |"
ERR_TOTAL=0
for e in "${CTL_ERRS[@]}"; do ERR_TOTAL=$((ERR_TOTAL + e)); done
echo "| completed control ops per round | ${CTL_OPS[*]} ($ERR_TOTAL failed in all) |"
echo "| \`cryptblk ctl stats\` round trip, new process, median of 50 | $STATS_MS ms |"
echo "| \`cryptblk --version\` (process start alone), median of 50 | $VERSION_MS ms |"
echo "| JSON-RPC \"stats\" on an open connection (python3), median of 50 | $RPC_US us |"
echo
echo "Per round: quiet IOPS${IOPS[quiet]}; churn IOPS${IOPS[churn]}; spawn-only IOPS${IOPS[spawn]}; control ops/s ${CTL_OPS_S[*]}; spawns/s ${SPAWN_S[*]}."
