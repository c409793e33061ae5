#!/usr/bin/env bash
# A full `cryptblk backup pull` against its peer and the ceiling, on the same export and disk,
# in interleaved rounds: nbdcopy copying the same NBD export to a file and flushing it (the
# peer, as durable as a pulled entry), and cp of the image file (the disk's ceiling). A raw
# image of SIZE random data is served read-only by
# qemu-nbd. The page cache is dropped before every run (root needed; otherwise the runs are
# warm and this says so). Prints one line per run (wall seconds, CPU seconds of the copier)
# and the median and worst per-round ratios of throughput.
#
#   scripts/bench-backup.sh [SIZE_MIB=1024] [ROUNDS=5] [DIR=target/bench-backup]
# Needs: a built cryptblk (target/release or target/debug; CRYPTBLK_BIN overrides), qemu-nbd,
# nbdcopy (libnbd-bin), GNU time. CRYPTBLK_BASELINE=OLD/cryptblk pulls with an older binary
# too, right after the new one in every round, and reports new over old.
set -euo pipefail
size_mib=${1:-1024}
rounds=${2:-5}
dir=${3:-target/bench-backup}
bin=${CRYPTBLK_BIN:-}
base=${CRYPTBLK_BASELINE:-}
if [ -z "$bin" ]; then
  for b in target/release/cryptblk target/debug/cryptblk; do [ -x "$b" ] && bin=$b && break; done
fi
[ -x "$bin" ] || { echo "no cryptblk binary: cargo build --release -p cryptblk" >&2; exit 1; }
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
img=$dir/source.raw
if [ "$(stat -c %s "$img" 2>/dev/null || echo 0)" != $((size_mib << 20)) ]; then
  head -c $((size_mib << 20)) /dev/urandom >"$img"
fi
sock=$dir/nbd.sock
rm -f "$sock"
qemu-nbd -r -t -f raw -x disk -k "$sock" "$img" &
server=$!
trap 'kill $server 2>/dev/null; rm -rf "$dir/chain" "$dir/copy.raw" "$dir/cp.raw"' EXIT
while [ ! -S "$sock" ]; do sleep 0.05; done
uri="nbd+unix:///disk?socket=$sock"

. "$(dirname "$0")/lib/rounds.sh"
declare -a r_peer r_ceiling r_base
echo "size ${size_mib} MiB, ${rounds} rounds, binary $bin${base:+, baseline $base}"
for round in $(seq 1 "$rounds"); do
  rm -rf "$dir/chain" "$dir/copy.raw" "$dir/cp.raw"
  drop; read -r pw pc < <(timed "$bin" backup pull "$uri" "$dir/chain" --checkpoint c0)
  if [ -n "$base" ]; then
    rm -rf "$dir/chain"
    drop; read -r bw bc < <(timed "$base" backup pull "$uri" "$dir/chain" --checkpoint c0)
    echo "round $round: baseline pull ${bw}s (cpu ${bc}s)"
    r_base+=("$(ratio "$bw" "$pw")")
  fi
  # --flush: the copy is on stable storage when nbdcopy exits, as a pulled entry is.
  drop; read -r nw nc < <(timed nbdcopy --flush "$uri" "$dir/copy.raw")
  drop; read -r cw cc < <(timed cp "$img" "$dir/cp.raw")
  cmp -s "$dir/copy.raw" "$img" || { echo "nbdcopy copied different bytes" >&2; exit 1; }
  echo "round $round: pull ${pw}s (cpu ${pc}s)  nbdcopy ${nw}s (cpu ${nc}s)  cp ${cw}s (cpu ${cc}s)"
  r_peer+=("$(ratio "$nw" "$pw")")
  r_ceiling+=("$(ratio "$cw" "$pw")")
done
summary "pull throughput / nbdcopy's" "${r_peer[@]}"
summary "pull throughput / cp's (the disk)" "${r_ceiling[@]}"
[ -z "$base" ] || summary "pull throughput / the baseline's" "${r_base[@]}"
echo "page cache dropped before each run: $cold"
