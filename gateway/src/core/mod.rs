//! The NVMe-oF protocol core: subsystems, controllers, queues and every command, with no
//! I/O and no clock. Transports (NVMe/TCP, NVMe/RDMA) drive it through [`queue::Queue`].

pub mod admin;
pub mod auth;
pub mod budget;
pub mod buffers;
pub mod cid_map;
pub mod command;
pub mod controller;
pub mod fabrics;
pub mod identify;
pub mod io;
pub mod log_page;
pub mod pr;
pub mod qos;
pub mod queue;
pub mod refusals;
pub mod subsystem;
pub(crate) mod supported;
pub mod target;
pub mod tls;
pub mod visibility;
mod wire;

pub use auth::{AuthCounters, AuthPolicy, HostKeys};
pub use budget::DataBudget;
pub use buffers::{BufferSource, RecycledBuffers};
pub use command::{Command, Completion, Status};
pub use controller::{Controller, QueueNotifier, TeardownReason};
pub use queue::{Action, Queue, Response};
pub use refusals::{ConnectRefusals, RefusalReason};
pub use subsystem::{FrozenSize, HostAccess, Namespace, Subsystem, SubsystemKind, SubsystemSpec};
pub use target::{
    ListenerInfo, Target, TargetIdentity, TransportCaps, TransportType, UnavailableNamespace,
};
pub use visibility::Visibility;

#[cfg(test)]
mod auth_tests;
#[cfg(test)]
mod discovery_tests;
#[cfg(test)]
mod pr_tests;
#[cfg(test)]
mod refusal_tests;
#[cfg(test)]
pub(crate) mod tests;
#[cfg(test)]
mod visibility_tests;
