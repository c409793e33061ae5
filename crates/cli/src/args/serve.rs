//! `cryptblk serve`'s options: one image or a config file of disks, their frontends, and the
//! daemon's own (control socket, limits, logging, hand-over).
use crate::size::parse_size;
use clap::{Args, ValueEnum};
use cryptblk_control::api::{AioEngine, CacheMode as ImageCacheMode, DiskConfig, UnknownName};
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// Serve every disk table of this TOML file (format below) instead of one image; not
    /// combined with the single-disk options.
    #[arg(long, value_name = "FILE", conflicts_with_all = [
        "socket", "image", "key_file", "num_queues", "queue_size", "readonly", "discard", "name",
        "cache", "aio", "poll_us", "socket_owner", "socket_mode", "socket_peer_uid",
        "socket_peer_gid", "unsealed_memory",
    ])]
    pub config: Option<PathBuf>,
    /// Export the disk over vhost-user-blk on this UNIX socket path (a stale socket there is
    /// replaced).
    #[arg(long = "vhost-user-blk", value_name = "SOCKET")]
    pub socket: Option<PathBuf>,
    /// The image to export: LUKS1/LUKS2 (needs a passphrase) or raw. A file, or an RBD image
    /// named `rbd:POOL/IMAGE[@SNAP][:conf=PATH][:id=USER][:keyring=PATH]`, opened under its
    /// exclusive lock (connecting to the cluster and each operation time out after 30 s).
    #[arg(long, value_name = "PATH")]
    pub image: Option<PathBuf>,
    /// The disk's name: its NBD export name and its name on the control socket (default:
    /// the image's file name).
    #[arg(long, value_name = "NAME", requires = "image")]
    pub name: Option<String>,
    /// File holding the LUKS passphrase ('-' for stdin).
    #[arg(long, short = 'd', value_name = "FILE")]
    pub key_file: Option<PathBuf>,
    /// Virtqueues offered to the guest; each gets its own worker thread.
    #[arg(long, value_name = "N", default_value_t = DiskConfig::DEFAULT_NUM_QUEUES)]
    pub num_queues: u16,
    /// Largest virtqueue size (a power of two up to 1024).
    #[arg(long, value_name = "N", default_value_t = DiskConfig::DEFAULT_QUEUE_SIZE)]
    pub queue_size: u16,
    /// Export read-only (the image is opened read-only, writes fail with IOERR).
    #[arg(long)]
    pub readonly: bool,
    /// Pass guest discards to the image as punched holes, like dm-crypt allow_discards; off
    /// by default because discards on an encrypted disk reveal which blocks are unused.
    #[arg(long)]
    pub discard: bool,
    /// Host cache mode of the image, as QEMU's cache=: none (O_DIRECT), writeback,
    /// writethrough, directsync or unsafe (flushes ignored).
    #[arg(long, value_name = "MODE", default_value = "none", value_parser = parse_cache_mode)]
    pub cache: ImageCacheMode,
    /// Asynchronous I/O engine: io_uring or threads.
    #[arg(long, value_name = "ENGINE", default_value = "io_uring", value_parser = parse_aio_engine)]
    pub aio: AioEngine,
    /// Busy-poll each queue's completions this many microseconds before sleeping, like
    /// QEMU's aio-poll: lower latency for CPU time. 0 (the default) never polls.
    #[arg(long, value_name = "US", default_value_t = 0)]
    pub poll_us: u32,
    /// Owner of the vhost-user-blk socket: USER, USER:GROUP or :GROUP, names or ids (e.g.
    /// libvirt-qemu, the user libvirt runs QEMU as); set before any connection is accepted.
    #[arg(long, value_name = "USER[:GROUP]", requires = "socket")]
    pub socket_owner: Option<String>,
    /// Permission bits of the vhost-user-blk socket in octal, e.g. 0660 (a client needs
    /// write permission to connect).
    #[arg(long, value_name = "MODE", requires = "socket")]
    pub socket_mode: Option<String>,
    /// Accept a vhost-user-blk frontend only from this user (name or uid, checked with
    /// SO_PEERCRED); other connections are closed and logged.
    #[arg(long, value_name = "USER", requires = "socket")]
    pub socket_peer_uid: Option<String>,
    /// Accept a vhost-user-blk frontend only from this primary group (name or gid); with
    /// --socket-peer-uid both must match.
    #[arg(long, value_name = "GROUP", requires = "socket")]
    pub socket_peer_gid: Option<String>,
    /// Map guest memory that is not sealed against shrinking (libblkio clients, QEMU's
    /// memory-backend-file). Such a frontend can crash the daemon by truncating it; by default
    /// only sealed memfds (QEMU's memory-backend-memfd) are accepted.
    #[arg(long, requires = "socket")]
    pub unsealed_memory: bool,
    /// Also serve every disk over NBD, export name = disk name: unix:PATH or tcp:HOST:PORT.
    #[arg(long, value_name = "ADDR")]
    pub nbd: Option<String>,
    /// Require TLS on the NBD server, with x509 credentials in QEMU's layout: DIR holds
    /// ca-cert.pem, server-cert.pem and server-key.pem.
    #[arg(long, value_name = "DIR", requires = "nbd")]
    pub tls_creds: Option<PathBuf>,
    /// With --tls-creds: admit only NBD clients whose certificate's subject CN or a DNS
    /// subjectAltName is one of these names (comma-separated), or @FILE for one name per
    /// line. A disk's own `tls-authz` replaces this list for its export.
    #[arg(long, value_name = "NAME[,NAME]|@FILE", requires = "tls_creds")]
    pub tls_authz: Option<String>,
    /// Serve NBD without TLS on an address other machines can reach (e.g. tcp:0.0.0.0:10809):
    /// anyone who reaches it reads and writes every disk. Without it, plain NBD is allowed
    /// only on unix: sockets and loopback addresses.
    #[arg(long, requires = "nbd", conflicts_with = "tls_creds")]
    pub nbd_insecure: bool,
    /// NBD connections served at once; more are closed at once (and logged).
    #[arg(long, value_name = "N", default_value_t = cryptblk_nbd::DEFAULT_CONNECTION_LIMITS.total as u32,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub nbd_max_connections: u32,
    /// NBD connections served at once from one TCP peer address.
    #[arg(long, value_name = "N", default_value_t = cryptblk_nbd::DEFAULT_CONNECTION_LIMITS.per_peer as u32,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub nbd_max_connections_per_peer: u32,
    /// Bytes of request data (ciphertext, bounce buffers, NBD payloads) all disks' queues may
    /// make the daemon hold at once, together: past it requests wait their turn, they do not
    /// fail. Default: 1/16 of RAM (or of the cgroup's memory.max), 64M to 1G; at least 64M.
    /// Overrides a --config file's `memory-budget`.
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub memory_budget: Option<u64>,
    /// Listen for control requests (JSON-RPC 2.0, one per line; see `cryptblk ctl`) on this
    /// UNIX socket, created with mode 0600. With it the daemon may start without disks.
    #[arg(long, value_name = "PATH")]
    pub control: Option<PathBuf>,
    /// Decrypt passphrases sent as `key-secret` (control requests, `[[disk]]` tables) with
    /// the AES-256 key in this file: exactly 32 raw random bytes (`head -c 32 /dev/urandom`),
    /// mode 0600, read once at start, as libvirt's master key for QEMU's secret objects.
    #[arg(long, value_name = "FILE")]
    pub master_key_file: Option<PathBuf>,
    /// Answer Prometheus scrapes (HTTP GET /metrics) on unix:PATH or tcp:HOST:PORT; the
    /// address bound is logged (tcp:127.0.0.1:0 picks a free port). Off by default.
    #[arg(long, value_name = "ADDR")]
    pub metrics: Option<String>,
    /// Log lines as plain text or as one JSON object each (for log shippers).
    #[arg(long, value_enum, default_value = "text", value_name = "FORMAT")]
    pub log_format: LogFormat,
    /// Let the daemon dump core and be traced by its user (for debugging only: a dump then
    /// holds guest memory and cipher key schedules). By default it is not dumpable.
    #[arg(long)]
    pub allow_core_dumps: bool,
    /// Keep each LUKS disk's volume keys in the kernel keyring of the daemon's user
    /// (`keyring`), so that a daemon restarted after a crash or a kill opens its disks without
    /// a key derivation; off by default: any process of that user can read them meanwhile
    /// (README: "Security model").
    #[arg(long, value_name = "WHERE", value_parser = ["keyring", "off"], default_value = "off")]
    pub key_cache: String,
    /// How long cached keys outlive the daemon that last renewed them (it renews them while
    /// it runs; a detached disk's key goes at once).
    #[arg(long, value_name = "SECONDS", default_value_t = 300, value_parser = clap::value_parser!(u64).range(1..))]
    pub key_cache_timeout: u64,
    /// Memory the key derivations at start may use at once (disks are unlocked in parallel,
    /// one per core, each as its costliest keyslot allows; K, M, G suffixes). Default: half
    /// the memory available at start.
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub unlock_memory: Option<u64>,
    /// Take over from a running daemon over this inherited descriptor (what `ctl upgrade`
    /// starts the new daemon with; not for use by hand).
    #[arg(long = "take-over-fd", value_name = "FD", hide = true)]
    pub take_over_fd: Option<i32>,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    Json,
}

fn parse_cache_mode(s: &str) -> Result<ImageCacheMode, UnknownName> {
    s.parse()
}

fn parse_aio_engine(s: &str) -> Result<AioEngine, UnknownName> {
    s.parse()
}
