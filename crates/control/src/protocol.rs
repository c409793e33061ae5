//! JSON-RPC 2.0 messages: the handler trait and turning one received line into the line to send
//! back. Kept free of I/O so the rules are in one place.
use crate::fds::PassedFds;
use crate::rpc_error::RpcError;
use serde_json::{Map, Value};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Longest request (or response) line accepted, newline excluded. Far above any real
/// request; it only bounds the memory one client can make the daemon buffer.
pub const MAX_LINE: usize = 1 << 20;

/// Serves the methods. Called concurrently from one thread per client connection, hence
/// `Send + Sync`; a call may block (it only delays its own connection).
pub trait Handler: Send + Sync {
    /// `params` is the request's `params` member (an object or an array), or `Value::Null`
    /// when the request has none. Unknown methods should return
    /// [`RpcError::method_not_found`]. A panic is caught and reported as an internal error.
    fn call(&self, method: &str, params: Value) -> Result<Value, RpcError>;

    /// [`Handler::call`] for a request that came with file descriptors (SCM_RIGHTS), which its
    /// params name by index; those it does not [`PassedFds::take`] are closed after it returns.
    /// The default ignores them, so a handler that takes none implements `call` only.
    fn call_with_fds(
        &self,
        method: &str,
        params: Value,
        fds: &mut PassedFds,
    ) -> Result<Value, RpcError> {
        let _ = fds;
        self.call(method, params)
    }
}

/// Closures are handlers, which keeps small servers and tests short.
impl<F> Handler for F
where
    F: Fn(&str, Value) -> Result<Value, RpcError> + Send + Sync,
{
    fn call(&self, method: &str, params: Value) -> Result<Value, RpcError> {
        self(method, params)
    }
}

/// Handles one received line (without its newline) and returns the response line to send
/// (without newline), or `None` when nothing must be sent (notifications only).
/// `fds` are the descriptors that came with the line (shared by the members of a batch).
pub(crate) fn process_line(
    handler: &dyn Handler,
    line: &[u8],
    fds: &mut PassedFds,
) -> Option<String> {
    let value: Value = match serde_json::from_slice(line) {
        Ok(value) => value,
        Err(e) => {
            let error = RpcError::parse_error(format!("parse error: {e}"));
            return Some(error_response(Value::Null, error).to_string());
        }
    };
    match value {
        Value::Array(items) => {
            if items.is_empty() {
                let error = RpcError::invalid_request("empty batch");
                return Some(error_response(Value::Null, error).to_string());
            }
            // Batch members run in order on this connection's thread; the specification
            // allows any order, and in-order keeps "one connection is sequential" true.
            let responses: Vec<Value> = items
                .into_iter()
                .filter_map(|item| process_value(handler, item, fds))
                .collect();
            // A batch of notifications gets no reply at all, not an empty array.
            (!responses.is_empty()).then(|| Value::Array(responses).to_string())
        }
        other => process_value(handler, other, fds).map(|response| response.to_string()),
    }
}

/// One request object -> its response object, or `None` for a notification.
fn process_value(handler: &dyn Handler, value: Value, fds: &mut PassedFds) -> Option<Value> {
    let Value::Object(mut request) = value else {
        let error = RpcError::invalid_request("a request must be a JSON object");
        return Some(error_response(Value::Null, error));
    };
    // An absent `id` makes a notification; a present one (even null) asks for a response.
    let id = request.remove("id");
    let reply_id = match &id {
        None => Value::Null,
        Some(id @ (Value::Null | Value::String(_) | Value::Number(_))) => id.clone(),
        Some(_) => {
            let error = RpcError::invalid_request("`id` must be a string, a number or null");
            return Some(error_response(Value::Null, error));
        }
    };
    // Shape errors are answered even without an id: the specification does so, and the
    // sender otherwise never learns its "notification" was dropped.
    let (method, params) = match parse_call(&mut request) {
        Ok(call) => call,
        Err(error) => return Some(error_response(reply_id, error)),
    };
    if let Some(error) = fds.refusal() {
        return Some(error_response(reply_id, error));
    }
    let result = catch_unwind(AssertUnwindSafe(|| {
        handler.call_with_fds(&method, params, fds)
    }))
    .unwrap_or_else(|_| Err(RpcError::internal(format!("method `{method}` panicked"))));
    let id = id?;
    Some(match result {
        Ok(result) => {
            let mut response = Map::new();
            response.insert("jsonrpc".into(), "2.0".into());
            response.insert("result".into(), result);
            response.insert("id".into(), id);
            Value::Object(response)
        }
        Err(error) => error_response(id, error),
    })
}

fn parse_call(request: &mut Map<String, Value>) -> Result<(String, Value), RpcError> {
    match request.get("jsonrpc") {
        Some(Value::String(version)) if version == "2.0" => {}
        _ => return Err(RpcError::invalid_request("`jsonrpc` must be \"2.0\"")),
    }
    let method = match request.remove("method") {
        Some(Value::String(method)) => method,
        Some(_) => return Err(RpcError::invalid_request("`method` must be a string")),
        None => return Err(RpcError::invalid_request("missing `method`")),
    };
    let params = match request.remove("params") {
        None => Value::Null,
        Some(params @ (Value::Object(_) | Value::Array(_))) => params,
        Some(_) => {
            return Err(RpcError::invalid_request(
                "`params` must be an object or an array",
            ))
        }
    };
    Ok((method, params))
}

pub(crate) fn error_response(id: Value, error: RpcError) -> Value {
    let mut response = Map::new();
    response.insert("jsonrpc".into(), "2.0".into());
    // Serialising a struct of a String, an i64 and a Value cannot fail.
    let error = serde_json::to_value(error).unwrap_or(Value::Null);
    response.insert("error".into(), error);
    response.insert("id".into(), id);
    Value::Object(response)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn echo(method: &str, params: Value) -> Result<Value, RpcError> {
        match method {
            "echo" => Ok(params),
            _ => Err(RpcError::method_not_found(method)),
        }
    }

    fn run(line: &str) -> Option<Value> {
        process_line(&echo, line.as_bytes(), &mut PassedFds::default())
            .map(|s| serde_json::from_str(&s).unwrap())
    }

    #[test]
    fn request_and_notification() {
        assert_eq!(
            run(r#"{"jsonrpc":"2.0","method":"echo","params":[1],"id":"a"}"#),
            Some(json!({"jsonrpc":"2.0","result":[1],"id":"a"}))
        );
        assert_eq!(run(r#"{"jsonrpc":"2.0","method":"echo"}"#), None);
        assert_eq!(run(r#"{"jsonrpc":"2.0","method":"nope"}"#), None);
        assert_eq!(
            run(r#"{"jsonrpc":"2.0","method":"echo","id":null}"#),
            Some(json!({"jsonrpc":"2.0","result":null,"id":null}))
        );
    }

    #[test]
    fn batch() {
        assert_eq!(
            run(
                r#"[{"jsonrpc":"2.0","method":"echo","params":{"a":1},"id":1},
                    {"jsonrpc":"2.0","method":"echo"},
                    5,
                    {"jsonrpc":"2.0","method":"nope","id":2}]"#
            ),
            Some(json!([
                {"jsonrpc":"2.0","result":{"a":1},"id":1},
                {"jsonrpc":"2.0","error":{"code":-32600,"message":"a request must be a JSON object"},"id":null},
                {"jsonrpc":"2.0","error":{"code":-32601,"message":"unknown method `nope`"},"id":2},
            ]))
        );
        assert_eq!(run(r#"[{"jsonrpc":"2.0","method":"echo"}]"#), None);
        assert_eq!(run("[]").unwrap()["error"]["code"], json!(-32600));
    }

    #[test]
    #[should_panic(expected = "application error codes")]
    fn application_code_range_is_enforced() {
        let _ = RpcError::application(-32603, "not an application code");
    }
}
