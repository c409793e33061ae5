//! `ctl upgrade` hands a successor only what travels over the hand-over channel: a VM
//! connected at the upgrade leaves nothing of its own (guest-memory memfds, ring eventfds,
//! received without close-on-exec by the vhost crate) in the new process, which would pin
//! the VM's RAM after it shut down and pile up with every upgrade.

mod common;

use common::*;

#[test]
fn an_upgrade_leaves_no_frontend_descriptor_in_the_successor() {
    let t = TestDir::new();
    let image = t.raw("disk.raw", 16 * MIB);
    let mut daemon = t.serve().disk(&image).vhost_user().control().start();
    let mut guest = daemon.frontend(1, 64);
    assert_eq!(guest.read(0, 0, 4096).0, frontend::S_OK);
    let with_guest = daemon.open_fds();
    assert!(
        with_guest.iter().any(|l| l.contains("cryptblk-guest")),
        "the daemon should hold the frontend's guest memory: {with_guest:?}"
    );

    let answer = daemon.upgrade();
    assert_eq!(answer["disks"], 1, "{answer}");
    let successor = daemon.open_fds();
    assert!(
        !successor.iter().any(|l| l.contains("cryptblk-guest")),
        "the successor holds the old connection's guest memory: {successor:?}"
    );
    // The successor serves the disk to a frontend that connects again.
    drop(guest);
    let mut guest = daemon.frontend(1, 64);
    assert_eq!(guest.read(0, 0, 4096).0, frontend::S_OK);
    drop(guest);
    assert_eq!(daemon.terminate(), code::OK);
}
