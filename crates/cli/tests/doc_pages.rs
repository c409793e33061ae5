//! The pages (README.md, ARCHITECTURE.md, docs/*.md) against the command line and the tree:
//! every `cryptblk ...` command they show uses subcommands and options `cryptblk` offers (its
//! `--help` at each level), and every relative link, heading anchor and repository path they
//! name exists. `cryptblk-bench` commands are checked by crates/bench/tests/doc_pages.rs.
use cryptblk_testutil::docs::{broken_references, invocations, pages, repository_root, Cli};

#[test]
fn every_command_and_option_the_pages_show_exists() {
    let pages = pages(&repository_root());
    let shown = invocations(&pages, "cryptblk");
    // The usage page alone shows some thirty command lines.
    assert!(
        shown.len() > 100,
        "only {} cryptblk command lines found",
        shown.len()
    );
    let mut cli = Cli::new(env!("CARGO_BIN_EXE_cryptblk"));
    let problems: Vec<String> = shown.iter().flat_map(|i| cli.check(i)).collect();
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn every_link_anchor_and_path_the_pages_name_exists() {
    let root = repository_root();
    let problems = broken_references(&root, &pages(&root));
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}
