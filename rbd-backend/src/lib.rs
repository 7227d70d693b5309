//! Block devices behind NVMe namespaces.
//!
//! The NVMe-oF core never calls a storage library directly: it hands an [`IoOp`] to a
//! [`BlockDevice`] and later receives the same op back, with its result, through an
//! [`IoCompletion`]. That callback shape (rather than `async fn`) is what librbd's
//! `rbd_aio_*` completions map onto without a boxed future per I/O, and it lets the op own its
//! buffers, so a device that completes on another thread can never write into freed memory.
//!
//! Devices: [`MemoryDevice`] (RAM) and [`RbdDevice`] (a Ceph RBD image through librbd, see
//! [`rbd`]). All foreign calls live in the private `ffi` module, the only one allowed `unsafe`.

#![deny(unsafe_code)]

mod device;
mod ffi;
mod memory;
pub mod op_ages;
pub mod osd_probe;
pub mod rados;
pub mod rbd;
pub mod stats;

pub use device::{
    BlockDevice, ByteBudget, Charge, DeviceEvent, DeviceEventSink, IoBuf, IoCompletion, IoDone,
    IoError, IoOp,
};
pub use memory::MemoryDevice;
pub use rbd::{CephSettings, ClusterPool, ImageSpec, RbdDevice, RbdError};
pub use stats::{IoStats, IoStatsSnapshot, OpKind, OpTotals};
