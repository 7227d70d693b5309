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
    /// compare-and-write, the range for discard and write zeroes, 0 for a flush).
    pub fn of(op: &IoOp) -> (OpKind, u64) {
        match op {
            IoOp::Read { buf, .. } => (OpKind::Read, buf.len() as u64),
            IoOp::Write { buf, .. } => (OpKind::Write, buf.len() as u64),
            IoOp::Flush => (OpKind::Flush, 0),
            IoOp::Discard { len, .. } => (OpKind::Discard, *len),
            IoOp::WriteZeroes { len, .. } => (OpKind::WriteZeroes, *len),
            IoOp::CompareAndWrite { write, .. } => (OpKind::CompareAndWrite, write.len() as u64),
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

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
}

/// The live counters of one device.
#[derive(Default)]
pub struct IoStats {
    per_kind: [Counters; 6],
}

impl IoStats {
    /// Counts `op`, submitted at `started`, as completed now with `result`.
    pub fn record(&self, op: &IoOp, started: Instant, result: &Result<(), IoError>) {
        let (kind, bytes) = OpKind::of(op);
        let c = &self.per_kind[kind.index()];
        let nanos = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        c.completed.fetch_add(1, Ordering::Relaxed);
        c.nanos.fetch_add(nanos, Ordering::Relaxed);
        match result {
            Ok(()) => c.bytes.fetch_add(bytes, Ordering::Relaxed),
            Err(_) => c.failed.fetch_add(1, Ordering::Relaxed),
        };
    }

    pub fn snapshot(&self) -> IoStatsSnapshot {
        let mut snapshot = IoStatsSnapshot::default();
        for (totals, c) in snapshot.totals.iter_mut().zip(&self.per_kind) {
            *totals = OpTotals {
                completed: c.completed.load(Ordering::Relaxed),
                failed: c.failed.load(Ordering::Relaxed),
                bytes: c.bytes.load(Ordering::Relaxed),
                seconds: c.nanos.load(Ordering::Relaxed) as f64 / 1e9,
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
        assert_eq!(s.get(OpKind::Write), OpTotals::default());
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
