use super::*;

fn page(text: &str) -> Vec<Page> {
    vec![Page {
        path: "docs/x.md".into(),
        text: text.to_string(),
    }]
}

#[test]
fn invocations_come_from_code_blocks_and_spans() {
    let pages = page(
        "Run `cryptblk dump\n--json disk` or:\n\n```sh\n# as root (cryptblk must run as root):\nsudo X=1 cryptblk serve \\\n  --image a # note\necho | cryptblk ctl -s s disk-list 2> /dev/null\ncargo run --release -p cryptblk-bench -- list\n```\n",
    );
    let words: Vec<(usize, String)> = invocations(&pages, "cryptblk")
        .into_iter()
        .map(|i| (i.line, i.words.join(" ")))
        .collect();
    assert_eq!(
        words,
        [
            (1, "dump --json disk".to_string()),
            (6, "serve --image a".to_string()),
            (8, "ctl -s s disk-list".to_string())
        ]
    );
    let bench = invocations(&pages, "cryptblk-bench");
    assert_eq!(bench.len(), 1);
    assert_eq!(bench[0].words, ["list"]);
}

#[test]
fn help_gives_subcommands_options_and_values() {
    let help = parse_help(
        "Usage: x\n\nCommands:\n  serve  Run it\n          more text\n  help   Help\n\nOptions:\n  -d, --key-file <FILE>  The key\n  -p, --progress[=<MODE>]  Bar\n  -q, --batch-mode  Quiet [aliases: --quiet]\n\nQEMU connects with:\n  -object memory-backend-memfd\n",
    );
    assert_eq!(help.subcommands, ["serve", "help"]);
    assert_eq!(help.options.get("--key-file"), Some(&true));
    assert_eq!(help.options.get("-d"), Some(&true));
    assert_eq!(help.options.get("--progress"), Some(&false));
    assert_eq!(help.options.get("--quiet"), Some(&false));
    assert!(!help.options.contains_key("-object"));
}

#[test]
fn check_names_what_the_program_does_not_offer() {
    let root = tempfile_root("check");
    std::fs::create_dir_all(&root).unwrap();
    // A program whose help offers `serve --image FILE` and `ctl -s PATH disk-add --force`.
    let program = root.join("prog");
    std::fs::write(
        &program,
        "#!/bin/sh\ncase \"$*\" in\n\
         '--help') printf 'Usage: prog <COMMAND>\\n\\nCommands:\\n  serve  S\\n  ctl  C\\n\\nOptions:\\n  -h, --help  H\\n' ;;\n\
         'serve --help') printf 'Options:\\n      --image <FILE>  I\\n' ;;\n\
         'ctl --help') printf 'Usage: prog ctl <COMMAND>\\n\\nCommands:\\n  disk-add  A\\n\\nOptions:\\n  -s, --socket <PATH>  S\\n' ;;\n\
         'ctl disk-add --help') printf 'Options:\\n      --force  F\\n' ;;\n\
         esac\n",
    )
    .unwrap();
    std::fs::set_permissions(
        &program,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let pages = page(
        "```\nprog serve --image a.img\nprog ctl -s /run/s disk-add vm1 --force\nprog serve --imag a\nprog ctl -s /run/s disk-add --no-force\nprog ctl disk-ad vm1 --force\n```\n",
    );
    let mut cli = Cli::new(&program);
    let problems: Vec<String> = invocations(&pages, "prog")
        .iter()
        .flat_map(|i| cli.check(i))
        .collect();
    assert_eq!(
        problems,
        [
            "docs/x.md:4: `prog serve` has no option --imag",
            "docs/x.md:5: `prog ctl disk-add` has no option --no-force",
            "docs/x.md:6: `prog ctl` has no command disk-ad",
        ]
    );
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn anchors_are_githubs() {
    assert_eq!(
        anchor(" Live migration: on-demand latency (`cryptblk-bench migrate`)"),
        "live-migration-on-demand-latency-cryptblk-bench-migrate"
    );
    assert_eq!(
        anchor("Rotate a running disk's volume key"),
        "rotate-a-running-disks-volume-key"
    );
}

#[test]
fn broken_links_and_paths_are_named() {
    let root = tempfile_root("references");
    std::fs::create_dir_all(root.join("docs")).unwrap();
    std::fs::create_dir_all(root.join("crates/a")).unwrap();
    std::fs::write(root.join("crates/a/one.rs"), "").unwrap();
    std::fs::create_dir_all(root.join("crates/a/tests")).unwrap();
    std::fs::write(root.join("crates/a/tests/good.rs"), "").unwrap();
    std::fs::write(root.join("docs/y.md"), "# Title\n## Part two\n").unwrap();
    let pages = page(
        "[ok](y.md#part-two) [bad](y.md#part-three) [gone](z.md)\n`cargo test -p a --test good --test gone`\n`crates/a/one.rs` `crates/a/{one,two}.rs` `crates/a/o*` `crates/b`\n```\n[not](a link)\n```\n",
    );
    let problems = broken_references(&root, &pages);
    assert_eq!(problems.len(), 5, "{problems:#?}");
    for (problem, expected) in problems.iter().zip([
        "part-three: no such heading",
        "no docs/z.md",
        "no test target gone",
        "`crates/a/{one,two}.rs` does not exist",
        "`crates/b` does not exist",
    ]) {
        assert!(problem.contains(expected), "{problems:#?}");
    }
    std::fs::remove_dir_all(&root).unwrap();
}

fn tempfile_root(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("cryptblk-docs-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}
