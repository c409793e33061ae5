//! `RawSectors`: a run of bytes a cipher may read and write through raw pointers, as a value
//! that carries the proof that the memory is valid.
//!
//! Memory that must never become a Rust reference (a guest's RAM under a virtio request,
//! which the guest may write at any moment) reaches a cipher as raw addresses. Whoever knows
//! that such memory is valid, and for how long, says so once by building a `RawSectors` (the
//! `unsafe` constructors, or a safe one on a type that owns or pins the memory, such as
//! `IoBuffers` in the block crate); every layer the value then passes through
//! (`SectorCipher::crypt_raw`, `CryptoPool::crypt_raw`, wrappers such as the volume's
//! zero-holes cipher) is a safe call, and `unsafe` is left only where an engine finally reads
//! or writes the bytes.
//!
//! The value is three words passed by value, made without allocation or checks beyond the
//! constructors' own; it is neither `Copy` nor `Clone`, so (like `&mut [u8]`) one value is one
//! claim on its bytes, and [`RawSectors::split_at`] hands out disjoint parts.

use crate::CryptoError;
use std::marker::PhantomData;

/// `len` bytes read at `src` and written at `dst` (the same address, or disjoint ranges),
/// valid for the lifetime `'a`.
///
/// Invariant, established by whoever builds the value and relied upon by every cipher that
/// reads `src` or writes `dst`: for as long as the value (lifetime `'a`) lives, `src` is valid
/// for reads and `dst` valid for writes of `len` bytes (mapped and not freed; no alignment
/// needed), the two ranges are either the same or disjoint, and no Rust reference to either
/// range is alive in this process except the borrow the value was made from (the safe
/// constructors). Other parties (a guest, another request the guest made over the same memory)
/// may write the bytes concurrently: the engines read each input byte once per sector they
/// produce and never read back what they wrote, so that only changes which bytes come out.
#[derive(Debug)]
pub struct RawSectors<'a> {
    src: *const u8,
    dst: *mut u8,
    len: usize,
    _memory: PhantomData<&'a mut [u8]>,
}

impl<'a> RawSectors<'a> {
    /// `len` bytes read at `src` and written at `dst`.
    ///
    /// # Safety
    /// For the lifetime `'a`: `src` valid for reads and `dst` valid for writes of `len` bytes
    /// (mapped and not freed; no alignment needed), the two ranges the same or disjoint, and
    /// no Rust reference to either range alive in this process. See the type's invariant.
    #[inline]
    pub unsafe fn new(src: *const u8, dst: *mut u8, len: usize) -> Self {
        RawSectors {
            src,
            dst,
            len,
            _memory: PhantomData,
        }
    }

    /// `len` bytes at `at`, transformed in place.
    ///
    /// # Safety
    /// For the lifetime `'a`: `at` valid for reads and writes of `len` bytes (mapped and not
    /// freed; no alignment needed), and no Rust reference to the range alive in this process.
    #[inline]
    pub unsafe fn in_place(at: *mut u8, len: usize) -> Self {
        // SAFETY: one range is "the same" range for source and destination; the rest is this
        // function's contract.
        unsafe { Self::new(at, at, len) }
    }

    /// The bytes of `data`, transformed in place.
    #[inline]
    pub fn from_mut(data: &'a mut [u8]) -> Self {
        let len = data.len();
        let at = data.as_mut_ptr();
        // SAFETY: `data` is an exclusive borrow of `len` bytes for `'a`, used only through
        // `at` from now on.
        unsafe { Self::in_place(at, len) }
    }

    /// `src` transformed into `dst`, which must be exactly as long.
    #[inline]
    pub fn between(src: &'a [u8], dst: &'a mut [u8]) -> Result<Self, CryptoError> {
        crate::check_same_len(src, dst)?;
        // SAFETY: a shared and an exclusive borrow of the same length, both for `'a`; the two
        // never overlap, and they are used only through these pointers from now on.
        Ok(unsafe { Self::new(src.as_ptr(), dst.as_mut_ptr(), src.len()) })
    }

    /// Where the input starts (valid for reads of `len()` bytes: the type's invariant).
    #[inline]
    pub fn src(&self) -> *const u8 {
        self.src
    }

    /// Where the output starts (valid for writes of `len()` bytes: the type's invariant).
    #[inline]
    pub fn dst(&self) -> *mut u8 {
        self.dst
    }

    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Source and destination are the same bytes.
    #[inline]
    pub fn is_in_place(&self) -> bool {
        std::ptr::eq(self.src, self.dst)
    }

    /// Copies the source bytes at `at..at + out.len()` into `out`.
    ///
    /// # Panics
    /// If the range runs past `len()`.
    #[inline]
    pub fn read_into(&self, at: usize, out: &mut [u8]) {
        self.check_range(at, out.len());
        // SAFETY: the range lies inside the source, valid for reads (the type's invariant).
        // `out` cannot overlap it: no reference to the source is alive but the one this
        // value may hold, a shared borrow, which excludes the exclusive `out`.
        unsafe { std::ptr::copy_nonoverlapping(self.src.add(at), out.as_mut_ptr(), out.len()) }
    }

    /// Copies `data` into the destination bytes at `at..at + data.len()`.
    ///
    /// # Panics
    /// If the range runs past `len()`.
    #[inline]
    pub fn write_from(&mut self, at: usize, data: &[u8]) {
        self.check_range(at, data.len());
        // SAFETY: the range lies inside the destination, valid for writes (the type's
        // invariant). `data` cannot overlap it: no reference to the destination is alive but
        // the exclusive borrow this value may hold.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.dst.add(at), data.len()) }
    }

    /// Sets every destination byte to zero.
    #[inline]
    pub fn zero_dst(&mut self) {
        // SAFETY: `len` bytes at `dst`, valid for writes (the type's invariant).
        unsafe { self.dst.write_bytes(0, self.len) }
    }

    /// Whether the source bytes at `at..at + len` are all zero. Reads them once, 8 at a time,
    /// and stops at the first non-zero word.
    ///
    /// # Panics
    /// If the range runs past `len()`.
    #[inline]
    pub fn src_is_zero(&self, at: usize, len: usize) -> bool {
        self.check_range(at, len);
        let p = self.src.wrapping_add(at);
        let words = len / 8;
        // SAFETY: every read is inside `at..at + len`, inside the source, valid for reads (the
        // type's invariant); unaligned, as the memory has no alignment promise.
        unsafe {
            (0..words).all(|i| p.add(i * 8).cast::<u64>().read_unaligned() == 0)
                && (words * 8..len).all(|i| p.add(i).read() == 0)
        }
    }

    #[inline]
    fn check_range(&self, at: usize, len: usize) {
        assert!(
            at.checked_add(len).is_some_and(|end| end <= self.len),
            "bytes {at}..+{len} of a {}-byte run",
            self.len
        );
    }

    /// The first `mid` bytes and the rest, as two values over disjoint parts.
    ///
    /// # Panics
    /// If `mid > len()`, as `slice::split_at` does.
    #[inline]
    pub fn split_at(self, mid: usize) -> (Self, Self) {
        assert!(mid <= self.len, "split of a {}-byte run at {mid}", self.len);
        // `wrapping_add` stays inside (or one past) the ranges, as `mid <= len`.
        let rest = RawSectors {
            src: self.src.wrapping_add(mid),
            dst: self.dst.wrapping_add(mid),
            len: self.len - mid,
            _memory: PhantomData,
        };
        let head = RawSectors { len: mid, ..self };
        (head, rest)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_at_hands_out_the_two_parts_of_both_ranges() {
        let src = [1u8; 64];
        let mut dst = [0u8; 64];
        let (s, d) = (src.as_ptr(), dst.as_mut_ptr());
        let (head, tail) = RawSectors::between(&src, &mut dst).unwrap().split_at(16);
        assert_eq!((head.src(), head.dst(), head.len()), (s, d, 16));
        assert_eq!(
            (tail.src(), tail.dst(), tail.len()),
            (s.wrapping_add(16), d.wrapping_add(16), 48)
        );
        assert!(!head.is_in_place() && !tail.is_in_place());
        let (all, none) = tail.split_at(48);
        assert_eq!(all.len(), 48);
        assert!(none.is_empty());

        let mut data = [0u8; 32];
        let (a, b) = RawSectors::from_mut(&mut data).split_at(0);
        assert!(a.is_empty() && a.is_in_place() && b.is_in_place());
        assert_eq!(b.len(), 32);
    }

    #[test]
    #[should_panic(expected = "split of a 8-byte run at 9")]
    fn split_past_the_end_panics() {
        let mut data = [0u8; 8];
        let _ = RawSectors::from_mut(&mut data).split_at(9);
    }

    #[test]
    fn reads_writes_and_zero_checks_stay_inside_their_ranges() {
        let mut src = [0u8; 64];
        src[40] = 7;
        let mut dst = [9u8; 64];
        {
            let mut run = RawSectors::between(&src, &mut dst).unwrap();
            let mut out = [1u8; 8];
            run.read_into(36, &mut out);
            assert_eq!(out, [0, 0, 0, 0, 7, 0, 0, 0]);
            assert!(run.src_is_zero(0, 40) && run.src_is_zero(41, 23));
            assert!(!run.src_is_zero(33, 8) && !run.src_is_zero(40, 1));
            run.write_from(60, &[1, 2, 3, 4]);
            let (_, mut tail) = run.split_at(56);
            tail.zero_dst();
        }
        assert!(dst[..56].iter().all(|&b| b == 9));
        assert_eq!(dst[56..], [0; 8]);
    }

    #[test]
    #[should_panic(expected = "bytes 60..+8 of a 64-byte run")]
    fn a_read_past_the_end_panics() {
        let mut data = [0u8; 64];
        RawSectors::from_mut(&mut data).read_into(60, &mut [0; 8]);
    }

    #[test]
    #[should_panic(expected = "bytes 1..+64 of a 64-byte run")]
    fn a_write_past_the_end_panics() {
        let mut data = [0u8; 64];
        RawSectors::from_mut(&mut data).write_from(1, &[0; 64]);
    }

    #[test]
    #[should_panic(expected = "of a 64-byte run")]
    fn a_zero_check_past_the_end_panics() {
        let mut data = [0u8; 64];
        RawSectors::from_mut(&mut data).src_is_zero(usize::MAX, 2);
    }

    #[test]
    fn between_refuses_different_lengths() {
        let err = RawSectors::between(&[0; 512], &mut [0; 1024]).unwrap_err();
        assert!(matches!(err, CryptoError::InvalidLength(_)), "{err}");
    }
}
