//! The daemon's methods: each one's params as a type (what the server accepts, checked
//! strictly) and as a table entry (what `cryptblk ctl` offers and documents). A test keeps
//! the two equal, so a param the server takes is never missing from `ctl` or its help.
use super::disk::{DiskConfig, ImageName};
use super::passphrase_params::params_with_passphrases;
use crate::RpcError;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::path::PathBuf;

/// `disk-remove`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct DiskRemoveParams {
    pub name: String,
    #[serde(default)]
    pub force: bool,
}

/// `disk-list`: no params.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NoParams {}

/// `stats`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StatsParams {
    /// One disk; all when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

/// Key derivation of a new keyslot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Pbkdf {
    Pbkdf2,
    Argon2i,
    Argon2id,
}

params_with_passphrases! {
    /// `key-add`: the existing passphrase from `key_file`, `key_fd` or `key_secret`, the new one
    /// from `new_key_file`, `new_key_fd` or `new_key_secret` (exactly one of each; see
    /// [`super::key_source()`]).
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    #[serde(deny_unknown_fields, rename_all = "kebab-case")]
    pub struct KeyAddParams {
        pub name: String,
        passphrase key_params(key_file, key_fd, key_secret, key_secret_iv);
        passphrase new_key_params(new_key_file, new_key_fd, new_key_secret, new_key_secret_iv);
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub pbkdf: Option<Pbkdf>,
        /// Milliseconds.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub iter_time: Option<u32>,
    }
}

params_with_passphrases! {
    /// `key-remove`.
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    #[serde(deny_unknown_fields, rename_all = "kebab-case")]
    pub struct KeyRemoveParams {
        pub name: String,
        passphrase key_params(key_file, key_fd, key_secret, key_secret_iv);
    }
}

/// `disk-resize`: `size` is what the guest sees, in bytes (a whole number of the disk's
/// sectors: the LUKS encryption sector, 512 for raw).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct DiskResizeParams {
    pub name: String,
    pub size: u64,
    /// Allow a size below the current one (the data past it is lost).
    #[serde(default)]
    pub allow_shrink: bool,
}

params_with_passphrases! {
    /// `migrate-incoming`.
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    #[serde(deny_unknown_fields, rename_all = "kebab-case")]
    pub struct MigrateIncomingParams {
        pub name: String,
        /// The new image file the disk is received into (must not exist).
        pub image: ImageName,
        /// Where the source connects: `tcp:HOST:PORT` or `unix:PATH`.
        pub listen: String,
        passphrase key_params(key_file, key_fd, key_secret, key_secret_iv);
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub tls_creds: Option<PathBuf>,
        /// With `tls_creds`: the name the source's certificate must carry.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub peer_name: Option<String>,
        /// Plain TCP on a non-loopback address, on purpose.
        #[serde(default)]
        pub insecure: bool,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub vhost_user_blk: Option<PathBuf>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub num_queues: Option<u16>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub queue_size: Option<u16>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub nbd_export: Option<bool>,
        #[serde(default)]
        pub discard: bool,
    }
}

/// `migrate-start`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct MigrateStartParams {
    pub name: String,
    pub to: String,
    #[serde(default)]
    pub postcopy: bool,
    #[serde(default)]
    pub preempt: bool,
    /// Shared storage: hand the image's lock over instead of copying.
    #[serde(default)]
    pub shared: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chunk_size: Option<u64>,
    /// Bytes per second over all channels.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_bandwidth: Option<u64>,
    /// With preempt: interrupt bulk chunks for urgent requests (default true).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub break_chunks: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_passes: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_creds: Option<PathBuf>,
    /// With `tls_creds`: the name the destination's certificate must carry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peer_name: Option<String>,
    /// Plain TCP to a non-loopback address, on purpose.
    #[serde(default)]
    pub insecure: bool,
    /// Milliseconds for each connect and handshake (default [`DEFAULT_CONNECT_TIMEOUT_MS`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub connect_timeout: Option<u64>,
}

/// How long a migration connect, TLS handshake or Hello exchange may take unless the
/// request says otherwise.
pub const DEFAULT_CONNECT_TIMEOUT_MS: u64 = 10_000;

/// `migrate-switchover`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MigrateSwitchoverParams {
    pub name: String,
    /// Absent: the mode the migration was started with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub postcopy: Option<bool>,
}

/// `migrate-postcopy`, `migrate-status`, `migrate-cancel`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NameParams {
    pub name: String,
}

/// `migrate-recover`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct MigrateRecoverParams {
    pub name: String,
    /// The connections are bounded by the connect timeout the migration was started with.
    pub to: String,
}

/// `upgrade`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct UpgradeParams {
    /// The program to run as the successor (default: the daemon's own program file, as it
    /// is now on disk, e.g. a new version a package put there).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub binary: Option<PathBuf>,
}

/// A request the daemon understands, its params checked.
#[derive(Debug, Clone, PartialEq)]
pub enum Request {
    DiskAdd(DiskConfig),
    DiskRemove(DiskRemoveParams),
    DiskResize(DiskResizeParams),
    DiskList(NoParams),
    Stats(StatsParams),
    KeyAdd(KeyAddParams),
    KeyRemove(KeyRemoveParams),
    MigrateIncoming(MigrateIncomingParams),
    MigrateStart(MigrateStartParams),
    MigrateSwitchover(MigrateSwitchoverParams),
    MigratePostcopy(NameParams),
    MigrateStatus(NameParams),
    MigrateCancel(NameParams),
    MigrateRecover(MigrateRecoverParams),
    ReencryptStart(super::ReencryptStartParams),
    ReencryptStatus(NameParams),
    ReencryptPause(NameParams),
    CheckpointAdd(super::CheckpointParams),
    CheckpointList(super::CheckpointListParams),
    CheckpointRemove(super::CheckpointParams),
    BackupStart(super::BackupStartParams),
    BackupEnd(super::BackupEndParams),
    Upgrade(UpgradeParams),
}

impl Request {
    /// Checks `params` of `method` (absent params are `{}`). An unknown method is
    /// "method not found"; params of the wrong shape, unknown keys included, are "invalid
    /// params" naming the problem.
    pub fn parse(method: &str, params: Value) -> Result<Request, RpcError> {
        let params = if params.is_null() {
            Value::Object(Default::default())
        } else {
            params
        };
        Ok(match method {
            "disk-add" => Request::DiskAdd(from(params)?),
            "disk-remove" => Request::DiskRemove(from(params)?),
            "disk-resize" => Request::DiskResize(from(params)?),
            "disk-list" => Request::DiskList(from(params)?),
            "stats" => Request::Stats(from(params)?),
            "key-add" => Request::KeyAdd(from(params)?),
            "key-remove" => Request::KeyRemove(from(params)?),
            "migrate-incoming" => Request::MigrateIncoming(from(params)?),
            "migrate-start" => Request::MigrateStart(from(params)?),
            "migrate-switchover" => Request::MigrateSwitchover(from(params)?),
            "migrate-postcopy" => Request::MigratePostcopy(from(params)?),
            "migrate-status" => Request::MigrateStatus(from(params)?),
            "migrate-cancel" => Request::MigrateCancel(from(params)?),
            "migrate-recover" => Request::MigrateRecover(from(params)?),
            "reencrypt-start" => Request::ReencryptStart(from(params)?),
            "reencrypt-status" => Request::ReencryptStatus(from(params)?),
            "reencrypt-pause" => Request::ReencryptPause(from(params)?),
            "checkpoint-add" => Request::CheckpointAdd(from(params)?),
            "checkpoint-list" => Request::CheckpointList(from(params)?),
            "checkpoint-remove" => Request::CheckpointRemove(from(params)?),
            "backup-start" => Request::BackupStart(from(params)?),
            "backup-end" => Request::BackupEnd(from(params)?),
            "upgrade" => Request::Upgrade(from(params)?),
            other => return Err(RpcError::method_not_found(other)),
        })
    }

    pub fn method(&self) -> &'static str {
        match self {
            Request::DiskAdd(_) => "disk-add",
            Request::DiskRemove(_) => "disk-remove",
            Request::DiskResize(_) => "disk-resize",
            Request::DiskList(_) => "disk-list",
            Request::Stats(_) => "stats",
            Request::KeyAdd(_) => "key-add",
            Request::KeyRemove(_) => "key-remove",
            Request::MigrateIncoming(_) => "migrate-incoming",
            Request::MigrateStart(_) => "migrate-start",
            Request::MigrateSwitchover(_) => "migrate-switchover",
            Request::MigratePostcopy(_) => "migrate-postcopy",
            Request::MigrateStatus(_) => "migrate-status",
            Request::MigrateCancel(_) => "migrate-cancel",
            Request::MigrateRecover(_) => "migrate-recover",
            Request::ReencryptStart(_) => "reencrypt-start",
            Request::ReencryptStatus(_) => "reencrypt-status",
            Request::ReencryptPause(_) => "reencrypt-pause",
            Request::CheckpointAdd(_) => "checkpoint-add",
            Request::CheckpointList(_) => "checkpoint-list",
            Request::CheckpointRemove(_) => "checkpoint-remove",
            Request::BackupStart(_) => "backup-start",
            Request::BackupEnd(_) => "backup-end",
            Request::Upgrade(_) => "upgrade",
        }
    }
}

fn from<T: DeserializeOwned>(params: Value) -> Result<T, RpcError> {
    serde_json::from_value(params).map_err(|e| RpcError::invalid_params(e.to_string()))
}
