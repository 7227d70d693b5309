//! Where a queue's data buffers come from and go back to.
//!
//! A busy queue reuses its buffers rather than allocate one per command. What it keeps is
//! bounded twice: a queue that had a burst of large I/O (64 x 1 MiB writes on one queue is an
//! ordinary sequential load for a Linux host, whose queues hold 128 commands) keeps at most
//! [`RecycledBuffers::KEEP_BYTES`] while busy, and once it has been idle a while (the
//! transport says when: [`crate::core::Queue::release_idle_buffers`]) only
//! [`RecycledBuffers::KEEP_IDLE_BYTES`], so a host's idle connections do not each sit on
//! the largest burst they ever had. Linux nvmet allocates and frees each command's pages;
//! SPDK keeps a shared, bounded pool; this is in between. A buffer out of the free list
//! counts against the gateway's [`DataBudget`] until it comes back or is dropped.

use std::sync::atomic::{AtomicU64, Ordering};

use rbd_backend::IoBuf;

use super::budget::DataBudget;

/// Where a queue's data buffers come from and go back to.
pub trait BufferSource: Send {
    /// A buffer of exactly `len` bytes (contents unspecified).
    fn take(&mut self, len: usize) -> IoBuf;
    /// A buffer the queue no longer needs.
    fn give_back(&mut self, buf: IoBuf);
    /// The queue has been idle a while: keep only what a light load reuses.
    fn trim_idle(&mut self) {}
}

/// The default source: a per-queue free list, so a warm queue does not allocate.
#[derive(Default)]
pub struct RecycledBuffers {
    free: Vec<IoBuf>,
    /// Capacity of the buffers in `free`.
    free_bytes: usize,
    /// A process-wide gauge of the bytes kept in free lists, for the metrics.
    gauge: Option<&'static AtomicU64>,
    /// What buffers out of the free list count against.
    budget: Option<&'static DataBudget>,
}

impl RecycledBuffers {
    /// Enough for a full queue of in-flight small commands; more are dropped.
    pub const KEEP: usize = 256;
    /// What a busy queue keeps: 32 commands at the largest transfer (MDTS, 1 MiB), or 256
    /// at 128 KiB. Beyond it buffers are allocated per command, which at that size costs
    /// little next to moving the data.
    pub const KEEP_BYTES: usize = 32 << 20;
    /// What an idle queue keeps: one command at MDTS, or 256 of 4 KiB.
    pub const KEEP_IDLE_BYTES: usize = 1 << 20;

    /// A free list whose kept bytes are added to `gauge` (and taken off when it drops).
    pub fn counted(gauge: &'static AtomicU64) -> Self {
        Self {
            free: Vec::new(),
            free_bytes: 0,
            gauge: Some(gauge),
            budget: None,
        }
    }

    /// Buffers taken from this list count against `budget` while they are out.
    pub fn charged_to(mut self, budget: &'static DataBudget) -> Self {
        self.budget = Some(budget);
        self
    }

    /// Bytes kept for reuse.
    pub fn kept_bytes(&self) -> usize {
        self.free_bytes
    }

    fn remove(&mut self, index: usize) -> IoBuf {
        let buf = self.free.swap_remove(index);
        self.account_removed(buf.capacity());
        buf
    }

    fn account_removed(&mut self, bytes: usize) {
        self.free_bytes -= bytes;
        if let Some(gauge) = self.gauge {
            gauge.fetch_sub(bytes as u64, Ordering::Relaxed);
        }
    }
}

impl BufferSource for RecycledBuffers {
    fn take(&mut self, len: usize) -> IoBuf {
        // Prefer a buffer that is already large enough, so resizing does not reallocate.
        let fit = self.free.iter().rposition(|b| b.capacity() >= len);
        let mut buf = match fit.or_else(|| self.free.len().checked_sub(1)) {
            Some(i) => self.remove(i),
            None => IoBuf::default(),
        };
        buf.resize(len);
        if let Some(budget) = self.budget {
            buf.set_charge(budget.charge(buf.capacity()));
        }
        buf
    }

    fn give_back(&mut self, mut buf: IoBuf) {
        buf.release_charge();
        let bytes = buf.capacity();
        if self.free.len() < Self::KEEP && self.free_bytes + bytes <= Self::KEEP_BYTES {
            self.free_bytes += bytes;
            if let Some(gauge) = self.gauge {
                gauge.fetch_add(bytes as u64, Ordering::Relaxed);
            }
            self.free.push(buf);
        }
    }

    fn trim_idle(&mut self) {
        // Largest first: small buffers serve more commands per byte kept.
        while self.free_bytes > Self::KEEP_IDLE_BYTES {
            let largest = (0..self.free.len()).max_by_key(|&i| self.free[i].capacity());
            match largest {
                Some(i) => drop(self.remove(i)),
                None => break,
            }
        }
    }
}

impl Drop for RecycledBuffers {
    fn drop(&mut self) {
        let bytes = self.free_bytes;
        self.account_removed(bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    #[test]
    fn a_busy_free_list_reuses_its_buffers() {
        let mut source = RecycledBuffers::default();
        let taken: Vec<IoBuf> = (0..8).map(|_| source.take(64 << 10)).collect();
        let addresses: Vec<*const u8> = taken.iter().map(|b| b.as_slice().as_ptr()).collect();
        taken.into_iter().for_each(|b| source.give_back(b));
        assert_eq!(source.kept_bytes(), 8 * (64 << 10));
        let again: Vec<IoBuf> = (0..8).map(|_| source.take(4096)).collect();
        for buf in &again {
            assert_eq!(buf.len(), 4096);
            assert!(addresses.contains(&buf.as_slice().as_ptr()), "reused");
        }
        assert_eq!(source.kept_bytes(), 0);
    }

    #[test]
    fn a_burst_of_large_buffers_is_kept_up_to_the_busy_bound_and_trimmed_when_idle() {
        static GAUGE: AtomicU64 = AtomicU64::new(0);
        let mut source = RecycledBuffers::counted(&GAUGE);
        let burst: Vec<IoBuf> = (0..64).map(|_| source.take(MIB)).collect();
        burst.into_iter().for_each(|b| source.give_back(b));
        let busy = source.kept_bytes();
        assert!(busy <= RecycledBuffers::KEEP_BYTES, "{busy}");
        assert!(busy >= RecycledBuffers::KEEP_BYTES - MIB, "{busy}");
        assert_eq!(GAUGE.load(Ordering::Relaxed), busy as u64);

        source.trim_idle();
        assert_eq!(source.kept_bytes(), MIB, "one command at MDTS");
        assert_eq!(GAUGE.load(Ordering::Relaxed), MIB as u64);
        // Small buffers stay in preference to a large one.
        (0..4).for_each(|_| source.give_back(IoBuf::zeroed(4096)));
        source.trim_idle();
        assert_eq!(source.kept_bytes(), 4 * 4096);
        assert_eq!(GAUGE.load(Ordering::Relaxed), 4 * 4096);

        drop(source);
        assert_eq!(GAUGE.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn buffers_out_of_the_list_count_against_the_budget_until_back_or_dropped() {
        static GAUGE: AtomicU64 = AtomicU64::new(0);
        let budget = DataBudget::leaked(8 * MIB);
        let mut source = RecycledBuffers::counted(&GAUGE).charged_to(budget);
        let a = source.take(MIB);
        let b = source.take(4096);
        assert_eq!(budget.in_use(), a.capacity() + b.capacity());
        source.give_back(a);
        assert_eq!(
            budget.in_use(),
            b.capacity(),
            "back in the list: free again"
        );
        // Taken again from the list, the 1 MiB buffer counts by what it holds.
        let again = source.take(4096);
        assert_eq!(budget.in_use(), b.capacity() + again.capacity());
        assert!(again.capacity() >= MIB);
        // A buffer that never comes back (its connection gone before the device finished)
        // stops counting when it is dropped.
        drop(again);
        drop(b);
        assert_eq!(budget.in_use(), 0);
    }
}
