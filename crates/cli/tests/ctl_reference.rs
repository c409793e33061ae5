//! `cryptblk ctl --help`, each verb's help and docs/serving.md list the same methods and params as
//! the daemon accepts (the param types' own field names, `api::accepted_params`).
mod common;

use common::*;
use cryptblk_control::api::{accepted_params, methods_reference, METHODS};

#[test]
fn ctl_help_lists_every_method_and_param_the_daemon_accepts() {
    let help = cryptblk(["ctl", "--help"]);
    help.ok();
    assert!(
        help.stdout.contains(&methods_reference()),
        "`ctl --help` lacks the method reference:\n{}",
        help.stdout
    );
    for m in METHODS {
        assert!(help.stdout.contains(m.name), "{} missing", m.name);
        let verb = cryptblk(["ctl", "--socket", "/nonexistent", m.name, "--help"]);
        verb.ok();
        for param in accepted_params(m.name).unwrap() {
            let shown = verb.stdout.contains(&format!("--{param}"))
                || verb.stdout.contains(&format!("--no-{param}"))
                || (param == "name" && verb.stdout.contains("<NAME>"))
                || (param == "name" && verb.stdout.contains("[NAME]"))
                || (param == "size" && verb.stdout.contains("<SIZE>"))
                || (param == "checkpoint" && verb.stdout.contains("<CHECKPOINT>"));
            assert!(
                shown,
                "`ctl {} --help` does not offer `{param}`:\n{}",
                m.name, verb.stdout
            );
        }
    }
}

#[test]
fn the_serving_page_lists_the_methods_the_daemon_accepts() {
    let page = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../docs/serving.md"
    ))
    .unwrap();
    let reference = methods_reference();
    assert!(
        page.contains(&format!("```text\n{reference}  ```")),
        "docs/serving.md's method list is out of date; it should read:\n{reference}"
    );
    for m in METHODS {
        for param in accepted_params(m.name).unwrap() {
            assert!(
                reference.contains(&format!("\"{param}\"")),
                "{} {param}",
                m.name
            );
        }
    }
}
