//! Copies between a contiguous buffer of ours and a request's scatter-gather list, through
//! raw pointers (the list may be guest memory, which is never a Rust reference).

use super::IoVec;

/// Copies `src` into the list's bytes starting `skip` bytes into the list.
///
/// # Safety
/// The list's buffers are valid for writes of their lengths and do not overlap `src`.
pub(crate) unsafe fn scatter(src: &[u8], iov: &[IoVec], skip: usize) {
    let mut at = 0usize;
    let mut pos = 0usize;
    for v in iov {
        if at == src.len() {
            break;
        }
        let end = pos + v.len();
        if end > skip {
            let from = skip.max(pos) - pos;
            let n = (v.len() - from).min(src.len() - at);
            // SAFETY: `from + n <= v.len()` and `at + n <= src.len()`; the caller vouches for
            // the list's memory and that it does not overlap `src`.
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr().add(at), v.base().add(from), n) };
            at += n;
        }
        pos = end;
    }
}

/// Fills `dst` from the list's bytes starting `skip` bytes into the list.
///
/// # Safety
/// The list's buffers are valid for reads of their lengths and do not overlap `dst`.
pub(crate) unsafe fn gather(iov: &[IoVec], skip: usize, dst: &mut [u8]) {
    let mut at = 0usize;
    let mut pos = 0usize;
    for v in iov {
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

/// Zeroes the list's bytes after its first `skip` bytes.
///
/// # Safety
/// The list's buffers are valid for writes of their lengths.
pub(crate) unsafe fn zero_fill(iov: &[IoVec], skip: usize) {
    let mut pos = 0usize;
    for v in iov {
        let end = pos + v.len();
        if end > skip {
            let from = skip.max(pos) - pos;
            // SAFETY: `from <= v.len()`; the caller vouches for the memory.
            unsafe { std::ptr::write_bytes(v.base().add(from), 0, v.len() - from) };
        }
        pos = end;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scatter_and_gather_cross_segment_boundaries() {
        let mut a = [0u8; 3];
        let mut b = [0u8; 5];
        let mut c = [0u8; 4];
        let iov = [
            IoVec::from_slice(&mut a),
            IoVec::from_slice(&mut b),
            IoVec::from_slice(&mut c),
        ];
        let src: Vec<u8> = (1..=9).collect();
        // SAFETY: the arrays outlive the calls and are not otherwise used meanwhile.
        unsafe { scatter(&src, &iov, 2) };
        assert_eq!((a, b, c), ([0, 0, 1], [2, 3, 4, 5, 6], [7, 8, 9, 0]));
        let mut out = [0u8; 6];
        // SAFETY: as above.
        unsafe { gather(&iov, 4, &mut out) };
        assert_eq!(out, [3, 4, 5, 6, 7, 8]);
        let mut rest = Vec::new();
        advance(&iov, 4, &mut rest);
        assert_eq!(rest.iter().map(IoVec::len).collect::<Vec<_>>(), [4, 4]);
        // SAFETY: as above.
        unsafe { zero_fill(&iov, 6) };
        assert_eq!((a, b, c), ([0, 0, 1], [2, 3, 4, 0, 0], [0, 0, 0, 0]));
    }
}
