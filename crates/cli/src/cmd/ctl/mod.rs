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
use crate::exit::UsageError;
use anyhow::{bail, Context, Result};
use clap::{Arg, ArgAction, ArgMatches, Command};
use cryptblk_control::api::{MethodSpec, ParamKind, ParamSpec, Request, METHODS};
use cryptblk_control::Client;
use serde_json::{Map, Value};
use std::os::fd::{AsFd, BorrowedFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};

/// After-help of `cryptblk ctl`: the protocol reference for orchestrators that talk to the
/// socket directly.
pub fn help() -> String {
    format!(
        "\
Protocol (for programs talking to the socket directly): JSON-RPC 2.0 over the UNIX socket,
one JSON object per line each way, e.g.
  {{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"disk-list\",\"params\":{{}}}}
Paths must be absolute (the daemon resolves nothing against its working directory).
Key files are passed by path and read by the daemon; never send a passphrase. A key may
instead come in a descriptor passed with the request line (SCM_RIGHTS ancillary data, at most
4 per request), named by its index among them: \"key-fd\": 0. ctl --key-fd N passes its
descriptor N (e.g. 3< <(vault read ...)); --key-file - passes its stdin. Or, as QEMU's
secret objects: \"key-secret\" is base64 of the passphrase's AES-256-CBC ciphertext (PKCS#7
padding) under the daemon's master key (serve --master-key-file), \"key-secret-iv\" base64
of its 16-byte IV.

Methods and params (? = optional):
{}  (addr: tcp:HOST:PORT or unix:PATH; tls-creds: QEMU x509 layout, both ends verified;
   ms: milliseconds; bytes: a number, ctl also takes K, M, G suffixes)

Errors:
{}`cryptblk ctl` prints the result as JSON on stdout; on an error it prints the message on
stderr and exits with the status of the error's kind (see `cryptblk --help`).",
        cryptblk_control::api::methods_reference(),
        cryptblk_control::api::errors_reference()
    )
}

/// A verb with its arguments, as given.
#[derive(Debug)]
pub struct CtlArgs {
    socket: PathBuf,
    method: &'static MethodSpec,
    values: Vec<(ParamSpec, Given)>,
}

/// One param's value from the command line, before it becomes JSON.
#[derive(Debug)]
enum Given {
    Text(String),
    Path(PathBuf),
    Bool(bool),
    Number(u64),
    /// One of our descriptors, to pass with the request.
    Fd(i32),
}

/// A descriptor of ours that goes with the request; its index in the request is its place in
/// the list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Passed {
    Fd(i32),
    /// `--key-file -`: our stdin (a pipe or a file, never a terminal).
    Stdin,
}

/// The flag (or positional) id of a param.
fn arg_id(p: &ParamSpec) -> String {
    match p.kind {
        ParamKind::FlagDefaultOn => format!("no-{}", p.name),
        _ => p.name.to_string(),
    }
}

fn param_arg(p: &ParamSpec) -> Arg {
    let id = arg_id(p);
    let arg = Arg::new(id.clone()).help(p.help);
    match p.kind {
        ParamKind::Name => arg.value_name("NAME").required(p.required),
        ParamKind::Checkpoint => arg.value_name("CHECKPOINT").required(p.required),
        ParamKind::Flag | ParamKind::FlagIfGiven | ParamKind::FlagDefaultOn => {
            arg.long(id).action(ArgAction::SetTrue)
        }
        // A size the method cannot do without is positional, after the name, as in `virsh
        // blockresize DOMAIN PATH SIZE`: `ctl disk-resize NAME SIZE`.
        ParamKind::Bytes if p.required => arg
            .value_name("SIZE")
            .required(true)
            .value_parser(crate::size::parse_size),
        kind => {
            let arg = arg.long(id).required(p.required);
            match kind {
                ParamKind::Text => arg.value_name("TEXT"),
                ParamKind::Path => arg
                    .value_name("PATH")
                    .value_parser(clap::value_parser!(PathBuf)),
                ParamKind::KeyFile => arg
                    .value_name("FILE")
                    .value_parser(clap::value_parser!(PathBuf)),
                ParamKind::Address => arg.value_name("ADDR"),
                ParamKind::Base64 => arg.value_name("BASE64"),
                ParamKind::Count => arg.value_name("N").value_parser(clap::value_parser!(u64)),
                ParamKind::KeyFd => arg
                    .value_name("FD")
                    .value_parser(clap::value_parser!(i32).range(0..)),
                ParamKind::Millis => arg.value_name("MS").value_parser(clap::value_parser!(u64)),
                ParamKind::Bytes => arg.value_name("SIZE").value_parser(crate::size::parse_size),
                ParamKind::Choice(names) => arg
                    .value_name(names.join("|"))
                    .value_parser(clap::builder::PossibleValuesParser::new(names)),
                _ => unreachable!("handled above"),
            }
        }
    }
}

impl clap::Args for CtlArgs {
    fn augment_args(cmd: Command) -> Command {
        let cmd = cmd
            .arg(
                Arg::new("socket")
                    .long("socket")
                    .short('s')
                    .value_name("PATH")
                    .required(true)
                    .value_parser(clap::value_parser!(PathBuf))
                    .help("The daemon's control socket (`cryptblk serve --control PATH`)."),
            )
            .subcommand_required(true)
            .after_help(help());
        METHODS.iter().fold(cmd, |cmd, m| {
            let verb = m
                .params
                .iter()
                .fold(Command::new(m.name).about(m.summary), |verb, p| {
                    verb.arg(param_arg(p))
                });
            cmd.subcommand(verb)
        })
    }

    fn augment_args_for_update(cmd: Command) -> Command {
        Self::augment_args(cmd)
    }
}

impl clap::FromArgMatches for CtlArgs {
    fn from_arg_matches(m: &ArgMatches) -> Result<Self, clap::Error> {
        let socket = m
            .get_one::<PathBuf>("socket")
            .cloned()
            .ok_or_else(|| clap::Error::new(clap::error::ErrorKind::MissingRequiredArgument))?;
        let (verb, vm) = m
            .subcommand()
            .ok_or_else(|| clap::Error::new(clap::error::ErrorKind::MissingSubcommand))?;
        let method = cryptblk_control::api::method(verb)
            .ok_or_else(|| clap::Error::new(clap::error::ErrorKind::InvalidSubcommand))?;
        let mut values = Vec::new();
        for p in method.params {
            let id = arg_id(p);
            let given = match p.kind {
                ParamKind::Flag | ParamKind::FlagIfGiven | ParamKind::FlagDefaultOn => {
                    Some(Given::Bool(vm.get_flag(&id)))
                }
                ParamKind::Path | ParamKind::KeyFile => {
                    vm.get_one::<PathBuf>(&id).cloned().map(Given::Path)
                }
                ParamKind::Count | ParamKind::Millis | ParamKind::Bytes => {
                    vm.get_one::<u64>(&id).copied().map(Given::Number)
                }
                ParamKind::KeyFd => vm.get_one::<i32>(&id).copied().map(Given::Fd),
                ParamKind::Name
                | ParamKind::Checkpoint
                | ParamKind::Text
                | ParamKind::Address
                | ParamKind::Base64
                | ParamKind::Choice(_) => vm.get_one::<String>(&id).cloned().map(Given::Text),
            };
            if let Some(given) = given {
                values.push((*p, given));
            }
        }
        Ok(CtlArgs {
            socket,
            method,
            values,
        })
    }

    fn update_from_arg_matches(&mut self, m: &ArgMatches) -> Result<(), clap::Error> {
        *self = Self::from_arg_matches(m)?;
        Ok(())
    }
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
    // SAFETY: fcntl(F_DUPFD_CLOEXEC) only reads the descriptor table; on success the new
    // descriptor is ours alone.
    let dup = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 3) };
    if dup < 0 {
        return Err(UsageError(format!(
            "{what}: descriptor {fd} is not open in this process; open it when starting ctl, \
             e.g. `--key-fd 3 3< <(vault read ...)`"
        ))
        .into());
    }
    // SAFETY: `dup` was just created and nothing else owns it.
    let owned = unsafe { OwnedFd::from_raw_fd(dup) };
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
