#!/usr/bin/env bash
# The daemon-wide memory budget under many busy queues (issue 33): one `cryptblk serve` with
# DISKS LUKS2 disks added through `ctl disk-add` (2 queues each, pbkdf2 so that adding them is
# quick), CLIENTS libblkio clients (vu_bench) of 64 KiB random writes at depth 64 on both queues
# of the first CLIENTS disks for RUNTIME seconds; then the clients leave and the daemon idles.
# The daemon's memory (/proc/PID/status) is sampled every 100 ms throughout.
#
#   scripts/bench-memory-budget.sh [--budget 256M|default|none] [--disks 200] [--clients 40]
#       [--queues 2] [--depth 64] [--bs 65536] [--runtime 8] [--idle 10] [--dir DIR]
#       [--cryptblk BIN] [--vu-bench BIN] [--results FILE] [--serve-arg ARG]...
#
# --budget none runs without the option (a binary that does not know it, e.g. --cryptblk OLD),
# default without it on a binary that has one. Writes JSON lines to FILE (default
# memory-budget-results.jsonl): one "sample" record per 100 ms (t_s, phase, vm_rss_kib,
# rss_anon_kib, rss_file_kib, rss_shmem_kib, threads, fds), one "client" record per client
# (vu_bench's line: queue_ios, iops, runtime_s, exit status), and a "summary" record: idle
# RssAnon before the clients, peak RssAnon and VmRSS under load, RssAnon after IDLE seconds,
# each queue's IOPS (min, 10th percentile, median, 90th, max, min/max) as its client timed it
# and as the daemon counted it over one window in which all clients run (window_*: from 30 %
# to 70 % of the run; the clients start one after another, so their own runs overlap only in
# part), client errors, and the
# daemon's cryptblk_memory_* metrics at the end (budget, peak reserved, waits), and the load
# average before the clients start and when they have left (the machine may be shared).
# Prints it.
#
# Guest memory (the clients' buffers, mapped by the daemon) is the clients' memory and shows in
# RssShmem; the daemon's own memory is RssAnon (+ RssFile: its binary). The budget bounds
# RssAnon.
set -euo pipefail

budget=256M disks=200 clients=40 queues=2 depth=64 bs=65536 runtime=8 idle=10
dir="" cryptblk="" vu="" results=memory-budget-results.jsonl
serve_args=()
while [ $# -gt 0 ]; do
  case $1 in
    --budget) budget=$2; shift 2 ;;
    --disks) disks=$2; shift 2 ;;
    --clients) clients=$2; shift 2 ;;
    --queues) queues=$2; shift 2 ;;
    --depth) depth=$2; shift 2 ;;
    --bs) bs=$2; shift 2 ;;
    --runtime) runtime=$2; shift 2 ;;
    --idle) idle=$2; shift 2 ;;
    --dir) dir=$2; shift 2 ;;
    --cryptblk) cryptblk=$2; shift 2 ;;
    --vu-bench) vu=$2; shift 2 ;;
    --results) results=$2; shift 2 ;;
    --serve-arg) serve_args+=("$2"); shift 2 ;;
    *) sed -n '2,28p' "$0" >&2; exit 1 ;;
  esac
done
if [ "$clients" -gt "$disks" ]; then
  echo "--clients $clients is more than --disks $disks" >&2
  exit 1
fi
root=$(cd "$(dirname "$0")/.." && pwd)
if [ -z "$cryptblk" ] || [ -z "$vu" ]; then
  (cd "$root" && cargo build --release -q -p cryptblk -p cryptblk-vhost-user-blk --bin cryptblk --example vu_bench)
  target=$(cd "$root" && cargo metadata --format-version 1 --no-deps | jq -r .target_directory)
  cryptblk=${cryptblk:-$target/release/cryptblk}
  vu=${vu:-$target/release/examples/vu_bench}
fi
work=$(realpath "$(mktemp -d "${dir:-${TMPDIR:-/tmp}}/memory-budget.XXXXXX")")
daemon=""
cleanup() {
  [ -n "$daemon" ] && kill "$daemon" 2>/dev/null && wait "$daemon" 2>/dev/null
  [ -n "${sampler:-}" ] && kill "$sampler" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT

# One image, copied: every disk has the same key, which does not matter here.
printf 'memory-budget' > "$work/key"
chmod 600 "$work/key"
"$cryptblk" format -q --pbkdf pbkdf2 --pbkdf-force-iterations 1000 -d "$work/key" \
  "$work/disk.luks" 64M >/dev/null
for i in $(seq 1 "$disks"); do
  cp --sparse=always "$work/disk.luks" "$work/d$i.luks"
done

: > "$results"
args=(serve --control "$work/ctl.sock" --metrics "unix:$work/metrics.sock")
case $budget in
  none | default) ;;
  *) args+=(--memory-budget "$budget") ;;
esac
"$cryptblk" "${args[@]}" "${serve_args[@]}" 2> "$work/serve.log" &
daemon=$!
for _ in $(seq 100); do [ -S "$work/ctl.sock" ] && break; sleep 0.1; done
[ -S "$work/ctl.sock" ] || { cat "$work/serve.log" >&2; exit 1; }
started=$(date +%s.%N)
for i in $(seq 1 "$disks"); do
  "$cryptblk" ctl -s "$work/ctl.sock" disk-add "d$i" --image "$work/d$i.luks" \
    --key-file "$work/key" --vhost-user-blk "$work/d$i.sock" --num-queues "$queues" \
    --unsealed-memory >/dev/null
done
echo "added $disks disks in $(echo "$(date +%s.%N) - $started" | bc) s" >&2

phase_file="$work/phase"
echo idle-before > "$phase_file"
sample() {
  local t0 now phase
  t0=$(date +%s.%N)
  while kill -0 "$daemon" 2>/dev/null; do
    now=$(date +%s.%N)
    phase=$(cat "$phase_file")
    awk -v t="$(echo "$now - $t0" | bc)" -v phase="$phase" -v fds="$(ls "/proc/$daemon/fd" | wc -l)" '
      /^(VmRSS|RssAnon|RssFile|RssShmem|Threads):/ { v[$1] = $2 }
      END { printf "{\"record\":\"sample\",\"t_s\":%.2f,\"phase\":\"%s\",\"vm_rss_kib\":%d,\"rss_anon_kib\":%d,\"rss_file_kib\":%d,\"rss_shmem_kib\":%d,\"threads\":%d,\"fds\":%d}\n",
        t, phase, v["VmRSS:"], v["RssAnon:"], v["RssFile:"], v["RssShmem:"], v["Threads:"], fds }' \
      "/proc/$daemon/status" >> "$results" 2>/dev/null || true
    sleep 0.1
  done
}
sample &
sampler=$!
sleep 2

load_before=$(cut -d' ' -f1-3 /proc/loadavg)
echo load > "$phase_file"
pids=()
for i in $(seq 1 "$clients"); do
  "$vu" --socket "$work/d$i.sock" --rw randwrite --bs "$bs" --iodepth "$depth" \
    --queues "$queues" --runtime "$runtime" --size $((64 << 20)) \
    > "$work/client$i.json" 2> "$work/client$i.err" &
  pids+=($!)
done
# Each queue's writes counted by the daemon over one window in which every client runs (the
# clients start one after another and each times its own run, so their own figures cover
# windows that overlap only in part): from 30 % to 70 % of the run.
writes_by_queue() {
  curl -s --unix-socket "$work/metrics.sock" http://localhost/metrics |
    awk '/^cryptblk_io_requests_total\{/ && /op="write"/ && /export="vhost-user-blk"/ {
      match($0, /disk="[^"]*"/); d = substr($0, RSTART + 6, RLENGTH - 7)
      match($0, /queue="[^"]*"/); q = substr($0, RSTART + 7, RLENGTH - 8)
      printf "%s/%s %s\n", d, q, $NF }' | sort
}
sleep "$(echo "$runtime * 0.3" | bc)"
window_start=$(date +%s.%N)
writes_by_queue > "$work/writes-start"
sleep "$(echo "$runtime * 0.4" | bc)"
writes_by_queue > "$work/writes-end"
window_s=$(printf '%.3f' "$(echo "$(date +%s.%N) - $window_start" | bc)")
window_iops=$(join "$work/writes-start" "$work/writes-end" |
  awk -v w="$window_s" '$3 > $2 { printf "%s%.1f", sep, ($3 - $2) / w; sep = "," } BEGIN { printf "[" } END { print "]" }')
for i in $(seq 1 "$clients"); do
  status=0
  wait "${pids[$((i - 1))]}" || status=$?
  line=$(grep '^{' "$work/client$i.json" | tail -1)
  [ -n "$line" ] || line='{}'
  echo "$line" | jq -c --argjson status "$status" --arg disk "d$i" \
    --arg err "$(head -c 500 "$work/client$i.err")" \
    '{record: "client", disk: $disk, status: $status, stderr: $err} + .' >> "$results"
done
load_after=$(cut -d' ' -f1-3 /proc/loadavg)
echo idle-after > "$phase_file"
sleep "$idle"
echo done > "$phase_file"
budget_metrics=$(curl -s --unix-socket "$work/metrics.sock" http://localhost/metrics |
    awk '/^cryptblk_memory_/ { printf "%s\"%s\":%s", sep, $1, $2; sep="," } BEGIN { printf "{" } END { print "}" }')
sleep 0.3
kill "$sampler" 2>/dev/null || true
wait "$sampler" 2>/dev/null || true
sampler=""

summary=$(jq -s -c --arg budget "$budget" --argjson disks "$disks" --argjson clients "$clients" \
  --argjson idle "$idle" --arg binary "$cryptblk" --argjson metrics "$budget_metrics" \
  --arg load_before "$load_before" --arg load_after "$load_after" \
  --argjson window_iops "$window_iops" --argjson window_s "$window_s" '
  (map(select(.record == "sample"))) as $s
  | (map(select(.record == "client"))) as $c
  | ($s | map(select(.phase == "idle-before")) | last) as $before
  | ($s | map(select(.phase == "load" or .phase == "idle-after"))) as $busy
  | ($s | map(select(.phase == "idle-after")) | last) as $after
  | ([$c[] | select(.queue_ios != null) | .runtime_s as $r | .queue_ios[] / $r] | sort) as $q
  | ($window_iops | sort) as $w
  | def wpct(p): if ($w | length) > 0 then $w[(($w | length) - 1) * p | floor] | floor else null end;
  def pct(p): if ($q | length) > 0 then $q[(($q | length) - 1) * p | floor] | floor else null end;
  {record: "summary", binary: $binary, budget: $budget, disks: $disks, clients: $clients,
     load_avg_before: $load_before, load_avg_after_clients: $load_after,
     queues: ($q | length),
     idle_before_rss_anon_mib: ($before.rss_anon_kib / 1024 | floor),
     peak_rss_anon_mib: ($busy | map(.rss_anon_kib) | max / 1024 | floor),
     peak_vm_rss_mib: ($busy | map(.vm_rss_kib) | max / 1024 | floor),
     peak_rss_shmem_mib: ($busy | map(.rss_shmem_kib) | max / 1024 | floor),
     rss_file_mib: ($before.rss_file_kib / 1024 | floor),
     idle_after_s: $idle,
     idle_after_rss_anon_mib: ($after.rss_anon_kib / 1024 | floor),
     idle_after_vm_rss_mib: ($after.vm_rss_kib / 1024 | floor),
     threads_idle: $before.threads, peak_threads: ($busy | map(.threads) | max),
     fds_idle: $before.fds,
     total_iops: ([$c[] | .iops // 0] | add | floor),
     queue_iops_min: ($q | min | floor), queue_iops_p10: pct(0.1), queue_iops_median: pct(0.5),
     queue_iops_p90: pct(0.9), queue_iops_max: ($q | max | floor),
     queue_iops_min_over_max: (if ($q | length) > 0 then (($q | min) / ($q | max) * 1000 | floor) / 1000 else null end),
     window_s: ($window_s * 100 | floor / 100), window_queues: ($w | length),
     window_queue_iops_min: wpct(0), window_queue_iops_p10: wpct(0.1),
     window_queue_iops_median: wpct(0.5), window_queue_iops_p90: wpct(0.9),
     window_queue_iops_max: wpct(1),
     window_queue_iops_min_over_max: (if ($w | length) > 0 then (($w | min) / ($w | max) * 1000 | floor) / 1000 else null end),
     client_errors: ([$c[] | select(.status != 0)] | length),
     budget_metrics: $metrics}' "$results")
echo "$summary" >> "$results"
echo "$summary" | jq .
