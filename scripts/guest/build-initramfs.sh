#!/usr/bin/env bash
# Builds the cryptblk test guest from Debian 12 packages only:
#   OUTDIR/vmlinuz            the kernel of linux-image-amd64's linux-image-6.1.*-amd64 dependency
#   OUTDIR/initramfs.cpio.gz  busybox-static, fio with every shared library it links, the virtio
#                             modules that kernel needs for a virtio-blk disk, and scripts/guest/init.sh
# The kernel package is fetched with `apt-get download` and unpacked into a temporary directory
# (never installed); busybox-static, fio, cpio and xz-utils are installed when missing (sudo when
# not root). The result is cached under a content key (this script, init.sh, the package versions
# and the bytes of every binary copied in): a rerun with nothing changed returns at once.
# Usage: scripts/guest/build-initramfs.sh OUTDIR
set -euo pipefail
[ $# -eq 1 ] || { echo "usage: $0 OUTDIR" >&2; exit 1; }
here="$(cd "$(dirname "$0")" && pwd)"
mkdir -p "$1"
outdir="$(cd "$1" && pwd)"

sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
updated=""
apt_update() {
  [ -n "$updated" ] || { $sudo apt-get update -qq; updated=1; }
}

# Host tools, like scripts/install-deps.sh: Debian package names, installed only when missing.
missing=()
for pkg in busybox-static fio cpio xz-utils; do
  dpkg-query -W -f='${Status}\n' "$pkg" 2>/dev/null | grep -q '^install ok installed$' ||
    missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing: ${missing[*]}" >&2
  apt_update
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# The kernel package linux-image-amd64 currently points at, and its version (its Depends line
# reads "linux-image-6.1.0-N-amd64 (= VERSION)").
kernel_dep() { apt-cache show --no-all-versions linux-image-amd64 2>/dev/null |
  sed -n 's/^Depends:.*\(linux-image-6\.1\.[0-9.-]*-amd64\) *(= *\([^)]*\)).*/\1 \2/p' | head -1; }
dep="$(kernel_dep)"
if [ -z "$dep" ]; then
  apt_update
  dep="$(kernel_dep)"
fi
[ -n "$dep" ] || { echo "$0: no linux-image-6.1.*-amd64 (= version) behind linux-image-amd64" >&2; exit 1; }
read -r kpkg kver <<<"$dep"

busybox=/bin/busybox
fio="$(command -v fio)"
# fio's shared libraries and the dynamic loader, as the host resolves them.
ldd_out="$(ldd "$fio")"
if grep -q 'not found' <<<"$ldd_out"; then
  echo "$0: fio has unresolved libraries:" >&2
  grep 'not found' <<<"$ldd_out" >&2
  exit 1
fi
mapfile -t libs < <(awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// { print $1 }' <<<"$ldd_out" | sort -u)

key="$({
  cat "$0" "$here/init.sh"
  echo "$kpkg=$kver"
  dpkg-query -W -f='${Package}=${Version}\n' busybox-static fio
  sha256sum "$busybox" "$fio" "${libs[@]}"
} | sha256sum | cut -d' ' -f1)"

exec 9>"$outdir/.lock"
flock 9
if [ -f "$outdir/key" ] && [ "$(cat "$outdir/key")" = "$key" ] &&
  [ -f "$outdir/vmlinuz" ] && [ -f "$outdir/initramfs.cpio.gz" ]; then
  echo "guest artifacts up to date in $outdir (key ${key:0:12})" >&2
  exit 0
fi

work="$(mktemp -d "$outdir/.build.XXXXXX")"
trap 'rm -rf "$work"' EXIT
echo "building guest: $kpkg $kver, busybox-static, fio $("$fio" --version) -> $outdir" >&2

# Kernel: download the .deb, unpack vmlinuz, modules.builtin and the virtio drivers only.
(cd "$work" && apt-get download -qq "$kpkg=$kver" 2>/dev/null) ||
  (cd "$work" && apt-get download "$kpkg=$kver")
deb="$(ls "$work"/*.deb)"
mkdir "$work/kernel"
dpkg-deb --fsys-tarfile "$deb" | tar -x -C "$work/kernel" --wildcards \
  './boot/vmlinuz-*' './lib/modules/*/modules.builtin' './lib/modules/*/kernel/drivers/virtio/*' \
  './lib/modules/*/kernel/drivers/block/virtio_blk.ko*'
rm -f "$deb"
moddir="$(echo "$work"/kernel/lib/modules/*)"
kname="$(basename "$moddir")"

root="$work/root"
mkdir -p "$root"/{bin,dev,proc,sys,tmp,etc,usr/bin,lib/modules}

# Modules: what virtio-blk over PCI needs, minus what the kernel has built in, plus every
# module those depend on (from each module's .modinfo "depends="), loaded in dependency order.
declare -A done_mod=()
order=()
module_file() { # NAME -> path of NAME.ko[.xz|.zst] in the unpacked tree, or nothing
  find "$moddir/kernel" \( -name "$1.ko" -o -name "$1.ko.xz" -o -name "$1.ko.zst" \) | head -1
}
add_module() {
  local name="$1" file dep deps
  [ -z "${done_mod[$name]:-}" ] || return 0
  done_mod[$name]=1
  if grep -Eq "/$name\.ko(\.[a-z]+)?\$" "$moddir/modules.builtin"; then
    echo "  module $name: built in" >&2
    return 0
  fi
  file="$(module_file "$name")"
  [ -n "$file" ] || { echo "$0: module $name not found in $kpkg" >&2; exit 1; }
  case "$file" in
  *.ko.xz) xz -dc "$file" >"$root/lib/modules/$name.ko" ;;
  *.ko.zst) zstd -qdc "$file" >"$root/lib/modules/$name.ko" ;;
  *) cp "$file" "$root/lib/modules/$name.ko" ;;
  esac
  deps="$(tr '\0' '\n' <"$root/lib/modules/$name.ko" | sed -n 's/^depends=//p' | head -1)"
  for dep in ${deps//,/ }; do
    add_module "${dep//-/_}"
  done
  order+=("$name")
  echo "  module $name: loaded at boot${deps:+ after $deps}" >&2
}
for m in virtio virtio_ring virtio_pci_modern_dev virtio_pci_legacy_dev virtio_pci virtio_blk; do
  add_module "$m"
done
printf '%s\n' "${order[@]}" >"$root/lib/modules/load-order"

# busybox (applet links are made by the init script) and fio with its libraries at the paths
# the host resolved; the guest loader finds them through LD_LIBRARY_PATH.
cp "$busybox" "$root/bin/busybox"
cp "$fio" "$root/usr/bin/fio"
for lib in "${libs[@]}"; do
  mkdir -p "$root$(dirname "$lib")"
  cp -L "$lib" "$root$lib"
done
printf '%s\n' "${libs[@]}" | xargs -n1 dirname | sort -u | paste -sd: >"$root/etc/fio-library-path"
cp "$here/init.sh" "$root/init"
chmod 0755 "$root/init" "$root/bin/busybox" "$root/usr/bin/fio"

# Check that fio starts from the copied files alone.
loader="$(awk '$1 ~ /^\// { print $1; exit }' <<<"$ldd_out")"
libpath="$(sed "s|\\(^\\|:\\)/|\\1$root/|g" "$root/etc/fio-library-path")"
"$root$loader" --library-path "$libpath" "$root/usr/bin/fio" --version >/dev/null

(cd "$root" && find . -mindepth 1 -print0 | LC_ALL=C sort -z |
  cpio --null -o -H newc -R 0:0 --reproducible --quiet) | gzip -6 >"$work/initramfs.cpio.gz"
cp "$work/kernel/boot/vmlinuz-$kname" "$work/vmlinuz"
mv -f "$work/vmlinuz" "$outdir/vmlinuz"
mv -f "$work/initramfs.cpio.gz" "$outdir/initramfs.cpio.gz"
echo "$kname" >"$outdir/kernel-release"
echo "$key" >"$outdir/key"
echo "guest built: kernel $kname, initramfs $(du -h "$outdir/initramfs.cpio.gz" | cut -f1)" \
  "(modules: ${order[*]:-none})" >&2
