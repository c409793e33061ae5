//! Frames over a byte stream: reading one off a socket (a stalled peer bounded by the
//! socket's read timeout once a frame has begun) and writing one, a chunk without copying its
//! data into a frame buffer. The bytes themselves are the parent's parsers' and encoders'.
use super::{
    checksum, decode_payload, parse_header, push_header, verified_chunk, Frame, WireError,
    CHUNK_PREFIX, HEADER_LEN, KIND_CHUNK,
};
use std::io::{Read, Write};

/// Reads one frame. A clean end of stream before the first header byte is `Closed`.
pub fn read_frame<R: Read + ?Sized>(r: &mut R) -> Result<Frame, WireError> {
    read_frame_with(r, false)
}

/// As [`read_frame`], on a stream with a read timeout that bounds a frame once it has begun
/// but not the wait for one: a timeout before the first byte of a frame waits on, a timeout
/// after it is an error (a peer that stalls mid-frame is dropped).
pub fn read_frame_after_idle<R: Read + ?Sized>(r: &mut R) -> Result<Frame, WireError> {
    read_frame_with(r, true)
}

fn read_frame_with<R: Read + ?Sized>(r: &mut R, idle_ok: bool) -> Result<Frame, WireError> {
    let mut hbuf = [0u8; HEADER_LEN];
    let mut got = 0;
    while got < HEADER_LEN {
        match r.read(&mut hbuf[got..]) {
            Ok(0) if got == 0 => return Err(WireError::Closed),
            Ok(0) => {
                return Err(WireError::Truncated {
                    needed: HEADER_LEN,
                    got,
                })
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) if idle_ok && got == 0 && is_timeout(&e) => {}
            Err(e) => return Err(WireError::Io(e)),
        }
    }
    let header = parse_header(&hbuf)?;
    let read_exact = |r: &mut R, buf: &mut [u8]| {
        r.read_exact(buf).map_err(|e| {
            if e.kind() == std::io::ErrorKind::UnexpectedEof {
                WireError::Truncated {
                    needed: header.len,
                    got: 0,
                }
            } else {
                WireError::Io(e)
            }
        })
    };
    if header.kind == KIND_CHUNK {
        // Chunk data is read straight into the buffer the frame keeps: no copy of the bulk
        // of the stream. The checksum is checked before anyone sees the data.
        let mut prefix = [0u8; CHUNK_PREFIX];
        read_exact(r, &mut prefix)?;
        let mut data = vec![0u8; header.len - CHUNK_PREFIX];
        read_exact(r, &mut data)?;
        return verified_chunk(&prefix, data);
    }
    // Bounded by parse_header's per-kind cap.
    let mut payload = vec![0u8; header.len];
    read_exact(r, &mut payload)?;
    decode_payload(header, &payload)
}

pub fn write_frame<W: Write + ?Sized>(w: &mut W, frame: &Frame) -> Result<(), WireError> {
    w.write_all(&frame.encode())?;
    Ok(())
}

/// The header and checksum of a chunk frame for `data`: write these, then `data` itself (in
/// as many pieces as the caller likes), without copying the data into a frame buffer.
pub fn chunk_prefix(offset: u64, data: &[u8]) -> Vec<u8> {
    let mut prefix = Vec::with_capacity(HEADER_LEN + CHUNK_PREFIX);
    push_header(&mut prefix, KIND_CHUNK, CHUNK_PREFIX + data.len());
    prefix.extend_from_slice(&offset.to_le_bytes());
    prefix.extend_from_slice(&checksum(offset, data));
    prefix
}

/// Writes a whole chunk frame for `data`.
pub fn write_chunk<W: Write + ?Sized>(
    w: &mut W,
    offset: u64,
    data: &[u8],
) -> Result<(), WireError> {
    w.write_all(&chunk_prefix(offset, data))?;
    w.write_all(data)?;
    Ok(())
}

/// Whether an I/O error is a socket timeout firing.
pub fn is_timeout(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
    )
}
