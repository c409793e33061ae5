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
    fn between_refuses_different_lengths() {
        let err = RawSectors::between(&[0; 512], &mut [0; 1024]).unwrap_err();
        assert!(matches!(err, CryptoError::InvalidLength(_)), "{err}");
    }
}
