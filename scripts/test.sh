#!/usr/bin/env bash
# The whole test suite, from a fresh Debian 12 machine with the Rust toolchain: installs the
# real tools the interop tests drive, then runs every crate's tests (unit, known-answer,
# interop with qemu-img/qemu-io/cryptsetup, corpus and fuzz-corpus replay, CLI contract).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
# Debian 12's cryptsetup (2.6.1) cannot decrypt an image whose header is at its head; 2.7 can,
# and the `reencrypt --decrypt` interop tests drive it: built once into /var/tmp (about a
# minute), found through CRYPTSETUP27.
CRYPTSETUP27=$(scripts/build-cryptsetup27.sh)
export CRYPTSETUP27
# Incremental compilation state is for edit-compile loops; on a one-off run it only fills the
# disk (3-4 GiB for this workspace).
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
cargo fmt --version >/dev/null 2>&1 || rustup component add rustfmt
cargo clippy --version >/dev/null 2>&1 || rustup component add clippy
cargo fmt --all -- --check
# The fuzz targets are a workspace of their own (running them needs nightly and cargo-fuzz):
# check their formatting too, and build them after the tests below.
cargo fmt --manifest-path fuzz/Cargo.toml -- --check
# Sibling modules import one way (no circle beyond the known ones the list shrinks from); the
# checker first shows it still finds a circle.
python3 scripts/check-import-cycles.py --self-test
python3 scripts/check-import-cycles.py
# Lints include the workspace rule that every unsafe block carries a SAFETY comment.
cargo clippy --workspace --all-targets --locked -- -D warnings
# Broken intra-doc links and other rustdoc warnings fail the suite.
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --locked
# The last binaries cargo runs are doc-test harnesses with nothing in them; end with one line
# that totals every test binary's result instead.
log=$(mktemp)
trap 'rm -f "$log" "$log.fuzz" "$log.deb"' EXIT
# Tests write images of up to 1 GiB each into $TMPDIR, several binaries' worth at once. On a
# machine whose disk the build has nearly filled they would fail with ENOSPC in ways that say
# nothing about cryptblk, so their temporary files go to RAM (/dev/shm) instead when the disk
# is short. Tests that need O_DIRECT use the target directory, not $TMPDIR.
free_kib() { df -Pk "$1" 2>/dev/null | awk 'NR == 2 { print $4 }'; }
tmp_free=$(free_kib "${TMPDIR:-/tmp}")
shm_free=$(free_kib /dev/shm)
target_free=$(free_kib "${CARGO_TARGET_DIR:-target}")
echo "free space: ${TMPDIR:-/tmp} $((${tmp_free:-0} / 1048576)) GiB, /dev/shm $((${shm_free:-0} / 1048576)) GiB, target $((${target_free:-0} / 1048576)) GiB"
if [ "${tmp_free:-0}" -lt $((4 << 20)) ] && [ "${shm_free:-0}" -gt $((8 << 20)) ]; then
  TMPDIR=$(mktemp -d /dev/shm/cryptblk-test.XXXXXX)
  export TMPDIR
  echo "less than 4 GiB free for temporary files: tests use $TMPDIR"
  trap 'rm -f "$log" "$log.fuzz" "$log.deb"; rm -rf "$TMPDIR"' EXIT
fi
set +e
cargo test --workspace --locked "$@" 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
set -e
if [ "$status" -eq 0 ]; then
  # The Debian package, built from the binary the tests just used, checked by lintian and,
  # as root, installed, checked as an operator would and purged (scripts/test-deb.sh).
  if ! scripts/test-deb.sh >"$log.deb" 2>&1; then
    cat "$log.deb"
    echo "the Debian package (scripts/test-deb.sh) fails"
    status=1
  else
    tail -n 1 "$log.deb"
  fi
fi
if [ "$status" -eq 0 ]; then
  # Every fuzz target still builds against the crates it fuzzes, on stable: libFuzzer is
  # linked, without the sanitizer instrumentation `cargo fuzz` adds. Same target directory,
  # optimisation and debug-info levels as the workspace, so only what differs is built again
  # (the crates whose build scripts use `cc`, whose features libfuzzer-sys changes: about 3
  # minutes on 2 cores).
  if ! cargo build --manifest-path fuzz/Cargo.toml --locked --target-dir "${CARGO_TARGET_DIR:-target}" \
    --config 'profile.dev.opt-level=1' --config 'profile.dev.package."*".opt-level=3' \
    --config 'profile.dev.debug="line-tables-only"' --config 'profile.dev.package."*".debug=false' \
    >"$log.fuzz" 2>&1; then
    cat "$log.fuzz"
    echo "the fuzz targets (fuzz/) do not build"
    status=1
  fi
fi
# A test that cannot run here (cryptsetup's corpus absent) prints `SKIPPED <binary>::<test>:
# <why>` and returns, which libtest counts as passed: count it as skipped instead (anywhere on
# a line: with --test-threads=1 libtest's "test NAME ... " comes first).
awk '/^test result:/ { p += $4; f += $6; i += $8 }
     /SKIPPED [^ ]+::[^ ]+: / { s++ }
     END { printf "%d passed, %d failed, %d skipped\n", p - s, f, i + s }' "$log"
exit "$status"
