# shellcheck shell=bash
# Helpers for cryptblk's benchmark scripts (sourced, not run). Requires bash 4+.

log() { printf '%s\n' "$*" >&2; }
die() { log "bench: $*"; exit 1; }

# need TOOL [PACKAGE]: fail with an install hint unless TOOL is on PATH.
need() {
    command -v "$1" >/dev/null 2>&1 || die "'$1' is required but not installed (Debian: apt-get install ${2:-$1})"
}

# bytes SIZE: '4G', '512M', '1048576' -> bytes (binary suffixes, like qemu-img).
bytes() {
    numfmt --from=iec "${1%B}" 2>/dev/null || die "invalid size '$1'"
}

# Runs a command under /usr/bin/time; sets LAST_WALL (seconds) and LAST_RSS_KIB. The command
# line is printed first so every figure can be reproduced by hand.
LAST_WALL=
LAST_RSS_KIB=
timed() {
    local tf
    tf=$(mktemp "${BENCH_WORK:-/tmp}/time.XXXXXX")
    log "+ $*${BENCH_SYNC:+ && sync}"
    # With BENCH_SYNC set, the timing includes writing the target back to disk: qemu-img convert
    # leaves it dirty in the page cache (its default target cache mode is 'unsafe'), cryptblk
    # flushes it, so timing without a sync would compare different amounts of work.
    local -a cmd=("$@")
    [[ -n ${BENCH_SYNC:-} ]] && cmd=(bash -c '"$@"; rc=$?; sync; exit $rc' bench "$@")
    # qemu-img's PBKDF calibration can fail spuriously on a busy machine ("Unable to get
    # accurate CPU usage", up to one run in two here): retry a failed run before giving up.
    local attempt
    for attempt in 1 2 3 4 5 6 7 8 9 10; do
        /usr/bin/time -f '%e %M' -o "$tf" "${cmd[@]}" >"$tf.out" 2>&1 && break
        cat "$tf.out" >&2
        if (( attempt == 10 )); then
            rm -f "$tf" "$tf.out"
            die "command failed: $*"
        fi
        log "bench: attempt $attempt failed; retrying"
    done
    read -r LAST_WALL LAST_RSS_KIB < <(tail -n 1 "$tf")
    rm -f "$tf" "$tf.out"
}

# bench_job NAME TARGET CMD...: run CMD once (sync and remove TARGET first) and append its wall
# time and peak RSS to WALLS[NAME] / RSSES[NAME]. Callers interleave jobs over several rounds so
# that this host's slowly drifting storage speed hits every tool alike, then report medians.
declare -A WALLS RSSES
bench_job() {
    local name=$1 target=$2
    shift 2
    rm -f "$target"
    sync
    timed "$@"
    log "  $name: ${LAST_WALL} s, peak RSS ${LAST_RSS_KIB} KiB"
    WALLS[$name]="${WALLS[$name]:-} $LAST_WALL"
    RSSES[$name]="${RSSES[$name]:-} $LAST_RSS_KIB"
    rm -f "$target"
    sync
}

# median VALUES...: the median (lower middle for an even count).
median() {
    printf '%s\n' "$@" | sort -g | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'
}

# max VALUES...
max() {
    printf '%s\n' "$@" | sort -g | tail -n 1
}

# ratio A B [DIGITS]: A / B as a decimal.
ratio() {
    awk -v a="$1" -v b="$2" -v d="${3:-2}" 'BEGIN { if (b == 0) print "n/a"; else printf "%.*f\n", d, a / b }'
}

# mibps BYTES SECONDS: throughput in MiB/s.
mibps() {
    awk -v n="$1" -v s="$2" 'BEGIN { if (s == 0) print "n/a"; else printf "%.0f\n", n / s / 1048576 }'
}

# proc_cpu_ticks PID: utime + stime of a whole process (all its threads, live and exited), in
# clock ticks, from /proc/PID/stat (the comm field may hold spaces: cut after the last ')').
proc_cpu_ticks() {
    awk '{ sub(/^.*\) /, ""); print $12 + $13 }' "/proc/$1/stat"
}

# now_s: wall clock in seconds with nanoseconds.
now_s() { date +%s.%N; }

# cpu_pct_of TICKS SECONDS: CPU time as a percentage of wall time (100% = one core).
cpu_pct_of() {
    awk -v t="$1" -v s="$2" -v hz="$(getconf CLK_TCK)" 'BEGIN { if (s <= 0) print "n/a"; else printf "%.1f\n", t / hz / s * 100 }'
}

# elapsed T0 T1: T1 - T0 in seconds (from now_s).
elapsed() {
    awk -v a="$1" -v b="$2" 'BEGIN { printf "%.6f\n", b - a }'
}

# load1: the 1-minute load average.
load1() { awk '{ print $1 }' /proc/loadavg; }

# random_file PATH BYTES: BYTES of incompressible data (AES-CTR keystream, fast) into PATH.
random_file() {
    log "+ head -c $2 /dev/zero | openssl enc -aes-128-ctr -K <random> -iv <random> > $1"
    head -c "$2" /dev/zero \
        | openssl enc -aes-128-ctr -nosalt -K "$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')" \
            -iv "$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')" >"$1"
    [[ $(stat -c %s "$1") -eq $2 ]] || die "could not write $2 bytes to $1"
}

# wait_nbd URI PID LOG [SECONDS]: wait until the NBD server PID answers URI (nbdinfo --size);
# on the server's death print LOG and fail.
wait_nbd() {
    local uri=$1 pid=$2 logf=$3 i
    for ((i = 0; i < ${4:-30} * 10; i++)); do
        nbdinfo --size "$uri" >/dev/null 2>&1 && return 0
        kill -0 "$pid" 2>/dev/null || { cat "$logf" >&2; die "server (pid $pid) exited before serving $uri"; }
        sleep 0.1
    done
    cat "$logf" >&2
    die "no NBD export at $uri after ${4:-30} s"
}

# fio_nbd URI JSON FIO-ARGS...: one fio run with the nbd ioengine against URI, JSON output in
# the file JSON; prints "IOPS BYTES_PER_S" (read + write, all jobs, group_reporting).
fio_nbd() {
    local uri=$1 json=$2
    shift 2
    log "+ fio --ioengine=nbd --uri='$uri' --group_reporting --output-format=json $*"
    fio --ioengine=nbd --uri="$uri" --group_reporting --output-format=json --output="$json" "$@" \
        >"$json.log" 2>&1 || { cat "$json.log" "$json" >&2; die "fio failed against $uri"; }
    jq -e '.jobs[0].error == 0' "$json" >/dev/null || { cat "$json" >&2; die "fio reported an error against $uri"; }
    jq -r '.jobs[0] | "\(.read.iops + .write.iops) \(.read.bw_bytes + .write.bw_bytes)"' "$json"
}

# The cryptblk binary to measure: $CRYPTBLK if set, else a fresh release build. Sets BIN.
cryptblk_bin() {
    if [[ -n ${CRYPTBLK:-} ]]; then
        BIN=$CRYPTBLK
    else
        need cargo
        log "+ cargo build --release -p cryptblk"
        cargo build --release -p cryptblk
        BIN=${CARGO_TARGET_DIR:-target}/release/cryptblk
    fi
    [[ -x $BIN ]] || die "cryptblk binary not found at $BIN"
}

# qemu_luks1_create PATH BYTES KEYFILE: a LUKS1 aes-xts-plain64 image made by qemu-img (QEMU's
# own encryption, the peer to compare with). Its KDF calibration sometimes fails with "Unable
# to get accurate CPU usage" on a busy machine: that error only is retried.
qemu_luks1_create() {
    local path=$1 size=$2 key=$3 attempt err
    log "+ qemu-img create -f luks -o cipher-alg=aes-256,cipher-mode=xts,ivgen-alg=plain64,hash-alg=sha256,iter-time=10 $path $size"
    # A failed calibration ends in milliseconds and each try is independent (about one in two
    # fails here), so many quick tries (crates/testutil/src/lib.rs says why it fails).
    for attempt in $(seq 400); do
        if err=$(qemu-img create -q -f luks --object "secret,id=sec0,file=$key" \
            -o key-secret=sec0,cipher-alg=aes-256,cipher-mode=xts,ivgen-alg=plain64,hash-alg=sha256,iter-time=10 \
            "$path" "$size" 2>&1); then
            return 0
        fi
        [[ $err == *"accurate CPU usage"* && $attempt -lt 400 ]] || die "qemu-img create failed: $err"
        rm -f "$path"
    done
}
