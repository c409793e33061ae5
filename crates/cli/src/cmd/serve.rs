//! `cryptblk serve`: the command line of the daemon (`cryptblk-daemon`). Disks come from the
//! command line (one), a `--config` file (several) or later from the control socket.
use crate::args::{Cli, ServeArgs};
use crate::exit::UsageError;
use crate::options::{crypto_pool, unlock_options};
use crate::secrets::read_passphrase;
use anyhow::{Context, Result};
use cryptblk_control::api::{DiskConfig, ImageName};
use cryptblk_daemon::config::{load_config_file, ConfigFileError};
use cryptblk_daemon::{ServeConfig, StartDisk};
use cryptblk_nbd::AllowList;
use cryptblk_nbd::{ConnectionLimits, NbdAddress, TlsCreds};

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
disk-add, disk-remove, disk-list, stats, key-add, key-remove and the migrate-* methods;
`cryptblk ctl --help` lists them with their parameters. With --control the daemon may
start with no disk.

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

pub fn run(cli: &Cli, a: &ServeArgs) -> Result<()> {
    // Before any passphrase is read or key derived.
    if a.allow_core_dumps {
        tracing::warn!(
            "--allow-core-dumps: a core dump or a debugger attached to this daemon can read \
             guest memory and the disks' cipher keys"
        );
    } else {
        cryptblk_daemon::forbid_core_dumps()?;
    }
    let disks = match (&a.config, &a.image) {
        (Some(path), _) => load_config_file(path)
            .map_err(|e| match e {
                ConfigFileError::Invalid { .. } => UsageError(e.to_string()).into(),
                ConfigFileError::Read { .. } => anyhow::Error::from(e),
            })?
            .into_iter()
            .map(|config| StartDisk {
                config,
                passphrase: None,
            })
            .collect(),
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
    let nbd = a
        .nbd
        .as_deref()
        .map(|addr| {
            addr.parse::<NbdAddress>()
                .map_err(|e| UsageError(format!("--nbd {addr}: {e}")))
        })
        .transpose()?;
    let metrics = a
        .metrics
        .as_deref()
        .map(|addr| {
            addr.parse::<cryptblk_daemon::Address>()
                .map_err(|e| UsageError(format!("--metrics {addr}: {e}")))
        })
        .transpose()?;
    let authz = a
        .tls_authz
        .as_deref()
        .map(|text| {
            match text.strip_prefix('@') {
                Some(file) => AllowList::from_file(std::path::Path::new(file)),
                None => AllowList::parse(text),
            }
            .map_err(|e| UsageError(format!("--tls-authz {text}: {e}")))
        })
        .transpose()?;
    let nbd_tls = a
        .tls_creds
        .as_deref()
        .map(|dir| TlsCreds::load(dir).with_context(|| format!("--tls-creds {}", dir.display())))
        .transpose()?
        .map(|creds| match authz {
            Some(list) => creds.with_authz(list),
            None => creds,
        });
    cryptblk_daemon::serve(ServeConfig {
        disks,
        nbd,
        nbd_tls,
        nbd_insecure: a.nbd_insecure,
        nbd_limits: ConnectionLimits {
            total: a.nbd_max_connections as usize,
            per_peer: a.nbd_max_connections_per_peer as usize,
        },
        control: a.control.clone(),
        metrics,
        pool: crypto_pool(cli)?,
        unlock: unlock_options(cli),
        name_disks: a.config.is_some(),
    })?;
    Ok(())
}

/// The disk of `--image` and its options. A LUKS image without `--key-file` gets its
/// passphrase from the terminal (or one line of stdin), asked here, before the daemon starts,
/// unless its LUKS2 header has a clevis token.
fn single_disk(a: &ServeArgs) -> Result<StartDisk> {
    let Some(image) = &a.image else {
        return Err(UsageError("--image PATH is missing".into()).into());
    };
    if a.socket.is_none() && a.nbd.is_none() {
        return Err(UsageError(
            "give --vhost-user-blk SOCKET and/or --nbd ADDR to export the image".into(),
        )
        .into());
    }
    let image = ImageName::new(image);
    let mut config = DiskConfig::new(a.name.clone().unwrap_or_else(|| image.file_name()), image);
    config.key_file = a.key_file.clone();
    config.vhost_user_blk = a.socket.clone();
    config.num_queues = a.num_queues;
    config.queue_size = a.queue_size;
    config.readonly = a.readonly;
    config.discard = a.discard;
    config.cache = a.cache;
    config.aio = a.aio;
    config.poll_us = a.poll_us;
    config.socket_owner = a.socket_owner.clone();
    config.socket_peer_uid = a.socket_peer_uid.clone();
    config.socket_peer_gid = a.socket_peer_gid.clone();
    config.unsealed_memory = a.unsealed_memory;
    config.socket_mode = a.socket_mode.clone();
    cryptblk_daemon::config::validate(&config).map_err(|e| UsageError(e.0))?;
    let is_luks = matches!(
        cryptblk_block::probe_format(config.image.path()),
        Ok(cryptblk_block::Format::Luks)
    );
    // A header with a clevis token unlocks through its tang server (in the daemon): no prompt.
    let passphrase = if config.key_file.is_none() && is_luks && !has_clevis_token(&config) {
        Some(read_passphrase(None, "Enter passphrase: ")?)
    } else {
        None
    };
    Ok(StartDisk { config, passphrase })
}

/// True when the image's LUKS2 header carries a `clevis` token (a header that cannot be read
/// here is reported by the daemon when it opens the image).
fn has_clevis_token(config: &DiskConfig) -> bool {
    let Ok(file) = std::fs::File::open(config.image.path()) else {
        return false;
    };
    match cryptblk_luks::LuksImage::read(&file) {
        Ok((cryptblk_luks::LuksImage::V2(header), _)) => header
            .metadata()
            .tokens
            .values()
            .any(|t| t.get("type").and_then(|v| v.as_str()) == Some("clevis")),
        _ => false,
    }
}
