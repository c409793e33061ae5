//! What a local process can do to a disk's socket: a frontend whose uid/gid the disk does not
//! allow is disconnected while the disk stays available to its own VM, and guest memory that
//! could shrink under the daemon (an unsealed memfd) is refused, dropping only that
//! connection.
use cryptblk_testutil::vhost_user as common;

use std::io::Read;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::Duration;

use common::{Daemon, Guest, S_OK};
use cryptblk_block::{BlockDevice, OpenOptions, RawFile};
use cryptblk_vhost_user_blk::{AllowedPeer, ServeOptions, SocketFile};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo};
use vm_memory::{Address, Bytes, GuestAddress, GuestMemoryBackend};

const MIB: u64 = 1 << 20;

fn raw_device(dir: &std::path::Path, name: &str) -> Arc<dyn BlockDevice> {
    let path = dir.join(name);
    std::fs::File::create(&path)
        .unwrap()
        .set_len(8 * MIB)
        .unwrap();
    Arc::new(
        RawFile::open(
            &path,
            OpenOptions {
                writable: true,
                lock: true,
            },
        )
        .unwrap(),
    )
}

/// One sector written and read back through `guest`.
fn round_trip(guest: &mut Guest, sector: u64, byte: u8) {
    assert_eq!(guest.write(0, sector, &[byte; 512]), S_OK);
    let (status, back) = guest.read(0, sector, 512);
    assert_eq!(status, S_OK);
    assert_eq!(back, vec![byte; 512]);
}

/// True once the daemon has closed `stream` (EOF or reset) within `limit`; a timeout means
/// it kept the connection.
fn closed_by_daemon(stream: &mut UnixStream, limit: Duration) -> bool {
    stream.set_read_timeout(Some(limit)).unwrap();
    let mut byte = [0u8; 1];
    match stream.read(&mut byte) {
        Ok(0) => true,
        Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
        Ok(_) => false,
    }
}

const CHILD: &str = "CRYPTBLK_PEER_TEST_SOCKET";

/// A peer the disk does not allow is cut off at once; the disk keeps waiting for (and then
/// serves) the allowed one. The refused peer runs as another user (a child of this test
/// binary that drops to uid/gid 65534 when run as root); the allowed one is this process.
#[test]
fn a_peer_the_disk_does_not_allow_is_disconnected() {
    if let Some(socket) = std::env::var_os(CHILD) {
        // SAFETY: getuid has no preconditions; setresgid/setresuid on this child only.
        unsafe {
            if libc::getuid() == 0 {
                assert_eq!(libc::setresgid(65534, 65534, 65534), 0);
                assert_eq!(libc::setresuid(65534, 65534, 65534), 0);
            }
        }
        let mut stream = UnixStream::connect(socket).unwrap();
        assert!(
            closed_by_daemon(&mut stream, Duration::from_secs(10)),
            "the daemon kept a connection from a peer it does not allow"
        );
        return;
    }
    // SAFETY: getuid/getgid have no preconditions.
    let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
    if uid != 0 {
        cryptblk_testutil::skip("connecting as another user needs root");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let opts = ServeOptions {
        // Anyone may open the socket: only the peer check keeps others out.
        socket: SocketFile::with_mode(0o666),
        allowed_peer: AllowedPeer {
            uid: Some(uid),
            gid: Some(gid),
        },
        ..Default::default()
    };
    let daemon = Daemon::start(raw_device(dir.path(), "a.raw"), opts);
    std::fs::set_permissions(
        daemon.dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    for _ in 0..2 {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "a_peer_the_disk_does_not_allow_is_disconnected",
                "--nocapture",
            ])
            .env(CHILD, &daemon.socket)
            .output()
            .unwrap();
        assert!(
            out.status.success() && String::from_utf8_lossy(&out.stdout).contains("1 passed"),
            "{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // The allowed peer still gets the disk.
    let mut guest = Guest::connect(&daemon.socket, 1, 256);
    round_trip(&mut guest, 3, 0x5a);
    drop(guest);
    daemon.stop();
}

/// An unsealed guest-memory memfd (QEMU's `seal=off`) could be truncated under the daemon
/// (SIGBUS on the next request): SET_MEM_TABLE refuses it and the connection ends, while
/// another disk of the same process keeps serving and the refused disk takes a sealed
/// frontend next.
#[test]
fn guest_memory_that_could_shrink_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let a = Daemon::start(raw_device(dir.path(), "a.raw"), ServeOptions::default());
    let b = Daemon::start(raw_device(dir.path(), "b.raw"), ServeOptions::default());
    let mut on_b = Guest::connect(&b.socket, 1, 256);
    round_trip(&mut on_b, 1, 0x11);

    let mut frontend = Frontend::connect(&a.socket, 1).unwrap();
    frontend.set_owner().unwrap();
    let features = frontend.get_features().unwrap();
    frontend.set_features(features).unwrap();
    let proto = frontend.get_protocol_features().unwrap();
    frontend.set_protocol_features(proto).unwrap();
    let mem = common::memfd_memory_sealed(false);
    let region = mem.find_region(GuestAddress(0)).unwrap();
    let info = VhostUserMemoryRegionInfo::from_guest_region(region).unwrap();
    // Without REPLY_ACK the message itself gets no answer: the refusal shows as the daemon
    // closing the connection, so the next request fails.
    let sent = frontend.set_mem_table(&[info]);
    let next = frontend.get_features();
    assert!(
        sent.is_err() || next.is_err(),
        "an unsealed memfd was accepted as guest memory"
    );
    drop(frontend);

    // The other disk never noticed; the refused one serves a sealed frontend.
    round_trip(&mut on_b, 2, 0x22);
    let mut on_a = Guest::connect(&a.socket, 1, 256);
    round_trip(&mut on_a, 1, 0x33);
    drop((on_a, on_b));
    a.stop();
    b.stop();
}

/// CPU time (ticks) the daemon's thread `name` has used so far.
fn thread_ticks(name: &str) -> u64 {
    let mut ticks = 0;
    for task in std::fs::read_dir("/proc/self/task").unwrap() {
        let dir = task.unwrap().path();
        let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
        if comm.trim() != name {
            continue;
        }
        let stat = std::fs::read_to_string(dir.join("stat")).unwrap_or_default();
        // Past the command name's closing parenthesis: utime and stime are fields 14 and 15.
        let fields: Vec<&str> = stat
            .rsplit_once(')')
            .unwrap()
            .1
            .split_whitespace()
            .collect();
        ticks += fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    }
    ticks
}

/// A guest that sets its available index far past the ring (more requests than the ring
/// holds, which the ring refuses to hand out) and kicks: the queue's worker must not spin on
/// it, and must still stop when its frontend asks (GET_VRING_BASE), as a migration does.
#[test]
fn an_available_index_past_the_ring_neither_spins_the_worker_nor_blocks_its_stop() {
    let dir = tempfile::tempdir().unwrap();
    let daemon = Daemon::start(raw_device(dir.path(), "a.raw"), ServeOptions::default());
    let mut guest = Guest::connect(&daemon.socket, 1, 256);
    assert!(guest.event_idx(), "the test needs EVENT_IDX");
    round_trip(&mut guest, 0, 0x5a);
    let idx = guest.avail_ring(0).unchecked_add(2);
    let current: u16 = guest.mem.read_obj(idx).unwrap();
    guest
        .mem
        .write_obj(current.wrapping_add(1000), idx)
        .unwrap();
    guest.kick(0);
    std::thread::sleep(Duration::from_millis(200));
    let before = thread_ticks("vu-queue-0");
    std::thread::sleep(Duration::from_millis(1000));
    let spent = thread_ticks("vu-queue-0") - before;
    // Spinning takes most of a core (about 100 ticks a second, at least half of that on
    // two busy cores); a waiting worker takes none.
    assert!(spent < 20, "the queue's worker used {spent} ticks in 1 s");
    let (done, stopped) = std::sync::mpsc::channel();
    let frontend = std::thread::spawn(move || {
        let base = guest.frontend.get_vring_base(0);
        let _ = done.send(());
        (base, guest)
    });
    stopped
        .recv_timeout(Duration::from_secs(20))
        .expect("GET_VRING_BASE got no answer: the worker did not stop");
    let (base, _guest) = frontend.join().unwrap();
    base.unwrap();
}
