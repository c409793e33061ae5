//! JSON-RPC 2.0 error objects and their codes: those the specification fixes and the range
//! it leaves to applications. Both sides use them (the server answers with one, a client
//! receives one), and so does whatever checks a request's parts, such as its passed descriptors.
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Malformed JSON. The connection stays usable: the next line is a new frame.
pub const PARSE_ERROR: i64 = -32700;
/// Valid JSON that is not a request (not an object, `jsonrpc` not "2.0", `method` not a
/// string, `params` not structured, empty batch), or a line longer than [`crate::MAX_LINE`].
pub const INVALID_REQUEST: i64 = -32600;
pub const METHOD_NOT_FOUND: i64 = -32601;
pub const INVALID_PARAMS: i64 = -32602;
pub const INTERNAL_ERROR: i64 = -32603;
/// Lowest code for application errors ("server error" range of the specification).
pub const APPLICATION_ERROR_MIN: i64 = -32099;
/// Highest code for application errors.
pub const APPLICATION_ERROR_MAX: i64 = -32000;
/// Sent by the server itself for requests it reads after [`crate::StopHandle::stop`]; handlers
/// should pick other application codes so clients can tell the two apart.
pub const SERVER_SHUTTING_DOWN: i64 = -32000;

/// A JSON-RPC error object, as returned by a [`crate::Handler`] and as received by a client.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, thiserror::Error)]
#[error("{message} (JSON-RPC error {code})")]
pub struct RpcError {
    pub code: i64,
    pub message: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<Value>,
}

impl RpcError {
    fn new(code: i64, message: impl Into<String>) -> RpcError {
        RpcError {
            code,
            message: message.into(),
            data: None,
        }
    }

    /// -32700: the line is not JSON.
    pub fn parse_error(message: impl Into<String>) -> RpcError {
        RpcError::new(PARSE_ERROR, message)
    }

    /// -32600: the JSON is not a valid request.
    pub fn invalid_request(message: impl Into<String>) -> RpcError {
        RpcError::new(INVALID_REQUEST, message)
    }

    /// -32601, naming the method so a client typo is obvious.
    pub fn method_not_found(method: &str) -> RpcError {
        RpcError::new(METHOD_NOT_FOUND, format!("unknown method `{method}`"))
    }

    /// -32602: the method exists but its params are wrong.
    pub fn invalid_params(message: impl Into<String>) -> RpcError {
        RpcError::new(INVALID_PARAMS, message)
    }

    /// -32603: the server failed in a way that is not the caller's fault.
    pub fn internal(message: impl Into<String>) -> RpcError {
        RpcError::new(INTERNAL_ERROR, message)
    }

    /// An application error; attach details with [`RpcError::with_data`].
    ///
    /// # Panics
    /// If `code` is outside `-32099..=-32000`: the other codes have meanings fixed by the
    /// specification, and a handler sending one would mislead clients.
    pub fn application(code: i64, message: impl Into<String>) -> RpcError {
        assert!(
            (APPLICATION_ERROR_MIN..=APPLICATION_ERROR_MAX).contains(&code),
            "JSON-RPC application error codes are -32099..=-32000, not {code}"
        );
        RpcError::new(code, message)
    }

    /// Attaches the optional `data` member (structured details for programs).
    pub fn with_data(mut self, data: Value) -> RpcError {
        self.data = Some(data);
        self
    }

    pub(crate) fn shutting_down() -> RpcError {
        RpcError::new(SERVER_SHUTTING_DOWN, "the server is shutting down")
    }
}
