//! Liveness and readiness of an `nvmeof-control` replica, answered on its metrics endpoint
//! (`/healthz`, `/readyz`; see `metrics_exposition::HealthChecks`) for Kubernetes' probes.
//!
//! - Alive: the runtime makes progress (`metrics_exposition::heartbeat`: a task beats every
//!   second; no beat for 5 s fails). A replica that cannot reach Ceph is alive: it keeps retrying,
//!   and restarting it would not help.
//! - Ready: connected to RADOS, the group state loaded and gRPC served. A replica that does
//!   not hold the leader lease is ready too: it serves admin requests and assignment streams
//!   and takes over when the lease lapses. Not ready while shutting down.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use metrics_exposition::{HealthChecks, Heartbeat};

/// A replica's health, shared by its start-up, its signal handler and the probe handlers.
pub struct ReplicaHealth {
    heartbeat: Heartbeat,
    shutting_down: AtomicBool,
    /// None once serving; else why not (the start-up step, or the last Ceph error).
    not_ready: Mutex<Option<String>>,
}

impl ReplicaHealth {
    pub fn new() -> Arc<Self> {
        Arc::new(ReplicaHealth {
            heartbeat: Heartbeat::default(),
            shutting_down: AtomicBool::new(false),
            not_ready: Mutex::new(Some("starting".into())),
        })
    }

    /// Not ready, because of `why` (one line).
    pub fn not_ready(&self, why: impl Into<String>) {
        *self.not_ready.lock().unwrap_or_else(|e| e.into_inner()) = Some(why.into());
    }

    /// Connected, state loaded, gRPC served.
    pub fn serving(&self) {
        *self.not_ready.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }

    /// SIGTERM or SIGINT: not ready from now on.
    pub fn shutting_down(&self) {
        self.shutting_down.store(true, Ordering::SeqCst);
    }

    /// `/healthz`: Ok while the heartbeat is recent.
    pub fn live(&self) -> Result<(), String> {
        self.heartbeat.live()
    }

    /// `/readyz`: Ok, or why not.
    pub fn ready(&self) -> Result<(), String> {
        if self.shutting_down.load(Ordering::SeqCst) {
            return Err("shutting down".into());
        }
        match self
            .not_ready
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
        {
            Some(why) => Err(why.clone()),
            None => Ok(()),
        }
    }

    /// The probes' checks for the metrics endpoint.
    pub fn checks(self: &Arc<Self>) -> HealthChecks {
        let (live, ready) = (self.clone(), self.clone());
        HealthChecks {
            live: Arc::new(move || live.live()),
            ready: Arc::new(move || ready.ready()),
        }
    }

    /// Starts the heartbeat task on the current runtime; it ends with the last other holder.
    pub fn spawn_heartbeat(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        self.heartbeat.beat();
        let health = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = Heartbeat::ticker();
            loop {
                tick.tick().await;
                let Some(health) = health.upgrade() else {
                    return;
                };
                health.heartbeat.beat();
            }
        })
    }
}

/// The pause before connection attempt `attempt` (1, 2, ...): 1 s doubling to at most
/// [`MAX_RETRY_PAUSE`], so a keyring mounted later is picked up within that.
pub fn retry_pause(attempt: u32) -> Duration {
    let secs = 1u64 << attempt.saturating_sub(1).min(16);
    Duration::from_secs(secs).min(MAX_RETRY_PAUSE)
}

/// The longest pause between two attempts to reach Ceph.
pub const MAX_RETRY_PAUSE: Duration = Duration::from_secs(8);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readiness_and_liveness() {
        let h = ReplicaHealth::new();
        assert_eq!(h.ready(), Err("starting".into()));
        h.not_ready("ceph keyring /k: missing");
        assert_eq!(h.ready(), Err("ceph keyring /k: missing".into()));
        h.serving();
        assert_eq!(h.ready(), Ok(()));
        h.shutting_down();
        assert_eq!(h.ready(), Err("shutting down".into()));
        h.heartbeat.beat();
        assert_eq!(h.live(), Ok(()));
    }

    #[test]
    fn retries_back_off_to_a_bound() {
        let pauses: Vec<u64> = (1..=6).map(|a| retry_pause(a).as_secs()).collect();
        assert_eq!(pauses, [1, 2, 4, 8, 8, 8]);
        assert_eq!(retry_pause(u32::MAX), MAX_RETRY_PAUSE);
    }
}
