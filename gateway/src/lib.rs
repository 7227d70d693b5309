//! Ceph RBD to NVMe-oF gateway: the protocol core, its transports and the daemon's pieces.

/// DH-HMAC-CHAP's primitives (crate `nvme-auth`), shared with the control plane.
pub use nvme_auth as auth;
pub mod apply;
mod blocking;
pub mod config;
pub mod core;
pub mod events;
pub mod group;
pub mod health;
pub mod host;
pub mod io_report;
mod keep_alive;
pub mod lease;
pub mod limits;
pub mod metrics;
pub mod osd_witness;
pub mod qos;
pub mod rdma;
pub mod reload;
#[cfg(test)]
mod scratch;
pub mod signals;
pub mod spec;
pub mod stall;
pub mod tcp;
