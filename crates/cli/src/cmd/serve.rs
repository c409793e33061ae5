//! `cryptblk serve`: run the daemon. Disks come from the command line (one), a `--config`
//! file (several) or later from the control socket; each is exported over vhost-user-blk
//! and/or NBD until SIGTERM/SIGINT.
//!
//! Every disk named at start is opened and unlocked before any socket is bound, so a bad key
//! or a missing image fails the whole start and leaves no socket behind.
use crate::args::{Cli, ServeArgs};
use crate::daemon::disk::DiskConfig;
use crate::daemon::rpc::ControlHandler;
use crate::daemon::{Daemon, Event};
use crate::exit::UsageError;
use crate::options::{crypto_pool, unlock_options};
use anyhow::{Context, Result};
use cryptblk_control::ControlServer;
use cryptblk_nbd::{ExportRegistry, NbdAddress, NbdServer, TlsCreds};
use cryptblk_vhost_user_blk::{MAX_QUEUES, MAX_QUEUE_SIZE};
use serde::Deserialize;
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub const HELP: &str = "\
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

  [[disk]]
  name = \"vm1-data\"
  ...

--nbd unix:PATH or --nbd tcp:HOST:PORT also serves every disk over NBD (fixed newstyle,
structured replies, base:allocation, multi-conn), export name = disk name:
  qemu-img info 'nbd+unix:///NAME?socket=PATH'   nbdinfo 'nbd+unix:///NAME?socket=PATH'
--tls-creds DIR makes TLS mandatory on it (QEMU's layout: ca-cert.pem, server-cert.pem,
server-key.pem).

--control PATH answers JSON-RPC 2.0 requests (one per line) on a 0600 UNIX socket:
disk-add, disk-remove, disk-list, stats, key-add, key-remove; `cryptblk ctl --help` lists
them with their parameters. With --control the daemon may start with no disk.

Unknown keys are errors; names and socket paths must be unique; relative paths are
resolved against the directory of the config file. Every disk is opened and unlocked
before any socket is bound: one missing image or wrong key fails the whole start (the
message names the disk) and no socket is created. SIGTERM or SIGINT stops and flushes
every disk, then exits 0.";

/// One `[[disk]]` entry of a `--config` file, as written.
#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct DiskEntry {
    name: String,
    image: PathBuf,
    key_file: Option<PathBuf>,
    vhost_user_blk: Option<PathBuf>,
    #[serde(default = "default_true")]
    nbd: bool,
    #[serde(default = "default_num_queues")]
    num_queues: u16,
    #[serde(default = "default_queue_size")]
    queue_size: u16,
    #[serde(default)]
    readonly: bool,
    #[serde(default)]
    discard: bool,
    serial: Option<String>,
    #[serde(default)]
    cache: cryptblk_block::CacheMode,
    #[serde(default)]
    aio: cryptblk_block::AioEngine,
    #[serde(default)]
    poll_us: u32,
}

fn default_true() -> bool {
    true
}

fn default_num_queues() -> u16 {
    1
}

fn default_queue_size() -> u16 {
    256
}

pub fn run(cli: &Cli, a: &ServeArgs) -> Result<()> {
    let configs = match (&a.config, &a.image) {
        (Some(config), _) => load_config(config)?,
        (None, Some(_)) => vec![single_disk(a)?],
        (None, None) if a.control.is_some() => Vec::new(),
        (None, None) => {
            return Err(UsageError(
                "give --image PATH (with --vhost-user-blk SOCKET and/or --nbd ADDR), \
                 --config FILE, or --control PATH to add disks later"
                    .into(),
            )
            .into())
        }
    };
    let nbd_address = a
        .nbd
        .as_deref()
        .map(|addr| {
            addr.parse::<NbdAddress>()
                .map_err(|e| UsageError(format!("--nbd {addr}: {e}")))
        })
        .transpose()?;
    for c in &configs {
        if c.vhost_user_blk.is_none() && !(c.nbd && nbd_address.is_some()) {
            return Err(UsageError(format!(
                "disk \"{}\" would not be exported: give it a vhost-user-blk socket, or serve --nbd ADDR",
                c.name
            ))
            .into());
        }
    }
    let tls = a
        .tls_creds
        .as_deref()
        .map(|dir| TlsCreds::load(dir).with_context(|| format!("--tls-creds {}", dir.display())))
        .transpose()?;

    let mut signals = signal_hook::iterator::Signals::new([
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGINT,
    ])
    .context("installing signal handlers")?;
    let (events_tx, events) = crossbeam_channel::unbounded();
    let registry = nbd_address.as_ref().map(|_| ExportRegistry::new());
    let daemon = Daemon::new(
        crypto_pool(cli)?,
        unlock_options(cli),
        registry.clone(),
        events_tx.clone(),
    );

    // Every disk of the command line or config is opened and unlocked before any socket is
    // bound; then all are exported. One failure detaches the others again and fails the start.
    let multi = a.config.is_some();
    let label = |config: &DiskConfig| {
        if multi {
            format!("disk \"{}\" ({})", config.name, config.image.display())
        } else {
            config.image.display().to_string()
        }
    };
    let mut prepared = Vec::with_capacity(configs.len());
    for config in configs {
        let what = label(&config);
        match daemon.prepare(config) {
            Ok(p) => prepared.push(p),
            Err(e) => {
                for p in prepared {
                    daemon.abandon(p);
                }
                return Err(e.context(what));
            }
        }
    }
    let mut pending = prepared.into_iter();
    while let Some(p) = pending.next() {
        let config = p.config.clone();
        let info = match daemon.publish(p) {
            Ok(info) => info,
            Err(e) => {
                for rest in pending {
                    daemon.abandon(rest);
                }
                let _ = daemon.shutdown();
                return Err(e.context(label(&config)));
            }
        };
        let exports: Vec<String> = config
            .vhost_user_blk
            .iter()
            .map(|s| format!("vhost-user-blk {}", s.display()))
            .chain(
                (config.nbd && nbd_address.is_some())
                    .then(|| format!("NBD export \"{}\"", config.name)),
            )
            .collect();
        let format = info["format"].as_str().unwrap_or("?");
        eprintln!(
            "cryptblk: serving {} ({format}) on {}",
            label(&config),
            exports.join(", ")
        );
    }

    let mut nbd_thread = None;
    if let (Some(addr), Some(registry)) = (&nbd_address, &registry) {
        let server = match NbdServer::bind(addr, registry.clone(), tls) {
            Ok(s) => s,
            Err(e) => {
                let _ = daemon.shutdown();
                return Err(anyhow::Error::from(e)
                    .context(format!("--nbd {}", a.nbd.as_deref().unwrap_or(""))));
            }
        };
        eprintln!("cryptblk: NBD server on {}", server.local_addr());
        let stop = server.stop_handle();
        let events = events_tx.clone();
        let thread = std::thread::Builder::new()
            .name("nbd".into())
            .spawn(move || {
                let result = server.run();
                if let Err(e) = &result {
                    let _ = events.send(Event::ServerFailed {
                        disk: "(NBD server)".into(),
                        error: e.to_string(),
                    });
                }
            })
            .context("starting the NBD server thread")?;
        nbd_thread = Some((stop, thread));
    }

    let mut control_thread = None;
    if let Some(path) = &a.control {
        let handler = Arc::new(ControlHandler {
            daemon: daemon.clone(),
        });
        let server = match ControlServer::bind(path, handler) {
            Ok(s) => s,
            Err(e) => {
                if let Some((stop, thread)) = nbd_thread.take() {
                    stop.stop();
                    let _ = thread.join();
                }
                let _ = daemon.shutdown();
                return Err(anyhow::Error::from(e).context(format!("--control {}", path.display())));
            }
        };
        eprintln!("cryptblk: control socket {}", path.display());
        let stop = server.stop_handle();
        let thread = std::thread::Builder::new()
            .name("control".into())
            .spawn(move || {
                if let Err(e) = server.run() {
                    tracing::warn!("control socket: {e}");
                }
            })
            .context("starting the control thread")?;
        control_thread = Some((stop, thread));
    }

    let signal_handle = signals.handle();
    let signal_thread = std::thread::spawn(move || {
        if let Some(sig) = signals.forever().next() {
            let _ = events_tx.send(Event::Signal(sig));
        }
    });

    // Run until a signal, or until a server fails: the daemon never keeps running with some
    // of its disks gone.
    let mut failure = None;
    if let Ok(event) = events.recv() {
        match event {
            Event::Signal(sig) => tracing::info!("signal {sig}: stopping"),
            Event::ServerFailed { disk, error } => {
                eprintln!("cryptblk: disk {disk}: server failed: {error}; stopping every disk");
                failure = Some(anyhow::anyhow!("serving disk {disk}: {error}"));
            }
        }
    }

    // Control first (no disk-add during shutdown), then every disk (in-flight requests
    // finish, images are flushed), then the NBD listener.
    if let Some((stop, thread)) = control_thread {
        stop.stop();
        let _ = thread.join();
    }
    let detached = daemon.shutdown();
    if let Some((stop, thread)) = nbd_thread {
        stop.stop();
        let _ = thread.join();
    }
    signal_handle.close();
    let _ = signal_thread.join();
    match (failure, detached) {
        (Some(e), _) | (None, Err(e)) => Err(e),
        (None, Ok(())) => Ok(()),
    }
}

fn single_disk(a: &ServeArgs) -> Result<DiskConfig> {
    let Some(image) = &a.image else {
        return Err(UsageError("--image PATH is missing".into()).into());
    };
    if a.socket.is_none() && a.nbd.is_none() {
        return Err(UsageError(
            "give --vhost-user-blk SOCKET and/or --nbd ADDR to export the image".into(),
        )
        .into());
    }
    check_queues(a.num_queues, a.queue_size, "--num-queues", "--queue-size")?;
    let name = match &a.name {
        Some(n) => n.clone(),
        None => image
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| image.display().to_string()),
    };
    Ok(DiskConfig {
        name,
        image: image.clone(),
        key_file: a.key_file.clone(),
        may_prompt: true,
        vhost_user_blk: a.socket.clone(),
        nbd: true,
        num_queues: a.num_queues,
        queue_size: a.queue_size,
        readonly: a.readonly,
        discard: a.discard,
        serial: None,
        cache: a.cache,
        aio: a.aio,
        poll_us: a.poll_us,
    })
}

pub fn check_queues(num_queues: u16, queue_size: u16, nq: &str, qs: &str) -> Result<()> {
    if num_queues == 0 || num_queues > MAX_QUEUES {
        return Err(UsageError(format!("{nq} {num_queues}: use 1 to {MAX_QUEUES}")).into());
    }
    if !queue_size.is_power_of_two() || queue_size > MAX_QUEUE_SIZE {
        return Err(UsageError(format!(
            "{qs} {queue_size}: use a power of two up to {MAX_QUEUE_SIZE}"
        ))
        .into());
    }
    Ok(())
}

/// Reads and checks a `--config` file; every problem is a usage error naming the file (and
/// the disk, where there is one).
fn load_config(path: &Path) -> Result<Vec<DiskConfig>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading config {}", path.display()))?;
    let base = path.parent().unwrap_or(Path::new(""));
    parse_config(&text, base).map_err(|msg| UsageError(format!("{}: {msg}", path.display())).into())
}

/// Parses config text; relative paths are resolved against `base`.
fn parse_config(text: &str, base: &Path) -> std::result::Result<Vec<DiskConfig>, String> {
    let table: toml::Table = toml::from_str(text).map_err(|e| toml_error(text, &e))?;
    if let Some(key) = table.keys().find(|k| k.as_str() != "disk") {
        return Err(format!(
            "unknown key `{key}` (the file holds [[disk]] tables only)"
        ));
    }
    let entries = match table.get("disk") {
        None => return Err("no [[disk]] in the file".into()),
        Some(toml::Value::Array(entries)) if !entries.is_empty() => entries,
        Some(_) => return Err("`disk` must be [[disk]] tables".into()),
    };

    let mut names = HashSet::new();
    let mut sockets = HashSet::new();
    let mut specs = Vec::with_capacity(entries.len());
    for (i, value) in entries.iter().enumerate() {
        let number = i + 1;
        let what = match value.get("name").and_then(toml::Value::as_str) {
            Some(name) => format!("disk \"{name}\""),
            None => format!("disk #{number}"),
        };
        let entry: DiskEntry = value
            .clone()
            .try_into()
            .map_err(|e: toml::de::Error| format!("{what}: {}", e.message().trim()))?;
        if entry.name.is_empty() {
            return Err(format!("disk #{number}: empty name"));
        }
        if entry.name.chars().any(char::is_control) {
            return Err(format!("{what}: control characters in the name"));
        }
        check_queues(
            entry.num_queues,
            entry.queue_size,
            "num-queues",
            "queue-size",
        )
        .map_err(|e| format!("{what}: {e}"))?;
        if !names.insert(entry.name.clone()) {
            return Err(format!("{what}: another disk has the same name"));
        }
        let socket = entry.vhost_user_blk.as_deref().map(|s| resolve(base, s));
        if let Some(socket) = &socket {
            if !sockets.insert(socket.clone()) {
                return Err(format!(
                    "{what}: socket {} is already used by another disk",
                    socket.display()
                ));
            }
        }
        let key_file = entry.key_file.as_deref().map(|k| {
            if k == Path::new("-") {
                k.to_path_buf()
            } else {
                resolve(base, k)
            }
        });
        specs.push(DiskConfig {
            serial: Some(entry.serial.unwrap_or_else(|| entry.name.clone())),
            name: entry.name,
            image: resolve(base, &entry.image),
            key_file,
            may_prompt: false,
            vhost_user_blk: socket,
            nbd: entry.nbd,
            num_queues: entry.num_queues,
            queue_size: entry.queue_size,
            readonly: entry.readonly,
            discard: entry.discard,
            cache: entry.cache,
            aio: entry.aio,
            poll_us: entry.poll_us,
        });
    }
    Ok(specs)
}

fn resolve(base: &Path, path: &Path) -> PathBuf {
    if path.is_absolute() {
        path.to_path_buf()
    } else {
        base.join(path)
    }
}

/// A TOML syntax or type error on one line: "line L, column C: message".
fn toml_error(text: &str, e: &toml::de::Error) -> String {
    let msg = e.message().trim().replace('\n', "; ");
    match e.span() {
        Some(span) => {
            let before = &text[..span.start.min(text.len())];
            let line = before.matches('\n').count() + 1;
            let column = before.len() - before.rfind('\n').map_or(0, |p| p + 1) + 1;
            format!("line {line}, column {column}: {msg}")
        }
        None => msg,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> std::result::Result<Vec<DiskConfig>, String> {
        parse_config(text, Path::new("/etc/cryptblk"))
    }

    #[test]
    fn config_defaults_and_relative_paths() {
        let specs = parse(
            r#"
[[disk]]
name = "a"
image = "a.raw"
vhost-user-blk = "/run/a.sock"

[[disk]]
name = "b"
image = "/var/b.luks"
key-file = "keys/b.key"
vhost-user-blk = "b.sock"
num-queues = 2
queue-size = 128
readonly = true
discard = true
serial = "bee"
"#,
        )
        .unwrap();
        assert_eq!(specs.len(), 2);
        let a = &specs[0];
        assert_eq!(a.image, Path::new("/etc/cryptblk/a.raw"));
        assert_eq!(a.vhost_user_blk.as_deref(), Some(Path::new("/run/a.sock")));
        assert!(a.nbd);
        assert_eq!((a.num_queues, a.queue_size), (1, 256));
        assert!(!a.readonly && !a.discard && a.key_file.is_none());
        assert_eq!(a.serial.as_deref(), Some("a"));
        let b = &specs[1];
        assert_eq!(
            b.key_file.as_deref(),
            Some(Path::new("/etc/cryptblk/keys/b.key"))
        );
        assert_eq!(
            b.vhost_user_blk.as_deref(),
            Some(Path::new("/etc/cryptblk/b.sock"))
        );
        assert_eq!((b.num_queues, b.queue_size), (2, 128));
        assert!(b.readonly && b.discard);
        assert_eq!(b.serial.as_deref(), Some("bee"));
    }

    #[test]
    fn config_errors_name_the_disk() {
        let e = parse("[[disk]]\nname = \"x\"\nimage = \"i\"\nvhost-user-blk = \"s\"\nbogus = 1\n")
            .unwrap_err();
        assert!(e.contains("bogus") && e.contains("\"x\""), "{e}");
        let e = parse("[[disk]]\nname = \"x\"\nvhost-user-blk = \"s\"\n").unwrap_err();
        assert!(e.contains("image") && e.contains("\"x\""), "{e}");
        let two = |a: &str, b: &str| {
            format!(
                "[[disk]]\nname = \"{a}\"\nimage = \"i1\"\nvhost-user-blk = \"s1\"\n\
                 [[disk]]\nname = \"{b}\"\nimage = \"i2\"\nvhost-user-blk = \"{}\"\n",
                if a == b { "s2" } else { "s1" }
            )
        };
        let e = parse(&two("x", "x")).unwrap_err();
        assert!(e.contains("same name"), "{e}");
        let e = parse(&two("x", "y")).unwrap_err();
        assert!(e.contains("socket") && e.contains("\"y\""), "{e}");
        let e = parse(
            "[[disk]]\nname = \"q\"\nimage = \"i\"\nvhost-user-blk = \"s\"\nqueue-size = 100\n",
        )
        .unwrap_err();
        assert!(e.contains("queue-size 100") && e.contains("\"q\""), "{e}");
        let e = parse("").unwrap_err();
        assert!(e.contains("no [[disk]]"), "{e}");
        let e = parse("[[disk]\n").unwrap_err();
        assert!(e.starts_with("line 1"), "{e}");
        let e = parse("extra = 1\n[[disk]]\nname = \"x\"\nimage = \"i\"\nvhost-user-blk = \"s\"\n")
            .unwrap_err();
        assert!(e.contains("extra"), "{e}");
    }
}
