//! The client side: connect, send a request line, read its response line.
use crate::protocol::MAX_LINE;
use crate::rpc_error::RpcError;
use serde_json::{Map, Value};
use std::io::{self, BufRead, BufReader, ErrorKind, Read};
use std::os::fd::BorrowedFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Why a call did not produce a result.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// Nothing is listening: the socket file is missing or stale.
    #[error(
        "cannot connect to the control socket {} (is `cryptblk serve --control PATH` running?)",
        path.display()
    )]
    NotRunning {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// Connecting failed for another reason (e.g. permission denied).
    #[error("cannot connect to the control socket {}", path.display())]
    Connect {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// Sending or receiving failed (including a timeout set with [`Client::set_timeout`]).
    #[error("control socket {}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("control socket {}: the server closed the connection without answering", path.display())]
    Closed { path: PathBuf },
    /// The server sent something that is not a JSON-RPC 2.0 response to our request.
    #[error("control socket {}: invalid response: {message}", path.display())]
    InvalidResponse { path: PathBuf, message: String },
    /// The server answered with an error object.
    #[error("{0}")]
    Rpc(RpcError),
}

/// Connects to `path`, calls `method` once (request id 1) and returns its result.
pub fn call(path: &Path, method: &str, params: Value) -> Result<Value, ClientError> {
    Client::connect(path)?.call(method, params)
}

/// A connection for several calls; they are answered in order.
#[derive(Debug)]
pub struct Client {
    path: PathBuf,
    reader: BufReader<UnixStream>,
    writer: UnixStream,
    next_id: u64,
}

impl Client {
    pub fn connect(path: &Path) -> Result<Client, ClientError> {
        let stream = UnixStream::connect(path).map_err(|source| {
            let path = path.to_owned();
            match source.kind() {
                ErrorKind::NotFound | ErrorKind::ConnectionRefused => {
                    ClientError::NotRunning { path, source }
                }
                _ => ClientError::Connect { path, source },
            }
        })?;
        let writer = stream.try_clone().map_err(|source| ClientError::Connect {
            path: path.to_owned(),
            source,
        })?;
        Ok(Client {
            path: path.to_owned(),
            reader: BufReader::new(stream),
            writer,
            next_id: 1,
        })
    }

    /// Bounds how long a call may wait to send or for its response (`None`: forever, the
    /// default, since some methods legitimately take long, e.g. unlocking a LUKS keyslot).
    pub fn set_timeout(&mut self, timeout: Option<Duration>) -> Result<(), ClientError> {
        self.writer
            .set_write_timeout(timeout)
            .and_then(|()| self.writer.set_read_timeout(timeout))
            .map_err(|source| self.io(source))
    }

    /// Calls `method`; `Value::Null` params are left out of the request.
    pub fn call(&mut self, method: &str, params: Value) -> Result<Value, ClientError> {
        self.call_with_fds(method, params, &[])
    }

    /// Calls `method`, passing `fds` with the request (SCM_RIGHTS, at most
    /// [`crate::MAX_FDS_PER_REQUEST`]); its params name them by index (`"key-fd": 0`). The
    /// daemon gets its own duplicates: ours stay open.
    pub fn call_with_fds(
        &mut self,
        method: &str,
        params: Value,
        fds: &[BorrowedFd<'_>],
    ) -> Result<Value, ClientError> {
        let id = self.next_id;
        self.next_id += 1;
        self.send(method, params, Some(id), fds)?;
        let line = self.read_line()?;
        let response: Value =
            serde_json::from_slice(&line).map_err(|e| self.invalid(format!("{e}")))?;
        let Value::Object(mut response) = response else {
            return Err(self.invalid("not a JSON object".into()));
        };
        if response.get("jsonrpc") != Some(&Value::from("2.0")) {
            return Err(self.invalid("`jsonrpc` is not \"2.0\"".into()));
        }
        if let Some(error) = response.remove("error") {
            // Errors the server raised before it could read our id (parse errors) carry
            // id null; they still answer this request, which was the only one in flight.
            let error: RpcError = serde_json::from_value(error)
                .map_err(|e| self.invalid(format!("malformed error object: {e}")))?;
            return Err(ClientError::Rpc(error));
        }
        if response.get("id") != Some(&Value::from(id)) {
            return Err(self.invalid(format!("expected id {id}, got {:?}", response.get("id"))));
        }
        response
            .remove("result")
            .ok_or_else(|| self.invalid("neither `result` nor `error`".into()))
    }

    /// Sends a notification: the server runs `method` but never answers.
    pub fn notify(&mut self, method: &str, params: Value) -> Result<(), ClientError> {
        self.send(method, params, None, &[])
    }

    fn send(
        &mut self,
        method: &str,
        params: Value,
        id: Option<u64>,
        fds: &[BorrowedFd<'_>],
    ) -> Result<(), ClientError> {
        let mut request = Map::new();
        request.insert("jsonrpc".into(), "2.0".into());
        request.insert("method".into(), method.into());
        if !params.is_null() {
            request.insert("params".into(), params);
        }
        if let Some(id) = id {
            request.insert("id".into(), id.into());
        }
        let mut line = Value::Object(request).to_string().into_bytes();
        line.push(b'\n');
        crate::fds::send_with_fds(&self.writer, &line, fds).map_err(|source| self.io(source))
    }

    fn read_line(&mut self) -> Result<Vec<u8>, ClientError> {
        let mut line = Vec::new();
        let n = (&mut self.reader)
            .take(MAX_LINE as u64 + 1)
            .read_until(b'\n', &mut line)
            .map_err(|source| self.io(source))?;
        if n == 0 {
            return Err(ClientError::Closed {
                path: self.path.clone(),
            });
        }
        if line.last() != Some(&b'\n') {
            return Err(if line.len() > MAX_LINE {
                self.invalid(format!("response longer than {MAX_LINE} bytes"))
            } else {
                self.invalid("connection closed in the middle of a response".into())
            });
        }
        line.pop();
        Ok(line)
    }

    fn io(&self, source: io::Error) -> ClientError {
        ClientError::Io {
            path: self.path.clone(),
            source,
        }
    }

    fn invalid(&self, message: String) -> ClientError {
        ClientError::InvalidResponse {
            path: self.path.clone(),
            message,
        }
    }
}
