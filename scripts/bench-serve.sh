#!/usr/bin/env bash
# Benchmark (not a test): `cryptblk serve` vs qemu-storage-daemon as vhost-user-blk servers on
# this machine, both driven by the same libblkio client
# (crates/vhost-user-blk/examples/vu_bench.rs, one thread per queue, blocking completion waits).
#
#   (a) cryptblk serve, LUKS2 image (aes-xts-plain64, 512-bit key, 4096-byte sectors)
#   (b) qemu-storage-daemon, LUKS1 image made by qemu-img (aes-xts-plain64, 512-bit key)
#   (c) qemu-storage-daemon, raw image (driver=file)
#   (d) cryptblk serve, the same raw image
#
# All images hold the same SIZE bytes of incompressible plaintext (the raw image, copied into
# both LUKS images with `cryptblk convert -n`). Workloads: 4k randread and randwrite at
# iodepth 32 (per queue) with 1 and with 2 queues, 64k read and write at iodepth 16 with 1 queue;
# each daemon is started with --num-queues equal to the workload's queue count. Servers and
# workloads run interleaved over ROUNDS rounds; the tables show medians. Server CPU% is the
# daemon's utime+stime delta (/proc/PID/stat) over the run's wall time (100% = one core; the
# client runs on the same 2 cores). After each daemon's 1-queue workloads: its CPU% over IDLE
# seconds with a connected but idle client (vu_bench --idle), and its VmRSS/VmHWM.
#
# Environment: SIZE (default 1G), ROUNDS (3), RUNTIME (seconds per workload, 10), IDLE (5),
# BENCH_DIR (default: /dev/shm if it has room for the images, else ${TMPDIR:-/tmp}),
# CRYPTBLK / VU_BENCH (prebuilt binaries; default: cargo build --release).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/bench-lib.sh
source scripts/bench-lib.sh

SIZE=${SIZE:-1G}
ROUNDS=${ROUNDS:-3}
RUNTIME=${RUNTIME:-10}
IDLE=${IDLE:-5}
SIZE_BYTES=$(bytes "$SIZE")
(( SIZE_BYTES % 65536 == 0 )) || die "SIZE must be a multiple of 64 KiB"

need qemu-storage-daemon qemu-system-common
need qemu-img qemu-utils
need openssl
need numfmt coreutils
need jq
need awk gawk

if [[ -n ${CRYPTBLK:-} && -n ${VU_BENCH:-} ]]; then
    BIN=$CRYPTBLK
    VU=$VU_BENCH
else
    need cargo
    log "+ cargo build --release -p cryptblk -p cryptblk-vhost-user-blk --bin cryptblk --example vu_bench"
    cargo build --release -p cryptblk -p cryptblk-vhost-user-blk --bin cryptblk --example vu_bench
    BIN=${CRYPTBLK:-${CARGO_TARGET_DIR:-target}/release/cryptblk}
    VU=${VU_BENCH:-${CARGO_TARGET_DIR:-target}/release/examples/vu_bench}
fi
[[ -x $BIN ]] || die "cryptblk binary not found at $BIN"
[[ -x $VU ]] || die "vu_bench binary not found at $VU"

# Three images of SIZE plus headers and slack.
NEED_KIB=$(( (SIZE_BYTES * 3 + (256 << 20)) / 1024 ))
if [[ -z ${BENCH_DIR:-} ]]; then
    BENCH_DIR=${TMPDIR:-/tmp}
    if [[ -d /dev/shm ]] && (( $(df -Pk /dev/shm | awk 'NR == 2 { print $4 }') > NEED_KIB )); then
        BENCH_DIR=/dev/shm
    fi
fi
mkdir -p "$BENCH_DIR"
BENCH_WORK=$(mktemp -d "$BENCH_DIR/cryptblk-bench-serve.XXXXXX")
export BENCH_WORK
(( $(df -Pk "$BENCH_WORK" | awk 'NR == 2 { print $4 }') > NEED_KIB )) \
    || die "$BENCH_WORK needs room for three $SIZE images"

# Every daemon started is recorded here and killed on exit, whatever happens.
declare -A DAEMON_PID
cleanup() {
    local pid
    for pid in "${DAEMON_PID[@]}"; do
        [[ -n $pid ]] && kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null
    done
    [[ -n ${IDLE_PID:-} ]] && kill "$IDLE_PID" 2>/dev/null
    rm -rf "$BENCH_WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

KEY=$BENCH_WORK/key
head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$KEY"
RAW=$BENCH_WORK/raw.img
LUKS2=$BENCH_WORK/luks2.img
LUKS1=$BENCH_WORK/luks1.img

log "+ head -c $SIZE_BYTES /dev/zero | openssl enc -aes-128-ctr -K <random> -iv <random> > $RAW"
head -c "$SIZE_BYTES" /dev/zero \
    | openssl enc -aes-128-ctr -nosalt -K "$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')" \
        -iv "$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')" >"$RAW"
[[ $(stat -c %s "$RAW") -eq $SIZE_BYTES ]] || die "could not write the $SIZE raw image"

log "+ $BIN format --type luks2 --sector-size 4096 (aes-xts-plain64, 512-bit key, pbkdf2 1000) $LUKS2 $SIZE_BYTES"
"$BIN" format -q --type luks2 --cipher aes-xts-plain64 --key-size 512 --sector-size 4096 \
    --pbkdf pbkdf2 --pbkdf-force-iterations 1000 --key-file "$KEY" "$LUKS2" "$SIZE_BYTES" >/dev/null
qemu_luks1_create "$LUKS1" "$SIZE_BYTES" "$KEY"
for img in "$LUKS2" "$LUKS1"; do
    log "+ $BIN convert -n -O luks --key-file KEY $RAW $img"
    "$BIN" convert -n -f raw -O luks --key-file "$KEY" "$RAW" "$img" >/dev/null
done

SERVERS=(a b c d)
declare -A SERVER_NAME=(
    [a]="cryptblk serve, LUKS2"
    [b]="qemu-storage-daemon, LUKS1"
    [c]="qemu-storage-daemon, raw"
    [d]="cryptblk serve, raw"
)

# start_server S Q: starts server S with Q queues on $BENCH_WORK/S.sock; sets DAEMON_PID[S].
start_server() {
    local s=$1 q=$2 sock=$BENCH_WORK/$1.sock
    local -a cmd
    rm -f "$sock"
    case $s in
        a) cmd=("$BIN" serve --vhost-user-blk "$sock" --image "$LUKS2" --key-file "$KEY" --num-queues "$q" --unsealed-memory) ;;
        d) cmd=("$BIN" serve --vhost-user-blk "$sock" --image "$RAW" --num-queues "$q" --unsealed-memory) ;;
        b) cmd=(qemu-storage-daemon --blockdev "driver=file,node-name=f,filename=$LUKS1"
                --object "secret,id=sec0,file=$KEY"
                --blockdev driver=luks,node-name=l,file=f,key-secret=sec0
                --export "type=vhost-user-blk,id=e,node-name=l,addr.type=unix,addr.path=$sock,writable=on,num-queues=$q") ;;
        c) cmd=(qemu-storage-daemon --blockdev "driver=file,node-name=f,filename=$RAW"
                --export "type=vhost-user-blk,id=e,node-name=f,addr.type=unix,addr.path=$sock,writable=on,num-queues=$q") ;;
    esac
    log "+ ${cmd[*]}"
    "${cmd[@]}" >"$BENCH_WORK/$s.log" 2>&1 &
    DAEMON_PID[$s]=$!
    local i
    for i in $(seq 300); do
        [[ -S $sock ]] && return 0
        kill -0 "${DAEMON_PID[$s]}" 2>/dev/null || { cat "$BENCH_WORK/$s.log" >&2; die "server $s exited"; }
        sleep 0.1
    done
    die "server $s: no socket after 30 s"
}

stop_server() {
    local s=$1 pid=${DAEMON_PID[$1]}
    kill "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    DAEMON_PID[$s]=
}

# cpu_ticks PID: utime + stime of the whole process, in clock ticks.
cpu_ticks() {
    awk '{ sub(/^.*\) /, ""); print $12 + $13 }' "/proc/$1/stat"
}
HZ=$(getconf CLK_TCK)
now() { date +%s.%N; }
cpu_pct() { # TICKS SECONDS
    awk -v t="$1" -v s="$2" -v hz="$HZ" 'BEGIN { printf "%.1f\n", t / hz / s * 100 }'
}

declare -A IOPS MIBS LAT LMAX BAL CPU IDLE_CPU RSS HWM
# workload NAME RW BS IODEPTH QUEUES SERVER
workload() {
    local name=$1 rw=$2 bs=$3 depth=$4 q=$5 s=$6 pid=${DAEMON_PID[$6]} t0 c0 t1 c1 json
    local -a cmd=("$VU" --socket "$BENCH_WORK/$s.sock" --rw "$rw" --bs "$bs" --iodepth "$depth"
        --queues "$q" --runtime "$RUNTIME" --size "$SIZE_BYTES")
    log "+ ${cmd[*]}"
    c0=$(cpu_ticks "$pid")
    t0=$(now)
    json=$("${cmd[@]}") || die "vu_bench failed against server $s (${SERVER_NAME[$s]})"
    t1=$(now)
    c1=$(cpu_ticks "$pid")
    local cpu
    cpu=$(cpu_pct $((c1 - c0)) "$(awk -v a="$t0" -v b="$t1" 'BEGIN { print b - a }')")
    log "  $s $name: $json cpu ${cpu}%"
    local key=$s.$name
    IOPS[$key]="${IOPS[$key]:-} $(jq -r .iops <<<"$json")"
    MIBS[$key]="${MIBS[$key]:-} $(jq -r .mib_s <<<"$json")"
    LAT[$key]="${LAT[$key]:-} $(jq -r .lat_avg_us <<<"$json")"
    LMAX[$key]="${LMAX[$key]:-} $(jq -r .lat_max_us <<<"$json")"
    BAL[$key]="${BAL[$key]:-} $(jq -r .queue_balance <<<"$json")"
    CPU[$key]="${CPU[$key]:-} $cpu"
}

# idle SERVER: CPU% over IDLE seconds with a connected, idle client; then VmRSS / VmHWM.
idle() {
    local s=$1 pid=${DAEMON_PID[$1]} c0 c1 t0 t1
    "$VU" --socket "$BENCH_WORK/$s.sock" --idle $((IDLE + 2)) --queues 1 >/dev/null &
    IDLE_PID=$!
    sleep 1
    c0=$(cpu_ticks "$pid")
    t0=$(now)
    sleep "$IDLE"
    c1=$(cpu_ticks "$pid")
    t1=$(now)
    local rss hwm cpu
    rss=$(awk '/^VmRSS:/ { print $2 }' "/proc/$pid/status")
    hwm=$(awk '/^VmHWM:/ { print $2 }' "/proc/$pid/status")
    wait "$IDLE_PID" || die "idle client failed against server $s"
    IDLE_PID=
    cpu=$(cpu_pct $((c1 - c0)) "$(awk -v a="$t0" -v b="$t1" 'BEGIN { print b - a }')")
    log "  $s idle: cpu ${cpu}%, VmRSS $rss KiB, VmHWM $hwm KiB"
    IDLE_CPU[$s]="${IDLE_CPU[$s]:-} $cpu"
    RSS[$s]="${RSS[$s]:-} $rss"
    HWM[$s]="${HWM[$s]:-} $hwm"
}

WORKLOADS=(randread-4k-q1 randwrite-4k-q1 read-64k-q1 write-64k-q1 randread-4k-q2 randwrite-4k-q2)
for round in $(seq "$ROUNDS"); do
    log "round $round of $ROUNDS"
    for s in "${SERVERS[@]}"; do
        start_server "$s" 1
        workload randread-4k-q1 randread 4096 32 1 "$s"
        workload randwrite-4k-q1 randwrite 4096 32 1 "$s"
        workload read-64k-q1 read 65536 16 1 "$s"
        workload write-64k-q1 write 65536 16 1 "$s"
        idle "$s"
        stop_server "$s"
    done
    for s in "${SERVERS[@]}"; do
        start_server "$s" 2
        workload randread-4k-q2 randread 4096 32 2 "$s"
        workload randwrite-4k-q2 randwrite 4096 32 2 "$s"
        stop_server "$s"
    done
done

med() { # ARRAY-VALUES: median, or n/a
    # shellcheck disable=SC2086 # word splitting of the recorded lists is intended
    if [[ -z ${1// /} ]]; then echo n/a; else median $1; fi
}
fmt0() { awk -v v="$1" 'BEGIN { if (v == "n/a") print v; else printf "%.0f", v }'; }
fmt1() { awk -v v="$1" 'BEGIN { if (v == "n/a") print v; else printf "%.1f", v }'; }

CPU_MODEL=$(awk -F': ' '/^model name/ { print $2; exit }' /proc/cpuinfo)
echo
echo "## cryptblk serve vs qemu-storage-daemon (vhost-user-blk, libblkio client)"
echo
echo "- Machine: ${CPU_MODEL:-unknown CPU}, $(nproc) CPUs; $(qemu-storage-daemon --version | head -n 1)"
echo "- cryptblk: $("$BIN" --version 2>/dev/null || echo "$BIN")"
echo "- Images: $SIZE ($SIZE_BYTES bytes) of the same incompressible data in $BENCH_DIR;"
echo "  ROUNDS=$ROUNDS, RUNTIME=${RUNTIME}s per workload, medians shown; iodepth is per queue."
echo "- Client: vu_bench (libblkio virtio-blk-vhost-user), one thread per queue, blocking waits."
echo "- Server CPU: utime+stime of the daemon over the run / wall, 100% = one core."
echo
# queue balance = least-served queue's I/Os / most-served queue's (target >= 0.8 with 2
# queues); lat max = the worst single request (target < 20 ms with 2 queues); both medians.
echo "| workload | server | IOPS | MiB/s | lat avg us | lat max us | queue balance | server CPU % |"
echo "|---|---|---:|---:|---:|---:|---:|---:|"
declare -A M_IOPS M_CPU
for w in "${WORKLOADS[@]}"; do
    for s in "${SERVERS[@]}"; do
        k=$s.$w
        M_IOPS[$k]=$(med "${IOPS[$k]:-}")
        M_CPU[$k]=$(med "${CPU[$k]:-}")
        echo "| $w | ($s) ${SERVER_NAME[$s]} | $(fmt0 "${M_IOPS[$k]}") | $(fmt1 "$(med "${MIBS[$k]:-}")") | $(fmt1 "$(med "${LAT[$k]:-}")") | $(fmt0 "$(med "${LMAX[$k]:-}")") | $(med "${BAL[$k]:-}") | ${M_CPU[$k]} |"
    done
done
echo
echo "| workload | IOPS a/b | IOPS a/c | IOPS a/d | CPU% a/b | CPU% a/c | CPU% a/d |"
echo "|---|---:|---:|---:|---:|---:|---:|"
for w in "${WORKLOADS[@]}"; do
    line="| $w"
    for o in b c d; do line+=" | $(ratio "${M_IOPS[a.$w]}" "${M_IOPS[$o.$w]}")"; done
    for o in b c d; do line+=" | $(ratio "${M_CPU[a.$w]}" "${M_CPU[$o.$w]}")"; done
    echo "$line |"
done
echo
echo "| server | idle CPU % (connected client, ${IDLE}s) | VmRSS MiB | VmHWM MiB |"
echo "|---|---:|---:|---:|"
for s in "${SERVERS[@]}"; do
    # shellcheck disable=SC2086
    echo "| ($s) ${SERVER_NAME[$s]} | $(med "${IDLE_CPU[$s]}") | $(( $(max ${RSS[$s]}) / 1024 )) | $(( $(max ${HWM[$s]}) / 1024 )) |"
done
