//! How long a device's oldest op has been waiting, within a few seconds, at the cost of one
//! relaxed atomic add when an op starts and one when it ends.
//!
//! Why: a gateway whose network reaches the monitors and some OSDs but not one of them has
//! commands stuck at that OSD while its other commands complete. Completions alone say the
//! cluster answers; what says otherwise is a command older than the stall window
//! (`gateway::stall`). Keeping every op's start time in a shared ordered set would take a
//! lock per op on the data path; counting ops per slice of start time needs none.
//!
//! Ops are counted in the slot of the [`SLICE`] their start fell in, [`SLOTS`] slots in a
//! ring. An op older than the ring ([`SPAN`]) is counted in a slot a newer slice reuses, so
//! it looks younger than it is until its slot ages again: ages are exact to a slice up to the
//! span, and an op stuck longer is seen as old again once per span.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The resolution of an op's age.
pub const SLICE: Duration = Duration::from_millis(100);
/// Slots in the ring.
pub const SLOTS: usize = 64;
/// The oldest age told apart: 6.4 s.
pub const SPAN: Duration = Duration::from_millis(100 * SLOTS as u64);

/// A process-wide origin, so that every tracker (and every caller's `Instant`) shares slices.
fn origin() -> Instant {
    static ORIGIN: OnceLock<Instant> = OnceLock::new();
    *ORIGIN.get_or_init(Instant::now)
}

/// The slice `t` falls in, counted from the origin (an instant before it: slice 0).
fn slice_of(t: Instant) -> u64 {
    (t.saturating_duration_since(origin()).as_millis() / SLICE.as_millis()) as u64
}

/// Ops in flight per slice of their start.
pub struct OpAges {
    slots: [AtomicU32; SLOTS],
}

impl Default for OpAges {
    fn default() -> Self {
        origin();
        Self {
            slots: std::array::from_fn(|_| AtomicU32::new(0)),
        }
    }
}

impl OpAges {
    /// An op started at `started` (its submit time, the same instant given to
    /// [`Self::finished`]).
    pub fn started(&self, started: Instant) {
        self.slot(started).fetch_add(1, Ordering::Relaxed);
    }

    /// The op started at `started` ended.
    pub fn finished(&self, started: Instant) {
        // Never below zero, even for an op not counted (a caller's mistake would otherwise
        // make a slot look busy for ever).
        let _ = self
            .slot(started)
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
    }

    /// Whether an op that started at least `age` before `now` is still in flight (`age` up to
    /// [`SPAN`]; exact to a [`SLICE`]).
    pub fn any_older_than(&self, now: Instant, age: Duration) -> bool {
        let now_slice = slice_of(now);
        let min_slices = age.as_millis().div_ceil(SLICE.as_millis()) as u64;
        let oldest_back = SLOTS as u64 - 1;
        (min_slices.max(1)..=oldest_back)
            .filter_map(|back| now_slice.checked_sub(back))
            .any(|s| self.slots[(s % SLOTS as u64) as usize].load(Ordering::Relaxed) > 0)
    }

    fn slot(&self, t: Instant) -> &AtomicU32 {
        &self.slots[(slice_of(t) % SLOTS as u64) as usize]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_op_is_old_once_its_age_passes_and_not_after_it_ends() {
        let ages = OpAges::default();
        let t0 = Instant::now();
        ages.started(t0);
        let window = Duration::from_millis(1000);
        assert!(!ages.any_older_than(t0 + Duration::from_millis(500), window));
        assert!(ages.any_older_than(t0 + Duration::from_millis(1200), window));
        ages.finished(t0);
        assert!(!ages.any_older_than(t0 + Duration::from_millis(1200), window));
    }

    #[test]
    fn young_ops_completing_do_not_hide_an_old_one() {
        let ages = OpAges::default();
        let t0 = Instant::now();
        ages.started(t0);
        // Many ops start and end after it, as through the OSDs that answer.
        for i in 1..=20u64 {
            let t = t0 + Duration::from_millis(60 * i);
            ages.started(t);
            ages.finished(t);
        }
        let now = t0 + Duration::from_millis(1300);
        ages.started(now);
        assert!(ages.any_older_than(now, Duration::from_millis(1000)));
        assert!(!ages.any_older_than(now, Duration::from_millis(1500)));
    }

    #[test]
    fn an_end_without_a_start_leaves_no_slot_busy() {
        let ages = OpAges::default();
        let t0 = Instant::now();
        ages.finished(t0);
        ages.started(t0);
        ages.finished(t0);
        assert!(!ages.any_older_than(t0 + Duration::from_secs(2), Duration::from_secs(1)));
    }

    #[test]
    fn an_op_stuck_past_the_span_is_seen_old_again_within_a_span() {
        let ages = OpAges::default();
        let t0 = Instant::now();
        ages.started(t0);
        let window = Duration::from_secs(1);
        let seen_old = (1..=2 * SLOTS as u64)
            .map(|i| t0 + SLICE * i as u32)
            .filter(|&now| now > t0 + SPAN && now <= t0 + SPAN * 2)
            .filter(|&now| ages.any_older_than(now, window))
            .count();
        assert!(seen_old > 0, "seen old again in its second span");
    }
}
