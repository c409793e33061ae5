//! The pull's reader: on a thread of its own it asks the export for block status and reads
//! the wanted extents, while the pull's writer checks, hashes and stores what it read before.
//! [`IN_FLIGHT`] reads wait on the server at once, so its disk is never idle between them
//! (an `O_DIRECT` image has no read-ahead of its own; docs/backup.md has the numbers), and
//! the next reads are on the wire while the last one is stored.
//!
//! Memory stays bounded: the reader fills [`BUFFERS`] buffers of [`READ_CHUNK`] bytes and
//! waits for the writer to hand one back.
use crate::error::Error;
use cryptblk_nbd_client::{Client, Extent};
use std::collections::VecDeque;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::thread::{Scope, ScopedJoinHandle};

/// Bytes one READ asks for.
pub(crate) const READ_CHUNK: usize = 1 << 20;
/// READs waiting on the server at once.
const IN_FLIGHT: usize = 8;
/// Block status is asked for one window at a time, so the extents held stay few.
const STATUS_WINDOW: u64 = 1 << 30;
/// Buffers between the reader and the writer: those being read, one being stored, one ready.
const BUFFERS: usize = IN_FLIGHT + 2;

/// What the reader found next, in the export's order.
pub(crate) enum Pulled {
    /// `len` bytes at `pos`, in `buf` (hand it back with [`ReadAhead::recycle`]).
    Data { pos: u64, buf: Vec<u8>, len: usize },
    /// Bytes up to `to` are not wanted (`window_end`: the end of a block-status window).
    Skipped { to: u64, window_end: bool },
}

/// The reader thread and the two channels to it.
pub(crate) struct ReadAhead<'scope> {
    pulled: Receiver<Result<Pulled, Error>>,
    empty: SyncSender<Vec<u8>>,
    thread: ScopedJoinHandle<'scope, Client>,
}

impl<'scope> ReadAhead<'scope> {
    /// Starts reading the extents of `context` from `start` to `end` that `wanted` (given an
    /// extent's flags) picks.
    pub(crate) fn start<'env>(
        scope: &'scope Scope<'scope, 'env>,
        mut client: Client,
        context: String,
        start: u64,
        end: u64,
        wanted: impl Fn(u32) -> bool + Send + 'scope,
    ) -> ReadAhead<'scope> {
        let (pulled_tx, pulled) = sync_channel(BUFFERS);
        let (empty, empty_rx) = sync_channel(BUFFERS);
        for _ in 0..BUFFERS {
            // Cannot fail: the channel has room for every buffer and its receiver is here.
            let _ = empty.send(vec![0u8; READ_CHUNK]);
        }
        let thread = scope.spawn(move || {
            let mut reader = Reader {
                client: &mut client,
                context: &context,
                out: &pulled_tx,
                empty: &empty_rx,
                wanted: &wanted,
                order: VecDeque::with_capacity(2 * IN_FLIGHT + 1),
            };
            if let Err(e) = reader.run(start, end) {
                // The writer may have stopped already; then nobody needs the error.
                let _ = pulled_tx.send(Err(e));
            }
            client
        });
        ReadAhead {
            pulled,
            empty,
            thread,
        }
    }

    /// The next thing read, in order; `None` once everything up to the end was.
    pub(crate) fn next(&self) -> Option<Result<Pulled, Error>> {
        self.pulled.recv().ok()
    }

    /// Gives a buffer of [`Pulled::Data`] back to the reader.
    pub(crate) fn recycle(&self, buf: Vec<u8>) {
        // The reader may have finished; then the buffer is simply freed.
        let _ = self.empty.send(buf);
    }

    /// Waits for the reader to finish (it has, once `next` said `None`) and returns the
    /// connection.
    pub(crate) fn finish(self) -> Client {
        drop(self.pulled);
        drop(self.empty);
        match self.thread.join() {
            Ok(client) => client,
            Err(panic) => std::panic::resume_unwind(panic),
        }
    }
}

struct Reader<'a, W> {
    client: &'a mut Client,
    context: &'a str,
    out: &'a SyncSender<Result<Pulled, Error>>,
    empty: &'a Receiver<Vec<u8>>,
    wanted: &'a W,
    /// Reads in flight and the skips between them, oldest first.
    order: VecDeque<Next>,
}

/// The writer went away (it stopped the pull): the reader stops too.
struct WriterGone;

/// What the writer is owed next, in the export's order.
enum Next {
    /// The oldest read in flight on the connection.
    Read,
    /// The bytes up to here are not wanted.
    Skip(u64),
}

impl<W: Fn(u32) -> bool> Reader<'_, W> {
    fn run(&mut self, start: u64, end: u64) -> Result<(), Error> {
        let mut extents: Vec<Extent> = Vec::new();
        let mut pos = start;
        while pos < end {
            let window = (end - pos).min(STATUS_WINDOW) as u32;
            self.client
                .block_status(self.context, pos, window, &mut extents)?;
            for e in &extents {
                let extent_end = pos + e.length;
                if (self.wanted)(e.flags) {
                    while pos < extent_end {
                        if self.client.reads_in_flight() == IN_FLIGHT
                            && self.deliver_oldest_read()?.is_err()
                        {
                            return Ok(());
                        }
                        let len = (extent_end - pos).min(READ_CHUNK as u64) as usize;
                        let Ok(buf) = self.empty.recv() else {
                            return Ok(());
                        };
                        self.client.send_read(pos, buf, len)?;
                        self.order.push_back(Next::Read);
                        pos += len as u64;
                    }
                } else {
                    pos = extent_end;
                    if self.skip(pos).is_err() {
                        return Ok(());
                    }
                }
            }
            // Block status is asked with no read in flight.
            if self.deliver_all()?.is_err() {
                return Ok(());
            }
            let window_end = Pulled::Skipped {
                to: pos,
                window_end: true,
            };
            if self.send(window_end).is_err() {
                return Ok(());
            }
        }
        Ok(())
    }

    /// Says the bytes up to `to` are not wanted: at once if nothing read waits to be handed
    /// on, else after it (one entry for consecutive skips, so the queue holds at most one
    /// skip per read in flight).
    fn skip(&mut self, to: u64) -> Result<(), WriterGone> {
        match self.order.back_mut() {
            None => self.send(Pulled::Skipped {
                to,
                window_end: false,
            }),
            Some(Next::Skip(last)) => {
                *last = to;
                Ok(())
            }
            Some(Next::Read) => {
                self.order.push_back(Next::Skip(to));
                Ok(())
            }
        }
    }

    /// Hands the writer everything queued before the oldest read in flight, then that read
    /// once it is answered, then the skips queued after it.
    fn deliver_oldest_read(&mut self) -> Result<Result<(), WriterGone>, Error> {
        let mut delivered_read = false;
        while let Some(next) = self.order.front() {
            let pulled = match *next {
                Next::Skip(to) => Pulled::Skipped {
                    to,
                    window_end: false,
                },
                Next::Read if delivered_read => break,
                Next::Read => {
                    delivered_read = true;
                    let Some(read) = self.client.receive_read()? else {
                        // Every `Next::Read` is a read sent on this connection.
                        return Err(cryptblk_nbd_client::Error::Request(
                            "a read queued for the writer was never sent".into(),
                        )
                        .into());
                    };
                    Pulled::Data {
                        pos: read.offset,
                        buf: read.buf,
                        len: read.len,
                    }
                }
            };
            self.order.pop_front();
            if self.send(pulled).is_err() {
                return Ok(Err(WriterGone));
            }
        }
        Ok(Ok(()))
    }

    /// Hands the writer everything queued, in order.
    fn deliver_all(&mut self) -> Result<Result<(), WriterGone>, Error> {
        while !self.order.is_empty() {
            if self.deliver_oldest_read()?.is_err() {
                return Ok(Err(WriterGone));
            }
        }
        Ok(Ok(()))
    }

    fn send(&self, pulled: Pulled) -> Result<(), WriterGone> {
        self.out.send(Ok(pulled)).map_err(|_| WriterGone)
    }
}
