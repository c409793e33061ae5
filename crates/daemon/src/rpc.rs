//! The control socket's methods: each request's params are checked by their type
//! (`cryptblk_control::api`), paths must be absolute (the daemon's working directory is not the
//! client's), and every failure becomes an error object whose code is its kind's.
use crate::config::{absolute, require_absolute_paths, validate};
use crate::error::{chain, Error, Result};
use crate::handover::Process;
use crate::key_file::Passphrase;
use crate::key_source::read_key_source;
use crate::migrate::Cancelled;
use crate::registry::Daemon;
use cryptblk_control::api::{
    key_source, DiskRemoved, ErrorKind, KeyAdded, KeyParams, KeyRemoved, KeySource, Request,
};
use cryptblk_control::{Handler, PassedFds, RpcError};
use serde::Serialize;
use serde_json::Value;
use std::sync::{Arc, OnceLock};

pub struct ControlHandler {
    pub daemon: Arc<Daemon>,
    /// The running process as `upgrade` hands it over, set by the serve loop once its servers
    /// (this one among them) run.
    pub process: Arc<OnceLock<Process>>,
}

impl Handler for ControlHandler {
    fn call(&self, method: &str, params: Value) -> Result<Value, RpcError> {
        self.call_with_fds(method, params, &mut PassedFds::default())
    }

    fn call_with_fds(
        &self,
        method: &str,
        params: Value,
        fds: &mut PassedFds,
    ) -> Result<Value, RpcError> {
        let request = Request::parse(method, params)?;
        let name = request_disk(&request).map(str::to_string);
        let result = self.dispatch(request, fds);
        if let Err(e) = &result {
            tracing::info!(disk = name.as_deref(), method, "refused: {}", chain(e));
        }
        result.map_err(|e| to_rpc(&e))
    }
}

impl ControlHandler {
    fn dispatch(&self, request: Request, fds: &mut PassedFds) -> Result<Value> {
        let d = &self.daemon;
        if changes_disks(&request) {
            d.refuse_while_upgrading()?;
        }
        match request {
            Request::DiskAdd(mut config) => {
                require_absolute_paths(&config).map_err(|e| Error::invalid_params(e.0))?;
                validate(&config).map_err(|e| Error::invalid_params(e.0))?;
                if config.nbd_export == Some(true) && !d.has_nbd() {
                    return Err(Error::invalid_params(
                        "nbd-export is set but this daemon was started without --nbd",
                    ));
                }
                // A passphrase passed by descriptor or as a secret is read now and stands in
                // for a key file.
                let passphrase = optional_passphrase(config.key_params(), fds, d)?;
                config.key_fd = None;
                let secret = config.key_secret.is_some();
                let prepared = d
                    .prepare(config, crate::Secret::Passphrase(passphrase))
                    .map_err(|e| {
                        // CBC cannot tell a wrong IV: it shows as a wrong passphrase.
                        if secret && e.kind() == ErrorKind::WrongPassphrase {
                            e.context(
                                "unlocking with key-secret (decrypted; is key-secret-iv right?)",
                            )
                        } else {
                            e
                        }
                    })?;
                json(d.publish(prepared)?)
            }
            Request::DiskRemove(p) => {
                d.remove_disk(&p.name, p.force)?;
                json(DiskRemoved { removed: p.name })
            }
            Request::DiskResize(p) => json(d.resize_disk(&p)?),
            Request::DiskList(_) => json(d.list()),
            Request::Stats(p) => json(d.stats(p.name.as_deref())?),
            Request::KeyAdd(p) => {
                for path in [&p.key_file, &p.new_key_file].into_iter().flatten() {
                    check_absolute(path)?;
                }
                let keyslot = d.key_add(&p, fds)?;
                json(KeyAdded {
                    name: p.name,
                    keyslot,
                })
            }
            Request::KeyRemove(p) => {
                if let Some(path) = &p.key_file {
                    check_absolute(path)?;
                }
                let removed_keyslot = d.key_remove(&p, fds)?;
                json(KeyRemoved {
                    name: p.name,
                    removed_keyslot,
                })
            }
            Request::MigrateIncoming(mut p) => {
                for path in [
                    // An rbd: image name is not a path.
                    p.image.rbd().is_none().then(|| p.image.path()),
                    p.key_file.as_deref(),
                    p.vhost_user_blk.as_deref(),
                    p.tls_creds.as_deref(),
                ]
                .into_iter()
                .flatten()
                {
                    check_absolute(path)?;
                }
                if p.nbd_export == Some(true) && !d.has_nbd() {
                    return Err(Error::invalid_params(
                        "nbd-export is set but this daemon was started without --nbd",
                    ));
                }
                let passphrase = optional_passphrase(p.key_params(), fds, d)?;
                p.key_fd = None;
                json(d.migrate_incoming(p, passphrase)?)
            }
            Request::MigrateStart(p) => {
                if let Some(dir) = &p.tls_creds {
                    check_absolute(dir)?;
                }
                json(d.migrate_start(&p)?)
            }
            Request::MigrateSwitchover(p) => json(d.migrate_switchover(&p.name, p.postcopy)?),
            Request::MigratePostcopy(p) => json(d.migrate_switchover(&p.name, Some(true))?),
            Request::MigrateStatus(p) => json(d.migrate_status(&p.name)?),
            Request::MigrateCancel(p) => match d.migrate_cancel(&p.name)? {
                Cancelled::Requested(c) => json(c),
                Cancelled::Outgoing(s) => json(s),
            },
            Request::MigrateRecover(p) => json(d.migrate_recover(&p.name, &p.to)?),
            Request::ReencryptStart(p) => {
                if let Some(path) = &p.key_file {
                    check_absolute(path)?;
                }
                json(d.reencrypt_start(&p, fds)?)
            }
            Request::ReencryptStatus(p) => json(d.reencrypt_status(&p.name)?),
            Request::ReencryptPause(p) => json(d.reencrypt_pause(&p.name)?),
            Request::CheckpointAdd(p) => json(d.checkpoint_add(&p)?),
            Request::CheckpointList(p) => json(d.checkpoint_list(&p)?),
            Request::CheckpointRemove(p) => json(d.checkpoint_remove(&p)?),
            Request::BackupStart(p) => json(d.backup_start(&p)?),
            Request::BackupEnd(p) => json(d.backup_end(&p)?),
            Request::Upgrade(p) => {
                if let Some(path) = &p.binary {
                    check_absolute(path)?;
                }
                json(d.upgrade(&p, self.process.get())?)
            }
        }
    }
}

/// Whether a request changes what the daemon serves (refused while an upgrade hands the
/// disks over); reading requests are answered throughout.
fn changes_disks(r: &Request) -> bool {
    !matches!(
        r,
        Request::DiskList(_)
            | Request::Stats(_)
            | Request::MigrateStatus(_)
            | Request::ReencryptStatus(_)
            | Request::CheckpointList(_)
            | Request::Upgrade(_)
    )
}

/// The disk a request concerns, for its log line.
fn request_disk(r: &Request) -> Option<&str> {
    match r {
        Request::DiskAdd(c) => Some(&c.name),
        Request::DiskRemove(p) => Some(&p.name),
        Request::DiskResize(p) => Some(&p.name),
        Request::DiskList(_) => None,
        Request::Stats(p) => p.name.as_deref(),
        Request::KeyAdd(p) => Some(&p.name),
        Request::KeyRemove(p) => Some(&p.name),
        Request::MigrateIncoming(p) => Some(&p.name),
        Request::MigrateStart(p) => Some(&p.name),
        Request::MigrateSwitchover(p) => Some(&p.name),
        Request::MigratePostcopy(p) | Request::MigrateStatus(p) | Request::MigrateCancel(p) => {
            Some(&p.name)
        }
        Request::MigrateRecover(p) => Some(&p.name),
        Request::ReencryptStart(p) => Some(&p.name),
        Request::ReencryptStatus(p) | Request::ReencryptPause(p) => Some(&p.name),
        Request::CheckpointAdd(p) | Request::CheckpointRemove(p) => Some(&p.name),
        Request::CheckpointList(p) => Some(&p.name),
        Request::BackupStart(p) => Some(&p.name),
        Request::BackupEnd(p) => Some(&p.name),
        Request::Upgrade(_) => None,
    }
}

/// The passphrase passed by descriptor (`key-fd`) or as a secret (`key-secret`) when there is
/// one, read now so that a bad one fails the request at once (at most one source is given,
/// checked here); `None` leaves the key file (if any) to be read where the image is opened.
fn optional_passphrase(
    given: KeyParams<'_>,
    fds: &mut PassedFds,
    daemon: &Daemon,
) -> Result<Option<Passphrase>> {
    let source = key_source(given, "key", false).map_err(|e| Error::invalid_params(e.message))?;
    match source {
        Some(source @ (KeySource::Fd(_) | KeySource::Secret { .. })) => {
            read_key_source(source, "key", fds, daemon.master_key.as_ref()).map(Some)
        }
        Some(KeySource::File(_)) | None => Ok(None),
    }
}

fn check_absolute(path: &std::path::Path) -> Result<()> {
    absolute(path).map_err(|e| Error::invalid_params(e.0))
}

fn json(value: impl Serialize) -> Result<Value> {
    serde_json::to_value(value).map_err(|e| Error::caused("encoding the answer", e))
}

/// The error object of a failed request: the kind's code, the whole chain as the message.
fn to_rpc(e: &Error) -> RpcError {
    let code = e.kind().code();
    let message = chain(e);
    if code == cryptblk_control::INVALID_PARAMS {
        RpcError::invalid_params(message)
    } else {
        RpcError::application(code, message)
    }
}
