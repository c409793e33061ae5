//! Every `cryptblk-bench ...` command the pages (README.md, ARCHITECTURE.md, docs/*.md) show,
//! `cargo run --release -p cryptblk-bench -- ...` included, uses subcommands and options the
//! harness offers (its `--help` at each level).
use cryptblk_testutil::docs::{invocations, pages, repository_root, Cli};

#[test]
fn every_benchmark_command_the_pages_show_exists() {
    let pages = pages(&repository_root());
    let shown = invocations(&pages, "cryptblk-bench");
    assert!(
        shown.len() > 30,
        "only {} cryptblk-bench command lines found",
        shown.len()
    );
    let mut cli = Cli::new(env!("CARGO_BIN_EXE_cryptblk-bench"));
    let problems: Vec<String> = shown.iter().flat_map(|i| cli.check(i)).collect();
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}
