//! `cryptblk ctl`: drive a running daemon through its control socket
//! (`cryptblk serve --control PATH`). Each verb is one JSON-RPC 2.0 call whose method has the
//! verb's name; the result is printed as pretty JSON so scripts can pipe it to `jq`.
//!
//! Secrets never travel: key-file options send the file's absolute path and the daemon reads
//! it, so no passphrase appears on the wire, in argv or in the daemon's request logs. All
//! paths are made absolute here because the daemon's working directory is not ours.
use anyhow::{bail, Result};
use clap::{Args, Subcommand};
use cryptblk_control::{Client, ClientError};
use serde_json::{Map, Value};
use std::path::{Path, PathBuf};

/// After-help of `cryptblk ctl`: the protocol reference for orchestrators that talk to the
/// socket directly.
pub const HELP: &str = "\
Protocol (for programs talking to the socket directly): JSON-RPC 2.0 over the UNIX socket,
one JSON object per line each way, e.g.
  {\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"disk-list\",\"params\":{}}
Paths must be absolute (the daemon resolves nothing against its working directory).
Key files are passed by path and read by the daemon; never send a passphrase.

Methods and params (? = optional):
  disk-add     {\"name\": str, \"image\": path, \"key-file\"?: path, \"vhost-user-blk\"?: path,
                \"num-queues\"?: int, \"queue-size\"?: int, \"nbd-export\": bool,
                \"readonly\": bool, \"discard\": bool, \"cache\"?: \"none\"|\"writeback\"|
                \"writethrough\"|\"directsync\"|\"unsafe\", \"aio\"?: \"io_uring\"|\"threads\",
                \"poll-us\"?: int}
  disk-remove  {\"name\": str, \"force\": bool}
  disk-list    {}
  stats        {\"name\"?: str}          (all disks when absent)
  key-add      {\"name\": str, \"key-file\": path, \"new-key-file\": path,
                \"pbkdf\"?: \"pbkdf2\"|\"argon2i\"|\"argon2id\", \"iter-time\"?: ms}
  key-remove   {\"name\": str, \"key-file\": path}
  migrate-incoming {\"name\": str, \"image\": new path, \"listen\": addr, \"key-file\"?: path,
                \"tls-creds\"?: dir, \"vhost-user-blk\"?: path, \"num-queues\"?: int,
                \"queue-size\"?: int, \"nbd-export\"?: bool, \"discard\"?: bool,
                \"cache\"?: mode, \"aio\"?: engine}
  migrate-start {\"name\": str, \"to\": addr, \"postcopy\"?: bool, \"preempt\"?: bool,
                \"chunk-size\"?: bytes, \"max-bandwidth\"?: bytes/s, \"break-chunks\"?: bool,
                \"max-passes\"?: int,
                \"tls-creds\"?: dir}
  migrate-switchover {\"name\": str, \"postcopy\"?: bool}
  migrate-postcopy / migrate-status / migrate-cancel {\"name\": str}
  migrate-recover {\"name\": str, \"to\": addr}
  (addr: tcp:HOST:PORT or unix:PATH; tls-creds: QEMU x509 layout, both ends verified)

Errors: -32700 parse error, -32600 invalid request, -32601 unknown method,
-32602 invalid params, -32603 internal error, -32000 server shutting down,
-32002 wrong passphrase, -32003 unsupported, -32004 damaged image, -32005 I/O error,
-32006 image in use, -32007 resource limit, -32008 other failure (the CLI's exit
statuses + 32000), -32010 no such disk, -32011 conflict (name or socket taken, last
keyslot, nothing to export), -32012 busy (a VM is connected: pass force; or still adding).
`cryptblk ctl` prints the result as JSON on stdout; on an error it prints
`error: MESSAGE` (and `data: JSON`) on stderr and exits non-zero.";

#[derive(Args, Debug)]
pub struct CtlArgs {
    /// The daemon's control socket (`cryptblk serve --control PATH`).
    #[arg(long, short = 's', value_name = "PATH")]
    socket: PathBuf,
    #[command(subcommand)]
    verb: CtlVerb,
}

#[derive(Subcommand, Debug)]
pub enum CtlVerb {
    /// Start serving another image.
    DiskAdd(DiskAddArgs),
    /// Stop serving a disk.
    DiskRemove {
        name: String,
        /// Remove it even if a client is connected.
        #[arg(long)]
        force: bool,
    },
    /// List the served disks.
    DiskList,
    /// I/O statistics of one disk, or of all.
    Stats { name: Option<String> },
    /// Add a keyslot to a served disk's LUKS image.
    KeyAdd {
        name: String,
        /// File holding an existing passphrase (read by the daemon).
        #[arg(long, value_name = "FILE")]
        key_file: PathBuf,
        /// File holding the new passphrase (read by the daemon).
        #[arg(long, value_name = "FILE")]
        new_key_file: PathBuf,
        /// Key derivation for the new keyslot (default: argon2id on LUKS2, pbkdf2 on LUKS1).
        #[arg(long, value_name = "pbkdf2|argon2i|argon2id")]
        pbkdf: Option<String>,
        /// Target unlock time of the new keyslot in milliseconds (default 2000).
        #[arg(long, value_name = "MS")]
        iter_time: Option<u32>,
    },
    /// Remove the keyslot a passphrase opens from a served disk's LUKS image.
    KeyRemove {
        name: String,
        /// File holding the passphrase to remove (read by the daemon).
        #[arg(long, value_name = "FILE")]
        key_file: PathBuf,
    },
    /// Destination: receive a disk from another daemon into a new image.
    MigrateIncoming(MigrateIncomingArgs),
    /// Source: start migrating a disk to a destination (precopy while it keeps serving).
    MigrateStart(MigrateStartArgs),
    /// Source: hand the disk over now (it stops serving here); postcopy if started so.
    MigrateSwitchover {
        name: String,
        /// Switch over in postcopy mode (only what is missing is listed; fetched on demand).
        #[arg(long)]
        postcopy: bool,
    },
    /// Source: switch over in postcopy mode now.
    MigratePostcopy { name: String },
    /// Progress of a disk's migration (either side).
    MigrateStatus { name: String },
    /// Stop a migration that has not handed the disk over yet.
    MigrateCancel { name: String },
    /// Source: resume a paused postcopy over a new connection.
    MigrateRecover {
        name: String,
        /// The destination's address (the same or a new route to it).
        #[arg(long, value_name = "ADDR")]
        to: String,
    },
}

#[derive(Args, Debug)]
pub struct MigrateIncomingArgs {
    /// Name of the disk on this daemon.
    name: String,
    /// The new image file to receive into (must not exist).
    #[arg(long, value_name = "PATH")]
    image: PathBuf,
    /// Where the source connects: tcp:HOST:PORT (port 0 picks one) or unix:PATH.
    #[arg(long, value_name = "ADDR")]
    listen: String,
    /// File holding the LUKS passphrase, to open the received volume (read by the daemon).
    #[arg(long, value_name = "FILE")]
    key_file: Option<PathBuf>,
    /// TLS credentials directory (QEMU x509 layout); the source must present a client
    /// certificate signed by its CA.
    #[arg(long, value_name = "DIR")]
    tls_creds: Option<PathBuf>,
    /// Export the disk on this vhost-user-blk socket (bound when the header has arrived).
    #[arg(long, value_name = "SOCKET")]
    vhost_user_blk: Option<PathBuf>,
    #[arg(long, value_name = "N")]
    num_queues: Option<u16>,
    #[arg(long, value_name = "N")]
    queue_size: Option<u16>,
    /// Export it over NBD as well.
    #[arg(long)]
    nbd_export: bool,
}

#[derive(Args, Debug)]
pub struct MigrateStartArgs {
    /// The attached disk to migrate.
    name: String,
    /// The destination's migrate-incoming address.
    #[arg(long, value_name = "ADDR")]
    to: String,
    /// Allow switching over before everything is copied; the destination fetches the rest
    /// on demand.
    #[arg(long)]
    postcopy: bool,
    /// With --postcopy: urgent requests on their own connection, ahead of the bulk stream.
    #[arg(long)]
    preempt: bool,
    /// Bulk chunk size, e.g. 2M (default 2 MiB).
    #[arg(long, value_name = "SIZE", value_parser = crate::size::parse_size)]
    chunk_size: Option<u64>,
    /// Cap on bytes per second over all channels, e.g. 125M for 1 Gbit/s.
    #[arg(long, value_name = "BYTES", value_parser = crate::size::parse_size)]
    max_bandwidth: Option<u64>,
    /// With --preempt: do not interrupt a bulk chunk for urgent requests (for comparisons).
    #[arg(long)]
    no_break_chunks: bool,
    /// Precopy passes before resending waits for the switchover (default 30; 0: no limit).
    #[arg(long, value_name = "N")]
    max_passes: Option<u32>,
    /// TLS credentials directory (QEMU x509 layout): ca-cert.pem, client-cert.pem,
    /// client-key.pem.
    #[arg(long, value_name = "DIR")]
    tls_creds: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub struct DiskAddArgs {
    /// Name of the disk in the daemon (logs, stats, later verbs).
    name: String,
    /// The image: LUKS1, LUKS2 or raw.
    #[arg(long, value_name = "PATH")]
    image: PathBuf,
    /// File holding the LUKS passphrase (read by the daemon; stdin cannot be forwarded).
    #[arg(long, value_name = "FILE")]
    key_file: Option<PathBuf>,
    /// Export it on this vhost-user-blk socket.
    #[arg(long, value_name = "SOCKET")]
    vhost_user_blk: Option<PathBuf>,
    /// Virtqueues offered to the guest.
    #[arg(long, value_name = "N")]
    num_queues: Option<u16>,
    /// Largest virtqueue size.
    #[arg(long, value_name = "N")]
    queue_size: Option<u16>,
    /// Export it over NBD as well.
    #[arg(long)]
    nbd_export: bool,
    /// Export read-only.
    #[arg(long)]
    readonly: bool,
    /// Pass guest discards to the image (reveals which blocks are unused).
    #[arg(long)]
    discard: bool,
    /// Host cache mode: none (O_DIRECT; the default), writeback, writethrough, directsync,
    /// unsafe.
    #[arg(long, value_name = "MODE")]
    cache: Option<cryptblk_block::CacheMode>,
    /// Asynchronous I/O engine: io_uring (the default) or threads.
    #[arg(long, value_name = "ENGINE")]
    aio: Option<cryptblk_block::AioEngine>,
    /// Busy-poll completions this many microseconds before sleeping (default 0: never).
    #[arg(long, value_name = "US")]
    poll_us: Option<u32>,
}

/// The daemon answered with a JSON-RPC error: printed as one line by the binary, which picks
/// the exit status from `code` (the daemon's codes mirror the CLI's exit statuses).
#[derive(Debug, thiserror::Error)]
#[error("{method}: {message} (JSON-RPC error {code})")]
pub struct RemoteError {
    pub method: &'static str,
    pub code: i64,
    pub message: String,
}

pub fn run(a: &CtlArgs) -> Result<()> {
    let result = execute(a)?;
    println!("{}", serde_json::to_string_pretty(&result)?);
    Ok(())
}

/// Sends the verb's request and returns the result, reporting an error response on stderr.
fn execute(a: &CtlArgs) -> Result<Value> {
    let (method, params) = request(&a.verb)?;
    let mut client = Client::connect(&a.socket)?;
    match client.call(method, params) {
        Ok(result) => Ok(result),
        Err(ClientError::Rpc(e)) => {
            if let Some(data) = &e.data {
                let data = serde_json::to_string_pretty(data).unwrap_or_else(|_| data.to_string());
                eprintln!("cryptblk: note: error data: {data}");
            }
            Err(RemoteError {
                method,
                code: e.code,
                message: e.message,
            }
            .into())
        }
        Err(e) => Err(e.into()),
    }
}

/// The JSON-RPC method and params for a verb.
fn request(verb: &CtlVerb) -> Result<(&'static str, Value)> {
    let mut p = Map::new();
    let method = match verb {
        CtlVerb::DiskAdd(d) => {
            p.insert("name".into(), d.name.clone().into());
            p.insert("image".into(), absolute(&d.image)?);
            if let Some(key_file) = &d.key_file {
                p.insert("key-file".into(), key_file_path(key_file, "--key-file")?);
            }
            if let Some(socket) = &d.vhost_user_blk {
                p.insert("vhost-user-blk".into(), absolute(socket)?);
            }
            if let Some(n) = d.num_queues {
                p.insert("num-queues".into(), n.into());
            }
            if let Some(n) = d.queue_size {
                p.insert("queue-size".into(), n.into());
            }
            p.insert("nbd-export".into(), d.nbd_export.into());
            p.insert("readonly".into(), d.readonly.into());
            p.insert("discard".into(), d.discard.into());
            if let Some(cache) = d.cache {
                p.insert("cache".into(), cache.name().into());
            }
            if let Some(aio) = d.aio {
                p.insert("aio".into(), aio.name().into());
            }
            if let Some(us) = d.poll_us {
                p.insert("poll-us".into(), us.into());
            }
            "disk-add"
        }
        CtlVerb::DiskRemove { name, force } => {
            p.insert("name".into(), name.clone().into());
            p.insert("force".into(), (*force).into());
            "disk-remove"
        }
        CtlVerb::DiskList => "disk-list",
        CtlVerb::Stats { name } => {
            if let Some(name) = name {
                p.insert("name".into(), name.clone().into());
            }
            "stats"
        }
        CtlVerb::KeyAdd {
            name,
            key_file,
            new_key_file,
            pbkdf,
            iter_time,
        } => {
            p.insert("name".into(), name.clone().into());
            p.insert("key-file".into(), key_file_path(key_file, "--key-file")?);
            p.insert(
                "new-key-file".into(),
                key_file_path(new_key_file, "--new-key-file")?,
            );
            if let Some(pbkdf) = pbkdf {
                p.insert("pbkdf".into(), pbkdf.clone().into());
            }
            if let Some(ms) = iter_time {
                p.insert("iter-time".into(), (*ms).into());
            }
            "key-add"
        }
        CtlVerb::KeyRemove { name, key_file } => {
            p.insert("name".into(), name.clone().into());
            p.insert("key-file".into(), key_file_path(key_file, "--key-file")?);
            "key-remove"
        }
        CtlVerb::MigrateIncoming(m) => {
            p.insert("name".into(), m.name.clone().into());
            p.insert("image".into(), absolute(&m.image)?);
            p.insert("listen".into(), m.listen.clone().into());
            if let Some(k) = &m.key_file {
                p.insert("key-file".into(), key_file_path(k, "--key-file")?);
            }
            if let Some(d) = &m.tls_creds {
                p.insert("tls-creds".into(), absolute(d)?);
            }
            if let Some(v) = &m.vhost_user_blk {
                p.insert("vhost-user-blk".into(), absolute(v)?);
            }
            if let Some(n) = m.num_queues {
                p.insert("num-queues".into(), n.into());
            }
            if let Some(n) = m.queue_size {
                p.insert("queue-size".into(), n.into());
            }
            p.insert("nbd-export".into(), m.nbd_export.into());
            "migrate-incoming"
        }
        CtlVerb::MigrateStart(m) => {
            p.insert("name".into(), m.name.clone().into());
            p.insert("to".into(), m.to.clone().into());
            p.insert("postcopy".into(), m.postcopy.into());
            p.insert("preempt".into(), m.preempt.into());
            if let Some(c) = m.chunk_size {
                p.insert("chunk-size".into(), c.into());
            }
            if let Some(b) = m.max_bandwidth {
                p.insert("max-bandwidth".into(), b.into());
            }
            p.insert("break-chunks".into(), (!m.no_break_chunks).into());
            if let Some(n) = m.max_passes {
                p.insert("max-passes".into(), n.into());
            }
            if let Some(d) = &m.tls_creds {
                p.insert("tls-creds".into(), absolute(d)?);
            }
            "migrate-start"
        }
        CtlVerb::MigrateSwitchover { name, postcopy } => {
            p.insert("name".into(), name.clone().into());
            if *postcopy {
                p.insert("postcopy".into(), true.into());
            }
            "migrate-switchover"
        }
        CtlVerb::MigratePostcopy { name } => {
            p.insert("name".into(), name.clone().into());
            "migrate-postcopy"
        }
        CtlVerb::MigrateStatus { name } => {
            p.insert("name".into(), name.clone().into());
            "migrate-status"
        }
        CtlVerb::MigrateCancel { name } => {
            p.insert("name".into(), name.clone().into());
            "migrate-cancel"
        }
        CtlVerb::MigrateRecover { name, to } => {
            p.insert("name".into(), name.clone().into());
            p.insert("to".into(), to.clone().into());
            "migrate-recover"
        }
    };
    Ok((method, Value::Object(p)))
}

/// Absolute (not canonicalised: the daemon should see the path the user named, and the file
/// may legitimately not exist yet on our side of a mount namespace) and valid UTF-8, since
/// JSON strings cannot carry arbitrary bytes.
fn absolute(path: &Path) -> Result<Value> {
    let absolute = std::path::absolute(path)?;
    match absolute.to_str() {
        Some(s) => Ok(s.into()),
        None => bail!(
            "{}: only UTF-8 paths can be sent to the daemon",
            path.display()
        ),
    }
}

/// Key files are opened by the daemon, so our stdin and file descriptors mean nothing there.
fn key_file_path(path: &Path, option: &str) -> Result<Value> {
    let s = path.to_string_lossy();
    let local_only = s == "-"
        || s == "/dev/stdin"
        || ["/dev/fd/", "/proc/self/fd/"]
            .iter()
            .any(|prefix| s.starts_with(prefix));
    if local_only {
        bail!(
            "{option} {s}: the daemon reads key files itself, so stdin and file descriptors \
             cannot be forwarded; pass the path of a file it can read"
        );
    }
    absolute(path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use cryptblk_control::{ControlServer, RpcError};
    use serde_json::json;
    use std::sync::Arc;

    #[derive(Parser, Debug)]
    struct Cli {
        #[command(flatten)]
        ctl: CtlArgs,
    }

    fn parse(args: &[&str]) -> CtlArgs {
        let mut argv = vec!["ctl"];
        argv.extend_from_slice(args);
        Cli::try_parse_from(argv).unwrap().ctl
    }

    fn abs(p: &str) -> String {
        std::env::current_dir()
            .unwrap()
            .join(p)
            .to_str()
            .unwrap()
            .to_owned()
    }

    #[test]
    fn verbs_map_to_methods_and_params() {
        let a = parse(&[
            "-s",
            "c.sock",
            "disk-add",
            "vm1",
            "--image",
            "disk.luks",
            "--key-file",
            "pass.txt",
            "--vhost-user-blk",
            "/run/vm1.sock",
            "--num-queues",
            "4",
            "--readonly",
        ]);
        assert_eq!(
            request(&a.verb).unwrap(),
            (
                "disk-add",
                json!({"name": "vm1", "image": abs("disk.luks"), "key-file": abs("pass.txt"),
                       "vhost-user-blk": "/run/vm1.sock", "num-queues": 4,
                       "nbd-export": false, "readonly": true, "discard": false})
            )
        );
        let a = parse(&[
            "--socket",
            "c",
            "disk-add",
            "d",
            "--image",
            "/i",
            "--nbd-export",
        ]);
        assert_eq!(
            request(&a.verb).unwrap().1,
            json!({"name": "d", "image": "/i", "nbd-export": true, "readonly": false,
                   "discard": false})
        );
        let cases: [(&[&str], &str, Value); 6] = [
            (
                &["disk-remove", "d", "--force"],
                "disk-remove",
                json!({"name": "d", "force": true}),
            ),
            (
                &["disk-remove", "d"],
                "disk-remove",
                json!({"name": "d", "force": false}),
            ),
            (&["disk-list"], "disk-list", json!({})),
            (&["stats"], "stats", json!({})),
            (&["stats", "d"], "stats", json!({"name": "d"})),
            (
                &["key-add", "d", "--key-file", "/a", "--new-key-file", "b"],
                "key-add",
                json!({"name": "d", "key-file": "/a", "new-key-file": abs("b")}),
            ),
        ];
        for (args, method, params) in cases {
            let mut argv = vec!["-s", "c"];
            argv.extend_from_slice(args);
            assert_eq!(request(&parse(&argv).verb).unwrap(), (method, params));
        }
        let a = parse(&["-s", "c", "key-remove", "d", "--key-file", "/k"]);
        assert_eq!(
            request(&a.verb).unwrap(),
            ("key-remove", json!({"name": "d", "key-file": "/k"}))
        );
    }

    #[test]
    fn stdin_and_fd_key_files_are_refused() {
        for key in ["-", "/dev/stdin", "/dev/fd/3", "/proc/self/fd/0"] {
            let a = parse(&["-s", "c", "key-remove", "d", "--key-file", key]);
            let err = request(&a.verb).unwrap_err().to_string();
            assert!(err.contains("cannot be forwarded"), "{err}");
        }
    }

    #[test]
    fn calls_the_daemon_and_reports_errors() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("ctl.sock");
        let handler =
            |method: &str, params: Value| match method {
                "disk-list" => Ok(json!({"method": method, "params": params})),
                "disk-remove" => Err(RpcError::application(-32010, "no disk named `x`")
                    .with_data(json!({"name": "x"}))),
                _ => Err(RpcError::method_not_found(method)),
            };
        let server = ControlServer::bind(&socket, Arc::new(handler)).unwrap();
        let stop = server.stop_handle();
        let thread = std::thread::spawn(move || server.run());
        let sock = socket.to_str().unwrap();

        let result = execute(&parse(&["-s", sock, "disk-list"])).unwrap();
        assert_eq!(result, json!({"method": "disk-list", "params": {}}));

        let err = execute(&parse(&["-s", sock, "disk-remove", "x"])).unwrap_err();
        let remote = err.downcast_ref::<RemoteError>().unwrap();
        assert_eq!((remote.method, remote.code), ("disk-remove", -32010));

        stop.stop();
        thread.join().unwrap().unwrap();
        let err = execute(&parse(&["-s", sock, "disk-list"])).unwrap_err();
        assert!(
            err.to_string().contains("cryptblk serve --control"),
            "{err}"
        );
    }
}
