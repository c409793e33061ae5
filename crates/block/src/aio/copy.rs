//! Copies between a contiguous buffer of ours and a request's scatter-gather list, through
//! raw pointers (the list may be guest memory, which is never a Rust reference). The
//! request's `IoBuffers` vouch for the list's memory, and their invariants (no Rust reference
//! to it) keep it apart from our buffer.

use super::{IoBuffers, IoVec};

/// Copies `src` into the buffers' bytes starting `skip` bytes into them.
pub(crate) fn scatter(src: &[u8], buffers: &IoBuffers, skip: usize) {
    let mut at = 0usize;
    let mut pos = 0usize;
    for v in buffers.iov() {
        if at == src.len() {
            break;
        }
        let end = pos + v.len();
        if end > skip {
            let from = skip.max(pos) - pos;
            let n = (v.len() - from).min(src.len() - at);
            // SAFETY: `from + n <= v.len()` and `at + n <= src.len()`; `buffers` keep the
            // list's memory valid, and no reference (such as `src`) reaches into it.
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr().add(at), v.base().add(from), n) };
            at += n;
        }
        pos = end;
    }
}

/// Fills `dst` from the buffers' bytes starting `skip` bytes into them.
pub(crate) fn gather(buffers: &IoBuffers, skip: usize, dst: &mut [u8]) {
    let mut at = 0usize;
    let mut pos = 0usize;
    for v in buffers.iov() {
        if at == dst.len() {
            break;
        }
        let end = pos + v.len();
        if end > skip {
            let from = skip.max(pos) - pos;
            let n = (v.len() - from).min(dst.len() - at);
            // SAFETY: as in `scatter`, reading the list and writing our own buffer.
            unsafe {
                std::ptr::copy_nonoverlapping(v.base().add(from), dst.as_mut_ptr().add(at), n)
            };
            at += n;
        }
        pos = end;
    }
}

/// The part of the list after its first `skip` bytes, into `out` (cleared first).
pub(crate) fn advance(iov: &[IoVec], skip: usize, out: &mut Vec<IoVec>) {
    out.clear();
    let mut pos = 0usize;
    for v in iov {
        let end = pos + v.len();
        if end > skip {
            let from = skip.max(pos) - pos;
            out.push(IoVec::from_raw(v.base().wrapping_add(from), v.len() - from));
        }
        pos = end;
    }
}

/// Zeroes the buffers' bytes after their first `skip` bytes.
pub(crate) fn zero_fill(buffers: &IoBuffers, skip: usize) {
    let mut pos = 0usize;
    for v in buffers.iov() {
        let end = pos + v.len();
        if end > skip {
            let from = skip.max(pos) - pos;
            // SAFETY: `from <= v.len()`; `buffers` keep the memory valid.
            unsafe { std::ptr::write_bytes(v.base().add(from), 0, v.len() - from) };
        }
        pos = end;
    }
}

#[cfg(test)]
mod tests {
    use super::super::OwnedBuffer;
    use super::*;
    use std::sync::Arc;

    #[test]
    fn scatter_and_gather_cross_segment_boundaries() {
        let mut memory = Arc::new(OwnedBuffer::zeroed(12));
        let mut buffers = IoBuffers::new();
        buffers.set_owner(memory.clone());
        for (addr, len) in [(0, 3), (3, 5), (8, 4)] {
            buffers.add(addr, len).unwrap();
        }
        let src: Vec<u8> = (1..=9).collect();
        scatter(&src, &buffers, 2);
        let mut out = [0u8; 6];
        gather(&buffers, 4, &mut out);
        assert_eq!(out, [3, 4, 5, 6, 7, 8]);
        let mut rest = Vec::new();
        advance(buffers.iov(), 4, &mut rest);
        assert_eq!(rest.iter().map(IoVec::len).collect::<Vec<_>>(), [4, 4]);
        zero_fill(&buffers, 6);
        buffers.clear();
        let bytes = Arc::get_mut(&mut memory).unwrap().bytes_mut();
        assert_eq!(bytes, [0, 0, 1, 2, 3, 4, 0, 0, 0, 0, 0, 0]);
    }
}
