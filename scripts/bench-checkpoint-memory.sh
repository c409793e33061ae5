#!/usr/bin/env bash
# What checkpoints cost a host (issue 36): one `cryptblk serve` with DISKS LUKS2 disks of SIZE
# (sparse images, pbkdf2 so that adding them is quick), then CHECKPOINTS checkpoints added to
# every disk through `ctl checkpoint-add`, then a `ctl upgrade` (the successor opens every
# disk's checkpoints). Prints one JSON line: the daemon's RssAnon before and after each round
# of checkpoints and the time each round took; the upgrade's time until the successor answers
# for the last disk's checkpoints, and the successor's RssAnon.
#
#   scripts/bench-checkpoint-memory.sh [--disks 200] [--size 1T] [--checkpoints 2]
#       [--cryptblk BIN] [--dir DIR]
set -euo pipefail

disks=200 size=1T checkpoints=2 cryptblk="" dir=""
while [ $# -gt 0 ]; do
  case $1 in
    --disks) disks=$2; shift 2 ;;
    --size) size=$2; shift 2 ;;
    --checkpoints) checkpoints=$2; shift 2 ;;
    --cryptblk) cryptblk=$2; shift 2 ;;
    --dir) dir=$2; shift 2 ;;
    *) sed -n '2,11p' "$0" >&2; exit 1 ;;
  esac
done
root=$(cd "$(dirname "$0")/.." && pwd)
if [ -z "$cryptblk" ]; then
  (cd "$root" && cargo build --release -q -p cryptblk --bin cryptblk)
  cryptblk=$(cd "$root" && cargo metadata --format-version 1 --no-deps | jq -r .target_directory)/release/cryptblk
fi
work=$(realpath "$(mktemp -d "${dir:-${TMPDIR:-/tmp}}/checkpoint-memory.XXXXXX")")
daemon=""
cleanup() {
  [ -n "$daemon" ] && kill "$daemon" 2>/dev/null && wait "$daemon" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT

printf 'checkpoint-memory' > "$work/key"
chmod 600 "$work/key"
"$cryptblk" format -q --pbkdf pbkdf2 --pbkdf-force-iterations 1000 -d "$work/key" \
  "$work/disk.luks" "$size" >/dev/null
for i in $(seq 1 "$disks"); do cp --sparse=always "$work/disk.luks" "$work/d$i.luks"; done

"$cryptblk" serve --control "$work/ctl.sock" > "$work/serve.out" 2> "$work/serve.log" &
daemon=$!
for _ in $(seq 100); do [ -S "$work/ctl.sock" ] && break; sleep 0.1; done
[ -S "$work/ctl.sock" ] || { cat "$work/serve.log" >&2; exit 1; }
for i in $(seq 1 "$disks"); do
  "$cryptblk" ctl -s "$work/ctl.sock" disk-add "d$i" --image "$work/d$i.luks" \
    --key-file "$work/key" --vhost-user-blk "$work/d$i.sock" --unsealed-memory >/dev/null
done
rss_anon_kib() { awk '/^RssAnon:/ { print $2 }' "/proc/$daemon/status"; }

rounds="[]"
before=$(rss_anon_kib)
for c in $(seq 1 "$checkpoints"); do
  started=$(date +%s.%N)
  for i in $(seq 1 "$disks"); do
    "$cryptblk" ctl -s "$work/ctl.sock" checkpoint-add "d$i" "c$c" >/dev/null
  done
  took=$(echo "$(date +%s.%N) - $started" | bc)
  rounds=$(jq -c --argjson kib "$(rss_anon_kib)" --argjson s "$took" \
    '. + [{rss_anon_kib: $kib, add_all_s: $s}]' <<< "$rounds")
done

started=$(date +%s.%N)
"$cryptblk" ctl -s "$work/ctl.sock" upgrade >/dev/null
until "$cryptblk" ctl -s "$work/ctl.sock" checkpoint-list "d$disks" >/dev/null 2>&1; do sleep 0.05; done
upgrade_s=$(echo "$(date +%s.%N) - $started" | bc)
# The successor: started by its predecessor with the descriptors it hands over.
daemon=$(pgrep -n -f -- "--control $work/ctl.sock --take-over-fd")
jq -n -c --arg binary "$cryptblk" --argjson disks "$disks" --arg size "$size" \
  --argjson before "$before" --argjson rounds "$rounds" --arg load "$(cut -d' ' -f1-3 /proc/loadavg)" \
  --argjson upgrade_s "$upgrade_s" --argjson successor "$(rss_anon_kib)" \
  '{binary: $binary, disks: $disks, size: $size, rss_anon_kib_without: $before,
    after_each_checkpoint: $rounds, upgrade_until_last_disk_answers_s: $upgrade_s,
    successor_rss_anon_kib: $successor, load_avg: $load}'
