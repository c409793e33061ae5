//! The man pages and the shell completions generated from the command-line definitions: every
//! command has a page that groff renders without a warning, and bash completes commands,
//! `ctl` verbs and options from the script `cryptblk completions bash` prints.
use std::process::Command;

fn cryptblk(args: &[&str]) -> std::process::Output {
    let args: Vec<&std::ffi::OsStr> = args.iter().map(std::ffi::OsStr::new).collect();
    cryptblk_testutil::run_tool(env!("CARGO_BIN_EXE_cryptblk"), &args)
}

#[test]
fn every_command_has_a_man_page_groff_renders_cleanly() {
    if Command::new("groff").arg("--version").output().is_err() {
        cryptblk_testutil::skip("groff is not installed (run scripts/install-deps.sh)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let dir_arg = dir.path().to_str().unwrap();
    cryptblk(&["man", "--dir", dir_arg]);
    let render = |page: &str| -> String {
        let path = dir.path().join(page);
        assert!(path.exists(), "no {page}");
        // Plain text: no overstrike bold or underline.
        let out = Command::new("groff")
            .args(["-man", "-Tutf8", "-ww", "-P-cbou"])
            .arg(&path)
            .env("LC_ALL", "C.UTF-8")
            .output()
            .unwrap();
        assert!(out.status.success(), "groff {page}: {}", out.status);
        assert!(
            out.stderr.is_empty(),
            "groff warns about {page}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        // groff may join a hyphenated word with U+2010; compare with ASCII hyphens.
        String::from_utf8_lossy(&out.stdout).replace('\u{2010}', "-")
    };
    for page in [
        "cryptblk.1",
        "cryptblk-convert.1",
        "cryptblk-key-add.1",
        "cryptblk-ctl-disk-add.1",
        "cryptblk-ctl-migrate-start.1",
    ] {
        render(page);
    }
    let serve = render("cryptblk-serve.1");
    for option in ["--cache", "--vhost-user-blk", "--config", "--control"] {
        assert!(
            serve.contains(option),
            "cryptblk-serve(1) lacks {option}:\n{serve}"
        );
    }
    let ctl = render("cryptblk-ctl.1");
    assert!(
        ctl.contains("disk-add") && ctl.contains("migrate-start"),
        "{ctl}"
    );
    // Without --dir: cryptblk(1) on stdout.
    let page = cryptblk(&["man"]).stdout;
    assert!(String::from_utf8_lossy(&page).starts_with(".ie \\n(.g .ds Aq"));
}

/// What bash completes after `cryptblk WORDS...` (the last word being completed).
fn bash_completes(script: &std::path::Path, words: &[&str]) -> Vec<String> {
    let quoted: Vec<String> = words.iter().map(|w| format!("'{w}'")).collect();
    let current = words.last().unwrap();
    let previous = words[words.len() - 2];
    let program = format!(
        "source '{}'; COMP_WORDS=({}); COMP_CWORD={}; _cryptblk cryptblk '{current}' '{previous}'; \
         printf '%s\\n' \"${{COMPREPLY[@]}}\"",
        script.display(),
        quoted.join(" "),
        words.len() - 1
    );
    let out = Command::new("bash")
        .args(["-c", &program])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{program}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_owned)
        .collect()
}

#[test]
fn bash_completes_commands_verbs_and_options() {
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("cryptblk.bash");
    std::fs::write(&script, cryptblk(&["completions", "bash"]).stdout).unwrap();
    assert_eq!(bash_completes(&script, &["cryptblk", "se"]), ["serve"]);
    let mut verbs = bash_completes(&script, &["cryptblk", "ctl", "disk-"]);
    verbs.sort();
    assert_eq!(
        verbs,
        ["disk-add", "disk-list", "disk-remove", "disk-resize"]
    );
    assert!(bash_completes(&script, &["cryptblk", "serve", "--ca"]).contains(&"--cache".into()));
    // Every shell clap knows gets a script.
    for shell in ["zsh", "fish", "elvish", "powershell"] {
        let script = cryptblk(&["completions", shell]).stdout;
        assert!(
            String::from_utf8_lossy(&script).contains("disk-add"),
            "{shell}"
        );
    }
}
