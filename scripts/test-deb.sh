#!/usr/bin/env bash
# The Debian package as an operator gets it: built from the test build's binary (no second,
# release build), checked by lintian (no error), then, as root, installed with dpkg and checked
# as a user would (the group, the enabled unit and `systemd-analyze verify`, the conffile,
# `man cryptblk`, bash completion, `cryptblk --version` and `cryptblk demo` from /usr/bin), and
# purged again. Not root, or a cryptblk package already installed: the package's files are
# unpacked with `dpkg-deb -x` and checked there instead (no maintainer scripts run).
# Called by scripts/test.sh after `cargo test`; needs lintian, man-db and dpkg-dev
# (scripts/install-deps.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
fail() { echo "test-deb: $*" >&2; exit 1; }
step() { echo "test-deb: $*"; }

scripts/build-deb.sh --profile dev --no-build
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
deb=${CARGO_TARGET_DIR:-target}/debian/cryptblk_${version}-1_amd64.deb
[ -f "$deb" ] || fail "no $deb"

step "lintian $deb"
# Errors fail; warnings are shown. The binary is the test profile's, so lintian's view of
# its hardening flags is not the release's.
lintian --tag-display-limit 0 "$deb" | tee "$deb.lintian"
if grep -q '^E: ' "$deb.lintian"; then
  fail "lintian reports errors"
fi

work=$(mktemp -d)
installed=0
cleanup() {
  if [ "$installed" = 1 ]; then
    dpkg --purge cryptblk >/dev/null || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT

if [ "$(id -u)" = 0 ] && ! dpkg-query -W cryptblk >/dev/null 2>&1; then
  step "dpkg -i"
  dpkg -i "$deb"
  installed=1
  root=""
  getent group cryptblk >/dev/null || fail "postinst made no group cryptblk"
  [ -L /etc/systemd/system/multi-user.target.wants/cryptblk.service ] ||
    fail "the unit is not enabled (no multi-user.target.wants link)"
  dpkg-query -W -f='${Conffiles}\n' cryptblk | grep -q ' /etc/cryptblk/disks.toml ' ||
    fail "/etc/cryptblk/disks.toml is not a conffile"
  man -P cat cryptblk >"$work/man.txt" 2>"$work/man.err" || fail "man cryptblk: $(cat "$work/man.err")"
  man -P cat cryptblk-serve >>"$work/man.txt" 2>>"$work/man.err" || fail "man cryptblk-serve"
else
  step "dpkg-deb -x (not root, or a cryptblk package is installed)"
  dpkg-deb -x "$deb" "$work/root"
  root=$work/root
  dpkg-deb -I "$deb" conffiles | grep -qx /etc/cryptblk/disks.toml ||
    fail "/etc/cryptblk/disks.toml is not a conffile"
  grep -q 'addgroup --system' <(dpkg-deb -I "$deb" postinst) || fail "postinst makes no group"
  man -P cat -l "$root/usr/share/man/man1/cryptblk.1.gz" >"$work/man.txt" || fail "man -l cryptblk.1.gz"
fi
grep -q 'cryptblk-serve' "$work/man.txt" || fail "cryptblk(1) does not name cryptblk-serve"
grep -q -- '--vhost-user-blk' "$work/man.txt" || [ -n "$root" ] || fail "cryptblk-serve(1) lacks --vhost-user-blk"

step "the unit"
unit=$root/usr/lib/systemd/system/cryptblk.service
[ -f "$unit" ] || unit=$root/lib/systemd/system/cryptblk.service
[ -f "$unit" ] || fail "no cryptblk.service under $root/usr/lib/systemd/system or $root/lib/systemd/system"
if [ -n "$root" ]; then
  # verify checks that ExecStart's program exists: point it at the unpacked binary.
  sed "s|/usr/bin/cryptblk|$root/usr/bin/cryptblk|" "$unit" >"$work/cryptblk.service"
  unit=$work/cryptblk.service
fi
systemd-analyze verify --man=no "$unit" 2>"$work/verify.err" || fail "systemd-analyze verify: $(cat "$work/verify.err")"
[ ! -s "$work/verify.err" ] || fail "systemd-analyze verify warns: $(cat "$work/verify.err")"

step "completions and the example config"
bash -c "source '$root/usr/share/bash-completion/completions/cryptblk' && declare -F _cryptblk >/dev/null" ||
  fail "the bash completion defines no _cryptblk"
[ -f "$root/usr/share/zsh/vendor-completions/_cryptblk" ] || fail "no zsh completion"
[ -f "$root/usr/share/fish/vendor_completions.d/cryptblk.fish" ] || fail "no fish completion"
[ -f "$root/usr/share/doc/cryptblk/examples/cryptblk-vm.xml" ] || fail "no libvirt example"
grep -q '^# \[\[disk\]\]' "$root/etc/cryptblk/disks.toml" || fail "the example disks.toml has no example disk"

step "cryptblk --version and demo from the installed binary"
bin=$root/usr/bin/cryptblk
"$bin" --version | grep -qx "cryptblk $version" || fail "$bin --version: $("$bin" --version)"
"$bin" demo --dir "$work/demo" --size 64M >"$work/demo.log" 2>&1 || {
  cat "$work/demo.log"
  fail "cryptblk demo failed"
}
grep -q 'ratio' "$work/demo.log" || { cat "$work/demo.log"; fail "the demo printed no comparison"; }
step "ok: $deb"
