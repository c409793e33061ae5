//! `cryptblk serve`: export one image as a vhost-user-blk socket until SIGTERM/SIGINT.
use crate::args::{Cli, ServeArgs};
use crate::exit::UsageError;
use crate::options::crypto_pool;
use crate::secrets::read_passphrase;
use anyhow::{Context, Result};
use cryptblk_block::{BlockDevice, Format, OpenOptions, RawFile};
use cryptblk_vhost_user_blk::{ServeOptions, Server, MAX_QUEUES, MAX_QUEUE_SIZE};
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
default: the holes show anyone with the image which blocks are unused.";

pub fn run(cli: &Cli, a: &ServeArgs) -> Result<()> {
    if a.num_queues == 0 || a.num_queues > MAX_QUEUES {
        return Err(UsageError(format!(
            "--num-queues {}: use 1 to {MAX_QUEUES}",
            a.num_queues
        ))
        .into());
    }
    if !a.queue_size.is_power_of_two() || a.queue_size > MAX_QUEUE_SIZE {
        return Err(UsageError(format!(
            "--queue-size {}: use a power of two up to {MAX_QUEUE_SIZE}",
            a.queue_size
        ))
        .into());
    }
    let path = &a.image;
    let format = cryptblk_block::probe_format(path)
        .with_context(|| format!("probing {}", path.display()))?;
    let (device, serial): (Arc<dyn BlockDevice>, String) = match format {
        Format::Luks => {
            let passphrase = read_passphrase(a.key_file.as_deref(), "Enter passphrase: ")?;
            let pool = crypto_pool(cli)?;
            let volume = cryptblk_block::open_luks_volume(
                path,
                &passphrase,
                &cryptblk_block::VolumeOptions {
                    writable: !a.readonly,
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
            if a.key_file.is_some() {
                return Err(UsageError(format!(
                    "--key-file given, but {} is raw, not LUKS",
                    path.display()
                ))
                .into());
            }
            let raw = RawFile::open(
                path,
                OpenOptions {
                    writable: !a.readonly,
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

    let server = Server::bind(
        &a.socket,
        device,
        ServeOptions {
            num_queues: a.num_queues,
            queue_size: a.queue_size,
            read_only: a.readonly,
            serial,
            discard: a.discard,
        },
    )?;
    let stop = server.stop_handle();
    let mut signals = signal_hook::iterator::Signals::new([
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGINT,
    ])
    .context("installing signal handlers")?;
    let signal_handle = signals.handle();
    let signal_thread = std::thread::spawn(move || {
        if let Some(sig) = signals.forever().next() {
            tracing::info!("signal {sig}: stopping");
            stop.stop();
        }
    });
    eprintln!(
        "cryptblk: serving {} ({}) on {}",
        path.display(),
        format.name(),
        a.socket.display()
    );
    let result = server.run();
    signal_handle.close();
    let _ = signal_thread.join();
    result.with_context(|| format!("serving {}", path.display()))
}
