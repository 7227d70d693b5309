//! Liveness for `/healthz`, shared by `nvmeof-gateway` and `nvmeof-control`: a process is
//! alive while its async runtime makes progress. A task beats every [`HEARTBEAT`]; a beat
//! older than [`STALL_LIMIT`] means the runtime's workers are stuck (a blocking call on a
//! worker, a deadlock), which a restart cures. Waiting on Ceph is not stuck: the daemons
//! retry off the runtime, and restarting them would not help.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How often the liveness task beats.
pub const HEARTBEAT: Duration = Duration::from_secs(1);
/// A heartbeat older than this makes `/healthz` fail.
pub const STALL_LIMIT: Duration = Duration::from_secs(5);

/// The time of the last beat.
#[derive(Debug)]
pub struct Heartbeat {
    started: Instant,
    /// Milliseconds after `started` of the last beat.
    last_beat_ms: AtomicU64,
}

impl Default for Heartbeat {
    fn default() -> Self {
        Self::started_at(Instant::now())
    }
}

impl Heartbeat {
    fn started_at(started: Instant) -> Self {
        Heartbeat {
            started,
            last_beat_ms: AtomicU64::new(0),
        }
    }

    /// The runtime made progress now.
    pub fn beat(&self) {
        self.last_beat_ms
            .store(self.started.elapsed().as_millis() as u64, Ordering::SeqCst);
    }

    /// Ok while the last beat is recent; else why not (one line).
    pub fn live(&self) -> Result<(), String> {
        let now = self.started.elapsed().as_millis() as u64;
        let silent = now.saturating_sub(self.last_beat_ms.load(Ordering::SeqCst));
        if silent > STALL_LIMIT.as_millis() as u64 {
            return Err(format!(
                "the runtime made no progress for {silent} ms (heartbeat every {} ms)",
                HEARTBEAT.as_millis()
            ));
        }
        Ok(())
    }

    /// The liveness task's ticker: every [`HEARTBEAT`], late ticks delayed rather than
    /// bunched (a burst of beats after a stall would hide it).
    pub fn ticker() -> tokio::time::Interval {
        let mut tick = tokio::time::interval(HEARTBEAT);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn live_while_it_beats_and_not_after_a_stall() {
        let heartbeat = Heartbeat::default();
        heartbeat.beat();
        assert_eq!(heartbeat.live(), Ok(()));
        // Started long ago and beaten only at its start, as a runtime stuck since then.
        let stalled = Heartbeat::started_at(Instant::now() - STALL_LIMIT - Duration::from_secs(1));
        let why = stalled.live().expect_err("stalled");
        assert!(
            why.starts_with("the runtime made no progress for "),
            "{why}"
        );
        stalled.beat();
        assert_eq!(stalled.live(), Ok(()), "a beat makes it live again");
    }
}
