//! The byte stream of a connection: the client socket, or TLS over it after STARTTLS.

use std::io::{self, Read, Write};

/// A connected client socket of either family (`cryptblk-net`'s).
pub(crate) use cryptblk_net::Stream as Socket;

/// The byte stream of a connection: the socket itself, or TLS over it after NBD_OPT_STARTTLS.
pub(crate) enum Transport {
    Plain(Socket),
    Tls(Box<rustls::StreamOwned<rustls::ServerConnection, Socket>>),
}

impl Transport {
    pub(crate) fn socket(&self) -> &Socket {
        match self {
            Transport::Plain(socket) => socket,
            Transport::Tls(stream) => stream.get_ref(),
        }
    }
}

impl Read for Transport {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Transport::Plain(socket) => socket.read(buf),
            Transport::Tls(stream) => stream.read(buf),
        }
    }
}

impl Write for Transport {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Transport::Plain(socket) => socket.write(buf),
            Transport::Tls(stream) => stream.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            Transport::Plain(socket) => socket.flush(),
            Transport::Tls(stream) => stream.flush(),
        }
    }
}
