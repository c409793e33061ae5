//! cryptsetup's own test images (the `tests/` images of its source tree): real-world and
//! deliberately odd headers that no installed tool can make again, so they are not in this
//! repository. They are looked up at `$CRYPTBLK_CORPUS`, else at `../shared/corpus/cryptsetup`
//! beside the workspace (where CI has them). A test that needs them starts with
//!
//! ```no_run
//! # fn test() {
//! let Some(corpus) = cryptblk_testutil::corpus::Corpus::find_or_skip() else {
//!     return;
//! };
//! # }
//! ```
//!
//! which, when the corpus is absent, reports the test as skipped by name (see
//! [`crate::skip`]) and never passes it silently.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};

/// The environment variable naming the corpus directory, which then must exist.
pub const ENV: &str = "CRYPTBLK_CORPUS";

/// Where the corpus is looked up when `$CRYPTBLK_CORPUS` is not set.
pub fn default_dir() -> PathBuf {
    // crates/testutil -> crates -> the workspace root -> the directory holding it.
    let beside_workspace = Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(3)
        .expect("crates/testutil lies three levels below some directory");
    beside_workspace.join("shared/corpus/cryptsetup")
}

/// A directory of cryptsetup's test images (`*.xz`, `*.tar.xz`).
#[derive(Debug, Clone)]
pub struct Corpus {
    dir: PathBuf,
}

impl Corpus {
    /// The corpus, or `None` after reporting the running test as skipped because it is not
    /// there. Panics when `$CRYPTBLK_CORPUS` names a directory that does not exist: whoever set
    /// it expects the tests to run.
    pub fn find_or_skip() -> Option<Corpus> {
        if let Some(dir) = std::env::var_os(ENV) {
            let dir = PathBuf::from(dir);
            assert!(
                dir.is_dir(),
                "{ENV}={} is not a directory: point it at cryptsetup's corpus or unset it",
                dir.display()
            );
            return Some(Corpus { dir });
        }
        let dir = default_dir();
        if dir.is_dir() {
            return Some(Corpus { dir });
        }
        crate::skip(&format!(
            "cryptsetup corpus not found at {} (set {ENV} to its directory)",
            dir.display()
        ));
        None
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Decompresses corpus file `name` into `into`: `x.xz` becomes `into/x`; an `x.tar.xz`
    /// archive is unpacked into `into` and `into/x` returned. Panics (the test fails) when the
    /// file is missing from the corpus or cannot be unpacked.
    pub fn unpack(&self, into: &Path, name: &str) -> PathBuf {
        let src = self.dir.join(name);
        assert!(
            src.is_file(),
            "the corpus at {} has no {name}: it is incomplete",
            self.dir.display()
        );
        if let Some(stem) = name.strip_suffix(".tar.xz") {
            crate::run_tool(
                "tar",
                &[
                    OsStr::new("-xJf"),
                    src.as_os_str(),
                    OsStr::new("-C"),
                    into.as_os_str(),
                ],
            );
            let out = into.join(stem);
            assert!(out.exists(), "{name} did not unpack into {}", out.display());
            return out;
        }
        let stem = name
            .strip_suffix(".xz")
            .unwrap_or_else(|| panic!("corpus file {name} is neither .xz nor .tar.xz"));
        let out = into.join(stem);
        let data = crate::run_tool("xz", &[OsStr::new("-dc"), src.as_os_str()]).stdout;
        std::fs::write(&out, data).unwrap_or_else(|e| panic!("writing {}: {e}", out.display()));
        out
    }
}
