//! Ceph RBD to NVMe-oF gateway: the protocol core, its transports and the daemon's pieces.

pub mod core;
pub mod spec;
