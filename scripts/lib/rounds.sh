# What the shell benchmarks (scripts/bench-backup*.sh) share: dropping the page cache before a
# device run, timing a command, per-round ratios and their median and worst round. Sourced;
# `dir` must name the benchmark's work directory.

cold=yes
# Writes back and drops the page cache (as root; otherwise the runs are warm: `cold=no`).
drop() {
  sync
  if [ -w /proc/sys/vm/drop_caches ]; then echo 3 >/proc/sys/vm/drop_caches; else cold=no; fi
}

# Runs a command with its output discarded; prints its "wall cpu" seconds, or shows its
# stderr and fails.
timed() {
  /usr/bin/time -o "$dir/time.txt" -f '%e %U %S' "$@" >/dev/null 2>"$dir/timed.err" ||
    { cat "$dir/timed.err" >&2; return 1; }
  awk '{ printf "%.3f %.3f\n", $1, $2 + $3 }' "$dir/time.txt"
}

# A / B, to three places.
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.3f", a / b }'; }

# "WHAT: median M, worst W" of the per-round ratios given after WHAT.
summary() {
  printf '%s\n' "${@:2}" | sort -n | awk -v what="$1" '
    { v[NR] = $1 } END { m = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2;
      printf "%s: median %.2f, worst %.2f\n", what, m, v[1] }'
}
