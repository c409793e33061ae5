//! The control socket end to end: a real server on a real socket, driven by raw lines (to
//! test malformed input) and by the client API.
use cryptblk_control::{
    call, Client, ClientError, ControlServer, Error, Handler, RpcError, StopHandle, INTERNAL_ERROR,
    INVALID_PARAMS, INVALID_REQUEST, MAX_LINE, METHOD_NOT_FOUND, PARSE_ERROR,
};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// echo: returns params. sleep {"ms": N}: sleeps, returns "slept". fail: an application
/// error with data. count: counts calls (to see notifications run). panic: panics.
#[derive(Default)]
struct TestHandler {
    sleeping: Mutex<usize>,
    sleep_started: Condvar,
    counted: AtomicUsize,
}

impl TestHandler {
    /// Waits until `n` sleep calls have started, so a test knows a slow request is in
    /// progress without guessing with timeouts.
    fn wait_sleeping(&self, n: usize) {
        let mut sleeping = self.sleeping.lock().unwrap();
        while *sleeping < n {
            sleeping = self.sleep_started.wait(sleeping).unwrap();
        }
    }
}

impl Handler for TestHandler {
    fn call(&self, method: &str, params: Value) -> Result<Value, RpcError> {
        match method {
            "echo" => Ok(params),
            "sleep" => {
                let ms = params["ms"]
                    .as_u64()
                    .ok_or_else(|| RpcError::invalid_params("`ms` must be a number"))?;
                *self.sleeping.lock().unwrap() += 1;
                self.sleep_started.notify_all();
                std::thread::sleep(Duration::from_millis(ms));
                Ok(json!("slept"))
            }
            "fail" => Err(RpcError::application(-32042, "it failed").with_data(json!({"why": 1}))),
            "count" => Ok(json!(self.counted.fetch_add(1, Ordering::SeqCst) + 1)),
            "panic" => panic!("test handler panics on purpose"),
            _ => Err(RpcError::method_not_found(method)),
        }
    }
}

struct Running {
    _dir: tempfile::TempDir,
    path: PathBuf,
    handler: Arc<TestHandler>,
    stop: StopHandle,
    thread: Option<JoinHandle<Result<(), Error>>>,
}

impl Running {
    fn start() -> Running {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ctl.sock");
        let handler = Arc::new(TestHandler::default());
        let server = ControlServer::bind(&path, handler.clone()).unwrap();
        let stop = server.stop_handle();
        let thread = Some(std::thread::spawn(move || server.run()));
        Running {
            _dir: dir,
            path,
            handler,
            stop,
            thread,
        }
    }

    fn stop(&mut self) {
        self.stop.stop();
        if let Some(thread) = self.thread.take() {
            thread.join().unwrap().unwrap();
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            self.stop();
        }
    }
}

/// A raw line-level connection, with a read timeout so a missing reply fails the test
/// instead of hanging it.
struct Raw {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
}

impl Raw {
    fn connect(path: &Path) -> Raw {
        let stream = UnixStream::connect(path).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        Raw {
            writer: stream.try_clone().unwrap(),
            reader: BufReader::new(stream),
        }
    }

    fn send(&mut self, line: &str) {
        self.writer.write_all(line.as_bytes()).unwrap();
        self.writer.write_all(b"\n").unwrap();
    }

    fn recv(&mut self) -> Value {
        let mut line = String::new();
        self.reader.read_line(&mut line).unwrap();
        assert!(line.ends_with('\n'), "no complete response line: {line:?}");
        serde_json::from_str(&line).unwrap()
    }

    fn roundtrip(&mut self, line: &str) -> Value {
        self.send(line);
        self.recv()
    }

    /// True if the server closed the connection: end-of-file, or a reset when it closed with
    /// our unread data still queued (Linux reports ECONNRESET then).
    fn at_eof(&mut self) -> bool {
        let mut line = String::new();
        match self.reader.read_line(&mut line) {
            Ok(n) => n == 0,
            Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
        }
    }
}

fn error_code(response: &Value) -> i64 {
    response["error"]["code"]
        .as_i64()
        .unwrap_or_else(|| panic!("not an error response: {response}"))
}

#[test]
fn malformed_json_gets_parse_error_and_connection_stays_usable() {
    let server = Running::start();
    let mut raw = Raw::connect(&server.path);
    for bad in ["{", "{\"jsonrpc\": \"2.0\", \"method\": }", "nope", "\u{1}"] {
        let response = raw.roundtrip(bad);
        assert_eq!(error_code(&response), PARSE_ERROR, "{bad}");
        assert_eq!(response["id"], Value::Null);
        assert_eq!(response["jsonrpc"], "2.0");
    }
    // Invalid UTF-8 is a parse error too.
    raw.writer.write_all(b"\xff\xfe\n").unwrap();
    assert_eq!(error_code(&raw.recv()), PARSE_ERROR);
    let response = raw.roundtrip(r#"{"jsonrpc":"2.0","method":"echo","params":{"a":1},"id":1}"#);
    assert_eq!(response, json!({"jsonrpc":"2.0","result":{"a":1},"id":1}));
}

#[test]
fn invalid_requests_get_invalid_request() {
    let server = Running::start();
    let mut raw = Raw::connect(&server.path);
    let cases = [
        ("42", Value::Null),
        ("\"echo\"", Value::Null),
        ("null", Value::Null),
        ("[]", Value::Null),
        (r#"{"method":"echo","id":1}"#, json!(1)),
        (r#"{"jsonrpc":"1.0","method":"echo","id":2}"#, json!(2)),
        (r#"{"jsonrpc":2.0,"method":"echo","id":3}"#, json!(3)),
        (r#"{"jsonrpc":"2.0","method":5,"id":4}"#, json!(4)),
        (r#"{"jsonrpc":"2.0","id":5}"#, json!(5)),
        (
            r#"{"jsonrpc":"2.0","method":"echo","params":"x","id":6}"#,
            json!(6),
        ),
        (
            r#"{"jsonrpc":"2.0","method":"echo","id":{"a":1}}"#,
            Value::Null,
        ),
        (r#"{"jsonrpc":"2.0","method":"echo","id":[1]}"#, Value::Null),
        // Shape errors are answered even without an id.
        (r#"{"jsonrpc":"2.0","method":7}"#, Value::Null),
    ];
    for (line, id) in cases {
        let response = raw.roundtrip(line);
        assert_eq!(error_code(&response), INVALID_REQUEST, "{line}: {response}");
        assert_eq!(response["id"], id, "{line}");
    }
    // Still usable afterwards.
    let response = raw.roundtrip(r#"{"jsonrpc":"2.0","method":"echo","id":"x"}"#);
    assert_eq!(response, json!({"jsonrpc":"2.0","result":null,"id":"x"}));
}

#[test]
fn unknown_method_and_handler_errors() {
    let server = Running::start();
    let mut raw = Raw::connect(&server.path);
    let response = raw.roundtrip(r#"{"jsonrpc":"2.0","method":"frobnicate","id":1}"#);
    assert_eq!(error_code(&response), METHOD_NOT_FOUND);
    assert!(response["error"]["message"]
        .as_str()
        .unwrap()
        .contains("frobnicate"));

    let response = raw.roundtrip(r#"{"jsonrpc":"2.0","method":"sleep","params":{},"id":2}"#);
    assert_eq!(error_code(&response), INVALID_PARAMS);
    assert_eq!(response["id"], 2);

    let response = raw.roundtrip(r#"{"jsonrpc":"2.0","method":"fail","id":3}"#);
    assert_eq!(
        response,
        json!({"jsonrpc":"2.0","error":{"code":-32042,"message":"it failed","data":{"why":1}},"id":3})
    );

    // A panicking handler is an internal error, not a dead connection.
    let response = raw.roundtrip(r#"{"jsonrpc":"2.0","method":"panic","id":4}"#);
    assert_eq!(error_code(&response), INTERNAL_ERROR);
    let response = raw.roundtrip(r#"{"jsonrpc":"2.0","method":"echo","params":[1],"id":5}"#);
    assert_eq!(response["result"], json!([1]));
}

#[test]
fn ids_of_every_kind_are_echoed() {
    let server = Running::start();
    let mut raw = Raw::connect(&server.path);
    for id in [
        json!(0),
        json!(-7),
        json!(1.5),
        json!("abc"),
        json!(""),
        Value::Null,
    ] {
        let request = json!({"jsonrpc":"2.0","method":"echo","params":[true],"id":id});
        let response = raw.roundtrip(&request.to_string());
        assert_eq!(
            response,
            json!({"jsonrpc":"2.0","result":[true],"id":id}),
            "{id}"
        );
    }
}

#[test]
fn notifications_get_no_reply() {
    let server = Running::start();
    let mut raw = Raw::connect(&server.path);
    raw.send(r#"{"jsonrpc":"2.0","method":"count"}"#);
    raw.send(r#"{"jsonrpc":"2.0","method":"no-such-method"}"#);
    raw.send(r#"{"jsonrpc":"2.0","method":"fail","params":[]}"#);
    raw.send("");
    // Replies come in order, so if any notification had been answered it would come first.
    let response = raw.roundtrip(r#"{"jsonrpc":"2.0","method":"count","id":7}"#);
    assert_eq!(response, json!({"jsonrpc":"2.0","result":2,"id":7}));
    assert_eq!(server.handler.counted.load(Ordering::SeqCst), 2);

    // Through the client API too.
    let mut client = Client::connect(&server.path).unwrap();
    client.notify("count", Value::Null).unwrap();
    assert_eq!(client.call("count", Value::Null).unwrap(), json!(4));
}

#[test]
fn batches() {
    let server = Running::start();
    let mut raw = Raw::connect(&server.path);
    let response = raw.roundtrip(
        r#"[{"jsonrpc":"2.0","method":"echo","params":[1],"id":1},
            {"jsonrpc":"2.0","method":"count"},
            {"jsonrpc":"2.0","method":"nope","id":"b"},
            {"foo":"bar"}]"#
            .replace('\n', " ")
            .as_str(),
    );
    let items = response.as_array().expect("a batch response is an array");
    assert_eq!(items.len(), 3);
    assert_eq!(items[0], json!({"jsonrpc":"2.0","result":[1],"id":1}));
    assert_eq!(error_code(&items[1]), METHOD_NOT_FOUND);
    assert_eq!(items[1]["id"], "b");
    assert_eq!(error_code(&items[2]), INVALID_REQUEST);
    // All notifications: nothing at all comes back.
    raw.send(r#"[{"jsonrpc":"2.0","method":"count"},{"jsonrpc":"2.0","method":"count"}]"#);
    let response = raw.roundtrip(r#"{"jsonrpc":"2.0","method":"count","id":9}"#);
    assert_eq!(response["result"], 4);
}

#[test]
fn overlong_line_gets_an_error_then_the_connection_closes() {
    let server = Running::start();
    let mut raw = Raw::connect(&server.path);
    let mut writer = raw.writer.try_clone().unwrap();
    // Written from another thread: the server stops reading after the cap, so our write of
    // the rest may block or fail with EPIPE, which is expected.
    let sender = std::thread::spawn(move || {
        let line = vec![b' '; MAX_LINE + 4096];
        let _ = writer.write_all(&line);
        let _ = writer.write_all(b"\n");
    });
    let response = raw.recv();
    assert_eq!(error_code(&response), INVALID_REQUEST);
    assert!(raw.at_eof());
    sender.join().unwrap();
    // Other clients are unaffected.
    assert_eq!(call(&server.path, "echo", json!([2])).unwrap(), json!([2]));
}

#[test]
fn line_of_exactly_the_cap_is_accepted() {
    let server = Running::start();
    let mut raw = Raw::connect(&server.path);
    let request = r#"{"jsonrpc":"2.0","method":"echo","params":[],"id":1}"#;
    let mut line = String::from(request);
    line.push_str(&" ".repeat(MAX_LINE - request.len()));
    assert_eq!(line.len(), MAX_LINE);
    let response = raw.roundtrip(&line);
    assert_eq!(response["result"], json!([]));
}

#[test]
fn slow_request_does_not_block_other_clients() {
    let server = Running::start();
    let path = server.path.clone();
    let slow = std::thread::spawn(move || {
        let result = call(&path, "sleep", json!({"ms": 500})).unwrap();
        (result, Instant::now())
    });
    server.handler.wait_sleeping(1);
    let fast: Vec<_> = (0..15)
        .map(|i| {
            let path = server.path.clone();
            std::thread::spawn(move || {
                let mut client = Client::connect(&path).unwrap();
                for j in 0..3 {
                    assert_eq!(
                        client.call("echo", json!({"i": i, "j": j})).unwrap(),
                        json!({"i": i, "j": j})
                    );
                }
                Instant::now()
            })
        })
        .collect();
    let fast_done: Vec<Instant> = fast.into_iter().map(|t| t.join().unwrap()).collect();
    let (result, slow_done) = slow.join().unwrap();
    assert_eq!(result, json!("slept"));
    for done in fast_done {
        assert!(done < slow_done, "a quick client waited for the slow one");
    }
}

#[test]
fn one_connection_answers_in_order() {
    let server = Running::start();
    let mut raw = Raw::connect(&server.path);
    // Pipelined: the slow request is first, so its reply must be first.
    raw.send(r#"{"jsonrpc":"2.0","method":"sleep","params":{"ms":200},"id":1}"#);
    raw.send(r#"{"jsonrpc":"2.0","method":"echo","id":2}"#);
    assert_eq!(raw.recv()["id"], 1);
    assert_eq!(raw.recv()["id"], 2);
}

#[test]
fn socket_mode_is_0600_and_no_temporary_files_remain() {
    let server = Running::start();
    let meta = std::fs::symlink_metadata(&server.path).unwrap();
    assert_eq!(meta.permissions().mode() & 0o7777, 0o600);
    let names: Vec<_> = std::fs::read_dir(server.path.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, vec![std::ffi::OsString::from("ctl.sock")]);
}

#[test]
fn stop_lets_a_request_in_progress_finish() {
    let mut server = Running::start();
    // An idle client must not keep the server from stopping.
    let mut idle = Raw::connect(&server.path);
    let path = server.path.clone();
    let slow = std::thread::spawn(move || call(&path, "sleep", json!({"ms": 500})));
    server.handler.wait_sleeping(1);
    server.stop.stop();
    assert_eq!(slow.join().unwrap().unwrap(), json!("slept"));
    server.stop();
    assert!(idle.at_eof());
    assert!(!server.path.exists(), "the socket file is removed on stop");
    let err = call(&server.path, "echo", Value::Null).unwrap_err();
    assert!(matches!(err, ClientError::NotRunning { .. }), "{err:?}");
}

#[test]
fn second_bind_on_a_live_socket_fails() {
    let server = Running::start();
    let err = ControlServer::bind(&server.path, Arc::new(TestHandler::default())).unwrap_err();
    assert!(matches!(err, Error::InUse { .. }), "{err:?}");
    assert!(err.to_string().contains("already listening"), "{err}");
    // The first server is untouched.
    assert_eq!(call(&server.path, "echo", json!([1])).unwrap(), json!([1]));
    // A bound but not yet running server counts as live too (it already listens).
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s");
    let _first = ControlServer::bind(&path, Arc::new(TestHandler::default())).unwrap();
    let err = ControlServer::bind(&path, Arc::new(TestHandler::default())).unwrap_err();
    assert!(matches!(err, Error::InUse { .. }), "{err:?}");
}

#[test]
fn stale_socket_is_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ctl.sock");
    drop(UnixListener::bind(&path).unwrap());
    assert!(path.exists());
    let server = ControlServer::bind(&path, Arc::new(TestHandler::default())).unwrap();
    let stop = server.stop_handle();
    let thread = std::thread::spawn(move || server.run());
    assert_eq!(call(&path, "echo", json!(["x"])).unwrap(), json!(["x"]));
    stop.stop();
    thread.join().unwrap().unwrap();
    assert!(!path.exists());
}

#[test]
fn non_socket_files_are_not_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("important.txt");
    std::fs::write(&path, "keep me").unwrap();
    let err = ControlServer::bind(&path, Arc::new(TestHandler::default())).unwrap_err();
    assert!(matches!(err, Error::NotASocket { .. }), "{err:?}");
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "keep me");
    // No temporary directory was left behind either.
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
}

#[test]
fn dropping_an_unrun_server_removes_its_socket() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s");
    let server = ControlServer::bind(&path, Arc::new(TestHandler::default())).unwrap();
    assert!(path.exists());
    drop(server);
    assert!(!path.exists());
}

#[test]
fn stop_before_run_returns_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s");
    let server = ControlServer::bind(&path, Arc::new(TestHandler::default())).unwrap();
    server.stop_handle().stop();
    server.run().unwrap();
    assert!(!path.exists());
}

#[test]
fn relative_paths_work() {
    // bind makes the path absolute; the client resolves it against the same directory.
    let dir = tempfile::tempdir_in(".").unwrap();
    let relative = dir
        .path()
        .strip_prefix(std::env::current_dir().unwrap())
        .unwrap_or(dir.path())
        .join("s");
    let server = ControlServer::bind(&relative, Arc::new(TestHandler::default())).unwrap();
    assert!(server.path().is_absolute());
    drop(server);
    assert!(!relative.exists());
}

#[test]
fn client_errors_are_clear() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.sock");
    let err = call(&missing, "echo", Value::Null).unwrap_err();
    assert!(matches!(err, ClientError::NotRunning { .. }), "{err:?}");
    assert!(
        err.to_string().contains("cryptblk serve --control"),
        "{err}"
    );
    // A stale socket (refused) is "not running" too.
    let stale = dir.path().join("stale.sock");
    drop(UnixListener::bind(&stale).unwrap());
    let err = call(&stale, "echo", Value::Null).unwrap_err();
    assert!(matches!(err, ClientError::NotRunning { .. }), "{err:?}");

    let server = Running::start();
    let mut client = Client::connect(&server.path).unwrap();
    match client.call("fail", Value::Null).unwrap_err() {
        ClientError::Rpc(e) => {
            assert_eq!(e.code, -32042);
            assert_eq!(e.message, "it failed");
            assert_eq!(e.data, Some(json!({"why": 1})));
        }
        other => panic!("{other:?}"),
    }
    match client.call("nope", Value::Null).unwrap_err() {
        ClientError::Rpc(e) => assert_eq!(e.code, METHOD_NOT_FOUND),
        other => panic!("{other:?}"),
    }
    // The connection survives error responses.
    assert_eq!(
        client.call("echo", json!({"k": "v"})).unwrap(),
        json!({"k": "v"})
    );
}

#[test]
fn requests_read_after_stop_are_refused_not_run() {
    let mut server = Running::start();
    let mut raw = Raw::connect(&server.path);
    raw.send(r#"{"jsonrpc":"2.0","method":"sleep","params":{"ms":300},"id":1}"#);
    server.handler.wait_sleeping(1);
    // Queued behind the slow request, so it is read only after stop.
    raw.send(r#"{"jsonrpc":"2.0","method":"count","id":2}"#);
    server.stop.stop();
    assert_eq!(raw.recv(), json!({"jsonrpc":"2.0","result":"slept","id":1}));
    // Either refused with SERVER_SHUTTING_DOWN or the connection was closed: never run.
    let mut line = String::new();
    if raw.reader.read_line(&mut line).unwrap() > 0 {
        let response: Value = serde_json::from_str(&line).unwrap();
        assert_eq!(
            error_code(&response),
            cryptblk_control::SERVER_SHUTTING_DOWN
        );
        assert_eq!(response["id"], 2);
    }
    server.stop();
    assert_eq!(server.handler.counted.load(Ordering::SeqCst), 0);
}
