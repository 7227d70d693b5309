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
//! catches up within a beacon or [`FULL_EVERY`] of them).

use std::collections::BTreeMap;

use control_plane::proto::{NamespaceIoCounters, OpCounters, SubsystemIoCounters};
use rbd_backend::{IoStatsSnapshot, OpKind};

use crate::core::Target;

/// Every how many beacons all namespaces are reported, changed or not (at the default
/// beacon interval of 1 s: every 30 s).
pub const FULL_EVERY: u32 = 30;

/// What the previous beacons reported, to send only what changed.
#[derive(Debug, Default)]
pub struct IoReport {
    /// (subsystem NQN, NSID) -> the counters last put in a beacon.
    sent: BTreeMap<(String, u32), NamespaceIoCounters>,
    /// Beacons since the last full report; None: the next one is full.
    since_full: Option<u32>,
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
    /// The counters for the next beacon: the namespaces that changed, or all of them.
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
        let mut out = Vec::new();
        for sub in target.subsystems() {
            if sub.is_discovery() {
                continue;
            }
            let mut namespaces = Vec::new();
            for ns in sub.namespaces() {
                let Some(stats) = ns.device.io_stats() else {
                    continue;
                };
                let c = counters(ns.nsid, &ns.uuid, &stats, ns.device.in_flight());
                let key = (sub.nqn().to_string(), ns.nsid);
                if full || self.sent.get(&key) != Some(&c) {
                    namespaces.push(c.clone());
                }
                now.insert(key, c);
            }
            if !namespaces.is_empty() {
                out.push(SubsystemIoCounters {
                    nqn: sub.nqn().to_string(),
                    namespaces,
                });
            }
        }
        // Namespaces no longer here are dropped: one added again is reported afresh.
        self.sent = now;
        out
    }

    /// A replica did not take the last beacon: the next one reports every namespace.
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
}
