//! Metadata contexts: which ones an export offers (`base:allocation` always, and
//! `qemu:dirty-bitmap:NAME` for each dirty bitmap it has), which ones a client's
//! LIST/SET_META_CONTEXT queries select, and the limits on both.
//!
//! The naming and query rules are QEMU's (docs/interop/nbd.rst) and the NBD spec's: a query
//! names one context, or with LIST a namespace prefix (`base:`, `qemu:`,
//! `qemu:dirty-bitmap:`) or nothing at all stands for every context under it; SET takes
//! whole names only, ignoring the rest.

use crate::protocol::{BASE_ALLOCATION, DIRTY_BITMAP_PREFIX};
use cryptblk_block::BlockError;

/// Queries one LIST/SET_META_CONTEXT may carry; more get NBD_REP_ERR_TOO_BIG. QEMU sends one
/// or two; the bound keeps the matching work per option small.
pub const MAX_META_CONTEXT_QUERIES: usize = 64;
/// Contexts one connection may select; more get NBD_REP_ERR_TOO_BIG. Each adds one chunk of at
/// most 1024 descriptors (8 KiB) to every BLOCK_STATUS reply, so a reply stays under 140 KiB.
pub const MAX_SELECTED_CONTEXTS: usize = 16;

/// The dirty bitmaps an export offers as `qemu:dirty-bitmap:NAME` contexts, with the byte
/// ranges of the export each marks changed (bit set: NBD_STATE_DIRTY).
pub trait DirtyBitmaps: Send + Sync {
    /// The names of the bitmaps offered now.
    fn names(&self) -> Vec<String>;

    /// The changed ranges `(offset, length)` of bitmap `name`, sorted and disjoint, from the
    /// one holding or following byte `from` on, at most `limit` of them. A bitmap that has
    /// gone away since the client selected it is an error.
    fn dirty_runs(
        &self,
        name: &str,
        from: u64,
        limit: usize,
    ) -> Result<Vec<(u64, u64)>, BlockError>;
}

/// A context a client can select.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum MetaContext {
    BaseAllocation,
    /// The bitmap's name, without the `qemu:dirty-bitmap:` prefix.
    DirtyBitmap(String),
}

impl MetaContext {
    pub(crate) fn name(&self) -> String {
        match self {
            MetaContext::BaseAllocation => BASE_ALLOCATION.to_string(),
            MetaContext::DirtyBitmap(bitmap) => format!("{DIRTY_BITMAP_PREFIX}{bitmap}"),
        }
    }
}

/// Every context an export with `bitmaps` offers, `base:allocation` first.
fn offered(bitmaps: Option<&dyn DirtyBitmaps>) -> Vec<MetaContext> {
    let mut contexts = vec![MetaContext::BaseAllocation];
    if let Some(bitmaps) = bitmaps {
        contexts.extend(bitmaps.names().into_iter().map(MetaContext::DirtyBitmap));
    }
    contexts
}

/// The contexts of an export with `bitmaps` that `queries` select, each once, in the order
/// first named. `listing`: the queries are a LIST's, where prefixes and an empty list select
/// groups.
pub(crate) fn select(
    bitmaps: Option<&dyn DirtyBitmaps>,
    queries: &[String],
    listing: bool,
) -> Vec<MetaContext> {
    let offered = offered(bitmaps);
    if listing && queries.is_empty() {
        return offered;
    }
    let mut selected: Vec<MetaContext> = Vec::new();
    for query in queries {
        for context in &offered {
            if matches(context, query, listing) && !selected.contains(context) {
                selected.push(context.clone());
            }
        }
    }
    selected
}

fn matches(context: &MetaContext, query: &str, listing: bool) -> bool {
    if query == context.name() {
        return true;
    }
    if !listing {
        return false;
    }
    match context {
        MetaContext::BaseAllocation => query == "base:",
        MetaContext::DirtyBitmap(_) => query == "qemu:" || query == DIRTY_BITMAP_PREFIX,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Bitmaps(Vec<&'static str>);

    impl DirtyBitmaps for Bitmaps {
        fn names(&self) -> Vec<String> {
            self.0.iter().map(|n| n.to_string()).collect()
        }
        fn dirty_runs(&self, _: &str, _: u64, _: usize) -> Result<Vec<(u64, u64)>, BlockError> {
            Ok(Vec::new())
        }
    }

    fn names(contexts: &[MetaContext]) -> Vec<String> {
        contexts.iter().map(MetaContext::name).collect()
    }

    fn strings(queries: &[&str]) -> Vec<String> {
        queries.iter().map(|q| q.to_string()).collect()
    }

    #[test]
    fn listing_with_prefixes_or_nothing_selects_groups() {
        let bitmaps = Bitmaps(vec!["a", "b"]);
        let e = Some(&bitmaps as &dyn DirtyBitmaps);
        let all = [
            "base:allocation",
            "qemu:dirty-bitmap:a",
            "qemu:dirty-bitmap:b",
        ];
        assert_eq!(names(&select(e, &[], true)), all);
        assert_eq!(names(&select(e, &strings(&["qemu:"]), true)), &all[1..]);
        assert_eq!(
            names(&select(e, &strings(&["qemu:dirty-bitmap:"]), true)),
            &all[1..]
        );
        assert_eq!(names(&select(e, &strings(&["base:"]), true)), &all[..1]);
        assert_eq!(
            names(&select(
                e,
                &strings(&["qemu:dirty-bitmap:b", "base:"]),
                true
            )),
            ["qemu:dirty-bitmap:b", "base:allocation"]
        );
    }

    #[test]
    fn setting_takes_whole_names_once_and_ignores_the_rest() {
        let bitmaps = Bitmaps(vec!["a", "b"]);
        let e = Some(&bitmaps as &dyn DirtyBitmaps);
        let queries = strings(&[
            "qemu:",
            "qemu:dirty-bitmap:",
            "qemu:dirty-bitmap:b",
            "qemu:dirty-bitmap:c",
            "x-other:thing",
            "base:allocation",
            "qemu:dirty-bitmap:b",
        ]);
        assert_eq!(
            names(&select(e, &queries, false)),
            ["qemu:dirty-bitmap:b", "base:allocation"]
        );
        assert!(select(e, &[], false).is_empty());
    }

    #[test]
    fn an_export_without_bitmaps_offers_base_allocation_only() {
        assert_eq!(names(&select(None, &[], true)), ["base:allocation"]);
        assert!(select(None, &strings(&["qemu:dirty-bitmap:a"]), false).is_empty());
        assert!(select(None, &strings(&["qemu:"]), true).is_empty());
    }
}
