#!/bin/busybox sh
# /init of the cryptblk test guest (packed into the initramfs by build-initramfs.sh).
# Kernel command line parameters:
#   cryptblk.job=write-verify|read-verify|restart-verify|marks-verify|resize-grow   the job to run
#   cryptblk.size=BYTES                     how much of the disk the job covers (default 64M)
#   cryptblk.bs=BYTES                       fio block size (default 64k)
#   cryptblk.dev=NAME                       the test disk under /dev (default vda)
# Prints exactly one "GUEST-RESULT: PASS" or "GUEST-RESULT: FAIL <why>" line on the console,
# plus "GUEST-SHA256: <hex>" of the disk's first size bytes after a passing write-verify or
# read-verify, then powers off. restart-verify runs rounds of a mixed verified fio job until the
# console reads the line "stop" (the host restarts the disk's server meanwhile), printing each
# round's fio JSON report between "FIO-JSON-BEGIN <n>" and "FIO-JSON-END <n>".
# marks-verify runs the same fio rounds in the background (a line per round passed, the report
# only for a failed one) and meanwhile writes marks past the first size bytes until "stop":
# mark n is 4096 bytes, 64 lines of "cryptblk guest mark <n>" padded with spaces to 63
# characters and a newline, at byte size + (n - 1) * 65536 (a 64 KiB region of its own); once
# it is written and flushed (fsync of the disk) the guest prints "GUEST-MARK <n>". So a mark
# printed is on the disk, and mark n + 2 was not begun before mark n was printed.
# resize-grow waits (60 s at most) for the disk to grow while the guest runs (the host resizes
# it), writes a verified fio pattern over what was added and prints "GUEST-SHA256: <hex>" of
# those bytes.
/bin/busybox mkdir -p /proc /sys /dev /tmp /sbin /usr/bin /usr/sbin
/bin/busybox --install -s
mount -t devtmpfs devtmpfs /dev
exec </dev/console >/dev/console 2>&1
mount -t proc proc /proc
mount -t sysfs sysfs /sys

finish() {
	echo "GUEST-RESULT: $*"
	sync
	poweroff -f
	sleep 5
	exit 1
}

job=""
size=64M
bs=64k
dev=vda
for word in $(cat /proc/cmdline); do
	case "$word" in
	cryptblk.job=*) job="${word#*=}" ;;
	cryptblk.size=*) size="${word#*=}" ;;
	cryptblk.bs=*) bs="${word#*=}" ;;
	cryptblk.dev=*) dev="${word#*=}" ;;
	esac
done
# A newline first: the firmware leaves terminal escapes at the start of the console line.
echo
echo "guest: up $(cut -d' ' -f1 /proc/uptime)s, kernel $(uname -r), job=${job:-none} size=$size bs=$bs dev=/dev/$dev"

while read -r mod; do
	[ -n "$mod" ] || continue
	insmod "/lib/modules/$mod.ko" || finish "FAIL insmod $mod"
done </lib/modules/load-order

tries=0
while [ ! -b "/dev/$dev" ]; do
	tries=$((tries + 1))
	[ "$tries" -le 200 ] || finish "FAIL no /dev/$dev after 10 s"
	sleep 0.05
done
echo "guest: /dev/$dev is $(cat "/sys/block/$dev/size") sectors, $(ls "/sys/block/$dev/mq" | wc -l) queue(s)"

export LD_LIBRARY_PATH="$(cat /etc/fio-library-path)"

# Round $1 of 1 MiB writes at depth 8 (the first 3/4 of size) and 4 KiB writes at depth 24 (the
# last 1/4), fsync every 8 writes, each block read back and crc32c-verified after its round;
# fio's JSON report on stdout.
mixed_round() {
	big=$((size / 4 * 3 / 1048576 * 1048576))
	small=$((size - big))
	fio --output-format=json --eta=never --filename="/dev/$dev" --direct=1 \
		--ioengine=libaio --verify=crc32c --verify_fatal=1 --verify_state_save=0 \
		--randseed="$1" --fsync=8 --rw=randwrite \
		--name=big --bs=1M --iodepth=8 --offset=0 --size="$big" \
		--name=small --bs=4k --iodepth=24 --offset="$big" --size="$small"
}

if [ "$job" = restart-verify ]; then
	case "$size" in *[!0-9]*) finish "FAIL restart-verify needs cryptblk.size in bytes" ;; esac
	round=0
	while :; do
		round=$((round + 1))
		echo "FIO-JSON-BEGIN $round"
		mixed_round "$round" || finish "FAIL fio restart-verify round $round exited with status $?"
		echo "FIO-JSON-END $round"
		echo "guest: round $round passed at $(cut -d' ' -f1 /proc/uptime)s"
		if read -t 1 line && [ "$line" = stop ]; then
			break
		fi
		[ "$round" -lt 500 ] || finish "FAIL no stop from the host after $round rounds"
	done
	finish PASS
fi
# The fio rounds in the background, the marks in the foreground; "stop" ends the marks, then
# the round under way.
if [ "$job" = marks-verify ]; then
	case "$size" in *[!0-9]*) finish "FAIL marks-verify needs cryptblk.size in bytes" ;; esac
	marks=$((($(cat "/sys/block/$dev/size") * 512 - size) / 65536))
	[ "$marks" -gt 0 ] || finish "FAIL no room for marks past the first $size bytes of /dev/$dev"
	(
		round=0
		while [ ! -e /tmp/stop ]; do
			round=$((round + 1))
			mixed_round "$round" >/tmp/fio.json 2>&1 || {
				echo "guest: fio round $round exited with status $?:"
				tail -n 40 /tmp/fio.json
				exit 1
			}
			echo "guest: fio round $round passed at $(cut -d' ' -f1 /proc/uptime)s"
		done
		echo "$round" >/tmp/fio.rounds
	) &
	fio_loop=$!
	n=0
	while ! { read -t 0.2 line && [ "$line" = stop ]; }; do
		[ "$n" -lt "$marks" ] || continue
		n=$((n + 1))
		text="$(printf '%-63s' "cryptblk guest mark $n")"
		: >/tmp/mark
		i=0
		while [ "$i" -lt 64 ]; do
			echo "$text" >>/tmp/mark
			i=$((i + 1))
		done
		dd if=/tmp/mark of="/dev/$dev" bs=4096 seek=$(((size + (n - 1) * 65536) / 4096)) \
			count=1 conv=notrunc,fsync 2>/dev/null || finish "FAIL writing mark $n"
		echo "GUEST-MARK $n"
	done
	touch /tmp/stop
	wait "$fio_loop" || finish "FAIL a fio round (above)"
	echo "guest: $n marks written, $(cat /tmp/fio.rounds) fio rounds passed"
	finish PASS
fi
# The host grows the disk while the guest runs: the kernel must see it without a reboot
# (virtio config interrupt), and the new sectors must take data.
if [ "$job" = resize-grow ]; then
	old=$(cat "/sys/block/$dev/size")
	echo "guest: waiting for /dev/$dev to grow past $old sectors"
	tries=0
	while [ "$(cat "/sys/block/$dev/size")" -le "$old" ]; do
		tries=$((tries + 1))
		[ "$tries" -le 1200 ] || finish "FAIL /dev/$dev stayed at $old sectors for 60 s"
		sleep 0.05
	done
	new=$(cat "/sys/block/$dev/size")
	echo "guest: /dev/$dev grew from $old to $new sectors"
	fio --name=grown --filename="/dev/$dev" --rw=write --bs="$bs" --offset=$((old * 512)) \
		--size=$(((new - old) * 512)) --direct=1 --ioengine=psync --verify=crc32c \
		--verify_fatal=1 --verify_state_save=0 --do_verify=1 ||
		finish "FAIL fio past the old end exited with status $?"
	# In 64 KiB blocks: the test grows by whole MiB.
	echo "GUEST-SHA256: $(dd if="/dev/$dev" bs=65536 skip=$((old / 128)) count=$(((new - old) / 128)) 2>/dev/null | sha256sum | cut -d' ' -f1)"
	finish PASS
fi

set -- fio --name=verify --filename="/dev/$dev" --rw=write --bs="$bs" --size="$size" \
	--direct=1 --ioengine=psync --verify=crc32c --verify_fatal=1 --verify_state_save=0
case "$job" in
write-verify) set -- "$@" --do_verify=1 ;;
read-verify) set -- "$@" --verify_only=1 ;;
*) finish "FAIL unknown job '${job}' (cryptblk.job=write-verify|read-verify)" ;;
esac
echo "guest: $*"
"$@" || finish "FAIL fio $job exited with status $?"

# A digest of what the guest now reads from the disk (the first size bytes, read back through
# the block layer), for the host to compare with the image's decrypted contents.
case "$size" in
*[!0-9]*) ;;
*) echo "GUEST-SHA256: $(head -c "$size" "/dev/$dev" | sha256sum | cut -d' ' -f1)" ;;
esac
echo "guest: done at $(cut -d' ' -f1 /proc/uptime)s"
finish PASS
