//! Measures, on one thread, what one encrypted 64 KiB read costs along three paths, to decide
//! whether mapping the image into memory would pay (see "Serving VMs over vhost-user-blk" in docs/performance.md):
//!
//! - `pread + decrypt`: what `CryptDevice` does: the kernel copies the page cache into the
//!   caller's buffer, which is then decrypted in place (two passes over the data);
//! - `whole-file map`: decrypt straight from a mapping of the whole image into the buffer (one
//!   pass), the mapping made and faulted in beforehand; its page tables and resident set grow
//!   with the image;
//! - `window map`: the same from a bounded cache of 16 mappings of `--window` bytes, mapped on
//!   demand and unmapped when evicted, so memory stays bounded.
//!
//! Each path runs sequential and random 64 KiB reads over the file; the output is µs per read.
//!
//! Usage: cargo run --release -p cryptblk-block --example read_path_probe -- FILE [WINDOW_KIB]
//! (FILE: any file of at least 64 MiB, ideally in page cache or tmpfs, e.g. /dev/shm).

use std::collections::VecDeque;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::sync::Arc;
use std::time::Instant;

use cryptblk_crypto::{default_engine_for, CipherSpec, Direction, SecretKey, SectorCipher};

const READ: usize = 64 * 1024;
const SECTOR: usize = 4096;
const READS: usize = 16 * 1024;
const WINDOWS_KEPT: usize = 16;

/// A read-only shared mapping, unmapped on drop.
struct Mapping {
    addr: *mut libc::c_void,
    len: usize,
}

impl Mapping {
    fn new(file: &File, offset: usize, len: usize) -> Mapping {
        let offset = libc::off_t::try_from(offset).expect("offset fits off_t");
        // SAFETY: a fresh read-only shared mapping chosen by the kernel; nothing else uses
        // the address range. The result is checked before use.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                offset,
            )
        };
        assert!(
            addr != libc::MAP_FAILED,
            "mmap: {}",
            std::io::Error::last_os_error()
        );
        Mapping { addr, len }
    }

    fn bytes(&self, start: usize, len: usize) -> &[u8] {
        assert!(start + len <= self.len);
        // SAFETY: the range lies inside the mapping, which lives as long as `self`; this
        // probe truncates nothing, so the pages stay readable.
        unsafe { std::slice::from_raw_parts(self.addr.cast::<u8>().add(start), len) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping made in `new`; no slice of it outlives `self`.
        unsafe { libc::munmap(self.addr, self.len) };
    }
}

fn per_read_us(start: Instant) -> f64 {
    start.elapsed().as_secs_f64() / READS as f64 * 1e6
}

fn main() {
    let mut args = std::env::args().skip(1);
    let path = args
        .next()
        .expect("usage: read_path_probe FILE [WINDOW_KIB]");
    let window = args
        .next()
        .map_or(1024, |k| k.parse::<usize>().expect("WINDOW_KIB"))
        * 1024;
    assert!(
        window >= READ && window.is_multiple_of(READ),
        "window: a multiple of 64 KiB"
    );
    let file = File::open(&path).expect("open FILE");
    let size = usize::try_from(file.metadata().expect("stat FILE").len()).expect("size");
    let size = size / window * window;
    assert!(size >= 64 << 20, "FILE must hold at least 64 MiB");

    let spec = CipherSpec::parse_luks2("aes-xts-plain64", 64).expect("spec");
    let key = SecretKey::random(64).expect("key");
    let cipher: Arc<dyn SectorCipher> = default_engine_for(&spec)
        .and_then(|e| e.new_cipher(&spec, &key, SECTOR))
        .expect("cipher");
    let decrypt_into = |offset: usize, src: &[u8], dst: &mut [u8]| {
        let sector = (offset / SECTOR) as u64;
        cipher
            .crypt_into(Direction::Decrypt, sector, src, dst)
            .expect("decrypt");
    };

    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let random: Vec<usize> = (0..READS)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state as usize % (size / READ)) * READ
        })
        .collect();
    let sequential: Vec<usize> = (0..READS).map(|i| i * READ % size).collect();

    let whole = Mapping::new(&file, 0, size);
    let mut buf = vec![0u8; READ];
    // Fault the whole mapping in, so that its column shows the steady state.
    for offset in (0..size).step_by(READ) {
        decrypt_into(offset, whole.bytes(offset, READ), &mut buf);
    }

    println!(
        "engine {}, {} KiB windows; µs per 64 KiB read:",
        cipher.engine_name(),
        window / 1024
    );
    for (pattern, offsets) in [("sequential", &sequential), ("random", &random)] {
        let t = Instant::now();
        for &offset in offsets {
            file.read_exact_at(&mut buf, offset as u64).expect("pread");
            let sector = (offset / SECTOR) as u64;
            cipher
                .crypt(Direction::Decrypt, sector, &mut buf)
                .expect("decrypt");
        }
        let pread = per_read_us(t);

        let t = Instant::now();
        for &offset in offsets {
            decrypt_into(offset, whole.bytes(offset, READ), &mut buf);
        }
        let mapped = per_read_us(t);

        let mut windows: VecDeque<(usize, Mapping)> = VecDeque::new();
        let t = Instant::now();
        for &offset in offsets {
            let index = offset / window;
            if !windows.iter().any(|(i, _)| *i == index) {
                if windows.len() == WINDOWS_KEPT {
                    windows.pop_front();
                }
                windows.push_back((index, Mapping::new(&file, index * window, window)));
            }
            let (_, map) = windows
                .iter()
                .find(|(i, _)| *i == index)
                .expect("window just made");
            decrypt_into(offset, map.bytes(offset - index * window, READ), &mut buf);
        }
        let windowed = per_read_us(t);
        println!(
            "  {pattern:>10}: pread + decrypt {pread:6.2}   whole-file map {mapped:6.2}   window map {windowed:6.2}"
        );
    }
}
