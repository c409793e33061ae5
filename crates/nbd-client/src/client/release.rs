//! Releasing what the client has stored: a TRIM on an export that announces itself READ_ONLY
//! with SEND_TRIM (cryptblk's backup export, whose TRIM frees the backup's copies and changes
//! nothing it serves). Refused on any other export: there a TRIM would discard the disk's data.

use super::reply::{unexpected_chunk, unknown_cookie, ReplyPart};
use super::Client;
use crate::wire::*;
use crate::Error;
use std::io::{Read, Write};

/// The longest range one TRIM releases (its length is 32 bits; kept to whole MiB).
const MAX_RELEASE: u64 = 1 << 30;

impl<S: Read + Write> Client<S> {
    /// Whether the export takes releases: read-only, and announcing TRIM all the same.
    pub fn can_release(&self) -> bool {
        let flags = self.info.flags;
        flags & TFLAG_READ_ONLY != 0 && flags & TFLAG_SEND_TRIM != 0
    }

    /// Tells the export that `length` bytes at `offset` are stored and need not be kept, in
    /// TRIMs of at most 1 GiB. Refused (an [`Error::Request`]) on an export that does not
    /// [`can_release`](Client::can_release), and while reads wait for their replies.
    pub fn release(&mut self, mut offset: u64, length: u64) -> Result<(), Error> {
        if !self.can_release() {
            return Err(Error::Request(
                "this export does not take releases (it is not a read-only export offering \
                 TRIM, as a cryptblk backup export is): a TRIM could discard its data"
                    .into(),
            ));
        }
        self.check_range(offset, length)?;
        if !self.reads.is_empty() {
            return Err(Error::Request(format!(
                "a release while {} reads wait for their replies",
                self.reads.len()
            )));
        }
        let end = offset + length;
        while offset < end {
            let n = (end - offset).min(MAX_RELEASE);
            let cookie = self.send_request(CMD_TRIM, offset, n as u32)?;
            let result = self.release_reply(cookie, offset);
            self.mark_if_broken(&result);
            result?;
            offset += n;
        }
        Ok(())
    }

    fn release_reply(&mut self, cookie: u64, offset: u64) -> Result<(), Error> {
        loop {
            match self.next_reply_part()? {
                // A TRIM's reply has no payload: a simple success is one (the spec lets a
                // server answer so after structured replies were agreed).
                ReplyPart::Simple {
                    cookie: got,
                    errno: 0,
                } if got == cookie => return Ok(()),
                ReplyPart::Simple { cookie: got, errno } if got == cookie => {
                    return Err(Error::Command {
                        command: "release (trim)",
                        offset,
                        reason: crate::error::nbd_errno_name(errno),
                    });
                }
                ReplyPart::Failed {
                    cookie: got,
                    reason,
                    ..
                } if got == cookie => {
                    return Err(Error::Command {
                        command: "release (trim)",
                        offset,
                        reason,
                    });
                }
                ReplyPart::Chunk { cookie: got, chunk } if got == cookie => {
                    unexpected_chunk(&chunk)?;
                    if chunk.done {
                        return Ok(());
                    }
                }
                part => return Err(unknown_cookie(part.cookie())),
            }
        }
    }
}
