#!/usr/bin/env bash
# Boots the cryptblk test guest (scripts/guest/build-initramfs.sh) under qemu-system-x86_64 with
# one test disk, runs a fio job on it and reports the guest's verdict.
#
# Usage: scripts/guest/run-guest.sh (--disk-raw FILE | --vhost-user-blk SOCKET [--queues N]
#            [--reconnect SECS]) --job write-verify|read-verify|restart-verify|marks-verify|resize-grow
#            --size BYTES [--bs BYTES] [--log FILE] [--timeout SECS] [--artifacts DIR] [--stdin]
#            [--qmp SOCKET]
#
#   --disk-raw FILE         a raw image as a plain virtio-blk disk (cache=none)
#   --vhost-user-blk SOCKET a vhost-user-blk server's socket (guest RAM is a shared memfd)
#   --queues N              virtqueues of the vhost-user-blk device (default 1)
#   --reconnect SECS        QEMU reconnects to the vhost-user-blk socket every SECS seconds
#                           after the server goes away (QEMU 7.2's chardev reconnect=SECS)
#   --job                   write-verify: fio writes a crc32c-verified pattern over the first
#                           --size bytes and reads it back; read-verify: fio only verifies a
#                           pattern an earlier write-verify left there; restart-verify: rounds
#                           of a mixed fio job (1 MiB writes at depth 8 and 4 KiB writes at
#                           depth 24, fsync every 8, crc32c verify) over the first --size
#                           bytes until the line "stop" arrives on the console (--stdin);
#                           marks-verify: the same rounds in the background while numbered
#                           4 KiB marks are written past --size bytes, each reported on the
#                           console ("GUEST-MARK <n>") once written and flushed, until "stop"
#                           (see init.sh); resize-grow: waits for the disk to grow (the
#                           host resizes it), then writes and verifies a pattern over the
#                           added sectors
#   --size BYTES            bytes of the disk the job covers (a multiple of --bs)
#   --bs BYTES              fio block size (default 65536)
#   --log FILE              the guest console (default: a temporary file, removed on success)
#   --timeout SECS          kill QEMU after this long (default 300)
#   --artifacts DIR         where the kernel and initramfs are built/cached (default target/guest)
#   --stdin                 the guest console reads this script's stdin (default: nothing)
#   --qmp SOCKET            QEMU serves QMP on this UNIX socket (to pause the VM: stop, cont)
#
# The console is also echoed to stdout, and written to --log line by line as it comes (a test
# can watch it while the guest runs). Exits 0 only if the guest printed "GUEST-RESULT: PASS";
# after a pass the console also holds "GUEST-SHA256: <hex>", the digest of the first --size
# bytes as the guest reads them. Acceleration: TCG (-accel tcg,thread=multi -cpu max) whenever
# the host's KVM is PVM (/sys/module/kvm_pvm present: a stock kernel hangs under it); KVM only
# where kvm_pvm is absent and /dev/kvm is usable. CRYPTBLK_GUEST_ACCEL=tcg|kvm overrides.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
usage() { sed -n "4,8p" "$0" | sed "s/^# \{0,1\}//" >&2; exit "${1:-1}"; }

disk_raw="" socket="" queues=1 reconnect="" job="" size="" bs=65536 log="" timeout_s=300
console_in=/dev/null qmp=""
artifacts="$here/../../target/guest"
while [ $# -gt 0 ]; do
  case "$1" in
  --disk-raw) disk_raw="$2"; shift 2 ;;
  --vhost-user-blk) socket="$2"; shift 2 ;;
  --queues) queues="$2"; shift 2 ;;
  --reconnect) reconnect="$2"; shift 2 ;;
  --stdin) console_in=/dev/stdin; shift ;;
  --qmp) qmp="$2"; shift 2 ;;
  --job) job="$2"; shift 2 ;;
  --size) size="$2"; shift 2 ;;
  --bs) bs="$2"; shift 2 ;;
  --log) log="$2"; shift 2 ;;
  --timeout) timeout_s="$2"; shift 2 ;;
  --artifacts) artifacts="$2"; shift 2 ;;
  -h | --help) usage 0 ;;
  *) echo "$0: unknown argument $1" >&2; usage ;;
  esac
done
if { [ -n "$disk_raw" ] && [ -n "$socket" ]; } || { [ -z "$disk_raw" ] && [ -z "$socket" ]; }; then
  echo "$0: give exactly one of --disk-raw and --vhost-user-blk" >&2
  usage
fi
case "$job" in write-verify | read-verify | restart-verify | marks-verify | resize-grow) ;;
*) echo "$0: --job write-verify|read-verify|restart-verify|marks-verify|resize-grow" >&2; usage ;;
esac
[[ "$size" =~ ^[0-9]+$ ]] && [ "$size" -gt 0 ] || { echo "$0: --size BYTES (a positive integer)" >&2; usage; }
[[ "$bs" =~ ^[0-9]+$ ]] && [ $((size % bs)) -eq 0 ] || { echo "$0: --size must be a multiple of --bs" >&2; exit 1; }
[[ "$queues" =~ ^[1-9][0-9]*$ ]] || { echo "$0: --queues N (N >= 1)" >&2; exit 1; }
[ -z "$reconnect" ] || [[ "$reconnect" =~ ^[1-9][0-9]*$ ]] || { echo "$0: --reconnect SECS (SECS >= 1)" >&2; exit 1; }

command -v qemu-system-x86_64 >/dev/null 2>&1 || {
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "installing: qemu-system-x86" >&2
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends qemu-system-x86
}
"$here/build-initramfs.sh" "$artifacts"

accel="${CRYPTBLK_GUEST_ACCEL:-}"
if [ -z "$accel" ]; then
  accel=tcg
  if [ ! -e /sys/module/kvm_pvm ] && [ -r /dev/kvm ] && [ -w /dev/kvm ]; then
    accel=kvm
  fi
fi
case "$accel" in
tcg) accel_args=(-accel tcg,thread=multi -cpu max) ;;
kvm) accel_args=(-accel kvm -cpu host) ;;
*) echo "$0: CRYPTBLK_GUEST_ACCEL must be tcg or kvm" >&2; exit 1 ;;
esac

mem=512M
if [ -n "$disk_raw" ]; then
  [ -f "$disk_raw" ] || { echo "$0: no such file: $disk_raw" >&2; exit 1; }
  disk_args=(-drive "file=$disk_raw,format=raw,if=none,id=d0,cache=none,aio=threads"
    -device virtio-blk-pci,drive=d0)
else
  [ -S "$socket" ] || { echo "$0: not a socket: $socket" >&2; exit 1; }
  disk_args=(-object "memory-backend-memfd,id=mem,size=$mem,share=on" -numa node,memdev=mem
    -chardev "socket,id=c0,path=$socket${reconnect:+,reconnect=$reconnect}"
    -device "vhost-user-blk-pci,chardev=c0,num-queues=$queues")
fi

qmp_args=()
[ -z "$qmp" ] || qmp_args=(-qmp "unix:$qmp,server=on,wait=off")

keep_log=1
if [ -z "$log" ]; then
  log="$(mktemp "${TMPDIR:-/tmp}/cryptblk-guest.XXXXXX.log")"
  keep_log=""
fi
start=$(date +%s%N)
set +e
timeout --kill-after=10 "$timeout_s" qemu-system-x86_64 "${accel_args[@]}" -m "$mem" -smp 2 \
  -nographic -nodefaults -no-user-config -serial stdio -no-reboot \
  -kernel "$artifacts/vmlinuz" -initrd "$artifacts/initramfs.cpio.gz" \
  -append "console=ttyS0 quiet panic=-1 cryptblk.job=$job cryptblk.size=$size cryptblk.bs=$bs" \
  "${disk_args[@]}" "${qmp_args[@]}" <"$console_in" 2>&1 | stdbuf -oL tr -d '\r' | tee "$log"
status=("${PIPESTATUS[@]}")
set -e
elapsed=$(awk -v ns=$(($(date +%s%N) - start)) 'BEGIN { printf "%.1f", ns / 1e9 }')
if [ "${status[0]}" -eq 124 ] || [ "${status[0]}" -eq 137 ]; then
  echo "$0: guest timed out after ${timeout_s}s ($accel); console in $log" >&2
  exit 1
fi
if grep -q '^GUEST-RESULT: PASS' "$log"; then
  echo "guest: PASS ($job, $size bytes, $accel, ${elapsed}s)" >&2
  [ -n "$keep_log" ] || rm -f "$log"
  exit 0
fi
echo "$0: guest did not pass ($accel, qemu status ${status[0]}, ${elapsed}s): $(grep -a '^GUEST-RESULT' "$log" || echo 'no GUEST-RESULT line'); console in $log" >&2
exit 1
