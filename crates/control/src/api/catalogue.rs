//! The methods as a table: names, what each param is and what it means. `cryptblk ctl` builds
//! its verbs, flags and help from it, and the protocol reference (`ctl --help`, docs/serving.md) is
//! generated from it; a test checks it against the param types of [`super::methods`].

/// What a param holds, which decides how `ctl` takes it and how the reference writes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParamKind {
    /// The disk's name; `ctl`'s positional argument.
    Name,
    /// Free text.
    Text,
    /// A checkpoint's name; `ctl`'s positional argument after the disk's.
    Checkpoint,
    /// A path the daemon opens (sent absolute: its working directory is not the client's).
    Path,
    /// A file holding a passphrase, read by the daemon (never the passphrase itself).
    KeyFile,
    /// The index of a descriptor passed with the request (SCM_RIGHTS) holding a passphrase;
    /// `ctl --NAME N` passes its own descriptor N.
    KeyFd,
    /// Base64 text: a passphrase encrypted with the daemon's master key, or its IV (the
    /// ciphertext may be logged; the passphrase never travels in clear).
    Base64,
    /// `tcp:HOST:PORT` or `unix:PATH`.
    Address,
    /// A boolean, false unless given; `ctl --NAME` sends true, otherwise false.
    Flag,
    /// A boolean sent only when given (`ctl --NAME` sends true); absent keeps a mode chosen
    /// earlier.
    FlagIfGiven,
    /// A boolean, true unless given false; `ctl --no-NAME` sends false.
    FlagDefaultOn,
    /// A count.
    Count,
    /// Bytes (`ctl` accepts K, M, G, T suffixes).
    Bytes,
    /// Milliseconds.
    Millis,
    /// One of these names.
    Choice(&'static [&'static str]),
}

impl ParamKind {
    /// How the protocol reference writes the value.
    pub fn json_type(self) -> String {
        match self {
            ParamKind::Name | ParamKind::Text | ParamKind::Checkpoint => "str".into(),
            ParamKind::Path | ParamKind::KeyFile => "path".into(),
            ParamKind::Address => "addr".into(),
            ParamKind::Base64 => "base64".into(),
            ParamKind::Flag | ParamKind::FlagIfGiven | ParamKind::FlagDefaultOn => "bool".into(),
            ParamKind::Count => "int".into(),
            ParamKind::KeyFd => "fd".into(),
            ParamKind::Bytes => "bytes".into(),
            ParamKind::Millis => "ms".into(),
            ParamKind::Choice(names) => names
                .iter()
                .map(|n| format!("\"{n}\""))
                .collect::<Vec<_>>()
                .join("|"),
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub struct ParamSpec {
    /// The JSON key (and `ctl`'s flag without `--`).
    pub name: &'static str,
    pub kind: ParamKind,
    pub required: bool,
    pub help: &'static str,
}

#[derive(Debug, Clone, Copy)]
pub struct MethodSpec {
    pub name: &'static str,
    /// One line: what the method does (`ctl VERB`'s about text).
    pub summary: &'static str,
    pub params: &'static [ParamSpec],
}

const fn req(name: &'static str, kind: ParamKind, help: &'static str) -> ParamSpec {
    ParamSpec {
        name,
        kind,
        required: true,
        help,
    }
}

const fn opt(name: &'static str, kind: ParamKind, help: &'static str) -> ParamSpec {
    ParamSpec {
        name,
        kind,
        required: false,
        help,
    }
}

use super::passphrase_params::passphrase_specs;
use ParamKind::*;

/// `N` params from `parts`, in order: a method's own params and its passphrase quads as one
/// list. A wrong `N` fails the build (const evaluation panics).
const fn params<const N: usize>(parts: &[&[ParamSpec]]) -> [ParamSpec; N] {
    let mut out = [NAME; N];
    let mut filled = 0;
    let mut part = 0;
    while part < parts.len() {
        let mut i = 0;
        while i < parts[part].len() {
            out[filled] = parts[part][i];
            filled += 1;
            i += 1;
        }
        part += 1;
    }
    assert!(filled == N, "N is not the number of params");
    out
}

const NAME: ParamSpec = req("name", Name, "The disk's name in the daemon.");
const CACHE_MODES: &[&str] = &["none", "writeback", "writethrough", "directsync", "unsafe"];
const AIO_ENGINES: &[&str] = &["io_uring", "threads"];

/// Every method, in the order the reference lists them.
pub const METHODS: &[MethodSpec] = &[
    MethodSpec {
        name: "disk-add",
        summary: "Start serving another image.",
        params: &params::<22>(&[
            &[
                NAME,
                req("image", Path, "The image: LUKS1, LUKS2 or raw; a file, or an RBD image rbd:POOL/IMAGE[@SNAP][:conf=PATH][:id=USER][:keyring=PATH]."),
            ],
            &passphrase_specs!("key", "the LUKS passphrase"),
            &[
                opt("vhost-user-blk", Path, "Export it on this vhost-user-blk socket."),
                opt("num-queues", Count, "Virtqueues offered to the guest (default 1)."),
                opt("queue-size", Count, "Largest virtqueue size, a power of two up to 1024 (default 256)."),
                opt("nbd-export", Flag, "Export it over the daemon's NBD server as well."),
                opt("readonly", Flag, "Export read-only."),
                opt("discard", Flag, "Pass guest discards to the image (reveals which blocks are unused)."),
                opt("serial", Text, "The vhost-user GET_ID answer (default: the LUKS UUID or the image's file name)."),
                opt("cache", Choice(CACHE_MODES), "Host cache mode, as QEMU's cache= (default none)."),
                opt("aio", Choice(AIO_ENGINES), "Asynchronous I/O engine (default io_uring)."),
                opt("poll-us", Count, "Busy-poll completions this many microseconds before sleeping (default 0: never)."),
                opt("socket-owner", Text, "Owner of the vhost-user-blk socket: USER, USER:GROUP or :GROUP (e.g. libvirt-qemu for libvirt's QEMU)."),
                opt("socket-mode", Text, "Permission bits of the vhost-user-blk socket in octal, e.g. 0660 (default 0600)."),
                opt("tls-authz", Text, "On a TLS NBD server: the client certificate names (subject CN or DNS subjectAltName, comma-separated) allowed to use this export, instead of serve --tls-authz."),
                opt("socket-peer-uid", Text, "Accept a vhost-user-blk frontend only from this user (name or uid; SO_PEERCRED); others are disconnected and logged."),
                opt("socket-peer-gid", Text, "Accept a vhost-user-blk frontend only from this primary group (name or gid); with socket-peer-uid both must match."),
                opt("unsealed-memory", Flag, "Map guest memory not sealed against shrinking (libblkio clients, QEMU memory-backend-file); such a frontend can crash the daemon."),
            ],
        ]),
    },
    MethodSpec {
        name: "disk-remove",
        summary: "Stop serving a disk (drains, flushes, closes).",
        params: &[
            NAME,
            opt("force", Flag, "Remove it even if a VM is connected over vhost-user."),
        ],
    },
    MethodSpec {
        name: "disk-resize",
        summary: "Grow (or shrink) a served disk; the guest sees the new size without a reboot.",
        params: &[
            NAME,
            req("size", Bytes, "The size the guest sees (like virsh blockresize), a multiple of the disk's sector size (the LUKS encryption sector, 512 for raw)."),
            opt("allow-shrink", Flag, "Allow a size below the current one: the data past it is lost."),
        ],
    },
    MethodSpec {
        name: "disk-list",
        summary: "List the served disks.",
        params: &[],
    },
    MethodSpec {
        name: "stats",
        summary: "I/O statistics of one disk, or of all.",
        params: &[opt("name", Name, "The disk (all disks when absent).")],
    },
    MethodSpec {
        name: "key-add",
        summary: "Add a keyslot to a served disk's LUKS image.",
        params: &params::<11>(&[
            &[
                NAME,
            ],
            &passphrase_specs!("key", "an existing passphrase"),
            &passphrase_specs!("new-key", "the new passphrase"),
            &[
                opt("pbkdf", Choice(&["pbkdf2", "argon2i", "argon2id"]), "Key derivation for the new keyslot (default: argon2id on LUKS2, pbkdf2 on LUKS1)."),
                opt("iter-time", Millis, "Target unlock time of the new keyslot in milliseconds (default 2000)."),
            ],
        ]),
    },
    MethodSpec {
        name: "key-remove",
        summary: "Remove the keyslot a passphrase opens from a served disk's LUKS image.",
        params: &params::<5>(&[
            &[
                NAME,
            ],
            &passphrase_specs!("key", "the passphrase to remove"),
        ]),
    },
    MethodSpec {
        name: "migrate-incoming",
        summary: "Destination: receive a disk from another daemon into a new image (or take over the rbd: image it shares).",
        params: &params::<15>(&[
            &[
                NAME,
                req("image", Path, "The new image to receive into (must not exist): a file, or rbd:POOL/IMAGE[:conf=PATH][:id=USER][:keyring=PATH]. An existing rbd: image is the one the source serves, handed over with migrate-start --shared."),
                req("listen", Address, "Where the source connects: tcp:HOST:PORT (port 0 picks one) or unix:PATH."),
            ],
            &passphrase_specs!("key", "the LUKS passphrase that opens the received volume"),
            &[
                opt("tls-creds", Path, "TLS credentials directory (QEMU x509 layout); the source must present a client certificate signed by its CA. Required on a non-loopback TCP address unless insecure."),
                opt("peer-name", Text, "With tls-creds: the name (subject CN or DNS subjectAltName) the source's certificate must carry; others are refused after the TLS handshake."),
                opt("insecure", Flag, "Allow plain TCP (no tls-creds) on an address other machines reach: whoever connects first sends the disk. Logged as a warning."),
                opt("vhost-user-blk", Path, "Export the disk on this vhost-user-blk socket (bound when the header has arrived)."),
                opt("num-queues", Count, "Virtqueues offered to the guest (default 1)."),
                opt("queue-size", Count, "Largest virtqueue size (default 256)."),
                opt("nbd-export", Flag, "Export it over NBD as well."),
                opt("discard", Flag, "Pass guest discards to the image."),
            ],
        ]),
    },
    MethodSpec {
        name: "migrate-start",
        summary: "Source: start migrating a disk to a destination (precopy while it keeps serving).",
        params: &[
            NAME,
            req("to", Address, "The destination's migrate-incoming address."),
            opt("postcopy", Flag, "Allow switching over before everything is copied; the destination fetches the rest on demand."),
            opt("preempt", Flag, "With postcopy: urgent requests on their own connection, ahead of the bulk stream."),
            opt("shared", Flag, "Both daemons reach the disk's rbd: image: copy nothing, hand the image's exclusive lock over at switchover (the destination listens on the same image)."),
            opt("chunk-size", Bytes, "Bulk chunk size (default 2 MiB)."),
            opt("max-bandwidth", Bytes, "Cap on bytes per second over all channels, e.g. 125M for 1 Gbit/s."),
            opt("break-chunks", FlagDefaultOn, "With preempt: interrupt a bulk chunk for urgent requests (default on; off only for comparisons)."),
            opt("max-passes", Count, "Precopy passes before resending waits for the switchover (default 30; 0: no limit)."),
            opt("tls-creds", Path, "TLS credentials directory (QEMU x509 layout): ca-cert.pem, client-cert.pem, client-key.pem. Required to a non-loopback TCP address unless insecure."),
            opt("peer-name", Text, "With tls-creds: the name the destination's certificate must carry (a DNS or IP subjectAltName) instead of the host of `to`."),
            opt("insecure", Flag, "Allow plain TCP (no tls-creds) to an address on another machine: the disk's ciphertext crosses the network unauthenticated. Logged as a warning."),
            opt("connect-timeout", Millis, "Milliseconds each connect, TLS handshake and hello exchange with the destination may take, also when recovering (default 10000)."),
        ],
    },
    MethodSpec {
        name: "migrate-switchover",
        summary: "Source: hand the disk over (it stops serving here) now, or as soon as the destination serves it; postcopy if started so.",
        params: &[
            NAME,
            opt("postcopy", FlagIfGiven, "Switch over in postcopy mode (only what is missing is listed; fetched on demand)."),
        ],
    },
    MethodSpec {
        name: "migrate-postcopy",
        summary: "Source: switch over in postcopy mode now, or as soon as the destination serves the disk.",
        params: &[NAME],
    },
    MethodSpec {
        name: "migrate-status",
        summary: "Progress of a disk's migration (either side).",
        params: &[NAME],
    },
    MethodSpec {
        name: "migrate-cancel",
        summary: "Stop a migration that has not handed the disk over yet.",
        params: &[NAME],
    },
    MethodSpec {
        name: "migrate-recover",
        summary: "Source: resume a paused postcopy over a new connection.",
        params: &[
            NAME,
            req("to", Address, "The destination's address (the same or a new route to it); the start's connect-timeout applies."),
        ],
    },
    MethodSpec {
        name: "reencrypt-start",
        summary: "Replace a served LUKS2 disk's volume key (or cipher, key size, sector size) while it serves, encrypt a served raw disk in place (encrypt), or continue a paused one.",
        params: &params::<14>(&[
            &[
                NAME,
            ],
            &passphrase_specs!("key", "a passphrase of the disk (it also protects the new volume key)"),
            &[
                opt("resilience", Choice(&["checksum", "journal", "none"]), "How a hotzone a crash interrupts is recovered (default checksum; none loses that hotzone, as in cryptsetup)."),
                opt("cipher", Text, "The new cipher, e.g. aes-xts-plain64 (default: the current one; with encrypt, aes-xts-plain64)."),
                opt("key-size", Count, "Bits of the new volume key (default: the current size; with encrypt or a new cipher, 512 for XTS, else 256)."),
                opt("sector-size", Count, "Bytes of the new encryption sector, 512 to 4096 (default: the current one; with encrypt, 512)."),
                opt("max-bandwidth", Bytes, "Bytes per second the reencryption reads and writes (default 64M; 0: no limit)."),
                opt("pbkdf", Choice(&["pbkdf2", "argon2i", "argon2id"]), "Key derivation for the new volume key's keyslot (default argon2id)."),
                opt("iter-time", Millis, "Target unlock time of that keyslot in milliseconds (default 2000)."),
                opt("encrypt", Flag, "The disk is raw: encrypt it in place as LUKS2 without changing its size; from the moment this returns its image is LUKS2, attached with this passphrase."),
                opt("reduce-device-size", Bytes, "With encrypt: bytes for the LUKS2 header and the data shift, as cryptsetup's --reduce-device-size (default 32M): the image grows by them while the encryption runs and ends half of them larger than the disk."),
            ],
        ]),
    },
    MethodSpec {
        name: "reencrypt-status",
        summary: "Progress of a disk's online reencryption: phase, bytes done, rate, ETA, resilience, hotzone, last error.",
        params: &[NAME],
    },
    MethodSpec {
        name: "reencrypt-pause",
        summary: "Stop a disk's online reencryption once the hotzone being rewritten is committed; reencrypt-start continues it.",
        params: &[NAME],
    },
    MethodSpec {
        name: "checkpoint-add",
        summary: "Add a checkpoint to a disk: from now on what is written is recorded, crash-safe, as changed since it (for incremental backups of the image's bytes).",
        params: &[
            NAME,
            req("checkpoint", Checkpoint, "The checkpoint's name: 1 to 64 of A-Z a-z 0-9 . _ - (not starting with .)."),
        ],
    },
    MethodSpec {
        name: "checkpoint-list",
        summary: "A disk's checkpoints, oldest first, each with the bytes of the image changed since it.",
        params: &[
            NAME,
            opt("extents", Flag, "Also list each checkpoint's changed ranges of the image, [offset, length] (at most 65536)."),
        ],
    },
    MethodSpec {
        name: "checkpoint-remove",
        summary: "Remove a disk's checkpoint; what changed since it stays recorded for the checkpoint before it.",
        params: &[
            NAME,
            req("checkpoint", Checkpoint, "The checkpoint's name."),
        ],
    },
    MethodSpec {
        name: "backup-start",
        summary: "Serve a disk's image bytes (LUKS header and ciphertext, never plaintext) read-only over NBD for a key-less backup, adding a checkpoint; with incremental, also the dirty bitmap qemu:dirty-bitmap:FROM. A point-in-time view while the VM writes: a region's old bytes are copied to a bounded scratch file before its first change; a full scratch fails the backup, not the VM.",
        params: &[
            NAME,
            req("checkpoint", Text, "The checkpoint the backup is taken at (added now; must not exist)."),
            opt("incremental", Text, "An existing checkpoint: what changed since it is served as qemu:dirty-bitmap:FROM."),
            req("nbd", Address, "Where the export listens: unix:PATH or tcp:HOST:PORT (port 0 picks one); with the daemon's --tls-creds, TLS and its allow-list apply."),
            opt("scratch-size", Bytes, "Bytes of old data the copy-before-write scratch (IMAGE.cryptblk-backup-scratch) may hold (default 1G, in 4 KiB regions): the disk may change that much during the backup; more fails the backup (the VM's writes go on; end it with failed)."),
            opt("max-bandwidth", Bytes, "Bytes per second the export's clients may read at most, all connections together (default and 0: no limit; else at least 1M): a backup reading at the disk's full speed slows the VM's own I/O."),
            opt("background-share", Count, "Percent of the time (1-100, default 5) the export's reads may take while the VM is doing I/O, one read at a time, each followed by a rest in proportion; while the VM is idle the backup reads at full speed. 100: never yield."),
        ],
    },
    MethodSpec {
        name: "backup-end",
        summary: "Stop a disk's backup export: its checkpoint is kept, or with failed removed (what changed since it stays recorded for the checkpoint before it).",
        params: &[
            NAME,
            opt("failed", Flag, "The backup did not complete: remove its checkpoint (required once the backup failed, e.g. its scratch filled)."),
        ],
    },
    MethodSpec {
        name: "upgrade",
        summary: "Hand every disk, socket and volume key to a new daemon process (a new version) without a key derivation; VMs reconnect to the same sockets; this daemon then exits.",
        params: &[
            opt("binary", Path, "The program to start as the new daemon (default: the daemon's own program path, as the package manager left it)."),
        ],
    },
];

/// Keys a config file may spell differently from the method's param (file key, param).
pub const CONFIG_FILE_ALIASES: &[(&str, &str)] = &[("nbd", "nbd-export")];

pub fn method(name: &str) -> Option<&'static MethodSpec> {
    METHODS.iter().find(|m| m.name == name)
}

/// The methods and their params, one method per line group, for `ctl --help` and the
/// docs/serving.md: `disk-add {"name": str, "image": path, "key-file"?: path, ...}`.
pub fn methods_reference() -> String {
    let mut out = String::new();
    for m in METHODS {
        let params: Vec<String> = m
            .params
            .iter()
            .map(|p| {
                let optional = if p.required { "" } else { "?" };
                format!("\"{}\"{optional}: {}", p.name, p.kind.json_type())
            })
            .collect();
        let mut line = format!("  {} {{", m.name);
        let indent = " ".repeat(line.len());
        let mut first = true;
        for p in &params {
            let piece = if first { p.clone() } else { format!(", {p}") };
            if !first && line.len() + piece.len() > 92 {
                out.push_str(&line);
                out.push_str(",\n");
                line = format!("{indent}{p}");
            } else {
                line.push_str(&piece);
            }
            first = false;
        }
        line.push('}');
        out.push_str(&line);
        out.push('\n');
    }
    out
}

/// The error codes, for `ctl --help`.
pub fn errors_reference() -> String {
    let mut out = String::from(
        "  -32700 parse error, -32600 invalid request, -32601 unknown method,\n  \
         -32603 internal error, -32000 server shutting down,\n",
    );
    for k in super::ErrorKind::ALL {
        out.push_str(&format!("  {} {}\n", k.code(), k.describe()));
    }
    out
}
