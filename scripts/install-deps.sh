#!/usr/bin/env bash
# Installs the Debian packages cryptblk's tests and benchmarks drive (the real peers: qemu-img,
# qemu-io, cryptsetup, clevis and a tang server) plus what the vendored OpenSSL build, the
# fuzz targets' libFuzzer (C++) and the Debian package's build and checks (dpkg-dev, lintian,
# man-db; scripts/build-deb.sh installs cargo-deb with cargo) need. Idempotent; uses sudo when not root.
# `--spdk` adds what scripts/build-spdk.sh needs to build SPDK against the system DPDK (the
# benchmark's peer (e); CI does not build SPDK, so it is not in the default set).
set -euo pipefail
declare -A want=(
  [qemu-img]=qemu-utils [qemu-io]=qemu-utils [cryptsetup]=cryptsetup-bin [xz]=xz-utils
  [openssl]=openssl [perl]=perl [make]=make [cc]=gcc [g++]=g++ [/usr/bin/time]=time [tar]=tar
  [qemu-system-x86_64]=qemu-system-x86 [busybox]=busybox-static [fio]=fio [cpio]=cpio
  [jq]=jq [nbdinfo]=libnbd-bin [nbdcopy]=libnbd-bin [qemu-storage-daemon]=qemu-system-common
  [ceph-mon]=ceph-mon [ceph-osd]=ceph-osd [rbd]=ceph-common [/usr/lib/x86_64-linux-gnu/librbd.so.1]=librbd1
  [/usr/lib/x86_64-linux-gnu/qemu/block-rbd.so]=qemu-block-extra [uuidgen]=uuid-runtime
  [groff]=groff-base [systemd-analyze]=systemd [man]=man-db
  [lintian]=lintian [dpkg-shlibdeps]=dpkg-dev [addgroup]=adduser
  [virt-xml-validate]=libvirt-clients [xmllint]=libxml2-utils [libvirtd]=libvirt-daemon-system
  [/usr/lib/python3/dist-packages/prometheus_client/parser.py]=python3-prometheus-client
  [clevis]=clevis [clevis-luks-bind]=clevis-luks [jose]=jose [/usr/libexec/tangd]=tang [socat]=socat
)
if [ "${1:-}" = --spdk ]; then
  for pkg in libdpdk-dev libcunit1-dev libaio-dev libssl-dev libjson-c-dev libcmocka-dev uuid-dev \
    libiscsi-dev libncurses-dev python3-dev unzip libfuse3-dev nasm libnuma-dev autoconf automake \
    libtool help2man liburing-dev pkg-config python3-pyelftools meson ninja-build; do
    want["/spdk-build-dep/$pkg"]=$pkg
  done
fi
missing=()
for tool in "${!want[@]}"; do
  if [[ $tool == /spdk-build-dep/* ]]; then
    dpkg-query -W -f='${Status}' "${want[$tool]}" 2>/dev/null | grep -q 'ok installed' ||
      missing+=("${want[$tool]}")
    continue
  fi
  command -v "$tool" >/dev/null 2>&1 || [[ $tool == /* && -e $tool ]] || missing+=("${want[$tool]}")
done
[ ${#missing[@]} -eq 0 ] && exit 0
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sort -u)
echo "installing: ${missing[*]}"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
