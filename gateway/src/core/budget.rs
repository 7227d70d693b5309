//! The gateway-wide bound on memory held for hosts' data.
//!
//! Every NVMe/TCP command that moves data holds a buffer of up to MDTS (1 MiB): a read from
//! its submission until its data is on the socket, a write from its R2T until the device
//! has it. A queue's own bound is twice its size in commands, but nothing bounded the sum
//! over queues: with the cluster stalled (an OSD down, a dead writer's exclusive lock held
//! ~30 s), every host keeps its queues full, Linux's 128 commands per queue and a queue per
//! CPU, and at 1 MiB writes twenty hosts would hold 20 GiB until the kernel kills the
//! process and with it every namespace. SPDK bounds the same memory with its shared buffer
//! pool (`num_shared_buffers`), and a request waits for a buffer; Linux nvmet allocates per
//! command and fails it when memory runs out.
//!
//! Here buffers carry a [`Charge`] against one [`DataBudget`] for as long as they exist, so
//! the count follows the memory wherever it goes. Before a queue takes a command that needs
//! a buffer it asks [`DataBudget::admits`]; when the budget is spent the transport holds the
//! command (no buffer, no R2T, no device op) until a release wakes it. A queue that holds
//! nothing of the budget is always let through one command, so a host that pins buffers (its
//! R2Ts unanswered) slows the others but cannot stop them: the memory is bounded by the
//! budget plus one MDTS buffer per queue.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, Weak};

use rbd_backend::{ByteBudget, Charge};

use super::controller::QueueNotifier;

/// The default budget: SPDK's NVMe/TCP transport keeps 511 shared buffers of 128 KiB
/// (64 MiB); a gateway in front of Ceph, whose ops take milliseconds, needs more in flight
/// to keep a fast network busy (at 10 GB/s and 5 ms per op: 50 MB).
pub const DEFAULT_LIMIT: usize = 256 << 20;

pub struct DataBudget {
    limit: usize,
    in_use: AtomicUsize,
    /// Queues holding commands until bytes are released, woken (all) at the next release.
    waiters: Mutex<Vec<Weak<dyn QueueNotifier>>>,
    /// `waiters` is not empty: lets a release skip the lock when nobody waits.
    has_waiters: AtomicBool,
    /// Commands held since start (a metric).
    held_total: AtomicU64,
    /// Commands held now (a metric).
    held_now: AtomicU64,
}

impl DataBudget {
    /// A budget of `limit` bytes, for the rest of the process (buffers refer to it).
    pub fn leaked(limit: usize) -> &'static Self {
        Box::leak(Box::new(Self::new(limit)))
    }

    pub const fn new(limit: usize) -> Self {
        Self {
            limit,
            in_use: AtomicUsize::new(0),
            waiters: Mutex::new(Vec::new()),
            has_waiters: AtomicBool::new(false),
            held_total: AtomicU64::new(0),
            held_now: AtomicU64::new(0),
        }
    }

    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Bytes charged now.
    pub fn in_use(&self) -> usize {
        self.in_use.load(Ordering::SeqCst)
    }

    /// Whether `bytes` more stay within the limit.
    pub fn admits(&self, bytes: usize) -> bool {
        self.in_use() + bytes <= self.limit
    }

    /// Counts `bytes` as in use until the returned charge is dropped. Never refuses: callers
    /// ask [`Self::admits`] first, and a few concurrent admissions may overshoot a little.
    pub fn charge(&'static self, bytes: usize) -> Charge {
        self.in_use.fetch_add(bytes, Ordering::SeqCst);
        Charge::new(bytes, self)
    }

    /// Wakes `waiter` at the next release (once, however often it asked). Register before
    /// checking [`Self::admits`] again: a release between a failed check and the
    /// registration would otherwise go unseen.
    pub fn wake_on_release(&self, waiter: Weak<dyn QueueNotifier>) {
        let mut waiters = self.waiters.lock().unwrap_or_else(|e| e.into_inner());
        if !waiters.iter().any(|w| w.ptr_eq(&waiter)) {
            waiters.push(waiter);
        }
        self.has_waiters.store(true, Ordering::SeqCst);
    }

    /// A queue starts holding a command for want of bytes.
    pub fn note_held(&self) {
        self.held_total.fetch_add(1, Ordering::Relaxed);
        self.held_now.fetch_add(1, Ordering::Relaxed);
    }

    /// A held command went on (or its queue closed).
    pub fn note_resumed(&self, commands: usize) {
        self.held_now.fetch_sub(commands as u64, Ordering::Relaxed);
    }

    /// Commands held now, and since start.
    pub fn held(&self) -> (u64, u64) {
        (
            self.held_now.load(Ordering::Relaxed),
            self.held_total.load(Ordering::Relaxed),
        )
    }
}

impl ByteBudget for DataBudget {
    fn release(&self, bytes: usize) {
        self.in_use.fetch_sub(bytes, Ordering::SeqCst);
        if !self.has_waiters.load(Ordering::SeqCst) {
            return;
        }
        let waiters = {
            let mut waiters = self.waiters.lock().unwrap_or_else(|e| e.into_inner());
            self.has_waiters.store(false, Ordering::SeqCst);
            std::mem::take(&mut *waiters)
        };
        for waiter in waiters.iter().filter_map(Weak::upgrade) {
            waiter.wake();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[derive(Default)]
    struct Wakes(AtomicUsize);
    impl QueueNotifier for Wakes {
        fn wake(&self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn charges_count_until_dropped() {
        let budget = DataBudget::leaked(4096);
        assert!(budget.admits(4096));
        let a = budget.charge(3000);
        assert_eq!(budget.in_use(), 3000);
        assert!(budget.admits(1096));
        assert!(!budget.admits(1097));
        drop(a);
        assert_eq!(budget.in_use(), 0);
        assert!(budget.admits(4096));
    }

    #[test]
    fn a_release_wakes_every_waiter_once() {
        let budget = DataBudget::leaked(100);
        let held = budget.charge(100);
        let waiters: Vec<Arc<Wakes>> = (0..3).map(|_| Arc::new(Wakes::default())).collect();
        for w in &waiters {
            let strong: Arc<dyn QueueNotifier> = w.clone();
            // A queue that asks again before the release is still woken once.
            budget.wake_on_release(Arc::downgrade(&strong));
            budget.wake_on_release(Arc::downgrade(&strong));
        }
        assert_eq!(budget.waiters.lock().unwrap().len(), 3);
        drop(held);
        let second = budget.charge(10);
        drop(second);
        for w in &waiters {
            assert_eq!(
                w.0.load(Ordering::SeqCst),
                1,
                "woken by the first release only"
            );
        }
    }

    #[test]
    fn a_buffer_carries_its_charge_until_dropped() {
        let budget = DataBudget::leaked(1 << 20);
        let mut buf = rbd_backend::IoBuf::zeroed(8192);
        buf.set_charge(budget.charge(8192));
        let moved = buf;
        assert_eq!(budget.in_use(), 8192);
        drop(moved);
        assert_eq!(budget.in_use(), 0);
    }
}
