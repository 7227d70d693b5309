//! The gateways' per-namespace I/O counters, from their beacons (`GroupBeacon.io_counters`),
//! summed into the totals that ceph-nvmeof's `namespace_get_io_stats`, `get_gateway_stats`
//! and `nvmeofctl namespace stats` answer.
//!
//! A gateway reports, per namespace, its totals since its process started (counted by the
//! namespace's device; a device reopened on fresh cluster clients keeps them). Clients such
//! as the Ceph dashboard take rates from two readings, so a total must never go down: not
//! when the namespace moves to another gateway (failover, failback, a planned move), not when
//! a gateway restarts. So this keeps, per (gateway, namespace), the last values reported and
//! a base: what that gateway's earlier processes counted. A new incarnation folds the last
//! values into the base; counters that go down within one incarnation (the namespace removed
//! from that gateway and added again) are folded the same way. A namespace's total is the sum
//! over every gateway that ever served it, so a move only changes which gateway's share
//! grows.
//!
//! What resets a total: the namespace deleted (or another namespace under its NSID: its
//! UUID differs), and a restart of this control-plane replica (the book lives in memory; it
//! starts again from the gateways' current process totals). Pure: no clock, no I/O.

use std::collections::BTreeMap;

use crate::proto;

/// Totals of one kind of op.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OpTotals {
    pub ops: u64,
    pub failed: u64,
    pub bytes: u64,
    pub latency_ns: u64,
    /// The longest and shortest single op (0: no op).
    pub max_latency_ns: u64,
    pub min_latency_ns: u64,
}

impl OpTotals {
    fn from_wire(c: Option<&proto::OpCounters>) -> OpTotals {
        c.map(|c| OpTotals {
            ops: c.ops,
            failed: c.failed,
            bytes: c.bytes,
            latency_ns: c.latency_ns,
            max_latency_ns: c.max_latency_ns,
            min_latency_ns: c.min_latency_ns,
        })
        .unwrap_or_default()
    }

    fn to_wire(self) -> Option<proto::OpCounters> {
        (self != OpTotals::default()).then_some(proto::OpCounters {
            ops: self.ops,
            failed: self.failed,
            bytes: self.bytes,
            latency_ns: self.latency_ns,
            max_latency_ns: self.max_latency_ns,
            min_latency_ns: self.min_latency_ns,
        })
    }

    /// Both together: sums add (saturating: a gateway's garbage cannot wrap a total), the
    /// extremes are the extremes of both.
    fn plus(self, o: OpTotals) -> OpTotals {
        OpTotals {
            ops: self.ops.saturating_add(o.ops),
            failed: self.failed.saturating_add(o.failed),
            bytes: self.bytes.saturating_add(o.bytes),
            latency_ns: self.latency_ns.saturating_add(o.latency_ns),
            max_latency_ns: self.max_latency_ns.max(o.max_latency_ns),
            min_latency_ns: match (self.min_latency_ns, o.min_latency_ns) {
                (0, m) | (m, 0) => m,
                (a, b) => a.min(b),
            },
        }
    }

    /// Whether a monotonic counter is lower than in `earlier`.
    fn went_down(&self, earlier: &OpTotals) -> bool {
        self.ops < earlier.ops
            || self.failed < earlier.failed
            || self.bytes < earlier.bytes
            || self.latency_ns < earlier.latency_ns
    }
}

/// One namespace's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NamespaceTotals {
    pub read: OpTotals,
    pub write: OpTotals,
    pub unmap: OpTotals,
    /// Flush, Write Zeroes and Compare-and-Write.
    pub other_ops: u64,
}

impl NamespaceTotals {
    pub fn from_wire(c: &proto::NamespaceIoCounters) -> NamespaceTotals {
        NamespaceTotals {
            read: OpTotals::from_wire(c.read.as_ref()),
            write: OpTotals::from_wire(c.write.as_ref()),
            unmap: OpTotals::from_wire(c.unmap.as_ref()),
            other_ops: c.other_ops,
        }
    }

    /// The wire form (`nsid`, `uuid` and `in_flight` left to the caller).
    pub fn to_wire(self) -> proto::NamespaceIoCounters {
        proto::NamespaceIoCounters {
            read: self.read.to_wire(),
            write: self.write.to_wire(),
            unmap: self.unmap.to_wire(),
            other_ops: self.other_ops,
            ..Default::default()
        }
    }

    pub fn plus(self, o: NamespaceTotals) -> NamespaceTotals {
        NamespaceTotals {
            read: self.read.plus(o.read),
            write: self.write.plus(o.write),
            unmap: self.unmap.plus(o.unmap),
            other_ops: self.other_ops.saturating_add(o.other_ops),
        }
    }

    /// Every op completed, of any kind.
    pub fn completed(&self) -> u64 {
        self.read
            .ops
            .saturating_add(self.write.ops)
            .saturating_add(self.unmap.ops)
            .saturating_add(self.other_ops)
    }

    fn went_down(&self, earlier: &NamespaceTotals) -> bool {
        self.read.went_down(&earlier.read)
            || self.write.went_down(&earlier.write)
            || self.unmap.went_down(&earlier.unmap)
            || self.other_ops < earlier.other_ops
    }
}

/// What one gateway counted for one namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Record {
    /// The namespace's UUID as the gateway reported it (empty: not said).
    uuid: Vec<u8>,
    incarnation: u64,
    /// Counted by the gateway's earlier processes (and earlier adds of the namespace there).
    base: NamespaceTotals,
    /// The current process's totals, as last reported.
    last: NamespaceTotals,
    in_flight: u64,
    /// When it was last reported (the caller's clock, milliseconds).
    at_ms: u64,
}

impl Record {
    fn total(&self) -> NamespaceTotals {
        self.base.plus(self.last)
    }

    /// The process that counted `last` is gone (or its counters were reset): keep what it
    /// counted in the base, and count the next process's from 0.
    fn fold(&mut self) {
        self.base = self.total();
        self.last = NamespaceTotals::default();
        self.in_flight = 0;
    }
}

/// One gateway's queue totals (`GatewayIoTotals`), folded across its restarts like the
/// namespaces' counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct QueueRecord {
    incarnation: u64,
    base: (u64, u64),
    last: (u64, u64),
}

/// A gateway's share of a namespace's counters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GatewayShare {
    pub gateway: String,
    pub totals: NamespaceTotals,
    pub in_flight: u64,
    pub at_ms: u64,
}

/// A gateway's totals over every namespace, for `get_gateway_stats`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GatewayTotals {
    /// Admin and I/O queues connected since the gateway first beaconed to this replica.
    pub admin_queues: u64,
    pub io_queues: u64,
    /// Ops the gateway's namespaces completed (every kind), and have at their devices now.
    pub completed: u64,
    pub in_flight: u64,
}

/// Every gateway's counters, as this replica heard them.
#[derive(Debug, Default)]
pub struct IoStatsBook {
    /// (gateway, subsystem NQN, NSID) -> record.
    records: BTreeMap<(String, String, u32), Record>,
    queues: BTreeMap<String, QueueRecord>,
}

impl IoStatsBook {
    /// Takes in a gateway's beacon: its incarnation, the namespaces it reports (only those
    /// whose counters changed, or all of them) and its queue totals (None: a gateway that
    /// predates them).
    pub fn on_beacon(
        &mut self,
        gateway: &str,
        incarnation: u64,
        now_ms: u64,
        counters: &[proto::SubsystemIoCounters],
        queues: Option<&proto::GatewayIoTotals>,
    ) {
        // A new process: whatever the old one counted stays in the base, reported now or not.
        for ((gw, _, _), r) in self.records.iter_mut() {
            if gw == gateway && r.incarnation != incarnation {
                r.fold();
                r.incarnation = incarnation;
            }
        }
        for s in counters {
            for n in &s.namespaces {
                let reported = NamespaceTotals::from_wire(n);
                let key = (gateway.to_string(), s.nqn.clone(), n.nsid);
                let fresh = Record {
                    uuid: n.uuid.clone(),
                    incarnation,
                    base: NamespaceTotals::default(),
                    last: reported,
                    in_flight: n.in_flight,
                    at_ms: now_ms,
                };
                match self.records.get_mut(&key) {
                    // Another namespace under that NSID: the old one's counters are not its.
                    Some(r) if r.uuid != n.uuid => *r = fresh,
                    Some(r) => {
                        if reported.went_down(&r.last) {
                            r.fold();
                        }
                        r.last = reported;
                        r.in_flight = n.in_flight;
                        r.at_ms = now_ms;
                    }
                    None => {
                        self.records.insert(key, fresh);
                    }
                }
            }
        }
        if let Some(q) = queues {
            let now = (q.admin_queues, q.io_queues);
            let r = self.queues.entry(gateway.to_string()).or_default();
            if r.incarnation != incarnation || now.0 < r.last.0 || now.1 < r.last.1 {
                r.base = (
                    r.base.0.saturating_add(r.last.0),
                    r.base.1.saturating_add(r.last.1),
                );
                r.last = (0, 0);
                r.incarnation = incarnation;
            }
            r.last = now;
        }
    }

    /// Forgets the counters of namespaces that are gone: `exists(nqn, nsid, uuid)` says
    /// whether the group still has that namespace.
    pub fn retain(&mut self, exists: impl Fn(&str, u32, &[u8]) -> bool) {
        self.records
            .retain(|(_, nqn, nsid), r| exists(nqn, *nsid, &r.uuid));
    }

    /// A namespace's counters on every gateway that reported it: the total and each
    /// gateway's share. `uuid`: the namespace's UUID (counters reported under another one
    /// belong to an earlier namespace under that NSID); None: any.
    pub fn namespace(
        &self,
        nqn: &str,
        nsid: u32,
        uuid: Option<&[u8]>,
    ) -> (NamespaceTotals, Vec<GatewayShare>) {
        let mut total = NamespaceTotals::default();
        let mut shares = Vec::new();
        for ((gw, n, id), r) in &self.records {
            if n != nqn || *id != nsid || uuid.is_some_and(|u| !r.uuid.is_empty() && r.uuid != u) {
                continue;
            }
            let t = r.total();
            total = total.plus(t);
            shares.push(GatewayShare {
                gateway: gw.clone(),
                totals: t,
                in_flight: r.in_flight,
                at_ms: r.at_ms,
            });
        }
        (total, shares)
    }

    /// Every gateway's totals over all its namespaces (gateways that reported anything).
    pub fn gateways(&self) -> BTreeMap<String, GatewayTotals> {
        let mut out: BTreeMap<String, GatewayTotals> = BTreeMap::new();
        for ((gw, _, _), r) in &self.records {
            let g = out.entry(gw.clone()).or_default();
            g.completed = g.completed.saturating_add(r.total().completed());
            g.in_flight = g.in_flight.saturating_add(r.in_flight);
        }
        for (gw, q) in &self.queues {
            let g = out.entry(gw.clone()).or_default();
            g.admin_queues = q.base.0.saturating_add(q.last.0);
            g.io_queues = q.base.1.saturating_add(q.last.1);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NQN: &str = "nqn.2016-06.io.test:s";
    const UUID_A: [u8; 16] = [0xa; 16];
    const UUID_B: [u8; 16] = [0xb; 16];

    fn reads(ops: u64, bytes: u64) -> proto::NamespaceIoCounters {
        proto::NamespaceIoCounters {
            nsid: 1,
            uuid: UUID_A.to_vec(),
            read: Some(proto::OpCounters {
                ops,
                bytes,
                latency_ns: ops * 100_000,
                max_latency_ns: if ops > 0 { 200_000 } else { 0 },
                min_latency_ns: if ops > 0 { 50_000 } else { 0 },
                failed: 0,
            }),
            ..Default::default()
        }
    }

    fn report(n: proto::NamespaceIoCounters) -> Vec<proto::SubsystemIoCounters> {
        vec![proto::SubsystemIoCounters {
            nqn: NQN.into(),
            namespaces: vec![n],
        }]
    }

    fn total(book: &IoStatsBook) -> NamespaceTotals {
        book.namespace(NQN, 1, Some(&UUID_A)).0
    }

    #[test]
    fn a_failover_adds_the_new_gateways_counts_to_the_old_ones() {
        let mut book = IoStatsBook::default();
        book.on_beacon("gw1", 11, 0, &report(reads(100, 409_600)), None);
        assert_eq!(total(&book).read.ops, 100);
        // gw1 dies (no more beacons); gw2 takes the namespace over and counts from 0.
        book.on_beacon("gw2", 22, 1_000, &report(reads(5, 20_480)), None);
        let (t, shares) = book.namespace(NQN, 1, Some(&UUID_A));
        assert_eq!((t.read.ops, t.read.bytes), (105, 430_080));
        assert_eq!(t.read.latency_ns, 10_500_000);
        assert_eq!(
            shares
                .iter()
                .map(|s| (s.gateway.as_str(), s.totals.read.ops))
                .collect::<Vec<_>>(),
            [("gw1", 100), ("gw2", 5)]
        );
        // Failback: gw1 restarted meanwhile (new incarnation) and serves again from 0; the
        // total keeps what its old process counted.
        book.on_beacon("gw1", 12, 2_000, &report(reads(3, 12_288)), None);
        let t = total(&book);
        assert_eq!((t.read.ops, t.read.bytes), (108, 442_368));
    }

    #[test]
    fn a_gateway_restart_never_makes_a_total_go_down() {
        let mut book = IoStatsBook::default();
        let mut seen = 0;
        let mut step = |book: &mut IoStatsBook, inc: u64, ops: u64| {
            book.on_beacon("gw1", inc, 0, &report(reads(ops, ops * 4096)), None);
            let now = total(book).read.ops;
            assert!(now >= seen, "{now} after {seen}");
            seen = now;
            now
        };
        step(&mut book, 1, 10);
        step(&mut book, 1, 50);
        // restarted: counts from 0 again
        step(&mut book, 2, 0);
        assert_eq!(step(&mut book, 2, 7), 57);
        // restarted again; its first beacon already counts 100 ops (more than before): the
        // incarnation, not the values, tells a restart
        assert_eq!(step(&mut book, 3, 100), 157);
        // and the restart folds namespaces it does not report (yet) too
        book.on_beacon("gw1", 4, 0, &[], None);
        assert_eq!(total(&book).read.ops, 157);
        book.on_beacon("gw1", 4, 0, &report(reads(1, 4096)), None);
        assert_eq!(total(&book).read.ops, 158);
    }

    #[test]
    fn counters_that_go_down_within_one_process_are_folded() {
        // The namespace removed from gw1 and added again (same UUID): its device counts
        // from 0 though the process did not restart.
        let mut book = IoStatsBook::default();
        book.on_beacon("gw1", 1, 0, &report(reads(40, 1)), None);
        book.on_beacon("gw1", 1, 0, &report(reads(2, 1)), None);
        assert_eq!(total(&book).read.ops, 42);
    }

    #[test]
    fn another_namespace_under_the_same_nsid_starts_from_zero() {
        let mut book = IoStatsBook::default();
        book.on_beacon("gw1", 1, 0, &report(reads(40, 163_840)), None);
        let mut other = reads(3, 12_288);
        other.uuid = UUID_B.to_vec();
        book.on_beacon("gw2", 2, 0, &report(other.clone()), None);
        // Asked for the new namespace: gw1's counts were the old one's.
        let (t, shares) = book.namespace(NQN, 1, Some(&UUID_B));
        assert_eq!((t.read.ops, shares.len()), (3, 1));
        // gw1 serves the new one too now: its record is replaced, not added to.
        book.on_beacon("gw1", 1, 0, &report(other), None);
        assert_eq!(book.namespace(NQN, 1, Some(&UUID_B)).0.read.ops, 6);
        assert_eq!(
            book.namespace(NQN, 1, Some(&UUID_A)).0,
            NamespaceTotals::default()
        );
    }

    #[test]
    fn deleted_namespaces_are_forgotten() {
        let mut book = IoStatsBook::default();
        book.on_beacon("gw1", 1, 0, &report(reads(40, 1)), None);
        book.retain(|_, _, _| true);
        assert_eq!(total(&book).read.ops, 40);
        book.retain(|_, nsid, _| nsid != 1);
        assert_eq!(total(&book), NamespaceTotals::default());
        assert!(book.gateways().is_empty());
    }

    #[test]
    fn extremes_are_the_extremes_of_every_gateway() {
        let mut book = IoStatsBook::default();
        let mut a = reads(1, 1);
        a.read = Some(proto::OpCounters {
            ops: 1,
            latency_ns: 300,
            max_latency_ns: 300,
            min_latency_ns: 300,
            ..Default::default()
        });
        let mut b = a.clone();
        b.read = Some(proto::OpCounters {
            ops: 2,
            latency_ns: 1100,
            max_latency_ns: 1000,
            min_latency_ns: 100,
            ..Default::default()
        });
        book.on_beacon("gw1", 1, 0, &report(a), None);
        book.on_beacon("gw2", 2, 0, &report(b), None);
        let r = total(&book).read;
        assert_eq!(
            (r.ops, r.latency_ns, r.max_latency_ns, r.min_latency_ns),
            (3, 1400, 1000, 100)
        );
        // A gateway without reads does not make the minimum 0.
        let mut idle = reads(0, 0);
        idle.read = None;
        book.on_beacon("gw3", 3, 0, &report(idle), None);
        assert_eq!(total(&book).read.min_latency_ns, 100);
    }

    #[test]
    fn gateway_totals_survive_restarts() {
        let mut book = IoStatsBook::default();
        let q = |a, i| proto::GatewayIoTotals {
            admin_queues: a,
            io_queues: i,
        };
        let mut busy = reads(10, 1);
        busy.in_flight = 4;
        book.on_beacon("gw1", 1, 0, &report(busy), Some(&q(2, 8)));
        let g = book.gateways()["gw1"];
        assert_eq!(
            (g.admin_queues, g.io_queues, g.completed, g.in_flight),
            (2, 8, 10, 4)
        );
        book.on_beacon("gw1", 2, 0, &[], Some(&q(1, 4)));
        let g = book.gateways()["gw1"];
        assert_eq!(
            (g.admin_queues, g.io_queues, g.completed, g.in_flight),
            (3, 12, 10, 0)
        );
    }
}
