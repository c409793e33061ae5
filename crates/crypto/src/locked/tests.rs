use super::*;

/// The `VmFlags:` of the mapping that holds `address`, from /proc/self/smaps. (Not the one
/// that starts there: the kernel merges a key's mapping with a neighbour of the same flags,
/// such as another test's key made at the same time.)
fn vm_flags(address: usize) -> Vec<String> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let holds = |line: &str| {
        let Some((range, _)) = line.split_once(' ') else {
            return false;
        };
        let Some((start, end)) = range.split_once('-') else {
            return false;
        };
        match (
            usize::from_str_radix(start, 16),
            usize::from_str_radix(end, 16),
        ) {
            (Ok(start), Ok(end)) => (start..end).contains(&address),
            _ => false,
        }
    };
    let mut lines = smaps.lines().skip_while(|l| !holds(l));
    assert!(
        lines.next().is_some(),
        "no mapping holds {address:x} in smaps"
    );
    let flags = lines
        .find_map(|l| l.strip_prefix("VmFlags:"))
        .expect("a VmFlags line");
    flags.split_whitespace().map(str::to_owned).collect()
}

#[test]
fn key_pages_are_kept_out_of_dumps_and_locked() {
    let mut key = LockedBytes::copy_of(&[0xa5; 64]);
    assert_eq!(key.as_slice(), &[0xa5; 64]);
    key.as_mut_slice()[0] = 1;
    assert_eq!(key.as_slice()[0], 1);
    assert_eq!(
        key.address() % rustix::param::page_size(),
        0,
        "not page-aligned"
    );
    let flags = vm_flags(key.address());
    assert!(flags.contains(&"dd".to_owned()), "not DONTDUMP: {flags:?}");
    // Root, or an unprivileged user within RLIMIT_MEMLOCK (8 MiB by default): locked.
    assert!(key.is_locked(), "mlock of one page refused");
    assert!(flags.contains(&"lo".to_owned()), "not locked: {flags:?}");
    // An empty key still gets a page (no zero-length mapping).
    assert!(LockedBytes::zeroed(0).as_slice().is_empty());
}

const CHILD: &str = "CRYPTBLK_LOCKED_BYTES_CHILD";

/// With RLIMIT_MEMLOCK at 0 and no CAP_IPC_LOCK, mlock is refused: the key still works,
/// unlocked, and still out of dumps. Run in a child process (the limit and the identity are
/// the process's), which re-runs this test.
#[test]
fn a_refused_lock_fails_soft() {
    if std::env::var_os(CHILD).is_some() {
        use rustix::process::{getuid, setrlimit, Resource, Rlimit};
        let zero = Rlimit {
            current: Some(0),
            maximum: Some(0),
        };
        setrlimit(Resource::Memlock, zero).unwrap();
        if getuid().is_root() {
            // Leaving uid 0 drops CAP_IPC_LOCK, which would ignore the limit.
            // SAFETY: setresgid/setresuid on this child process only.
            unsafe {
                assert_eq!(libc::setresgid(65534, 65534, 65534), 0);
                assert_eq!(libc::setresuid(65534, 65534, 65534), 0);
            }
        }
        let key = LockedBytes::copy_of(b"still a key");
        assert!(!key.is_locked(), "mlock succeeded with RLIMIT_MEMLOCK 0");
        assert_eq!(key.as_slice(), b"still a key");
        assert!(vm_flags(key.address()).contains(&"dd".to_owned()));
        return;
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "locked::tests::a_refused_lock_fails_soft",
            "--nocapture",
        ])
        .env(CHILD, "1")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("1 passed"));
}
