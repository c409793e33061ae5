//! `ctl`'s argument contract: what each command line sends as a request.
use super::*;
use clap::{CommandFactory, Parser};
use cryptblk_control::api::METHODS;
use cryptblk_control::{ControlServer, RpcError};
use serde_json::json;
use std::sync::Arc;

#[derive(Parser, Debug)]
struct Cli {
    #[command(flatten)]
    ctl: CtlArgs,
}

fn parse(args: &[&str]) -> CtlArgs {
    let mut argv = vec!["ctl"];
    argv.extend_from_slice(args);
    Cli::try_parse_from(argv).unwrap().ctl
}

fn abs(p: &str) -> String {
    std::env::current_dir()
        .unwrap()
        .join(p)
        .to_str()
        .unwrap()
        .to_owned()
}

#[test]
fn verbs_map_to_methods_and_params() {
    let a = parse(&[
        "-s",
        "c.sock",
        "disk-add",
        "vm1",
        "--image",
        "disk.luks",
        "--key-file",
        "pass.txt",
        "--vhost-user-blk",
        "/run/vm1.sock",
        "--num-queues",
        "4",
        "--readonly",
    ]);
    assert_eq!(
        request(&a).unwrap(),
        (
            "disk-add",
            json!({"name": "vm1", "image": abs("disk.luks"), "key-file": abs("pass.txt"),
                   "vhost-user-blk": "/run/vm1.sock", "num-queues": 4,
                   "nbd-export": false, "readonly": true, "discard": false,
                   "unsealed-memory": false})
        )
    );
    let a = parse(&[
        "--socket",
        "c",
        "disk-add",
        "d",
        "--image",
        "/i",
        "--nbd-export",
        "--cache",
        "writeback",
        "--serial",
        "s1",
    ]);
    assert_eq!(
        request(&a).unwrap().1,
        json!({"name": "d", "image": "/i", "nbd-export": true, "readonly": false,
               "discard": false, "serial": "s1", "cache": "writeback",
               "unsealed-memory": false})
    );
    let cases: [(&[&str], &str, Value); 11] = [
        (
            &["disk-resize", "d", "20G"],
            "disk-resize",
            json!({"name": "d", "size": 20u64 << 30, "allow-shrink": false}),
        ),
        (
            &["disk-resize", "d", "512K", "--allow-shrink"],
            "disk-resize",
            json!({"name": "d", "size": 512 << 10, "allow-shrink": true}),
        ),
        (
            &["disk-remove", "d", "--force"],
            "disk-remove",
            json!({"name": "d", "force": true}),
        ),
        (
            &["disk-remove", "d"],
            "disk-remove",
            json!({"name": "d", "force": false}),
        ),
        (&["disk-list"], "disk-list", json!({})),
        (&["stats"], "stats", json!({})),
        (&["stats", "d"], "stats", json!({"name": "d"})),
        (
            &["key-add", "d", "--key-file", "/a", "--new-key-file", "b"],
            "key-add",
            json!({"name": "d", "key-file": "/a", "new-key-file": abs("b")}),
        ),
        (
            &[
                "migrate-start",
                "d",
                "--to",
                "tcp:h:1",
                "--no-break-chunks",
                "--chunk-size",
                "1M",
                "--connect-timeout",
                "500",
            ],
            "migrate-start",
            json!({"name": "d", "to": "tcp:h:1", "postcopy": false, "preempt": false, "shared": false,
                   "chunk-size": 1 << 20, "break-chunks": false, "connect-timeout": 500,
                   "insecure": false}),
        ),
        (
            &["migrate-switchover", "d"],
            "migrate-switchover",
            json!({"name": "d"}),
        ),
        (
            &["migrate-switchover", "d", "--postcopy"],
            "migrate-switchover",
            json!({"name": "d", "postcopy": true}),
        ),
    ];
    for (args, method, params) in cases {
        let mut argv = vec!["-s", "c"];
        argv.extend_from_slice(args);
        assert_eq!(
            request(&parse(&argv)).unwrap(),
            (method, params),
            "{args:?}"
        );
    }
    let a = parse(&["-s", "c", "key-remove", "d", "--key-file", "/k"]);
    assert_eq!(
        request(&a).unwrap(),
        ("key-remove", json!({"name": "d", "key-file": "/k"}))
    );
}

#[test]
fn params_the_daemon_would_refuse_are_refused_here() {
    let a = parse(&[
        "-s",
        "c",
        "disk-add",
        "d",
        "--image",
        "/i",
        "--num-queues",
        "70000",
    ]);
    let err = request(&a).unwrap_err();
    assert!(err.is::<UsageError>(), "{err}");
    assert!(err.to_string().contains("70000"), "{err}");
    let bad = Cli::try_parse_from([
        "ctl", "-s", "c", "disk-add", "d", "--image", "/i", "--cache", "fast",
    ]);
    assert!(bad.is_err());
    // disk-resize needs its size, and a size ctl can read.
    for args in [
        &["ctl", "-s", "c", "disk-resize", "d"][..],
        &["ctl", "-s", "c", "disk-resize", "d", "20X"],
        &["ctl", "-s", "c", "disk-resize", "d", "--size", "20G"],
    ] {
        assert!(Cli::try_parse_from(args).is_err(), "{args:?}");
    }
}

#[test]
fn fd_paths_as_key_files_are_refused() {
    for key in ["/dev/fd/3", "/proc/self/fd/0"] {
        let a = parse(&["-s", "c", "key-remove", "d", "--key-file", key]);
        let err = request(&a).unwrap_err().to_string();
        assert!(err.contains("--key-fd N"), "{err}");
    }
}

#[test]
fn key_fds_and_stdin_become_passed_descriptors() {
    let a = parse(&[
        "-s",
        "c",
        "key-add",
        "d",
        "--key-fd",
        "3",
        "--new-key-file",
        "-",
    ]);
    assert_eq!(
        request_with_fds(&a).unwrap(),
        (
            "key-add",
            json!({"name": "d", "key-fd": 0, "new-key-fd": 1}),
            vec![Passed::Fd(3), Passed::Stdin]
        )
    );
    let a = parse(&["-s", "c", "disk-add", "d", "--image", "/i", "--key-fd", "7"]);
    assert_eq!(
        request_with_fds(&a).unwrap().1,
        json!({"name": "d", "image": "/i", "key-fd": 0, "nbd-export": false,
               "readonly": false, "discard": false, "unsealed-memory": false})
    );
    let a = parse(&[
        "-s",
        "c",
        "key-add",
        "d",
        "--key-file",
        "-",
        "--new-key-file",
        "-",
    ]);
    let err = request(&a).unwrap_err().to_string();
    assert!(err.contains("only one passphrase"), "{err}");
    let a = parse(&[
        "-s",
        "c",
        "key-remove",
        "d",
        "--key-fd",
        "3",
        "--key-file",
        "/k",
    ]);
    let err = request(&a).unwrap_err().to_string();
    assert!(err.contains("give one of them"), "{err}");
    let e = duplicate(Passed::Fd(999)).unwrap_err().to_string();
    assert!(e.contains("not open in this process"), "{e}");
}

#[test]
fn key_secrets_are_sent_as_given_one_source_per_passphrase() {
    let a = parse(&[
        "-s",
        "c",
        "key-add",
        "d",
        "--key-fd",
        "3",
        "--new-key-secret",
        "c2VjcmV0IGNpcGhlcnRleHQ=",
        "--new-key-secret-iv",
        "AAAAAAAAAAAAAAAAAAAAAA==",
    ]);
    assert_eq!(
        request_with_fds(&a).unwrap(),
        (
            "key-add",
            json!({"name": "d", "key-fd": 0, "new-key-secret": "c2VjcmV0IGNpcGhlcnRleHQ=",
                   "new-key-secret-iv": "AAAAAAAAAAAAAAAAAAAAAA=="}),
            vec![Passed::Fd(3)]
        )
    );
    let a = parse(&[
        "-s",
        "c",
        "disk-add",
        "d",
        "--image",
        "/i",
        "--key-file",
        "/k",
        "--key-secret",
        "AAAA",
        "--key-secret-iv",
        "AAAA",
    ]);
    let err = request(&a).unwrap_err().to_string();
    assert!(err.contains("key-file and key-secret both"), "{err}");
    let a = parse(&["-s", "c", "key-remove", "d", "--key-secret", "AAAA"]);
    let err = request(&a).unwrap_err().to_string();
    assert!(err.contains("key-secret needs key-secret-iv"), "{err}");
    for verb in ["migrate-incoming", "reencrypt-start"] {
        let help = Cli::command()
            .find_subcommand_mut(verb)
            .unwrap()
            .render_help()
            .to_string();
        assert!(help.contains("--key-secret <BASE64>"), "{verb}: {help}");
        assert!(help.contains("--key-secret-iv <BASE64>"), "{verb}: {help}");
    }
}

#[test]
fn every_method_is_a_verb_with_a_flag_per_param() {
    let cmd = Cli::command();
    let verbs: Vec<&str> = cmd.get_subcommands().map(|c| c.get_name()).collect();
    let methods: Vec<&str> = METHODS.iter().map(|m| m.name).collect();
    assert_eq!(verbs, methods);
    for m in METHODS {
        let verb = cmd.find_subcommand(m.name).unwrap();
        let mut flags: Vec<String> = verb
            .get_arguments()
            .filter(|a| a.get_id() != "help")
            .map(|a| match a.get_long() {
                Some(long) => long.strip_prefix("no-").unwrap_or(long).to_string(),
                None => a.get_id().to_string(),
            })
            .collect();
        let mut accepted: Vec<String> = cryptblk_control::api::accepted_params(m.name)
            .unwrap()
            .into_iter()
            .map(str::to_string)
            .collect();
        flags.sort();
        accepted.sort();
        assert_eq!(flags, accepted, "ctl {}", m.name);
    }
}

#[test]
fn calls_the_daemon_and_reports_errors() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("ctl.sock");
    let handler = |method: &str, params: Value| match method {
        "disk-list" => Ok(json!({"method": method, "params": params})),
        "disk-remove" => {
            Err(RpcError::application(-32010, "no disk named `x`").with_data(json!({"name": "x"})))
        }
        _ => Err(RpcError::method_not_found(method)),
    };
    let server = ControlServer::bind(&socket, Arc::new(handler)).unwrap();
    let stop = server.stop_handle();
    let thread = std::thread::spawn(move || server.run());
    let sock = socket.to_str().unwrap();

    let result = execute(&parse(&["-s", sock, "disk-list"])).unwrap();
    assert_eq!(result, json!({"method": "disk-list", "params": {}}));

    let err = execute(&parse(&["-s", sock, "disk-remove", "x"])).unwrap_err();
    assert_eq!(
        crate::exit::one_line(&err),
        "disk-remove: no disk named `x` (JSON-RPC error -32010)"
    );
    assert_eq!(crate::exit::code_for(&err), crate::exit::OTHER);

    stop.stop();
    thread.join().unwrap().unwrap();
    let err = execute(&parse(&["-s", sock, "disk-list"])).unwrap_err();
    assert!(
        crate::exit::one_line(&err).contains("cryptblk serve --control"),
        "{err}"
    );
}

#[test]
fn a_passed_descriptor_is_duplicated_and_a_closed_one_named() {
    use std::os::fd::AsRawFd;
    let file = tempfile::tempfile().unwrap();
    let fd = file.as_raw_fd();
    let dup = duplicate(Passed::Fd(fd)).unwrap();
    assert!(dup.as_raw_fd() >= 3 && dup.as_raw_fd() != fd);
    let flags = rustix::io::fcntl_getfd(&dup).unwrap();
    assert!(flags.contains(rustix::io::FdFlags::CLOEXEC), "{flags:?}");

    // A number no descriptor of this process has: above the descriptor limit.
    let closed = i32::try_from(
        rustix::process::getrlimit(rustix::process::Resource::Nofile)
            .current
            .unwrap_or(1 << 20)
            .min(1 << 30),
    )
    .unwrap();
    let err = duplicate(Passed::Fd(closed)).unwrap_err();
    assert!(err.downcast_ref::<UsageError>().is_some(), "{err:#}");
    assert!(
        format!("{err:#}").contains(&format!(
            "--key-fd {closed}: descriptor {closed} is not open in this process"
        )),
        "{err:#}"
    );
}
