#!/usr/bin/env bash
# Benchmark (not a test): cryptblk convert vs qemu-img convert on this machine.
#
#   (a) raw -> LUKS, AES-256-XTS (512-bit key, plain64 IVs): cryptblk (LUKS2) vs qemu-img (LUKS1,
#       QEMU 7.2 cannot write LUKS2); both with a negligible KDF cost;
#   (b) the raw -> raw copy ceiling of both tools on the same disk;
#   (c) single-thread AES-256-XTS at 4 KiB: `cryptblk bench --json` vs `openssl speed`;
#   (d) peak RSS of every convert (/usr/bin/time %M);
#   (e) raw -> LUKS on tmpfs (/dev/shm): cp, qemu-img convert and cryptblk convert of a dense
#       TMPFS_SIZE file, where storage costs nothing and what is left is each tool's own work
#       (on tmpfs SEEK_HOLE walks a dense file to its end, so probing holes chunk by chunk
#       shows here). With CRYPTBLK_BEFORE=<another binary> it gets a row too (before/after).
#
# Page cache cannot be dropped without root: jobs run interleaved over ROUNDS rounds (sync and
# target removal before each run) and the median is reported.
#
# Environment: SIZE (default 4G), BENCH_SYNC (default 1: time "convert && sync"), BENCH_DIR (default /tmp/cryptblk-bench), THREADS (cryptblk
# --threads, default: one per CPU), CRYPTBLK (a prebuilt binary; default: cargo build --release),
# PARTS (default "disk,tmpfs": (a)-(d) and (e)), TMPFS_DIR (default /dev/shm), TMPFS_SIZE
# (default 2G), CRYPTBLK_BEFORE (optional second binary for (e)).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/bench-lib.sh
source scripts/bench-lib.sh

SIZE=${SIZE:-4G}
ROUNDS=${ROUNDS:-3}
PARTS=${PARTS:-disk,tmpfs}
has_part() { [[ ",$PARTS," == *",$1,"* ]]; }
TMPFS_DIR=${TMPFS_DIR:-/dev/shm}
TMPFS_SIZE=${TMPFS_SIZE:-2G}
# Time "convert && sync" (1, default) or the convert alone (empty).
export BENCH_SYNC=${BENCH_SYNC-1}
BENCH_DIR=${BENCH_DIR:-/tmp/cryptblk-bench}
SIZE_BYTES=$(bytes "$SIZE")
(( SIZE_BYTES % 4096 == 0 )) || die "SIZE must be a multiple of 4096 bytes"

need qemu-img qemu-utils
need openssl
need numfmt coreutils
need jq
need awk gawk
if [[ ! -x /usr/bin/time ]]; then
    log "bench: /usr/bin/time is missing; installing the 'time' package"
    if [[ $(id -u) -eq 0 ]]; then apt-get install -y time >/dev/null; else sudo apt-get install -y time >/dev/null; fi
fi
[[ -x /usr/bin/time ]] || die "/usr/bin/time is required (apt-get install time)"

cryptblk_bin
THREAD_ARGS=()
[[ -n ${THREADS:-} ]] && THREAD_ARGS=(--threads "$THREADS")

if [[ -n ${CRYPTBLK_BEFORE:-} ]]; then
    [[ -x $CRYPTBLK_BEFORE ]] || die "CRYPTBLK_BEFORE=$CRYPTBLK_BEFORE is not an executable"
fi

KEY_ARGS=(--cipher aes-xts-plain64 --key-size 512 --pbkdf pbkdf2 --pbkdf-force-iterations 1000)
QEMU_LUKS_OPTS=key-secret=s0,cipher-alg=aes-256,cipher-mode=xts,ivgen-alg=plain64,hash-alg=sha256,iter-time=10

# (e) on tmpfs: run after (a)-(d), or alone with PARTS=tmpfs; prints its own table.
TMPFS_WORK=
tmpfs_part() {
    local size_bytes src out key round job free
    size_bytes=$(bytes "$TMPFS_SIZE")
    [[ $(stat -f -c %T "$TMPFS_DIR") == tmpfs ]] || die "TMPFS_DIR=$TMPFS_DIR is not a tmpfs"
    TMPFS_WORK=$(mktemp -d "$TMPFS_DIR/cryptblk-bench.XXXXXX")
    free=$(df -Pk "$TMPFS_WORK" | awk 'NR == 2 { print $4 }')
    (( free * 1024 > size_bytes * 2 + (64 << 20) )) || die "$TMPFS_WORK needs room for two $TMPFS_SIZE files"
    src=$TMPFS_WORK/src.raw
    out=$TMPFS_WORK/out
    key=$TMPFS_WORK/key
    head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$key"
    random_file "$src" "$size_bytes"
    # Nothing to write back on tmpfs, and a sync would time other filesystems' writeback.
    local BENCH_SYNC=
    local jobs=(cp qemu_luks_tmpfs cryptblk_luks_tmpfs)
    [[ -n ${CRYPTBLK_BEFORE:-} ]] && jobs+=(cryptblk_before_tmpfs)
    for round in $(seq "$ROUNDS"); do
        log "tmpfs round $round of $ROUNDS"
        bench_job cp "$out" cp "$src" "$out"
        bench_job qemu_luks_tmpfs "$out" qemu-img convert -m 16 -W -f raw -O luks \
            --object "secret,id=s0,file=$key" -o "$QEMU_LUKS_OPTS" "$src" "$out"
        bench_job cryptblk_luks_tmpfs "$out" "$BIN" "${THREAD_ARGS[@]}" convert -f raw -O luks2 \
            "${KEY_ARGS[@]}" --key-file "$key" "$src" "$out"
        if [[ -n ${CRYPTBLK_BEFORE:-} ]]; then
            bench_job cryptblk_before_tmpfs "$out" "$CRYPTBLK_BEFORE" "${THREAD_ARGS[@]}" convert \
                -f raw -O luks2 "${KEY_ARGS[@]}" --key-file "$key" "$src" "$out"
        fi
    done
    declare -A TW TR
    for job in "${jobs[@]}"; do
        # shellcheck disable=SC2086 # word splitting of the recorded lists is intended
        TW[$job]=$(median ${WALLS[$job]})
        # shellcheck disable=SC2086
        TR[$job]=$(max ${RSSES[$job]})
    done
    local before_walls=""
    [[ -n ${CRYPTBLK_BEFORE:-} ]] && before_walls="; cryptblk before${WALLS[cryptblk_before_tmpfs]}"
    cat <<END_TMPFS

## raw -> LUKS on tmpfs ($TMPFS_DIR)

- $TMPFS_SIZE ($size_bytes bytes) of incompressible data, source and target in $TMPFS_DIR;
  $ROUNDS interleaved rounds, median wall time (peak RSS: the largest), no sync.
- Raw wall times: cp${WALLS[cp]}; qemu-img${WALLS[qemu_luks_tmpfs]}; cryptblk${WALLS[cryptblk_luks_tmpfs]}$before_walls.

| job | wall s | MiB/s | peak RSS MiB | time / cp time |
|---|---:|---:|---:|---:|
| cp | ${TW[cp]} | $(mibps "$size_bytes" "${TW[cp]}") | $((TR[cp] / 1024)) | 1.00 |
| qemu-img convert -m 16 -W raw -> LUKS1 | ${TW[qemu_luks_tmpfs]} | $(mibps "$size_bytes" "${TW[qemu_luks_tmpfs]}") | $((TR[qemu_luks_tmpfs] / 1024)) | $(ratio "${TW[qemu_luks_tmpfs]}" "${TW[cp]}") |
| cryptblk convert raw -> LUKS2 (target <= 1.3) | ${TW[cryptblk_luks_tmpfs]} | $(mibps "$size_bytes" "${TW[cryptblk_luks_tmpfs]}") | $((TR[cryptblk_luks_tmpfs] / 1024)) | $(ratio "${TW[cryptblk_luks_tmpfs]}" "${TW[cp]}") |
END_TMPFS
    if [[ -n ${CRYPTBLK_BEFORE:-} ]]; then
        echo "| cryptblk convert raw -> LUKS2, \$CRYPTBLK_BEFORE | ${TW[cryptblk_before_tmpfs]} | $(mibps "$size_bytes" "${TW[cryptblk_before_tmpfs]}") | $((TR[cryptblk_before_tmpfs] / 1024)) | $(ratio "${TW[cryptblk_before_tmpfs]}" "${TW[cp]}") |"
    fi
    rm -rf "$TMPFS_WORK"
}
trap 'rm -rf "${BENCH_WORK:-}" "${TMPFS_WORK:-}"' EXIT

if ! has_part disk; then
    has_part tmpfs || die "PARTS=$PARTS names neither disk nor tmpfs"
    tmpfs_part
    exit 0
fi

mkdir -p "$BENCH_DIR"
BENCH_WORK=$(mktemp -d "$BENCH_DIR/run.XXXXXX")
export BENCH_WORK
free_kib=$(df -Pk "$BENCH_WORK" | awk 'NR == 2 { print $4 }')
(( free_kib * 1024 > SIZE_BYTES * 2 + (256 << 20) )) || die "$BENCH_WORK needs room for two $SIZE images"

SRC=$BENCH_WORK/src.raw
KEY=$BENCH_WORK/key
head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$KEY"

# Incompressible source: AES-CTR keystream (fast) of SIZE bytes, written once, not timed.
log "+ head -c $SIZE_BYTES /dev/zero | openssl enc -aes-128-ctr -K <random> -iv <random> > $SRC"
head -c "$SIZE_BYTES" /dev/zero \
    | openssl enc -aes-128-ctr -nosalt -K "$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')" \
        -iv "$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')" >"$SRC"
[[ $(stat -c %s "$SRC") -eq $SIZE_BYTES ]] || die "could not write the $SIZE source image"

# (a) raw -> LUKS, AES-256-XTS, and (b) the raw -> raw ceiling, interleaved over ROUNDS rounds.
OUT=$BENCH_WORK/out
for round in $(seq "$ROUNDS"); do
    log "round $round of $ROUNDS"
    bench_job cryptblk_luks "$OUT" "$BIN" "${THREAD_ARGS[@]}" convert -f raw -O luks2 \
        "${KEY_ARGS[@]}" --key-file "$KEY" "$SRC" "$OUT"
    bench_job qemu_luks "$OUT" qemu-img convert -m 16 -W -f raw -O luks \
        --object "secret,id=s0,file=$KEY" -o "$QEMU_LUKS_OPTS" "$SRC" "$OUT"
    bench_job cryptblk_raw "$OUT" "$BIN" "${THREAD_ARGS[@]}" convert -f raw -O raw "$SRC" "$OUT"
    bench_job qemu_raw "$OUT" qemu-img convert -m 16 -W -f raw -O raw "$SRC" "$OUT"
done
declare -A WALL RSS
for job in cryptblk_luks qemu_luks cryptblk_raw qemu_raw; do
    # shellcheck disable=SC2086 # word splitting of the recorded lists is intended
    WALL[$job]=$(median ${WALLS[$job]})
    # shellcheck disable=SC2086
    RSS[$job]=$(max ${RSSES[$job]})
done

# (c) single-thread AES-256-XTS, 4 KiB sectors.
log "+ $BIN bench --json"
BENCH_JSON=$("$BIN" "${THREAD_ARGS[@]}" bench --json)
CB_GBPS=$(jq -r '
    [.results[] | select(.cipher == "aes-xts-plain64" and .key_bits == 512 and .sector_size == 4096)]
    | (map(select(.is_default)) + .) | .[0].single_encrypt_gbps // empty' <<<"$BENCH_JSON")
CB_ENGINE=$(jq -r '
    [.results[] | select(.cipher == "aes-xts-plain64" and .key_bits == 512 and .sector_size == 4096)]
    | (map(select(.is_default)) + .) | .[0].engine // empty' <<<"$BENCH_JSON")
[[ -n $CB_GBPS ]] || die "cryptblk bench --json has no aes-xts-plain64 512-bit 4096-byte result"
log "+ openssl speed -mr -evp aes-256-xts -bytes 4096 -seconds 2"
OSSL_BPS=$(openssl speed -mr -evp aes-256-xts -bytes 4096 -seconds 2 2>/dev/null \
    | awk -F: '/^\+F:/ { print $4 }' | tail -n 1)
[[ -n $OSSL_BPS ]] || die "could not parse openssl speed output"
OSSL_GBPS=$(awk -v b="$OSSL_BPS" 'BEGIN { printf "%.2f\n", b / 1e9 }')
# The best library here is the vendored OpenSSL 3.6 the engine wraps: compare the engine with
# the leanest direct loop over the same library (same build, same binary).
log "+ cargo run --release -p cryptblk-crypto --example openssl_baseline"
BASELINE=$(cargo run -q --release -p cryptblk-crypto --example openssl_baseline)
read -r DIRECT_GBPS ENGINE_GBPS < <(awk '$1 == 4096 { print $2, $3 }' <<<"$BASELINE")
[[ -n $DIRECT_GBPS ]] || die "could not parse the openssl_baseline output"

CPU=$(awk -F': ' '/^model name/ { print $2; exit }' /proc/cpuinfo)
cat <<EOF

## cryptblk convert benchmark

- Machine: ${CPU:-unknown CPU}, $(nproc) CPUs; $(qemu-img --version | head -n 1); $(openssl version)
- Image: $SIZE ($SIZE_BYTES bytes) of incompressible data in $BENCH_WORK
- Jobs ran interleaved in $ROUNDS rounds, each after \`sync\`; the table shows the **median** wall
  time (peak RSS: the largest). Raw wall times: cryptblk LUKS${WALLS[cryptblk_luks]}; qemu LUKS${WALLS[qemu_luks]};
  cryptblk raw${WALLS[cryptblk_raw]}; qemu raw${WALLS[qemu_raw]}.
- Timings $( [[ -n $BENCH_SYNC ]] && echo "include a final \`sync\` (qemu-img convert leaves its target dirty in the page cache, cryptblk flushes it)" || echo "exclude writeback: qemu-img convert does not flush its target, cryptblk does (BENCH_SYNC unset)").
- Peak RSS is that of the convert process (with the sync wrapper: the largest process of the job).
- cryptblk writes LUKS2, qemu-img writes LUKS1 (QEMU cannot write LUKS2); both AES-256-XTS
  (512-bit key), plain64 IVs, KDF cost negligible (PBKDF2 1000 iterations / iter-time=10 ms).

| job | wall s | MiB/s | peak RSS MiB |
|---|---:|---:|---:|
| cryptblk convert raw -> LUKS2 | ${WALL[cryptblk_luks]} | $(mibps "$SIZE_BYTES" "${WALL[cryptblk_luks]}") | $((RSS[cryptblk_luks] / 1024)) |
| qemu-img convert -m 16 -W raw -> LUKS1 | ${WALL[qemu_luks]} | $(mibps "$SIZE_BYTES" "${WALL[qemu_luks]}") | $((RSS[qemu_luks] / 1024)) |
| cryptblk convert raw -> raw | ${WALL[cryptblk_raw]} | $(mibps "$SIZE_BYTES" "${WALL[cryptblk_raw]}") | $((RSS[cryptblk_raw] / 1024)) |
| qemu-img convert -m 16 -W raw -> raw | ${WALL[qemu_raw]} | $(mibps "$SIZE_BYTES" "${WALL[qemu_raw]}") | $((RSS[qemu_raw] / 1024)) |

| ratio | value |
|---|---:|
| LUKS convert speed-up, qemu-img time / cryptblk time | $(ratio "${WALL[qemu_luks]}" "${WALL[cryptblk_luks]}") |
| cryptblk LUKS time / cryptblk raw copy time (target <= 1.3) | $(ratio "${WALL[cryptblk_luks]}" "${WALL[cryptblk_raw]}") |
| cryptblk LUKS time / qemu-img raw copy time (target <= 1.3) | $(ratio "${WALL[cryptblk_luks]}" "${WALL[qemu_raw]}") |

| single-thread AES-256-XTS, 4 KiB | GB/s |
|---|---:|
| cryptblk bench (engine ${CB_ENGINE}) | $(awk -v g="$CB_GBPS" 'BEGIN { printf "%.2f", g }') |
| system OpenSSL 3.0: openssl speed -evp aes-256-xts -bytes 4096 | $OSSL_GBPS |
| ratio cryptblk / system openssl speed | $(ratio "$CB_GBPS" "$OSSL_GBPS") |
| vendored OpenSSL 3.6, direct loop (examples/openssl_baseline) | $DIRECT_GBPS |
| cryptblk engine in the same run (examples/openssl_baseline) | $ENGINE_GBPS |
| ratio engine / best library (target >= 0.90) | $(ratio "$ENGINE_GBPS" "$DIRECT_GBPS") |
EOF
if has_part tmpfs; then
    tmpfs_part
fi
