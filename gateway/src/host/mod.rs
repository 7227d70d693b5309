//! NVMe/TCP initiator (host) library, used by tests, benchmarks and tools.
//!
//! One [`HostConnection`] is one TCP connection carrying one queue (the
//! admin queue or one I/O queue), as NVMe/TCP requires:
//!
//! ```no_run
//! # async fn demo() -> Result<(), nvmeof_gateway::host::HostError> {
//! use nvmeof_gateway::host::{HostConnection, HostOptions};
//! let opts = HostOptions::new("nqn.2014-08.org.nvmexpress:uuid:demo");
//! let admin = HostConnection::connect("127.0.0.1:4420", opts.clone()).await?;
//! let cntlid = admin.connect_admin("nqn.2016-06.io.example:sub", 30_000).await?;
//! admin.enable_controller().await?;
//! let ctrl = admin.identify_controller().await?;
//! let io = HostConnection::connect("127.0.0.1:4420", opts).await?;
//! io.set_in_capsule_data_max(ctrl.in_capsule_data_max());
//! io.connect_io("nqn.2016-06.io.example:sub", cntlid, 1, 127).await?;
//! let data = io.read(1, 0, 8, 512).await?;
//! # let _ = data; Ok(()) }
//! ```
//!
//! Commands are pipelined: [`HostConnection::start`] sends a command and
//! returns an [`Inflight`] handle to await its completion, so many commands
//! can be outstanding on one queue; a reader task matches responses to
//! commands by CID, answers R2Ts with H2CData and gathers C2HData.
//!
//! For benchmarks, [`pipelined::LeanQueue`] drives one I/O queue from a blocking socket
//! with no allocation per command.

mod auth;
pub mod cmd;
mod commands;
mod conn;
pub mod pipelined;

pub use auth::{AuthOutcome, HostTransaction, Refused};
pub use cmd::{
    Completion, DiscoveryEntry, DiscoveryLog, IdentifyController, IdentifyNamespace, Sqe,
};
pub use conn::{HostConnection, HostError, HostOptions, Inflight, RawCommand, Response, Xfer};

#[cfg(test)]
mod tests;
