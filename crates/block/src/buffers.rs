//! The process's buffers for request data (an encrypted write's ciphertext, a misaligned
//! transfer's bounce, an NBD payload): taken from one cache by size class and given back to
//! it, so that a queue in steady state allocates nothing, while what a burst took is not kept
//! by any one queue or volume.
//!
//! - Classes go from 4 KiB to 4 MiB in steps of 1.5x and 2x (4, 8, 12, 16, 24, 32, 48 KiB, ...),
//!   so a buffer is at most 1.5 times the request it serves (the budget charges a request its
//!   class, [`class_size`]). Larger requests get a buffer of their own, freed when given back.
//! - The lists are kept per CPU (`Shard`), so a queue's thread takes and gives back buffers
//!   without a cache line another CPU writes; a CPU whose list of a class is empty takes from
//!   another's.
//! - What the cache keeps is bounded for the whole process ([`set_keep_limit`], 32 MiB unless
//!   changed), whatever the number of queues and volumes.
//! - What was not used goes back to the system: a reclaimer thread looks at each class every
//!   `RECLAIM_PERIOD` and frees as many buffers as stayed unused through the whole period (the
//!   fewest the class held since its last look), so a second after a burst ends its buffers
//!   are gone, and a steady load keeps what it cycles through. The thread sleeps while the
//!   cache is empty.
//! - Buffers of 64 KiB and more are mappings of their own (`AlignedBuf`), returned to the
//!   kernel when freed. Smaller ones come from the C allocator, whose per-thread arenas keep
//!   freed memory (measured: 628 of 731 MiB of an idle daemon after a burst of 64 KiB writes
//!   on 80 queues, before this cache): after freeing, the reclaimer asks it to give free pages
//!   back (`malloc_trim`).

use crate::AlignedBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::Duration;

/// Smallest class.
const MIN_CLASS: usize = 4096;
/// Largest class: the largest vhost-user-blk request (`MAX_REQUEST_BYTES`).
pub const MAX_CLASS: usize = 4 << 20;
/// 4 KiB, then each power of two from 8 KiB to 4 MiB with 1.5 times the one below it.
const CLASSES: usize = 2 * 10;
/// How often the reclaimer looks at the cache while it holds buffers.
pub const RECLAIM_PERIOD: Duration = Duration::from_secs(1);
/// What the cache keeps at most unless told otherwise.
pub const DEFAULT_KEEP: u64 = 32 << 20;

/// The capacity of the buffer a request of `len` bytes gets (its class; above the largest
/// class, `len` rounded up to whole 4 KiB).
pub fn class_size(len: usize) -> usize {
    match class_index(len) {
        Some(i) => class_capacity(i),
        None => len.next_multiple_of(MIN_CLASS),
    }
}

fn class_capacity(index: usize) -> usize {
    if index == 0 {
        return MIN_CLASS;
    }
    // Index 2k-1 is 2^k x 4 KiB; index 2k is 1.5 x that.
    let k = index.div_ceil(2);
    let power = MIN_CLASS << k;
    if index % 2 == 1 {
        power
    } else {
        power + power / 2
    }
}

fn class_index(len: usize) -> Option<usize> {
    if len <= MIN_CLASS {
        return Some(0);
    }
    if len > MAX_CLASS {
        return None;
    }
    // The smallest power of two (in 4 KiB units) at or above len, then its 1.5x step below.
    let units = len.div_ceil(MIN_CLASS);
    let k = usize::BITS - (units - 1).leading_zeros();
    let power = MIN_CLASS << k;
    let index = 2 * k as usize - 1;
    if k >= 2 && len <= (power / 2) + (power / 4) {
        Some(index - 1)
    } else {
        Some(index)
    }
}

struct Class {
    capacity: usize,
    free: Mutex<FreeList>,
}

#[derive(Default)]
struct FreeList {
    /// Taken and given back at the end; the reclaimer frees from the start (the least
    /// recently used).
    bufs: Vec<AlignedBuf>,
    /// The fewest buffers on the list since the reclaimer last looked.
    low: usize,
}

/// The lists of one CPU: a buffer goes back to the shard of the CPU that gives it back and is
/// taken from the shard of the CPU that takes it (from another one when that is empty), so a
/// queue's thread takes and gives back on lists and counters its CPU already holds. Aligned so
/// that no two shards share a cache line.
#[repr(align(128))]
struct Shard {
    classes: Vec<Class>,
    /// Bytes of the buffers on this shard's lists.
    kept: AtomicU64,
}

impl Shard {
    fn new() -> Self {
        Shard {
            classes: (0..CLASSES)
                .map(|i| Class {
                    capacity: class_capacity(i),
                    free: Mutex::new(FreeList::default()),
                })
                .collect(),
            kept: AtomicU64::new(0),
        }
    }

    fn pop(&self, index: usize) -> Option<AlignedBuf> {
        let buf = {
            let mut free = lock(&self.classes[index].free);
            let buf = free.bufs.pop();
            free.low = free.low.min(free.bufs.len());
            buf
        }?;
        self.kept.fetch_sub(buf.len() as u64, Ordering::Relaxed);
        Some(buf)
    }
}

struct Cache {
    /// One per CPU (at most `MAX_SHARDS`).
    shards: Vec<Shard>,
    keep_limit: AtomicU64,
    reclaimer_started: AtomicBool,
    /// The reclaimer sleeps until a buffer is kept (it found the cache empty).
    reclaimer_asleep: AtomicBool,
    wake: (Mutex<()>, Condvar),
}

/// Shards at most, whatever the number of CPUs.
const MAX_SHARDS: usize = 64;

fn cache() -> &'static Cache {
    static CACHE: OnceLock<Cache> = OnceLock::new();
    CACHE.get_or_init(|| {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        Cache::new(true, cpus.min(MAX_SHARDS))
    })
}

impl Cache {
    /// `reclaimed`: a reclaimer thread looks at it (started with the first buffer kept).
    fn new(reclaimed: bool, shards: usize) -> Self {
        Cache {
            shards: (0..shards.max(1)).map(|_| Shard::new()).collect(),
            keep_limit: AtomicU64::new(DEFAULT_KEEP),
            reclaimer_started: AtomicBool::new(!reclaimed),
            reclaimer_asleep: AtomicBool::new(false),
            wake: (Mutex::new(()), Condvar::new()),
        }
    }

    /// The shard of the CPU this thread runs on.
    fn local(&self) -> usize {
        // SAFETY: sched_getcpu has no preconditions; it returns -1 on failure (then shard 0).
        let cpu = unsafe { libc::sched_getcpu() };
        usize::try_from(cpu).unwrap_or(0) % self.shards.len()
    }

    fn kept(&self) -> u64 {
        self.shards
            .iter()
            .map(|s| s.kept.load(Ordering::Relaxed))
            .sum()
    }

    fn take(&'static self, len: usize) -> PooledBuf {
        let Some(index) = class_index(len) else {
            return PooledBuf {
                buf: Some(AlignedBuf::zeroed(class_size(len))),
                cache: self,
            };
        };
        let local = self.local();
        let n = self.shards.len();
        let reused = (0..n).find_map(|k| self.shards[(local + k) % n].pop(index));
        let buf = reused.unwrap_or_else(|| AlignedBuf::zeroed(class_capacity(index)));
        PooledBuf {
            buf: Some(buf),
            cache: self,
        }
    }

    fn give_back(&'static self, buf: AlignedBuf) {
        let Some(index) = class_index(buf.len()).filter(|&i| class_capacity(i) == buf.len()) else {
            return;
        };
        let size = buf.len() as u64;
        let limit = self.keep_limit.load(Ordering::Relaxed);
        let shard = &self.shards[self.local()];
        // Within its part of the limit a shard keeps the buffer without looking at the others.
        let within = shard.kept.load(Ordering::Relaxed) + size <= limit / self.shards.len() as u64
            || self.kept() + size <= limit;
        if !within {
            return;
        }
        lock(&shard.classes[index].free).bufs.push(buf);
        shard.kept.fetch_add(size, Ordering::SeqCst);
        if !self.reclaimer_started.load(Ordering::Relaxed) {
            self.start_reclaimer();
        }
        // Pairs with the reclaimer's store before it looks at `kept` a last time.
        if self.reclaimer_asleep.load(Ordering::SeqCst) {
            let _guard = lock(&self.wake.0);
            self.reclaimer_asleep.store(false, Ordering::SeqCst);
            self.wake.1.notify_one();
        }
    }

    fn start_reclaimer(&'static self) {
        if self.reclaimer_started.swap(true, Ordering::SeqCst) {
            return;
        }
        let started = std::thread::Builder::new()
            .name("buffer-reclaim".into())
            .spawn(move || self.reclaim_forever());
        if let Err(e) = started {
            // Without it the cache keeps up to its limit: still bounded.
            tracing::warn!("cannot start the buffer reclaimer: {e}");
        }
    }

    fn reclaim_forever(&self) {
        loop {
            // Look every period for as long as anything is kept.
            loop {
                std::thread::sleep(RECLAIM_PERIOD);
                if self.reclaim_unused() > 0 {
                    give_free_pages_back();
                }
                if self.kept() == 0 {
                    break;
                }
            }
            // Then sleep until a buffer is kept again.
            self.reclaimer_asleep.store(true, Ordering::SeqCst);
            let mut guard = lock(&self.wake.0);
            while self.reclaimer_asleep.load(Ordering::SeqCst) {
                if self.kept() > 0 {
                    self.reclaimer_asleep.store(false, Ordering::SeqCst);
                    break;
                }
                guard = self
                    .wake
                    .1
                    .wait(guard)
                    .unwrap_or_else(PoisonError::into_inner);
            }
        }
    }

    /// Frees, in every class of every shard, the buffers that stayed on the list since the
    /// last look (and any over the keep limit); returns the bytes freed.
    fn reclaim_unused(&self) -> u64 {
        let mut freed = 0u64;
        let limit = self.keep_limit.load(Ordering::Relaxed);
        for shard in &self.shards {
            for class in &shard.classes {
                let unused: Vec<AlignedBuf> = {
                    let mut free = lock(&class.free);
                    let mut n = free.low.min(free.bufs.len());
                    let kept = self.kept();
                    if kept > limit {
                        let over = (kept - limit).div_ceil(class.capacity as u64);
                        n = n.max(
                            usize::try_from(over)
                                .unwrap_or(usize::MAX)
                                .min(free.bufs.len()),
                        );
                    }
                    let unused = free.bufs.drain(..n).collect();
                    free.low = free.bufs.len();
                    unused
                };
                let bytes = (unused.len() * class.capacity) as u64;
                shard.kept.fetch_sub(bytes, Ordering::Relaxed);
                freed += bytes;
                drop(unused);
            }
        }
        freed
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A list of plain buffers cannot be left inconsistent by a panicking holder.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Bounds the bytes of free buffers the cache keeps (0 keeps none); buffers over the new
/// bound are freed by the reclaimer's next look or when they come back.
pub fn set_keep_limit(bytes: u64) {
    cache().keep_limit.store(bytes, Ordering::Relaxed);
}

/// Bytes of free buffers the cache holds now.
pub fn kept_bytes() -> u64 {
    cache().kept()
}

/// A buffer of at least `len` bytes (its class's capacity), aligned for direct I/O, contents
/// unspecified (callers overwrite what they use).
pub fn take(len: usize) -> PooledBuf {
    cache().take(len)
}

/// Asks the C allocator to return its free pages (glibc's arenas keep them otherwise).
fn give_free_pages_back() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim takes a padding size and only returns free memory to the system.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// A buffer of the cache, given back to it when dropped (on every path, errors included).
/// Derefs to its whole capacity.
pub struct PooledBuf {
    /// Always Some until drop gives it back.
    buf: Option<AlignedBuf>,
    cache: &'static Cache,
}

impl PooledBuf {
    pub fn capacity(&self) -> usize {
        self.buf.as_ref().map_or(0, |b| b.len())
    }
}

impl std::ops::Deref for PooledBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.buf.as_deref().unwrap_or(&[])
    }
}

impl std::ops::DerefMut for PooledBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.buf.as_deref_mut().unwrap_or(&mut [])
    }
}

impl Drop for PooledBuf {
    fn drop(&mut self) {
        if let Some(buf) = self.buf.take() {
            self.cache.give_back(buf);
        }
    }
}

impl std::fmt::Debug for PooledBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PooledBuf({} bytes)", self.capacity())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_step_by_one_and_a_half_and_two() {
        let sizes: Vec<usize> = (0..CLASSES).map(class_capacity).collect();
        assert_eq!(
            &sizes[..8],
            &[4, 8, 12, 16, 24, 32, 48, 64].map(|k| k << 10)
        );
        assert_eq!(sizes[CLASSES - 1], MAX_CLASS);
        for (i, &size) in sizes.iter().enumerate() {
            assert_eq!(class_index(size), Some(i), "{size}");
            assert_eq!(
                class_index(size + 1).map(class_capacity),
                sizes.get(i + 1).copied()
            );
            assert!(i == 0 || class_index(sizes[i - 1] + 1) == Some(i));
        }
        assert_eq!(class_size(1), 4096);
        assert_eq!(class_size(5000), 8192);
        assert_eq!(class_size(1280 << 10), 1536 << 10);
        assert_eq!(class_size(MAX_CLASS + 1), MAX_CLASS + 4096);
        for len in (1..(MAX_CLASS + 10)).step_by(997) {
            let c = class_size(len);
            assert!(
                c >= len && (c <= 4096 || c * 2 <= len * 3 + 8192),
                "{len} -> {c}"
            );
        }
    }

    /// A cache of its own, without a reclaimer thread: the test looks for it.
    fn private_cache(shards: usize) -> &'static Cache {
        Box::leak(Box::new(Cache::new(false, shards)))
    }

    fn free_len(cache: &Cache, len: usize) -> usize {
        let index = class_index(len).unwrap();
        cache
            .shards
            .iter()
            .map(|s| lock(&s.classes[index].free).bufs.len())
            .sum()
    }

    #[test]
    fn buffers_come_back_to_their_class_and_are_reused() {
        let cache = private_cache(1);
        let first = cache.take(3 << 20);
        let address = first.as_ptr();
        assert_eq!(first.capacity(), 3 << 20);
        assert_eq!(first.as_ptr() as usize % crate::DIRECT_IO_ALIGN, 0);
        drop(first);
        assert_eq!(cache.kept(), 3 << 20);
        let again = cache.take((3 << 20) - 5);
        assert_eq!(again.as_ptr(), address);
        assert_eq!(cache.kept(), 0);
        let oversized = cache.take(MAX_CLASS + 1);
        assert_eq!(oversized.capacity(), MAX_CLASS + 4096);
        drop(oversized);
        assert_eq!(cache.kept(), 0);
    }

    #[test]
    fn a_cpu_takes_from_another_s_list_when_its_own_is_empty() {
        let cache = private_cache(64);
        // Whatever CPU this runs on, the buffer lands in one shard and is found from any.
        drop(cache.take(64 << 10));
        assert_eq!((cache.kept(), free_len(cache, 64 << 10)), (64 << 10, 1));
        let shard = cache
            .shards
            .iter()
            .position(|s| s.kept.load(Ordering::Relaxed) > 0)
            .unwrap();
        let other = (shard + 1) % cache.shards.len();
        let n = cache.shards.len();
        let found =
            (0..n).find_map(|k| cache.shards[(other + k) % n].pop(class_index(64 << 10).unwrap()));
        assert!(found.is_some());
        assert_eq!(cache.kept(), 0);
    }

    #[test]
    fn what_is_kept_is_bounded() {
        let cache = private_cache(4);
        cache.keep_limit.store(1 << 20, Ordering::Relaxed);
        let held: Vec<PooledBuf> = (0..5).map(|_| cache.take(256 << 10)).collect();
        drop(held);
        assert_eq!(cache.kept(), 1 << 20);
    }

    #[test]
    fn unused_buffers_are_freed_by_the_next_looks() {
        let cache = private_cache(1);
        let held: Vec<PooledBuf> = (0..4).map(|_| cache.take(64 << 10)).collect();
        drop(held);
        // All four were in use during this period: kept.
        assert_eq!(cache.reclaim_unused(), 0);
        assert_eq!(free_len(cache, 64 << 10), 4);
        // One in use during the next: the other three are freed.
        drop(cache.take(64 << 10));
        assert_eq!(cache.reclaim_unused(), 3 * (64 << 10));
        assert_eq!(free_len(cache, 64 << 10), 1);
        assert_eq!(cache.reclaim_unused(), 64 << 10);
        assert_eq!(cache.kept(), 0);
    }
}
