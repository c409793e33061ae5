#!/usr/bin/env bash
# Benchmark (not a test): serving an encrypted disk from a real filesystem with the host page
# cache bypassed, against QEMU and against the device itself, in one run on one machine.
#
#   (f) fio --direct=1 --ioengine=io_uring on the raw image, same depth: the device's ceiling
#   (a) cryptblk serve --cache none, LUKS2 (aes-xts-plain64, 512-bit key, 4096-byte sectors)
#   (b) qemu-storage-daemon, LUKS1 (same cipher, made by qemu-img), cache.direct=on,aio=io_uring
#   (c) qemu-storage-daemon, the raw image, same options
#   (d) cryptblk serve --cache none, the raw image
#
# Every image holds SIZE bytes of the same incompressible plaintext (the raw image, copied
# into both LUKS images with `cryptblk convert -n`), on BENCH_DIR, which must not be tmpfs.
# Workloads: 4k randread and randwrite at iodepth 32 with 1 and 2 queues (fio: numjobs), 64k
# sequential read and write at iodepth 16. Clients: vhost-user-blk through libblkio
# (crates/vhost-user-blk/examples/vu_bench.rs), NBD through fio's nbd ioengine (one
# connection per job). A fresh server per run; the page cache is dropped before every run
# (`echo 3 > /proc/sys/vm/drop_caches` as root, else `dd iflag=nocache` on each image).
# This machine's storage speed drifts 2-5x within minutes, so runs are interleaved — for each
# round and workload: f, a, b, c, d, f — and the tables report medians of per-round ratios,
# each taken against the ceiling measured next to it (the mean of the two f runs around it).
#
# Environment: SIZE (default 8G), ROUNDS (3), RUNTIME (seconds per run, 10),
# PROTOCOLS ("vhost nbd"), BENCH_DIR (default /var/tmp), KEEP_IMAGES=1 to reuse the images of
# an earlier run in BENCH_DIR/cryptblk-bench-disk (they take minutes to write),
# CRYPTBLK / VU_BENCH (prebuilt binaries; default: cargo build --release).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/bench-lib.sh
source scripts/bench-lib.sh

SIZE=${SIZE:-8G}
ROUNDS=${ROUNDS:-3}
RUNTIME=${RUNTIME:-10}
PROTOCOLS=${PROTOCOLS:-vhost nbd}
SIZE_BYTES=$(bytes "$SIZE")
(( SIZE_BYTES % 65536 == 0 )) || die "SIZE must be a multiple of 64 KiB"

need qemu-storage-daemon qemu-system-common
need qemu-img qemu-utils
need fio
need nbdinfo libnbd-bin
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

BENCH_DIR=${BENCH_DIR:-/var/tmp}
mkdir -p "$BENCH_DIR"
[[ $(stat -f -c %T "$BENCH_DIR") != tmpfs ]] \
    || die "$BENCH_DIR is tmpfs: this benchmark measures a real device (set BENCH_DIR)"
IMAGES=$BENCH_DIR/cryptblk-bench-disk
mkdir -p "$IMAGES"
BENCH_WORK=$(mktemp -d "${TMPDIR:-/tmp}/cryptblk-bench-disk.XXXXXX")
export BENCH_WORK

declare -A DAEMON_PID
cleanup() {
    local pid
    for pid in "${DAEMON_PID[@]}"; do
        [[ -n $pid ]] && kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null
    done
    rm -rf "$BENCH_WORK"
    [[ ${KEEP_IMAGES:-} == 1 ]] || rm -rf "$IMAGES"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

KEY=$IMAGES/key
RAW=$IMAGES/raw.img
LUKS2=$IMAGES/luks2.img
LUKS1=$IMAGES/luks1.img
if [[ ${KEEP_IMAGES:-} == 1 && -s $RAW && -s $LUKS2 && -s $LUKS1 && -s $KEY
      && $(stat -c %s "$RAW") -eq $SIZE_BYTES ]]; then
    log "reusing the images in $IMAGES"
else
    NEED_KIB=$(( (SIZE_BYTES * 3 + (256 << 20)) / 1024 ))
    (( $(df -Pk "$IMAGES" | awk 'NR == 2 { print $4 }') > NEED_KIB )) \
        || die "$IMAGES needs room for three $SIZE images"
    rm -f "$RAW" "$LUKS2" "$LUKS1"
    head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$KEY"
    random_file "$RAW" "$SIZE_BYTES"
    log "+ $BIN format --type luks2 --sector-size 4096 (aes-xts-plain64, 512-bit key, pbkdf2 1000) $LUKS2 $SIZE_BYTES"
    "$BIN" format -q --type luks2 --cipher aes-xts-plain64 --key-size 512 --sector-size 4096 \
        --pbkdf pbkdf2 --pbkdf-force-iterations 1000 --key-file "$KEY" "$LUKS2" "$SIZE_BYTES" >/dev/null
    qemu_luks1_create "$LUKS1" "$SIZE_BYTES" "$KEY"
    for img in "$LUKS2" "$LUKS1"; do
        log "+ $BIN convert -n -O luks --key-file KEY $RAW $img"
        "$BIN" convert -n -f raw -O luks --key-file "$KEY" "$RAW" "$img" >/dev/null
    done
    sync
fi

drop_caches() {
    sync
    if [[ -w /proc/sys/vm/drop_caches ]]; then
        echo 3 >/proc/sys/vm/drop_caches
    else
        local img
        for img in "$RAW" "$LUKS2" "$LUKS1"; do
            dd if="$img" iflag=nocache count=0 status=none
        done
    fi
}

# start_server PROTOCOL S Q: server S (a b c d) with Q queues; sets DAEMON_PID[S] and ADDR.
start_server() {
    local proto=$1 s=$2 q=$3 sock=$BENCH_WORK/$2.sock
    local -a cmd export
    rm -f "$sock"
    case $proto in
        vhost) export=(--vhost-user-blk "$sock" --num-queues "$q" --unsealed-memory)
               qexport="type=vhost-user-blk,id=e,addr.type=unix,addr.path=$sock,writable=on,num-queues=$q" ;;
        nbd) export=(--nbd "unix:$sock" --name vol)
             qexport="type=nbd,id=e,name=vol,writable=on" ;;
    esac
    local qfile="driver=file,node-name=f,cache.direct=on,aio=io_uring"
    case $s in
        a) cmd=("$BIN" serve "${export[@]}" --image "$LUKS2" --key-file "$KEY" --cache none) ;;
        d) cmd=("$BIN" serve "${export[@]}" --image "$RAW" --cache none) ;;
        b) cmd=(qemu-storage-daemon --blockdev "$qfile,filename=$LUKS1"
                --object "secret,id=sec0,file=$KEY"
                --blockdev "driver=luks,node-name=l,file=f,key-secret=sec0") ;;
        c) cmd=(qemu-storage-daemon --blockdev "$qfile,filename=$RAW") ;;
    esac
    if [[ $s == b || $s == c ]]; then
        local node=f
        [[ $s == b ]] && node=l
        [[ $proto == nbd ]] && cmd+=(--nbd-server "addr.type=unix,addr.path=$sock")
        cmd+=(--export "$qexport,node-name=$node")
    fi
    log "+ ${cmd[*]}"
    "${cmd[@]}" >"$BENCH_WORK/$s.log" 2>&1 &
    DAEMON_PID[$s]=$!
    if [[ $proto == nbd ]]; then
        wait_nbd "nbd+unix:///vol?socket=$sock" "${DAEMON_PID[$s]}" "$BENCH_WORK/$s.log" 60
    else
        local i
        for i in $(seq 600); do
            [[ -S $sock ]] && return 0
            kill -0 "${DAEMON_PID[$s]}" 2>/dev/null || { cat "$BENCH_WORK/$s.log" >&2; die "server $s exited"; }
            sleep 0.1
        done
        die "server $s: no socket after 60 s"
    fi
}

stop_server() {
    local s=$1 pid=${DAEMON_PID[$1]}
    kill "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    DAEMON_PID[$s]=
}

# Workloads: name -> "rw bs depth queues".
WORKLOADS=(rr4k_q1 rw4k_q1 rr4k_q2 rw4k_q2 r64k w64k)
declare -A W=(
    [rr4k_q1]="randread 4k 32 1" [rw4k_q1]="randwrite 4k 32 1"
    [rr4k_q2]="randread 4k 32 2" [rw4k_q2]="randwrite 4k 32 2"
    [r64k]="read 64k 16 1" [w64k]="write 64k 16 1"
)
declare -A WNAME=(
    [rr4k_q1]="4k randread, depth 32, 1 queue" [rw4k_q1]="4k randwrite, depth 32, 1 queue"
    [rr4k_q2]="4k randread, depth 32, 2 queues" [rw4k_q2]="4k randwrite, depth 32, 2 queues"
    [r64k]="64k read, depth 16" [w64k]="64k write, depth 16"
)

# run PROTOCOL WORKLOAD SERVER: prints IOPS.
run() {
    local proto=$1 w=$2 s=$3 rw bs depth q
    read -r rw bs depth q <<<"${W[$w]}"
    drop_caches
    if [[ $s == f ]]; then
        local json=$BENCH_WORK/f.json
        log "+ fio --filename=$RAW --direct=1 --ioengine=io_uring --rw=$rw --bs=$bs --iodepth=$depth --numjobs=$q --runtime=$RUNTIME"
        fio --name=ceiling --filename="$RAW" --direct=1 --ioengine=io_uring --rw="$rw" --bs="$bs" \
            --iodepth="$depth" --numjobs="$q" --time_based --runtime="$RUNTIME" \
            --group_reporting --output-format=json --output="$json" >/dev/null 2>&1 \
            || { cat "$json" >&2; die "fio failed on $RAW"; }
        jq -r '.jobs[0] | .read.iops + .write.iops' "$json"
        return
    fi
    start_server "$proto" "$s" "$q"
    local iops
    if [[ $proto == vhost ]]; then
        local json
        log "+ $VU --socket $BENCH_WORK/$s.sock --rw $rw --bs $bs --iodepth $depth --queues $q --runtime $RUNTIME --size $SIZE_BYTES"
        json=$("$VU" --socket "$BENCH_WORK/$s.sock" --rw "$rw" --bs "$bs" --iodepth "$depth" \
            --queues "$q" --runtime "$RUNTIME" --size "$SIZE_BYTES") \
            || die "vu_bench failed against server $s"
        iops=$(jq -r .iops <<<"$json")
    else
        local res
        res=$(fio_nbd "nbd+unix:///vol?socket=$BENCH_WORK/$s.sock" "$BENCH_WORK/fio.json" \
            --name="$w" --rw="$rw" --bs="$bs" --iodepth="$depth" --numjobs="$q" \
            --time_based --runtime="$RUNTIME")
        iops=${res%% *}
    fi
    stop_server "$s"
    echo "$iops"
}

declare -A IOPS RATIO
record() { IOPS[$1]="${IOPS[$1]:-} $2"; }
ratio_add() { RATIO[$1]="${RATIO[$1]:-} $2"; }

for round in $(seq "$ROUNDS"); do
    for proto in $PROTOCOLS; do
        for w in "${WORKLOADS[@]}"; do
            declare -A R=()
            f1=$(run "$proto" "$w" f)
            for s in a b c d; do
                R[$s]=$(run "$proto" "$w" "$s")
            done
            f2=$(run "$proto" "$w" f)
            f=$(awk -v x="$f1" -v y="$f2" 'BEGIN { print (x + y) / 2 }')
            log "  round $round $proto $w: f $f1/$f2 a ${R[a]} b ${R[b]} c ${R[c]} d ${R[d]}"
            key=$proto.$w
            record "$key.f" "$f"
            for s in a b c d; do record "$key.$s" "${R[$s]}"; done
            ratio_add "$key.af" "$(ratio "${R[a]}" "$f" 3)"
            ratio_add "$key.ad" "$(ratio "${R[a]}" "${R[d]}" 3)"
            ratio_add "$key.ab" "$(ratio "${R[a]}" "${R[b]}" 3)"
            ratio_add "$key.cf" "$(ratio "${R[c]}" "$f" 3)"
            ratio_add "$key.df" "$(ratio "${R[d]}" "$f" 3)"
        done
    done
done

med() { median ${1}; }
CPU_MODEL=$(awk -F': ' '/^model name/ { print $2; exit }' /proc/cpuinfo)
DEV=$(df -P "$IMAGES" | awk 'NR == 2 { print $1 }')
echo "## Serving from a real filesystem with the page cache bypassed"
echo
echo "- Machine: ${CPU_MODEL:-unknown CPU}, $(nproc) CPUs; images on $(stat -f -c %T "$IMAGES") ($DEV), $SIZE each; $(qemu-storage-daemon --version | head -n 1); $(fio --version)"
echo "- ROUNDS=$ROUNDS, RUNTIME=${RUNTIME}s, page cache dropped before every run, runs interleaved f a b c d f per round and workload; IOPS are medians, ratios are medians of per-round ratios."
for proto in $PROTOCOLS; do
    echo
    if [[ $proto == vhost ]]; then
        echo "### vhost-user-blk (libblkio client, vu_bench)"
    else
        echo "### NBD (fio nbd ioengine, one connection per job)"
    fi
    echo
    echo "| workload | (f) fio direct | (a) cryptblk LUKS2 | (b) qsd LUKS1 | (c) qsd raw | (d) cryptblk raw | a/f | a/d | a/b | c/f | d/f |"
    echo "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    for w in "${WORKLOADS[@]}"; do
        k=$proto.$w
        printf '| %s | %.0f | %.0f | %.0f | %.0f | %.0f | %s | %s | %s | %s | %s |\n' "${WNAME[$w]}" \
            "$(med "${IOPS[$k.f]}")" "$(med "${IOPS[$k.a]}")" "$(med "${IOPS[$k.b]}")" \
            "$(med "${IOPS[$k.c]}")" "$(med "${IOPS[$k.d]}")" \
            "$(med "${RATIO[$k.af]}")" "$(med "${RATIO[$k.ad]}")" "$(med "${RATIO[$k.ab]}")" \
            "$(med "${RATIO[$k.cf]}")" "$(med "${RATIO[$k.df]}")"
    done
done
echo
echo "Targets: a/f >= 0.9 everywhere; a/d >= 0.95; a/b >= 1.3 at 4k and >= 2 at 64k."
echo "Per-round ratios:"
for key in $(printf '%s\n' "${!RATIO[@]}" | sort); do
    echo "- $key:${RATIO[$key]}"
done
