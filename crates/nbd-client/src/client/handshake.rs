//! The fixed newstyle handshake: the greeting, structured replies, the metadata contexts the
//! caller selects, then GO on the export (its size and transmission flags).

use super::{Client, ExportInfo};
use crate::wire::*;
use crate::Error;
use std::collections::VecDeque;
use std::io::{BufReader, Read, Write};

/// The longest export name this client sends.
const MAX_EXPORT_NAME: usize = 4096;

impl<S: Read + Write> Client<S> {
    /// Runs the fixed newstyle handshake over `stream`: structured replies, the metadata
    /// `contexts`, then GO on `export`.
    pub fn handshake(stream: S, export: &str, contexts: &[&str]) -> Result<Client<S>, Error> {
        if export.len() > MAX_EXPORT_NAME {
            return Err(Error::Request(format!(
                "the export name is {} bytes long (at most {MAX_EXPORT_NAME})",
                export.len()
            )));
        }
        let mut client = Client {
            stream: BufReader::new(stream),
            info: ExportInfo { size: 0, flags: 0 },
            description: None,
            contexts: Vec::new(),
            next_cookie: 1,
            reads: VecDeque::new(),
            spare_covered: Vec::new(),
            broken: false,
        };
        client.greeting()?;
        client.structured_replies()?;
        if !contexts.is_empty() {
            client.set_meta_contexts(export, contexts)?;
        }
        client.go(export)?;
        Ok(client)
    }

    fn greeting(&mut self) -> Result<(), Error> {
        let r = &mut self.stream;
        if read_u64(r)? != NBD_MAGIC {
            return Err(Error::protocol(
                "this is not an NBD server (no NBDMAGIC greeting)",
            ));
        }
        if read_u64(r)? != IHAVEOPT {
            return Err(Error::protocol(
                "the server speaks only oldstyle negotiation, which this client does not",
            ));
        }
        let flags = read_u16(r)?;
        if flags & FLAG_FIXED_NEWSTYLE == 0 {
            return Err(Error::protocol(
                "the server does not offer fixed newstyle negotiation",
            ));
        }
        let client_flags = u32::from(flags & (FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES));
        self.stream
            .get_mut()
            .write_all(&client_flags.to_be_bytes())?;
        Ok(())
    }

    fn send_option(&mut self, option: u32, payload: &[u8]) -> Result<(), Error> {
        let mut msg = Vec::with_capacity(16 + payload.len());
        msg.extend_from_slice(&IHAVEOPT.to_be_bytes());
        msg.extend_from_slice(&option.to_be_bytes());
        msg.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        msg.extend_from_slice(payload);
        self.stream.get_mut().write_all(&msg)?;
        Ok(())
    }

    /// One option reply: its type and payload; an error reply becomes [`Error::Refused`].
    fn option_reply(&mut self, option: u32, name: &'static str) -> Result<(u32, Vec<u8>), Error> {
        let r = &mut self.stream;
        if read_u64(r)? != OPTION_REPLY_MAGIC {
            return Err(Error::protocol("an option reply has a bad magic number"));
        }
        let answered = read_u32(r)?;
        let kind = read_u32(r)?;
        let len = read_u32(r)?;
        let payload = read_bounded(r, len.into(), MAX_OPTION_REPLY, "an option reply")?;
        if answered != option {
            return Err(Error::protocol(format!(
                "a reply to option {answered} came while {name} was asked"
            )));
        }
        if kind & REP_ERR != 0 {
            let message = String::from_utf8_lossy(&payload).into_owned();
            let reason = match (kind & !REP_ERR, message.is_empty()) {
                (1, true) => "not supported".to_string(),
                (2, true) => "forbidden by the server's policy".to_string(),
                (6, true) => "no such export".to_string(),
                (5, _) => {
                    format!("TLS is required, which this client does not speak yet {message}")
                }
                (_, true) => format!("error {}", kind & !REP_ERR),
                (_, false) => message,
            };
            return Err(Error::Refused {
                option: name,
                reason,
            });
        }
        Ok((kind, payload))
    }

    fn structured_replies(&mut self) -> Result<(), Error> {
        self.send_option(OPT_STRUCTURED_REPLY, &[])?;
        let name = "structured replies (needed for block status)";
        match self.option_reply(OPT_STRUCTURED_REPLY, name)? {
            (REP_ACK, _) => Ok(()),
            (kind, _) => Err(Error::protocol(format!(
                "reply type {kind} to the structured-reply option"
            ))),
        }
    }

    fn set_meta_contexts(&mut self, export: &str, contexts: &[&str]) -> Result<(), Error> {
        let mut payload = Vec::new();
        put_string(&mut payload, export);
        payload.extend_from_slice(&(contexts.len() as u32).to_be_bytes());
        for c in contexts {
            put_string(&mut payload, c);
        }
        self.send_option(OPT_SET_META_CONTEXT, &payload)?;
        loop {
            let (kind, reply) = self.option_reply(OPT_SET_META_CONTEXT, "the metadata contexts")?;
            match kind {
                REP_ACK => break,
                REP_META_CONTEXT => {
                    let mut f = Fields::new(&reply);
                    let id = f.u32("a metadata context reply")?;
                    let name = String::from_utf8_lossy(f.rest()).into_owned();
                    if self.contexts.len() >= contexts.len() {
                        return Err(Error::protocol(
                            "more metadata contexts than were asked for",
                        ));
                    }
                    self.contexts.push((name, id));
                }
                other => {
                    return Err(Error::protocol(format!(
                        "reply type {other} to the metadata-context option"
                    )))
                }
            }
        }
        for wanted in contexts {
            if self.context_id(wanted).is_none() {
                return Err(Error::NoContext(wanted.to_string()));
            }
        }
        Ok(())
    }

    /// GO on `export`, asking for its description too: a backup pull tells one backup
    /// export from another by it (a server that has none, or ignores the request, sends
    /// none).
    fn go(&mut self, export: &str) -> Result<(), Error> {
        let mut payload = Vec::new();
        put_string(&mut payload, export);
        payload.extend_from_slice(&1u16.to_be_bytes());
        payload.extend_from_slice(&INFO_DESCRIPTION.to_be_bytes());
        self.send_option(OPT_GO, &payload)?;
        let mut info = None;
        loop {
            let (kind, reply) = self.option_reply(OPT_GO, "the export")?;
            match kind {
                REP_ACK => break,
                REP_INFO => {
                    let mut f = Fields::new(&reply);
                    match f.u16("an info reply")? {
                        INFO_EXPORT => {
                            let size = f.u64("the export info")?;
                            let flags = f.u16("the export info")?;
                            info = Some(ExportInfo { size, flags });
                        }
                        // UTF-8 by the spec; a server that sends other bytes still has its
                        // description compared as it came (lossily decoded).
                        INFO_DESCRIPTION => {
                            self.description = Some(String::from_utf8_lossy(f.rest()).into_owned());
                        }
                        _ => {}
                    }
                }
                other => {
                    return Err(Error::protocol(format!("reply type {other} to GO")));
                }
            }
        }
        self.info =
            info.ok_or_else(|| Error::protocol("GO succeeded without the export's size"))?;
        if self.info.size > i64::MAX as u64 {
            return Err(Error::protocol(format!(
                "an export size of {} bytes",
                self.info.size
            )));
        }
        Ok(())
    }
}

fn put_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u32).to_be_bytes());
    out.extend_from_slice(s.as_bytes());
}
