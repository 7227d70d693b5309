//! The keep-alive timer both transports run on a connected admin queue: armed with the
//! controller's KATO, and on each tick the controller is torn down unless a Keep Alive (or
//! other admin command) was seen since the previous tick.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::{Instant, Interval, MissedTickBehavior};

use crate::core::{Queue, TeardownReason};

/// Controllers torn down because their keep-alive timer expired, process-wide.
static TIMEOUTS: AtomicU64 = AtomicU64::new(0);

/// Keep-alive timeouts since start (for the metrics).
pub(crate) fn timeouts() -> u64 {
    TIMEOUTS.load(Ordering::Relaxed)
}

/// The KATO timer, once `queue` is a connected admin queue with a non-zero keep-alive timeout;
/// its first tick is one period from now (the host has a whole KATO for its first command).
pub(crate) fn admin_queue_timer(queue: &Queue) -> Option<Interval> {
    let binding = queue.binding()?;
    if binding.qid != 0 {
        return None;
    }
    let kato = binding.controller.kato_ms();
    if kato == 0 {
        return None;
    }
    let period = Duration::from_millis(u64::from(kato));
    let mut interval = tokio::time::interval_at(Instant::now() + period, period);
    // A late tick (a busy worker) must not be followed by a burst of catch-up ticks, which
    // would find no keep-alive in between and tear a healthy controller down.
    interval.set_missed_tick_behavior(MissedTickBehavior::Delay);
    Some(interval)
}

/// One KATO period elapsed: true when the controller saw a keep-alive in it (or the queue has
/// no controller); false when it did not, after tearing the controller down (the caller then
/// closes the connection).
pub(crate) fn still_alive(queue: &Queue) -> bool {
    let Some(ctrl) = queue.controller() else {
        return true;
    };
    if ctrl.take_keep_alive() {
        return true;
    }
    tracing::warn!(
        cntlid = ctrl.cntlid,
        kato_ms = ctrl.kato_ms(),
        "keep alive timeout"
    );
    TIMEOUTS.fetch_add(1, Ordering::Relaxed);
    ctrl.teardown(TeardownReason::KeepAliveExpired);
    false
}

/// The next tick of an armed timer; never completes while none is armed (for `select!`).
pub(crate) async fn tick(keep_alive: &mut Option<Interval>) {
    match keep_alive {
        Some(interval) => {
            interval.tick().await;
        }
        None => std::future::pending().await,
    }
}
