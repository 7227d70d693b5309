//! Ceph RBD images as [`BlockDevice`]s: cluster connections shared by a bounded number of
//! images, and [`RbdDevice`], which turns [`IoOp`]s into `rbd_aio_*` calls.
//!
//! # Threads
//! - [`ClusterPool::open`] blocks (connect, `rbd_open`): call it from a blocking thread or at
//!   start-up. It takes no lock that I/O of open images needs, and connecting a new shard holds
//!   only that shard's lock.
//! - [`RbdDevice::submit`] never waits for the cluster: librbd dispatches the op on the
//!   calling thread down to the messenger's queue (`rbd_non_blocking_aio=false`, without the
//!   Objecter throttle, see [`GATEWAY_DEFAULT_ARGS`]) and returns; the completion runs on a
//!   librados callback thread, which calls [`IoCompletion::complete`] directly.
//!   Reads land directly in the op's buffer. Writes pass a small non-blocking gate that orders
//!   them against emulated compare-and-writes (see [`WriteGate`]); compare-and-write beyond
//!   one 512-byte sector runs on an `rbd-caw` thread.
//! - Resize notifications (`rbd_update_watch`) arrive on a librbd thread, which must not call
//!   librbd synchronously; they are forwarded to one `rbd-events` thread that reads the new
//!   size and reports [`DeviceEvent::Resized`].
//! - Dropping a device closes its image on an `rbd-close` thread; [`wait_for_closes`] waits.
//!
//! Files: `settings.rs` (what the gateway's `[ceph]` section configures), `cluster.rs`
//! (connections and opening images), `device.rs` (the device and librbd's completions),
//! `caw.rs` (compare-and-write).
//!
//! [`BlockDevice`]: crate::BlockDevice
//! [`IoOp`]: crate::IoOp
//! [`RbdDevice::submit`]: crate::BlockDevice::submit
//! [`IoCompletion::complete`]: crate::IoCompletion::complete
//! [`DeviceEvent::Resized`]: crate::DeviceEvent::Resized
//!
//! # Sharding
//! A [`ClusterPool`] has up to `max_connections` `rados_t` handles (each with its own messenger
//! threads). A new image goes to the shard with the fewest open images, connecting that shard
//! on first use, so with N images and C connections every connection serves at most
//! ceil(N / C) images. One context shared by every image roughly halves IOPS on many-core
//! machines (spdk #2580, ceph-nvmeof #939); one per image costs threads and memory. Measured
//! here (micro cluster, 2 vCPUs): an idle connection ~8 MiB RSS and 12 threads; an open image
//! ~0.35 MiB before I/O, ~1 MiB after, 0.6 threads. Default: one connection per CPU, at most 8.
//!
//! # Defaults
//! Before the user's `args`/`options`, the gateway sets `rbd_cache=false` (writes are
//! acknowledged durable; FUA = write + flush stays correct either way),
//! `client_mount_timeout=30`, inline dispatch and no Objecter throttle (see
//! [`GATEWAY_DEFAULT_ARGS`]).

mod caw;
mod cluster;
mod device;
mod settings;
#[cfg(test)]
mod tests;

use crate::ffi::FfiError;

pub use crate::ffi::versions as library_versions;
pub use caw::WriteGate;
pub(crate) use cluster::connect_rados;
pub use cluster::{last_connect_failure, wait_for_closes, ClientHealth, ClusterPool, PoolAdmin};
pub use device::{record_object, DeviceState, RbdDevice};
pub use settings::{default_connections, CephSettings, ImageSpec, GATEWAY_DEFAULT_ARGS};

// Linux errno values, which librbd returns negated (include/uapi/asm-generic/errno*.h).
const ENOENT: i32 = 2;
const EIO: i32 = 5;
const EINVAL: i32 = 22;
const EROFS: i32 = 30;
const EILSEQ: i32 = 84;
const ESHUTDOWN: i32 = 108; // EBLOCKLISTED
const ETIMEDOUT: i32 = 110;

/// Why a cluster or image could not be used.
#[derive(Debug, Clone, thiserror::Error)]
pub enum RbdError {
    #[error(transparent)]
    Library(FfiError),
    #[error("ceph configuration: {0}")]
    Config(String),
    /// A file the settings name (ceph.conf, keyring) cannot be used: said before connecting,
    /// because librados only reports a missing keyring as an authentication failure.
    #[error("ceph {what} {path}: {problem}")]
    File {
        what: &'static str,
        path: String,
        problem: String,
    },
    #[error("cannot connect to the Ceph cluster as {client} (conf {conf}): {source}")]
    Connect {
        client: String,
        conf: String,
        source: FfiError,
    },
    #[error("pool {pool:?} not found")]
    PoolNotFound { pool: String },
    #[error("image {image} not found")]
    ImageNotFound { image: String },
    #[error("cannot open image {image}: {source}")]
    Open { image: String, source: FfiError },
    #[error(
        "image {image}: rbd_open did not finish within {secs} s (cluster slow or an OSD down)"
    )]
    OpenTimedOut { image: String, secs: u64 },
    #[error("{what} on image {image}: {source}")]
    Image {
        what: &'static str,
        image: String,
        source: FfiError,
    },
}
