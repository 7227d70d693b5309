//! What a device has completed: ops, bytes and time per kind of op, for the gateway's
//! metrics (what SPDK's `bdev_get_iostat` and ceph-nvmeof's `bdev_*_total` metrics give).
//!
//! Devices record each op once, when its result is known and before the completion is
//! delivered, so a scrape taken after the host saw a completion counts that op. Counters are
//! relaxed atomics: a snapshot is not one instant across all of them, which monotonic
//! counters read by Prometheus do not need.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use crate::device::{IoError, IoOp};

/// The kinds of op a device counts separately.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpKind {
    Read,
    /// Writes, FUA or not.
    Write,
    Flush,
    /// Deallocate (NVMe Dataset Management).
    Discard,
    WriteZeroes,
    CompareAndWrite,
}

impl OpKind {
    pub const ALL: [OpKind; 6] = [
        OpKind::Read,
        OpKind::Write,
        OpKind::Flush,
        OpKind::Discard,
        OpKind::WriteZeroes,
        OpKind::CompareAndWrite,
    ];

    /// Lower-case name, as a metrics label value.
    pub fn name(self) -> &'static str {
        match self {
            OpKind::Read => "read",
            OpKind::Write => "write",
            OpKind::Flush => "flush",
            OpKind::Discard => "discard",
            OpKind::WriteZeroes => "write_zeroes",
            OpKind::CompareAndWrite => "compare_and_write",
        }
    }

    /// The kind of `op` and the bytes it moves or covers (the written bytes for a
    /// compare-and-write, the range for discard and write zeroes, 0 for a flush); `None` for
    /// a record store, which is no I/O of the namespace's data and is not counted.
    pub fn of(op: &IoOp) -> Option<(OpKind, u64)> {
        Some(match op {
            IoOp::Read { buf, .. } => (OpKind::Read, buf.len() as u64),
            IoOp::Write { buf, .. } => (OpKind::Write, buf.len() as u64),
            IoOp::Flush => (OpKind::Flush, 0),
            IoOp::Discard { len, .. } => (OpKind::Discard, *len),
            IoOp::WriteZeroes { len, .. } => (OpKind::WriteZeroes, *len),
            IoOp::CompareAndWrite { write, .. } => (OpKind::CompareAndWrite, write.len() as u64),
            IoOp::StoreRecord { .. } => return None,
        })
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// Upper bounds (nanoseconds) of the latency buckets kept for reads and writes: 100 us to
/// 5 s, what separates a healthy all-flash pool (sub-millisecond), a busy or HDD one (tens of
/// milliseconds) and an OSD failing over (seconds). Ops slower than the last go to +Inf.
pub const LATENCY_BUCKETS_NS: [u64; 13] = [
    100_000,
    250_000,
    500_000,
    1_000_000,
    2_500_000,
    5_000_000,
    10_000_000,
    25_000_000,
    50_000_000,
    100_000_000,
    250_000_000,
    1_000_000_000,
    5_000_000_000,
];

/// Totals of one kind of op.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct OpTotals {
    /// Ops completed, successfully or not.
    pub completed: u64,
    /// Of those, the ones that failed (a compare-and-write miscompare included).
    pub failed: u64,
    /// Bytes of the ops that succeeded.
    pub bytes: u64,
    /// Time from submission to completion, summed over all completed ops.
    pub seconds: f64,
    /// The longest and the shortest of those times, in nanoseconds (0: no op yet): what
    /// ceph-nvmeof's `namespace_get_io_stats` answers as max/min latency.
    pub max_nanos: u64,
    pub min_nanos: u64,
    /// Reads and writes only: completed ops per [`LATENCY_BUCKETS_NS`] bucket (not cumulative;
    /// ops slower than the last bound are `completed` minus their sum).
    pub latency_buckets: Option<[u64; 13]>,
}

/// A device's totals per kind of op, indexed like [`OpKind::ALL`].
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct IoStatsSnapshot {
    totals: [OpTotals; 6],
}

impl IoStatsSnapshot {
    pub fn get(&self, kind: OpKind) -> OpTotals {
        self.totals[kind.index()]
    }

    /// Every kind with its totals, in [`OpKind::ALL`] order.
    pub fn iter(&self) -> impl Iterator<Item = (OpKind, OpTotals)> + '_ {
        OpKind::ALL.iter().map(|&k| (k, self.get(k)))
    }
}

#[derive(Default)]
struct Counters {
    completed: AtomicU64,
    failed: AtomicU64,
    bytes: AtomicU64,
    nanos: AtomicU64,
    max_nanos: AtomicU64,
    /// The shortest time, bitwise inverted: the largest inverted value is the shortest time,
    /// so `fetch_max` keeps it as for the longest, and 0 (the default) means no op yet.
    min_nanos_inverted: AtomicU64,
    /// Used for reads and writes only (the ops whose latency hosts feel).
    buckets: [AtomicU64; 13],
}

fn has_latency_buckets(kind: OpKind) -> bool {
    matches!(kind, OpKind::Read | OpKind::Write)
}

/// The live counters of one device.
#[derive(Default)]
pub struct IoStats {
    per_kind: [Counters; 6],
}

impl IoStats {
    /// Counts `op`, submitted at `started`, as completed now with `result`.
    pub fn record(&self, op: &IoOp, started: Instant, result: &Result<(), IoError>) {
        let Some((kind, bytes)) = OpKind::of(op) else {
            return;
        };
        let c = &self.per_kind[kind.index()];
        let nanos = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        c.completed.fetch_add(1, Ordering::Relaxed);
        c.nanos.fetch_add(nanos, Ordering::Relaxed);
        // A load first: once the extremes settle, almost no op changes them, and a plain
        // load costs less than the locked compare-and-swap `fetch_max` is on x86.
        if nanos > c.max_nanos.load(Ordering::Relaxed) {
            c.max_nanos.fetch_max(nanos, Ordering::Relaxed);
        }
        if !nanos > c.min_nanos_inverted.load(Ordering::Relaxed) {
            c.min_nanos_inverted.fetch_max(!nanos, Ordering::Relaxed);
        }
        if has_latency_buckets(kind) {
            if let Some(i) = LATENCY_BUCKETS_NS.iter().position(|&bound| nanos <= bound) {
                c.buckets[i].fetch_add(1, Ordering::Relaxed);
            }
        }
        match result {
            Ok(()) => c.bytes.fetch_add(bytes, Ordering::Relaxed),
            Err(_) => c.failed.fetch_add(1, Ordering::Relaxed),
        };
    }

    pub fn snapshot(&self) -> IoStatsSnapshot {
        let mut snapshot = IoStatsSnapshot::default();
        for ((totals, c), kind) in snapshot
            .totals
            .iter_mut()
            .zip(&self.per_kind)
            .zip(OpKind::ALL)
        {
            *totals = OpTotals {
                completed: c.completed.load(Ordering::Relaxed),
                failed: c.failed.load(Ordering::Relaxed),
                bytes: c.bytes.load(Ordering::Relaxed),
                seconds: c.nanos.load(Ordering::Relaxed) as f64 / 1e9,
                max_nanos: c.max_nanos.load(Ordering::Relaxed),
                min_nanos: match c.min_nanos_inverted.load(Ordering::Relaxed) {
                    0 => 0,
                    inverted => !inverted,
                },
                latency_buckets: has_latency_buckets(kind)
                    .then(|| std::array::from_fn(|i| c.buckets[i].load(Ordering::Relaxed))),
            };
        }
        snapshot
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::IoBuf;

    #[test]
    fn latencies_land_in_the_first_bucket_that_holds_them() {
        let stats = IoStats::default();
        let write = IoOp::Write {
            offset: 0,
            buf: IoBuf::zeroed(512),
            fua: false,
        };
        let now = Instant::now();
        // submitted 3 ms, 30 ms and 7 s ago
        for ago_ms in [3u64, 30, 7000] {
            let started = now
                .checked_sub(std::time::Duration::from_millis(ago_ms))
                .expect("the clock has run that long");
            stats.record(&write, started, &Ok(()));
        }
        let w = stats.snapshot().get(OpKind::Write);
        assert!(
            (3_000_000..30_000_000).contains(&w.min_nanos),
            "shortest {} ns",
            w.min_nanos
        );
        assert!(w.max_nanos >= 7_000_000_000, "longest {} ns", w.max_nanos);
        assert_eq!(
            stats.snapshot().get(OpKind::Read).min_nanos,
            0,
            "no read yet"
        );
        let buckets = w.latency_buckets.expect("writes have buckets");
        // 3 ms -> le 0.005 (index 5); 30 ms -> le 0.05 (index 8); 7 s -> beyond the last
        let mut want = [0u64; 13];
        want[5] = 1;
        want[8] = 1;
        assert_eq!(buckets, want);
        assert_eq!(
            w.completed - buckets.iter().sum::<u64>(),
            1,
            "one beyond 5 s"
        );
        assert_eq!(LATENCY_BUCKETS_NS[5], 5_000_000);
        assert_eq!(LATENCY_BUCKETS_NS[8], 50_000_000);
    }

    #[test]
    fn counts_per_kind_bytes_of_successes_and_failures() {
        let stats = IoStats::default();
        let started = Instant::now();
        let read = IoOp::Read {
            offset: 0,
            buf: IoBuf::zeroed(4096),
        };
        stats.record(&read, started, &Ok(()));
        stats.record(&read, started, &Err(IoError::Device("down".into())));
        let discard = IoOp::Discard {
            offset: 0,
            len: 1 << 20,
        };
        stats.record(&discard, started, &Ok(()));
        let s = stats.snapshot();
        let r = s.get(OpKind::Read);
        assert_eq!((r.completed, r.failed, r.bytes), (2, 1, 4096));
        assert!(r.seconds >= 0.0);
        let d = s.get(OpKind::Discard);
        assert_eq!((d.completed, d.failed, d.bytes), (1, 0, 1 << 20));
        assert_eq!(
            d.latency_buckets, None,
            "only reads and writes have buckets"
        );
        assert_eq!(
            s.get(OpKind::Write),
            OpTotals {
                latency_buckets: Some([0; 13]),
                ..OpTotals::default()
            }
        );
        assert_eq!(
            r.latency_buckets.map(|b| b.iter().sum::<u64>()),
            Some(2),
            "two fast reads land in a bucket: {r:?}"
        );
        let names: Vec<&str> = s.iter().map(|(k, _)| k.name()).collect();
        assert_eq!(
            names,
            [
                "read",
                "write",
                "flush",
                "discard",
                "write_zeroes",
                "compare_and_write"
            ]
        );
    }
}
