#!/usr/bin/env bash
# Benchmark (not a test): `cryptblk serve --nbd` vs qemu-storage-daemon as NBD servers on this
# machine, all driven by the same client, fio's nbd ioengine (libnbd, one connection per job):
#
#   (a) cryptblk serve, LUKS2 image (aes-xts-plain64, 512-bit key, 4096-byte sectors)
#   (b) qemu-storage-daemon, LUKS1 image made by qemu-img (aes-xts-plain64, 512-bit key), QEMU's
#       luks driver over driver=file (cache.direct=off)
#   (c) qemu-storage-daemon, raw image (driver=file, cache.direct=off)
#   (d) cryptblk serve, the same raw image
#
# All payloads start with the same SIZE bytes of incompressible data: the raw image is a copy of
# the random source, each LUKS image is filled through its own server's export (nbdcopy) and
# read back through it and checked (sha256) before anything is measured.
# Workloads (--time_based --runtime=RUNTIME --group_reporting): 4k randread and randwrite at
# iodepth 32 with numjobs 1 and 2 (2 NBD connections), 64k sequential read and write at
# iodepth 16, numjobs 1. Then `nbdcopy URI null:` of the whole disk out of every server, timed.
# Every measurement gets a freshly started server; rounds interleave (for each round, each
# workload, each server) and the tables show medians over ROUNDS rounds.
# Server CPU% is the daemon's utime+stime delta (/proc/PID/stat) over the run's wall time
# (100% = one core; the client runs on the same cores).
#
# Environment: SIZE (default 1G), ROUNDS (3), RUNTIME (seconds per fio run, 10),
# BENCH_DIR (default: /dev/shm if it has room for the images, else ${TMPDIR:-/tmp}),
# CRYPTBLK (a prebuilt binary; default: cargo build --release -p cryptblk).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/bench-lib.sh
source scripts/bench-lib.sh

SIZE=${SIZE:-1G}
ROUNDS=${ROUNDS:-3}
RUNTIME=${RUNTIME:-10}
SIZE_BYTES=$(bytes "$SIZE")
(( SIZE_BYTES % 65536 == 0 )) || die "SIZE must be a multiple of 64 KiB"

need fio
need nbdcopy libnbd-bin
need nbdinfo libnbd-bin
need qemu-storage-daemon qemu-system-common
need qemu-img qemu-utils
need openssl
need numfmt coreutils
need sha256sum coreutils
need jq
need awk gawk
fio --enghelp=nbd >/dev/null 2>&1 || die "this fio has no nbd ioengine (Debian's fio 3.33 has it)"

cryptblk_bin
BIN_ORIG=$BIN

# Source, raw, LUKS2 and LUKS1 images of SIZE, plus headers and slack.
NEED_KIB=$(( (SIZE_BYTES * 4 + (256 << 20)) / 1024 ))
if [[ -z ${BENCH_DIR:-} ]]; then
    BENCH_DIR=${TMPDIR:-/tmp}
    if [[ -d /dev/shm ]] && (( $(df -Pk /dev/shm | awk 'NR == 2 { print $4 }') > NEED_KIB )); then
        BENCH_DIR=/dev/shm
    fi
fi
mkdir -p "$BENCH_DIR"
BENCH_WORK=$(mktemp -d "$BENCH_DIR/cryptblk-bench-nbd.XXXXXX")
export BENCH_WORK
(( $(df -Pk "$BENCH_WORK" | awk 'NR == 2 { print $4 }') > NEED_KIB )) \
    || die "$BENCH_WORK needs room for four $SIZE files"

# Every daemon started is recorded here and killed on exit, whatever happens.
declare -A DAEMON_PID=()
cleanup() {
    local pid
    for pid in "${DAEMON_PID[@]}"; do
        [[ -n $pid ]] && kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null
    done
    rm -rf "$BENCH_WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
# Work on a private copy: other builds in this tree may replace target/release/cryptblk mid-run.
cp "$BIN" "$BENCH_WORK/cryptblk"
BIN=$BENCH_WORK/cryptblk

LOADS=()
LOADS+=("$(load1)")
KEY=$BENCH_WORK/key
head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$KEY"
SRC=$BENCH_WORK/src.bin
RAW=$BENCH_WORK/raw.img
LUKS2=$BENCH_WORK/luks2.img
LUKS1=$BENCH_WORK/luks1.img

random_file "$SRC" "$SIZE_BYTES"
SRC_SHA=$(sha256sum <"$SRC" | awk '{ print $1 }')
cp "$SRC" "$RAW"

log "+ $BIN format --type luks2 --sector-size 4096 -c aes-xts-plain64 -s 512 --pbkdf pbkdf2 --pbkdf-force-iterations 1000 $LUKS2 $SIZE_BYTES"
"$BIN" format -q --type luks2 --sector-size 4096 -c aes-xts-plain64 -s 512 \
    --pbkdf pbkdf2 --pbkdf-force-iterations 1000 --key-file "$KEY" "$LUKS2" "$SIZE_BYTES" >/dev/null
qemu_luks1_create "$LUKS1" "$SIZE_BYTES" "$KEY"

SERVERS=(a b c d)
declare -A SERVER_NAME=(
    [a]="cryptblk serve, LUKS2"
    [b]="qemu-storage-daemon, LUKS1"
    [c]="qemu-storage-daemon, raw"
    [d]="cryptblk serve, raw"
)
uri() { echo "nbd+unix:///vol?socket=$BENCH_WORK/$1.sock"; }

# start_server S: starts server S exporting "vol" on $BENCH_WORK/S.sock; sets DAEMON_PID[S].
start_server() {
    local s=$1 sock=$BENCH_WORK/$1.sock
    local -a cmd
    rm -f "$sock"
    case $s in
        a) cmd=("$BIN" serve --image "$LUKS2" --key-file "$KEY" --name vol --nbd "unix:$sock") ;;
        d) cmd=("$BIN" serve --image "$RAW" --name vol --nbd "unix:$sock") ;;
        b) cmd=(qemu-storage-daemon --object "secret,id=sec0,file=$KEY"
                --blockdev "driver=file,node-name=f,filename=$LUKS1,cache.direct=off"
                --blockdev driver=luks,node-name=l,file=f,key-secret=sec0
                --nbd-server "addr.type=unix,addr.path=$sock"
                --export type=nbd,id=e,node-name=l,name=vol,writable=on) ;;
        c) cmd=(qemu-storage-daemon
                --blockdev "driver=file,node-name=f,filename=$RAW,cache.direct=off"
                --nbd-server "addr.type=unix,addr.path=$sock"
                --export type=nbd,id=e,node-name=f,name=vol,writable=on) ;;
    esac
    log "+ ${cmd[*]}"
    "${cmd[@]}" >"$BENCH_WORK/$s.log" 2>&1 &
    DAEMON_PID[$s]=$!
    wait_nbd "$(uri "$s")" "${DAEMON_PID[$s]}" "$BENCH_WORK/$s.log"
    local got
    got=$(nbdinfo --size "$(uri "$s")")
    [[ $got -eq $SIZE_BYTES ]] || die "server $s exports $got bytes, expected $SIZE_BYTES"
}

stop_server() {
    local s=$1 pid=${DAEMON_PID[$1]}
    kill "$pid" 2>/dev/null || true
    local rc=0
    wait "$pid" 2>/dev/null || rc=$?
    DAEMON_PID[$s]=
    # SIGTERM is a clean stop for both daemons (exit 0); anything else is worth a look.
    (( rc == 0 || rc == 143 )) || { cat "$BENCH_WORK/$s.log" >&2; log "bench: server $s exited with status $rc on SIGTERM"; }
}

# Fill each LUKS payload with the source through its own server, then read every export back.
for s in a b; do
    start_server "$s"
    log "+ nbdcopy --flush $SRC '$(uri "$s")'"
    nbdcopy --flush "$SRC" "$(uri "$s")"
    stop_server "$s"
done
for s in "${SERVERS[@]}"; do
    start_server "$s"
    log "+ nbdcopy '$(uri "$s")' - | sha256sum"
    got=$(nbdcopy "$(uri "$s")" - | sha256sum | awk '{ print $1 }')
    stop_server "$s"
    [[ $got == "$SRC_SHA" ]] || die "server $s (${SERVER_NAME[$s]}) does not read back the data written"
done
rm -f "$SRC"

declare -A IOPS MIBS CPU
WORKLOADS=(randread-4k-j1 randread-4k-j2 randwrite-4k-j1 randwrite-4k-j2 read-64k-j1 write-64k-j1)
declare -A W_ARGS=(
    [randread-4k-j1]="--rw=randread --bs=4k --iodepth=32 --numjobs=1"
    [randread-4k-j2]="--rw=randread --bs=4k --iodepth=32 --numjobs=2"
    [randwrite-4k-j1]="--rw=randwrite --bs=4k --iodepth=32 --numjobs=1"
    [randwrite-4k-j2]="--rw=randwrite --bs=4k --iodepth=32 --numjobs=2"
    [read-64k-j1]="--rw=read --bs=64k --iodepth=16 --numjobs=1"
    [write-64k-j1]="--rw=write --bs=64k --iodepth=16 --numjobs=1"
)

# record KEY IOPS BYTES_PER_S CPU_PCT
record() {
    IOPS[$1]="${IOPS[$1]:-} $2"
    MIBS[$1]="${MIBS[$1]:-} $(awk -v b="$3" 'BEGIN { printf "%.1f", b / 1048576 }')"
    CPU[$1]="${CPU[$1]:-} $4"
}

# run_fio WORKLOAD SERVER: one fio run against a fresh server.
run_fio() {
    local w=$1 s=$2 pid c0 c1 t0 t1 res cpu
    start_server "$s"
    pid=${DAEMON_PID[$s]}
    LOADS+=("$(load1)")
    c0=$(proc_cpu_ticks "$pid"); t0=$(now_s)
    # shellcheck disable=SC2086 # W_ARGS holds several options
    res=$(fio_nbd "$(uri "$s")" "$BENCH_WORK/fio.json" --name="$w" ${W_ARGS[$w]} \
        --time_based --runtime="$RUNTIME")
    t1=$(now_s); c1=$(proc_cpu_ticks "$pid")
    stop_server "$s"
    cpu=$(cpu_pct_of $((c1 - c0)) "$(elapsed "$t0" "$t1")")
    read -r iops bps <<<"$res"
    log "  $s $w: $(printf '%.0f' "$iops") IOPS, $(awk -v b="$bps" 'BEGIN { printf "%.1f", b / 1048576 }') MiB/s, server CPU ${cpu}%, load $(load1)"
    record "$s.$w" "$iops" "$bps" "$cpu"
}

# run_copy SERVER: nbdcopy of the whole disk into null:, timed.
run_copy() {
    local s=$1 pid c0 c1 t0 t1 wall cpu
    start_server "$s"
    pid=${DAEMON_PID[$s]}
    LOADS+=("$(load1)")
    log "+ nbdcopy '$(uri "$s")' null:"
    c0=$(proc_cpu_ticks "$pid"); t0=$(now_s)
    nbdcopy "$(uri "$s")" null: || die "nbdcopy failed against server $s"
    t1=$(now_s); c1=$(proc_cpu_ticks "$pid")
    stop_server "$s"
    wall=$(elapsed "$t0" "$t1")
    cpu=$(cpu_pct_of $((c1 - c0)) "$wall")
    log "  $s nbdcopy: ${wall} s, $(mibps "$SIZE_BYTES" "$wall") MiB/s, server CPU ${cpu}%"
    record "$s.nbdcopy" "$(awk -v w="$wall" 'BEGIN { print 1 / w }')" \
        "$(awk -v n="$SIZE_BYTES" -v w="$wall" 'BEGIN { print n / w }')" "$cpu"
    COPY_WALL[$s]="${COPY_WALL[$s]:-} $wall"
}
declare -A COPY_WALL

for round in $(seq "$ROUNDS"); do
    log "round $round of $ROUNDS (load average $(cut -d' ' -f1-3 /proc/loadavg))"
    for w in "${WORKLOADS[@]}"; do
        for s in "${SERVERS[@]}"; do
            run_fio "$w" "$s"
        done
    done
    for s in "${SERVERS[@]}"; do
        run_copy "$s"
    done
done
LOADS+=("$(load1)")

med() { # VALUES: median, or n/a
    # shellcheck disable=SC2086 # word splitting of the recorded lists is intended
    if [[ -z ${1// /} ]]; then echo n/a; else median $1; fi
}
fmt0() { awk -v v="$1" 'BEGIN { if (v == "n/a") print v; else printf "%.0f", v }'; }
fmt1() { awk -v v="$1" 'BEGIN { if (v == "n/a") print v; else printf "%.1f", v }'; }
# target VALUE MIN: "VALUE (>= MIN ok)" or "VALUE (>= MIN MISS)"
target() {
    awk -v v="$1" -v m="$2" 'BEGIN { if (v == "n/a") print v; else printf "%s (>= %s %s)", v, m, (v + 0 >= m + 0 ? "ok" : "MISS") }'
}

CPU_MODEL=$(awk -F': ' '/^model name/ { print $2; exit }' /proc/cpuinfo)
LOAD_MED=$(median "${LOADS[@]}")
LOAD_MAX=$(max "${LOADS[@]}")
echo
echo "## cryptblk serve --nbd vs qemu-storage-daemon (NBD over a UNIX socket, fio nbd ioengine)"
echo
echo "- Machine: ${CPU_MODEL:-unknown CPU}, $(nproc) CPUs; $(qemu-storage-daemon --version | head -n 1); $(fio --version); $(nbdcopy --version | head -n 1)"
echo "- cryptblk: $BIN_ORIG ($(git rev-parse --short HEAD 2>/dev/null || echo unknown commit)$(git diff --quiet HEAD -- crates 2>/dev/null || echo ', uncommitted changes in crates/'))"
echo "- Images: $SIZE ($SIZE_BYTES bytes) in $BENCH_DIR, same incompressible data in every payload (verified through each server)."
echo "- ROUNDS=$ROUNDS, RUNTIME=${RUNTIME}s per fio run, a fresh server per run, medians shown. fio --ioengine=nbd, one NBD connection per job (j2 = numjobs 2)."
echo "- Server CPU: utime+stime of the daemon over the run / wall, 100% = one core; fio runs on the same cores."
echo "- 1-minute load average sampled before each run: median $LOAD_MED, max $LOAD_MAX on $(nproc) CPUs$(awk -v l="$LOAD_MED" -v n="$(nproc)" 'BEGIN { if (l > n * 0.75) printf " -- HIGH: other work shared the CPUs, figures are noisy and depressed" }')."
echo
echo "| workload | IOPS a | IOPS b | IOPS c | IOPS d | MiB/s a | MiB/s b | MiB/s c | MiB/s d | CPU% a | CPU% b | CPU% c | CPU% d | a/b | a/c | a/d |"
echo "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
for w in "${WORKLOADS[@]}" nbdcopy; do
    declare -A M=() MB=() MC=()
    for s in "${SERVERS[@]}"; do
        M[$s]=$(med "${IOPS[$s.$w]:-}")
        MB[$s]=$(med "${MIBS[$s.$w]:-}")
        MC[$s]=$(med "${CPU[$s.$w]:-}")
    done
    if [[ $w == nbdcopy ]]; then
        # One "op" is the whole disk: show MiB/s only, ratios of throughput.
        line="| nbdcopy whole disk -> null: | - | - | - | -"
        for s in "${SERVERS[@]}"; do line+=" | $(fmt0 "${MB[$s]}")"; done
        for s in "${SERVERS[@]}"; do line+=" | ${MC[$s]}"; done
        ab=$(ratio "${MB[a]}" "${MB[b]}"); ac=$(ratio "${MB[a]}" "${MB[c]}"); ad=$(ratio "${MB[a]}" "${MB[d]}")
        echo "$line | $ab | $ac | $ad |"
        continue
    fi
    line="| $w"
    for s in "${SERVERS[@]}"; do line+=" | $(fmt0 "${M[$s]}")"; done
    for s in "${SERVERS[@]}"; do line+=" | $(fmt1 "${MB[$s]}")"; done
    for s in "${SERVERS[@]}"; do line+=" | ${MC[$s]}"; done
    ab=$(ratio "${M[a]}" "${M[b]}"); ac=$(ratio "${M[a]}" "${M[c]}"); ad=$(ratio "${M[a]}" "${M[d]}")
    case $w in *-4k-*) tb=1.5 ;; *) tb=4 ;; esac
    echo "$line | $(target "$ab" "$tb") | $ac | $(target "$ad" 0.85) |"
done
echo
echo "Servers: (a) ${SERVER_NAME[a]}; (b) ${SERVER_NAME[b]}; (c) ${SERVER_NAME[c]}; (d) ${SERVER_NAME[d]}."
echo "Ratios are of IOPS (of MiB/s for nbdcopy); targets: a/b >= 1.5 at 4k and >= 4 at 64k, a/d >= 0.85."
echo "nbdcopy wall seconds per round: a${COPY_WALL[a]}; b${COPY_WALL[b]}; c${COPY_WALL[c]}; d${COPY_WALL[d]}."
