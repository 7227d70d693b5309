//! Per-namespace QoS: limits on I/Os per second and on read, write and total bandwidth,
//! enforced by token buckets. Pure: the caller passes the time in (nanoseconds on a monotonic
//! clock) and sleeps for the delay it is told; the async layer that does is
//! `crate::qos`. A throttled command waits, it never fails.
//!
//! The limits are ceph-nvmeof's (`namespace set_qos`): `rw_ios_per_second`,
//! `rw_megabytes_per_second`, `r_megabytes_per_second`, `w_megabytes_per_second`; 0 means
//! no limit, and a megabyte is 2^20 bytes (SPDK's bdev QoS, which ceph-nvmeof uses, counts
//! them so).
//!
//! Each bucket is a GCRA ("virtual scheduling"): it keeps the time at which its budget is
//! next free (`free_at`); an op starts at the latest `free_at` of the buckets it draws
//! from (or now), and pushes each of them by its cost divided by the rate. A bucket idle
//! for a while lends at most [`BURST_NS`] of its rate, so a late timer wake-up does not cost
//! throughput and a burst never exceeds [`BURST_NS`] worth of the limit.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

use rbd_backend::IoOp;

/// Bytes in a megabyte of the bandwidth limits (SPDK's bdev QoS counts 2^20).
pub const MEGABYTE: u64 = 1 << 20;

/// How much unused budget an idle bucket keeps (as time at its rate): 5 ms, larger than the
/// async runtime's timer granularity (1 ms) so ops woken late still meet the rate.
pub const BURST_NS: u64 = 5_000_000;

const NANOS_PER_SECOND: u128 = 1_000_000_000;

/// A namespace's limits; 0 = no limit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct QosLimits {
    /// Read and write commands per second.
    pub rw_ios_per_second: u64,
    /// Read plus write bandwidth, MB (2^20 bytes) per second.
    pub rw_megabytes_per_second: u64,
    /// Read bandwidth, MB per second.
    pub r_megabytes_per_second: u64,
    /// Write bandwidth, MB per second.
    pub w_megabytes_per_second: u64,
}

impl QosLimits {
    pub const UNLIMITED: QosLimits = QosLimits {
        rw_ios_per_second: 0,
        rw_megabytes_per_second: 0,
        r_megabytes_per_second: 0,
        w_megabytes_per_second: 0,
    };

    pub fn is_unlimited(&self) -> bool {
        *self == Self::UNLIMITED
    }
}

impl std::fmt::Display for QosLimits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.is_unlimited() {
            return write!(f, "unlimited");
        }
        let mut parts = Vec::new();
        let mut part = |value: u64, unit: &str| {
            if value != 0 {
                parts.push(format!("{value} {unit}"));
            }
        };
        part(self.rw_ios_per_second, "IOPS");
        part(self.rw_megabytes_per_second, "MB/s");
        part(self.r_megabytes_per_second, "MB/s read");
        part(self.w_megabytes_per_second, "MB/s write");
        write!(f, "{}", parts.join(", "))
    }
}

/// What one device op draws from the buckets.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Cost {
    pub ios: u64,
    pub read_bytes: u64,
    pub write_bytes: u64,
}

impl Cost {
    /// Reads (and a Compare's read) and writes count their data; Write Zeroes and each
    /// deallocated range count as one I/O without data (nothing crosses the wire); a
    /// Flush carries no data and is not throttled, so durability is never held back; nor is
    /// storing a reservation record (the gateway's own bookkeeping, not the host's I/O).
    pub fn of(op: &IoOp) -> Cost {
        match op {
            IoOp::Read { buf, .. } => Cost {
                ios: 1,
                read_bytes: buf.len() as u64,
                write_bytes: 0,
            },
            IoOp::Write { buf, .. } => Cost {
                ios: 1,
                read_bytes: 0,
                write_bytes: buf.len() as u64,
            },
            IoOp::CompareAndWrite { compare, write, .. } => Cost {
                ios: 1,
                read_bytes: compare.len() as u64,
                write_bytes: write.len() as u64,
            },
            IoOp::WriteZeroes { .. } | IoOp::Discard { .. } => Cost {
                ios: 1,
                read_bytes: 0,
                write_bytes: 0,
            },
            IoOp::Flush | IoOp::StoreRecord { .. } => Cost::default(),
        }
    }
}

/// One rate: `per_second` units, its budget next free at `free_at` (ns).
#[derive(Debug, Clone, Copy)]
struct Bucket {
    per_second: u64,
    free_at: u64,
}

impl Bucket {
    fn new(per_second: u64) -> Option<Bucket> {
        (per_second != 0).then_some(Bucket {
            per_second,
            free_at: 0,
        })
    }

    /// The earliest an op drawing from this bucket may start.
    fn earliest(&self, now: u64) -> u64 {
        self.free_at.max(now.saturating_sub(BURST_NS))
    }

    /// `units` drawn by an op that starts at `start`.
    fn draw(&mut self, start: u64, units: u64) {
        let span = u128::from(units) * NANOS_PER_SECOND / u128::from(self.per_second);
        self.free_at = self
            .earliest(start)
            .saturating_add(u64::try_from(span).unwrap_or(u64::MAX));
    }
}

/// The buckets of one namespace's limits.
#[derive(Debug, Clone)]
pub struct Throttle {
    limits: QosLimits,
    ios: Option<Bucket>,
    total_bytes: Option<Bucket>,
    read_bytes: Option<Bucket>,
    write_bytes: Option<Bucket>,
}

impl Throttle {
    pub fn new(limits: QosLimits) -> Throttle {
        let mb = |v: u64| Bucket::new(v.saturating_mul(MEGABYTE));
        Throttle {
            limits,
            ios: Bucket::new(limits.rw_ios_per_second),
            total_bytes: mb(limits.rw_megabytes_per_second),
            read_bytes: mb(limits.r_megabytes_per_second),
            write_bytes: mb(limits.w_megabytes_per_second),
        }
    }

    pub fn limits(&self) -> QosLimits {
        self.limits
    }

    /// Takes `cost` from the buckets for an op arriving at `now`; returns how long (ns) the
    /// op must wait before it starts (0: at once). Ops are given start times in the order
    /// they arrive.
    pub fn reserve(&mut self, cost: Cost, now: u64) -> u64 {
        let total = cost.read_bytes + cost.write_bytes;
        let mut draws: [(Option<&mut Bucket>, u64); 4] = [
            (self.ios.as_mut(), cost.ios),
            (self.total_bytes.as_mut(), total),
            (self.read_bytes.as_mut(), cost.read_bytes),
            (self.write_bytes.as_mut(), cost.write_bytes),
        ];
        let start = draws
            .iter()
            .filter_map(|(b, units)| b.as_ref().filter(|_| *units > 0).map(|b| b.earliest(now)))
            .fold(now, u64::max);
        for (bucket, units) in draws.iter_mut() {
            if let Some(b) = bucket.as_mut().filter(|_| *units > 0) {
                b.draw(start, *units);
            }
        }
        start - now
    }
}

/// A namespace's limits as the data path sees them: shared by the namespace's every queue,
/// replaced live. An unlimited namespace costs its I/O one relaxed atomic load
/// ([`NamespaceQos::is_limited`]): no lock and no clock.
#[derive(Debug)]
pub struct NamespaceQos {
    limited: AtomicBool,
    throttle: Mutex<Throttle>,
    /// Commands that had to wait, and how long they waited in total.
    throttled_commands: AtomicU64,
    throttled_ns: AtomicU64,
    /// Commands waiting now (a drain waits for them as for commands at the device).
    waiting: AtomicUsize,
}

impl Default for NamespaceQos {
    fn default() -> Self {
        Self::new(QosLimits::UNLIMITED)
    }
}

impl NamespaceQos {
    pub fn new(limits: QosLimits) -> NamespaceQos {
        NamespaceQos {
            limited: AtomicBool::new(!limits.is_unlimited()),
            throttle: Mutex::new(Throttle::new(limits)),
            throttled_commands: AtomicU64::new(0),
            throttled_ns: AtomicU64::new(0),
            waiting: AtomicUsize::new(0),
        }
    }

    /// Whether any limit is set: the data path's only check when none is.
    #[inline]
    pub fn is_limited(&self) -> bool {
        self.limited.load(Ordering::Relaxed)
    }

    pub fn limits(&self) -> QosLimits {
        self.lock().limits()
    }

    /// Replaces the limits (live: the next op is held to them). Returns whether they changed.
    pub fn set_limits(&self, limits: QosLimits) -> bool {
        let mut throttle = self.lock();
        if throttle.limits() == limits {
            return false;
        }
        *throttle = Throttle::new(limits);
        self.limited
            .store(!limits.is_unlimited(), Ordering::Relaxed);
        true
    }

    /// [`Throttle::reserve`] for an op arriving at `now` (ns); counts a wait.
    pub fn reserve(&self, cost: Cost, now: u64) -> u64 {
        let wait = self.lock().reserve(cost, now);
        if wait > 0 {
            self.throttled_commands.fetch_add(1, Ordering::Relaxed);
            self.throttled_ns.fetch_add(wait, Ordering::Relaxed);
        }
        wait
    }

    /// Commands that waited so far, and their total wait in nanoseconds.
    pub fn throttled(&self) -> (u64, u64) {
        (
            self.throttled_commands.load(Ordering::Relaxed),
            self.throttled_ns.load(Ordering::Relaxed),
        )
    }

    /// A command starts (`true`) or ends (`false`) waiting.
    pub fn note_waiting(&self, waiting: bool) {
        if waiting {
            self.waiting.fetch_add(1, Ordering::Relaxed);
        } else {
            self.waiting.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Commands waiting for their turn now.
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Relaxed)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Throttle> {
        self.throttle.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECOND: u64 = 1_000_000_000;

    fn read(bytes: u64) -> Cost {
        Cost {
            ios: 1,
            read_bytes: bytes,
            write_bytes: 0,
        }
    }

    fn write(bytes: u64) -> Cost {
        Cost {
            ios: 1,
            read_bytes: 0,
            write_bytes: bytes,
        }
    }

    /// Ops offered back to back (a host keeping its queue full): each starts when told; the
    /// number started in `[from, from + SECOND)`.
    fn started_in_a_second(throttle: &mut Throttle, cost: Cost, from: u64) -> u64 {
        let mut now = 0;
        let mut started = 0;
        while now < from + SECOND {
            now += throttle.reserve(cost, now);
            if now >= from && now < from + SECOND {
                started += 1;
            }
        }
        started
    }

    #[test]
    fn an_iops_limit_is_met_exactly_from_1k_to_100k() {
        for rate in [1_000, 10_000, 50_000, 100_000] {
            let mut t = Throttle::new(QosLimits {
                rw_ios_per_second: rate,
                ..QosLimits::UNLIMITED
            });
            // The second second: the idle burst is spent.
            let n = started_in_a_second(&mut t, read(4096), SECOND);
            assert!(n.abs_diff(rate) <= 1, "{rate} IOPS: {n} started");
        }
    }

    #[test]
    fn bandwidth_limits_count_bytes_of_their_direction() {
        let mut t = Throttle::new(QosLimits {
            r_megabytes_per_second: 10,
            ..QosLimits::UNLIMITED
        });
        let n = started_in_a_second(&mut t, read(128 * 1024), SECOND);
        assert_eq!(n, 80, "10 MB/s of 128 KiB reads");
        // Writes do not draw from the read bucket.
        assert_eq!(t.reserve(write(1 << 30), 5 * SECOND), 0);
        let mut t = Throttle::new(QosLimits {
            rw_megabytes_per_second: 4,
            ..QosLimits::UNLIMITED
        });
        let n = started_in_a_second(&mut t, write(1 << 20), SECOND);
        assert!((4..=5).contains(&n), "4 MB/s of 1 MiB writes: {n}");
    }

    #[test]
    fn the_tightest_limit_governs() {
        let mut t = Throttle::new(QosLimits {
            rw_ios_per_second: 100_000,
            w_megabytes_per_second: 1,
            ..QosLimits::UNLIMITED
        });
        let n = started_in_a_second(&mut t, write(4096), SECOND);
        assert!(n.abs_diff(256) <= 1, "1 MB/s of 4 KiB writes: {n}");
    }

    #[test]
    fn an_idle_bucket_lends_at_most_the_burst() {
        let mut t = Throttle::new(QosLimits {
            rw_ios_per_second: 1_000,
            ..QosLimits::UNLIMITED
        });
        let now = 10 * SECOND;
        let waits: Vec<u64> = (0..9).map(|_| t.reserve(read(512), now)).collect();
        // 5 ms at 1000 IOPS lent: 5 ops ahead of the rate and the one due now start at once,
        // then one per millisecond.
        let ms = 1_000_000;
        assert_eq!(waits, [0, 0, 0, 0, 0, 0, ms, 2 * ms, 3 * ms]);
    }

    #[test]
    fn unlimited_and_flush_never_wait() {
        let mut t = Throttle::new(QosLimits::UNLIMITED);
        for i in 0..1000 {
            assert_eq!(t.reserve(write(1 << 20), i), 0);
        }
        let mut t = Throttle::new(QosLimits {
            rw_ios_per_second: 10,
            ..QosLimits::UNLIMITED
        });
        for i in 0..1000 {
            assert_eq!(t.reserve(Cost::default(), i), 0, "flush");
        }
    }

    #[test]
    fn limits_change_live_and_clearing_them_stops_the_checks() {
        let qos = NamespaceQos::default();
        assert!(!qos.is_limited());
        let limits = QosLimits {
            rw_ios_per_second: 100,
            ..QosLimits::UNLIMITED
        };
        assert!(qos.set_limits(limits));
        assert!(!qos.set_limits(limits), "unchanged");
        assert!(qos.is_limited());
        let mut now = SECOND;
        for _ in 0..20 {
            now += qos.reserve(read(512), now);
        }
        let (commands, waited) = qos.throttled();
        assert!(commands >= 14, "{commands}");
        assert!(waited > 0);
        assert!(qos.set_limits(QosLimits::UNLIMITED));
        assert!(!qos.is_limited());
        assert_eq!(qos.reserve(read(512), now), 0);
    }

    #[test]
    fn costs_follow_the_op() {
        use rbd_backend::IoBuf;
        let c = Cost::of(&IoOp::Read {
            offset: 0,
            buf: IoBuf::zeroed(4096),
        });
        assert_eq!(c, read(4096));
        let c = Cost::of(&IoOp::CompareAndWrite {
            offset: 0,
            compare: IoBuf::zeroed(512),
            write: IoBuf::zeroed(512),
        });
        assert_eq!((c.ios, c.read_bytes, c.write_bytes), (1, 512, 512));
        assert_eq!(Cost::of(&IoOp::Flush), Cost::default());
        assert_eq!(
            Cost::of(&IoOp::Discard {
                offset: 0,
                len: 1 << 30
            }),
            Cost {
                ios: 1,
                read_bytes: 0,
                write_bytes: 0
            }
        );
    }
}
