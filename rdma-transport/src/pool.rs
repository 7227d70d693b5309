//! The registered-buffer cache: memory registered once and lent out per I/O.
//!
//! - **Size classes** (e.g. 4 KiB, 16 KiB, 64 KiB, 128 KiB) are allocated and registered when
//!   the pool is created; a request takes the smallest class that fits and has a free buffer.
//! - **Larger or unusual sizes** come from a registration cache: buffers of the request's size
//!   (rounded up to 4 KiB), registered on first use and kept registered when returned, so the
//!   next request of that size is a hit. The cache is bounded in bytes; to make room it evicts
//!   the least recently used **idle** buffers (the `lru` crate) and never one on loan.
//! - When nothing fits (every class buffer on loan, the cache full of buffers on loan) the
//!   request is refused with `None`: the caller waits for its [`Waker`] and tries
//!   again (back-pressure, never a failed I/O). Exhaustion is counted.
//!
//! Buffers are plain `Vec<u8>`s whose heap allocation was registered; the pool recognises a
//! returned buffer by that address and knows its key. The registration itself is behind the
//! [`Registrar`] trait, so the pool is tested without RDMA hardware.
//!
//! Besides its own counters (one pool's, for its log line), every pool adds to process-wide
//! [`RegistrationCounters`] (what a metrics exporter reads): registrations, deregistrations and
//! registered bytes, with those made while serving apart from those of setup. Creating a pool,
//! [`BufferPool::take_for_setup`] and dropping a pool are setup; [`BufferPool::take`] and
//! [`BufferPool::take_copy_of`] serve (the data path: a registration there is a cost paid per
//! I/O), and only they count hits, misses and copies.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use lru::LruCache;

use crate::ffi::{self, MemoryRegion, ProtectionDomain};

/// One registration; dropping it deregisters.
pub trait Registration: Send + Sync {
    fn lkey(&self) -> u32;
}

/// Registers memory with an adapter.
pub trait Registrar: Send + Sync {
    fn register(&self, mem: &mut [u8]) -> Result<Box<dyn Registration>, ffi::Error>;
}

impl Registration for MemoryRegion {
    fn lkey(&self) -> u32 {
        MemoryRegion::lkey(self)
    }
}

/// Registers with a protection domain (`ibv_reg_mr`, local write access).
pub struct VerbsRegistrar {
    pub pd: Arc<ProtectionDomain>,
}

impl Registrar for VerbsRegistrar {
    fn register(&self, mem: &mut [u8]) -> Result<Box<dyn Registration>, ffi::Error> {
        Ok(Box::new(MemoryRegion::register(&self.pd, mem)?))
    }
}

/// Pool shape.
#[derive(Debug, Clone)]
pub struct PoolConfig {
    /// `(buffer size, count)` per size class, registered at creation.
    pub classes: Vec<(usize, usize)>,
    /// Upper bound of the registration cache in bytes.
    pub cache_bytes: usize,
}

impl Default for PoolConfig {
    fn default() -> Self {
        Self {
            classes: vec![
                (4096, 512),
                (16 * 1024, 128),
                (64 * 1024, 64),
                (128 * 1024, 64),
            ],
            cache_bytes: 64 << 20,
        }
    }
}

/// Counters (monotonic unless noted).
#[derive(Debug, Default)]
pub struct PoolCounters {
    /// Memory registrations made (size classes at creation, cache misses later).
    pub registrations: AtomicU64,
    pub deregistrations: AtomicU64,
    /// Buffers lent from a size class.
    pub class_takes: AtomicU64,
    /// Registration-cache requests served by an idle registered buffer.
    pub cache_hits: AtomicU64,
    /// Registration-cache requests that registered a new buffer.
    pub cache_misses: AtomicU64,
    /// Idle cache buffers deregistered to make room.
    pub evictions: AtomicU64,
    /// Requests refused because nothing fit (the caller waited).
    pub exhaustion: AtomicU64,
}

/// Registrations of every pool in the process, for metrics (monotonic unless noted).
#[derive(Debug, Default)]
pub struct RegistrationCounters {
    /// Memory registrations made (setup and serving).
    pub registrations: AtomicU64,
    /// Of `registrations`: made by a request while serving (a registration-cache miss).
    pub registrations_serving: AtomicU64,
    /// Memory registrations released (cache evictions, pools dropped).
    pub deregistrations: AtomicU64,
    /// Of `deregistrations`: evictions made by a request while serving.
    pub deregistrations_serving: AtomicU64,
    /// Bytes registered now (a gauge).
    pub registered_bytes: AtomicU64,
    /// Requests while serving that got memory already registered (a size-class buffer or an
    /// idle registration-cache buffer).
    pub hits: AtomicU64,
    /// Requests while serving that registered a new buffer.
    pub misses: AtomicU64,
    /// Payloads copied into a registered buffer because they were not in one.
    pub copies: AtomicU64,
}

impl RegistrationCounters {
    pub const fn new() -> Self {
        Self {
            registrations: AtomicU64::new(0),
            registrations_serving: AtomicU64::new(0),
            deregistrations: AtomicU64::new(0),
            deregistrations_serving: AtomicU64::new(0),
            registered_bytes: AtomicU64::new(0),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            copies: AtomicU64::new(0),
        }
    }

    pub fn snapshot(&self) -> RegistrationStats {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        RegistrationStats {
            registrations: g(&self.registrations),
            registrations_serving: g(&self.registrations_serving),
            deregistrations: g(&self.deregistrations),
            deregistrations_serving: g(&self.deregistrations_serving),
            registered_bytes: g(&self.registered_bytes),
            hits: g(&self.hits),
            misses: g(&self.misses),
            copies: g(&self.copies),
        }
    }

    fn registered(&self, bytes: usize, phase: Phase) {
        self.registrations.fetch_add(1, Ordering::Relaxed);
        if phase == Phase::Serving {
            self.registrations_serving.fetch_add(1, Ordering::Relaxed);
        }
        self.registered_bytes
            .fetch_add(bytes as u64, Ordering::Relaxed);
    }

    fn deregistered(&self, bytes: usize, phase: Phase) {
        self.deregistrations.fetch_add(1, Ordering::Relaxed);
        if phase == Phase::Serving {
            self.deregistrations_serving.fetch_add(1, Ordering::Relaxed);
        }
        self.registered_bytes
            .fetch_sub(bytes as u64, Ordering::Relaxed);
    }
}

/// A snapshot of [`RegistrationCounters`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RegistrationStats {
    pub registrations: u64,
    pub registrations_serving: u64,
    pub deregistrations: u64,
    pub deregistrations_serving: u64,
    pub registered_bytes: u64,
    pub hits: u64,
    pub misses: u64,
    pub copies: u64,
}

static REGISTRATIONS: RegistrationCounters = RegistrationCounters::new();

/// The registrations of every pool in this process (pools made with [`BufferPool::new`]).
pub fn registrations() -> &'static RegistrationCounters {
    &REGISTRATIONS
}

/// Why a pool registers: to get ready (pool creation, receives posted for a new connection)
/// or for a request on the data path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Setup,
    Serving,
}

/// A snapshot of the counters plus the current state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolStats {
    pub registrations: u64,
    pub deregistrations: u64,
    pub class_takes: u64,
    pub cache_hits: u64,
    pub cache_misses: u64,
    pub evictions: u64,
    pub exhaustion: u64,
    /// Buffers currently on loan.
    pub on_loan: usize,
    /// Bytes held by the registration cache (idle and on loan).
    pub cache_bytes: usize,
    /// Registrations currently alive.
    pub live_registrations: usize,
    /// Bytes those registrations cover.
    pub registered_bytes: usize,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Origin {
    Class(usize),
    Cache,
}

struct Entry {
    reg: Box<dyn Registration>,
    size: usize,
    origin: Origin,
    on_loan: bool,
}

struct Class {
    size: usize,
    free: Vec<Vec<u8>>,
}

struct Inner {
    classes: Vec<Class>,
    entries: HashMap<usize, Entry>,
    /// Idle cache buffers by size, and their LRU order (address -> size).
    idle_by_size: BTreeMap<usize, Vec<Vec<u8>>>,
    idle_lru: LruCache<usize, usize>,
    cache_used: usize,
    on_loan: usize,
    waiters: usize,
    registered_bytes: usize,
}

/// Wakes whoever waits for a buffer (the transport plugs in its reactor's notifier).
pub trait Waker: Send + Sync {
    fn wake(&self);
}

pub struct BufferPool {
    inner: Mutex<Inner>,
    registrar: Box<dyn Registrar>,
    cache_limit: usize,
    counters: PoolCounters,
    registrations: &'static RegistrationCounters,
    waker: Mutex<Option<Arc<dyn Waker>>>,
}

const PAGE: usize = 4096;

fn round_up(len: usize) -> usize {
    len.div_ceil(PAGE).max(1) * PAGE
}

impl BufferPool {
    /// Allocates and registers every size-class buffer; counts in the process-wide
    /// [`registrations`].
    pub fn new(config: &PoolConfig, registrar: Box<dyn Registrar>) -> Result<Self, ffi::Error> {
        Self::with_counters(config, registrar, registrations())
    }

    /// Like [`BufferPool::new`], counting registrations in `registrations` instead.
    pub fn with_counters(
        config: &PoolConfig,
        registrar: Box<dyn Registrar>,
        registrations: &'static RegistrationCounters,
    ) -> Result<Self, ffi::Error> {
        let pool = Self {
            inner: Mutex::new(Inner {
                classes: Vec::new(),
                entries: HashMap::new(),
                idle_by_size: BTreeMap::new(),
                idle_lru: LruCache::unbounded(),
                cache_used: 0,
                on_loan: 0,
                waiters: 0,
                registered_bytes: 0,
            }),
            registrar,
            cache_limit: config.cache_bytes,
            counters: PoolCounters::default(),
            registrations,
            waker: Mutex::new(None),
        };
        let mut classes: Vec<(usize, usize)> = config.classes.clone();
        classes.sort_unstable();
        {
            let mut inner = pool.lock();
            for (ci, &(size, count)) in classes.iter().enumerate() {
                let mut class = Class {
                    size,
                    free: Vec::with_capacity(count),
                };
                for _ in 0..count {
                    let mut buf = vec![0u8; size];
                    let reg = pool.registrar.register(&mut buf)?;
                    pool.counters.registrations.fetch_add(1, Ordering::Relaxed);
                    pool.registrations.registered(size, Phase::Setup);
                    inner.registered_bytes += size;
                    inner.entries.insert(
                        buf.as_ptr() as usize,
                        Entry {
                            reg,
                            size,
                            origin: Origin::Class(ci),
                            on_loan: false,
                        },
                    );
                    class.free.push(buf);
                }
                inner.classes.push(class);
            }
        }
        Ok(pool)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Who to wake when a buffer comes back while someone waits.
    pub fn set_waker(&self, waker: Arc<dyn Waker>) {
        *self.waker.lock().unwrap_or_else(|e| e.into_inner()) = Some(waker);
    }

    pub fn counters(&self) -> &PoolCounters {
        &self.counters
    }

    /// A registered buffer of exactly `len` bytes (contents unspecified) and its key, or
    /// `None` when the pool is exhausted: wait for a wake-up and try again. For requests
    /// while serving: a registration made here is counted as one.
    pub fn take(&self, len: usize) -> Option<(Vec<u8>, u32)> {
        self.take_in(len, Phase::Serving)
    }

    /// Like [`BufferPool::take`], while getting ready to serve (e.g. the receives of a new
    /// connection): not counted as a registration while serving, nor as a hit or miss.
    pub fn take_for_setup(&self, len: usize) -> Option<(Vec<u8>, u32)> {
        self.take_in(len, Phase::Setup)
    }

    /// A registered buffer holding a copy of `data` (which is not in registered memory), and
    /// its key; counted as a copy. `None` when the pool is exhausted.
    pub fn take_copy_of(&self, data: &[u8]) -> Option<(Vec<u8>, u32)> {
        let (mut buf, lkey) = self.take(data.len())?;
        buf.copy_from_slice(data);
        self.registrations.copies.fetch_add(1, Ordering::Relaxed);
        Some((buf, lkey))
    }

    fn take_in(&self, len: usize, phase: Phase) -> Option<(Vec<u8>, u32)> {
        let mut inner = self.lock();
        let got = self.take_locked(&mut inner, len, phase);
        if got.is_none() {
            self.counters.exhaustion.fetch_add(1, Ordering::Relaxed);
            inner.waiters += 1;
        }
        got
    }

    fn hit(&self, phase: Phase) {
        if phase == Phase::Serving {
            self.registrations.hits.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn take_locked(&self, inner: &mut Inner, len: usize, phase: Phase) -> Option<(Vec<u8>, u32)> {
        // Size classes, smallest that fits first.
        let mut from_class = None;
        for class in inner.classes.iter_mut() {
            if class.size >= len {
                if let Some(buf) = class.free.pop() {
                    from_class = Some(buf);
                    break;
                }
            }
        }
        if let Some(mut buf) = from_class {
            self.counters.class_takes.fetch_add(1, Ordering::Relaxed);
            self.hit(phase);
            buf.resize(len, 0);
            return Some(self.lend(inner, buf));
        }
        let size = round_up(len);
        // Registration cache: an idle buffer of this size?
        let hit = inner.idle_by_size.get_mut(&size).and_then(|v| v.pop());
        if let Some(mut buf) = hit {
            if inner.idle_by_size.get(&size).is_some_and(|v| v.is_empty()) {
                inner.idle_by_size.remove(&size);
            }
            inner.idle_lru.pop(&(buf.as_ptr() as usize));
            self.counters.cache_hits.fetch_add(1, Ordering::Relaxed);
            self.hit(phase);
            buf.resize(len, 0);
            return Some(self.lend(inner, buf));
        }
        // Make room by evicting idle buffers, least recently used first.
        while inner.cache_used + size > self.cache_limit {
            let (addr, esize) = inner.idle_lru.pop_lru()?;
            if let Some(list) = inner.idle_by_size.get_mut(&esize) {
                if let Some(i) = list.iter().position(|b| b.as_ptr() as usize == addr) {
                    let buf = list.swap_remove(i);
                    if list.is_empty() {
                        inner.idle_by_size.remove(&esize);
                    }
                    // Deregister before freeing the memory.
                    inner.entries.remove(&addr);
                    drop(buf);
                    inner.cache_used -= esize;
                    inner.registered_bytes -= esize;
                    self.counters.evictions.fetch_add(1, Ordering::Relaxed);
                    self.counters
                        .deregistrations
                        .fetch_add(1, Ordering::Relaxed);
                    self.registrations.deregistered(esize, phase);
                }
            }
        }
        let mut buf = vec![0u8; size];
        let reg = match self.registrar.register(&mut buf) {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, size, "registration failed: waiting for a buffer");
                return None;
            }
        };
        self.counters.registrations.fetch_add(1, Ordering::Relaxed);
        self.counters.cache_misses.fetch_add(1, Ordering::Relaxed);
        self.registrations.registered(size, phase);
        if phase == Phase::Serving {
            self.registrations.misses.fetch_add(1, Ordering::Relaxed);
        }
        inner.cache_used += size;
        inner.registered_bytes += size;
        inner.entries.insert(
            buf.as_ptr() as usize,
            Entry {
                reg,
                size,
                origin: Origin::Cache,
                on_loan: false,
            },
        );
        buf.resize(len, 0);
        Some(self.lend(inner, buf))
    }

    fn lend(&self, inner: &mut Inner, buf: Vec<u8>) -> (Vec<u8>, u32) {
        inner.on_loan += 1;
        let e = inner
            .entries
            .get_mut(&(buf.as_ptr() as usize))
            .map(|e| {
                e.on_loan = true;
                e.reg.lkey()
            })
            .unwrap_or(0);
        (buf, e)
    }

    /// The key of a buffer on loan from this pool that covers `buf`, if it is one.
    pub fn lkey(&self, buf: &[u8]) -> Option<u32> {
        let inner = self.lock();
        let e = inner.entries.get(&(buf.as_ptr() as usize))?;
        (e.on_loan && buf.len() <= e.size).then(|| e.reg.lkey())
    }

    /// Returns a buffer. Returns it back (`Err`) when it is not one of this pool's.
    pub fn give_back(&self, mut buf: Vec<u8>) -> Result<(), Vec<u8>> {
        let addr = buf.as_ptr() as usize;
        let wake = {
            let mut inner = self.lock();
            let Some(e) = inner.entries.get_mut(&addr) else {
                return Err(buf);
            };
            if !e.on_loan || buf.capacity() < e.size {
                return Err(buf);
            }
            e.on_loan = false;
            let (origin, size) = (e.origin, e.size);
            inner.on_loan -= 1;
            buf.resize(size, 0);
            match origin {
                Origin::Class(ci) => inner.classes[ci].free.push(buf),
                Origin::Cache => {
                    inner.idle_lru.put(addr, size);
                    inner.idle_by_size.entry(size).or_default().push(buf);
                }
            }
            std::mem::take(&mut inner.waiters) > 0
        };
        if wake {
            if let Some(w) = self.waker.lock().unwrap_or_else(|e| e.into_inner()).clone() {
                w.wake();
            }
        }
        Ok(())
    }

    pub fn stats(&self) -> PoolStats {
        let inner = self.lock();
        let c = &self.counters;
        PoolStats {
            registrations: c.registrations.load(Ordering::Relaxed),
            deregistrations: c.deregistrations.load(Ordering::Relaxed),
            class_takes: c.class_takes.load(Ordering::Relaxed),
            cache_hits: c.cache_hits.load(Ordering::Relaxed),
            cache_misses: c.cache_misses.load(Ordering::Relaxed),
            evictions: c.evictions.load(Ordering::Relaxed),
            exhaustion: c.exhaustion.load(Ordering::Relaxed),
            on_loan: inner.on_loan,
            cache_bytes: inner.cache_used,
            live_registrations: inner.entries.len(),
            registered_bytes: inner.registered_bytes,
        }
    }
}

impl Drop for BufferPool {
    fn drop(&mut self) {
        // Registrations first (Entry drops deregister), then the memory.
        let mut inner = self.lock();
        let entries = std::mem::take(&mut inner.entries);
        for entry in entries.into_values() {
            let size = entry.size;
            drop(entry);
            self.registrations.deregistered(size, Phase::Setup);
        }
        inner.registered_bytes = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    #[derive(Default)]
    struct Fake {
        next: AtomicU32,
        live: Arc<AtomicU64>,
        fail: std::sync::atomic::AtomicBool,
    }
    struct FakeReg(u32, Arc<AtomicU64>);
    impl Registration for FakeReg {
        fn lkey(&self) -> u32 {
            self.0
        }
    }
    impl Drop for FakeReg {
        fn drop(&mut self) {
            self.1.fetch_sub(1, Ordering::SeqCst);
        }
    }
    impl Registrar for Arc<Fake> {
        fn register(&self, _mem: &mut [u8]) -> Result<Box<dyn Registration>, ffi::Error> {
            if self.fail.load(Ordering::SeqCst) {
                return Err(ffi::Error::Errno {
                    call: "fake",
                    errno: libc::ENOMEM,
                });
            }
            self.live.fetch_add(1, Ordering::SeqCst);
            Ok(Box::new(FakeReg(
                self.next.fetch_add(1, Ordering::SeqCst) + 1,
                self.live.clone(),
            )))
        }
    }

    fn pool(classes: Vec<(usize, usize)>, cache: usize) -> (BufferPool, Arc<Fake>) {
        let fake = Arc::new(Fake::default());
        let p = BufferPool::new(
            &PoolConfig {
                classes,
                cache_bytes: cache,
            },
            Box::new(fake.clone()),
        )
        .expect("pool");
        (p, fake)
    }

    #[test]
    fn size_classes_are_registered_once_and_reused() {
        let (p, _) = pool(vec![(4096, 2), (65536, 1)], 0);
        assert_eq!(p.stats().registrations, 3);
        for _ in 0..100 {
            let (a, ka) = p.take(512).expect("4k");
            assert_eq!(a.len(), 512);
            assert_eq!(p.lkey(&a), Some(ka));
            let (b, _) = p.take(30000).expect("64k");
            p.give_back(a).expect("ours");
            p.give_back(b).expect("ours");
        }
        let s = p.stats();
        assert_eq!(s.registrations, 3, "no registration in steady state");
        assert_eq!(s.on_loan, 0);
        assert_eq!(s.class_takes, 200);
    }

    #[test]
    fn a_full_class_spills_to_the_next_larger_one() {
        let (p, _) = pool(vec![(4096, 1), (16384, 1)], 0);
        let a = p.take(4096).expect("first");
        let b = p.take(4096).expect("spills to 16k");
        assert_eq!(b.0.len(), 4096);
        assert!(p.take(4096).is_none(), "exhausted");
        assert_eq!(p.stats().exhaustion, 1);
        p.give_back(a.0).expect("ours");
        p.give_back(b.0).expect("ours");
    }

    #[test]
    fn foreign_buffers_are_refused() {
        let (p, _) = pool(vec![(4096, 1)], 0);
        assert!(p.give_back(vec![0u8; 4096]).is_err());
        assert_eq!(p.lkey(&[0u8; 16]), None);
        let (a, _) = p.take(100).expect("buf");
        let copy = a.clone();
        assert!(p.give_back(copy).is_err());
        p.give_back(a).expect("ours");
        assert_eq!(p.stats().on_loan, 0);
    }

    #[test]
    fn large_sizes_use_the_registration_cache_with_hits() {
        let (p, _) = pool(vec![(4096, 1)], 4 << 20);
        let (a, _) = p.take(1 << 20).expect("1 MiB");
        p.give_back(a).expect("ours");
        for _ in 0..10 {
            let (a, _) = p.take(1 << 20).expect("hit");
            p.give_back(a).expect("ours");
        }
        let s = p.stats();
        assert_eq!(s.cache_misses, 1);
        assert_eq!(s.cache_hits, 10);
        assert_eq!(s.registrations, 2);
        // Unusual sizes round up to 4 KiB and share a registration.
        let (a, _) = p.take(1_000_000).expect("rounded");
        assert_eq!(a.len(), 1_000_000);
        p.give_back(a).expect("ours");
        let (a, _) = p.take(1_000_001).expect("same rounded size");
        p.give_back(a).expect("ours");
        assert_eq!(p.stats().cache_hits, 11);
    }

    #[test]
    fn cache_is_bounded_and_evicts_least_recently_used_idle_buffers() {
        let (p, fake) = pool(vec![], 3 * 256 * 1024);
        let sizes = [256 * 1024, 200 * 1024, 300 * 1024 - 4096];
        for s in sizes {
            let (b, _) = p.take(s).expect("fits");
            p.give_back(b).expect("ours");
        }
        assert_eq!(p.stats().cache_bytes, 256 * 1024 + 200 * 1024 + 296 * 1024);
        // Touch the 256K one so the 200K one is least recently used.
        let (b, _) = p.take(256 * 1024).expect("hit");
        p.give_back(b).expect("ours");
        // A new 64K buffer does not fit (752K + 64K > 768K): the 200K one goes.
        let (b, _) = p.take(64 * 1024).expect("after eviction");
        let s = p.stats();
        assert_eq!(s.evictions, 1);
        assert!(s.cache_bytes <= 3 * 256 * 1024);
        p.give_back(b).expect("ours");
        // The 256K one is still cached (a hit), the 200K one is not (a miss).
        let hits = p.stats().cache_hits;
        let (b, _) = p.take(256 * 1024).expect("still cached");
        assert_eq!(p.stats().cache_hits, hits + 1);
        p.give_back(b).expect("ours");
        assert_eq!(
            fake.live.load(Ordering::SeqCst) as usize,
            p.stats().live_registrations
        );
    }

    #[test]
    fn buffers_on_loan_are_never_evicted_and_exhaustion_back_pressures() {
        let (p, fake) = pool(vec![], 2 * 128 * 1024);
        let a = p.take(200 * 1024).expect("a");
        assert!(
            p.take(200 * 1024).is_none(),
            "bound reached: the caller waits"
        );
        assert_eq!(p.stats().exhaustion, 1);
        assert_eq!(p.stats().evictions, 0, "a buffer on loan is not evicted");

        struct Flag(std::sync::atomic::AtomicBool);
        impl Waker for Flag {
            fn wake(&self) {
                self.0.store(true, Ordering::SeqCst);
            }
        }
        let flag = Arc::new(Flag(Default::default()));
        p.set_waker(flag.clone());
        p.give_back(a.0).expect("ours");
        assert!(flag.0.load(Ordering::SeqCst), "the waiter is woken");
        let b = p.take(200 * 1024).expect("after the wake-up");
        p.give_back(b.0).expect("ours");
        // A different size evicts the idle one.
        let c = p.take(100 * 1024).expect("evicts");
        assert_eq!(p.stats().evictions, 1);
        p.give_back(c.0).expect("ours");
        drop(p);
        assert_eq!(fake.live.load(Ordering::SeqCst), 0, "all deregistered");
    }

    #[test]
    fn registrations_are_counted_for_metrics_apart_from_setup() {
        let counters: &'static RegistrationCounters =
            Box::leak(Box::new(RegistrationCounters::new()));
        let fake = Arc::new(Fake::default());
        let p = BufferPool::with_counters(
            &PoolConfig {
                classes: vec![(4096, 2)],
                cache_bytes: (2 << 20) + 8192,
            },
            Box::new(fake.clone()),
            counters,
        )
        .expect("pool");
        let setup = RegistrationStats {
            registrations: 2,
            registered_bytes: 8192,
            ..Default::default()
        };
        assert_eq!(counters.snapshot(), setup, "size classes: setup");
        // A new connection's receive: registered, but not while serving.
        let (recv, _) = p.take_for_setup(12 * 1024).expect("receive");
        p.give_back(recv).expect("ours");
        let after_setup = RegistrationStats {
            registrations: 3,
            registered_bytes: 8192 + 12 * 1024,
            ..Default::default()
        };
        assert_eq!(counters.snapshot(), after_setup);
        // Serving: a class buffer (hit), a new 1 MiB buffer (miss, registered while serving),
        // the same size again (hit), a copy.
        let (a, _) = p.take(512).expect("class");
        p.give_back(a).expect("ours");
        let (b, _) = p.take(1 << 20).expect("miss");
        p.give_back(b).expect("ours");
        let (c, _) = p.take(1 << 20).expect("hit");
        p.give_back(c).expect("ours");
        let (d, _) = p.take_copy_of(&[9u8; 100]).expect("copy");
        assert_eq!(&d[..], &[9u8; 100][..]);
        p.give_back(d).expect("ours");
        // 1 MiB + 12 KiB cached of 2 MiB + 8 KiB: a 1 MiB + 4 KiB buffer evicts the least
        // recently used idle one (the receive's) while serving, then registers.
        let (e, _) = p.take((1 << 20) + 4096).expect("evicts");
        p.give_back(e).expect("ours");
        let s = counters.snapshot();
        assert_eq!(
            s,
            RegistrationStats {
                registrations: 5,
                registrations_serving: 2,
                deregistrations: 1,
                deregistrations_serving: 1,
                registered_bytes: (8192 + (1 << 20) + (1 << 20) + 4096) as u64,
                hits: 3,
                misses: 2,
                copies: 1,
            }
        );
        assert_eq!(p.stats().registered_bytes as u64, s.registered_bytes);
        drop(p);
        let gone = counters.snapshot();
        assert_eq!(
            gone.deregistrations, 5,
            "a dropped pool deregisters everything"
        );
        assert_eq!(gone.deregistrations_serving, 1);
        assert_eq!(gone.registered_bytes, 0);
        assert_eq!(fake.live.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn a_failed_registration_is_a_wait_not_an_error() {
        let (p, fake) = pool(vec![], 1 << 20);
        fake.fail.store(true, Ordering::SeqCst);
        assert!(p.take(8192).is_none());
        fake.fail.store(false, Ordering::SeqCst);
        let (b, _) = p.take(8192).expect("retry works");
        p.give_back(b).expect("ours");
    }
}
