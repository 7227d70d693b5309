//! What the I/O counters add to a gateway's group beacon (`GroupBeacon.io_counters`, see
//! `gateway/src/io_report.rs`), in encoded bytes, by number of namespaces: the beacon without
//! them, one namespace's entry with small and with day-long totals, a full report (every
//! namespace, sent every 30th beacon and after a replica missed one), and a beacon when only
//! some namespaces had I/O since the previous one (an idle namespace is not sent).
//!
//! ```sh
//! cargo run -p control-plane --example beacon_io_cost
//! ```

use control_plane::proto::{
    Beacon, Connection, GatewayIoTotals, GroupBeacon, GroupClients, NamespaceIoCounters,
    OpCounters, SubsystemIoCounters,
};
use prost::Message;

const NQN: &str = "nqn.2016-06.io.ceph-nvmeof-rs:scale";

/// A namespace's counters after `seconds` of 4 KiB I/O at `iops` (70 % reads), 0.5 ms mean
/// latency.
fn counters(nsid: u32, iops: u64, seconds: u64) -> NamespaceIoCounters {
    let ops = iops * seconds;
    let op = |n: u64| OpCounters {
        ops: n,
        failed: 0,
        bytes: n * 4096,
        latency_ns: n * 500_000,
        max_latency_ns: 250_000_000,
        min_latency_ns: 90_000,
    };
    NamespaceIoCounters {
        nsid,
        uuid: vec![0xa5; 16],
        read: Some(op(ops * 7 / 10)),
        write: Some(op(ops * 3 / 10)),
        unmap: None,
        other_ops: ops / 100,
        in_flight: 4,
    }
}

/// A gateway's beacon with `reported` namespaces' counters, and the connections and client
/// addresses a gateway with 8 hosts sends anyway.
fn beacon(reported: Vec<NamespaceIoCounters>) -> GroupBeacon {
    GroupBeacon {
        beacon: Some(Beacon {
            gateway: "gw1".into(),
            ana_group: 1,
            incarnation: u64::MAX / 3,
            client_addrs: vec!["10.0.0.11:0/3141592653".into()],
            applied_version: 12_345,
            connections: (0..8)
                .map(|i| Connection {
                    gateway: String::new(),
                    subsystem_nqn: NQN.into(),
                    host_nqn: format!(
                        "nqn.2014-08.org.nvmexpress:uuid:{i:08}-0000-0000-0000-000000000000"
                    ),
                    cntlid: 1 + i,
                    io_queues: 4,
                    secure: false,
                })
                .collect(),
            ..Default::default()
        }),
        group_clients: vec![GroupClients {
            ana_group: 1,
            addrs: vec!["10.0.0.11:0/2718281828".into()],
        }],
        applied_state_version: 678,
        io_counters: if reported.is_empty() {
            vec![]
        } else {
            vec![SubsystemIoCounters {
                nqn: NQN.into(),
                namespaces: reported,
            }]
        },
        io_totals: Some(GatewayIoTotals {
            admin_queues: 1_000,
            io_queues: 4_000,
        }),
    }
}

fn main() {
    let mut without = beacon(vec![]);
    without.io_totals = None;
    let base = without.encoded_len();
    let totals_only = beacon(vec![]).encoded_len();
    println!("beacon without I/O counters (8 hosts connected): {base} bytes");
    println!(
        "queue totals (io_totals), every beacon: +{} bytes",
        totals_only - base
    );
    let one = |c: NamespaceIoCounters| c.encoded_len() + 2;
    println!(
        "one namespace's entry: {} bytes after 1 s at 100 IOPS, {} after a day at 10000 IOPS",
        one(counters(1, 100, 1)),
        one(counters(1, 10_000, 86_400))
    );
    println!("namespaces  full report (every 30th beacon)  10% busy  all busy");
    for n in [1u32, 10, 100, 1000, 4096] {
        let all: Vec<_> = (1..=n).map(|i| counters(i, 10_000, 86_400)).collect();
        let busy: Vec<_> = (1..=n.div_ceil(10))
            .map(|i| counters(i, 10_000, 86_400))
            .collect();
        let full = beacon(all).encoded_len() - totals_only;
        let some = beacon(busy).encoded_len() - totals_only;
        println!("{n:>10}  {full:>28} B  {some:>8} B  {full:>8} B");
    }
}
