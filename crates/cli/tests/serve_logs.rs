//! `serve --log-format json`: one JSON object per line on stderr, the disk's name as a field,
//! so a log shipper can index what the daemon did to which disk.
mod common;

use common::*;

#[test]
fn json_log_lines_name_the_disk() {
    let t = TestDir::new();
    let image = t.path("vm1.raw");
    std::fs::write(&image, vec![0u8; 1 << 20]).unwrap();
    let serve = t.serve().args(&["--log-format", "json", "--name", "vm1"]);
    let mut daemon = serve.image(&image).nbd().start();
    assert_eq!(daemon.terminate(), 0);

    let text = daemon.log();
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: not JSON: {l}")))
        .collect();
    let serving = lines
        .iter()
        .find(|l| {
            l["message"]
                .as_str()
                .is_some_and(|m| m.starts_with("serving"))
        })
        .unwrap_or_else(|| panic!("no `serving` line in:\n{text}"));
    assert_eq!(serving["disk"], "vm1", "{serving}");
    assert_eq!(serving["level"], "INFO", "{serving}");
    assert!(
        serving["message"].as_str().unwrap().contains("(raw)"),
        "{serving}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l["message"] == "detached" && l["disk"] == "vm1"),
        "{text}"
    );
}
