//! `backup verify`: every entry's files against the manifest's lengths and SHA-256 sums, every
//! extent record checked, and the chain's continuity (checked when the manifest loads).
use crate::error::Error;
use crate::replay::replay;
use crate::restore::load_chain;
use std::path::Path;

/// One entry's result.
#[derive(Debug)]
pub struct EntryCheck {
    pub checkpoint: String,
    /// `None` when the entry is intact; otherwise what is wrong (the entry named in it).
    pub problem: Option<Error>,
}

/// Checks every entry of the chain in `dir`. A manifest that does not load, or a chain whose
/// continuity is broken, is the `Err`; damaged entries are listed in the result.
pub fn verify(dir: &Path, mut progress: impl FnMut(u64, u64)) -> Result<Vec<EntryCheck>, Error> {
    let chain = load_chain(dir)?;
    let total: u64 = chain.entries.iter().map(|e| e.data_bytes).sum();
    let mut done = 0;
    let mut checks = Vec::new();
    for e in &chain.entries {
        let result = replay(dir, e, None, &mut |n| {
            done += n;
            progress(done, total);
        });
        checks.push(EntryCheck {
            checkpoint: e.checkpoint.clone(),
            problem: result.err(),
        });
    }
    Ok(checks)
}
