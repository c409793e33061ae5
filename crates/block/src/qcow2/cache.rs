//! A small bounded LRU cache of L2 tables. Held under a mutex only for lookups and inserts;
//! tables are loaded from disk outside the lock (two threads may load the same table at once,
//! which costs a read but is harmless: both copies are identical).

use std::collections::HashMap;
use std::sync::Arc;

pub(crate) struct L2Cache {
    tables: HashMap<u64, (Arc<[u64]>, u64)>,
    tick: u64,
    capacity: usize,
}

impl L2Cache {
    /// A cache holding at most `max_bytes` of tables of `table_bytes` each (but at least two,
    /// so that a read crossing an L2 boundary does not thrash).
    pub(crate) fn new(max_bytes: usize, table_bytes: usize) -> Self {
        let capacity = (max_bytes / table_bytes.max(1)).max(2);
        L2Cache {
            tables: HashMap::new(),
            tick: 0,
            capacity,
        }
    }

    pub(crate) fn get(&mut self, host_offset: u64) -> Option<Arc<[u64]>> {
        self.tick += 1;
        let tick = self.tick;
        self.tables.get_mut(&host_offset).map(|(t, used)| {
            *used = tick;
            Arc::clone(t)
        })
    }

    pub(crate) fn insert(&mut self, host_offset: u64, table: Arc<[u64]>) {
        if !self.tables.contains_key(&host_offset) && self.tables.len() >= self.capacity {
            // Linear scan: the cache holds at most a few dozen tables.
            if let Some(oldest) = self
                .tables
                .iter()
                .min_by_key(|(_, (_, used))| *used)
                .map(|(k, _)| *k)
            {
                self.tables.remove(&oldest);
            }
        }
        self.tick += 1;
        self.tables.insert(host_offset, (table, self.tick));
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.tables.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evicts_least_recently_used() {
        let mut c = L2Cache::new(3 * 64, 64);
        for k in 0..3u64 {
            c.insert(k, Arc::from(vec![k; 8]));
        }
        assert!(c.get(0).is_some()); // 1 is now the oldest
        c.insert(3, Arc::from(vec![3u64; 8]));
        assert_eq!(c.len(), 3);
        assert!(c.get(1).is_none());
        assert!(c.get(0).is_some() && c.get(2).is_some() && c.get(3).is_some());
    }
}
