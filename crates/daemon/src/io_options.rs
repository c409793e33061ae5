//! The control contract's names for a disk's cache mode and I/O engine, turned into the data
//! path's (`cryptblk-block`) where the daemon opens an image. The matches are exhaustive both
//! ways, so a mode added on one side and not the other does not compile.
use cryptblk_block as block;
use cryptblk_control::api as wire;

pub(crate) fn cache_mode(mode: wire::CacheMode) -> block::CacheMode {
    match mode {
        wire::CacheMode::None => block::CacheMode::None,
        wire::CacheMode::Writeback => block::CacheMode::Writeback,
        wire::CacheMode::Writethrough => block::CacheMode::Writethrough,
        wire::CacheMode::Directsync => block::CacheMode::Directsync,
        wire::CacheMode::Unsafe => block::CacheMode::Unsafe,
    }
}

pub(crate) fn aio_engine(engine: wire::AioEngine) -> block::AioEngine {
    match engine {
        wire::AioEngine::IoUring => block::AioEngine::IoUring,
        wire::AioEngine::Threads => block::AioEngine::Threads,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_wire_name_means_the_data_path_mode_of_that_name() {
        for mode in wire::CacheMode::ALL {
            assert_eq!(cache_mode(mode).name(), mode.name());
        }
        for engine in wire::AioEngine::ALL {
            assert_eq!(aio_engine(engine).name(), engine.name());
        }
        assert_eq!(wire::CacheMode::ALL.len(), block::CacheMode::ALL.len());
        assert_eq!(wire::AioEngine::ALL.len(), block::AioEngine::ALL.len());
    }
}
