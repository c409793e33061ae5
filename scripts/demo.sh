#!/usr/bin/env bash
# Builds cryptblk and runs the built-in example: a generated sample disk is encrypted into a new
# LUKS2 image on every core, decrypted back and verified byte for byte.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked -p cryptblk
exec target/release/cryptblk demo "$@"
