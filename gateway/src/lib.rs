//! Ceph RBD to NVMe-oF gateway: the protocol core, its transports and the daemon's pieces.

pub mod auth;
mod blocking;
pub mod config;
pub mod core;
pub mod events;
pub mod group;
pub mod host;
mod keep_alive;
pub mod limits;
pub mod metrics;
pub mod rdma;
pub mod signals;
pub mod spec;
pub mod tcp;
