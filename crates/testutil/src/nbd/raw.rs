//! A byte-level NBD client: each message as the test asks for it, so tests can send anything.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use cryptblk_nbd::protocol::*;

use super::{read_option_reply, write_option, write_request};

/// Speaks NBD byte by byte, so tests can send anything.
pub struct RawClient {
    pub stream: UnixStream,
}

impl RawClient {
    /// Connects and checks the server greeting; the client flags are not sent yet.
    pub fn connect(path: &Path) -> RawClient {
        let stream = UnixStream::connect(path).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        let mut client = RawClient { stream };
        let mut greeting = [0u8; 18];
        client.stream.read_exact(&mut greeting).unwrap();
        assert_eq!(&greeting[0..8], &NBD_MAGIC.to_be_bytes());
        assert_eq!(&greeting[8..16], &IHAVEOPT.to_be_bytes());
        assert_eq!(
            u16::from_be_bytes([greeting[16], greeting[17]]),
            FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES
        );
        client
    }

    /// Connects, negotiates fixed newstyle without zeroes and optionally structured replies,
    /// and enters transmission on `name` with NBD_OPT_GO. Returns (client, size, flags).
    pub fn open(path: &Path, name: &str, structured: bool) -> (RawClient, u64, u16) {
        let mut client = RawClient::connect(path);
        client.send_flags(CLIENT_FLAG_FIXED_NEWSTYLE | CLIENT_FLAG_NO_ZEROES);
        if structured {
            client.send_option(OPT_STRUCTURED_REPLY, &[]);
            assert_eq!(client.read_option_reply().1, REP_ACK);
        }
        let mut data = Vec::new();
        data.extend_from_slice(&(name.len() as u32).to_be_bytes());
        data.extend_from_slice(name.as_bytes());
        data.extend_from_slice(&0u16.to_be_bytes());
        client.send_option(OPT_GO, &data);
        let (mut size, mut flags) = (0, 0);
        loop {
            let (option, reply, payload) = client.read_option_reply();
            assert_eq!(option, OPT_GO);
            match reply {
                REP_INFO => {
                    if u16::from_be_bytes([payload[0], payload[1]]) == INFO_EXPORT {
                        size = u64::from_be_bytes(payload[2..10].try_into().unwrap());
                        flags = u16::from_be_bytes([payload[10], payload[11]]);
                    }
                }
                REP_ACK => return (client, size, flags),
                other => panic!("NBD_OPT_GO for '{name}' failed with reply {other:#x}"),
            }
        }
    }

    pub fn send_flags(&mut self, flags: u32) {
        self.stream.write_all(&flags.to_be_bytes()).unwrap();
    }

    pub fn send_option(&mut self, option: u32, data: &[u8]) {
        write_option(&mut self.stream, option, data).unwrap();
    }

    /// (option, reply type, payload)
    pub fn read_option_reply(&mut self) -> (u32, u32, Vec<u8>) {
        read_option_reply(&mut self.stream).unwrap()
    }

    pub fn send_request(
        &mut self,
        command: u16,
        flags: u16,
        cookie: u64,
        offset: u64,
        length: u32,
    ) {
        let header = RequestHeader {
            flags,
            command,
            cookie,
            offset,
            length,
        };
        write_request(&mut self.stream, &header, &[]).unwrap();
    }

    /// Reads a simple reply: (error, cookie, `data_len` bytes of data when error is 0).
    pub fn read_simple_reply(&mut self, data_len: usize) -> (u32, u64, Vec<u8>) {
        let mut header = [0u8; 16];
        self.stream.read_exact(&mut header).unwrap();
        assert_eq!(&header[0..4], &SIMPLE_REPLY_MAGIC.to_be_bytes());
        let error = u32::from_be_bytes(header[4..8].try_into().unwrap());
        let cookie = u64::from_be_bytes(header[8..16].try_into().unwrap());
        let mut data = Vec::new();
        if error == 0 {
            data.resize(data_len, 0);
            self.stream.read_exact(&mut data).unwrap();
        }
        (error, cookie, data)
    }

    /// True when the server has closed the connection (EOF or reset) within the timeout.
    pub fn is_closed_by_server(&mut self) -> bool {
        let mut byte = [0u8; 1];
        match self.stream.read(&mut byte) {
            Ok(0) => true,
            Ok(_) => false,
            Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
        }
    }
}
