#!/usr/bin/env bash
# Benchmark (not a test): serving a LUKS2 disk stored in Ceph RBD. Peers, all on images of the
# same payload size in the same pool, driven by fio (numjobs 1, --time_based):
#
#   (f) ceiling: fio's rbd ioengine (librbd in fio) on a plain, unencrypted image
#   (a) cryptblk serve --nbd of a LUKS2 image made by `cryptblk format rbd:POOL/IMAGE`
#       (aes-xts-plain64, 512-bit key, 4096-byte sectors); fio's nbd ioengine
#   (b) qemu-storage-daemon, driver=rbd with librbd's own LUKS2 encryption
#       (encrypt.format=luks2) on an image made by `rbd encryption format POOL/IMAGE luks2`,
#       exported over NBD; fio's nbd ioengine
#   (d) cryptblk serve --nbd of the plain image of (f), raw (the NBD path without the crypto)
#
# Workloads: 4k randread and randwrite at iodepth 32, 64k sequential read and write at
# iodepth 8. Every payload is first filled with the same SIZE bytes of incompressible data
# (through its own server for (a) and (b)) and read back and checked (sha256) through every
# peer, so reads hit written data. Every fio run gets a freshly started server; rounds
# interleave (for each round, each workload: f, a, b, d). The first table shows every round;
# the second the medians and the medians of the per-round ratios a/f, a/b, d/f (of IOPS).
# Server CPU% is the daemon's utime+stime delta over the run's wall time (100% = one core;
# fio, the OSD and the monitor share the same cores); (f) has no server. Every librbd client
# (fio, cryptblk, QEMU) runs with librbd's default cache settings from CEPH_CONF.
#
# Image features: by default object-map and fast-diff are disabled on all three images
# (FAST_DIFF=0). With them, QEMU 7.2's NBD server asks the rbd driver for block status on
# every read (the client, libnbd, negotiates structured replies and QEMU then sends holes
# sparsely), which librbd answers with rbd_diff_iterate2: measured here, (b)'s 4k randread
# fell from ~17500 to ~5300 IOPS. That is a cost of QEMU's NBD export, not of librbd's
# encryption; FAST_DIFF=1 keeps Ceph's default features to show it.
#
# Cluster: unless CEPH_CONF and POOL name an existing cluster, a throwaway single-node cluster
# is started with /work/shared/ceph/micro-ceph.sh (or $MICRO_CEPH) under BENCH_WORK
# (OBJECTSTORE=memstore by default: the OSD holds the three images in RAM) and stopped on exit.
# On an existing cluster, the images are named bench-PID-* and removed on exit.
#
# Usage: [SIZE=1G] [ROUNDS=3] [RUNTIME=10] [SERVERS="f a b d"] [FAST_DIFF=0] [KEEP=1]
#        [CEPH_CONF=PATH POOL=NAME] [OBJECTSTORE=memstore] [MON_PORT=13390] [CRYPTBLK=PATH]
#        [BENCH_DIR=DIR] scripts/bench-rbd.sh
#   SIZE: payload of every image; ROUNDS: interleaved rounds; RUNTIME: seconds per fio run;
#   SERVERS: the peers to run, a subset of "f a b d" (ratios need both sides);
#   KEEP=1: leave the cluster (or the images), the key and the logs in place and print where;
#   CRYPTBLK: a prebuilt binary (default: cargo build --release -p cryptblk);
#   BENCH_DIR: where the work directory goes (default: /dev/shm if it has room, else /tmp).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/bench-lib.sh
source scripts/bench-lib.sh

if [[ ${1:-} == -h || ${1:-} == --help ]]; then
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
    exit 0
fi
(( $# == 0 )) || die "no arguments expected (settings are environment variables; see --help)"

SIZE=${SIZE:-1G}
ROUNDS=${ROUNDS:-3}
RUNTIME=${RUNTIME:-10}
SERVERS_LIST=${SERVERS:-f a b d}
FAST_DIFF=${FAST_DIFF:-0}
KEEP=${KEEP:-}
OBJECTSTORE=${OBJECTSTORE:-memstore}
MON_PORT=${MON_PORT:-13390}
MICRO_CEPH=${MICRO_CEPH:-/work/shared/ceph/micro-ceph.sh}
SIZE_BYTES=$(bytes "$SIZE")
(( SIZE_BYTES % 65536 == 0 )) || die "SIZE must be a multiple of 64 KiB"
HDR=$((16 << 20)) # LUKS2 data offset of both `cryptblk format rbd:` and `rbd encryption format`
read -r -a SERVERS <<<"$SERVERS_LIST"
for s in "${SERVERS[@]}"; do [[ $s == [fabd] ]] || die "SERVERS: unknown peer '$s' (known: f a b d)"; done
has() { [[ " ${SERVERS[*]} " == *" $1 "* ]]; }

need fio
need rbd ceph-common
need ceph ceph-common
need nbdcopy libnbd-bin
need nbdinfo libnbd-bin
need openssl
need numfmt coreutils
need sha256sum coreutils
need jq
need awk gawk
fio --enghelp=nbd >/dev/null 2>&1 || die "this fio has no nbd ioengine (Debian's fio 3.33 has it)"
has f && { fio --enghelp=rbd >/dev/null 2>&1 || die "this fio has no rbd ioengine (Debian: apt-get install fio, built with librbd)"; }
if has b; then
    need qemu-storage-daemon qemu-system-common
    compgen -G '/usr/lib/*/qemu/block-rbd.so' >/dev/null \
        || die "qemu-storage-daemon has no rbd block driver (Debian: apt-get install qemu-block-extra)"
fi

if [[ -n ${CEPH_CONF:-} || -n ${POOL:-} ]]; then
    [[ -n ${CEPH_CONF:-} && -n ${POOL:-} ]] || die "set both CEPH_CONF and POOL to use an existing cluster"
    [[ -r $CEPH_CONF ]] || die "CEPH_CONF: cannot read $CEPH_CONF"
    OWN_CLUSTER=
    PREFIX=bench-$$-
else
    [[ -x $MICRO_CEPH ]] || die "$MICRO_CEPH not found: set MICRO_CEPH, or CEPH_CONF and POOL for an existing cluster"
    need ceph-mon ceph-mon
    need ceph-osd ceph-osd
    OWN_CLUSTER=1
    POOL=rbd
    PREFIX=
fi

cryptblk_bin
BIN_ORIG=$BIN

# The random source (the OSD's memstore is its own process, not in BENCH_DIR).
NEED_KIB=$(( (SIZE_BYTES + (256 << 20)) / 1024 ))
if [[ -z ${BENCH_DIR:-} ]]; then
    BENCH_DIR=${TMPDIR:-/tmp}
    if [[ -d /dev/shm ]] && (( $(df -Pk /dev/shm | awk 'NR == 2 { print $4 }') > NEED_KIB )); then
        BENCH_DIR=/dev/shm
    fi
fi
mkdir -p "$BENCH_DIR"
BENCH_WORK=$(mktemp -d "$BENCH_DIR/cryptblk-bench-rbd.XXXXXX")
export BENCH_WORK
(( $(df -Pk "$BENCH_WORK" | awk 'NR == 2 { print $4 }') > NEED_KIB )) \
    || die "$BENCH_WORK needs room for a $SIZE file"
CLUSTER_DIR=$BENCH_WORK/ceph
IMAGES=()

# Every daemon started is recorded here and killed on exit, whatever happens; then the images
# (existing cluster) or the whole cluster (own) go, unless KEEP=1.
declare -A DAEMON_PID=()
cleanup() {
    local pid img
    for pid in "${DAEMON_PID[@]}"; do
        [[ -n $pid ]] && kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null
    done
    if [[ $KEEP == 1 ]]; then
        log "bench: KEEP=1: kept $BENCH_WORK (key, logs)"
        if [[ -n $OWN_CLUSTER ]]; then
            log "bench: cluster still running: export CEPH_CONF=$CLUSTER_DIR/ceph.conf; stop it with: $MICRO_CEPH stop $CLUSTER_DIR"
        else
            log "bench: images kept in pool $POOL: ${IMAGES[*]}"
        fi
        return
    fi
    if [[ -n $OWN_CLUSTER ]]; then
        [[ -e $CLUSTER_DIR/ceph.conf ]] && "$MICRO_CEPH" stop "$CLUSTER_DIR" >/dev/null 2>&1
    else
        for img in "${IMAGES[@]}"; do rbd rm --no-progress "$POOL/$img" >/dev/null 2>&1 || log "bench: could not remove $POOL/$img"; done
    fi
    rm -rf "$BENCH_WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
# Work on a private copy: other builds in this tree may replace target/release/cryptblk mid-run.
cp "$BIN" "$BENCH_WORK/cryptblk"
BIN=$BENCH_WORK/cryptblk

if [[ -n $OWN_CLUSTER ]]; then
    # memstore keeps every object in the OSD's RAM: three payloads, two headers, slack.
    OSD_GB=$(( (3 * SIZE_BYTES + 2 * HDR + (1 << 30) + (1 << 30) - 1) >> 30 ))
    log "+ OBJECTSTORE=$OBJECTSTORE OSD_SIZE_GB=$OSD_GB MON_PORT=$MON_PORT $MICRO_CEPH start $CLUSTER_DIR"
    OBJECTSTORE=$OBJECTSTORE OSD_SIZE_GB=$OSD_GB MON_PORT=$MON_PORT "$MICRO_CEPH" start "$CLUSTER_DIR" \
        >"$BENCH_WORK/micro-ceph.log" 2>&1 || { cat "$BENCH_WORK/micro-ceph.log" >&2; die "could not start a Ceph cluster (another one on MON_PORT=$MON_PORT?)"; }
    CEPH_CONF=$CLUSTER_DIR/ceph.conf
fi
export CEPH_CONF
CONF=$(realpath "$CEPH_CONF")

LOADS=()
LOADS+=("$(load1)")
KEY=$BENCH_WORK/key
head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$KEY"
SRC=$BENCH_WORK/src.bin
random_file "$SRC" "$SIZE_BYTES"
SRC_SHA=$(sha256sum <"$SRC" | awk '{ print $1 }')

IMG_PLAIN=${PREFIX}plain
IMG_CB=${PREFIX}img
IMG_RBD=${PREFIX}img2
declare -A EXPORT=([a]=$IMG_CB [b]=$IMG_RBD [d]=$IMG_PLAIN)

# no_fast_diff IMAGE: unless FAST_DIFF=1, disable object-map and fast-diff (see the top).
no_fast_diff() {
    [[ $FAST_DIFF == 1 ]] && return 0
    local f
    local -a off=()
    f=$(rbd info "$POOL/$1" --format json | jq -r '.features | join(",")')
    # In one call: fast-diff depends on object-map (and disabling it alone takes both away here).
    [[ ,$f, == *,fast-diff,* ]] && off+=(fast-diff)
    [[ ,$f, == *,object-map,* ]] && off+=(object-map)
    (( ${#off[@]} == 0 )) && return 0
    log "+ rbd feature disable $POOL/$1 ${off[*]}"
    rbd feature disable "$POOL/$1" "${off[@]}"
}

# (f)/(d): the plain image, filled with the source.
log "+ rbd import --no-progress $SRC $POOL/$IMG_PLAIN"
IMAGES+=("$IMG_PLAIN")
rbd import --no-progress "$SRC" "$POOL/$IMG_PLAIN"
no_fast_diff "$IMG_PLAIN"
# (a): made by cryptblk.
log "+ $BIN format --batch-mode --key-file KEY --pbkdf pbkdf2 --iter-time 10 rbd:$POOL/$IMG_CB:conf=$CONF $SIZE_BYTES"
IMAGES+=("$IMG_CB")
"$BIN" format --batch-mode --key-file "$KEY" --pbkdf pbkdf2 --iter-time 10 \
    "rbd:$POOL/$IMG_CB:conf=$CONF" "$SIZE_BYTES" >/dev/null
no_fast_diff "$IMG_CB"
# (b): made by librbd. `rbd encryption format` has no PBKDF options: argon2id, ~1 GiB of
# memory and 10-20 s here to format, 2-3 s to open (once per server start, before measuring).
if has b; then
    log "+ rbd create --size $((SIZE_BYTES + HDR))B $POOL/$IMG_RBD && rbd encryption format $POOL/$IMG_RBD luks2 KEY"
    IMAGES+=("$IMG_RBD")
    rbd create --size "$((SIZE_BYTES + HDR))B" "$POOL/$IMG_RBD"
    no_fast_diff "$IMG_RBD"
    rbd encryption format "$POOL/$IMG_RBD" luks2 "$KEY" 2>"$BENCH_WORK/rbd-encryption-format.log" \
        || { cat "$BENCH_WORK/rbd-encryption-format.log" >&2; die "rbd encryption format failed"; }
fi

declare -A SERVER_NAME=(
    [f]="fio rbd engine, plain image (ceiling)"
    [a]="cryptblk serve --nbd, LUKS2 by cryptblk format"
    [b]="qemu-storage-daemon rbd encrypt.format=luks2 (librbd), NBD"
    [d]="cryptblk serve --nbd, plain image raw"
)
uri() { echo "nbd+unix:///${EXPORT[$1]}?socket=$BENCH_WORK/$1.sock"; }

# start_server S: starts server S (a, b or d) exporting its image on $BENCH_WORK/S.sock.
start_server() {
    local s=$1 sock=$BENCH_WORK/$1.sock
    local -a cmd
    rm -f "$sock"
    case $s in
        a) cmd=("$BIN" serve --image "rbd:$POOL/$IMG_CB:conf=$CONF" --key-file "$KEY" --nbd "unix:$sock") ;;
        d) cmd=("$BIN" serve --image "rbd:$POOL/$IMG_PLAIN:conf=$CONF" --nbd "unix:$sock") ;;
        b) cmd=(qemu-storage-daemon --object "secret,id=s0,file=$KEY"
                --blockdev "driver=rbd,node-name=d0,pool=$POOL,image=$IMG_RBD,conf=$CONF,encrypt.format=luks2,encrypt.key-secret=s0"
                --nbd-server "addr.type=unix,addr.path=$sock"
                --export "type=nbd,id=e0,node-name=d0,name=$IMG_RBD,writable=on") ;;
    esac
    log "+ ${cmd[*]}"
    "${cmd[@]}" >"$BENCH_WORK/$s.log" 2>&1 &
    DAEMON_PID[$s]=$!
    wait_nbd "$(uri "$s")" "${DAEMON_PID[$s]}" "$BENCH_WORK/$s.log" 90
    local got
    got=$(nbdinfo --size "$(uri "$s")")
    [[ $got -eq $SIZE_BYTES ]] || die "server $s exports $got bytes, expected $SIZE_BYTES"
}

# stop_server S: SIGTERM, which also releases the image's exclusive lock for the next client.
stop_server() {
    local s=$1 pid=${DAEMON_PID[$1]}
    kill "$pid" 2>/dev/null || true
    local rc=0
    wait "$pid" 2>/dev/null || rc=$?
    DAEMON_PID[$s]=
    (( rc == 0 || rc == 143 )) || { cat "$BENCH_WORK/$s.log" >&2; log "bench: server $s exited with status $rc on SIGTERM"; }
}

# Fill each LUKS payload with the source through its own server, then read every peer back.
for s in a b; do
    has "$s" || continue
    start_server "$s"
    log "+ nbdcopy --flush $SRC '$(uri "$s")'"
    nbdcopy --flush "$SRC" "$(uri "$s")"
    stop_server "$s"
done
for s in f a b d; do
    has "$s" || continue
    if [[ $s == f ]]; then
        log "+ rbd export --no-progress $POOL/$IMG_PLAIN - | sha256sum"
        got=$(rbd export --no-progress "$POOL/$IMG_PLAIN" - | sha256sum | awk '{ print $1 }')
    else
        start_server "$s"
        log "+ nbdcopy '$(uri "$s")' - | sha256sum"
        got=$(nbdcopy "$(uri "$s")" - | sha256sum | awk '{ print $1 }')
        stop_server "$s"
    fi
    [[ $got == "$SRC_SHA" ]] || die "peer $s (${SERVER_NAME[$s]}) does not read back the data written"
done
rm -f "$SRC"

# fio_rbd JSON FIO-ARGS...: like fio_nbd (bench-lib.sh), with the rbd ioengine on the plain image.
fio_rbd() {
    local json=$1
    shift
    log "+ CEPH_CONF=$CEPH_CONF fio --ioengine=rbd --clientname=admin --pool=$POOL --rbdname=$IMG_PLAIN --group_reporting --output-format=json $*"
    fio --ioengine=rbd --clientname=admin --pool="$POOL" --rbdname="$IMG_PLAIN" --group_reporting \
        --output-format=json --output="$json" "$@" >"$json.log" 2>&1 \
        || { cat "$json.log" "$json" >&2; die "fio (rbd) failed"; }
    jq -e '.jobs[0].error == 0' "$json" >/dev/null || { cat "$json" >&2; die "fio (rbd) reported an error"; }
    jq -r '.jobs[0] | "\(.read.iops + .write.iops) \(.read.bw_bytes + .write.bw_bytes)"' "$json"
}

WORKLOADS=(randread-4k randwrite-4k read-64k write-64k)
declare -A W_ARGS=(
    [randread-4k]="--rw=randread --bs=4k --iodepth=32"
    [randwrite-4k]="--rw=randwrite --bs=4k --iodepth=32"
    [read-64k]="--rw=read --bs=64k --iodepth=8"
    [write-64k]="--rw=write --bs=64k --iodepth=8"
)
# Per round R, workload W, peer S: R_IOPS[R.W.S], R_MIBS[...], R_CPU[...].
declare -A R_IOPS R_MIBS R_CPU

# run_fio ROUND WORKLOAD PEER: one fio run (against a fresh server unless PEER is f).
run_fio() {
    local r=$1 w=$2 s=$3 pid= c0 c1 t0 t1 res cpu=- iops bps
    # shellcheck disable=SC2206 # W_ARGS holds several options
    local -a args=(--name="$w" ${W_ARGS[$w]} --numjobs=1 --time_based --runtime="$RUNTIME")
    if [[ $s == f ]]; then
        LOADS+=("$(load1)")
        res=$(fio_rbd "$BENCH_WORK/fio.json" "${args[@]}")
    else
        start_server "$s"
        pid=${DAEMON_PID[$s]}
        LOADS+=("$(load1)")
        c0=$(proc_cpu_ticks "$pid"); t0=$(now_s)
        res=$(fio_nbd "$(uri "$s")" "$BENCH_WORK/fio.json" "${args[@]}")
        t1=$(now_s); c1=$(proc_cpu_ticks "$pid")
        stop_server "$s"
        cpu=$(cpu_pct_of $((c1 - c0)) "$(elapsed "$t0" "$t1")")
    fi
    read -r iops bps <<<"$res"
    R_IOPS[$r.$w.$s]=$iops
    R_MIBS[$r.$w.$s]=$(awk -v b="$bps" 'BEGIN { printf "%.1f", b / 1048576 }')
    R_CPU[$r.$w.$s]=$cpu
    log "  round $r $s $w: $(printf '%.0f' "$iops") IOPS, ${R_MIBS[$r.$w.$s]} MiB/s, server CPU ${cpu}%, load $(load1)"
}

for round in $(seq "$ROUNDS"); do
    log "round $round of $ROUNDS (load average $(cut -d' ' -f1-3 /proc/loadavg))"
    for w in "${WORKLOADS[@]}"; do
        for s in "${SERVERS[@]}"; do
            run_fio "$round" "$w" "$s"
        done
    done
done
LOADS+=("$(load1)")

fmt0() { awk -v v="$1" 'BEGIN { if (v == "n/a" || v == "") print "n/a"; else printf "%.0f", v }'; }
get() { # ARRAY KEY: the value, or n/a
    local -n arr=$1
    echo "${arr[$2]:-n/a}"
}
RATIOS=("a f" "a b" "d f")

CPU_MODEL=$(awk -F': ' '/^model name/ { print $2; exit }' /proc/cpuinfo)
LOAD_MED=$(median "${LOADS[@]}")
LOAD_MAX=$(max "${LOADS[@]}")
echo
echo "## LUKS2 on Ceph RBD: cryptblk serve --nbd vs librbd encryption in qemu-storage-daemon vs fio rbd"
echo
echo "- Machine: ${CPU_MODEL:-unknown CPU}, $(nproc) CPUs; $(fio --version); $(rbd --version | awk '{ print $1, $2, $3 }')$(has b && echo "; $(qemu-storage-daemon --version | head -n 1)")"
echo "- cryptblk: $BIN_ORIG ($(git rev-parse --short HEAD 2>/dev/null || echo unknown commit)$(git diff --quiet HEAD -- crates 2>/dev/null || echo ', uncommitted changes in crates/'))"
if [[ -n $OWN_CLUSTER ]]; then
    echo "- Cluster: throwaway single node (1 mon, 1 OSD, $OBJECTSTORE, pool size 1) on this machine, by $MICRO_CEPH."
else
    echo "- Cluster: existing, $CEPH_CONF, pool $POOL."
fi
echo "- Images: $SIZE ($SIZE_BYTES bytes) payload each, filled with the same incompressible data (verified through every peer); object-map/fast-diff $([[ $FAST_DIFF == 1 ]] && echo "as created" || echo "disabled (FAST_DIFF=0)")."
echo "- ROUNDS=$ROUNDS, RUNTIME=${RUNTIME}s per fio run, numjobs 1, a fresh server per run; 4k at iodepth 32, 64k at iodepth 8."
echo "- 1-minute load average sampled before each run: median $LOAD_MED, max $LOAD_MAX on $(nproc) CPUs$(awk -v l="$LOAD_MED" -v n="$(nproc)" 'BEGIN { if (l > n * 0.75) printf " -- HIGH: other work shared the CPUs, figures are noisy and depressed" }')."
echo
head="| workload | round"
sep="|---|---:"
for s in "${SERVERS[@]}"; do head+=" | IOPS $s"; sep+="|---:"; done
for s in "${SERVERS[@]}"; do head+=" | MiB/s $s"; sep+="|---:"; done
for s in "${SERVERS[@]}"; do [[ $s == f ]] || { head+=" | CPU% $s"; sep+="|---:"; }; done
for p in "${RATIOS[@]}"; do read -r x y <<<"$p"; head+=" | $x/$y"; sep+="|---:"; done
echo "$head |"
echo "$sep|"
declare -A PER_RATIO
for w in "${WORKLOADS[@]}"; do
    for round in $(seq "$ROUNDS"); do
        line="| $w | $round"
        for s in "${SERVERS[@]}"; do line+=" | $(fmt0 "$(get R_IOPS "$round.$w.$s")")"; done
        for s in "${SERVERS[@]}"; do line+=" | $(get R_MIBS "$round.$w.$s")"; done
        for s in "${SERVERS[@]}"; do [[ $s == f ]] || line+=" | $(get R_CPU "$round.$w.$s")"; done
        for p in "${RATIOS[@]}"; do
            read -r x y <<<"$p"
            rt=n/a
            has "$x" && has "$y" && rt=$(ratio "${R_IOPS[$round.$w.$x]}" "${R_IOPS[$round.$w.$y]}" 3)
            [[ $rt != n/a ]] && PER_RATIO[$w.$x$y]="${PER_RATIO[$w.$x$y]:-} $rt"
            line+=" | $rt"
        done
        echo "$line |"
    done
done
echo
head="| workload"
sep="|---"
for s in "${SERVERS[@]}"; do head+=" | IOPS $s"; sep+="|---:"; done
for s in "${SERVERS[@]}"; do head+=" | MiB/s $s"; sep+="|---:"; done
for p in "${RATIOS[@]}"; do read -r x y <<<"$p"; head+=" | $x/$y"; sep+="|---:"; done
echo "$head |"
echo "$sep|"
for w in "${WORKLOADS[@]}"; do
    line="| $w"
    for s in "${SERVERS[@]}"; do
        v=(); for round in $(seq "$ROUNDS"); do v+=("${R_IOPS[$round.$w.$s]}"); done
        line+=" | $(fmt0 "$(median "${v[@]}")")"
    done
    for s in "${SERVERS[@]}"; do
        v=(); for round in $(seq "$ROUNDS"); do v+=("${R_MIBS[$round.$w.$s]}"); done
        line+=" | $(median "${v[@]}")"
    done
    for p in "${RATIOS[@]}"; do
        read -r x y <<<"$p"
        # shellcheck disable=SC2086 # word splitting of the recorded list is intended
        if [[ -n ${PER_RATIO[$w.$x$y]:-} ]]; then line+=" | $(printf '%.2f' "$(median ${PER_RATIO[$w.$x$y]})")"; else line+=" | n/a"; fi
    done
    echo "$line |"
done
echo
echo "Peers: $(for s in "${SERVERS[@]}"; do printf '(%s) %s; ' "$s" "${SERVER_NAME[$s]}"; done | sed 's/; $/./')"
echo "First table: every round (ratios of IOPS within the round); second: medians over rounds, ratios = medians of the per-round ratios."
