use super::*;
use crate::error::chain;
use cryptblk_control::api::ErrorKind;
use std::io::Write;
use std::os::fd::OwnedFd;

fn refusal(path: &Path) -> String {
    let err = read_key_file(path).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Usage, "{}", chain(&err));
    chain(&err)
}

#[test]
fn whole_file_newlines_included_and_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("k");
    std::fs::write(&key, b"secret\n").unwrap();
    assert_eq!(read_key_file(&key).unwrap().as_slice(), b"secret\n");
    let missing = read_key_file(&dir.path().join("none")).unwrap_err();
    assert_eq!(missing.kind(), ErrorKind::Io);
    assert!(chain(&missing).contains("reading key file"));
    std::fs::write(&key, b"").unwrap();
    assert!(refusal(&key).contains("is empty"));
}

#[test]
fn a_directory_or_a_device_is_refused_before_reading() {
    let dir = tempfile::tempdir().unwrap();
    let message = refusal(dir.path());
    assert!(
        message.contains("is a directory: give a regular file (or a pipe)"),
        "{message}"
    );
    // /dev/zero would read forever.
    let message = refusal(Path::new("/dev/zero"));
    assert_eq!(
        message,
        "key file /dev/zero is a character device: give a regular file (or a pipe) that \
         holds the passphrase"
    );
}

#[test]
fn a_file_above_cryptsetups_limit_is_refused_and_one_at_it_is_read() {
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("big");
    let mut bytes = vec![0x5au8; MAX_KEY_FILE_BYTES];
    std::fs::write(&key, &bytes).unwrap();
    assert_eq!(read_key_file(&key).unwrap().len(), MAX_KEY_FILE_BYTES);
    bytes.push(1);
    std::fs::write(&key, &bytes).unwrap();
    let message = refusal(&key);
    assert!(
        message.contains("is larger than 8192 KiB (cryptsetup's default key file limit)"),
        "{message}"
    );
}

/// A named pipe that never ends is cut off at the cap; a short one is read whole.
#[test]
fn a_pipe_is_read_to_its_end_within_the_cap() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo");
    rustix::fs::mknodat(
        rustix::fs::CWD,
        &fifo,
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o600),
        0,
    )
    .unwrap();
    let writer = |data: Vec<u8>, path: std::path::PathBuf| {
        std::thread::spawn(move || {
            let mut f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
            // The reader stops at the cap and closes: a broken pipe is expected then.
            let _ = f.write_all(&data);
        })
    };
    let t = writer(b"pass\nword".to_vec(), fifo.clone());
    assert_eq!(read_key_file(&fifo).unwrap().as_slice(), b"pass\nword");
    t.join().unwrap();
    let t = writer(vec![7u8; MAX_KEY_FILE_BYTES + 4096], fifo.clone());
    let message = refusal(&fifo);
    assert!(message.contains("is larger than 8192 KiB"), "{message}");
    t.join().unwrap();
}

#[test]
fn group_or_world_readable_key_files_get_a_warning() {
    let p = Path::new("/k");
    assert_eq!(permission_warning(p, 0o100600), None);
    assert_eq!(permission_warning(p, 0o100400), None);
    assert_eq!(
        permission_warning(p, 0o100640).unwrap(),
        "key file /k is readable by its group (mode 0640): chmod 600 it"
    );
    assert_eq!(
        permission_warning(p, 0o100604).unwrap(),
        "key file /k is readable by other users (mode 0604): chmod 600 it"
    );
    assert_eq!(
        permission_warning(p, 0o100644).unwrap(),
        "key file /k is readable by its group and by other users (mode 0644): chmod 600 it"
    );
}

/// Hands out its bytes a few at a time, as a pipe may.
struct Trickle<'a>(&'a [u8]);

impl Read for Trickle<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = buf.len().min(self.0.len()).min(3);
        buf[..n].copy_from_slice(&self.0[..n]);
        self.0 = &self.0[n..];
        Ok(n)
    }
}

#[test]
fn reading_grows_by_hand_within_the_cap_and_lines_stop_at_the_newline() {
    let data: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8 + 1).collect();
    let got = read_capped(&mut Trickle(&data), 10_000, 0, None)
        .unwrap()
        .unwrap();
    assert_eq!(got.as_slice(), data.as_slice());
    // Never more capacity than the cap and one byte to see past it.
    assert!(got.capacity() <= 10_001, "{}", got.capacity());
    assert!(read_capped(&mut Trickle(&data), 9_999, 0, None)
        .unwrap()
        .is_none());
    // A wrong size hint (the file grew) still reads it all, or refuses past the cap.
    let got = read_capped(&mut Trickle(&data), 10_000, 10, None)
        .unwrap()
        .unwrap();
    assert_eq!(got.len(), 10_000);

    let got = read_capped(&mut Trickle(b"typed\nrest"), 512, 0, Some(b'\n'))
        .unwrap()
        .unwrap();
    assert_eq!(got.as_slice(), b"typed");
    let long = vec![b'x'; 513];
    assert!(read_capped(&mut Trickle(&long), 512, 0, Some(b'\n'))
        .unwrap()
        .is_none());
}

fn pipe_holding(bytes: &[u8]) -> OwnedFd {
    let (r, w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).unwrap();
    std::fs::File::from(w).write_all(bytes).unwrap();
    r
}

#[test]
fn a_passed_pipe_or_memfd_holds_the_whole_passphrase() {
    let key = read_key_fd(pipe_holding(b"from a pipe\n"), "key-fd 0").unwrap();
    assert_eq!(key.as_slice(), b"from a pipe\n");
    // A memfd written by the client has its offset at the end: read from the start anyway.
    let mut memfd = std::fs::File::from(
        rustix::fs::memfd_create("key", rustix::fs::MemfdFlags::CLOEXEC).unwrap(),
    );
    memfd.write_all(b"in memory").unwrap();
    let key = read_key_fd(memfd.into(), "key-fd 1").unwrap();
    assert_eq!(key.as_slice(), b"in memory");
}

#[test]
fn a_passed_descriptor_that_is_empty_or_not_a_key_is_refused() {
    let err = read_key_fd(pipe_holding(b""), "key-fd 0").unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Usage);
    assert!(
        chain(&err).contains("key-fd 0 held nothing"),
        "{}",
        chain(&err)
    );
    let dir = tempfile::tempdir().unwrap();
    let err = read_key_fd(std::fs::File::open(dir.path()).unwrap().into(), "key-fd 2").unwrap_err();
    assert!(
        chain(&err).contains("neither a pipe nor a regular file"),
        "{}",
        chain(&err)
    );
    let null = std::fs::File::open("/dev/zero").unwrap();
    assert!(read_key_fd(null.into(), "key-fd 3").is_err());
    // A descriptor opened for writing only cannot be read: an error, not a hang.
    let wo = std::fs::File::create(dir.path().join("w")).unwrap();
    let err = read_key_fd(wo.into(), "key-fd 4").unwrap_err();
    assert!(chain(&err).contains("key-fd 4"), "{}", chain(&err));
}
