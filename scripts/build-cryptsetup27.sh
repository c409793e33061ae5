#!/usr/bin/env bash
# Builds cryptsetup 2.7.5 from Debian's source tarball into a private prefix (default
# /var/tmp/cryptsetup-2.7.5, never over the system's cryptsetup) and prints its binary's path.
# The interop tests of `cryptblk reencrypt --decrypt` drive it: Debian 12's cryptsetup 2.6.1
# cannot decrypt an image whose header is at its head, 2.7 can. Idempotent: a finished build
# is only checked and its path printed. Tests find the binary through CRYPTSETUP27 or the
# default prefix. Uses sudo for apt when not root.
set -euo pipefail
version=2.7.5
sha256=66f82757456411353216def2e93ee6f82e1dc5c8b583cb9b1c84ecb918b60980
url="http://deb.debian.org/debian/pool/main/c/cryptsetup/cryptsetup_${version}.orig.tar.gz"
prefix="${CRYPTSETUP27_PREFIX:-/var/tmp/cryptsetup-$version}"
binary="$prefix/sbin/cryptsetup"

# The binary finds its own libcryptsetup through the rpath set below, so no LD_LIBRARY_PATH.
if [ -x "$binary" ] && "$binary" --version 2>/dev/null | grep -q "cryptsetup $version"; then
  echo "$binary"
  exit 0
fi

deps=(libdevmapper-dev libargon2-dev libblkid-dev libpopt-dev libjson-c-dev libssl-dev uuid-dev
  pkg-config gcc meson ninja-build curl ca-certificates)
missing=()
for pkg in "${deps[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'ok installed' || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "installing: ${missing[*]}" >&2
  $sudo apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >&2
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/cryptsetup-build.XXXXXX")
trap 'rm -rf "$work"' EXIT
# The checked tarball is kept beside the prefix, so a rebuild needs no download.
tarball="$(dirname "$prefix")/cryptsetup_${version}.orig.tar.gz"
if ! echo "$sha256  $tarball" | sha256sum --check --status 2>/dev/null; then
  echo "downloading $url" >&2
  curl -fsSL --retry 3 -o "$work/src.tar.gz" "$url"
  if ! echo "$sha256  $work/src.tar.gz" | sha256sum --check --status; then
    echo "error: $url does not have sha256 $sha256; not building it" >&2
    exit 1
  fi
  mv "$work/src.tar.gz" "$tarball"
fi
tar -xzf "$tarball" -C "$work"
cd "$work/cryptsetup-$version"
# Debian's orig tarball is a git export (no generated ./configure): meson builds it. Only the
# cryptsetup binary and its library: no manual pages (asciidoctor), translations, SSH or external
# token plugins, veritysetup/integritysetup, udev, OPAL, keyring or kernel crypto API.
meson setup build --prefix="$prefix" --libdir=lib --buildtype=release -Dasciidoc=disabled \
  -Dnls=false -Dssh-token=false -Dexternal-tokens=false -Dveritysetup=false \
  -Dintegritysetup=false -Dudev=false -Dhw-opal=false -Dkeyring=false -Dkernel_crypto=false \
  -Dcrypto-backend=openssl -Dargon-implementation=libargon2 -Dpwquality=false \
  -Dc_link_args="-Wl,-rpath,$prefix/lib" >"$work/setup.log" 2>&1 ||
  { tail -30 "$work/setup.log" >&2; exit 1; }
libcryptsetup_version=$(sed -n "s/^libcryptsetup_version = '\\(.*\\)'$/\\1/p" meson.build)
ninja -C build src/cryptsetup >"$work/build.log" 2>&1 || { tail -40 "$work/build.log" >&2; exit 1; }
# Not `ninja install`: it also writes /usr/lib/tmpfiles.d/cryptsetup.conf, the system package's
# file. The binary and its library are all the tests need.
install -D -m 0755 build/src/cryptsetup "$binary"
install -D -m 0755 "build/lib/libcryptsetup.so.$libcryptsetup_version" \
  "$prefix/lib/libcryptsetup.so.$libcryptsetup_version"
ln -sf "libcryptsetup.so.$libcryptsetup_version" "$prefix/lib/libcryptsetup.so.12"
"$binary" --version >&2
echo "$binary"
