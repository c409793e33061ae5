#!/usr/bin/env bash
# Instructions and branches per function of one crate's library, as optimized code (opt-level
# 3, one codegen unit, so that inlining does not depend on how the crate is partitioned): a
# measure of what a change costs the request path that wall-clock benchmarks on a shared,
# drifting machine cannot resolve. Compare two commits by running it on each and diffing.
#
#   scripts/fn-sizes.sh CRATE [SUBSTRING]     e.g. scripts/fn-sizes.sh cryptblk-volume ::crypt::
#
# Prints `instructions branches function` for the crate's functions whose demangled name
# contains SUBSTRING (default: all), sorted by name. Builds into the usual target directory
# (the dev profile at opt-level 3: the dependencies are built so already; the next ordinary
# build compiles the crate again). It measures the checkout it is run in, so a copy of it
# measures an older commit too:
#   cp scripts/fn-sizes.sh /tmp && git checkout OLD && /tmp/fn-sizes.sh CRATE > old.txt
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
crate=${1:?usage: scripts/fn-sizes.sh CRATE [SUBSTRING]}
filter=${2:-}
lib=${crate//-/_}
export CARGO_PROFILE_DEV_OPT_LEVEL=3 CARGO_PROFILE_DEV_DEBUG=0 CARGO_INCREMENTAL=0
# Compiled again even when cargo finds it fresh: the assembly is written only by a compile.
lib_src=$(cargo metadata --no-deps --format-version 1 | python3 -c '
import json, sys
crate = sys.argv[1]
for p in json.load(sys.stdin)["packages"]:
    if p["name"] == crate:
        print(next(t["src_path"] for t in p["targets"] if "lib" in t["kind"]))' "$crate")
touch "${lib_src:?no library crate $crate in this workspace}"
rm -f target/debug/deps/"$lib"-*.s
cargo rustc --quiet -p "$crate" --lib -- --emit=asm -C codegen-units=1
asm=$(ls target/debug/deps/"$lib"-*.s)
python3 - "$asm" "$lib" "$filter" <<'PY'
import re, subprocess, sys
path, lib, want = sys.argv[1:]
funcs, name = {}, None
for line in open(path):
    label = re.match(r"^([A-Za-z_$][\w.$]*):", line)
    if label:
        name = label.group(1)
        funcs.setdefault(name, [])
    elif name and line.startswith("\t") and not line.lstrip().startswith("."):
        funcs[name].append(line.strip())
names = list(funcs)
demangled = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True,
                           text=True, check=True).stdout.split("\n")
rows = []
for raw, readable in zip(names, demangled):
    readable = re.sub(r"::h[0-9a-f]{16}$", "", readable)
    if lib not in readable or want not in readable or not funcs[raw]:
        continue
    branches = sum(1 for i in funcs[raw] if re.match(r"j[a-z]+\s", i))
    rows.append((readable, len(funcs[raw]), branches))
for readable, n, b in sorted(rows):
    print(f"{n:6d} {b:5d}  {readable}")
PY
