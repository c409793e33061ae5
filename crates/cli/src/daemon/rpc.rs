//! The control socket's methods (JSON-RPC 2.0): params are checked strictly (unknown fields
//! are errors, paths must be absolute because the daemon's working directory is not the
//! client's) and every failure becomes an error object with a stable code.

use super::disk::DiskConfig;
use super::{Daemon, DaemonError};
use crate::args::PbkdfChoice;
use clap::ValueEnum;
use cryptblk_control::{Handler, RpcError};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Application error codes: -32000 minus the CLI's exit status for errors the CLI has one for
/// (-32002 wrong passphrase, -32003 unsupported, -32004 damaged, -32005 I/O, -32006 in use,
/// -32007 resource limit, -32008 other), and these for the daemon's own.
pub const CODE_NO_SUCH_DISK: i64 = -32010;
pub const CODE_CONFLICT: i64 = -32011;
pub const CODE_BUSY: i64 = -32012;

pub struct ControlHandler {
    pub daemon: Arc<Daemon>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct DiskAddParams {
    name: String,
    image: PathBuf,
    key_file: Option<PathBuf>,
    vhost_user_blk: Option<PathBuf>,
    num_queues: Option<u16>,
    queue_size: Option<u16>,
    /// Default: exported when the daemon has an NBD server.
    nbd_export: Option<bool>,
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

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DiskRemoveParams {
    name: String,
    #[serde(default)]
    force: bool,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct StatsParams {
    name: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct KeyAddParams {
    name: String,
    key_file: PathBuf,
    new_key_file: PathBuf,
    pbkdf: Option<String>,
    iter_time: Option<u32>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct KeyRemoveParams {
    name: String,
    key_file: PathBuf,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct MigrateIncomingParams {
    name: String,
    /// The new image file the disk is received into (must not exist).
    image: PathBuf,
    key_file: Option<PathBuf>,
    /// Where the source connects: tcp:HOST:PORT or unix:PATH.
    listen: String,
    tls_creds: Option<PathBuf>,
    vhost_user_blk: Option<PathBuf>,
    num_queues: Option<u16>,
    queue_size: Option<u16>,
    nbd_export: Option<bool>,
    #[serde(default)]
    discard: bool,
    #[serde(default)]
    cache: cryptblk_block::CacheMode,
    #[serde(default)]
    aio: cryptblk_block::AioEngine,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct MigrateStartParams {
    name: String,
    to: String,
    #[serde(default)]
    postcopy: bool,
    #[serde(default)]
    preempt: bool,
    chunk_size: Option<usize>,
    /// Bytes per second over all channels.
    max_bandwidth: Option<u64>,
    /// With preempt: interrupt bulk chunks for urgent requests (default true).
    break_chunks: Option<bool>,
    /// Precopy passes before resending waits for the switchover (0: no limit).
    max_passes: Option<u32>,
    tls_creds: Option<PathBuf>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MigrateSwitchoverParams {
    name: String,
    postcopy: Option<bool>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NameParams {
    name: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MigrateRecoverParams {
    name: String,
    to: String,
}

fn address(s: &str) -> Result<cryptblk_migration::MigrationAddress, RpcError> {
    s.parse().map_err(RpcError::invalid_params)
}

impl Handler for ControlHandler {
    fn call(&self, method: &str, params: Value) -> Result<Value, RpcError> {
        let d = &self.daemon;
        match method {
            "disk-add" => {
                let p: DiskAddParams = parse(params)?;
                for path in [
                    Some(&p.image),
                    p.key_file.as_ref(),
                    p.vhost_user_blk.as_ref(),
                ]
                .into_iter()
                .flatten()
                {
                    absolute(path)?;
                }
                let queues = p.num_queues.unwrap_or(1);
                let queue_size = p.queue_size.unwrap_or(256);
                crate::cmd::serve::check_queues(queues, queue_size, "num-queues", "queue-size")
                    .map_err(|e| RpcError::invalid_params(format!("{e:#}")))?;
                let config = DiskConfig {
                    name: p.name,
                    image: p.image,
                    key_file: p.key_file,
                    may_prompt: false,
                    vhost_user_blk: p.vhost_user_blk,
                    nbd: p.nbd_export.unwrap_or(d.has_nbd()),
                    num_queues: queues,
                    queue_size,
                    readonly: p.readonly,
                    discard: p.discard,
                    serial: p.serial,
                    cache: p.cache,
                    aio: p.aio,
                    poll_us: p.poll_us,
                };
                if config.nbd && !d.has_nbd() {
                    return Err(RpcError::invalid_params(
                        "nbd-export is set but this daemon was started without --nbd",
                    ));
                }
                d.add_disk(config).map_err(to_rpc)
            }
            "disk-remove" => {
                let p: DiskRemoveParams = parse(params)?;
                d.remove_disk(&p.name, p.force).map_err(to_rpc)?;
                Ok(json!({ "removed": p.name }))
            }
            "disk-list" => {
                let _: StatsParams = parse_or_default(params)?;
                Ok(d.list())
            }
            "stats" => {
                let p: StatsParams = parse_or_default(params)?;
                d.stats(p.name.as_deref()).map_err(to_rpc)
            }
            "key-add" => {
                let p: KeyAddParams = parse(params)?;
                absolute(&p.key_file)?;
                absolute(&p.new_key_file)?;
                let pbkdf = p
                    .pbkdf
                    .as_deref()
                    .map(|s| {
                        PbkdfChoice::from_str(s, true).map_err(|_| {
                            RpcError::invalid_params(format!(
                                "pbkdf \"{s}\": use pbkdf2, argon2i or argon2id"
                            ))
                        })
                    })
                    .transpose()?;
                let slot = d
                    .key_add(&p.name, &p.key_file, &p.new_key_file, pbkdf, p.iter_time)
                    .map_err(to_rpc)?;
                Ok(json!({ "name": p.name, "keyslot": slot }))
            }
            "key-remove" => {
                let p: KeyRemoveParams = parse(params)?;
                absolute(&p.key_file)?;
                let slot = d.key_remove(&p.name, &p.key_file).map_err(to_rpc)?;
                Ok(json!({ "name": p.name, "removed-keyslot": slot }))
            }
            "migrate-incoming" => {
                let p: MigrateIncomingParams = parse(params)?;
                for path in [
                    Some(&p.image),
                    p.key_file.as_ref(),
                    p.vhost_user_blk.as_ref(),
                    p.tls_creds.as_ref(),
                ]
                .into_iter()
                .flatten()
                {
                    absolute(path)?;
                }
                let listen = address(&p.listen)?;
                let queues = p.num_queues.unwrap_or(1);
                let queue_size = p.queue_size.unwrap_or(256);
                crate::cmd::serve::check_queues(queues, queue_size, "num-queues", "queue-size")
                    .map_err(|e| RpcError::invalid_params(format!("{e:#}")))?;
                let nbd = p.nbd_export.unwrap_or(d.has_nbd());
                if nbd && !d.has_nbd() {
                    return Err(RpcError::invalid_params(
                        "nbd-export is set but this daemon was started without --nbd",
                    ));
                }
                let config = DiskConfig {
                    name: p.name,
                    image: p.image,
                    key_file: p.key_file,
                    may_prompt: false,
                    vhost_user_blk: p.vhost_user_blk,
                    nbd,
                    num_queues: queues,
                    queue_size,
                    readonly: false,
                    discard: p.discard,
                    serial: None,
                    cache: p.cache,
                    aio: p.aio,
                    poll_us: 0,
                };
                d.migrate_incoming(config, &listen, p.tls_creds.as_deref())
                    .map_err(to_rpc)
            }
            "migrate-start" => {
                let p: MigrateStartParams = parse(params)?;
                if let Some(dir) = &p.tls_creds {
                    absolute(dir)?;
                }
                let req = super::migrate::StartRequest {
                    to: address(&p.to)?,
                    postcopy: p.postcopy,
                    preempt: p.preempt,
                    chunk_size: p.chunk_size,
                    max_bandwidth: p.max_bandwidth,
                    break_chunks: p.break_chunks.unwrap_or(true),
                    max_passes: p.max_passes,
                    tls_creds: p.tls_creds,
                };
                d.migrate_start(&p.name, req).map_err(to_rpc)
            }
            "migrate-switchover" => {
                let p: MigrateSwitchoverParams = parse(params)?;
                d.migrate_switchover(&p.name, p.postcopy).map_err(to_rpc)
            }
            "migrate-postcopy" => {
                let p: NameParams = parse(params)?;
                d.migrate_switchover(&p.name, Some(true)).map_err(to_rpc)
            }
            "migrate-status" => {
                let p: NameParams = parse(params)?;
                d.migrate_status(&p.name).map_err(to_rpc)
            }
            "migrate-cancel" => {
                let p: NameParams = parse(params)?;
                d.migrate_cancel(&p.name).map_err(to_rpc)
            }
            "migrate-recover" => {
                let p: MigrateRecoverParams = parse(params)?;
                d.migrate_recover(&p.name, &address(&p.to)?).map_err(to_rpc)
            }
            other => Err(RpcError::method_not_found(other)),
        }
    }
}

fn parse<T: DeserializeOwned>(params: Value) -> Result<T, RpcError> {
    serde_json::from_value(params).map_err(|e| RpcError::invalid_params(e.to_string()))
}

/// Like `parse`, with absent params meaning all defaults.
fn parse_or_default<T: DeserializeOwned + Default>(params: Value) -> Result<T, RpcError> {
    if params.is_null() {
        return Ok(T::default());
    }
    parse(params)
}

fn absolute(path: &Path) -> Result<(), RpcError> {
    if path.is_absolute() {
        Ok(())
    } else {
        Err(RpcError::invalid_params(format!(
            "{} is relative: the daemon needs absolute paths",
            path.display()
        )))
    }
}

fn to_rpc(e: anyhow::Error) -> RpcError {
    let message = crate::exit::one_line(&e);
    let code = match e.downcast_ref::<DaemonError>() {
        Some(DaemonError::NoSuchDisk(_)) => CODE_NO_SUCH_DISK,
        Some(DaemonError::Conflict(_)) => CODE_CONFLICT,
        Some(DaemonError::Busy(_)) => CODE_BUSY,
        None => -32000 - i64::from(crate::exit::code_for(&e)),
    };
    RpcError::application(code, message)
}
