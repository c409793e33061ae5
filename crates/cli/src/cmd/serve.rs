//! `cryptblk serve`: the command line of the daemon (`cryptblk-daemon`). Disks come from the
//! command line (one), a `--config` file (several) or later from the control socket.
use crate::args::{Cli, ServeArgs};
use crate::exit::UsageError;
use crate::options::{crypto_pool, unlock_options};
use crate::secrets::read_passphrase;
use anyhow::{Context, Result};
use cryptblk_control::api::{DiskConfig, ImageName};
use cryptblk_daemon::config::{load_serve_file, ConfigFileError, ServeFile};
use cryptblk_daemon::{ServeConfig, StartDisk};
use cryptblk_nbd::AllowList;
use cryptblk_nbd::{ConnectionLimits, NbdAddress, TlsCreds};

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
    // Read once, before any disk needs it; a bad file fails the start.
    // (A successor reads it again: the predecessor's copy stays in its own memory.)
    let master_key = a
        .master_key_file
        .as_deref()
        .map(cryptblk_daemon::secret::MasterKey::from_file)
        .transpose()
        .context("--master-key-file")?;
    let take_over = a.take_over_fd.map(inherited_fd).transpose()?;
    let mut file_budget = None;
    let disks = match (&a.config, &a.image) {
        (Some(path), _) => {
            let ServeFile {
                disks,
                memory_budget,
            } = load_serve_file(path).map_err(|e| match e {
                ConfigFileError::Invalid { .. } => UsageError(e.to_string()).into(),
                ConfigFileError::Read { .. } => anyhow::Error::from(e),
            })?;
            file_budget = memory_budget;
            if disks.is_empty() && a.control.is_none() && take_over.is_none() {
                return Err(UsageError(format!(
                    "{}: no [[disk]] in the file; give --control PATH to start without disks \
                     and add them later",
                    path.display()
                ))
                .into());
            }
            disks
                .into_iter()
                .map(|config| StartDisk {
                    config,
                    passphrase: None,
                })
                .filter(|_| take_over.is_none())
                .collect()
        }
        // A successor gets its disks from the daemon it takes over from (a config file
        // still gives its settings).
        _ if take_over.is_some() => Vec::new(),
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
        master_key,
        name_disks: a.config.is_some(),
        memory_budget: a.memory_budget.or(file_budget),
        key_cache: (a.key_cache == "keyring")
            .then(|| std::time::Duration::from_secs(a.key_cache_timeout)),
        unlock_memory_kib: a
            .unlock_memory
            .map_or_else(cryptblk_daemon::UnlockBudget::default_kib, |bytes| {
                bytes >> 10
            }),
        take_over,
        restart: Some(restart_command()?),
    })?;
    Ok(())
}

/// The descriptor a predecessor daemon passed down (`--take-over-fd`), checked to be open.
fn inherited_fd(fd: i32) -> Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    // SAFETY: F_GETFD only asks whether `fd` is open; it changes nothing.
    if fd < 3 || unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
        return Err(UsageError(format!(
            "--take-over-fd {fd}: no such descriptor (this option is for `ctl upgrade` only)"
        ))
        .into());
    }
    // SAFETY: the descriptor is open (checked above) and nothing else in this process owns
    // it: it was inherited for exactly this use.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
}

/// The program file and arguments that start this daemon again, for `ctl upgrade`: the path
/// as it was at start (a package upgrade puts the new version there), the same arguments.
fn restart_command() -> Result<(std::path::PathBuf, Vec<std::ffi::OsString>)> {
    let program = std::env::current_exe().context("finding the daemon's own program file")?;
    let args = cryptblk_daemon::restart_args(std::env::args_os().skip(1));
    Ok((program, args))
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
