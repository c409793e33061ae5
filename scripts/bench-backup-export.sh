#!/usr/bin/env bash
# What a backup of a served disk costs (issue 36), in interleaved rounds on one machine and disk.
# One `cryptblk serve` serves a LUKS2 image of SIZE (filled with data) over vhost-user-blk.
# Every round runs, with the page cache dropped before each run:
#   backup   a full backup: `ctl backup-start --nbd unix:...`, `cryptblk backup pull` of the
#            export into a fresh chain, `ctl backup-end` (wall time of all three)
#   nbdcopy  the peer: `nbdcopy --flush` copying a plain image file of the same size on the same
#            disk to a new file (as durable as a pulled entry)
#   cp       the disk's ceiling: cp of the LUKS image file
#   without  a VM's 4 KiB random writes at depth 32 for RUNTIME seconds (vu_bench, libblkio's
#            vhost-user-blk client) with no backup
#   during   the same while a full backup runs: the writes start SETTLE seconds (default 1)
#            after backup-start returned and the pull began; every first write to a 64 KiB
#            region copies it to the scratch first (and records it in the backup's new
#            checkpoint); the backup yields to the writes with the daemon's default
#            background share, or SHARE percent (`--background-share`, 100: never yields);
#            with MAX_BANDWIDTH (e.g. 64M) that backup is started with
#            `--max-bandwidth MAX_BANDWIDTH`. WRITE_AREA (e.g. 64M) confines the writes of
#            both to the disk's first bytes (a VM's working set, whose regions are copied
#            once, early), default the whole disk (every write may be a region's first).
#            PULL_NICE (e.g. 19) runs that backup's pull at that nice value: the pull's
#            checksums and writes then take this host's CPU only when the VM leaves it, as
#            on the backup host elsewhere that a deployment pulls to. PULL_ARGS (e.g.
#            --no-release: the export keeps what the pull stored, and copies it when the
#            VM writes there) are added to every pull
# Prints one line per round (with how long the backup during the writes took, from start to
# end) and the median and worst per-round ratios: backup throughput over nbdcopy's and over
# cp's, and IOPS during a backup over without one. Odd rounds measure
# `without` first, even rounds `during` first.
#
#   scripts/bench-backup-export.sh [SIZE_MIB=1024] [ROUNDS=5] [RUNTIME=5] [DIR=target/bench-backup-export]
# Needs: cryptblk (target/release, or CRYPTBLK_BIN), vu_bench (`cargo build --release -p
# cryptblk-vhost-user-blk --example vu_bench`, or VU_BENCH), nbdcopy (libnbd-bin), GNU time;
# root to drop the page cache (otherwise the runs are warm and the summary says so).
set -euo pipefail
size_mib=${1:-1024}
rounds=${2:-5}
runtime=${3:-5}
dir=${4:-target/bench-backup-export}
rate=${MAX_BANDWIDTH:-}
share=${SHARE:-}
area=${WRITE_AREA:-}
settle=${SETTLE:-1}
pull_nice=${PULL_NICE:-}
pull_args=${PULL_ARGS:-}
bin=${CRYPTBLK_BIN:-}
vu=${VU_BENCH:-}
if [ -z "$bin" ]; then
  for b in target/release/cryptblk target/debug/cryptblk; do [ -x "$b" ] && bin=$b && break; done
fi
if [ -z "$vu" ]; then
  for b in target/release/examples/vu_bench target/debug/examples/vu_bench; do
    [ -x "$b" ] && vu=$b && break
  done
fi
[ -x "$bin" ] || { echo "no cryptblk binary: cargo build --release -p cryptblk" >&2; exit 1; }
[ -x "$vu" ] || { echo "no vu_bench: cargo build --release -p cryptblk-vhost-user-blk --example vu_bench" >&2; exit 1; }
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
bin=$(cd "$(dirname "$bin")" && pwd)/$(basename "$bin")
size=$((size_mib << 20))
image=$dir/disk.luks
plain=$dir/plain.raw
ctl() { "$bin" ctl -s "$dir/ctl.sock" "$@"; }

. "$(dirname "$0")/lib/rounds.sh"

rm -rf "$dir/chain" "$dir/copy.raw" "$dir/cp.raw" "$image"* "$dir"/*.sock
printf 'bench-backup-export' >"$dir/key"
chmod 600 "$dir/key"
"$bin" format -q --pbkdf pbkdf2 --pbkdf-force-iterations 1000 -d "$dir/key" "$image" "${size_mib}M" >/dev/null
[ "$(stat -c %s "$plain" 2>/dev/null || echo 0)" = "$size" ] || head -c "$size" /dev/urandom >"$plain"

"$bin" serve --control "$dir/ctl.sock" >"$dir/serve.out" 2>"$dir/serve.log" &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null; rm -rf "$dir/chain" "$dir/copy.raw" "$dir/cp.raw"' EXIT
for _ in $(seq 100); do [ -S "$dir/ctl.sock" ] && break; sleep 0.1; done
[ -S "$dir/ctl.sock" ] || { cat "$dir/serve.log" >&2; exit 1; }
ctl disk-add d --image "$image" --key-file "$dir/key" --vhost-user-blk "$dir/vu.sock" \
  --unsealed-memory >/dev/null
# Every byte of the image is data, as on a disk in use: the backup copies all of it.
"$vu" --socket "$dir/vu.sock" --rw write --bs 1048576 --iodepth 8 --once >/dev/null

# A full backup at checkpoint $1, from start to end.
backup() {
  rm -rf "$dir/chain"
  ctl backup-start d --checkpoint "$1" --nbd "unix:$dir/backup.sock" >/dev/null
  "$bin" backup pull $pull_args "nbd+unix:///d?socket=$dir/backup.sock" "$dir/chain" \
    --checkpoint "$1"
  ctl backup-end d >/dev/null
}
export -f backup ctl
export bin dir pull_args
iops() { "$vu" --socket "$dir/vu.sock" --rw randwrite --bs 4096 --iodepth 32 --runtime "$runtime" \
  ${area:+--size "$(numfmt --from=iec "$area")"} |
  sed -n 's/.*"iops":\([0-9.]*\).*/\1/p'; }
# IOPS while a full backup at checkpoint $1 runs; fails when the backup ended before the writes.
iops_during() {
  rm -rf "$dir/chain"
  local began=$EPOCHREALTIME
  ctl backup-start d --checkpoint "$1" --nbd "unix:$dir/backup.sock" ${rate:+--max-bandwidth "$rate"} \
    ${share:+--background-share "$share"} >/dev/null
  ${pull_nice:+nice -n "$pull_nice"} "$bin" backup pull $pull_args \
    "nbd+unix:///d?socket=$dir/backup.sock" \
    "$dir/chain" --checkpoint "$1" >/dev/null 2>"$dir/pull.err" &
  local pull=$!
  local n
  sleep "$settle"
  n=$(iops)
  if ! kill -0 "$pull" 2>/dev/null; then
    echo "the backup ended before the ${runtime}s of writes did: use a larger SIZE or a smaller RUNTIME" >&2
    wait "$pull" || cat "$dir/pull.err" >&2
    exit 1
  fi
  wait "$pull" || { cat "$dir/pull.err" >&2; exit 1; }
  ctl backup-end d >/dev/null
  echo "$n $(awk -v a="$began" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')"
}
last=
forget() { [ -z "$last" ] || ctl checkpoint-remove d "$last" >/dev/null; last=$1; }

declare -a r_peer r_ceiling r_iops
echo "size ${size_mib} MiB, ${rounds} rounds, writes ${runtime}s, binary $bin, backup during writes: max-bandwidth ${rate:-none}, background share ${share:-default}, pull nice ${pull_nice:-0}, pull args ${pull_args:-none}, writes over ${area:-the whole disk} from ${settle}s into the backup"
for round in $(seq 1 "$rounds"); do
  rm -f "$dir/copy.raw" "$dir/cp.raw"
  drop; read -r bw bc < <(timed bash -c "backup b$round")
  forget "b$round"
  drop; read -r nw nc < <(timed nbdcopy --flush "$plain" "$dir/copy.raw")
  drop; read -r cw cc < <(timed cp "$image" "$dir/cp.raw")
  if [ $((round % 2)) = 1 ]; then
    drop; without=$(iops)
    drop; out=$(iops_during "w$round"); read -r during took <<<"$out"
  else
    drop; out=$(iops_during "w$round"); read -r during took <<<"$out"
    drop; without=$(iops)
  fi
  forget "w$round"
  echo "round $round: backup ${bw}s (cpu ${bc}s)  nbdcopy ${nw}s (cpu ${nc}s)  cp ${cw}s  IOPS without ${without} during ${during} (that backup ${took}s)"
  r_peer+=("$(ratio "$nw" "$bw")")
  r_ceiling+=("$(ratio "$cw" "$bw")")
  r_iops+=("$(ratio "$during" "$without")")
done
summary "full backup throughput / nbdcopy's of the plain file" "${r_peer[@]}"
summary "full backup throughput / cp's (the disk)" "${r_ceiling[@]}"
summary "VM write IOPS during a backup / without" "${r_iops[@]}"
echo "page cache dropped before each run: $cold"
