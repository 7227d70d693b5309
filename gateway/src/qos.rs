//! Per-namespace QoS in the data path: where a throttled op waits. The token buckets and
//! the limits are the core's ([`crate::core::qos`], pure, time passed in); here the clock is
//! read and the wait happens.
//!
//! The wait lives with the op, not with its queue: an op whose turn has not come is handed
//! to a task that sleeps until it has, then submits it to the device. The connection goes on
//! reading, executing and completing its other commands meanwhile, so a throttled namespace
//! never holds up another namespace (or a Keep Alive) on the same queue. The core still
//! counts the command in flight, so a queue's teardown and a namespace's drain wait for it
//! like for a command at the device ([`NamespaceQos::waiting`] for the drains that look at
//! devices).
//!
//! A namespace without limits never gets here: the core emits a plain
//! [`Action::Submit`](crate::core::Action::Submit) after one relaxed atomic load.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use rbd_backend::{BlockDevice, IoCompletion, IoOp};

use crate::core::qos::{Cost, NamespaceQos};

/// Nanoseconds on the runtime's monotonic clock (tokio's, so tests with a paused clock are
/// deterministic) since the first call.
fn now_ns() -> u64 {
    static EPOCH: OnceLock<tokio::time::Instant> = OnceLock::new();
    let epoch = *EPOCH.get_or_init(tokio::time::Instant::now);
    u64::try_from(epoch.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// Starts `op` on `device` under `qos`: at once when its turn has come, else from a task
/// that sleeps until it has. Must be called on a tokio runtime (both transports' queues run
/// on one).
pub fn submit(
    qos: Arc<NamespaceQos>,
    device: Arc<dyn BlockDevice>,
    tag: u64,
    op: IoOp,
    completion: &Arc<dyn IoCompletion>,
) {
    let wait = qos.reserve(Cost::of(&op), now_ns());
    if wait == 0 {
        device.submit(tag, op, completion);
        return;
    }
    qos.note_waiting(true);
    let completion = completion.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_nanos(wait)).await;
        device.submit(tag, op, &completion);
        // After the submit: a drain never sees the op neither waiting nor at the device.
        qos.note_waiting(false);
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::qos::QosLimits;
    use rbd_backend::{IoBuf, IoDone, MemoryDevice};
    use std::sync::atomic::{AtomicU64, Ordering};

    #[derive(Default)]
    struct Count(AtomicU64);
    impl IoCompletion for Count {
        fn complete(&self, done: IoDone) {
            assert!(done.result.is_ok());
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn read() -> IoOp {
        IoOp::Read {
            offset: 0,
            buf: IoBuf::zeroed(4096),
        }
    }

    /// One "queue" offers ops to a limited and an unlimited namespace alternately: the
    /// unlimited one's all complete at once, the limited one's at its rate.
    #[tokio::test(start_paused = true)]
    async fn a_limited_namespace_waits_and_an_unlimited_one_does_not() {
        let limited = Arc::new(NamespaceQos::new(QosLimits {
            rw_ios_per_second: 100,
            ..QosLimits::UNLIMITED
        }));
        let unlimited = Arc::new(NamespaceQos::default());
        let device: Arc<dyn BlockDevice> = Arc::new(MemoryDevice::new("mem", 1 << 20));
        let (slow, fast) = (Arc::new(Count::default()), Arc::new(Count::default()));
        let (slow_sink, fast_sink): (Arc<dyn IoCompletion>, Arc<dyn IoCompletion>) =
            (slow.clone(), fast.clone());
        for tag in 0..200 {
            submit(limited.clone(), device.clone(), tag, read(), &slow_sink);
            if unlimited.is_limited() {
                submit(unlimited.clone(), device.clone(), tag, read(), &fast_sink);
            } else {
                device.submit(tag, read(), &fast_sink);
            }
        }
        assert_eq!(fast.0.load(Ordering::Relaxed), 200, "never held back");
        // The limit's 5 ms burst plus the one due now start at once.
        assert_eq!(slow.0.load(Ordering::Relaxed), 1);
        assert_eq!(limited.waiting(), 199);
        tokio::time::sleep(Duration::from_millis(1000)).await;
        let after_a_second = slow.0.load(Ordering::Relaxed);
        assert!(
            (100..=102).contains(&after_a_second),
            "100 IOPS: {after_a_second} in the first second"
        );
        tokio::time::sleep(Duration::from_millis(1000)).await;
        assert_eq!(slow.0.load(Ordering::Relaxed), 200);
        assert_eq!(limited.waiting(), 0);
        let (commands, waited_ns) = limited.throttled();
        assert_eq!(commands, 199);
        assert!(waited_ns > 199 * 900_000_000 / 2, "{waited_ns}");
    }

    /// Limits changed while ops wait apply to the ops that arrive next; cleared, nothing
    /// waits any more.
    #[tokio::test(start_paused = true)]
    async fn clearing_a_limit_lets_new_ops_through_at_once() {
        let qos = Arc::new(NamespaceQos::new(QosLimits {
            rw_ios_per_second: 10,
            ..QosLimits::UNLIMITED
        }));
        let device: Arc<dyn BlockDevice> = Arc::new(MemoryDevice::new("mem", 1 << 20));
        let count = Arc::new(Count::default());
        let sink: Arc<dyn IoCompletion> = count.clone();
        for tag in 0..5 {
            submit(qos.clone(), device.clone(), tag, read(), &sink);
        }
        assert_eq!(count.0.load(Ordering::Relaxed), 1);
        qos.set_limits(QosLimits::UNLIMITED);
        assert!(!qos.is_limited());
        submit(qos.clone(), device.clone(), 9, read(), &sink);
        assert_eq!(
            count.0.load(Ordering::Relaxed),
            2,
            "the new op went at once"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(
            count.0.load(Ordering::Relaxed),
            6,
            "the waiting ones kept their turn"
        );
    }
}
