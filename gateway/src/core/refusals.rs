//! Refused Fabrics Connects: why, counted by reason for the metrics, and one log line each
//! so an admin can tell why a host does not get in.
//!
//! A host can refuse itself in a loop (a reconnecting initiator, a script, a hostile peer):
//! the log is throttled without a clock, per (reason, host, subsystem): the 1st, 2nd, 4th,
//! 8th... refusal of each is logged, with how many there were, so a flood costs a line per
//! doubling while every new host or reason shows at once. The counters count them all.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// Why a Connect (or the authentication a Connect asked for) was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RefusalReason {
    /// RECFMT other than 0.
    IncompatibleFormat,
    /// No Connect data, or less than 1024 bytes of it.
    NoConnectData,
    /// SUBNQN not a NUL-terminated UTF-8 string of 1 to 223 bytes.
    InvalidSubsystemNqn,
    /// HOSTNQN not a NUL-terminated UTF-8 string of at most 223 bytes.
    InvalidHostNqn,
    /// No subsystem of that NQN here.
    UnknownSubsystem,
    /// The subsystem's allowed hosts do not include this one.
    HostNotAllowed,
    /// An empty HOSTNQN, for a subsystem that allows only listed hosts.
    NoHostNqn,
    /// SQSIZE 0 or beyond CAP.MQES.
    InvalidSqsize,
    /// An admin Connect for a controller ID other than FFFFh or FFFEh.
    InvalidControllerId,
    /// Every controller ID of this gateway's range is in use.
    ControllerIdsExhausted,
    /// An I/O Connect naming no live controller of the subsystem.
    UnknownController,
    /// An I/O Connect by another host than the controller's.
    HostMismatch,
    /// An I/O Connect before the controller is enabled (CSTS.RDY).
    ControllerNotReady,
    /// A QID beyond the granted queues, or an I/O queue of a discovery controller.
    InvalidQueueId,
    /// An I/O queue already connected to that controller.
    QueueInUse,
    /// A second Connect on a queue already connected.
    AlreadyConnected,
    /// The host did not authenticate a queue that had to (a command before it, or the
    /// queue closed first, as a Linux host without a key does).
    AuthenticationRequired,
    /// In-band authentication failed (counted by reason in the authentication failures).
    AuthenticationFailed,
    /// A Connect without a secure channel to a subsystem that requires TLS.
    TlsRequired,
    /// A Connect over TLS naming another host or subsystem than the PSK identity.
    TlsIdentityMismatch,
}

impl RefusalReason {
    pub const ALL: [RefusalReason; 20] = [
        RefusalReason::IncompatibleFormat,
        RefusalReason::NoConnectData,
        RefusalReason::InvalidSubsystemNqn,
        RefusalReason::InvalidHostNqn,
        RefusalReason::UnknownSubsystem,
        RefusalReason::HostNotAllowed,
        RefusalReason::NoHostNqn,
        RefusalReason::InvalidSqsize,
        RefusalReason::InvalidControllerId,
        RefusalReason::ControllerIdsExhausted,
        RefusalReason::UnknownController,
        RefusalReason::HostMismatch,
        RefusalReason::ControllerNotReady,
        RefusalReason::InvalidQueueId,
        RefusalReason::QueueInUse,
        RefusalReason::AlreadyConnected,
        RefusalReason::AuthenticationRequired,
        RefusalReason::AuthenticationFailed,
        RefusalReason::TlsRequired,
        RefusalReason::TlsIdentityMismatch,
    ];

    /// The name in logs and in the `reason` label.
    pub fn name(self) -> &'static str {
        match self {
            RefusalReason::IncompatibleFormat => "incompatible_format",
            RefusalReason::NoConnectData => "no_connect_data",
            RefusalReason::InvalidSubsystemNqn => "invalid_subsystem_nqn",
            RefusalReason::InvalidHostNqn => "invalid_host_nqn",
            RefusalReason::UnknownSubsystem => "unknown_subsystem",
            RefusalReason::HostNotAllowed => "host_not_allowed",
            RefusalReason::NoHostNqn => "no_host_nqn",
            RefusalReason::InvalidSqsize => "invalid_sqsize",
            RefusalReason::InvalidControllerId => "invalid_controller_id",
            RefusalReason::ControllerIdsExhausted => "controller_ids_exhausted",
            RefusalReason::UnknownController => "unknown_controller",
            RefusalReason::HostMismatch => "host_mismatch",
            RefusalReason::ControllerNotReady => "controller_not_ready",
            RefusalReason::InvalidQueueId => "invalid_queue_id",
            RefusalReason::QueueInUse => "queue_in_use",
            RefusalReason::AlreadyConnected => "already_connected",
            RefusalReason::AuthenticationRequired => "authentication_required",
            RefusalReason::AuthenticationFailed => "authentication_failed",
            RefusalReason::TlsRequired => "tls_required",
            RefusalReason::TlsIdentityMismatch => "tls_identity_mismatch",
        }
    }

    fn index(self) -> usize {
        // ALL lists every variant once, in declaration order.
        self as usize
    }
}

/// Distinct (reason, host, subsystem) keys whose refusals are throttled one by one; past
/// that, new keys share one throttle (a peer inventing host NQNs cannot grow the map).
const MAX_THROTTLED_KEYS: usize = 1024;

type ThrottleKey = (RefusalReason, String, String);

/// Counters by reason and the log throttle; one per target.
#[derive(Debug, Default)]
pub struct ConnectRefusals {
    counts: [AtomicU64; RefusalReason::ALL.len()],
    repeats: Mutex<HashMap<ThrottleKey, u64>>,
    /// Refusals of keys beyond [`MAX_THROTTLED_KEYS`].
    overflow: AtomicU64,
}

/// One refused Connect, as logged.
#[derive(Debug, Clone, Copy)]
pub struct Refusal<'a> {
    pub reason: RefusalReason,
    pub host: &'a str,
    pub subsystem: &'a str,
    /// The queue the host asked for (None when the Connect command was not read that far).
    pub qid: Option<u16>,
}

impl ConnectRefusals {
    /// (reason name, count) for every reason.
    pub fn counts(&self) -> Vec<(&'static str, u64)> {
        RefusalReason::ALL
            .iter()
            .map(|r| (r.name(), self.count(*r)))
            .collect()
    }

    pub fn count(&self, reason: RefusalReason) -> u64 {
        self.counts[reason.index()].load(Ordering::Relaxed)
    }

    /// Counts a refusal its caller logs itself (an authentication failure, with its details).
    pub fn tally(&self, reason: RefusalReason) {
        self.counts[reason.index()].fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a refusal and logs it unless throttled.
    pub fn record(&self, refusal: Refusal<'_>) {
        self.tally(refusal.reason);
        let Some(repeated) = self.throttle(&refusal) else {
            return;
        };
        let Refusal {
            reason,
            host,
            subsystem,
            qid,
        } = refusal;
        // The transport's span around this call names the peer (its address and port).
        tracing::warn!(
            reason = reason.name(),
            host = %host.escape_debug(),
            subsystem = %subsystem.escape_debug(),
            qid,
            repeated,
            "connect refused"
        );
    }

    /// The number of refusals so far for this key when this one is to be logged.
    fn throttle(&self, refusal: &Refusal<'_>) -> Option<u64> {
        let mut repeats = self.repeats.lock().unwrap_or_else(|e| e.into_inner());
        let key = (
            refusal.reason,
            refusal.host.to_owned(),
            refusal.subsystem.to_owned(),
        );
        let count = if let Some(n) = repeats.get_mut(&key) {
            *n += 1;
            *n
        } else if repeats.len() < MAX_THROTTLED_KEYS {
            repeats.insert(key, 1);
            1
        } else {
            self.overflow.fetch_add(1, Ordering::Relaxed) + 1
        };
        count.is_power_of_two().then_some(count)
    }

    /// A host got in: its next refusal (say, after its access is revoked) logs at once.
    pub fn forget(&self, host: &str, subsystem: &str) {
        let mut repeats = self.repeats.lock().unwrap_or_else(|e| e.into_inner());
        if !repeats.is_empty() {
            repeats.retain(|(_, h, s), _| h != host || s != subsystem);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_reason_has_its_own_counter_and_name() {
        let refusals = ConnectRefusals::default();
        for (i, reason) in RefusalReason::ALL.iter().enumerate() {
            assert_eq!(reason.index(), i, "ALL is in declaration order");
            for _ in 0..=i {
                refusals.record(Refusal {
                    reason: *reason,
                    host: "h",
                    subsystem: "s",
                    qid: Some(0),
                });
            }
        }
        let counts = refusals.counts();
        let names: std::collections::BTreeSet<_> = counts.iter().map(|(n, _)| *n).collect();
        assert_eq!(names.len(), RefusalReason::ALL.len(), "distinct names");
        for (i, (_, count)) in counts.iter().enumerate() {
            assert_eq!(*count, i as u64 + 1);
        }
    }

    #[test]
    fn a_flood_logs_once_per_doubling_per_host_and_a_success_resets_it() {
        let refusals = ConnectRefusals::default();
        let refusal = |host| Refusal {
            reason: RefusalReason::HostNotAllowed,
            host,
            subsystem: "s",
            qid: Some(0),
        };
        let logged: Vec<u64> = (0..20)
            .filter_map(|_| refusals.throttle(&refusal("a")))
            .collect();
        assert_eq!(logged, [1, 2, 4, 8, 16]);
        assert_eq!(
            refusals.throttle(&refusal("b")),
            Some(1),
            "another host shows at once"
        );
        refusals.forget("a", "s");
        assert_eq!(refusals.throttle(&refusal("a")), Some(1));
    }

    #[test]
    fn invented_host_nqns_cannot_grow_the_throttle_past_its_bound() {
        let refusals = ConnectRefusals::default();
        let names: Vec<String> = (0..MAX_THROTTLED_KEYS + 100)
            .map(|i| format!("h{i}"))
            .collect();
        let logged = names
            .iter()
            .filter(|h| {
                refusals
                    .throttle(&Refusal {
                        reason: RefusalReason::HostNotAllowed,
                        host: h,
                        subsystem: "s",
                        qid: None,
                    })
                    .is_some()
            })
            .count();
        assert_eq!(refusals.repeats.lock().unwrap().len(), MAX_THROTTLED_KEYS);
        // Every key of the map once, then the overflow's 1st, 2nd, 4th, ..., 64th.
        assert_eq!(logged, MAX_THROTTLED_KEYS + 7);
    }
}
