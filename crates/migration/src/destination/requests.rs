//! On-demand requests to the source (postcopy): on the urgent channel when there is one, else
//! on the bulk channel; while paused they wait for a resume, which asks again.

use super::state::{DShared, SharedWriter};
use crate::wire::Frame;
use std::io::Write;
use std::sync::PoisonError;

/// After a resume (or a new urgent channel): asks again for everything still awaited.
pub(super) fn resend_outstanding(shared: &DShared) {
    let Ok(c) = shared.created() else { return };
    let mut ranges = Vec::new();
    let mut block = 0;
    while let Some((first, count)) = c.requested.next_run(block, true) {
        for b in first..first + count {
            if !c.received.is_set(b) {
                ranges.push(c.received.block_range(b, 1));
            }
        }
        block = first + count;
    }
    if !ranges.is_empty() {
        send_requests(shared, &ranges);
    }
}

fn request_writer(shared: &DShared) -> Option<SharedWriter> {
    let s = shared.lock();
    s.urgent_writer.clone().or_else(|| s.bulk_writer.clone())
}

pub(super) fn send_requests(shared: &DShared, ranges: &[(u64, u64)]) {
    let Some(w) = request_writer(shared) else {
        return; // paused: resent on resume
    };
    let mut bytes = Vec::new();
    for &(offset, len) in ranges {
        Frame::Request { offset, len }.encode_into(&mut bytes);
    }
    let mut w = w.lock().unwrap_or_else(PoisonError::into_inner);
    // A failed send is found by the reader of that channel; the request is resent on resume.
    let _ = w.write_all(&bytes);
}
