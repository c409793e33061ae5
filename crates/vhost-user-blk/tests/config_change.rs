//! A resized disk is announced to the frontend: `StopHandle::notify_config_change` sends
//! VHOST_USER_BACKEND_CONFIG_CHANGE_MSG on the backend request channel the frontend gave
//! (SET_BACKEND_REQ_FD), waits for the frontend's REPLY_ACK, and GET_CONFIG then reports the
//! new capacity. The frontend end of the channel is read and answered here byte by byte, as
//! QEMU's `vhost-user.c` does.
use cryptblk_testutil::vhost_user as common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::Arc;

use common::{Daemon, Guest};
use cryptblk_block::{BlockDevice, OpenOptions, RawFile};
use cryptblk_vhost_user_blk::ServeOptions;
use vhost::vhost_user::VhostUserFrontend;

const MIB: u64 = 1 << 20;
/// VHOST_USER_BACKEND_CONFIG_CHANGE_MSG.
const CONFIG_CHANGE_MSG: u32 = 2;
/// Header flags: version 1, reply, need reply.
const VERSION_1: u32 = 0x1;
const REPLY: u32 = 0x4;
const NEED_REPLY: u32 = 0x8;

fn capacity_sectors(guest: &mut Guest) -> u64 {
    u64::from_le_bytes(guest.config(0, 8).try_into().unwrap())
}

#[test]
fn a_grown_disk_is_announced_on_the_backend_channel() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("disk.raw");
    std::fs::File::create(&path)
        .unwrap()
        .set_len(8 * MIB)
        .unwrap();
    let file = Arc::new(
        RawFile::open(
            &path,
            OpenOptions {
                writable: true,
                lock: true,
            },
        )
        .unwrap(),
    );
    let device: Arc<dyn BlockDevice> = file.clone();
    let daemon = Daemon::start(
        device,
        ServeOptions {
            num_queues: 1,
            queue_size: 256,
            ..Default::default()
        },
    );
    let mut guest = Guest::connect(&daemon.socket, 1, 256);
    let handle = daemon.stop_handle().clone();
    assert_eq!(capacity_sectors(&mut guest), 8 * MIB / 512);
    // No backend channel yet: nobody to tell.
    assert!(!handle.notify_config_change().unwrap());

    let (mut ours, theirs) = UnixStream::pair().unwrap();
    ours.set_read_timeout(Some(std::time::Duration::from_secs(20)))
        .unwrap();
    guest.frontend.set_backend_request_fd(&theirs).unwrap();
    // The frontend does not wait for SET_BACKEND_REQ_FD to be acknowledged; a request it
    // waits for, answered in order after it, makes sure the channel is in place.
    assert_eq!(capacity_sectors(&mut guest), 8 * MIB / 512);
    file.set_len(12 * MIB).unwrap();
    let notify = std::thread::spawn(move || handle.notify_config_change());

    // The message: CONFIG_CHANGE_MSG, no body, asking for a reply (REPLY_ACK negotiated).
    let mut header = [0u8; 12];
    if let Err(e) = ours.read_exact(&mut header) {
        panic!(
            "no message ({e}); the notification returned {:?}",
            notify.join()
        );
    }
    let word = |i: usize| u32::from_le_bytes(header[i * 4..i * 4 + 4].try_into().unwrap());
    assert_eq!(word(0), CONFIG_CHANGE_MSG);
    assert_eq!(word(1), VERSION_1 | NEED_REPLY);
    assert_eq!(word(2), 0, "CONFIG_CHANGE_MSG has no body");
    // The frontend reads the config again before it answers.
    assert_eq!(capacity_sectors(&mut guest), 12 * MIB / 512);
    let mut reply = Vec::new();
    reply.extend_from_slice(&CONFIG_CHANGE_MSG.to_le_bytes());
    reply.extend_from_slice(&(VERSION_1 | REPLY).to_le_bytes());
    reply.extend_from_slice(&8u32.to_le_bytes());
    reply.extend_from_slice(&0u64.to_le_bytes());
    ours.write_all(&reply).unwrap();
    assert!(notify.join().unwrap().unwrap(), "the frontend was told");

    // A frontend that answers with a failure: the error reaches the caller.
    let handle = daemon.stop_handle().clone();
    let notify = std::thread::spawn(move || handle.notify_config_change());
    ours.read_exact(&mut header).unwrap();
    let mut failed = reply.clone();
    failed[12..].copy_from_slice(&1u64.to_le_bytes());
    ours.write_all(&failed).unwrap();
    assert!(notify.join().unwrap().is_err());
    drop(guest);
    daemon.stop();
}
