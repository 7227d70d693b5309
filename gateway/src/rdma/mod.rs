//! NVMe/RDMA: the same protocol core as NVMe/TCP, over reliable-connected queue pairs.
//!
//! - `wire`: the `rdma_cm` private data of connect requests, replies and rejects.
//! - `connection`: one queue pair (one NVMe queue) on a tokio task: capsules by SEND/RECV
//!   with receives pre-posted, keyed SGL data by RDMA READ (host to controller) and RDMA
//!   WRITE (controller to host) from registered buffers, SEND with Invalidate when the host
//!   asks, in-capsule data up to IOCCSZ.
//! - `server`: the `rdma_cm` listener: checks connect requests, creates the queue pair and
//!   its resources, accepts or rejects with the spec's codes, routes CM events.
//!
//! Completions are event-driven: each queue pair's completion channel fd is registered with
//! tokio (`AsyncFd`); a wake-up takes the channel's event (one `read`), re-arms the CQ, and
//! polls up to a budget of completions (256, then it yields and polls again without waiting
//! for the fd); the responses of a wake-up go out as one chained `ibv_post_send`. An idle
//! connection costs nothing and a busy one pays the wake-up per batch, not per completion.
//! Measured in the QEMU guest over Soft-RoCE (`tests/vm/e2e-rdma.sh`, 4K random reads at
//! QD16): ~9-11 I/Os per wake-up, 0.44 gateway system calls per I/O (per wake-up:
//! `epoll_wait`, the channel `read`, and with rxe an `ioctl` for the re-arm and a `write`
//! doorbell per post, both of which mlx5 does in user space), 0.1% of a core for an idle
//! connected controller. Polling threads were not chosen: they would spend a core per
//! worker when idle and, on this 2-core machine, take it from the host and librbd.

pub mod connection;
pub mod server;
pub mod wire;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use rdma_transport::{BufferPool, DeviceContext, DeviceLimits, PoolConfig, ProtectionDomain};

use crate::core::TransportCaps;

/// Bytes of data a command capsule may carry (IOCCSZ = (64 + this) / 16 = 516).
pub const IN_CAPSULE_DATA_SIZE: u32 = 8192;

/// Transport capabilities reported to controllers created over RDMA.
pub fn rdma_caps() -> TransportCaps {
    TransportCaps {
        in_capsule_data_size: IN_CAPSULE_DATA_SIZE,
        keyed_sgls: true,
    }
}

/// Per-device resources shared by every queue pair on it: the protection domain and the
/// registered-buffer pool.
pub struct Device {
    pub context: DeviceContext,
    pub limits: DeviceLimits,
    pub pd: Arc<ProtectionDomain>,
    /// Data buffers: size classes plus the registration cache.
    pub pool: Arc<BufferPool>,
    /// Receive buffers (command capsules with in-capsule data), registered on first use and
    /// reused by later connections; separate so data back-pressure never starves receives.
    pub recv_pool: Arc<BufferPool>,
    /// Woken when a buffer returns to a pool that refused a request.
    pub buffers_returned: Arc<tokio::sync::Notify>,
}

struct NotifyWaker(Arc<tokio::sync::Notify>);

impl rdma_transport::Waker for NotifyWaker {
    fn wake(&self) {
        self.0.notify_waiters();
    }
}

impl Device {
    pub fn open(
        context: DeviceContext,
        pool: &PoolConfig,
    ) -> Result<Arc<Self>, rdma_transport::Error> {
        let limits = context.query()?;
        let pd = ProtectionDomain::new(context)?;
        let pool = Arc::new(BufferPool::new(
            pool,
            Box::new(rdma_transport::VerbsRegistrar { pd: pd.clone() }),
        )?);
        let recv_pool = Arc::new(BufferPool::new(
            &PoolConfig {
                classes: Vec::new(),
                cache_bytes: RECV_CACHE_BYTES,
            },
            Box::new(rdma_transport::VerbsRegistrar { pd: pd.clone() }),
        )?);
        let buffers_returned = Arc::new(tokio::sync::Notify::new());
        pool.set_waker(Arc::new(NotifyWaker(buffers_returned.clone())));
        Ok(Arc::new(Self {
            context,
            limits,
            pd,
            pool,
            recv_pool,
            buffers_returned,
        }))
    }

    /// Returns a buffer to the pool it came from.
    pub fn give_back(&self, buf: Vec<u8>) {
        if let Err(buf) = self.pool.give_back(buf) {
            let _ = self.recv_pool.give_back(buf);
        }
    }
}

/// Bound of the receive-buffer registrations per device: 256 MiB is about 20 000 receives of
/// 12 KiB, e.g. 150 queues of 128 entries.
const RECV_CACHE_BYTES: usize = 256 << 20;

/// The data pool's shape: the default, or `NVMEOF_RDMA_POOL="SIZExCOUNT,..."` and
/// `NVMEOF_RDMA_CACHE_MIB=N` (for tests of back-pressure). The cache holds at least one
/// MDTS-sized buffer, so every command can eventually get one.
pub fn pool_config_from_env() -> PoolConfig {
    let mut c = PoolConfig::default();
    if let Ok(spec) = std::env::var("NVMEOF_RDMA_POOL") {
        let parsed: Option<Vec<(usize, usize)>> = spec
            .split(',')
            .filter(|s| !s.trim().is_empty())
            .map(|s| {
                let (size, count) = s.trim().split_once('x')?;
                Some((size.parse().ok()?, count.parse().ok()?))
            })
            .collect();
        match parsed {
            Some(classes) => c.classes = classes,
            None => {
                tracing::warn!(%spec, "NVMEOF_RDMA_POOL: expected SIZExCOUNT,...; using the default")
            }
        }
    }
    if let Some(mib) = std::env::var("NVMEOF_RDMA_CACHE_MIB")
        .ok()
        .and_then(|s| s.parse::<usize>().ok())
    {
        c.cache_bytes = mib << 20;
    }
    c.cache_bytes = c.cache_bytes.max(crate::core::queue::MAX_DATA_LEN as usize);
    c
}

/// Transport counters, process-wide.
#[derive(Debug, Default)]
pub struct RdmaStats {
    pub connect_requests: AtomicU64,
    pub accepted: AtomicU64,
    pub rejected: AtomicU64,
    /// Queue pairs alive now.
    pub live_qps: AtomicU64,
    pub commands: AtomicU64,
    pub rdma_reads: AtomicU64,
    pub rdma_writes: AtomicU64,
    pub send_with_invalidate: AtomicU64,
    /// Payload bytes copied into a registered buffer because the core's buffer was not one
    /// (should stay 0 for reads).
    pub payload_copies: AtomicU64,
    /// Data buffers the core got from plain memory because the pool was empty.
    pub unregistered_buffers: AtomicU64,
    /// Commands that waited for a registered buffer (back-pressure).
    pub buffer_waits: AtomicU64,
    /// Work completions with an error status (flushes excluded).
    pub wc_errors: AtomicU64,
    /// Buffers still owned by a device when a connection gave up waiting (leaked, not reused).
    pub abandoned_buffers: AtomicU64,
}

static STATS: RdmaStats = RdmaStats {
    connect_requests: AtomicU64::new(0),
    accepted: AtomicU64::new(0),
    rejected: AtomicU64::new(0),
    live_qps: AtomicU64::new(0),
    commands: AtomicU64::new(0),
    rdma_reads: AtomicU64::new(0),
    rdma_writes: AtomicU64::new(0),
    send_with_invalidate: AtomicU64::new(0),
    payload_copies: AtomicU64::new(0),
    unregistered_buffers: AtomicU64::new(0),
    buffer_waits: AtomicU64::new(0),
    wc_errors: AtomicU64::new(0),
    abandoned_buffers: AtomicU64::new(0),
};

pub fn stats() -> &'static RdmaStats {
    &STATS
}

impl RdmaStats {
    pub fn summary(&self) -> String {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        format!(
            "connect_requests={} accepted={} rejected={} live_qps={} commands={} rdma_reads={} rdma_writes={} send_inv={} payload_copies={} unregistered_buffers={} buffer_waits={} wc_errors={} abandoned_buffers={}",
            g(&self.connect_requests),
            g(&self.accepted),
            g(&self.rejected),
            g(&self.live_qps),
            g(&self.commands),
            g(&self.rdma_reads),
            g(&self.rdma_writes),
            g(&self.send_with_invalidate),
            g(&self.payload_copies),
            g(&self.unregistered_buffers),
            g(&self.buffer_waits),
            g(&self.wc_errors),
            g(&self.abandoned_buffers),
        )
    }
}

/// The receive pool's counters, with names that do not collide with the data pool's.
pub fn recv_summary(pool: &BufferPool) -> String {
    let s = pool.stats();
    format!(
        "recv_registrations={} recv_hits={} recv_on_loan={}",
        s.registrations, s.cache_hits, s.on_loan
    )
}

/// The pool's counters as one log line.
pub fn pool_summary(pool: &BufferPool) -> String {
    let s = pool.stats();
    format!(
        "registrations={} deregistrations={} live_registrations={} class_takes={} cache_hits={} cache_misses={} evictions={} exhaustion={} on_loan={} cache_bytes={}",
        s.registrations,
        s.deregistrations,
        s.live_registrations,
        s.class_takes,
        s.cache_hits,
        s.cache_misses,
        s.evictions,
        s.exhaustion,
        s.on_loan,
        s.cache_bytes
    )
}
