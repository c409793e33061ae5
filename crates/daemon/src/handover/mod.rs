//! An upgrade without key derivation: the running daemon (the predecessor) hands every disk,
//! listening socket and volume key to a new daemon process (the successor, usually a new
//! version of the program) and exits. `cryptblk ctl upgrade` asks for it; under systemd the
//! unit's `ExecReload=` does (`systemctl reload cryptblk`).
//!
//! The sequence (messages on a datagram socket pair, `channel`):
//! 1. The predecessor refuses mutating control requests from now on (`upgrading`), pauses
//!    online re-encryptions (their header must not move while the successor reads it), and
//!    refuses the upgrade while a migration or a `disk-add` is under way.
//! 2. It starts the successor: its own command line (`serve ...`) plus `--take-over-fd N`,
//!    the channel's other end. Log output goes where the predecessor's went.
//! 3. It sends `Hello` (the protocol `VERSION`), one `Disk` per disk (its configuration, the
//!    vhost-user socket's listener and file identity, the open image file whose lock then
//!    never lapses, the volume keys with their digests' fingerprints as the secret part),
//!    `Servers` (the NBD, control and metrics listeners), `EndOfState`.
//! 4. The successor opens every image with the keys (`Unlocker::Keys`: no KDF; a key that no
//!    longer matches its header falls back to the passphrase) and answers `Ready`, or `Failed`
//!    with the reason: then the predecessor goes on serving as if nothing happened, and the
//!    upgrade's answer says why.
//! 5. The predecessor releases the disks one by one: the vhost-user connection drains (every
//!    request taken is answered and signalled) and closes, the image is flushed; `Released`
//!    tells the successor, which serves that disk on the same listening socket at once. QEMU
//!    reconnects (`reconnect=` on its chardev) and resubmits what the inflight region holds:
//!    live vhost-user connections do not move, since their state (memory table, rings,
//!    inflight region) lives in QEMU and is re-sent at each connection. An RBD image is opened
//!    by the successor only then (its exclusive lock has a single owner).
//! 6. The predecessor stops its NBD (clients reconnect), control and metrics servers without
//!    removing their socket files, tells systemd the new main PID, and sends `Done`; the
//!    successor serves them and answers `Serving`; the predecessor answers the upgrade request
//!    and exits.
//!
//! Not carried over: a migration under way (refused), a running re-encryption (paused; the
//! successor serves it and `reencrypt-start` continues it, as after a restart), NBD client
//! connections (they reconnect).

mod channel;
mod predecessor;
mod successor;

pub use successor::{take_over, InheritedServers};

use cryptblk_control::api::DiskConfig;
use serde::{Deserialize, Serialize};
use std::ffi::OsString;
use std::path::PathBuf;

/// The hand-over protocol's version: a successor that does not know the predecessor's
/// version refuses the hand-over (the predecessor serves on).
pub const VERSION: u32 = 1;

/// The command-line option a successor is started with.
pub const TAKE_OVER_OPTION: &str = "--take-over-fd";

/// One message on the hand-over channel.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "msg", rename_all = "kebab-case", deny_unknown_fields)]
enum Message {
    Hello { version: u32, pid: u32 },
    Disk(Box<DiskState>),
    Servers(ServerState),
    EndOfState {},
    Ready { without_kdf: usize },
    Failed { error: String },
    Released { name: String },
    Done {},
    Serving { pid: u32 },
}

/// A disk as handed over; its descriptors follow in this order: the listener (if
/// `socket_file`), the image file (if `image_file`). The keys are the message's secret.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
struct DiskState {
    config: DiskConfig,
    /// The vhost-user socket file's device and inode.
    socket_file: Option<(u64, u64)>,
    image_file: bool,
    /// The LUKS UUID of the keys in the secret part (none for a raw image).
    uuid: Option<String>,
}

/// The daemon's listeners; descriptors in this order, for those present.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
struct ServerState {
    nbd: Option<SocketState>,
    control: Option<SocketState>,
    metrics: Option<SocketState>,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
struct SocketState {
    /// `unix:PATH` or `tcp:HOST:PORT`.
    address: String,
    /// A Unix socket file's device and inode.
    file: Option<(u64, u64)>,
}

/// What an upgrade needs of the running process: how to start a successor, and its servers
/// (registered by the serve loop once they run).
pub struct Process {
    /// The program file the daemon was started from (resolved at start).
    pub program: PathBuf,
    /// Its arguments after the program name, without any `--take-over-fd`.
    pub args: Vec<OsString>,
    pub nbd: Option<(cryptblk_net::ListeningSocket, cryptblk_nbd::StopHandle)>,
    pub control: Option<ControlSocket>,
    pub metrics: Option<(cryptblk_net::ListeningSocket, crate::metrics::MetricsStop)>,
    /// Where to send `Event::HandedOver` once the successor serves.
    pub events: crossbeam_channel::Sender<crate::Event>,
}

/// The control socket's listener as the upgrade hands it over.
pub struct ControlSocket {
    pub listener: std::os::fd::OwnedFd,
    pub path: PathBuf,
    pub file: cryptblk_net::unix_socket::FileId,
    pub stop: cryptblk_control::StopHandle,
}

/// The arguments of this process (after the program name) without a `--take-over-fd N` it
/// may have been started with, as a successor repeats them.
pub fn restart_args(args: impl IntoIterator<Item = OsString>) -> Vec<OsString> {
    let mut out = Vec::new();
    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        if arg == TAKE_OVER_OPTION {
            args.next();
            continue;
        }
        if arg
            .to_str()
            .is_some_and(|a| a.starts_with(&format!("{TAKE_OVER_OPTION}=")))
        {
            continue;
        }
        out.push(arg);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_successor_repeats_the_command_line_without_the_take_over_option() {
        let args = [
            "serve",
            "--config",
            "a.toml",
            "--take-over-fd",
            "5",
            "--take-over-fd=7",
            "-v",
        ];
        let kept = restart_args(args.iter().map(OsString::from));
        assert_eq!(kept, ["serve", "--config", "a.toml", "-v"]);
    }

    #[test]
    fn messages_reject_unknown_fields_and_kinds() {
        assert!(matches!(
            serde_json::from_str::<Message>(r#"{"msg":"done"}"#),
            Ok(Message::Done {})
        ));
        assert!(serde_json::from_str::<Message>(r#"{"msg":"done","x":1}"#).is_err());
        assert!(serde_json::from_str::<Message>(r#"{"msg":"explode"}"#).is_err());
        let hello = serde_json::to_string(&Message::Hello {
            version: VERSION,
            pid: 7,
        })
        .unwrap();
        assert_eq!(hello, r#"{"msg":"hello","version":1,"pid":7}"#);
    }
}
