//! `report --docs PAGE`: a page's tables rendered again from the records it names, so that a
//! committed table cannot drift from its data (docs/performance.md; a test checks that the
//! committed page is what `report` renders).
//!
//! A block of the page is everything between a marker naming what to render and the end
//! marker:
//!
//! ```text
//! <!-- cryptblk-bench report [--targets] FILE... -->
//! (the tables, as `cryptblk-bench report [--targets] FILE...` prints them)
//! <!-- end of cryptblk-bench report -->
//! ```
//!
//! FILE paths are relative to the repository's root (the directory above the page's own).
//! Everything outside the blocks is left as it is.
use anyhow::{bail, Result};
use std::path::PathBuf;

const START: &str = "<!-- cryptblk-bench report ";
const END: &str = "<!-- end of cryptblk-bench report -->";

/// What one block renders: `report FILE...` or `report --targets FILE...`.
#[derive(Debug, PartialEq)]
pub struct Block {
    pub targets: bool,
    pub files: Vec<PathBuf>,
}

/// The page with every block's content replaced by what `render` makes of its marker.
pub fn render_page(page: &str, render: &dyn Fn(&Block) -> Result<String>) -> Result<String> {
    let mut out = String::new();
    let mut lines = page.lines().enumerate();
    while let Some((i, line)) = lines.next() {
        out.push_str(line);
        out.push('\n');
        let Some(args) = line.strip_prefix(START) else {
            continue;
        };
        let Some(args) = args.strip_suffix(" -->") else {
            bail!("line {}: a report marker ends with ` -->`", i + 1);
        };
        let mut words = args.split_whitespace().peekable();
        let targets = words.next_if_eq(&"--targets").is_some();
        let block = Block {
            targets,
            files: words.map(PathBuf::from).collect(),
        };
        if block.files.is_empty() {
            bail!("line {}: the report marker names no results file", i + 1);
        }
        if !lines.any(|(_, l)| l == END) {
            bail!("line {}: the report block has no `{END}`", i + 1);
        }
        // Blank lines around the tables keep them tables for every markdown reader.
        let tables = render(&block)?;
        out.push('\n');
        out.push_str(tables.trim());
        out.push_str("\n\n");
        out.push_str(END);
        out.push('\n');
    }
    Ok(out)
}

/// `markdown`'s headings two levels down, to sit under a page's `###` heading.
pub fn demote_headings(markdown: &str) -> String {
    markdown
        .lines()
        .map(|l| {
            if l.starts_with('#') {
                format!("##{l}")
            } else {
                l.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn blocks_are_rendered_from_their_markers_and_the_rest_is_kept() {
        let page = "# P\n\ntext\n<!-- cryptblk-bench report a.jsonl b.jsonl -->\nold\ntable\n<!-- end of cryptblk-bench report -->\nmore\n<!-- cryptblk-bench report --targets c.jsonl -->\n<!-- end of cryptblk-bench report -->\n";
        let render = |b: &Block| -> Result<String> {
            Ok(format!(
                "| {} | {} |\n",
                b.targets,
                b.files
                    .iter()
                    .map(|f| f.display().to_string())
                    .collect::<Vec<_>>()
                    .join(" ")
            ))
        };
        assert_eq!(
            render_page(page, &render).unwrap(),
            "# P\n\ntext\n<!-- cryptblk-bench report a.jsonl b.jsonl -->\n\n| false | a.jsonl b.jsonl |\n\n<!-- end of cryptblk-bench report -->\nmore\n<!-- cryptblk-bench report --targets c.jsonl -->\n\n| true | c.jsonl |\n\n<!-- end of cryptblk-bench report -->\n"
        );
        let unclosed = render_page("<!-- cryptblk-bench report a.jsonl -->\nx\n", &render);
        assert!(format!("{:#}", unclosed.unwrap_err()).contains("line 1"));
        let empty = render_page("<!-- cryptblk-bench report --targets -->\n", &render);
        assert!(format!("{:#}", empty.unwrap_err()).contains("names no results file"));
    }

    /// The committed performance page is exactly what `report --docs` renders from the
    /// committed records: a table cannot be edited by hand or left behind by new records.
    #[test]
    fn the_committed_performance_page_is_what_report_renders() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let path = root.join("docs/performance.md");
        let page = std::fs::read_to_string(&path).unwrap();
        let config = crate::config::Config::load(None).unwrap();
        let rendered = render_page(&page, &|b| crate::render_block(&config, &root, b)).unwrap();
        assert!(
            page.contains(START),
            "docs/performance.md has no report block"
        );
        if rendered != page {
            let line = page
                .lines()
                .zip(rendered.lines())
                .position(|(a, b)| a != b)
                .map_or(page.lines().count().min(rendered.lines().count()), |i| i);
            panic!(
                "docs/performance.md differs from what the records render from line {}: run \
                 `cargo run -p cryptblk-bench -- report --docs docs/performance.md`",
                line + 1
            );
        }
    }
}
