//! Answering the destination's on-demand requests (postcopy): on the bulk channel between
//! chunks or slices, or with preempt on a connection and thread of their own.

use super::pacing::{link_sent, wait_link, Link};
use super::state::Shared;
use super::stop::Stop;
use crate::wire::{self, MAX_CHUNK_LEN};
use std::io::Write;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

/// Whether the destination may ask for `len` bytes at `offset` of the `size`-byte image file
/// whose payload starts at `payload`: only payload (the header never changes while migrating),
/// and no more than a chunk at once.
fn check_request(offset: u64, len: u64, payload: u64, size: u64) -> Result<(), String> {
    if offset < payload
        || len > MAX_CHUNK_LEN as u64
        || offset.checked_add(len).is_none_or(|e| e > size)
    {
        return Err(format!(
            "the destination asked for {len} bytes at {offset}, outside the {size}-byte disk's \
             payload"
        ));
    }
    Ok(())
}

/// Sends the `len` bytes at `offset` the destination asked for, on `w`.
pub(super) fn answer_urgent(
    shared: &Shared,
    link: &Mutex<Link>,
    w: &mut dyn Write,
    buf: &mut Vec<u8>,
    offset: u64,
    len: u64,
) -> Result<(), Stop> {
    let payload = shared.tracker.payload_offset();
    check_request(offset, len, payload, shared.file.size()).map_err(Stop::Broken)?;
    buf.resize(len as usize, 0);
    shared
        .file
        .read_at(buf, offset)
        .map_err(|e| Stop::Broken(e.to_string()))?;
    let prefix = wire::chunk_prefix(offset, buf);
    wait_link(link);
    w.write_all(&prefix)?;
    w.write_all(buf)?;
    link_sent(link, prefix.len() + buf.len());
    // Sent: the bulk stream need not send it again.
    shared
        .tracker
        .bitmap()
        .expect("tracking started")
        .clear_range(offset - payload, len);
    let mut s = shared.lock();
    s.urgent_served += 1;
    s.bytes_sent += len;
    s.chunks += 1;
    shared.cond.notify_all();
    Ok(())
}

/// With preempt, urgent requests are answered by a thread of their own, on the preempt
/// connection: the bulk sender may sit in a write to a full socket for milliseconds (Linux
/// wakes a writer only once a third of the buffer has drained), and an urgent answer must not
/// wait for that. Without break-chunks it still waits until the bulk sender is between chunks.
pub(super) fn spawn_urgent_answerer(
    shared: Arc<Shared>,
    link: Arc<Mutex<Link>>,
    mut w: Box<dyn Write + Send>,
    generation: u64,
) {
    let _ = std::thread::Builder::new()
        .name("migrate-urgent".into())
        .spawn(move || {
            let mut buf = Vec::new();
            loop {
                let (offset, len) = {
                    let mut s = shared.lock();
                    loop {
                        if s.generation != generation || s.phase.is_final() || s.broken.is_some() {
                            return;
                        }
                        if shared.opts.break_chunks || !s.bulk_in_chunk {
                            if let Some(r) = s.urgent.pop_front() {
                                break r;
                            }
                        }
                        s = shared
                            .cond
                            .wait_timeout(s, Duration::from_millis(100))
                            .unwrap_or_else(PoisonError::into_inner)
                            .0;
                    }
                };
                if let Err(stop) = answer_urgent(&shared, &link, &mut *w, &mut buf, offset, len) {
                    let e = match stop {
                        Stop::Broken(e) => e,
                        Stop::Cancelled => "cancelled".into(),
                    };
                    let mut s = shared.lock();
                    if s.generation == generation && s.broken.is_none() {
                        s.broken = Some(format!("urgent channel: {e}"));
                        shared.cond.notify_all();
                    }
                    return;
                }
            }
        });
}

#[cfg(test)]
mod tests {
    use super::check_request;
    use crate::wire::MAX_CHUNK_LEN;

    #[test]
    fn requests_must_lie_in_the_payload_and_fit_a_chunk() {
        let (payload, size) = (1 << 20, 128 << 20);
        assert!(check_request(payload, 4096, payload, size).is_ok());
        assert!(check_request(size - 4096, 4096, payload, size).is_ok());
        assert!(check_request(payload, MAX_CHUNK_LEN as u64, payload, size).is_ok());
        for (offset, len) in [
            (0, 4096),
            (payload - 512, 4096),
            (size - 4096, 8192),
            (u64::MAX - 1, 4096),
            (payload, MAX_CHUNK_LEN as u64 + 1),
        ] {
            let e = check_request(offset, len, payload, size).unwrap_err();
            assert!(e.contains(&format!("{len} bytes at {offset}")), "{e}");
        }
    }
}
