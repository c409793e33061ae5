//! `cryptblk serve`: export one image (command-line options) or several (`--config FILE`) as
//! vhost-user-blk sockets until SIGTERM/SIGINT.
//!
//! Every disk is opened and unlocked before any socket is bound, so a bad key or a missing
//! image fails the whole start and leaves no socket behind. Each disk then gets its own
//! `Server` on its own thread; a signal stops all of them.
use crate::args::{Cli, ServeArgs};
use crate::exit::UsageError;
use crate::options::crypto_pool;
use crate::secrets::read_passphrase;
use anyhow::{Context, Result};
use cryptblk_block::{BlockDevice, Format, OpenOptions, RawFile};
use cryptblk_crypto::CryptoPool;
use cryptblk_vhost_user_blk::{ServeOptions, Server, MAX_QUEUES, MAX_QUEUE_SIZE};
use serde::Deserialize;
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub const HELP: &str = "\
QEMU connects with:
  -object memory-backend-memfd,id=mem,size=<RAM>,share=on -numa node,memdev=mem
  -chardev socket,id=disk0,path=SOCKET,reconnect=1
  -device vhost-user-blk-pci,chardev=disk0,num-queues=N

The daemon serves one frontend at a time and accepts a new one after a disconnect.
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
  vhost-user-blk = \"/run/cryptblk/vm1.sock\"
  num-queues = 2                      # optional, default 1
  queue-size = 256                    # optional, default 256
  readonly = false                    # optional
  discard = false                     # optional
  serial = \"vm1-root\"                 # optional GET_ID answer (first 20 bytes)

  [[disk]]
  name = \"vm1-data\"
  ...

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
    vhost_user_blk: PathBuf,
    #[serde(default = "default_num_queues")]
    num_queues: u16,
    #[serde(default = "default_queue_size")]
    queue_size: u16,
    #[serde(default)]
    readonly: bool,
    #[serde(default)]
    discard: bool,
    serial: Option<String>,
}

fn default_num_queues() -> u16 {
    1
}

fn default_queue_size() -> u16 {
    256
}

/// A disk to serve, from the command line or from a config entry (paths resolved).
#[derive(Debug)]
struct DiskSpec {
    /// For messages: the config name, or the image path on the command line.
    label: String,
    image: PathBuf,
    key_file: Option<PathBuf>,
    /// A LUKS image without a key file prompts (command line) or is refused (config).
    may_prompt: bool,
    socket: PathBuf,
    num_queues: u16,
    queue_size: u16,
    readonly: bool,
    discard: bool,
    /// GET_ID answer; `None` = the LUKS UUID or the image file name.
    serial: Option<String>,
}

/// An opened disk, ready to bind.
struct OpenDisk {
    spec: DiskSpec,
    device: Arc<dyn BlockDevice>,
    format: Format,
    serial: String,
}

pub fn run(cli: &Cli, a: &ServeArgs) -> Result<()> {
    let specs = match &a.config {
        Some(config) => load_config(config)?,
        None => vec![single_disk(a)?],
    };
    let multi = a.config.is_some();

    // Open and unlock everything first: nothing is bound until every disk is usable.
    let mut pool: Option<Arc<CryptoPool>> = None;
    let mut disks = Vec::with_capacity(specs.len());
    for spec in specs {
        let disk = open_disk(cli, &mut pool, spec, multi)?;
        disks.push(disk);
    }

    let mut signals = signal_hook::iterator::Signals::new([
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGINT,
    ])
    .context("installing signal handlers")?;

    // Bind every socket; on a failure the servers already bound are dropped, which removes
    // their sockets.
    let mut servers = Vec::with_capacity(disks.len());
    for disk in disks {
        let OpenDisk {
            spec,
            device,
            format,
            serial,
        } = disk;
        let server = Server::bind(
            &spec.socket,
            device,
            ServeOptions {
                num_queues: spec.num_queues,
                queue_size: spec.queue_size,
                read_only: spec.readonly,
                serial,
                discard: spec.discard,
                io_threads: 0,
            },
        )
        .with_context(|| in_disk(&spec, multi))?;
        servers.push((spec, format, server));
    }

    let stops: Vec<_> = servers.iter().map(|(_, _, s)| s.stop_handle()).collect();
    let signal_handle = signals.handle();
    let signal_stops = stops.clone();
    let signal_thread = std::thread::spawn(move || {
        if let Some(sig) = signals.forever().next() {
            tracing::info!("signal {sig}: stopping");
            for stop in &signal_stops {
                stop.stop();
            }
        }
    });

    let (done_tx, done_rx) = crossbeam_channel::unbounded();
    let mut threads = Vec::with_capacity(servers.len());
    let mut labels = Vec::with_capacity(servers.len());
    for (index, (spec, format, server)) in servers.into_iter().enumerate() {
        if multi {
            eprintln!(
                "cryptblk: serving disk \"{}\": {} ({}) on {}",
                spec.label,
                spec.image.display(),
                format.name(),
                spec.socket.display()
            );
        } else {
            eprintln!(
                "cryptblk: serving {} ({}) on {}",
                spec.image.display(),
                format.name(),
                spec.socket.display()
            );
        }
        let done = done_tx.clone();
        let thread = std::thread::Builder::new()
            .name(format!("serve-{index}"))
            .spawn(move || {
                let result = server.run();
                let _ = done.send((index, result.is_err()));
                result
            });
        match thread {
            Ok(t) => {
                threads.push(t);
                labels.push(spec);
            }
            Err(e) => {
                // The servers already running are stopped below; this one is dropped.
                for stop in &stops {
                    stop.stop();
                }
                return Err(anyhow::Error::from(e).context("starting a server thread"));
            }
        }
    }
    drop(done_tx);

    // A server that fails (not one stopped by a signal) takes the others down with it, so
    // the daemon never keeps running with some of its disks gone.
    for (index, failed) in done_rx.iter() {
        if failed {
            tracing::warn!(
                "disk {}: server failed: stopping every disk",
                labels[index].label
            );
            for stop in &stops {
                stop.stop();
            }
        }
    }

    let mut first_err: Option<anyhow::Error> = None;
    for (thread, spec) in threads.into_iter().zip(&labels) {
        let result = match thread.join() {
            Ok(r) => r.map_err(anyhow::Error::from),
            Err(_) => Err(anyhow::anyhow!("server thread panicked")),
        };
        if let Err(e) = result {
            let e = e.context(if multi {
                format!("serving disk \"{}\" ({})", spec.label, spec.image.display())
            } else {
                format!("serving {}", spec.image.display())
            });
            if first_err.is_none() {
                first_err = Some(e);
            } else {
                eprintln!("cryptblk: {e:#}");
            }
        }
    }
    signal_handle.close();
    let _ = signal_thread.join();
    match first_err {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// "disk \"NAME\" (IMAGE)" for config disks, the image path for the single disk.
fn in_disk(spec: &DiskSpec, multi: bool) -> String {
    if multi {
        format!("disk \"{}\" ({})", spec.label, spec.image.display())
    } else {
        spec.image.display().to_string()
    }
}

fn single_disk(a: &ServeArgs) -> Result<DiskSpec> {
    let (Some(socket), Some(image)) = (&a.socket, &a.image) else {
        return Err(UsageError(
            "give --config FILE, or --vhost-user-blk SOCKET and --image PATH".into(),
        )
        .into());
    };
    check_queues(a.num_queues, a.queue_size, "--num-queues", "--queue-size")?;
    Ok(DiskSpec {
        label: image.display().to_string(),
        image: image.clone(),
        key_file: a.key_file.clone(),
        may_prompt: true,
        socket: socket.clone(),
        num_queues: a.num_queues,
        queue_size: a.queue_size,
        readonly: a.readonly,
        discard: a.discard,
        serial: None,
    })
}

fn check_queues(num_queues: u16, queue_size: u16, nq: &str, qs: &str) -> Result<()> {
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
fn load_config(path: &Path) -> Result<Vec<DiskSpec>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading config {}", path.display()))?;
    let base = path.parent().unwrap_or(Path::new(""));
    parse_config(&text, base).map_err(|msg| UsageError(format!("{}: {msg}", path.display())).into())
}

/// Parses config text; relative paths are resolved against `base`.
fn parse_config(text: &str, base: &Path) -> std::result::Result<Vec<DiskSpec>, String> {
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
        let socket = resolve(base, &entry.vhost_user_blk);
        if !sockets.insert(socket.clone()) {
            return Err(format!(
                "{what}: socket {} is already used by another disk",
                socket.display()
            ));
        }
        let key_file = entry.key_file.as_deref().map(|k| {
            if k == Path::new("-") {
                k.to_path_buf()
            } else {
                resolve(base, k)
            }
        });
        specs.push(DiskSpec {
            serial: Some(entry.serial.unwrap_or_else(|| entry.name.clone())),
            label: entry.name,
            image: resolve(base, &entry.image),
            key_file,
            may_prompt: false,
            socket,
            num_queues: entry.num_queues,
            queue_size: entry.queue_size,
            readonly: entry.readonly,
            discard: entry.discard,
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

fn open_disk(
    cli: &Cli,
    pool: &mut Option<Arc<CryptoPool>>,
    spec: DiskSpec,
    multi: bool,
) -> Result<OpenDisk> {
    let (device, format, serial) =
        open_device(cli, pool, &spec).with_context(|| in_disk(&spec, multi))?;
    Ok(OpenDisk {
        serial: spec.serial.clone().unwrap_or(serial),
        spec,
        device,
        format,
    })
}

fn open_device(
    cli: &Cli,
    pool: &mut Option<Arc<CryptoPool>>,
    spec: &DiskSpec,
) -> Result<(Arc<dyn BlockDevice>, Format, String)> {
    let path = &spec.image;
    let format = cryptblk_block::probe_format(path)
        .with_context(|| format!("probing {}", path.display()))?;
    let (device, serial): (Arc<dyn BlockDevice>, String) = match format {
        Format::Luks => {
            if spec.key_file.is_none() && !spec.may_prompt {
                return Err(UsageError("a LUKS image needs a key-file".into()).into());
            }
            let passphrase = read_passphrase(spec.key_file.as_deref(), "Enter passphrase: ")?;
            let pool = match pool {
                Some(p) => p.clone(),
                None => pool.insert(crypto_pool(cli)?).clone(),
            };
            let volume = cryptblk_block::open_luks_volume(
                path,
                &passphrase,
                &cryptblk_block::VolumeOptions {
                    writable: !spec.readonly,
                    unlock: crate::options::unlock_options(cli),
                    pool: Some(pool),
                },
            )?;
            for warning in volume.warnings() {
                eprintln!("cryptblk: warning: {}: {warning}", path.display());
            }
            let uuid = volume.header().uuid().to_string();
            (Arc::new(volume), uuid)
        }
        Format::Raw => {
            if spec.key_file.is_some() {
                return Err(UsageError(format!(
                    "a key file is given, but {} is raw, not LUKS",
                    path.display()
                ))
                .into());
            }
            let raw = RawFile::open(
                path,
                OpenOptions {
                    writable: !spec.readonly,
                    lock: true,
                },
            )?;
            let name = path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            (Arc::new(raw), name)
        }
        other => {
            return Err(UsageError(format!(
                "{} is {}: serve exports LUKS and raw images (convert it first)",
                path.display(),
                other.name()
            ))
            .into())
        }
    };
    Ok((device, format, serial))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> std::result::Result<Vec<DiskSpec>, String> {
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
        assert_eq!(a.socket, Path::new("/run/a.sock"));
        assert_eq!((a.num_queues, a.queue_size), (1, 256));
        assert!(!a.readonly && !a.discard && a.key_file.is_none());
        assert_eq!(a.serial.as_deref(), Some("a"));
        let b = &specs[1];
        assert_eq!(
            b.key_file.as_deref(),
            Some(Path::new("/etc/cryptblk/keys/b.key"))
        );
        assert_eq!(b.socket, Path::new("/etc/cryptblk/b.sock"));
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
