//! The longer help texts clap shows after a subcommand's options (`after_help`). They live
//! apart from the commands so that the argument definitions (`args.rs`) need none of the
//! commands that use them.

/// `cryptblk convert --help`: what the copy keeps in memory.
pub const CONVERT_MEMORY: &str = "\
Memory: convert keeps (2 x threads + 1) chunks in flight, where threads = crypto threads (at
least 2), and an encrypted target one bounce buffer per chunk being written: with the default
1 MiB chunk on a 2-core machine about 10 MiB of buffers and well under 64 MiB of RSS,
whatever the image size.";

/// `cryptblk reencrypt --help`: how a reencryption runs, stops and resumes.
pub const REENCRYPT: &str = "\
Without --init-only or --resume-only, starts a reencryption (or continues the one in progress)
and runs it to the end. A reencryption started or interrupted by cryptsetup continues here, and
one started or interrupted here continues with `cryptsetup reencrypt --resume-only
--force-offline-reencrypt`. SIGINT/SIGTERM stop after the current hotzone; kill -9 loses nothing
with --resilience checksum or journal (the next run recovers the hotzone).

--decrypt --header FILE decrypts in place as cryptsetup 2.7 does: the header goes to FILE (a
new file; an existing one is read as the header of a decryption in progress), the plaintext
to offset 0 of the image, the image's last data-offset bytes are overwritten with random
data at the end. Continue with `--resume-only --header FILE IMAGE` here or with cryptsetup
2.7's `reencrypt --resume-only --header FILE`.";

/// `cryptblk resize --help`: what changes, and the exit statuses a script may see.
pub const RESIZE: &str = "\
The image grows sparse (nothing is written past the old end). LUKS1 and a LUKS2 \"dynamic\"
data segment follow the image's length; a fixed-length LUKS2 segment is rewritten in both
header copies. The image is locked while it is resized: an image a daemon serves is refused
as in use (6); resize it there with `cryptblk ctl disk-resize NAME SIZE`. A shrink without
--allow-shrink or a size off the sector grid is a usage error (1); a filesystem or cluster
that refuses the new length (full, a file size limit, a quota) is an I/O error (5), and the
image keeps its old size.";

/// `cryptblk convert-header --help`: what moves, when it is refused, and the crash window.
pub const CONVERT_HEADER: &str = "\
Where cryptsetup can convert (a 28 KiB gap between the LUKS1 keyslots and the payload, as in
images cryptsetup formats), the keyslot material moves up by 28 KiB exactly as cryptsetup moves
it. QEMU-made images have no such gap: there each active keyslot is copied to free space
before the payload, and the LUKS1 header stays usable until the LUKS2 header is written. An
image already LUKS2 is a usage error (1); no room for the keyslots, a detached header or
luksmeta data is refused as unsupported (3); the image is then untouched. Keep a header
backup: as with cryptsetup, a crash while the header is rewritten can leave neither header.";

/// `cryptblk serve --help`: how QEMU connects, discard, and the `--config` file.
pub const SERVE: &str = "\
QEMU connects with:
  -object memory-backend-memfd,id=mem,size=<RAM>,share=on -numa node,memdev=mem
  -chardev socket,id=disk0,path=SOCKET,reconnect=1
  -device vhost-user-blk-pci,chardev=disk0,num-queues=N

Each vhost-user-blk socket serves one frontend at a time and accepts a new one after a
disconnect. Requests of one queue run in parallel on the disk's I/O threads.
SIGTERM or SIGINT closes the connection after the requests being handled, flushes the
image and exits 0. GET_ID answers the LUKS UUID (first 20 bytes) or the image file name.

--discard offers DISCARD to the guest (not on a --readonly export). On a raw image the
range becomes a hole and reads as zeros; on a LUKS image whole encryption sectors are
punched and then read back as garbage, exactly as with dm-crypt allow_discards. Off by
default: the holes show anyone with the image which blocks are unused.

--config FILE serves several disks, one socket and one thread each, from a TOML file:

  memory-budget = \"1G\"                # optional: as --memory-budget (which overrides it)

  [[disk]]
  name = \"vm1-root\"                   # in logs; the GET_ID serial unless `serial` is set
  image = \"/var/lib/vm1.luks\"
  key-file = \"/etc/cryptblk/vm1.key\"  # LUKS images only; never a passphrase in this file
  vhost-user-blk = \"/run/cryptblk/vm1.sock\"  # optional with --nbd
  nbd = true                          # optional: export over --nbd (default true)
  num-queues = 2                      # optional, default 1
  queue-size = 256                    # optional, default 256
  readonly = false                    # optional
  discard = false                     # optional
  serial = \"vm1-root\"                 # optional GET_ID answer (first 20 bytes)
  cache = \"none\"                      # optional: none|writeback|writethrough|directsync|unsafe
  aio = \"io_uring\"                    # optional: io_uring|threads
  poll-us = 0                         # optional: busy-poll completions (microseconds)
  socket-owner = \"libvirt-qemu\"      # optional: USER[:GROUP] of the vhost-user-blk socket
  socket-mode = \"0660\"               # optional: its permission bits (octal, default 0600)
  socket-peer-uid = \"libvirt-qemu\"   # optional: accept only this user's QEMU (SO_PEERCRED)
  socket-peer-gid = \"kvm\"            # optional: ... and/or only this primary group's
  unsealed-memory = false             # optional: map guest memory not sealed against shrinking

  [[disk]]
  name = \"vm1-data\"
  ...

The keys are those of the control socket's disk-add (`nbd` may also be written
`nbd-export`).

--nbd unix:PATH or --nbd tcp:HOST:PORT also serves every disk over NBD (fixed newstyle,
structured replies, base:allocation, multi-conn), export name = disk name:
  qemu-img info 'nbd+unix:///NAME?socket=PATH'   nbdinfo 'nbd+unix:///NAME?socket=PATH'
--tls-creds DIR makes TLS mandatory on it (QEMU's layout: ca-cert.pem, server-cert.pem,
server-key.pem); every client must present a certificate ca-cert.pem signed (QEMU:
client-cert.pem and client-key.pem in its tls-creds-x509 dir). --tls-authz NAME[,NAME]
(or @FILE) also requires the certificate's subject CN or a DNS subjectAltName to be
listed; a disk's `tls-authz = [\"NAME\"]` replaces the list for its export. Plain NBD on
an address other machines reach (tcp:0.0.0.0:PORT) is refused unless --nbd-insecure.
--nbd-max-connections (128) and --nbd-max-connections-per-peer (32, per TCP address)
cap the connections served at once; more are closed and logged.

--control PATH answers JSON-RPC 2.0 requests (one per line) on a 0600 UNIX socket:
disk-add, disk-remove, disk-resize, disk-list, stats, key-add, key-remove and the
migrate-* methods; `cryptblk ctl --help` lists them with their parameters. With --control
the daemon may start with no disk.

--memory-budget SIZE bounds the request data (an encrypted write's ciphertext, a bounce
buffer, an NBD payload) all queues of all disks make the daemon hold at once: a request
that does not fit waits in its queue, never fails, and the room freed goes to the waiting
queues in turn, a queue with nothing in flight first. Default: 1/16 of RAM (or of the
cgroup's memory.max), between 64M and 1G. Freed buffers are kept for reuse (at most an
eighth of the budget, up to 32 MiB) and given back to the system after a second unused.

--metrics unix:PATH or tcp:HOST:PORT answers HTTP GET /metrics in Prometheus's text
format: per disk and queue request counts, bytes, errors, requests in flight and latency
histograms, the crypto pool and engine, migrations. No key material is ever shown.

Logging: one line per event on stderr (--log-format json for log shippers), the disk's
name as a field; RUST_LOG=debug shows more, RUST_LOG=warn less.

A LUKS2 image whose header has a clevis token (`clevis luks bind ... tang`) needs no
key-file: its passphrase is recovered from the tang server (tried after a key-file that
opens no keyslot, too); the error names each token and its server when none works.

Unknown keys are errors; names and socket paths must be unique; relative paths are
resolved against the directory of the config file. Every disk is opened and unlocked
before any socket is bound: one missing image or wrong key fails the whole start (the
message names the disk) and no socket is created. SIGTERM or SIGINT stops and flushes
every disk, then exits 0.";

/// `cryptblk backup pull --help`: what a pull copies and how it survives an interruption.
pub const BACKUP_PULL: &str = "\
The export is of the image file itself (ciphertext and LUKS header): the chain never holds a
key or plaintext, and the command takes none. A full pull copies what base:allocation reports
allocated; an incremental what qemu:dirty-bitmap:NAME reports dirty. Data that reads as zeroes
is recorded, not stored. The export must be a point-in-time view (a backup export, or an image
nobody writes) for the entry to be consistent.

The entry is written to pull.*.partial files, made durable every 256 MiB; the manifest is
replaced last. SIGINT/SIGTERM stop durably, and the same command continues from there when
the export is the same one: the same size and the same non-empty NBD description (cryptblk's
backup export names each backup-start in it, so a backup started again is another export;
qemu-nbd: -D). Any other pull discards the partial entry and starts over, with a note. Exit
status 4 means the chain in DIR is damaged.

On a cryptblk backup export, what is durable in the chain is released (an NBD TRIM on the
read-only export): the export stops keeping it, so the VM's writes there copy nothing more and
a small --scratch-size is enough. Reading a released range fails, so a pull run again after its
entry was committed cannot read it: --no-release when another client reads the same export.";
