//! The running daemon's side of an upgrade (`ctl upgrade`): start the successor, hand it the
//! state, release the disks one by one, then step down. See the module above for the order.
use super::channel::{Channel, Received};
use super::{ControlSocket, DiskState, Message, Process, ServerState, SocketState, VERSION};
use crate::disk::AttachedDisk;
use crate::error::{chain, Context, Error, Result};
use crate::registry::Daemon;
use cryptblk_control::api::{ErrorKind, UpgradeParams, Upgraded};
use cryptblk_migration::Phase;
use rustix::process::{getrlimit, Resource};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::Ordering;
use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

/// How long the successor may take to open every disk (keys handed over: milliseconds per
/// disk; a stale key falls back to a KDF of seconds).
const READY_WAIT: Duration = Duration::from_secs(300);
/// How long it may take to serve the sockets once they are released.
const SERVING_WAIT: Duration = Duration::from_secs(60);

impl Daemon {
    /// Hands everything to a new daemon process (started and given the servers as `process`
    /// says, which the serve loop registers once they run: `None` before) and, once it serves,
    /// tells the serve loop to exit (`Event::HandedOver`). On any failure before the disks are
    /// released, this daemon serves on, unchanged, and the error says why.
    pub(crate) fn upgrade(
        self: &Arc<Self>,
        params: &UpgradeParams,
        process: Option<&Process>,
    ) -> Result<Upgraded> {
        let started = Instant::now();
        if self.begin_upgrade() {
            return Err(Error::busy("an upgrade is already under way"));
        }
        let result = self.try_upgrade(params, process, started);
        if result.is_err() {
            self.upgrading.store(false, Ordering::SeqCst);
        }
        result
    }

    fn try_upgrade(
        self: &Arc<Self>,
        params: &UpgradeParams,
        process: Option<&Process>,
        started: Instant,
    ) -> Result<Upgraded> {
        let Some(process) = process else {
            return Err(Error::new(
                ErrorKind::Unsupported,
                "this daemon was not started by `cryptblk serve`, so it cannot start a successor",
            ));
        };
        let disks = self.disks_to_hand_over()?;
        // No keyslot change, resize, migration or reencryption starts on a disk from here on
        // (the successor reads the headers as they are now): held until this process exits,
        // or dropped with the upgrade's failure.
        let header_changes = disks
            .iter()
            .map(|d| d.activity.begin_header_change(d.name()))
            .collect::<Result<Vec<_>>>()?;
        let program = params
            .binary
            .clone()
            .unwrap_or_else(|| process.program.clone());
        let (channel, theirs) = Channel::pair().context("creating the hand-over channel")?;
        let mut child = spawn_successor(&program, &process.args, theirs.as_fd())
            .with_context(|| format!("starting the new daemon {}", program.display()))?;
        drop(theirs);
        let pid = child.id();
        tracing::info!(pid, program = %program.display(), disks = disks.len(), "upgrade: handing over to a new daemon");
        let handed = send_state(&channel, &disks, process)
            .context("sending the state to the new daemon")
            .and_then(|()| await_ready(&channel, &mut child));
        let without_kdf = match handed {
            Ok(n) => n,
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(e.context(format!(
                    "upgrade to {} refused; this daemon serves on",
                    program.display()
                )));
            }
        };
        // From here on the successor owns the disks: what follows cannot be undone, so it
        // goes on whatever fails (each failure is logged).
        let mut longest_gap = Duration::ZERO;
        let count = disks.len();
        for disk in disks {
            let released = Instant::now();
            let name = disk.name().to_string();
            self.release(&disk);
            // The last reference here: an RBD image closes (its lock is free) before the
            // successor is told it may open it.
            drop(disk);
            if let Err(e) = channel.send(&Message::Released { name: name.clone() }, &[], &[]) {
                tracing::error!("upgrade: telling the new daemon disk \"{name}\" is free: {e}");
            }
            longest_gap = longest_gap.max(released.elapsed());
        }
        stop_servers(process);
        if let Some(manager) = crate::notify::ServiceManager::from_env() {
            manager.send(&format!(
                "MAINPID={pid}\nSTATUS=handed over to process {pid}"
            ));
        }
        if let Err(e) = channel.send(&Message::Done {}, &[], &[]) {
            tracing::error!("upgrade: telling the new daemon to start its servers: {e}");
        }
        let _ = channel.set_timeout(Some(SERVING_WAIT));
        match channel.recv() {
            Ok(Received {
                message: Message::Serving { .. },
                ..
            }) => {}
            Ok(other) => tracing::warn!("upgrade: the new daemon answered {:?}", other.message),
            Err(e) => tracing::error!("upgrade: no word from the new daemon that it serves: {e}"),
        }
        let _ = process.events.send(crate::Event::HandedOver);
        std::mem::forget(header_changes);
        // The successor is not ours to wait for: it lives on when this process exits.
        std::mem::forget(child);
        Ok(Upgraded {
            pid,
            disks: count,
            without_kdf,
            took_ms: started.elapsed().as_millis() as u64,
            longest_gap_ms: longest_gap.as_millis() as u64,
        })
    }

    /// Every attached disk, once nothing under way would be lost by handing it over: no disk
    /// being added, no migration in or out; running re-encryptions are paused here.
    fn disks_to_hand_over(&self) -> Result<Vec<Arc<AttachedDisk>>> {
        if let Some(name) = self.adding() {
            return Err(Error::busy(format!(
                "disk \"{name}\" is being added; retry the upgrade when disk-add has returned"
            )));
        }
        if let Some(name) = self
            .incoming
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .keys()
            .next()
        {
            return Err(Error::busy(format!(
                "disk \"{name}\" is being migrated in; upgrade when the migration is over"
            )));
        }
        let disks = self.attached_disks();
        for disk in &disks {
            let migrating = disk
                .activity
                .migration()
                .is_some_and(|m| !matches!(m.status().phase, Phase::Failed | Phase::Cancelled));
            if migrating || disk.activity.is_starting() || disk.image.tracker.is_fenced() {
                return Err(Error::busy(format!(
                    "disk \"{}\" is being (or was) migrated away; upgrade when the migration is \
                     over and the disk removed",
                    disk.name()
                )));
            }
        }
        for disk in &disks {
            if disk.reencryption.is_running() {
                tracing::info!(disk = %disk.name(), "upgrade: pausing the reencryption (reencrypt-start continues it on the new daemon)");
                disk.reencryption.stop();
            }
        }
        Ok(disks)
    }

    /// Stops serving `disk` here, leaving its socket file and cached keys for the successor.
    fn release(&self, disk: &AttachedDisk) {
        if let Some(vhost) = &disk.vhost {
            vhost.stop.hand_over();
        }
        if let Err(e) = self.detach_for_handover(disk.name()) {
            tracing::error!(disk = %disk.name(), "upgrade: releasing the disk: {}", chain(&e));
        }
    }
}

/// Starts `program` with `args` and `--take-over-fd N`, N being `channel` in the child.
fn spawn_successor(
    program: &std::path::Path,
    args: &[std::ffi::OsString],
    channel: BorrowedFd<'_>,
) -> std::io::Result<Child> {
    let fd = channel.as_raw_fd();
    let mut command = Command::new(program);
    command
        .args(args)
        .arg(super::TAKE_OVER_OPTION)
        .arg(fd.to_string())
        .stdin(Stdio::null());
    // SAFETY: the closure runs in the child between fork and exec and only makes system
    // calls (close_range(2), getrlimit(2) through rustix, fcntl(2)), all async-signal-safe, on descriptor
    // numbers; it allocates nothing and touches no lock.
    unsafe {
        command.pre_exec(move || {
            // Nothing but the channel crosses exec: what the successor needs (listeners,
            // image files) travels over the channel. Descriptors received from frontends
            // without close-on-exec (the vhost crate's guest-memory memfds and the rings'
            // eventfds) would otherwise live on in the successor, pinning a VM's RAM after
            // it shut down, and pile up with every upgrade.
            mark_close_on_exec_from(3);
            // The channel's end must survive exec in the child (it is close-on-exec here, so
            // no other child of this process inherits it).
            if libc::fcntl(fd, libc::F_SETFD, 0) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    command.spawn()
}

/// Sets close-on-exec on every descriptor from `first` up (between fork and exec: system
/// calls only). close_range(2) does it at once (Linux 5.11); older kernels get a loop up to
/// the descriptor limit.
fn mark_close_on_exec_from(first: libc::c_int) {
    // SAFETY: close_range with CLOSE_RANGE_CLOEXEC only changes descriptor flags.
    let done = unsafe {
        libc::syscall(
            libc::SYS_close_range,
            first as libc::c_uint,
            libc::c_uint::MAX,
            libc::CLOSE_RANGE_CLOEXEC,
        )
    } == 0;
    if done {
        return;
    }
    // No limit (RLIM_INFINITY) counts as the cap.
    let last = getrlimit(Resource::Nofile)
        .current
        .unwrap_or(u64::MAX)
        .min(1 << 20) as libc::c_int;
    for fd in first..last {
        // SAFETY: F_SETFD on a number that may not be open fails with EBADF and changes
        // nothing.
        unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
    }
}

fn file_parts(id: cryptblk_net::unix_socket::FileId) -> (u64, u64) {
    id.parts()
}

/// `Hello`, each disk, the servers, `EndOfState`.
fn send_state(
    channel: &Channel,
    disks: &[Arc<AttachedDisk>],
    process: &Process,
) -> std::io::Result<()> {
    channel.send(
        &Message::Hello {
            version: VERSION,
            pid: std::process::id(),
        },
        &[],
        &[],
    )?;
    for disk in disks {
        let mut fds: Vec<BorrowedFd<'_>> = Vec::new();
        let socket_file = disk.vhost.as_ref().map(|v| {
            let (listener, file) = v.served.listener();
            fds.push(listener);
            file_parts(file)
        });
        let image = disk.image.container.locked_file();
        if let Some(file) = image {
            fds.push(file.as_fd());
        }
        let keys = disk.image.volume_keys();
        let secret = keys
            .as_ref()
            .map(|k| crate::key_cache::encode(&k.keys))
            .unwrap_or_default();
        let state = DiskState {
            config: disk.config.clone(),
            socket_file,
            image_file: image.is_some(),
            uuid: keys.map(|k| k.uuid),
        };
        channel.send(&Message::Disk(Box::new(state)), &secret, &fds)?;
    }
    let mut servers = ServerState::default();
    let mut fds: Vec<BorrowedFd<'_>> = Vec::new();
    if let Some((socket, _)) = &process.nbd {
        servers.nbd = Some(socket_state(socket));
        fds.push(socket.fd.as_fd());
    }
    if let Some(ControlSocket {
        listener,
        path,
        file,
        ..
    }) = &process.control
    {
        servers.control = Some(SocketState {
            address: format!("unix:{}", path.display()),
            file: Some(file.parts()),
        });
        fds.push(listener.as_fd());
    }
    if let Some((socket, _)) = &process.metrics {
        servers.metrics = Some(socket_state(socket));
        fds.push(socket.fd.as_fd());
    }
    channel.send(&Message::Servers(servers), &[], &fds)?;
    channel.send(&Message::EndOfState {}, &[], &[])
}

fn socket_state(socket: &cryptblk_net::ListeningSocket) -> SocketState {
    SocketState {
        address: socket.address.to_string(),
        file: socket.file.map(|f| f.parts()),
    }
}

/// The successor's `Ready` (how many disks it opened without a KDF), or why not.
fn await_ready(channel: &Channel, child: &mut Child) -> Result<usize> {
    channel
        .set_timeout(Some(READY_WAIT))
        .context("setting a timeout")?;
    match channel.recv() {
        Ok(Received {
            message: Message::Ready { without_kdf },
            ..
        }) => Ok(without_kdf),
        Ok(Received {
            message: Message::Failed { error },
            ..
        }) => Err(Error::new(
            ErrorKind::Other,
            format!("the new daemon: {error}"),
        )),
        Ok(other) => Err(Error::new(
            ErrorKind::Other,
            format!(
                "the new daemon answered {:?} instead of ready",
                other.message
            ),
        )),
        Err(e) => {
            let status = child.try_wait().ok().flatten();
            Err(Error::new(
                ErrorKind::Other,
                match status {
                    Some(status) => format!("the new daemon exited ({status}) before it was ready"),
                    None => format!("the new daemon did not get ready: {e}"),
                },
            ))
        }
    }
}

/// Stops the NBD, control and metrics servers without removing their socket files (the
/// successor listens on the same sockets).
fn stop_servers(process: &Process) {
    if let Some((_, stop)) = &process.nbd {
        stop.hand_over();
        stop.stop();
    }
    if let Some(control) = &process.control {
        control.stop.hand_over();
    }
    if let Some((_, stop)) = &process.metrics {
        stop.hand_over();
    }
}
