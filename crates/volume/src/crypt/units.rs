//! The volume's numbers as types. Three kinds of `u64` meet on its path, and adding one kind to
//! another is a bug that corrupts data silently:
//!
//! - a [`VolumeOffset`]: a byte of the plaintext the guest sees;
//! - a [`BackendOffset`]: a byte of the backend (the image file, the RBD image), where that
//!   plaintext's ciphertext lies, past the header;
//! - an [`IvSector`]: the number an encryption sector's IV is made from, counted in encryption
//!   sectors (512 to 4096 bytes), shifted by the segment's IV offset and wrapping.
//!
//! A volume offset becomes one of the others only through the part it falls in: its
//! [`Placement`] (`backend(v)`) and its [`IvNumbering`] (`iv_sector(v)`). The raw number goes in
//! (`new`) and out (`bytes`, `get`) only at the volume's edges: the `BlockDevice` and aio
//! traits, the LUKS header, the cipher. The types are `repr(transparent)` and their
//! arithmetic the `u64`'s: no cost on the request path.
//!
//! A volume offset is not a backend offset:
//!
//! ```compile_fail,E0308
//! use cryptblk_volume::{BackendOffset, VolumeOffset};
//! fn ciphertext_at(_: BackendOffset) {}
//! ciphertext_at(VolumeOffset::new(4096));
//! ```
//!
//! nor is one added to the other:
//!
//! ```compile_fail,E0308
//! use cryptblk_volume::{BackendOffset, VolumeOffset};
//! let _ = BackendOffset::new(16 << 20) + VolumeOffset::new(4096);
//! ```
//!
//! and a layout takes each where it belongs:
//!
//! ```
//! use cryptblk_volume::{BackendOffset, CryptLayout, IvSector};
//! let layout = CryptLayout {
//!     data_offset: BackendOffset::new(16 << 20),
//!     payload_size: 1 << 30,
//!     iv_offset: IvSector::new(0),
//!     read_only: false,
//! };
//! assert_eq!(layout.data_offset.bytes(), 16 << 20);
//! ```
use std::ops::{Add, Sub};

/// A byte offset in the volume: what the guest addresses.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(transparent)]
pub struct VolumeOffset(u64);

/// A byte offset on the backend device, where the volume's bytes are stored.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(transparent)]
pub struct BackendOffset(u64);

/// The sector number an IV is made from (plain64: its little-endian bytes), in units of the
/// encryption sector. It wraps, as dm-crypt's does.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(transparent)]
pub struct IvSector(u64);

impl VolumeOffset {
    pub const fn new(bytes: u64) -> VolumeOffset {
        VolumeOffset(bytes)
    }

    pub const fn bytes(self) -> u64 {
        self.0
    }

    /// `len` bytes further, or `None` past the largest offset.
    pub fn checked_add(self, len: u64) -> Option<VolumeOffset> {
        self.0.checked_add(len).map(VolumeOffset)
    }

    /// `len` bytes further, at most the largest offset (a range end that must not wrap).
    pub fn saturating_add(self, len: u64) -> VolumeOffset {
        VolumeOffset(self.0.saturating_add(len))
    }

    /// The bytes from `earlier` to here, or `None` when `earlier` is above.
    pub fn checked_since(self, earlier: VolumeOffset) -> Option<u64> {
        self.0.checked_sub(earlier.0)
    }

    /// Whether the offset is a whole number of `sector`s.
    pub fn is_multiple_of(self, sector: u64) -> bool {
        self.0.is_multiple_of(sector)
    }

    /// The start of the `sector` this offset is in.
    pub fn round_down(self, sector: u64) -> VolumeOffset {
        VolumeOffset(self.0 / sector * sector)
    }

    /// The start of the first whole `sector` at or after this offset.
    pub fn round_up(self, sector: u64) -> VolumeOffset {
        VolumeOffset(self.0.div_ceil(sector) * sector)
    }

    /// How far into its `sector` this offset is.
    pub fn within(self, sector: u64) -> u64 {
        self.0 % sector
    }
}

impl BackendOffset {
    pub const fn new(bytes: u64) -> BackendOffset {
        BackendOffset(bytes)
    }

    pub const fn bytes(self) -> u64 {
        self.0
    }

    /// `len` bytes further, or `None` past the largest offset.
    pub fn checked_add(self, len: u64) -> Option<BackendOffset> {
        self.0.checked_add(len).map(BackendOffset)
    }
}

impl IvSector {
    pub const fn new(sector: u64) -> IvSector {
        IvSector(sector)
    }

    /// The number as the cipher takes it.
    pub const fn get(self) -> u64 {
        self.0
    }
}

/// A length added to an offset: requests are range-checked against the volume (or the
/// backend) before, so the sum stays inside it.
impl Add<u64> for VolumeOffset {
    type Output = VolumeOffset;
    #[inline]
    fn add(self, len: u64) -> VolumeOffset {
        VolumeOffset(self.0 + len)
    }
}

/// The length between two offsets of the volume.
impl Sub for VolumeOffset {
    type Output = u64;
    #[inline]
    fn sub(self, earlier: VolumeOffset) -> u64 {
        self.0 - earlier.0
    }
}

/// A length back from an offset (the start of an edge sector).
impl Sub<u64> for VolumeOffset {
    type Output = VolumeOffset;
    #[inline]
    fn sub(self, len: u64) -> VolumeOffset {
        VolumeOffset(self.0 - len)
    }
}

/// A length added to a backend offset.
impl Add<u64> for BackendOffset {
    type Output = BackendOffset;
    #[inline]
    fn add(self, len: u64) -> BackendOffset {
        BackendOffset(self.0 + len)
    }
}

/// Where a part of the volume lies on its backend: volume offset `v` at backend offset
/// `data_offset + v` (the same for every byte of the part; an encryption in place moves
/// parts, so each part has its own).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Placement {
    data_offset: BackendOffset,
}

impl Placement {
    /// Volume offset 0 at `data_offset`.
    pub(crate) fn at(data_offset: BackendOffset) -> Placement {
        Placement { data_offset }
    }

    /// The part whose volume offset `start` lies at backend offset `stored_at` (a LUKS2
    /// segment's), or `None` when that would put volume offset 0 below the backend's start.
    pub(crate) fn of_segment(start: VolumeOffset, stored_at: BackendOffset) -> Option<Placement> {
        let data_offset = stored_at.0.checked_sub(start.0)?;
        Some(Placement::at(BackendOffset(data_offset)))
    }

    /// The backend offset of volume offset 0.
    pub(crate) fn data_offset(self) -> BackendOffset {
        self.data_offset
    }

    /// Where volume offset `v` is stored.
    #[inline]
    pub(crate) fn backend(self, v: VolumeOffset) -> BackendOffset {
        BackendOffset(self.data_offset.0 + v.0)
    }

    /// The volume offset stored at backend offset `b`, or `None` below the part's data.
    #[inline]
    pub(crate) fn volume(self, b: BackendOffset) -> Option<VolumeOffset> {
        b.0.checked_sub(self.data_offset.0).map(VolumeOffset)
    }
}

/// How an encrypted part numbers its sectors for their IVs: the sector at volume offset `v`
/// has IV sector `first + v / sector`, wrapping.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct IvNumbering {
    /// The IV sector of volume offset 0 (wrapped "below zero" for a part that starts further up
    /// with a smaller IV tweak).
    first: IvSector,
    /// The encryption sector in bytes: a power of two from 512 to 4096.
    sector: u64,
}

impl IvNumbering {
    /// IV sector `first` at volume offset 0, in `sector`-byte sectors.
    pub(crate) fn new(first: IvSector, sector: u64) -> IvNumbering {
        IvNumbering { first, sector }
    }

    /// The numbering of a LUKS2 segment starting at volume offset `start` whose `iv_tweak` is,
    /// as the LUKS2 format (and dm-crypt's `iv_offset`) counts it, in 512-byte units whatever
    /// the sector size: the IV sector of volume offset `v` is
    /// `(iv_tweak * 512 + v - start) / sector`.
    pub(crate) fn of_luks2_segment(iv_tweak: u64, start: VolumeOffset, sector: u64) -> IvNumbering {
        let base = iv_tweak.saturating_mul(512);
        let first = if base >= start.0 {
            (base - start.0) / sector
        } else {
            ((start.0 - base) / sector).wrapping_neg()
        };
        IvNumbering::new(IvSector(first), sector)
    }

    /// The encryption sector in bytes.
    #[inline]
    pub(crate) fn sector(self) -> u64 {
        self.sector
    }

    /// The IV sector of volume offset 0.
    pub(crate) fn first(self) -> IvSector {
        self.first
    }

    /// The IV sector of the sector starting at `v` (sector aligned).
    #[inline]
    pub(crate) fn iv_sector(self, v: VolumeOffset) -> IvSector {
        IvSector(self.first.0.wrapping_add(v.0 / self.sector))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_part_maps_volume_offsets_past_its_data_offset_and_back() {
        let part = Placement::at(BackendOffset::new(16 << 20));
        let v = VolumeOffset::new(8192);
        assert_eq!(part.backend(v), BackendOffset::new((16 << 20) + 8192));
        assert_eq!(part.volume(part.backend(v)), Some(v));
        assert_eq!(
            part.volume(BackendOffset::new(4096)),
            None,
            "inside the header"
        );
    }

    #[test]
    fn a_segment_below_its_volume_offset_has_no_placement() {
        let moved = Placement::of_segment(VolumeOffset::new(4096), BackendOffset::new(1 << 20));
        assert_eq!(
            moved.map(Placement::data_offset),
            Some(BackendOffset::new((1 << 20) - 4096))
        );
        assert_eq!(
            Placement::of_segment(VolumeOffset::new(8192), BackendOffset::new(4096)),
            None
        );
    }

    #[test]
    fn iv_tweaks_count_512_byte_units_whatever_the_sector() {
        // A 4096-byte-sector segment from volume offset 1 MiB with iv_tweak 2048 (1 MiB in
        // 512-byte units): its first sector has IV sector 256, as at the start of a volume
        // that never moved.
        let ivs = IvNumbering::of_luks2_segment(2048, VolumeOffset::new(1 << 20), 4096);
        assert_eq!(
            ivs.iv_sector(VolumeOffset::new(1 << 20)),
            IvSector::new(256)
        );
        assert_eq!(
            ivs.iv_sector(VolumeOffset::new((1 << 20) + 4096)),
            IvSector::new(257)
        );
        // 512-byte sectors: one IV per 512 bytes.
        let ivs = IvNumbering::of_luks2_segment(0, VolumeOffset::new(0), 512);
        assert_eq!(ivs.iv_sector(VolumeOffset::new(4096)), IvSector::new(8));
    }

    #[test]
    fn a_tweak_below_its_segment_start_wraps_to_the_right_sectors() {
        // Segment at volume offset 64 KiB whose IVs start from 0: volume offset 0 would be
        // IV sector -16 (in 4 KiB sectors), so the segment's first sector is IV sector 0.
        let ivs = IvNumbering::of_luks2_segment(0, VolumeOffset::new(64 << 10), 4096);
        assert_eq!(ivs.first(), IvSector::new(16u64.wrapping_neg()));
        assert_eq!(ivs.iv_sector(VolumeOffset::new(64 << 10)), IvSector::new(0));
        assert_eq!(ivs.iv_sector(VolumeOffset::new(72 << 10)), IvSector::new(2));
    }
}
