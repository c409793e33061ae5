//! The new daemon's side of an upgrade (`serve --take-over-fd N`): take the predecessor's
//! state, open every disk with the keys it sent, serve each disk as soon as it is released,
//! then the servers. See the module above for the order.
use super::channel::{Channel, Received, MAX_FDS};
use super::{DiskState, Message, ServerState, SocketState, VERSION};
use crate::error::{Context, Error, Result};
use crate::image::Secret;
use crate::registry::{Daemon, InheritedSocket, PreparedDisk};
use cryptblk_control::api::{DiskConfig, ErrorKind};
use cryptblk_net::unix_socket::FileId;
use cryptblk_net::{Address, Listener, ListeningSocket};
use std::collections::BTreeMap;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The servers' listening sockets the predecessor handed over.
#[derive(Default)]
pub struct InheritedServers {
    pub nbd: Option<Listener>,
    pub control: Option<(PathBuf, UnixListener, FileId)>,
    pub metrics: Option<Listener>,
}

/// The channel back to the predecessor, to say the servers run (`serving`).
pub struct Predecessor {
    channel: Channel,
}

impl Predecessor {
    /// Tells the predecessor this daemon serves everything: it may exit.
    pub fn serving(self) {
        let _ = self.channel.send(
            &Message::Serving {
                pid: std::process::id(),
            },
            &[],
            &[],
        );
    }
}

/// A disk received, opened or (an RBD image, whose lock the predecessor still holds) to be
/// opened once released.
enum HandedDisk {
    Opened(PreparedDisk),
    Later(DiskConfig, Option<Vec<cryptblk_luks::KnownKey>>),
}

/// Takes over from the predecessor on `fd`: every disk is served when this returns (those the
/// predecessor did not release before it went, too), and the servers' sockets are returned
/// for the caller to serve. A failure before `Ready` is reported to the predecessor, which
/// serves on.
pub fn take_over(daemon: &Arc<Daemon>, fd: OwnedFd) -> Result<(InheritedServers, Predecessor)> {
    let channel = Channel::from_fd(fd);
    let received = receive_state(daemon, &channel);
    let (mut disks, servers, without_kdf) = match received {
        Ok(state) => state,
        Err(e) => {
            let _ = channel.send(
                &Message::Failed {
                    error: crate::error::chain(&e),
                },
                &[],
                &[],
            );
            return Err(e.context("taking over from the running daemon"));
        }
    };
    channel
        .send(&Message::Ready { without_kdf }, &[], &[])
        .context("telling the running daemon this one is ready")?;
    tracing::info!(
        disks = disks.len(),
        without_kdf,
        "taken over: every disk is open; serving each as it is released"
    );
    let _ = channel.set_timeout(None);
    loop {
        match channel.recv() {
            Ok(Received {
                message: Message::Released { name },
                ..
            }) => match disks.remove(&name) {
                Some(disk) => publish(daemon, &name, disk),
                None => tracing::warn!(disk = %name, "released, but never handed over"),
            },
            Ok(Received {
                message: Message::Done {},
                ..
            }) => break,
            Ok(other) => tracing::warn!("hand-over: unexpected {:?}", other.message),
            Err(e) => {
                // The predecessor is gone (its sockets and locks with it): serve the rest.
                tracing::warn!("hand-over: the running daemon went away ({e}); serving every disk");
                break;
            }
        }
    }
    for (name, disk) in std::mem::take(&mut disks) {
        publish(daemon, &name, disk);
    }
    Ok((servers, Predecessor { channel }))
}

type State = (
    BTreeMap<String, (HandedDisk, Option<InheritedSocket>)>,
    InheritedServers,
    usize,
);

fn receive_state(daemon: &Arc<Daemon>, channel: &Channel) -> Result<State> {
    let recv = || channel.recv().context("reading the hand-over");
    match recv()?.message {
        Message::Hello { version, .. } if version == VERSION => {}
        Message::Hello { version, .. } => {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!("hand-over version {version} is not this program's ({VERSION}): restart the daemon instead"),
            ))
        }
        other => return Err(protocol(&other)),
    }
    let mut disks = BTreeMap::new();
    let mut servers = InheritedServers::default();
    let mut without_kdf = 0;
    loop {
        let Received {
            message,
            secret,
            fds,
        } = recv()?;
        match message {
            Message::Disk(state) => {
                let name = state.config.name.clone();
                let (disk, listener, keyless) = receive_disk(daemon, *state, &secret, fds)
                    .map_err(|e| e.context(format!("disk \"{name}\"")))?;
                without_kdf += usize::from(keyless);
                disks.insert(name, (disk, listener));
            }
            Message::Servers(state) => servers = receive_servers(state, fds)?,
            Message::EndOfState {} => return Ok((disks, servers, without_kdf)),
            other => return Err(protocol(&other)),
        }
    }
}

fn protocol(message: &Message) -> Error {
    Error::new(
        ErrorKind::Other,
        format!("hand-over: unexpected message {message:?}"),
    )
}

/// Opens a disk handed over (not an RBD image: later); returns it, its listener, and
/// whether it opened without a key derivation.
fn receive_disk(
    daemon: &Daemon,
    state: DiskState,
    secret: &[u8],
    fds: Vec<OwnedFd>,
) -> Result<(HandedDisk, Option<InheritedSocket>, bool)> {
    if fds.len() > MAX_FDS {
        return Err(Error::new(ErrorKind::Other, "too many descriptors"));
    }
    let mut fds = fds.into_iter();
    let mut next_fd = |what: &str| {
        fds.next()
            .ok_or_else(|| Error::new(ErrorKind::Other, format!("its {what} did not arrive")))
    };
    let listener = match (state.socket_file, &state.config.vhost_user_blk) {
        (Some((dev, ino)), Some(path)) => Some(InheritedSocket {
            listener: UnixListener::from(next_fd("vhost-user socket")?),
            path: path.clone(),
            file: FileId::from_parts(dev, ino),
        }),
        (None, None) => None,
        _ => {
            return Err(Error::new(
                ErrorKind::Other,
                "its vhost-user socket and configuration disagree",
            ))
        }
    };
    let image = if state.image_file {
        Some(std::fs::File::from(next_fd("image file")?))
    } else {
        None
    };
    let keys = match state.uuid {
        Some(_) => Some(
            crate::key_cache::decode(secret)
                .ok_or_else(|| Error::new(ErrorKind::Other, "its volume keys arrived malformed"))?,
        ),
        None => None,
    };
    if image.is_none() {
        // An RBD image: its lock is the predecessor's until it releases the disk.
        let keyless = keys.is_some();
        return Ok((HandedDisk::Later(state.config, keys), listener, keyless));
    }
    let secret = match keys {
        Some(keys) => Secret::Keys(keys),
        None => Secret::Passphrase(None),
    };
    let prepared = daemon.prepare_on(state.config, image, secret)?;
    let keyless = prepared.opened_without_kdf();
    Ok((HandedDisk::Opened(prepared), listener, keyless))
}

fn receive_servers(state: ServerState, fds: Vec<OwnedFd>) -> Result<InheritedServers> {
    let mut fds = fds.into_iter();
    let mut take = |socket: Option<SocketState>, what: &str| -> Result<Option<ListeningSocket>> {
        let Some(socket) = socket else {
            return Ok(None);
        };
        let fd = fds.next().ok_or_else(|| {
            Error::new(
                ErrorKind::Other,
                format!("the {what} socket did not arrive"),
            )
        })?;
        let address: Address = socket.address.parse().map_err(|e| {
            Error::new(
                ErrorKind::Other,
                format!("the {what} socket's address: {e}"),
            )
        })?;
        Ok(Some(ListeningSocket {
            fd,
            address,
            file: socket.file.map(|(dev, ino)| FileId::from_parts(dev, ino)),
        }))
    };
    let nbd = take(state.nbd, "NBD")?;
    let control = take(state.control, "control")?;
    let metrics = take(state.metrics, "metrics")?;
    let listener = |s: ListeningSocket, what: &str| {
        s.into_listener()
            .with_context(|| format!("the {what} socket handed over"))
    };
    Ok(InheritedServers {
        nbd: nbd.map(|s| listener(s, "NBD")).transpose()?,
        control: match control {
            Some(ListeningSocket {
                fd,
                address: Address::Unix(path),
                file: Some(file),
            }) => Some((path, UnixListener::from(fd), file)),
            Some(_) => {
                return Err(Error::new(
                    ErrorKind::Other,
                    "the control socket handed over is not a Unix socket",
                ))
            }
            None => None,
        },
        metrics: metrics.map(|s| listener(s, "metrics")).transpose()?,
    })
}

/// How long an RBD image released by the predecessor may still show its lock as held (the
/// predecessor's last reference to it may go a moment after it said the disk is free).
const RBD_LOCK_WAIT: Duration = Duration::from_secs(15);

/// Opens an RBD image the predecessor released, with the keys handed over, retrying while
/// its lock still looks held.
fn open_released_rbd(
    daemon: &Daemon,
    config: DiskConfig,
    keys: Option<Vec<cryptblk_luks::KnownKey>>,
) -> Result<PreparedDisk> {
    let deadline = Instant::now() + RBD_LOCK_WAIT;
    loop {
        let secret = match &keys {
            Some(keys) => Secret::Keys(
                keys.iter()
                    .map(cryptblk_luks::KnownKey::duplicate)
                    .collect(),
            ),
            None => Secret::Passphrase(None),
        };
        match daemon.prepare_on(config.clone(), None, secret) {
            Err(e) if e.kind() == ErrorKind::InUse && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(100));
            }
            other => return other,
        }
    }
}

/// Serves a released disk (an RBD image is opened now, with the keys handed over).
fn publish(daemon: &Daemon, name: &str, (disk, listener): (HandedDisk, Option<InheritedSocket>)) {
    let prepared = match disk {
        HandedDisk::Opened(prepared) => Ok(prepared),
        HandedDisk::Later(config, keys) => open_released_rbd(daemon, config, keys),
    };
    match prepared.and_then(|p| daemon.publish_on(p, listener)) {
        Ok(_) => tracing::info!(disk = %name, "serving (taken over)"),
        Err(e) => {
            tracing::error!(disk = %name, "cannot serve the disk handed over: {}", crate::error::chain(&e))
        }
    }
}
