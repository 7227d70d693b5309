//! NVMe/TCP: the PDU codec (pure) and the tokio binding that drives the protocol core.

use std::sync::atomic::AtomicU64;
use std::sync::OnceLock;

use crate::core::budget::{self, DataBudget};

pub mod busy_poll;
pub mod connection;
pub mod digest;
pub mod ktls;
mod ktls_sys;
pub mod pdu;
pub mod server;
pub mod tls;
mod tls_ffi;

/// Transport counters, process-wide (exported as metrics).
#[derive(Debug, Default)]
pub struct TcpStats {
    /// Connections accepted since start.
    pub accepted: AtomicU64,
    /// Connections open now.
    pub live: AtomicU64,
    /// Connections closed for a malformed PDU (after a C2HTermReq).
    pub fatal_pdu_errors: AtomicU64,
    /// H2CData whose data digest did not match (the command failed for retry).
    pub data_digest_errors: AtomicU64,
    /// Connections the host ended with an H2CTermReq.
    pub host_term_reqs: AtomicU64,
    /// Reads while a busy-polling window was open (`[gateway] tcp_busy_poll_us`), found by
    /// the probe or by the runtime's readiness between slices: wake-ups saved.
    pub busy_poll_reads: AtomicU64,
    /// Busy-polling windows that closed with nothing to read (the task went to sleep).
    pub busy_poll_expired: AtomicU64,
    /// Adaptive busy polling (`tcp_busy_poll_adaptive`): a queue chose polling after
    /// measuring both modes.
    pub busy_poll_chose_poll: AtomicU64,
    /// ... and sleeping.
    pub busy_poll_chose_sleep: AtomicU64,
    /// Bytes of data buffers the connections keep for reuse (none of them in use).
    pub kept_buffer_bytes: AtomicU64,
}

static STATS: TcpStats = TcpStats {
    accepted: AtomicU64::new(0),
    live: AtomicU64::new(0),
    fatal_pdu_errors: AtomicU64::new(0),
    data_digest_errors: AtomicU64::new(0),
    host_term_reqs: AtomicU64::new(0),
    busy_poll_reads: AtomicU64::new(0),
    busy_poll_expired: AtomicU64::new(0),
    busy_poll_chose_poll: AtomicU64::new(0),
    busy_poll_chose_sleep: AtomicU64::new(0),
    kept_buffer_bytes: AtomicU64::new(0),
};

pub fn stats() -> &'static TcpStats {
    &STATS
}

static DATA_BUDGET: OnceLock<DataBudget> = OnceLock::new();

/// What every NVMe/TCP listener's data buffers count against, unless a listener is given its
/// own ([`server::TcpServer::with_data_budget`]): [`budget::DEFAULT_LIMIT`] unless
/// [`set_data_budget_limit`] came first.
pub fn data_budget() -> &'static DataBudget {
    DATA_BUDGET.get_or_init(|| DataBudget::new(budget::DEFAULT_LIMIT))
}

/// Sets the process-wide budget's limit (`[gateway] tcp_data_budget`); false if the budget
/// was in use already, with the limit it had.
pub fn set_data_budget_limit(limit: usize) -> bool {
    DATA_BUDGET.set(DataBudget::new(limit)).is_ok()
}
