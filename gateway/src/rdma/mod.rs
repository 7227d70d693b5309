//! NVMe/RDMA: the same protocol core as NVMe/TCP, over reliable-connected queue pairs.
//!
//! - `wire`: the `rdma_cm` private data of connect requests, replies and rejects.
//! - `close`: when a closing queue pair may be disconnected (after the sends it posted, so a
//!   response sent just before a close reaches the host).
//! - `connection`: one queue pair (one NVMe queue) on a tokio task: capsules by SEND/RECV
//!   with receives pre-posted, keyed SGL data by RDMA READ (host to controller) and RDMA
//!   WRITE (controller to host) from registered buffers, SEND with Invalidate when the host
//!   asks, in-capsule data up to IOCCSZ.
//! - `server`: the `rdma_cm` listener: checks connect requests, creates the queue pair and
//!   its resources, accepts or rejects with the spec's codes, routes CM events.
//!
//! Receives: by default every queue pair on a device takes its command capsules from the
//! device's shared receive queue ([`DEFAULT_SRQ_DEPTH`] receives, `NVMEOF_RDMA_SRQ_DEPTH`,
//! `NVMEOF_RDMA_SRQ=0` for one receive queue per QP), so receive memory is fixed per device
//! instead of growing with `HSQSIZE + 1` per queue (measured in `tests/vm/e2e-rdma.sh`, steps
//! m1/m2). A receive is re-posted once its capsule is copied out; a closing QP's CQ is polled
//! empty after the QP is destroyed, so the receives it consumed go back to the SRQ, which is
//! then topped up to its depth.
//!
//! Device removal (`RDMA_CM_EVENT_DEVICE_REMOVAL`, or a fatal device event): every queue pair
//! on the device closes, the listener bound to it is destroyed, and once nothing uses the
//! device its SRQ, pools (MRs) and PD are released and librdmacm is made to close the context
//! (`rdma_transport::release_removed_devices`), which is what lets the kernel finish the
//! removal; the listener tries to listen again every second, so it comes back when the address
//! has an RDMA device again. TCP listeners are not involved. QP error events (QP fatal,
//! request or access error) close that queue pair.
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

mod close;
pub mod connection;
pub mod server;
pub mod wire;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use rdma_transport::{
    BufferPool, DeviceContext, DeviceLimits, Lent, PoolConfig, ProtectionDomain, SharedReceiveQueue,
};

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
    /// The receives for command capsules, shared by every queue pair on the device (when the
    /// device has SRQs and they are not turned off): receive memory stays
    /// `depth x RECV_LEN` whatever the number of queues. Without it each queue pair posts
    /// `HSQSIZE + 1` receives of its own.
    pub srq: Option<Arc<SharedReceiveQueue>>,
}

/// Bytes of one receive: a command capsule with in-capsule data.
pub const RECV_LEN: usize = crate::core::command::SQE_LEN + IN_CAPSULE_DATA_SIZE as usize;

/// Receives in a device's shared receive queue by default: 6 MiB of receive buffers (12 KiB
/// registered each) for any number of queues. A receive is re-posted as soon as its capsule is
/// copied out, not held for the command's I/O, so the depth covers capsules that arrive
/// between two polls of a CQ, not every outstanding command (Linux nvmet uses 1024 per
/// completion vector, SPDK 4096 per poll group). A host that sends while every receive is in
/// use gets an RNR NAK and retries: flow control, not an error.
pub const DEFAULT_SRQ_DEPTH: u32 = 512;

/// The shared receive queue's depth: `NVMEOF_RDMA_SRQ_DEPTH=N`, or `0` for one receive queue
/// per queue pair (`NVMEOF_RDMA_SRQ=0` too); default [`DEFAULT_SRQ_DEPTH`].
pub fn srq_depth_from_env() -> u32 {
    if std::env::var("NVMEOF_RDMA_SRQ").is_ok_and(|v| v.trim() == "0") {
        return 0;
    }
    match std::env::var("NVMEOF_RDMA_SRQ_DEPTH") {
        Ok(v) => v.trim().parse().unwrap_or_else(|_| {
            tracing::warn!(value = %v, "NVMEOF_RDMA_SRQ_DEPTH: not a number; using the default");
            DEFAULT_SRQ_DEPTH
        }),
        Err(_) => DEFAULT_SRQ_DEPTH,
    }
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
        srq_depth: u32,
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
        let depth = srq_depth.min(limits.max_srq_wr);
        let srq = if depth == 0 || limits.max_srq == 0 {
            None
        } else {
            match SharedReceiveQueue::new(&pd, depth) {
                Ok(srq) => Some(srq),
                Err(e) => {
                    tracing::warn!(error = %e, "no shared receive queue: one receive queue per queue pair");
                    None
                }
            }
        };
        let device = Arc::new(Self {
            context,
            limits,
            pd,
            pool,
            recv_pool,
            buffers_returned,
            srq,
        });
        device.replenish_srq();
        Ok(device)
    }

    /// Tops the shared receive queue up to its depth (at start, and after receives were lost
    /// with a queue pair or could not be re-posted). Returns the receives posted now.
    pub fn replenish_srq(&self) -> usize {
        let Some(srq) = &self.srq else {
            return 0;
        };
        let mut posted = 0;
        while srq.posted() < srq.capacity() as usize {
            let Some((buf, lkey)) = self.recv_pool.take_for_setup(RECV_LEN) else {
                tracing::warn!("no registered memory for the shared receive queue");
                break;
            };
            if let Err((e, buf)) = srq.post_recv(0, Lent { buf, lkey }) {
                tracing::warn!(error = %e, "cannot post a shared receive");
                let _ = self.recv_pool.give_back(buf);
                break;
            }
            posted += 1;
        }
        posted
    }

    /// Re-posts a consumed receive buffer to the shared receive queue, or returns it to the
    /// receive pool when that fails (the SRQ is full or destroyed).
    pub fn repost_shared(&self, mut buf: Vec<u8>) {
        let Some(srq) = &self.srq else {
            let _ = self.recv_pool.give_back(buf);
            return;
        };
        let Some(lkey) = self.recv_pool.lkey(&buf) else {
            let _ = self.recv_pool.give_back(buf);
            return;
        };
        buf.resize(RECV_LEN, 0);
        if let Err((e, buf)) = srq.post_recv(0, Lent { buf, lkey }) {
            tracing::debug!(error = %e, "shared receive not re-posted");
            let _ = self.recv_pool.give_back(buf);
        }
    }

    /// Destroys the shared receive queue (every queue pair on the device must be gone) and
    /// returns its buffers to the receive pool. Returns false when the provider refused.
    pub fn release_srq(&self) -> bool {
        let Some(srq) = &self.srq else {
            return true;
        };
        match srq.destroy() {
            Ok(bufs) => {
                for (_, buf) in bufs {
                    let _ = self.recv_pool.give_back(buf);
                }
                true
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot destroy the shared receive queue");
                false
            }
        }
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
    /// Queue pair error events (QP fatal, request or access error) from the device.
    pub qp_fatal_events: AtomicU64,
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
    qp_fatal_events: AtomicU64::new(0),
};

pub fn stats() -> &'static RdmaStats {
    &STATS
}

impl RdmaStats {
    pub fn summary(&self) -> String {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        format!(
            "connect_requests={} accepted={} rejected={} live_qps={} commands={} rdma_reads={} rdma_writes={} send_inv={} payload_copies={} unregistered_buffers={} buffer_waits={} wc_errors={} abandoned_buffers={} qp_fatal_events={}",
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
            g(&self.qp_fatal_events),
        )
    }
}

/// The receive side's counters, with names that do not collide with the data pool's:
/// registered receive memory (`recv_bytes`), receives on loan (posted or being handled) and
/// the shared receive queue's fill (`srq_posted`/`srq_depth`, 0/0 without one).
pub fn recv_summary(device: &Device) -> String {
    let s = device.recv_pool.stats();
    let (posted, depth) = device
        .srq
        .as_ref()
        .map(|q| (q.posted(), q.capacity()))
        .unwrap_or((0, 0));
    format!(
        "recv_registrations={} recv_deregistrations={} recv_live_registrations={} recv_hits={} recv_on_loan={} recv_bytes={} srq_posted={} srq_depth={}",
        s.registrations,
        s.deregistrations,
        s.live_registrations,
        s.cache_hits,
        s.on_loan,
        s.cache_bytes,
        posted,
        depth
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
