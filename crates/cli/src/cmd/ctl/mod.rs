//! `cryptblk ctl`: drive a running daemon through its control socket
//! (`cryptblk serve --control PATH`). Each verb is one JSON-RPC 2.0 call whose method has the
//! verb's name; the result is printed as pretty JSON so scripts can pipe it to `jq`.
//!
//! The verbs, their flags and their help are made from the daemon's method table
//! (`cryptblk_control::api::METHODS`), and the params are checked with the same types the
//! daemon parses them with, so `ctl` offers exactly what the daemon accepts.
//!
//! Secrets never travel in the JSON: key-file options send the file's absolute path and the
//! daemon reads it; `--key-fd N` (and `--key-file -`, our stdin) pass the descriptor itself
//! with the request (SCM_RIGHTS) and the daemon reads the passphrase from it; `--key-secret`
//! sends it encrypted with the daemon's master key (the ciphertext may show; the passphrase
//! never does). So no passphrase appears in clear on the wire's JSON, in argv, in a file or in
//! the daemon's request logs. All paths
//! are made absolute here because the daemon's working directory is not ours.
use crate::args::ctl::{CtlArgs, Given};
use crate::exit::UsageError;
use anyhow::{bail, Context, Result};
use cryptblk_control::api::{ParamKind, Request};
use cryptblk_control::Client;
use serde_json::{Map, Value};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;

/// A descriptor of ours that goes with the request; its index in the request is its place in
/// the list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Passed {
    Fd(i32),
    /// `--key-file -`: our stdin (a pipe or a file, never a terminal).
    Stdin,
}

pub fn run(a: &CtlArgs) -> Result<()> {
    let result = execute(a)?;
    println!("{}", serde_json::to_string_pretty(&result)?);
    Ok(())
}

/// Sends the verb's request and returns the result, reporting an error response's data on
/// stderr; the error itself carries the daemon's code, which decides the exit status.
fn execute(a: &CtlArgs) -> Result<Value> {
    let (method, params, passed) = request_with_fds(a)?;
    let fds = passed
        .iter()
        .map(|p| duplicate(*p))
        .collect::<Result<Vec<OwnedFd>>>()?;
    let borrowed: Vec<BorrowedFd<'_>> = fds.iter().map(AsFd::as_fd).collect();
    let mut client = Client::connect(&a.socket)?;
    match client.call_with_fds(method, params, &borrowed) {
        Ok(result) => Ok(result),
        Err(e) => {
            if let cryptblk_control::ClientError::Rpc(rpc) = &e {
                if let Some(data) = &rpc.data {
                    let data =
                        serde_json::to_string_pretty(data).unwrap_or_else(|_| data.to_string());
                    eprintln!("cryptblk: note: error data: {data}");
                }
            }
            Err(anyhow::Error::from(e).context(method))
        }
    }
}

/// A duplicate of the descriptor to pass (the daemon gets its own; ours stays as it was).
fn duplicate(passed: Passed) -> Result<OwnedFd> {
    let (fd, what) = match passed {
        Passed::Fd(fd) => (fd, format!("--key-fd {fd}")),
        Passed::Stdin => (0, "--key-file - (stdin)".to_string()),
    };
    // SAFETY: `fd` (non-negative: the parser's range) names a descriptor the user passed to
    // this process for this request; nothing here closes descriptors while the borrow lives,
    // for the one fcntl below, which fails with EBADF and changes nothing if it is not open.
    let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
    let Ok(owned) = rustix::io::fcntl_dupfd_cloexec(borrowed, 3) else {
        return Err(UsageError(format!(
            "{what}: descriptor {fd} is not open in this process; open it when starting ctl, \
             e.g. `--key-fd 3 3< <(vault read ...)`"
        ))
        .into());
    };
    if passed == Passed::Stdin && std::io::IsTerminal::is_terminal(&owned.as_fd()) {
        return Err(UsageError(
            "--key-file -: stdin is a terminal; pipe the passphrase in (the daemon reads it to \
             its end)"
                .into(),
        )
        .into());
    }
    Ok(owned)
}

/// The JSON-RPC method and params for a verb, checked with the daemon's own param types.
#[cfg(test)]
fn request(a: &CtlArgs) -> Result<(&'static str, Value)> {
    request_with_fds(a).map(|(method, params, _)| (method, params))
}

/// The method and params of the request, and the descriptors to pass with it, in the order the params index them.
fn request_with_fds(a: &CtlArgs) -> Result<(&'static str, Value, Vec<Passed>)> {
    let mut params = Map::new();
    let mut passed = Vec::new();
    for (p, given) in &a.values {
        let value = match (p.kind, given) {
            (ParamKind::KeyFile, Given::Path(path)) if is_stdin(path) => {
                // The daemon cannot open our stdin by name: pass it instead, as the matching
                // `*-fd` param.
                if passed.contains(&Passed::Stdin) {
                    return Err(UsageError(
                        "stdin can supply only one passphrase: pass the other with a key file \
                         or --key-fd"
                            .into(),
                    )
                    .into());
                }
                let fd_param = p.name.replace("-file", "-fd");
                params.insert(fd_param, Value::from(passed.len()));
                passed.push(Passed::Stdin);
                continue;
            }
            (ParamKind::KeyFile, Given::Path(path)) => key_file_path(path, p.name)?,
            (ParamKind::KeyFd, Given::Fd(fd)) => {
                let index = match passed.iter().position(|q| *q == Passed::Fd(*fd)) {
                    Some(i) => i,
                    None => {
                        passed.push(Passed::Fd(*fd));
                        passed.len() - 1
                    }
                };
                Value::from(index)
            }
            (_, Given::Fd(fd)) => Value::from(*fd),
            (_, Given::Path(path)) => absolute(path)?,
            (ParamKind::FlagIfGiven, Given::Bool(false)) => continue,
            (ParamKind::FlagDefaultOn, Given::Bool(no)) => Value::Bool(!no),
            (_, Given::Bool(b)) => Value::Bool(*b),
            (_, Given::Number(n)) => Value::from(*n),
            (_, Given::Text(s)) => Value::String(s.clone()),
        };
        params.insert(p.name.to_string(), value);
    }
    // One source per passphrase (`PREFIX-file`, `-fd` or `-secret`), checked before sending.
    for p in a
        .method
        .params
        .iter()
        .filter(|p| p.kind == ParamKind::KeyFd)
    {
        let prefix = p.name.trim_end_matches("-fd");
        let given = |suffix: &str| params.contains_key(&format!("{prefix}-{suffix}"));
        let given = cryptblk_control::api::KeyParams {
            file: given("file").then(|| Path::new("")),
            fd: given("fd").then_some(0),
            secret: given("secret").then_some(""),
            secret_iv: given("secret-iv").then_some(""),
        };
        cryptblk_control::api::key_source(given, prefix, false)
            .map_err(|e| UsageError(format!("{}: {}", a.method.name, e.message)))?;
    }
    let params = Value::Object(params);
    Request::parse(a.method.name, params.clone())
        .map_err(|e| UsageError(format!("{}: {}", a.method.name, e.message)))?;
    if passed.len() > cryptblk_control::MAX_FDS_PER_REQUEST {
        bail!(UsageError(format!(
            "at most {} descriptors go with one request",
            cryptblk_control::MAX_FDS_PER_REQUEST
        )));
    }
    Ok((a.method.name, params, passed))
}

fn is_stdin(path: &Path) -> bool {
    path == Path::new("-") || path == Path::new("/dev/stdin")
}

/// Absolute (not canonicalised: the daemon should see the path the user named, and the file
/// may legitimately not exist yet on our side of a mount namespace) and valid UTF-8, since
/// JSON strings cannot carry arbitrary bytes.
fn absolute(path: &Path) -> Result<Value> {
    // An RBD image name is not a path: the daemon opens it as it is.
    if let Some(rbd) = cryptblk_control::api::rbd_name(path) {
        return Ok(rbd.into());
    }
    let absolute =
        std::path::absolute(path).with_context(|| format!("making {} absolute", path.display()))?;
    match absolute.to_str() {
        Some(s) => Ok(s.into()),
        None => bail!(
            "{}: only UTF-8 paths can be sent to the daemon",
            path.display()
        ),
    }
}

/// Key files are opened by the daemon by path, where our descriptors mean nothing (stdin is
/// passed as a descriptor before this is reached).
fn key_file_path(path: &Path, option: &str) -> Result<Value> {
    let s = path.to_string_lossy();
    let local_only = ["/dev/fd/", "/proc/self/fd/"]
        .iter()
        .any(|prefix| s.starts_with(prefix));
    if local_only {
        let fd_option = option.replace("-file", "-fd");
        return Err(UsageError(format!(
            "--{option} {s}: the daemon opens key files by path, where our descriptors mean \
             nothing; pass the descriptor itself with --{fd_option} N"
        ))
        .into());
    }
    absolute(path)
}

#[cfg(test)]
mod tests;
