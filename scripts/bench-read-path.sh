#!/usr/bin/env bash
# Benchmark (not a test): where the encrypted path loses against the plain one on a real disk.
# One LUKS2 image and its raw twin (the same plaintext) on BENCH_DIR (not tmpfs), served by the
# same cryptblk binary over vhost-user-blk (libblkio client, vu_bench), `--cache none`, one
# queue, the page cache dropped before every run. Per round and workload, interleaved:
#   fraw   fio --direct=1 --ioengine=io_uring on the raw twin (the device's ceiling)
#   fluks  the same on the LUKS2 image's payload (the ciphertext: the same file a serves)
#   fdec   the encryptor's ceiling on that payload: the same reads on one thread, each buffer
#          decrypted in place as it completes (`cryptblk-bench ceiling --touch decrypt`; reads
#          only). On some machines reading what a device has just written slows the device
#          itself; no encrypted server can beat this figure.
#   d      cryptblk serving the raw twin
#   a      cryptblk serving the LUKS2 image
#   o      cryptblk OLD serving the LUKS2 image (when OLD=path/to/older/cryptblk is given)
# Prints one line per run and, at the end, the median and the worst per-round ratio of a/d,
# a/fluks, a/fdec, fdec/fluks (the machine's toll for decrypting at all) and o/d. The two files may sit on different parts of the disk, which on this
# machine's virtual disk differ by up to 30 % from minute to minute: fluks says how much of an
# a/d gap is the file's, not the server's.
#
# Environment: ROUNDS (3), RUNTIME (seconds per run, 5), SIZE (8G), WORKLOADS ("read:65536:16
# randread:4096:128 read:65536:4 randwrite:4096:32 write:65536:16", rw:bs:depth),
# QUEUES (1: virtqueues served, vu_bench queues and fio jobs, each at the workload's depth),
# BENCH_DIR (/var/tmp), KEEP_IMAGES=1 to reuse the images, CRYPTBLK / VU_BENCH / BENCH
# (prebuilt cryptblk, vu_bench, cryptblk-bench).
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-3}
RUNTIME=${RUNTIME:-5}
SIZE=${SIZE:-8G}
WORKLOADS=${WORKLOADS:-"read:65536:16 randread:4096:128 read:65536:4 randwrite:4096:32 write:65536:16"}
QUEUES=${QUEUES:-1}
BENCH_DIR=${BENCH_DIR:-/var/tmp}
die() { echo "bench-read-path: $*" >&2; exit 1; }
for tool in fio jq openssl awk; do command -v $tool >/dev/null || die "$tool is needed (scripts/install-deps.sh)"; done
[[ $(id -u) -eq 0 ]] || die "run as root: the page cache is dropped before every run"
if [[ -z ${CRYPTBLK:-} || -z ${VU_BENCH:-} || -z ${BENCH:-} ]]; then
    cargo build --release -p cryptblk -p cryptblk-vhost-user-blk -p cryptblk-bench \
        --bin cryptblk --bin cryptblk-bench --example vu_bench
fi
CEILING=${BENCH:-${CARGO_TARGET_DIR:-target}/release/cryptblk-bench}
BIN=${CRYPTBLK:-${CARGO_TARGET_DIR:-target}/release/cryptblk}
VU=${VU_BENCH:-${CARGO_TARGET_DIR:-target}/release/examples/vu_bench}
[[ $(stat -f -c %T "$BENCH_DIR") != tmpfs ]] || die "$BENCH_DIR is tmpfs: this measures a real disk"
IMG=$BENCH_DIR/cryptblk-bench-read-path
mkdir -p "$IMG"
WORK=$(mktemp -d)
SERVER=
cleanup() {
    [[ -n $SERVER ]] && kill "$SERVER" 2>/dev/null && wait "$SERVER" 2>/dev/null
    rm -rf "$WORK"
    [[ ${KEEP_IMAGES:-} == 1 ]] || rm -rf "$IMG"
}
trap cleanup EXIT
printf 'bench' >"$WORK/key"
if [[ ! -f $IMG/luks.img ]]; then
    echo "writing $SIZE of random data and its LUKS2 twin to $IMG (minutes)" >&2
    # (openssl ends on SIGPIPE when head has enough: not a failure of the pipeline.)
    head -c "$(numfmt --from=iec "$SIZE")" \
        < <(openssl enc -aes-128-ctr -pass pass:bench -nosalt -pbkdf2 </dev/zero 2>/dev/null) \
        >"$IMG/raw.img"
    "$BIN" format -q --pbkdf pbkdf2 --pbkdf-force-iterations 1000 -d "$WORK/key" "$IMG/luks.img" "$SIZE" >/dev/null
    "$BIN" convert -n -O luks --key-file "$WORK/key" "$IMG/raw.img" "$IMG/luks.img" >/dev/null
fi
cp "$WORK/key" "$IMG/key"
data_offset=$("$BIN" dump --json "$IMG/luks.img" | jq -r .data_offset)
ticks() { awk '{ print $14 + $15 }' "/proc/$1/stat"; }
drop_caches() { sync; echo 3 >/proc/sys/vm/drop_caches; }
run() { # $1 peer, $2 rw, $3 bs, $4 depth -> prints "iops cpu_us_per_io"
    local peer=$1 rw=$2 bs=$3 depth=$4 file offset=0 kind=read out
    drop_caches
    case $peer in
    fraw | fluks)
        file=$IMG/raw.img
        [[ $peer == fluks ]] && { file=$IMG/luks.img; offset=$data_offset; }
        [[ $rw == *write ]] && kind=write
        out=$(fio --name=p --filename="$file" --offset="$offset" --size="$SIZE" --direct=1 \
            --ioengine=io_uring --rw="$rw" --bs="$bs" --iodepth="$depth" --runtime="$RUNTIME" \
            --time_based --numjobs="$QUEUES" --group_reporting --output-format=json)
        echo "$(jq ".jobs[0].$kind.iops" <<<"$out") -"
        ;;
    fdec)
        # (one thread: the ceiling of one queue)
        [[ ($rw == randread || $rw == read) && $QUEUES == 1 ]] || { echo "- -"; return; }
        out=$("$CEILING" ceiling "$IMG/luks.img" --offset "$data_offset" --rw "$rw" \
            --bs "$bs" --iodepth "$depth" --runtime "$RUNTIME" --touch decrypt)
        echo "$(jq '.iops' <<<"$out") -"
        ;;
    *)
        local bin=$BIN image=$IMG/luks.img key=(--key-file "$IMG/key")
        [[ $peer == o ]] && bin=$OLD
        [[ $peer == d ]] && { image=$IMG/raw.img; key=(); }
        # libblkio's memory is not sealed against shrinking: a server that checks says so.
        # vu_bench's ring holds three descriptors per request in flight (512 entries at depth
        # 128; a 256-entry ring would cap it at 85): the server offers the largest.
        local unsealed=
        "$bin" serve --help | grep -q -- --unsealed-memory && unsealed=--unsealed-memory
        rm -f "$WORK/s.sock"
        "$bin" serve --vhost-user-blk "$WORK/s.sock" --image "$image" "${key[@]}" --cache none \
            --num-queues "$QUEUES" --queue-size 1024 $unsealed \
            >"$WORK/server.log" 2>&1 &
        SERVER=$!
        for _ in $(seq 200); do [[ -S $WORK/s.sock ]] && break; sleep 0.05; done
        local t0 c0 t1 c1
        c0=$(ticks "$SERVER"); t0=$(date +%s.%N)
        out=$("$VU" --socket "$WORK/s.sock" --rw "$rw" --bs "$bs" --iodepth "$depth" \
            --runtime "$RUNTIME" --queues "$QUEUES")
        c1=$(ticks "$SERVER"); t1=$(date +%s.%N)
        kill "$SERVER"; wait "$SERVER" 2>/dev/null || true; SERVER=
        local iops; iops=$(jq '.iops' <<<"$out")
        # CPU% x 10^4 / IOPS = µs of server CPU per request (ticks are 1/100 s).
        echo "$iops $(awk -v c="$((c1 - c0))" -v t0="$t0" -v t1="$t1" -v i="$iops" \
            'BEGIN { printf "%.2f", c / (t1 - t0) * 10000 / i }')"
        ;;
    esac
}
peers="fraw fluks fdec d a"
[[ -n ${OLD:-} ]] && peers="$peers o"
results=$WORK/results
for round in $(seq "$ROUNDS"); do
    for wl in $WORKLOADS; do
        IFS=: read -r rw bs depth <<<"$wl"
        for peer in $peers; do
            read -r iops cpu < <(run "$peer" "$rw" "$bs" "$depth")
            [[ $iops == - ]] && continue
            printf 'round %s %-18s %-6s %9.0f IOPS  server CPU/IO %s µs\n' "$round" "$wl" "$peer" "$iops" "$cpu"
            echo "$round $wl $peer $iops" >>"$results"
        done
    done
done
echo
echo "ratios per workload: median of the per-round ratios (worst round)"
for wl in $WORKLOADS; do
    for pair in a/d a/fluks a/fdec fdec/fluks ${OLD:+o/d}; do
        num=${pair%/*} den=${pair#*/}
        awk -v wl="$wl" -v num="$num" -v den="$den" '
            $2 == wl && $3 == num { n[$1] = $4 }
            $2 == wl && $3 == den { d[$1] = $4 }
            END { for (r in n) if (d[r] > 0) print n[r] / d[r] }' "$results" | sort -g \
            | awk -v wl="$wl" -v pair="$pair" '
                { r[NR] = $1 }
                END {
                    if (NR == 0) exit
                    med = (NR % 2) ? r[(NR + 1) / 2] : (r[NR / 2] + r[NR / 2 + 1]) / 2
                    printf "  %-18s %-10s %.2f (worst %.2f)\n", wl, pair, med, r[1]
                }'
    done
done
