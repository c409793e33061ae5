#!/usr/bin/env bash
# Builds SPDK's vhost target (the benchmark's peers (e) and (e'), crates/bench) from a source tree
# the user provides, against Debian's system DPDK. Idempotent: configure and the workarounds run
# once, `make` only rebuilds what changed. CI does not run this.
#
#   SPDK_DIR=/var/tmp/spdk scripts/build-spdk.sh [--install-deps]
#
# --install-deps installs the Debian build dependencies first (scripts/install-deps.sh --spdk).
# The result is $SPDK_DIR/build/bin/vhost; it needs
# LD_LIBRARY_PATH=$SPDK_DIR/build/lib:$SPDK_DIR/isa-l/.libs:$SPDK_DIR/isa-l-crypto/.libs
# (the bench harness sets it).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)

if [ -z "${SPDK_DIR:-}" ]; then
  cat >&2 <<'EOF'
SPDK_DIR is not set: point it at an SPDK v24.01 source tree with its two isa-l submodules, e.g.
  git clone --branch v24.01 https://github.com/spdk/spdk /var/tmp/spdk
  git clone https://github.com/intel/isa-l /var/tmp/spdk/isa-l
  git -C /var/tmp/spdk/isa-l checkout bd226375027899087bd48f3e59b910430615cc0a
  git clone --branch v2.24.0 https://github.com/intel/isa-l_crypto /var/tmp/spdk/isa-l-crypto
(the isa-l commit is the one v24.01 pins; its pinned isa-l_crypto commit is not published, and
tag v2.24.0 works). The dpdk, ocf, xnvme, libvfio-user and intel-ipsec-mb submodules are not
needed. Then: SPDK_DIR=/var/tmp/spdk scripts/build-spdk.sh --install-deps
EOF
  exit 2
fi
cd "$SPDK_DIR"
for f in configure lib/env_dpdk/pci_dpdk.c isa-l/autogen.sh isa-l-crypto/autogen.sh; do
  [ -e "$f" ] || { echo "$SPDK_DIR/$f is missing: not an SPDK v24.01 tree with its isa-l and isa-l-crypto submodules (unset SPDK_DIR for how to get them)" >&2; exit 2; }
done

if [ "${1:-}" = --install-deps ]; then
  "$here/install-deps.sh" --spdk
elif [ -n "${1:-}" ]; then
  echo "unknown option $1 (the only one is --install-deps)" >&2
  exit 2
fi

# Workaround 1: configure turns IPsec-MB on because Debian's DPDK links it, and the top Makefile
# then builds the (absent) intel-ipsec-mb submodule. The system library serves; a do-nothing
# Makefile there lets the build go on.
mkdir -p intel-ipsec-mb
[ -e intel-ipsec-mb/Makefile ] || printf 'all clean install uninstall:\n\t@:\n' >intel-ipsec-mb/Makefile

# Workaround 2: v24.01 refuses DPDK 22.11.x for x > 4 ("DPDK LTS version 22.11.11 not
# supported"), in case a minor release changed the private PCI ABI. The vhost target runs with
# --no-pci, so no PCI function of that table is called: relax the check.
sed -i 's/if (minor > 4) {/if (minor > 4 \&\& 0) { \/\* cryptblk build-spdk.sh: --no-pci \*\//' \
  lib/env_dpdk/pci_dpdk.c

# Workaround 3: --without-uring-zns, or bdev_uring on a plain file fails its zoned check. The
# harness uses bdev_aio (faster here), but keep uring usable.
if [ ! -e mk/config.mk ] || ! grep -q '^CONFIG_CRYPTO?=y' mk/config.mk; then
  ./configure --with-dpdk --with-crypto --with-uring --without-uring-zns --disable-tests \
    --disable-unit-tests --disable-examples --without-fio --without-xnvme --without-vfio-user \
    --without-ocf
fi
make -j"$(nproc)"
echo "built $SPDK_DIR/build/bin/vhost"
