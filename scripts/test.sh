#!/usr/bin/env bash
# The whole test suite, from a fresh Debian 12 machine with the Rust toolchain: installs the
# real tools the interop tests drive, then runs every crate's tests (unit, known-answer,
# interop with qemu-img/qemu-io/cryptsetup, corpus and fuzz-corpus replay, CLI contract).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
cargo fmt --version >/dev/null 2>&1 || rustup component add rustfmt
cargo clippy --version >/dev/null 2>&1 || rustup component add clippy
cargo fmt --all -- --check
# Lints include the workspace rule that every unsafe block carries a SAFETY comment.
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo test --workspace --locked "$@"
