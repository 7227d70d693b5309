//! RDMA verbs and `rdma_cm` for the gateway's NVMe/RDMA binding, with no NVMe knowledge.
//!
//! - [`ffi`]: the only module with `unsafe`. Safe owning types for the device context,
//!   protection domain, memory region, completion channel and queue, reliable-connected queue
//!   pair (which owns posted buffers until their completion), `rdma_cm` event channel and IDs
//!   (listener and connections), shared receive queue, asynchronous device events, live
//!   object counters. libibverbs/librdmacm are loaded at run time.
//! - [`pool`]: the registered-buffer cache (size classes registered once, a bounded LRU
//!   registration cache for other sizes, counters, back-pressure on exhaustion).

#![deny(unsafe_code)]

pub mod ffi;
pub mod pool;

pub use ffi::{
    available, live_objects, release_removed_devices, AsyncEvent, AsyncEventKind, CmEvent,
    CmEventKind, CmId, CmIdRef, CompletionChannel, CompletionQueue, ConnParams, DeviceContext,
    DeviceLimits, Error, EventChannel, Lent, LiveObjects, MemoryRegion, ProtectionDomain, QpCaps,
    QpInfo, QueuePair, Remote, SharedReceiveQueue, WcOpcode, WorkCompletion,
};
pub use pool::{
    registrations, BufferPool, PoolConfig, PoolCounters, PoolStats, Registrar, Registration,
    RegistrationCounters, RegistrationStats, VerbsRegistrar, Waker,
};
