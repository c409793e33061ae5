//! Arbitrary bytes as everything an NBD server sends to cryptblk's backup client: the
//! handshake (greeting, option replies, metadata contexts, export info), then the replies to
//! block-status and read requests (one at a time, then several in flight). The client must
//! answer an error, never panic, hang or allocate past its stated bounds (option replies
//! 64 KiB, block-status chunks 4 MiB, 65,536 chunks per reply).
#![no_main]

use cryptblk_nbd_client::{Client, BASE_ALLOCATION};
use libfuzzer_sys::fuzz_target;
use std::io::{Cursor, Read, Write};

/// Replays the input as the server's side; what the client sends is dropped.
struct Server<'a>(Cursor<&'a [u8]>);

impl Read for Server<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.0.read(buf)
    }
}

impl Write for Server<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fuzz_target!(|data: &[u8]| {
    let bitmap = "qemu:dirty-bitmap:c0";
    let server = Server(Cursor::new(data));
    let Ok(mut client) = Client::handshake(server, "disk", &[BASE_ALLOCATION, bitmap]) else {
        return;
    };
    let size = client.info().size;
    let mut extents = Vec::new();
    let mut buf = vec![0u8; 64 << 10];
    for round in 0..4u64 {
        let context = if round % 2 == 0 {
            BASE_ALLOCATION
        } else {
            bitmap
        };
        let length = size.min(u64::from(u32::MAX)) as u32;
        if client
            .block_status(context, 0, length, &mut extents)
            .is_ok()
        {
            let described: u64 = extents.iter().map(|e| e.length).sum();
            assert!(described <= u64::from(length), "extents past the request");
        }
        let n = size.min(buf.len() as u64) as usize;
        if n > 0 {
            let _ = client.read(round.min(size - n as u64), &mut buf[..n]);
        }
    }
    // Reads in flight, answered in whatever order and with whatever chunks the bytes say.
    let n = size.min(4096) as usize;
    if n > 0 {
        for i in 0..3u64 {
            let offset = (i * n as u64).min(size - n as u64);
            if client.send_read(offset, vec![0u8; n], n).is_err() {
                break;
            }
        }
        while let Ok(Some(read)) = client.receive_read() {
            assert!(
                read.len == n && read.buf.len() >= n,
                "a read of the wrong size"
            );
        }
    }
});
