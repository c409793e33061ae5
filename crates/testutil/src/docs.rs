//! The project's pages (README.md, ARCHITECTURE.md, docs/*.md) checked against what they
//! describe: every command line they show names subcommands and options that the program's
//! `--help` offers, every relative link and heading anchor resolves, and every repository path
//! they name in backticks exists. The checks return what is wrong, one line each, naming the
//! page and line; the tests that call them assert that nothing is.
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

/// One markdown page: its path relative to the repository's root, and its text.
pub struct Page {
    pub path: PathBuf,
    pub text: String,
}

/// The repository's root (two levels above a crate's manifest directory).
pub fn repository_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// README.md, ARCHITECTURE.md and every docs/*.md, in that order.
pub fn pages(root: &Path) -> Vec<Page> {
    let mut paths = vec![PathBuf::from("README.md"), PathBuf::from("ARCHITECTURE.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .map(|dir| {
            dir.filter_map(|e| e.ok())
                .map(|e| Path::new("docs").join(e.file_name()))
                .filter(|p| p.extension().is_some_and(|x| x == "md"))
                .collect()
        })
        .unwrap_or_default();
    docs.sort();
    paths.extend(docs);
    paths
        .into_iter()
        .map(|path| {
            let text = std::fs::read_to_string(root.join(&path))
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            Page { path, text }
        })
        .collect()
}

/// A piece of a page: the code of a fenced block's line (continuation lines joined) or of an
/// inline code span, with the line it starts on.
struct Code<'a> {
    page: &'a Path,
    line: usize,
    text: String,
    fenced: bool,
}

/// Every fenced code line and inline code span of a page; `prose` gets the rest (outside any
/// code) with its line numbers.
fn split_code<'a>(page: &'a Page, prose: &mut Vec<(usize, String)>) -> Vec<Code<'a>> {
    let mut code = Vec::new();
    let mut in_fence = false;
    let mut pending: Option<(usize, String)> = None;
    let mut paragraph: Vec<(usize, &str)> = Vec::new();
    let flush = |paragraph: &mut Vec<(usize, &str)>,
                 code: &mut Vec<Code<'a>>,
                 prose: &mut Vec<(usize, String)>| {
        spans(page, paragraph, code, prose);
        paragraph.clear();
    };
    for (i, line) in page.text.lines().enumerate() {
        let number = i + 1;
        if line.trim_start().starts_with("```") {
            flush(&mut paragraph, &mut code, prose);
            in_fence = !in_fence;
            continue;
        }
        if in_fence {
            let (start, mut joined) = pending.take().unwrap_or((number, String::new()));
            let trimmed = line.trim_end();
            if let Some(head) = trimmed.strip_suffix('\\') {
                joined.push_str(head);
                joined.push(' ');
                pending = Some((start, joined));
            } else {
                joined.push_str(trimmed);
                code.push(Code {
                    page: &page.path,
                    line: start,
                    text: joined,
                    fenced: true,
                });
            }
            continue;
        }
        if line.trim().is_empty() {
            flush(&mut paragraph, &mut code, prose);
        } else {
            paragraph.push((number, line));
        }
    }
    flush(&mut paragraph, &mut code, prose);
    code
}

/// The inline code spans of one paragraph (a span may cross a line break).
fn spans<'a>(
    page: &'a Page,
    lines: &[(usize, &str)],
    code: &mut Vec<Code<'a>>,
    prose: &mut Vec<(usize, String)>,
) {
    let mut open: Option<(usize, String)> = None;
    for (number, line) in lines {
        let mut outside = String::new();
        for c in line.chars() {
            match (&mut open, c) {
                (None, '`') => open = Some((*number, String::new())),
                (None, c) => outside.push(c),
                (Some(_), '`') => {
                    let (line, text) = open.take().unwrap();
                    code.push(Code {
                        page: &page.path,
                        line,
                        text,
                        fenced: false,
                    });
                }
                (Some((_, text)), c) => text.push(c),
            }
        }
        if let Some((_, text)) = &mut open {
            text.push(' ');
        }
        prose.push((*number, outside));
    }
}

/// A command line a page shows: where, and its words after the program's name.
#[derive(Debug)]
pub struct Invocation {
    pub page: PathBuf,
    pub line: usize,
    pub words: Vec<String>,
}

/// Every invocation of `program` the pages show, in code blocks and inline code. `cargo run
/// ... -p PROGRAM --` counts as `PROGRAM`; environment assignments and `sudo` before it are
/// skipped; a pipe, `&&`, `;` or a command substitution starts a new command.
pub fn invocations(pages: &[Page], program: &str) -> Vec<Invocation> {
    let mut found = Vec::new();
    for page in pages {
        let mut prose = Vec::new();
        for code in split_code(page, &mut prose) {
            // A shell comment shows no command (`# after cryptblk was killed, ...`).
            let text = if code.fenced {
                let line = code.text.trim_start();
                let end = if line.starts_with('#') {
                    0
                } else {
                    line.find(" #").unwrap_or(line.len())
                };
                line[..end].to_string()
            } else {
                code.text.clone()
            };
            let text = text
                .replace(&format!("cargo run --release -p {program} --"), program)
                .replace(&format!("cargo run -p {program} --"), program);
            for command in text.split(['|', ';', '&', '(']) {
                let mut words = command.split_whitespace().map(clean).skip_while(|w| {
                    w.is_empty()
                        || w == "sudo"
                        || w == "$"
                        || (w.contains('=') && !w.starts_with('-'))
                });
                if words.next().as_deref() != Some(program) {
                    continue;
                }
                let words: Vec<String> = words
                    .take_while(|w| !w.starts_with('#') && !is_redirection(w))
                    .filter(|w| !w.is_empty() && w != "...")
                    .collect();
                // A span that only names the program (`cryptblk`) shows no command.
                if words.is_empty() && !code.fenced {
                    continue;
                }
                found.push(Invocation {
                    page: code.page.to_path_buf(),
                    line: code.line,
                    words,
                });
            }
        }
    }
    found
}

fn clean(word: &str) -> String {
    word.trim_matches(|c| matches!(c, '[' | ']' | '"' | '\'' | ',' | ')'))
        .to_string()
}

fn is_redirection(word: &str) -> bool {
    word.trim_start_matches(|c: char| c.is_ascii_digit())
        .starts_with(['<', '>'])
}

/// What a program's `--help` offers at one level: its subcommands and options, and which
/// options take a separate value.
#[derive(Debug, Default)]
struct Help {
    subcommands: Vec<String>,
    /// The usage line says `<COMMAND>`: the first word that is no option must be one.
    requires_subcommand: bool,
    /// Option (`--name` or `-x`) and whether the next word is its value.
    options: HashMap<String, bool>,
}

fn parse_help(text: &str) -> Help {
    let mut help = Help::default();
    let mut section = "";
    for line in text.lines() {
        if line.is_empty() {
            continue;
        }
        if !line.starts_with(' ') {
            if line.starts_with("Usage:") && line.contains("<COMMAND>") {
                help.requires_subcommand = true;
            }
            section = line.trim_end_matches(':');
            continue;
        }
        let indent = line.len() - line.trim_start().len();
        let body = line.trim_start();
        if section == "Commands" && indent == 2 {
            if let Some(name) = body.split_whitespace().next() {
                help.subcommands.push(name.to_string());
            }
        } else if section.ends_with("Options")
            && (indent == 2 || indent == 6)
            && body.starts_with('-')
        {
            // `-d, --key-file <FILE>  description`: the names end where the description
            // begins, and a `<VALUE>` after the last one is every name's.
            let names = body.split("  ").next().unwrap_or(body);
            let takes_value = names.contains(" <");
            for part in names.split(", ") {
                let Some(name) = part.split_whitespace().next() else {
                    continue;
                };
                let name = name.split("[=").next().unwrap_or(name);
                help.options.insert(name.to_string(), takes_value);
            }
        }
        if let Some(aliases) = body.split("[aliases: ").nth(1) {
            for alias in aliases.trim_end_matches(']').split(", ") {
                if alias.starts_with('-') {
                    help.options.insert(alias.to_string(), false);
                }
            }
        }
    }
    help
}

/// A program's command-line definitions as its `--help` shows them, asked level by level.
pub struct Cli {
    binary: PathBuf,
    cache: HashMap<Vec<String>, Help>,
}

impl Cli {
    pub fn new(binary: impl Into<PathBuf>) -> Cli {
        Cli {
            binary: binary.into(),
            cache: HashMap::new(),
        }
    }

    fn help(&mut self, path: &[String]) -> &Help {
        let binary = &self.binary;
        self.cache.entry(path.to_vec()).or_insert_with(|| {
            let out = Command::new(binary)
                .args(path)
                .arg("--help")
                .output()
                .unwrap_or_else(|e| panic!("{}: {e}", binary.display()));
            assert!(
                out.status.success(),
                "{} {} --help: {}",
                binary.display(),
                path.join(" "),
                String::from_utf8_lossy(&out.stderr)
            );
            parse_help(&String::from_utf8_lossy(&out.stdout))
        })
    }

    /// What is wrong with one invocation: a subcommand or option the program does not offer
    /// where the invocation uses it. Words that are neither (values, positionals) pass.
    pub fn check(&mut self, invocation: &Invocation) -> Vec<String> {
        let mut problems = Vec::new();
        let mut path: Vec<String> = Vec::new();
        let mut positional = false;
        let mut words = invocation.words.iter();
        while let Some(word) = words.next() {
            let help = self.help(&path);
            let option = word.split('=').next().unwrap_or(word);
            let is_option = option.starts_with("--") && option.len() > 2
                || option.len() == 2 && option.starts_with('-') && option != "--";
            if is_option {
                match help.options.get(option) {
                    Some(&takes_value) => {
                        if takes_value && !word.contains('=') {
                            words.next();
                        }
                    }
                    None => problems.push(format!(
                        "{}:{}: `{}` has no option {option}",
                        invocation.page.display(),
                        invocation.line,
                        command_name(&self.binary, &path)
                    )),
                }
            } else if !positional && help.subcommands.iter().any(|s| s == word) {
                path.push(word.clone());
            } else if !positional && help.requires_subcommand && !is_placeholder(word) {
                problems.push(format!(
                    "{}:{}: `{}` has no command {word}",
                    invocation.page.display(),
                    invocation.line,
                    command_name(&self.binary, &path)
                ));
                break;
            } else {
                positional = true;
            }
        }
        problems
    }
}

/// `COMMAND`, `<NAME>`: a word that stands for what the reader puts there.
fn is_placeholder(word: &str) -> bool {
    word.starts_with('<') || word.chars().all(|c| c.is_ascii_uppercase() || c == '_')
}

fn command_name(binary: &Path, path: &[String]) -> String {
    let program = binary.file_name().unwrap_or_default().to_string_lossy();
    std::iter::once(program.to_string())
        .chain(path.iter().cloned())
        .collect::<Vec<_>>()
        .join(" ")
}

/// GitHub's anchor for a heading: lower case, punctuation dropped, spaces made hyphens.
pub fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

fn anchors(text: &str) -> Vec<String> {
    let mut in_fence = false;
    let mut found = Vec::new();
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            in_fence = !in_fence;
        } else if !in_fence && line.starts_with('#') {
            found.push(anchor(line.trim_start_matches('#')));
        }
    }
    found
}

/// Relative links whose file does not exist or whose `#anchor` is no heading of that page,
/// and repository paths in backticks (under crates/, scripts/, contrib/, docs/, fuzz/,
/// vendor/ or .ci/; `*` and `{a,b}` allowed) that do not exist.
pub fn broken_references(root: &Path, pages: &[Page]) -> Vec<String> {
    let mut problems = Vec::new();
    for page in pages {
        let mut prose = Vec::new();
        let code = split_code(page, &mut prose);
        let dir = page.path.parent().unwrap_or(Path::new(""));
        for (line, text) in &prose {
            for target in link_targets(text) {
                if target.contains("://") || target.starts_with("mailto:") {
                    continue;
                }
                let (file, fragment) = target.split_once('#').unwrap_or((&target, ""));
                let file = if file.is_empty() {
                    page.path.clone()
                } else {
                    dir.join(file)
                };
                let where_ = format!("{}:{line}", page.path.display());
                if !root.join(&file).exists() {
                    problems.push(format!("{where_}: link to {target}: no {}", file.display()));
                    continue;
                }
                if !fragment.is_empty() && file.extension().is_some_and(|x| x == "md") {
                    let text = std::fs::read_to_string(root.join(&file)).unwrap_or_default();
                    if !anchors(&text).iter().any(|a| a == fragment) {
                        problems.push(format!("{where_}: link to {target}: no such heading"));
                    }
                }
            }
        }
        // `cargo test ... --test NAME`: some crate has that test target.
        for c in code.iter().filter(|c| c.text.contains("cargo test")) {
            let words: Vec<&str> = c.text.split_whitespace().collect();
            for pair in words.windows(2).filter(|w| w[0] == "--test") {
                if !test_target_exists(root, pair[1]) {
                    problems.push(format!(
                        "{}:{}: no test target {} (crates/*/tests/{}.rs)",
                        page.path.display(),
                        c.line,
                        pair[1],
                        pair[1]
                    ));
                }
            }
        }
        for c in code.iter().filter(|c| !c.fenced) {
            let path = c.text.trim().trim_end_matches([':', '.', ',']);
            let repository_path = [
                "crates/", "scripts/", "contrib/", "docs/", "fuzz/", "vendor/", ".ci/",
            ]
            .iter()
            .any(|p| path.starts_with(p));
            if repository_path
                && !path.contains(' ')
                && !expand(path).iter().all(|p| exists(root, p))
            {
                problems.push(format!(
                    "{}:{}: `{path}` does not exist",
                    page.path.display(),
                    c.line
                ));
            }
        }
    }
    problems
}

/// Whether a crate of the workspace has the integration test `name` (tests/NAME.rs or
/// tests/NAME/main.rs).
fn test_target_exists(root: &Path, name: &str) -> bool {
    std::fs::read_dir(root.join("crates")).is_ok_and(|crates| {
        crates.filter_map(|e| e.ok()).any(|c| {
            let tests = c.path().join("tests");
            tests.join(format!("{name}.rs")).exists() || tests.join(name).join("main.rs").exists()
        })
    })
}

/// The targets of `[text](target)` links in a line of prose.
fn link_targets(text: &str) -> Vec<String> {
    let mut targets = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find("](") {
        let after = &rest[at + 2..];
        let Some(end) = after.find(')') else { break };
        targets.push(after[..end].to_string());
        rest = &after[end..];
    }
    targets
}

/// `a/{b,c}.rs` as `a/b.rs` and `a/c.rs` (one pair of braces).
fn expand(path: &str) -> Vec<String> {
    match (path.find('{'), path.find('}')) {
        (Some(open), Some(close)) if open < close => path[open + 1..close]
            .split(',')
            .map(|choice| format!("{}{choice}{}", &path[..open], &path[close + 1..]))
            .collect(),
        _ => vec![path.to_string()],
    }
}

/// Whether `path` exists; a `*` in its last component matches any text there.
fn exists(root: &Path, path: &str) -> bool {
    let Some((dir, name)) = path.rsplit_once('/') else {
        return root.join(path).exists();
    };
    let Some((prefix, suffix)) = name.split_once('*') else {
        return root.join(path).exists();
    };
    std::fs::read_dir(root.join(dir)).is_ok_and(|entries| {
        entries.filter_map(|e| e.ok()).any(|e| {
            let n = e.file_name().to_string_lossy().to_string();
            n.starts_with(prefix) && n.ends_with(suffix)
        })
    })
}

#[cfg(test)]
mod tests;
