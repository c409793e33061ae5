//! Which files the daemon maps as guest memory (SET_MEM_TABLE, ADD_MEM_REG).
//!
//! A mapping of a file that shrinks afterwards raises SIGBUS on the next access beyond the new
//! end, and the daemon touches guest memory on every request: a frontend that truncates the
//! file it shared would kill the daemon, and every other VM's disk with it. The rule is
//! therefore that the file must be unable to shrink: a memfd sealed with `F_SEAL_SHRINK`, as
//! QEMU's `memory-backend-memfd` makes it by default (`seal=on`, also with `hugetlb=on`), and
//! at least as long as the range mapped. Anything else is refused, naming the fix:
//! - a memfd without the seal (`seal=off`): anyone holding it may truncate it;
//! - a file on tmpfs or hugetlbfs (`memory-backend-file` with `mem-path=/dev/shm/..` or a
//!   hugetlbfs mount): it cannot be sealed against shrinking (such files carry `F_SEAL_SEAL`
//!   from birth) and whoever can write the file may truncate it;
//! - a file on another filesystem (`F_GET_SEALS` fails): the same, and no seals at all.
//!
//! Surviving SIGBUS instead (failing the request and dropping that connection) would accept
//! those too, but needs a process-wide signal handler that can tell a guest-memory fault from
//! a bug and unwind out of any copy or crypto routine: far more machinery than a check that
//! QEMU's default configuration already passes.
use rustix::fs::{fcntl_get_seals, SealFlags};
use std::fs::File;
use std::io;

/// Ok if `file` may be mapped as guest memory up to byte `end`; see the module comment.
pub fn check_guest_memory_file(file: &File, end: u64) -> io::Result<()> {
    let Ok(seals) = fcntl_get_seals(file) else {
        return Err(refused(
            "is not a memfd (it cannot be sealed against shrinking)",
        ));
    };
    if !seals.contains(SealFlags::SHRINK) {
        return Err(refused(if seals == SealFlags::SEAL {
            "is a tmpfs or hugetlbfs file (it cannot be sealed against shrinking)"
        } else {
            "is a memfd without F_SEAL_SHRINK"
        }));
    }
    let size = file.metadata()?.len();
    if size < end {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("guest memory region maps {end} bytes of a {size}-byte file"),
        ));
    }
    Ok(())
}

fn refused(what: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::PermissionDenied,
        format!(
            "refusing guest memory (or a dirty log) whose file {what}: its owner could truncate \
             it and crash the daemon; use QEMU's memory-backend-memfd (sealed by default, \
             hugetlb=on for huge pages)"
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustix::fs::{fcntl_add_seals, memfd_create, MemfdFlags};

    fn memfd(flags: MemfdFlags) -> File {
        File::from(memfd_create("cryptblk-test", flags).unwrap())
    }

    #[test]
    fn only_memfds_sealed_against_shrinking_and_long_enough_are_mapped() {
        let unsealed = memfd(MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING);
        unsealed.set_len(1 << 20).unwrap();
        let err = check_guest_memory_file(&unsealed, 1 << 20).unwrap_err();
        assert!(
            err.to_string().contains("memfd without F_SEAL_SHRINK"),
            "{err}"
        );

        let sealed = memfd(MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING);
        sealed.set_len(1 << 20).unwrap();
        fcntl_add_seals(
            &sealed,
            SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL,
        )
        .unwrap();
        check_guest_memory_file(&sealed, 1 << 20).unwrap();
        // The seal holds: the file cannot be truncated any more.
        let err = sealed.set_len(4096).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EPERM), "{err}");
        // A region mapping past the end is refused too.
        let err = check_guest_memory_file(&sealed, (1 << 20) + 1).unwrap_err();
        assert!(
            err.to_string()
                .contains("1048577 bytes of a 1048576-byte file"),
            "{err}"
        );

        // Without MFD_ALLOW_SEALING a memfd carries F_SEAL_SEAL only, like a tmpfs file.
        let unsealable = memfd(MemfdFlags::CLOEXEC);
        let err = check_guest_memory_file(&unsealable, 0).unwrap_err();
        assert!(err.to_string().contains("tmpfs or hugetlbfs"), "{err}");

        let dir = tempfile::tempdir().unwrap();
        let plain = File::create(dir.path().join("ram")).unwrap();
        let err = check_guest_memory_file(&plain, 0).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::PermissionDenied);
        assert!(err.to_string().contains("memory-backend-memfd"), "{err}");
    }
}
