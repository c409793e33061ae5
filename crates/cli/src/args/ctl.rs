//! `cryptblk ctl`'s arguments: a verb per method of the daemon's table
//! (`cryptblk_control::api::METHODS`), its flags and help made from the method's params, parsed
//! into what `cmd::ctl` sends.
use clap::{Arg, ArgAction, ArgMatches, Command};
use cryptblk_control::api::{MethodSpec, ParamKind, ParamSpec, METHODS};
use std::path::PathBuf;

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
    pub(crate) socket: PathBuf,
    pub(crate) method: &'static MethodSpec,
    pub(crate) values: Vec<(ParamSpec, Given)>,
}

/// One param's value from the command line, before it becomes JSON.
#[derive(Debug)]
pub(crate) enum Given {
    Text(String),
    Path(PathBuf),
    Bool(bool),
    Number(u64),
    /// One of our descriptors, to pass with the request.
    Fd(i32),
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
