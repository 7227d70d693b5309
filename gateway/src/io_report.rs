//! The I/O counters a group gateway puts in its beacons (`GroupBeacon.io_counters`), from
//! which the control plane answers ceph-nvmeof's `namespace_get_io_stats` and
//! `get_gateway_stats` (`control_plane::io_stats`).
//!
//! Each namespace's counters are its device's totals since this process opened it (a reopen
//! on fresh clients keeps them). Totals, not deltas: a beacon a replica misses loses nothing,
//! and every replica gets the same beacon. To keep beacons small with many namespaces, one
//! carries only the namespaces whose counters changed since the previous beacon (an idle
//! group sends none), every [`FULL_EVERY`]th beacon carries them all, and so does the one
//! after a beacon that some replica did not take (so a replica that restarted or missed one
//! catches up within a beacon or [`FULL_EVERY`] of them). No beacon carries more than
//! [`MAX_PER_BEACON`] namespaces; the others wait their turn (their totals are not lost, only
//! reported a beacon or more later).

use std::collections::{BTreeMap, BTreeSet};

use control_plane::proto::{NamespaceIoCounters, OpCounters, SubsystemIoCounters};
use rbd_backend::{IoStatsSnapshot, OpKind};

use crate::core::Target;

/// Every how many beacons all namespaces are reported, changed or not (at the default
/// beacon interval of 1 s: every 30 s).
pub const FULL_EVERY: u32 = 30;

/// The most namespaces one beacon carries: about 95 KB of counters (92 bytes each with
/// day-long totals, `control-plane/examples/beacon_io_cost.rs`), far below gRPC's 4 MiB
/// message limit, which a beacon must never reach (a refused beacon is a dead gateway). The
/// rest go in the next beacons, in turn.
pub const MAX_PER_BEACON: usize = 1024;

type Key = (String, u32);

/// What the previous beacons reported, to send only what changed.
#[derive(Debug)]
pub struct IoReport {
    /// (subsystem NQN, NSID) -> the counters last put in a beacon.
    sent: BTreeMap<Key, NamespaceIoCounters>,
    /// Namespaces a full report still owes (sent only when they change otherwise).
    owed: BTreeSet<Key>,
    /// The last namespace sent: the next beacon starts after it when not all fit.
    cursor: Option<Key>,
    /// Beacons since the last full report; None: the next one is full.
    since_full: Option<u32>,
    cap: usize,
}

impl Default for IoReport {
    fn default() -> Self {
        IoReport::with_cap(MAX_PER_BEACON)
    }
}

fn op(s: &IoStatsSnapshot, kind: OpKind) -> Option<OpCounters> {
    let t = s.get(kind);
    (t.completed > 0).then_some(OpCounters {
        ops: t.completed,
        failed: t.failed,
        bytes: t.bytes,
        latency_ns: (t.seconds * 1e9) as u64,
        max_latency_ns: t.max_nanos,
        min_latency_ns: t.min_nanos,
    })
}

/// A namespace's counters as the beacon carries them.
pub fn counters(
    nsid: u32,
    uuid: &[u8; 16],
    s: &IoStatsSnapshot,
    in_flight: usize,
) -> NamespaceIoCounters {
    NamespaceIoCounters {
        nsid,
        uuid: uuid.to_vec(),
        read: op(s, OpKind::Read),
        write: op(s, OpKind::Write),
        unmap: op(s, OpKind::Discard),
        other_ops: [OpKind::Flush, OpKind::WriteZeroes, OpKind::CompareAndWrite]
            .iter()
            .map(|&k| s.get(k).completed)
            .sum(),
        in_flight: in_flight as u64,
    }
}

impl IoReport {
    /// At most `cap` namespaces per beacon.
    pub fn with_cap(cap: usize) -> IoReport {
        IoReport {
            sent: BTreeMap::new(),
            owed: BTreeSet::new(),
            cursor: None,
            since_full: None,
            cap: cap.max(1),
        }
    }

    /// The counters for the next beacon: the namespaces that changed since they were last
    /// sent, and those a full report still owes, at most `cap` of them, taking turns.
    pub fn next(&mut self, target: &Target) -> Vec<SubsystemIoCounters> {
        let full = match self.since_full {
            Some(n) if n + 1 < FULL_EVERY => {
                self.since_full = Some(n + 1);
                false
            }
            _ => {
                self.since_full = Some(0);
                true
            }
        };
        let mut now = BTreeMap::new();
        for sub in target.subsystems() {
            if sub.is_discovery() {
                continue;
            }
            for ns in sub.namespaces() {
                let Some(stats) = ns.device.io_stats() else {
                    continue;
                };
                let c = counters(ns.nsid, &ns.uuid, &stats, ns.device.in_flight());
                now.insert((sub.nqn().to_string(), ns.nsid), c);
            }
        }
        // Namespaces no longer here are forgotten: one added again is reported afresh.
        self.sent.retain(|k, _| now.contains_key(k));
        if full {
            self.owed = now.keys().cloned().collect();
        } else {
            self.owed.retain(|k| now.contains_key(k));
        }
        let due =
            |k: &Key, c: &NamespaceIoCounters| self.owed.contains(k) || self.sent.get(k) != Some(c);
        // In turn from the one after the last sent, so every namespace gets its turn when
        // more are due than fit.
        let after = self.cursor.clone();
        let (later, earlier): (Vec<_>, Vec<_>) = now
            .iter()
            .filter(|(k, c)| due(k, c))
            .partition(|(k, _)| after.as_ref().is_none_or(|a| *k > a));
        let chosen: Vec<(Key, NamespaceIoCounters)> = later
            .into_iter()
            .chain(earlier)
            .take(self.cap)
            .map(|(k, c)| (k.clone(), c.clone()))
            .collect();
        if let Some((k, _)) = chosen.last() {
            self.cursor = Some(k.clone());
        }
        let mut out: Vec<SubsystemIoCounters> = Vec::new();
        let mut sorted = chosen;
        sorted.sort_by(|a, b| a.0.cmp(&b.0));
        for (key, c) in sorted {
            self.owed.remove(&key);
            self.sent.insert(key.clone(), c.clone());
            match out.last_mut() {
                Some(s) if s.nqn == key.0 => s.namespaces.push(c),
                _ => out.push(SubsystemIoCounters {
                    nqn: key.0,
                    namespaces: vec![c],
                }),
            }
        }
        out
    }

    /// A replica did not take a beacon: the next ones report every namespace.
    pub fn resend_all(&mut self) {
        self.since_full = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use rbd_backend::{IoBuf, IoOp};
    use std::sync::Arc;

    const NQN: &str = "nqn.2016-06.io.test:report";

    /// A target with three 1 MiB memory namespaces.
    fn target() -> Arc<Target> {
        let mut toml = format!(
            "[gateway]\nname = \"gw1\"\n[[listener]]\ntransport = \"tcp\"\naddress = \"127.0.0.1\"\n\
             port = 4420\n[[subsystem]]\nnqn = \"{NQN}\"\nallow_any_host = true\n"
        );
        for nsid in 1..=3 {
            toml += &format!(
                "[[subsystem.namespace]]\nnsid = {nsid}\nbackend = \"memory\"\nsize = \"1MiB\"\n"
            );
        }
        let c = Config::from_toml_str(&toml).expect("config");
        c.build_target().expect("target")
    }

    fn read(target: &Target, nsid: u32) {
        let ns = target
            .subsystem(NQN)
            .and_then(|s| s.namespace(nsid))
            .expect("namespace");
        let op = IoOp::Read {
            offset: 0,
            buf: IoBuf::zeroed(4096),
        };
        let done = ns
            .device
            .complete_now(1, op)
            .unwrap_or_else(|_| panic!("a memory device completes at once"));
        assert!(done.result.is_ok());
    }

    fn nsids(report: &[SubsystemIoCounters]) -> Vec<u32> {
        report
            .iter()
            .flat_map(|s| s.namespaces.iter().map(|n| n.nsid))
            .collect()
    }

    #[test]
    fn only_changed_namespaces_between_full_reports() {
        let target = target();
        let mut report = IoReport::default();
        assert_eq!(nsids(&report.next(&target)), [1, 2, 3], "the first is full");
        assert_eq!(
            nsids(&report.next(&target)),
            Vec::<u32>::new(),
            "nothing changed"
        );
        read(&target, 2);
        let r = report.next(&target);
        assert_eq!(nsids(&r), [2]);
        let n = &r[0].namespaces[0];
        let reads = n.read.as_ref().expect("a read");
        assert_eq!((reads.ops, reads.bytes, n.other_ops), (1, 4096, 0));
        assert!(reads.max_latency_ns >= reads.min_latency_ns);
        let uuid = target
            .subsystem(NQN)
            .and_then(|s| s.namespace(2))
            .expect("namespace")
            .uuid;
        assert_eq!(n.uuid, uuid.to_vec());
        assert_eq!(nsids(&report.next(&target)), Vec::<u32>::new());
        // After a beacon some replica missed, everything again.
        report.resend_all();
        assert_eq!(nsids(&report.next(&target)), [1, 2, 3]);
        // And every FULL_EVERY beacons.
        let mut full_at = Vec::new();
        for i in 1..=2 * FULL_EVERY {
            if nsids(&report.next(&target)).len() == 3 {
                full_at.push(i);
            }
        }
        assert_eq!(full_at, [FULL_EVERY, 2 * FULL_EVERY]);
    }

    #[test]
    fn a_capped_report_gives_every_namespace_its_turn() {
        let target = target();
        let mut report = IoReport::with_cap(2);
        // The first (full) report over two beacons.
        assert_eq!(nsids(&report.next(&target)), [1, 2]);
        assert_eq!(nsids(&report.next(&target)), [3]);
        assert_eq!(nsids(&report.next(&target)), Vec::<u32>::new());
        // All three busy, two fit: each is sent at least every other beacon.
        let mut last_sent = [0usize; 3];
        for beacon in 1..=12usize {
            for nsid in 1..=3 {
                read(&target, nsid);
            }
            let sent = nsids(&report.next(&target));
            assert_eq!(sent.len(), 2, "{sent:?}");
            for nsid in sent {
                last_sent[nsid as usize - 1] = beacon;
            }
            for (i, &at) in last_sent.iter().enumerate() {
                assert!(
                    beacon - at <= 1 || beacon < 2,
                    "namespace {} waits: {last_sent:?}",
                    i + 1
                );
            }
        }
        // Once the I/O stops, the last counts of each go out within a beacon or two.
        report.next(&target);
        report.next(&target);
        for nsid in 1..=3u32 {
            let sent = &report.sent[&(NQN.to_string(), nsid)];
            assert_eq!(
                sent.read.as_ref().map(|r| r.ops),
                Some(12),
                "namespace {nsid}"
            );
        }
    }
}
