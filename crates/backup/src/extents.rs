//! The extents file of a chain entry: which byte ranges of the disk the entry holds, in
//! order, and whether each is data (its bytes next in the entry's data file) or zeroes.
//!
//! Layout: the 8-byte magic `CBBKEXT1`, then 24-byte records, all big-endian:
//! offset (u64), length (u64), kind (u32: 0 data, 1 zeroes), reserved (u32, 0).
//! Records are sorted, do not overlap and lie inside the entry's disk size. A backup store is
//! not trusted: [`Reader`] checks every record and never panics.
use std::io::{BufWriter, Read, Write};

pub const MAGIC: &[u8; 8] = b"CBBKEXT1";
pub const RECORD_LEN: usize = 24;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Data,
    Zero,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Record {
    pub offset: u64,
    pub length: u64,
    pub kind: Kind,
}

impl Record {
    pub fn end(&self) -> u64 {
        self.offset + self.length
    }

    pub fn encode(&self) -> [u8; RECORD_LEN] {
        let mut b = [0; RECORD_LEN];
        b[0..8].copy_from_slice(&self.offset.to_be_bytes());
        b[8..16].copy_from_slice(&self.length.to_be_bytes());
        let kind: u32 = match self.kind {
            Kind::Data => 0,
            Kind::Zero => 1,
        };
        b[16..20].copy_from_slice(&kind.to_be_bytes());
        b
    }
}

/// Reads and checks the records of one extents file (or any byte source).
pub struct Reader<R: Read> {
    input: R,
    disk_size: u64,
    next_free: u64,
    index: u64,
    /// Bytes of data the records so far hold.
    pub data_bytes: u64,
}

impl<R: Read> Reader<R> {
    pub fn new(mut input: R, disk_size: u64) -> Result<Reader<R>, String> {
        let mut magic = [0; 8];
        input
            .read_exact(&mut magic)
            .map_err(|e| format!("the extents file has no header ({e})"))?;
        if &magic != MAGIC {
            return Err("the extents file does not start with CBBKEXT1".into());
        }
        Ok(Reader {
            input,
            disk_size,
            next_free: 0,
            index: 0,
            data_bytes: 0,
        })
    }

    /// The next record, `None` at the end; a damaged record is an error naming it.
    pub fn next_record(&mut self) -> Result<Option<Record>, String> {
        let mut b = [0; RECORD_LEN];
        let mut got = 0;
        while got < RECORD_LEN {
            match self.input.read(&mut b[got..]) {
                Ok(0) if got == 0 => return Ok(None),
                Ok(0) => return Err(format!("extent record {} is cut short", self.index)),
                Ok(n) => got += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(format!("reading extent record {}: {e}", self.index)),
            }
        }
        let field = |r: std::ops::Range<usize>| {
            let mut a = [0; 8];
            a[8 - r.len()..].copy_from_slice(&b[r]);
            u64::from_be_bytes(a)
        };
        let (offset, length, kind, reserved) =
            (field(0..8), field(8..16), field(16..20), field(20..24));
        let at = self.index;
        self.index += 1;
        let kind = match (kind, reserved) {
            (0, 0) => Kind::Data,
            (1, 0) => Kind::Zero,
            _ => return Err(format!("extent record {at} has an unknown kind")),
        };
        if length == 0 {
            return Err(format!("extent record {at} is empty"));
        }
        if offset < self.next_free {
            return Err(format!(
                "extent record {at} overlaps or precedes the one before it"
            ));
        }
        match offset.checked_add(length) {
            Some(end) if end <= self.disk_size => self.next_free = end,
            _ => {
                return Err(format!(
                    "extent record {at} ({length} bytes at {offset}) ends past the disk ({} bytes)",
                    self.disk_size
                ))
            }
        }
        if kind == Kind::Data {
            self.data_bytes += length;
        }
        Ok(Some(Record {
            offset,
            length,
            kind,
        }))
    }

    pub fn records(&self) -> u64 {
        self.index
    }

    pub fn into_inner(self) -> R {
        self.input
    }
}

/// Appends records, merging a record into the one before it when they touch and agree.
pub struct Writer<W: Write> {
    out: W,
    pending: Option<Record>,
    /// Bytes written to `out` so far (header included).
    pub written: u64,
}

impl<W: Write> Writer<W> {
    /// A writer for an empty output (writes the header) or for one already holding
    /// `written` bytes of header and records.
    pub fn new(mut out: W, written: u64) -> std::io::Result<Writer<W>> {
        let mut written = written;
        if written == 0 {
            out.write_all(MAGIC)?;
            written = MAGIC.len() as u64;
        }
        Ok(Writer {
            out,
            pending: None,
            written,
        })
    }

    pub fn push(&mut self, r: Record) -> std::io::Result<()> {
        if let Some(p) = &mut self.pending {
            if p.kind == r.kind && p.end() == r.offset {
                p.length += r.length;
                return Ok(());
            }
        }
        if let Some(p) = self.pending.replace(r) {
            self.emit(p)?;
        }
        Ok(())
    }

    /// Writes the record still held back, so the output is complete up to here.
    pub fn settle(&mut self) -> std::io::Result<()> {
        if let Some(p) = self.pending.take() {
            self.emit(p)?;
        }
        Ok(())
    }

    fn emit(&mut self, r: Record) -> std::io::Result<()> {
        self.out.write_all(&r.encode())?;
        self.written += RECORD_LEN as u64;
        Ok(())
    }

    pub fn get_mut(&mut self) -> &mut W {
        &mut self.out
    }
}

impl Writer<BufWriter<std::fs::File>> {
    pub fn flush(&mut self) -> std::io::Result<()> {
        self.out.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(offset: u64, length: u64, kind: Kind) -> Record {
        Record {
            offset,
            length,
            kind,
        }
    }

    #[test]
    fn touching_records_of_one_kind_merge_and_read_back() {
        let mut w = Writer::new(Vec::new(), 0).unwrap();
        for r in [
            rec(0, 10, Kind::Data),
            rec(10, 5, Kind::Data),
            rec(15, 5, Kind::Zero),
            rec(40, 1, Kind::Data),
        ] {
            w.push(r).unwrap();
        }
        w.settle().unwrap();
        let bytes = w.get_mut().clone();
        assert_eq!(bytes.len(), 8 + 3 * RECORD_LEN);
        let mut r = Reader::new(&bytes[..], 41).unwrap();
        let mut got = Vec::new();
        while let Some(x) = r.next_record().unwrap() {
            got.push(x);
        }
        assert_eq!(
            got,
            [
                rec(0, 15, Kind::Data),
                rec(15, 5, Kind::Zero),
                rec(40, 1, Kind::Data)
            ]
        );
        assert_eq!(r.data_bytes, 16);
    }

    #[test]
    fn damaged_records_are_refused_by_number() {
        let encode = |rs: &[Record]| {
            let mut b = MAGIC.to_vec();
            for r in rs {
                b.extend_from_slice(&r.encode());
            }
            b
        };
        let read_all = |b: &[u8], size| -> Result<(), String> {
            let mut r = Reader::new(b, size)?;
            while r.next_record()?.is_some() {}
            Ok(())
        };
        let overlap = encode(&[rec(0, 10, Kind::Data), rec(5, 10, Kind::Data)]);
        assert!(read_all(&overlap, 100)
            .unwrap_err()
            .contains("record 1 overlaps"));
        let past = encode(&[rec(90, 20, Kind::Zero)]);
        assert!(read_all(&past, 100).unwrap_err().contains("past the disk"));
        let wrap = encode(&[rec(u64::MAX, 2, Kind::Data)]);
        assert!(read_all(&wrap, u64::MAX)
            .unwrap_err()
            .contains("past the disk"));
        let mut cut = encode(&[rec(0, 1, Kind::Data)]);
        cut.pop();
        assert!(read_all(&cut, 100).unwrap_err().contains("cut short"));
        let mut kind = encode(&[rec(0, 1, Kind::Data)]);
        kind[8 + 19] = 7;
        assert!(read_all(&kind, 100).unwrap_err().contains("unknown kind"));
        assert!(read_all(b"NOTMAGIC", 100).unwrap_err().contains("CBBKEXT1"));
    }
}
