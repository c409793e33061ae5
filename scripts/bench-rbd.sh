#!/usr/bin/env bash
# Benchmark (not a test): serving a LUKS disk stored in Ceph RBD. The throughput part is also
# `cryptblk-bench run --preset rbd` (crates/bench; JSON records, same peers); the hand-off
# section below is only here. Peers, all on images of the same payload size in the same pool
# of the same cluster:
#
#   (f)  ceiling: fio's rbd ioengine (librbd in fio, one client) on a plain, unencrypted image
#   (a)  cryptblk serve, a LUKS2 image made by `cryptblk format rbd:POOL/IMAGE`
#        (aes-xts-plain64, 512-bit key, 4096-byte sectors)
#   (b)  qemu-storage-daemon, driver=rbd with librbd's own LUKS2 encryption
#        (encrypt.format=luks2) on an image made by `rbd encryption format POOL/IMAGE luks2`
#   (b') qemu-storage-daemon, QEMU's LUKS1 (driver=luks) over driver=rbd, on a LUKS1 image made
#        by `qemu-img create -f luks` (aes-xts-plain64, 512-bit key, 512-byte sectors) in a file
#        and `rbd import`ed
#   (c)  qemu-storage-daemon, driver=rbd, the plain image of (f) raw (no encryption)
#   (d)  cryptblk serve, the plain image of (f) raw (cryptblk's path without the crypto)
#
# Transports (TRANSPORTS): every server peer (a, b, b', c, d) is measured over each of
#   nbd         exported over NBD on a Unix socket; fio's nbd ioengine (numjobs 1, --time_based)
#   vhost-user  exported as vhost-user-blk (cryptblk serve --vhost-user-blk, qemu-storage-daemon
#               --export type=vhost-user-blk, one queue); the repo's libblkio client vu_bench
#               (crates/vhost-user-blk/examples/vu_bench.rs, one queue, blocking completion waits)
# (f) has no server: its one fio rbd run per round and workload is the ceiling of both transports.
#
# Workloads: 4k randread and randwrite at iodepth 32, 64k sequential read and write at
# iodepth 16. Every payload is first filled with the same SIZE bytes of incompressible data
# (through its own server, over NBD, for (a), (b) and (b')) and read back and checked (sha256)
# through every peer (over NBD; the vhost-user exports serve the same images from the same
# daemons), so reads hit written data. Every run gets a freshly started server; rounds
# interleave: for each round, each workload: f, then for each transport a, b, b', c, d. For
# each transport, the first table shows every round, the second the medians and the medians of
# the per-round ratios a/f, a/b, a/b', a/c, d/f (of IOPS); then the issue's targets (a/f >= 0.9
# at every workload; a/b >= 1.5 at 4k and >= 3 at 64k) are checked against those medians.
# Server CPU% is the daemon's utime+stime delta over the run's wall time (100% = one core;
# the client, the OSD and the monitor share the same cores); (f) has no server. Every librbd
# client (fio, cryptblk, QEMU) runs with librbd's default cache settings from CEPH_CONF.
#
# Shared-storage hand-off (section `handoff`, after the throughput section): the issue's
# migration downtime with `migrate-start --shared` (targets: < 100 ms at idle, < 500 ms under
# 4k write load). Two cryptblk daemons (serve --control, --nbd) on the LUKS2 image of (a):
# daemon A serves it as disk "vol", daemon B waits with no disk. First qemu-io writes a
# pattern (0x5a at payload offset 1 MiB, 1 MiB long) through A's NBD export and flushes. Then
# 2 x HANDOFF_ROUNDS hand-offs, idle and loaded interleaved (idle, loaded; loaded, idle; ...,
# so that both run in both directions): the daemon without the disk listens
# (migrate-incoming vol --image rbd:... --nbd-export), the one serving it runs
# migrate-start --shared, migrate-switchover, waits for phase "completed" and, once the
# destination lists the disk as attached, disk-remove; the receiver is the next source
# (A -> B -> A ...), after a 1 s pause. Loaded: fio (nbd ioengine, 4k randwrite,
# iodepth 32, at payload offsets 4 MiB and up, --continue_on_error=all) runs against the
# source's export from 2 s before the switchover until the destination serves the disk (fio
# then sees I/O errors on the fenced source; it is stopped, its errors ignored). The figure
# is the source's `downtime-ms` (migrate-status: from the fence until the destination holds
# the image's lock and answered). Every hand-off is listed, then median and max at idle and
# loaded against the targets; finally the pattern must read back (qemu-io read -P 0x5a)
# through the last holder's export, else the script fails. Run alone with SECTIONS=handoff
# (then the other images are not made and SERVERS/TRANSPORTS are ignored).
#
# Image features: by default object-map and fast-diff are disabled on all images
# (FAST_DIFF=0). With them, QEMU 7.2's NBD server asks the rbd driver for block status on
# every read (the client, libnbd, negotiates structured replies and QEMU then sends holes
# sparsely), which librbd answers with rbd_diff_iterate2: measured here, (b)'s 4k randread
# fell from ~17500 to ~5300 IOPS. That is a cost of QEMU's NBD export, not of librbd's
# encryption (vhost-user has no block status); FAST_DIFF=1 keeps Ceph's default features.
#
# Cluster: unless CEPH_CONF and POOL name an existing cluster, this script starts a throwaway
# single-node cluster under BENCH_WORK (the steps of crates/testutil/src/ceph.rs: one monitor
# on 127.0.0.1:MON_PORT, no mgr, one OSD, auth off, pool `rbd` of size 1; OBJECTSTORE=memstore
# by default, which holds the four images in the OSD's RAM, or bluestore on a sparse file in
# BENCH_WORK) and kills its daemons by PID on exit. On an existing cluster, the images are
# named bench-PID-* and removed on exit.
#
# Usage: [SIZE=1G] [ROUNDS=3] [RUNTIME=10] [SERVERS="f a b b' c d"] [TRANSPORTS="nbd vhost-user"]
#        [FAST_DIFF=0] [KEEP=1] [CEPH_CONF=PATH POOL=NAME] [OBJECTSTORE=memstore|bluestore]
#        [MON_PORT=13390] [CRYPTBLK=PATH] [VU_BENCH=PATH] [BENCH_DIR=DIR]
#        [SECTIONS="throughput handoff"] [HANDOFF_ROUNDS=5] scripts/bench-rbd.sh
#   SIZE: payload of every image (at least 8M with the handoff section);
#   ROUNDS: interleaved rounds; RUNTIME: seconds per run;
#   SERVERS: the peers to run, a subset of "f a b b' c d" (ratios need both sides);
#   TRANSPORTS: a subset of "nbd vhost-user";
#   KEEP=1: leave the cluster (or the images), the key and the logs in place and print where;
#   CRYPTBLK, VU_BENCH: prebuilt binaries (default: cargo build --release of what is missing:
#   -p cryptblk --bin cryptblk, -p cryptblk-vhost-user-blk --example vu_bench);
#   BENCH_DIR: where the work directory goes (default: /dev/shm if it has room, else /tmp);
#   SECTIONS: what to run, a subset of "throughput handoff" (throughput: the peers' tables);
#   HANDOFF_ROUNDS: idle and loaded hand-offs each (0 skips the handoff section).
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
SERVERS_LIST=${SERVERS:-f a b b\' c d}
TRANSPORTS_LIST=${TRANSPORTS:-nbd vhost-user}
FAST_DIFF=${FAST_DIFF:-0}
KEEP=${KEEP:-}
OBJECTSTORE=${OBJECTSTORE:-memstore}
MON_PORT=${MON_PORT:-13390}
SIZE_BYTES=$(bytes "$SIZE")
(( SIZE_BYTES % 65536 == 0 )) || die "SIZE must be a multiple of 64 KiB"
[[ $ROUNDS =~ ^[1-9][0-9]*$ ]] || die "ROUNDS must be a positive integer"
[[ $RUNTIME =~ ^[1-9][0-9]*$ ]] || die "RUNTIME must be a positive number of seconds"
[[ $OBJECTSTORE == memstore || $OBJECTSTORE == bluestore ]] || die "OBJECTSTORE: memstore or bluestore"
HDR=$((16 << 20)) # LUKS2 data offset of both `cryptblk format rbd:` and `rbd encryption format`
SECTIONS_LIST=${SECTIONS:-throughput handoff}
HANDOFF_ROUNDS=${HANDOFF_ROUNDS:-5}
[[ $HANDOFF_ROUNDS =~ ^[0-9]+$ ]] || die "HANDOFF_ROUNDS must be a number (0 skips the handoff section)"
DO_TP='' DO_HO=''
read -r -a SECTIONS_A <<<"$SECTIONS_LIST"
for sec in "${SECTIONS_A[@]}"; do
    case $sec in
        throughput) DO_TP=1 ;;
        handoff) (( HANDOFF_ROUNDS > 0 )) && DO_HO=1 ;;
        *) die "SECTIONS: unknown section '$sec' (known: throughput handoff)" ;;
    esac
done
[[ -n $DO_TP || -n $DO_HO ]] || die "nothing to run (SECTIONS=\"$SECTIONS_LIST\", HANDOFF_ROUNDS=$HANDOFF_ROUNDS)"
[[ -z $DO_HO ]] || (( SIZE_BYTES >= 8 << 20 )) || die "SIZE must be at least 8M for the handoff section"
SERVERS=() TRANSPORTS=()
if [[ -n $DO_TP ]]; then
    read -r -a SERVERS <<<"$SERVERS_LIST"
    for s in "${SERVERS[@]}"; do
        case $s in f | a | b | "b'" | c | d) ;; *) die "SERVERS: unknown peer '$s' (known: f a b b' c d)" ;; esac
    done
    read -r -a TRANSPORTS <<<"$TRANSPORTS_LIST"
    (( ${#TRANSPORTS[@]} > 0 )) || die "TRANSPORTS is empty"
    for t in "${TRANSPORTS[@]}"; do
        [[ $t == nbd || $t == vhost-user ]] || die "TRANSPORTS: unknown transport '$t' (known: nbd vhost-user)"
    done
fi
has() { [[ " ${SERVERS[*]} " == *" $1 "* ]]; }
has_transport() { [[ " ${TRANSPORTS[*]} " == *" $1 "* ]]; }
# tag PEER: the peer's name in file names (b' -> bp).
tag() { echo "${1//\'/p}"; }
QSD_PEERS=()
for s in b "b'" c; do has "$s" && QSD_PEERS+=("$s"); done
SERVER_PEERS=()
for s in "${SERVERS[@]}"; do [[ $s == f ]] || SERVER_PEERS+=("$s"); done
USE_VU=
has_transport vhost-user && (( ${#SERVER_PEERS[@]} > 0 )) && USE_VU=1

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
[[ -n $DO_HO ]] && need qemu-io qemu-utils
{ has_transport nbd || [[ -n $DO_HO ]]; } && { fio --enghelp=nbd >/dev/null 2>&1 || die "this fio has no nbd ioengine (Debian's fio 3.33 has it)"; }
has f && { fio --enghelp=rbd >/dev/null 2>&1 || die "this fio has no rbd ioengine (Debian: apt-get install fio, built with librbd)"; }
if (( ${#QSD_PEERS[@]} > 0 )); then
    need qemu-storage-daemon qemu-system-common
    compgen -G '/usr/lib/*/qemu/block-rbd.so' >/dev/null \
        || die "qemu-storage-daemon has no rbd block driver (Debian: apt-get install qemu-block-extra)"
fi
has "b'" && need qemu-img qemu-utils

if [[ -n ${CEPH_CONF:-} || -n ${POOL:-} ]]; then
    [[ -n ${CEPH_CONF:-} && -n ${POOL:-} ]] || die "set both CEPH_CONF and POOL to use an existing cluster"
    [[ -r $CEPH_CONF ]] || die "CEPH_CONF: cannot read $CEPH_CONF"
    OWN_CLUSTER=
    PREFIX=bench-$$-
else
    need ceph-mon ceph-mon
    need ceph-osd ceph-osd
    need uuidgen uuid-runtime
    OWN_CLUSTER=1
    POOL=rbd
    PREFIX=
fi

# The binaries: prebuilt (CRYPTBLK, VU_BENCH) or one release build of what is missing.
BUILD=()
[[ -z ${CRYPTBLK:-} ]] && BUILD+=(-p cryptblk --bin cryptblk)
[[ -n $USE_VU && -z ${VU_BENCH:-} ]] && BUILD+=(-p cryptblk-vhost-user-blk --example vu_bench)
if (( ${#BUILD[@]} > 0 )); then
    need cargo
    log "+ cargo build --release ${BUILD[*]}"
    cargo build --release "${BUILD[@]}"
fi
BIN=${CRYPTBLK:-${CARGO_TARGET_DIR:-target}/release/cryptblk}
[[ -x $BIN ]] || die "cryptblk binary not found at $BIN"
BIN_ORIG=$BIN
if [[ -n $USE_VU ]]; then
    VU=${VU_BENCH:-${CARGO_TARGET_DIR:-target}/release/examples/vu_bench}
    [[ -x $VU ]] || die "vu_bench binary not found at $VU"
fi

# The random source (and, with bluestore, the OSD's sparse block file) go in BENCH_WORK.
NEED_KIB=$(( (SIZE_BYTES + (256 << 20)) / 1024 ))
[[ -n $OWN_CLUSTER && $OBJECTSTORE == bluestore ]] && NEED_KIB=$(( NEED_KIB + (4 * SIZE_BYTES + 4 * HDR) / 1024 ))
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
    || die "$BENCH_WORK needs room for a $SIZE file$([[ $OBJECTSTORE == bluestore ]] && echo " and the OSD's data")"
CLUSTER_DIR=$BENCH_WORK/ceph
IMAGES=()

# ---- The throwaway cluster (the steps of crates/testutil/src/ceph.rs) ----------------------

# Its daemons, started in the foreground as children of this script: name -> PID.
declare -A CEPH_PID=()

# ceph_cmd ARGS...: `ceph ARGS` against the throwaway cluster, stderr dropped.
ceph_cmd() { ceph --connect-timeout 20 -c "$CLUSTER_DIR/ceph.conf" "$@" 2>/dev/null; }

# ceph_wait WHAT SECONDS DAEMON TEST...: wait until the command TEST succeeds; fail early
# (with the daemon's log) if DAEMON died.
ceph_wait() {
    local what=$1 limit=$2 daemon=$3 t0=$SECONDS
    shift 3
    until "$@"; do
        if ! kill -0 "${CEPH_PID[$daemon]}" 2>/dev/null; then
            tail -n 30 "$CLUSTER_DIR/log/$daemon.out" "$CLUSTER_DIR/log/$daemon.log" >&2 2>/dev/null || true
            die "cluster: the $daemon daemon exited while waiting for $what (another cluster on MON_PORT=$MON_PORT?)"
        fi
        (( SECONDS - t0 < limit )) || die "cluster: $what not within $limit s (logs in $CLUSTER_DIR/log)"
        sleep 0.2
    done
}
mon_up() { ceph_cmd mon stat >/dev/null; }
osd_up() {
    local s
    s=$(ceph_cmd osd stat) || return 1
    [[ $s == *"1 up"* && $s == *"1 in"* ]]
}

# ceph_start DEVICE_BYTES: one monitor, one OSD of DEVICE_BYTES (memstore's RAM cap, or the
# size of bluestore's sparse block file), pool `rbd`; config, data, logs under CLUSTER_DIR.
ceph_start() {
    local bytes=$1 d=$CLUSTER_DIR conf=$CLUSTER_DIR/ceph.conf osd
    mkdir -p "$d/log" "$d/run" "$d/mon" "$d/osd" "$d/crash"
    cat >"$conf" <<EOF
[global]
fsid = $(uuidgen)
mon host = v2:127.0.0.1:$MON_PORT
ms bind msgr1 = false
auth cluster required = none
auth service required = none
auth client required = none
keyring = /dev/null
run dir = $d/run
pid file = $d/run/\$name.pid
admin socket = $d/run/\$name.asok
log file = $d/log/\$name.log
crash dir = $d/crash
osd crush chooseleaf type = 0
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
mon allow pool size one = true
mon warn on pool no redundancy = false
mon data avail crit = 0
mon data avail warn = 0
ms async op threads = 1
[client]
log file =
admin socket =
[mon.a]
mon data = $d/mon
public addr = v2:127.0.0.1:$MON_PORT
[osd]
public addr = 127.0.0.1
cluster addr = 127.0.0.1
osd data = $d/osd
osd objectstore = $OBJECTSTORE
osd class load list = *
osd class default list = *
osd op num shards = 1
osd op num threads per shard = 2
osd crush update on start = false
memstore device bytes = $bytes
bluestore block path = $d/osd-block.img
bluestore block create = true
bluestore block size = $bytes
osd client watch timeout = 5
EOF
    log "+ ceph-mon --id a --mkfs --keyring /dev/null -c $conf && ceph-mon -f --id a -c $conf &"
    ceph-mon --id a --mkfs --keyring /dev/null -c "$conf" >"$d/log/mon.out" 2>&1 \
        || { cat "$d/log/mon.out" >&2; die "cluster: ceph-mon --mkfs failed"; }
    ceph-mon -f --id a -c "$conf" >>"$d/log/mon.out" 2>&1 &
    CEPH_PID[mon]=$!
    ceph_wait "the monitor" 60 mon mon_up
    osd=$(ceph_cmd osd create) || die "cluster: ceph osd create failed"
    ceph_cmd osd crush add "osd.$osd" 1 root=default host=localhost >/dev/null \
        || die "cluster: ceph osd crush add failed"
    log "+ ceph-osd --id $osd --mkfs --mkkey -c $conf && ceph-osd -f --id $osd -c $conf & ($OBJECTSTORE, $bytes bytes)"
    ceph-osd --id "$osd" --mkfs --mkkey --keyring "$d/osd/keyring" -c "$conf" >"$d/log/osd.out" 2>&1 \
        || { cat "$d/log/osd.out" >&2; die "cluster: ceph-osd --mkfs failed"; }
    ceph-osd -f --id "$osd" -c "$conf" >>"$d/log/osd.out" 2>&1 &
    CEPH_PID[osd]=$!
    ceph_wait "the OSD" 90 osd osd_up
    ceph_cmd osd pool create rbd 8 8 >/dev/null || die "cluster: ceph osd pool create rbd failed"
    rbd -c "$conf" pool init rbd || die "cluster: rbd pool init failed"
}

# ceph_stop: SIGTERM the OSD, then the monitor; SIGKILL whichever still runs after 10 s.
ceph_stop() {
    local name pid i
    for name in osd mon; do
        pid=${CEPH_PID[$name]:-}
        [[ -n $pid ]] || continue
        kill "$pid" 2>/dev/null || true
        for ((i = 0; i < 100; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
        CEPH_PID[$name]=
    done
}

# Every server started is recorded here and killed on exit, whatever happens; then the images
# (existing cluster) or the whole cluster (own) go, unless KEEP=1.
declare -A DAEMON_PID=()
cleanup() {
    local pid img
    for pid in "${DAEMON_PID[@]}"; do
        # (A process ended by the signal has a non-zero status: not a reason to stop cleaning.)
        if [[ -n $pid ]] && kill "$pid" 2>/dev/null; then wait "$pid" 2>/dev/null || true; fi
    done
    if [[ $KEEP == 1 ]]; then
        log "bench: KEEP=1: kept $BENCH_WORK (key, logs)"
        if [[ -n $OWN_CLUSTER ]]; then
            log "bench: cluster still running: export CEPH_CONF=$CLUSTER_DIR/ceph.conf; stop it with: kill ${CEPH_PID[osd]:-} ${CEPH_PID[mon]:-}; rm -rf $BENCH_WORK"
        else
            log "bench: images kept in pool $POOL: ${IMAGES[*]}"
        fi
        return
    fi
    if [[ -n $OWN_CLUSTER ]]; then
        ceph_stop
    else
        for img in "${IMAGES[@]}"; do rbd rm --no-progress "$POOL/$img" >/dev/null 2>&1 || log "bench: could not remove $POOL/$img"; done
    fi
    rm -rf "$BENCH_WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
# Work on private copies: other builds in this tree may replace the binaries mid-run.
cp "$BIN" "$BENCH_WORK/cryptblk"
BIN=$BENCH_WORK/cryptblk
if [[ -n $USE_VU ]]; then
    cp "$VU" "$BENCH_WORK/vu_bench"
    VU=$BENCH_WORK/vu_bench
fi

if [[ -n $OWN_CLUSTER ]]; then
    # The OSD holds four payloads and four headers at most, plus slack, in whole GiB.
    OSD_BYTES=$(( ((4 * SIZE_BYTES + 4 * HDR + (1 << 30) + (1 << 30) - 1) >> 30) << 30 ))
    ceph_start "$OSD_BYTES"
    CEPH_CONF=$CLUSTER_DIR/ceph.conf
fi
export CEPH_CONF
CONF=$(realpath "$CEPH_CONF")

LOADS=()
LOADS+=("$(load1)")
KEY=$BENCH_WORK/key
head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$KEY"
SRC=$BENCH_WORK/src.bin
if [[ -n $DO_TP ]]; then
    random_file "$SRC" "$SIZE_BYTES"
    SRC_SHA=$(sha256sum <"$SRC" | awk '{ print $1 }')
fi

IMG_PLAIN=${PREFIX}plain
IMG_CB=${PREFIX}luks2-cryptblk
IMG_RBD=${PREFIX}luks2-librbd
IMG_L1=${PREFIX}luks1-qemu
declare -A EXPORT=([a]=$IMG_CB [b]=$IMG_RBD ["b'"]=$IMG_L1 [c]=$IMG_PLAIN [d]=$IMG_PLAIN)

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

# (f)/(c)/(d): the plain image, filled with the source.
if [[ -n $DO_TP ]]; then
    log "+ rbd import --no-progress $SRC $POOL/$IMG_PLAIN"
    IMAGES+=("$IMG_PLAIN")
    rbd import --no-progress "$SRC" "$POOL/$IMG_PLAIN"
    no_fast_diff "$IMG_PLAIN"
fi
# (a): made by cryptblk (also the image of the handoff section).
if has a || [[ -n $DO_HO ]]; then
    log "+ $BIN format --batch-mode --key-file KEY --pbkdf pbkdf2 --iter-time 10 rbd:$POOL/$IMG_CB:conf=$CONF $SIZE_BYTES"
    IMAGES+=("$IMG_CB")
    "$BIN" format --batch-mode --key-file "$KEY" --pbkdf pbkdf2 --iter-time 10 \
        "rbd:$POOL/$IMG_CB:conf=$CONF" "$SIZE_BYTES" >/dev/null
    no_fast_diff "$IMG_CB"
fi
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
# (b'): LUKS1 made by qemu-img in a file (PBKDF2, iter-time 10 ms; header and a sparse
# payload), then imported (rbd import skips the zeros).
if has "b'"; then
    qemu_luks1_create "$BENCH_WORK/luks1.img" "$SIZE_BYTES" "$KEY"
    log "+ rbd import --no-progress $BENCH_WORK/luks1.img $POOL/$IMG_L1"
    IMAGES+=("$IMG_L1")
    rbd import --no-progress "$BENCH_WORK/luks1.img" "$POOL/$IMG_L1"
    rm -f "$BENCH_WORK/luks1.img"
    no_fast_diff "$IMG_L1"
fi

declare -A SERVER_NAME=(
    [f]="fio rbd engine, plain image (ceiling)"
    [a]="cryptblk serve, LUKS2 by cryptblk format"
    [b]="qemu-storage-daemon driver=rbd encrypt.format=luks2 (librbd's LUKS2)"
    ["b'"]="qemu-storage-daemon driver=luks over driver=rbd (QEMU's LUKS1)"
    [c]="qemu-storage-daemon driver=rbd, plain image raw"
    [d]="cryptblk serve, plain image raw"
)
sock() { echo "$BENCH_WORK/$(tag "$1").$2.sock"; }
uri() { echo "nbd+unix:///${EXPORT[$1]}?socket=$(sock "$1" nbd)"; }

# start_server S T: starts server S (a, b, b', c or d) exporting its image over transport T
# (nbd or vhost-user) on $(sock S T); sets DAEMON_PID[S].
start_server() {
    local s=$1 t=$2 sk logf
    sk=$(sock "$s" "$t")
    logf=$BENCH_WORK/$(tag "$s").$t.log
    local -a cmd qsd_export
    rm -f "$sk"
    if [[ $t == nbd ]]; then
        qsd_export=(--nbd-server "addr.type=unix,addr.path=$sk"
                    --export "type=nbd,id=e0,node-name=d0,name=${EXPORT[$s]},writable=on")
    else
        qsd_export=(--export "type=vhost-user-blk,id=e0,node-name=d0,addr.type=unix,addr.path=$sk,writable=on,num-queues=1")
    fi
    case $s in
        a) cmd=("$BIN" serve --image "rbd:$POOL/$IMG_CB:conf=$CONF" --key-file "$KEY" --name "${EXPORT[$s]}") ;;
        d) cmd=("$BIN" serve --image "rbd:$POOL/$IMG_PLAIN:conf=$CONF" --name "${EXPORT[$s]}") ;;
        b) cmd=(qemu-storage-daemon --object "secret,id=s0,file=$KEY"
                --blockdev "driver=rbd,node-name=d0,pool=$POOL,image=$IMG_RBD,conf=$CONF,encrypt.format=luks2,encrypt.key-secret=s0"
                "${qsd_export[@]}") ;;
        "b'") cmd=(qemu-storage-daemon --object "secret,id=s0,file=$KEY"
                --blockdev "driver=rbd,node-name=r0,pool=$POOL,image=$IMG_L1,conf=$CONF"
                --blockdev "driver=luks,node-name=d0,file=r0,key-secret=s0"
                "${qsd_export[@]}") ;;
        c) cmd=(qemu-storage-daemon
                --blockdev "driver=rbd,node-name=d0,pool=$POOL,image=$IMG_PLAIN,conf=$CONF"
                "${qsd_export[@]}") ;;
    esac
    if [[ $s == a || $s == d ]]; then
        if [[ $t == nbd ]]; then cmd+=(--nbd "unix:$sk"); else cmd+=(--vhost-user-blk "$sk" --num-queues 1 --unsealed-memory); fi
    fi
    log "+ ${cmd[*]}"
    "${cmd[@]}" >"$logf" 2>&1 &
    DAEMON_PID[$s]=$!
    if [[ $t == nbd ]]; then
        wait_nbd "$(uri "$s")" "${DAEMON_PID[$s]}" "$logf" 90
        local got
        got=$(nbdinfo --size "$(uri "$s")")
        [[ $got -eq $SIZE_BYTES ]] || die "server $s exports $got bytes, expected $SIZE_BYTES"
    else
        # Both daemons open (and unlock) the image before they create the socket.
        local i
        for ((i = 0; i < 900; i++)); do
            [[ -S $sk ]] && return 0
            kill -0 "${DAEMON_PID[$s]}" 2>/dev/null || { cat "$logf" >&2; die "server $s exited before creating $sk"; }
            sleep 0.1
        done
        cat "$logf" >&2
        die "server $s: no vhost-user-blk socket at $sk after 90 s"
    fi
}

# stop_server S: SIGTERM, which also releases the image's exclusive lock for the next client.
stop_server() {
    local s=$1 pid=${DAEMON_PID[$1]}
    kill "$pid" 2>/dev/null || true
    local rc=0
    wait "$pid" 2>/dev/null || rc=$?
    DAEMON_PID[$s]=
    (( rc == 0 || rc == 143 )) || log "bench: server $s exited with status $rc on SIGTERM (log: $BENCH_WORK/$(tag "$s").*.log)"
}

# Fill each LUKS payload with the source through its own server, then read every peer back.
for s in a b "b'"; do
    has "$s" || continue
    start_server "$s" nbd
    log "+ nbdcopy --flush $SRC '$(uri "$s")'"
    nbdcopy --flush "$SRC" "$(uri "$s")"
    stop_server "$s"
done
for s in f a b "b'" c d; do
    has "$s" || continue
    if [[ $s == f ]]; then
        log "+ rbd export --no-progress $POOL/$IMG_PLAIN - | sha256sum"
        got=$(rbd export --no-progress "$POOL/$IMG_PLAIN" - | sha256sum | awk '{ print $1 }')
    else
        start_server "$s" nbd
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

# vu_run SOCKET VU-ARGS...: one vu_bench run; prints "IOPS BYTES_PER_S" like fio_nbd.
vu_run() {
    local sk=$1 json
    shift
    log "+ $VU --socket $sk $* --queues 1 --runtime $RUNTIME --size $SIZE_BYTES"
    json=$("$VU" --socket "$sk" "$@" --queues 1 --runtime "$RUNTIME" --size "$SIZE_BYTES") \
        || die "vu_bench failed against $sk"
    [[ $(jq -r .area_bytes <<<"$json") == "$SIZE_BYTES" ]] \
        || die "vu_bench against $sk: the disk is smaller than $SIZE_BYTES bytes ($json)"
    jq -r '"\(.iops) \(.mib_s * 1048576)"' <<<"$json"
}

WORKLOADS=(randread-4k randwrite-4k read-64k write-64k)
declare -A W_ARGS=( # fio (rbd and nbd ioengines)
    [randread-4k]="--rw=randread --bs=4k --iodepth=32"
    [randwrite-4k]="--rw=randwrite --bs=4k --iodepth=32"
    [read-64k]="--rw=read --bs=64k --iodepth=16"
    [write-64k]="--rw=write --bs=64k --iodepth=16"
)
declare -A V_ARGS=( # vu_bench, the same workloads
    [randread-4k]="--rw randread --bs 4096 --iodepth 32"
    [randwrite-4k]="--rw randwrite --bs 4096 --iodepth 32"
    [read-64k]="--rw read --bs 65536 --iodepth 16"
    [write-64k]="--rw write --bs 65536 --iodepth 16"
)
# Per round R, transport T, workload W, peer S: R_IOPS[R.T.W.S], R_MIBS[...], R_CPU[...]
# ((f)'s one run per round and workload is recorded under every transport).
declare -A R_IOPS R_MIBS R_CPU

# record ROUND TRANSPORT WORKLOAD PEER IOPS BYTES_PER_S CPU [LABEL]: store one run's figures
# and log them, labelled with the transport (or LABEL; an empty LABEL stores silently).
record() {
    local k=$1.$2.$3.$4 label=${8-$2}
    R_IOPS[$k]=$5
    R_MIBS[$k]=$(awk -v b="$6" 'BEGIN { printf "%.1f", b / 1048576 }')
    R_CPU[$k]=$7
    [[ -z $label ]] || log "  round $1 $label $4 $3: $(printf '%.0f' "$5") IOPS, ${R_MIBS[$k]} MiB/s, server CPU $7%, load $(load1)"
}

# run_peer ROUND WORKLOAD PEER [TRANSPORT]: one run (against a fresh server unless PEER is f).
run_peer() {
    local r=$1 w=$2 s=$3 t=${4:-} pid c0 c1 t0 t1 res cpu iops bps
    if [[ $s == f ]]; then
        # shellcheck disable=SC2206 # W_ARGS holds several options
        local -a args=(--name="$w" ${W_ARGS[$w]} --numjobs=1 --time_based --runtime="$RUNTIME")
        LOADS+=("$(load1)")
        res=$(fio_rbd "$BENCH_WORK/fio.json" "${args[@]}")
        read -r iops bps <<<"$res"
        local label=rbd
        for t in "${TRANSPORTS[@]}"; do record "$r" "$t" "$w" f "$iops" "$bps" - "$label"; label=; done
        return
    fi
    start_server "$s" "$t"
    pid=${DAEMON_PID[$s]}
    LOADS+=("$(load1)")
    c0=$(proc_cpu_ticks "$pid"); t0=$(now_s)
    if [[ $t == nbd ]]; then
        # shellcheck disable=SC2206 # W_ARGS holds several options
        local -a args=(--name="$w" ${W_ARGS[$w]} --numjobs=1 --time_based --runtime="$RUNTIME")
        res=$(fio_nbd "$(uri "$s")" "$BENCH_WORK/fio.json" "${args[@]}")
    else
        # shellcheck disable=SC2086 # V_ARGS holds several options
        res=$(vu_run "$(sock "$s" "$t")" ${V_ARGS[$w]})
    fi
    t1=$(now_s); c1=$(proc_cpu_ticks "$pid")
    stop_server "$s"
    cpu=$(cpu_pct_of $((c1 - c0)) "$(elapsed "$t0" "$t1")")
    read -r iops bps <<<"$res"
    record "$r" "$t" "$w" "$s" "$iops" "$bps" "$cpu"
}

if [[ -n $DO_TP ]]; then
    for round in $(seq "$ROUNDS"); do
        log "round $round of $ROUNDS (load average $(cut -d' ' -f1-3 /proc/loadavg))"
        for w in "${WORKLOADS[@]}"; do
            has f && run_peer "$round" "$w" f
            for t in "${TRANSPORTS[@]}"; do
                for s in "${SERVER_PEERS[@]}"; do
                    run_peer "$round" "$w" "$s" "$t"
                done
            done
        done
    done
fi
LOADS+=("$(load1)")

# ---- Shared-storage hand-offs (see the top) -------------------------------------------------

# Two daemons, A and B: control socket, NBD socket and log of each; DAEMON_PID[ho-X].
declare -A HO_CTL=([A]=$BENCH_WORK/ho-A.ctl [B]=$BENCH_WORK/ho-B.ctl)
declare -A HO_NBD=([A]=$BENCH_WORK/ho-A.nbd [B]=$BENCH_WORK/ho-B.nbd)
ho_log() { echo "$BENCH_WORK/ho-$1.handoff.log"; }
ho_uri() { echo "nbd+unix:///vol?socket=${HO_NBD[$1]}"; }
ho_other() { [[ $1 == A ]] && echo B || echo A; }
HO_IMAGE="rbd:$POOL/$IMG_CB:conf=$CONF"

# ho_fail X MESSAGE: the tail of both daemons' logs, then die.
ho_fail() {
    local x
    for x in A B; do
        [[ -f $(ho_log "$x") ]] || continue
        log "--- daemon $x ($(ho_log "$x")), last lines:"
        tail -n 25 "$(ho_log "$x")" >&2
    done
    die "hand-off: $*"
}

# ho_ctl X ARGS...: `cryptblk ctl` on daemon X; prints its JSON answer; dies on an error.
ho_ctl() {
    local x=$1 out
    shift
    log "+ cryptblk ctl --socket ${HO_CTL[$x]} $*"
    out=$("$BIN" ctl --socket "${HO_CTL[$x]}" "$@" 2>"$BENCH_WORK/ho-ctl.err") \
        || { cat "$BENCH_WORK/ho-ctl.err" >&2; ho_fail "cryptblk ctl $* failed on daemon $x"; }
    printf '%s\n' "$out"
}

# ho_start X [SERVE-ARGS...]: starts daemon X with its control and NBD sockets (and the disk
# SERVE-ARGS name, if any); waits for its control socket.
ho_start() {
    local x=$1 i
    shift
    rm -f "${HO_CTL[$x]}" "${HO_NBD[$x]}"
    local -a cmd=("$BIN" serve "$@" --nbd "unix:${HO_NBD[$x]}" --control "${HO_CTL[$x]}")
    log "+ ${cmd[*]}"
    "${cmd[@]}" >"$(ho_log "$x")" 2>&1 &
    DAEMON_PID[ho-$x]=$!
    for ((i = 0; i < 900; i++)); do
        [[ -S ${HO_CTL[$x]} ]] && "$BIN" ctl --socket "${HO_CTL[$x]}" disk-list >/dev/null 2>&1 && return 0
        kill -0 "${DAEMON_PID[ho-$x]}" 2>/dev/null || ho_fail "daemon $x exited at start"
        sleep 0.1
    done
    ho_fail "daemon $x: no control socket after 90 s"
}

# ho_io X WHAT QEMU-IO-COMMANDS...: qemu-io on daemon X's export of "vol"; dies unless every
# command succeeded (and every pattern matched).
ho_io() {
    local x=$1 what=$2 out rc=0
    shift 2
    local -a args=(-f raw)
    local c
    for c in "$@"; do args+=(-c "$c"); done
    log "+ qemu-io ${args[*]} '$(ho_uri "$x")'"
    out=$(qemu-io "${args[@]}" "$(ho_uri "$x")" 2>&1) || rc=$?
    printf '%s\n' "$out" | sed 's/^/  qemu-io: /' >&2
    if (( rc != 0 )) || [[ $out == *fail* || $out == *"Pattern verification"* ]]; then
        ho_fail "$what through daemon $x: qemu-io exited $rc: $out"
    fi
}

# ho_attached X: daemon X lists "vol" as attached.
ho_attached() {
    "$BIN" ctl --socket "${HO_CTL[$1]}" disk-list 2>/dev/null \
        | jq -e '.disks // [] | any(.name == "vol" and .state == "attached")' >/dev/null
}

# ho_stop_fio: SIGTERM the loaded hand-off's fio (SIGKILL after 10 s) and reap it.
ho_stop_fio() {
    local pid=${DAEMON_PID[ho-fio]:-} i
    [[ -n $pid ]] || return 0
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < 100; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    DAEMON_PID[ho-fio]=
}

# Per hand-off N (1..2*HANDOFF_ROUNDS): HO_FROM[N], HO_TO[N], HO_LOAD[N] (idle|load),
# HO_MS[N] (the source's downtime-ms), HO_FIO[N] (fio's write IOPS and errors, loaded only).
declare -A HO_FROM HO_TO HO_LOAD HO_MS HO_FIO
HO_SRC=A
HO_N=0

# handoff MODE: hands "vol" from HO_SRC to the other daemon, idle or under fio (MODE load).
handoff() {
    local mode=$1 src=$HO_SRC dst listen st phase ms i fio_json fio_pid t0
    dst=$(ho_other "$src")
    HO_N=$((HO_N + 1))
    listen=unix:$BENCH_WORK/ho-mig.$HO_N.sock
    LOADS+=("$(load1)")
    log "hand-off $HO_N of $((2 * HANDOFF_ROUNDS)): $src -> $dst, $mode (load average $(load1))"
    ho_ctl "$dst" migrate-incoming vol --image "$HO_IMAGE" --listen "$listen" \
        --key-file "$KEY" --nbd-export >/dev/null
    st=$(ho_ctl "$src" migrate-start vol --to "$listen" --shared)
    [[ $(jq -r .shared <<<"$st") == true ]] || ho_fail "migrate-start --shared did not start a shared migration: $st"
    if [[ $mode == load ]]; then
        fio_json=$BENCH_WORK/ho-fio.$HO_N.json
        log "+ fio --ioengine=nbd --uri='$(ho_uri "$src")' --name=handoff --rw=randwrite --bs=4k --iodepth=32 --offset=4M --size=$((SIZE_BYTES - (4 << 20))) --time_based --runtime=120 --continue_on_error=all --output-format=json &"
        fio --ioengine=nbd --uri="$(ho_uri "$src")" --name=handoff --rw=randwrite --bs=4k \
            --iodepth=32 --numjobs=1 --offset=4M --size=$((SIZE_BYTES - (4 << 20))) --time_based --runtime=120 \
            --continue_on_error=all --output-format=json --output="$fio_json" >"$fio_json.log" 2>&1 &
        fio_pid=$!
        DAEMON_PID[ho-fio]=$fio_pid
        sleep 2
        kill -0 "$fio_pid" 2>/dev/null || { cat "$fio_json.log" "$fio_json" >&2 2>/dev/null; ho_fail "fio ended before the switchover"; }
    fi
    ho_ctl "$src" migrate-switchover vol >/dev/null
    t0=$SECONDS
    while :; do
        st=$("$BIN" ctl --socket "${HO_CTL[$src]}" migrate-status vol) \
            || ho_fail "hand-off $HO_N: migrate-status failed on daemon $src"
        phase=$(jq -r .phase <<<"$st")
        [[ $phase == completed ]] && break
        [[ $phase == failed || $phase == cancelled ]] && ho_fail "hand-off $HO_N ($src -> $dst, $mode) $phase: $st"
        (( SECONDS - t0 < 120 )) || ho_fail "hand-off $HO_N ($src -> $dst, $mode) not completed after 120 s: $st"
        sleep 0.1
    done
    ms=$(jq -r '.outgoing["downtime-ms"] // empty' <<<"$st")
    [[ -n $ms ]] || ho_fail "hand-off $HO_N: migrate-status has no outgoing downtime-ms: $st"
    ms=$(printf '%.1f' "$ms")
    for ((i = 0; i < 300; i++)); do ho_attached "$dst" && break; sleep 0.1; done
    ho_attached "$dst" || ho_fail "hand-off $HO_N: daemon $dst never listed vol as attached"
    HO_FIO[$HO_N]=-
    if [[ $mode == load ]]; then
        ho_stop_fio
        # fio puts "fio: terminating on signal 15" in the output file, before the JSON.
        if sed -n '/^{/,$p' "$fio_json" | jq -e .jobs[0] >/dev/null 2>&1; then
            HO_FIO[$HO_N]=$(sed -n '/^{/,$p' "$fio_json" \
                | jq -r '.jobs[0] | "\(.write.iops | floor) write IOPS, \(.total_err // "?") errors"')
        else
            HO_FIO[$HO_N]="no fio report"
        fi
    fi
    ho_ctl "$src" disk-remove vol >/dev/null
    HO_FROM[$HO_N]=$src HO_TO[$HO_N]=$dst HO_LOAD[$HO_N]=$mode HO_MS[$HO_N]=$ms
    log "  hand-off $HO_N $src -> $dst $mode: downtime $ms ms$([[ $mode == load ]] && echo " (fio: ${HO_FIO[$HO_N]})")"
    HO_SRC=$dst
    sleep 1
}

if [[ -n $DO_HO ]]; then
    log "handoff: $HANDOFF_ROUNDS idle and $HANDOFF_ROUNDS loaded hand-offs of $HO_IMAGE (load average $(cut -d' ' -f1-3 /proc/loadavg))"
    ho_start A --image "$HO_IMAGE" --name vol --key-file "$KEY"
    wait_nbd "$(ho_uri A)" "${DAEMON_PID[ho-A]}" "$(ho_log A)" 90
    ho_start B
    ho_io A "writing the pattern" "write -P 0x5a 1M 1M" flush
    # Alternating daemons, "idle, load" every round would always load the same direction.
    for ((hr = 1; hr <= HANDOFF_ROUNDS; hr++)); do
        if (( hr % 2 )); then handoff idle; handoff load; else handoff load; handoff idle; fi
    done
    ho_io "$HO_SRC" "reading the pattern back after $HO_N hand-offs" "read -P 0x5a 1M 1M"
    HO_VERIFIED="the pattern written through A before the first hand-off (0x5a, payload 1 MiB..2 MiB) read back through $HO_SRC, the holder after the last"
    stop_server ho-A
    stop_server ho-B
fi

fmt0() { awk -v v="$1" 'BEGIN { if (v == "n/a" || v == "" || v == "-") print "n/a"; else printf "%.0f", v }'; }
get() { # ARRAY KEY: the value, or n/a
    local -n arr=$1
    echo "${arr[$2]:-n/a}"
}
RATIOS=()
for p in "a f" "a b" "a b'" "a c" "d f"; do
    read -r x y <<<"$p"
    has "$x" && has "$y" && RATIOS+=("$p")
done
join_semi() { # ITEMS...: "item; item", or none
    (( $# > 0 )) || { echo none; return; }
    local out=$1 i
    shift
    for i in "$@"; do out+="; $i"; done
    echo "$out"
}
declare -A TRANSPORT_NAME=(
    [nbd]="NBD on a Unix socket, fio's nbd ioengine (numjobs 1)"
    [vhost-user]="vhost-user-blk, vu_bench (libblkio virtio-blk-vhost-user, 1 queue)"
)

CPU_MODEL=$(awk -F': ' '/^model name/ { print $2; exit }' /proc/cpuinfo)
LOAD_MED=$(median "${LOADS[@]}")
LOAD_MAX=$(max "${LOADS[@]}")
echo
if [[ -n $DO_TP ]]; then
    echo "## LUKS on Ceph RBD: cryptblk serve vs librbd's LUKS2 and QEMU's LUKS1 in qemu-storage-daemon vs fio rbd"
else
    echo "## LUKS on Ceph RBD: cryptblk serve, shared-storage hand-off downtime"
fi
echo
echo "- Machine: ${CPU_MODEL:-unknown CPU}, $(nproc) CPUs; $(fio --version); $(rbd --version | awk '{ print $1, $2, $3 }')$( (( ${#QSD_PEERS[@]} > 0 )) && echo "; $(qemu-storage-daemon --version | head -n 1)")"
echo "- cryptblk: $BIN_ORIG ($(git rev-parse --short HEAD 2>/dev/null || echo unknown commit)$(git diff --quiet HEAD -- crates 2>/dev/null || echo ', uncommitted changes in crates/'))"
if [[ -n $OWN_CLUSTER ]]; then
    echo "- Cluster: throwaway single node started by this script (1 mon, no mgr, 1 OSD, $OBJECTSTORE, pool size 1, loopback) on this machine."
else
    echo "- Cluster: existing, $CEPH_CONF, pool $POOL."
fi
if [[ -n $DO_TP ]]; then
    echo "- Images: $SIZE ($SIZE_BYTES bytes) payload each, filled with the same incompressible data (verified through every peer); object-map/fast-diff $([[ $FAST_DIFF == 1 ]] && echo "as created" || echo "disabled (FAST_DIFF=0)")."
    echo "- ROUNDS=$ROUNDS, RUNTIME=${RUNTIME}s per run, a fresh server per run; 4k at iodepth 32, 64k at iodepth 16, one job / one queue."
else
    echo "- Image: the LUKS2 image of (a), $SIZE ($SIZE_BYTES bytes) payload; object-map/fast-diff $([[ $FAST_DIFF == 1 ]] && echo "as created" || echo "disabled (FAST_DIFF=0)"). SECTIONS=$SECTIONS_LIST: no throughput runs."
fi
echo "- 1-minute load average sampled before each run$([[ -n $DO_HO ]] && echo " and hand-off"): median $LOAD_MED, max $LOAD_MAX on $(nproc) CPUs$(awk -v l="$LOAD_MED" -v n="$(nproc)" 'BEGIN { if (l > n * 0.75) printf " -- HIGH: other work shared the CPUs, figures are noisy and depressed" }')."
# The head of a results table: the leading columns given, then IOPS, MiB/s and CPU% per peer
# and the ratios.
table_head() {
    local head=$1 sep=$2 s p x y
    for s in "${SERVERS[@]}"; do head+=" | IOPS $s"; sep+="|---:"; done
    for s in "${SERVERS[@]}"; do head+=" | MiB/s $s"; sep+="|---:"; done
    for s in "${SERVER_PEERS[@]}"; do head+=" | CPU% $s"; sep+="|---:"; done
    for p in "${RATIOS[@]}"; do read -r x y <<<"$p"; head+=" | $x/$y"; sep+="|---:"; done
    echo "$head |"
    echo "$sep|"
}

declare -A PER_RATIO MED_RATIO
for t in "${TRANSPORTS[@]}"; do
    echo
    echo "### Transport $t: ${TRANSPORT_NAME[$t]}$(has f && echo "; (f) is fio's rbd ioengine")"
    echo
    table_head "| workload | round" "|---|---:"
    for w in "${WORKLOADS[@]}"; do
        for round in $(seq "$ROUNDS"); do
            line="| $w | $round"
            for s in "${SERVERS[@]}"; do line+=" | $(fmt0 "$(get R_IOPS "$round.$t.$w.$s")")"; done
            for s in "${SERVERS[@]}"; do line+=" | $(get R_MIBS "$round.$t.$w.$s")"; done
            for s in "${SERVER_PEERS[@]}"; do line+=" | $(get R_CPU "$round.$t.$w.$s")"; done
            for p in "${RATIOS[@]}"; do
                read -r x y <<<"$p"
                rt=$(ratio "${R_IOPS[$round.$t.$w.$x]}" "${R_IOPS[$round.$t.$w.$y]}" 3)
                [[ $rt != n/a ]] && PER_RATIO[$t.$w.$x/$y]="${PER_RATIO[$t.$w.$x/$y]:-} $rt"
                line+=" | $rt"
            done
            echo "$line |"
        done
    done
    echo
    table_head "| workload" "|---"
    for w in "${WORKLOADS[@]}"; do
        line="| $w"
        for s in "${SERVERS[@]}"; do
            v=(); for round in $(seq "$ROUNDS"); do v+=("${R_IOPS[$round.$t.$w.$s]}"); done
            line+=" | $(fmt0 "$(median "${v[@]}")")"
        done
        for s in "${SERVERS[@]}"; do
            v=(); for round in $(seq "$ROUNDS"); do v+=("${R_MIBS[$round.$t.$w.$s]}"); done
            line+=" | $(median "${v[@]}")"
        done
        for s in "${SERVER_PEERS[@]}"; do
            v=(); for round in $(seq "$ROUNDS"); do v+=("${R_CPU[$round.$t.$w.$s]}"); done
            line+=" | $(median "${v[@]}")"
        done
        for p in "${RATIOS[@]}"; do
            read -r x y <<<"$p"
            k=$t.$w.$x/$y
            if [[ -n ${PER_RATIO[$k]:-} ]]; then
                # shellcheck disable=SC2086 # word splitting of the recorded list is intended
                MED_RATIO[$k]=$(printf '%.2f' "$(median ${PER_RATIO[$k]})")
                line+=" | ${MED_RATIO[$k]}"
            else
                line+=" | n/a"
            fi
        done
        echo "$line |"
    done
    # The issue's targets, against the medians of the per-round ratios.
    met=() missed=()
    for w in "${WORKLOADS[@]}"; do
        b_min=1.5
        [[ $w == *-64k ]] && b_min=3
        for goal in "a/f 0.9" "a/b $b_min"; do
            read -r pair min <<<"$goal"
            rv=${MED_RATIO[$t.$w.$pair]:-}
            [[ -n $rv ]] || continue
            if awk -v v="$rv" -v m="$min" 'BEGIN { exit !(v >= m) }'; then
                met+=("$w $pair $rv >= $min")
            else
                missed+=("$w $pair $rv < $min")
            fi
        done
    done
    (( ${#met[@]} + ${#missed[@]} > 0 )) || continue
    echo
    echo "Targets over $t (a/f >= 0.9 at every workload; a/b >= 1.5 at 4k, >= 3 at 64k): met: $(join_semi "${met[@]}"); missed: $(join_semi "${missed[@]}")."
done
if [[ -n $DO_TP ]]; then
    echo
    echo "Peers: $(for s in "${SERVERS[@]}"; do printf '(%s) %s; ' "$s" "${SERVER_NAME[$s]}"; done | sed 's/; $/./')"
    echo "Per transport, first table: every round (ratios of IOPS within the round); second: medians over rounds, ratios = medians of the per-round ratios.$(has f && (( ${#TRANSPORTS[@]} > 1 )) && echo " (f) is the same fio rbd run in every transport's tables.")"
fi
[[ -n $DO_HO ]] || exit 0

echo
echo "### Shared-storage hand-off (migrate-start --shared) of the LUKS2 image of (a) between two cryptblk daemons"
echo
echo "| hand-off | from -> to | load | downtime ms | fio during the load |"
echo "|---:|---|---|---:|---|"
for ((n = 1; n <= HO_N; n++)); do
    echo "| $n | ${HO_FROM[$n]} -> ${HO_TO[$n]} | $([[ ${HO_LOAD[$n]} == load ]] && echo "4k randwrite iodepth 32" || echo idle) | ${HO_MS[$n]} | ${HO_FIO[$n]} |"
done
echo
echo "| load | hand-offs | median ms | max ms | target | median | max |"
echo "|---|---:|---:|---:|---|---|---|"
verdict() { awk -v v="$1" -v m="$2" 'BEGIN { print (v < m) ? "met" : "missed" }'; } # VALUE LIMIT
met=() missed=()
for mode in idle load; do
    v=()
    for ((n = 1; n <= HO_N; n++)); do [[ ${HO_LOAD[$n]} == "$mode" ]] && v+=("${HO_MS[$n]}"); done
    limit=100 what=idle
    [[ $mode == load ]] && limit=500 what="4k randwrite iodepth 32"
    med=$(median "${v[@]}") mx=$(max "${v[@]}")
    echo "| $what | ${#v[@]} | $med | $mx | < $limit ms | $(verdict "$med" "$limit") | $(verdict "$mx" "$limit") |"
    if [[ $(verdict "$med" "$limit") == met ]]; then met+=("$what median $med < $limit ms"); else missed+=("$what median $med >= $limit ms"); fi
done
echo
echo "Targets (median downtime < 100 ms at idle, < 500 ms under 4k write load): met: $(join_semi "${met[@]}"); missed: $(join_semi "${missed[@]}")."
echo "Downtime: the source's migrate-status outgoing downtime-ms (from its fence until the destination holds the image's lock and answered). Idle and loaded hand-offs interleave (idle, loaded; loaded, idle; ...), 1 s apart; under load, fio (nbd ioengine, one job) writes to the source's export from 2 s before the switchover until the destination serves the disk; its IOPS and error count cover that whole run (the errors, after the fence, are expected). Data check: $HO_VERIFIED."
