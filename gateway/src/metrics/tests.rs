//! The exposition text of a target driven through the core (no socket).

use std::collections::BTreeSet;

use super::*;
use crate::core::tests::{
    admin_and_io, discovery_ready, fixture, one, run, rw, write_ok, HOSTNQN, SUBNQN,
};
use crate::spec::io_opcode;

/// Checks the text format (every sample belongs to a family announced by HELP and TYPE,
/// once each, with a number as value) and returns the sample lines.
fn samples(text: &str) -> Vec<String> {
    let mut typed = BTreeSet::new();
    let mut helped = BTreeSet::new();
    let mut lines = Vec::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let name = rest.split(' ').next().unwrap_or("");
            assert!(helped.insert(name.to_string()), "HELP twice: {line}");
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut parts = rest.split(' ');
            let name = parts.next().unwrap_or("");
            assert!(
                matches!(parts.next(), Some("gauge" | "counter" | "histogram")),
                "type: {line}"
            );
            assert!(helped.contains(name), "TYPE before HELP: {line}");
            assert!(typed.insert(name.to_string()), "TYPE twice: {line}");
        } else {
            let name_end = line.find(['{', ' ']).expect("a sample has a name");
            let name = &line[..name_end];
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|suffix| name.strip_suffix(suffix).filter(|f| typed.contains(*f)))
                .unwrap_or(name);
            assert!(
                typed.contains(family),
                "sample of an undeclared family: {line}"
            );
            let value = line.rsplit(' ').next().unwrap_or("");
            assert!(value.parse::<f64>().is_ok(), "value: {line}");
            lines.push(line.to_string());
        }
    }
    lines
}

fn has(lines: &[String], want: &str) -> bool {
    lines.iter().any(|l| l == want)
}

#[test]
fn a_scrape_shows_namespace_io_and_connected_hosts() {
    let f = fixture();
    let (_admin, mut io) = admin_and_io(&f);
    write_ok(&mut io, 1, 0, vec![7; 4096]);
    for cid in 2..4 {
        let r = one(run(&mut io, rw(io_opcode::READ, cid, 0, 8), None));
        assert!(r.completion.status.is_success());
    }
    let mut discovery = f.queue();
    discovery_ready(&mut discovery, "nqn.2014-08.org.nvmexpress:uuid:discoverer");

    let text = render(&f.target, "gw-a");
    let lines = samples(&text);
    let ns = format!("subsystem=\"{SUBNQN}\",nsid=\"1\",device=\"mem\"");
    for want in [
        format!(
            "nvmeof_gateway_info{{name=\"gw-a\",version=\"{}\"}} 1",
            env!("CARGO_PKG_VERSION")
        ),
        "nvmeof_listener_info{transport=\"tcp\",address=\"127.0.0.1\",port=\"4420\"} 1".into(),
        format!("nvmeof_subsystem_namespaces{{subsystem=\"{SUBNQN}\"}} 1"),
        // the admin queue and I/O queue are one controller
        format!(
            "nvmeof_subsystem_controllers{{subsystem=\"{SUBNQN}\",host=\"{HOSTNQN}\",transport=\"unknown\"}} 1"
        ),
        format!(
            "nvmeof_subsystem_controllers{{subsystem=\"{}\",host=\"nqn.2014-08.org.nvmexpress:uuid:discoverer\",transport=\"unknown\"}} 1",
            crate::spec::DISCOVERY_NQN
        ),
        format!(
            "nvmeof_ana_group_state{{subsystem=\"{SUBNQN}\",ana_group=\"1\",state=\"optimized\"}} 1"
        ),
        format!("nvmeof_namespace_info{{{ns},ana_group=\"1\"}} 1"),
        format!("nvmeof_namespace_capacity_bytes{{{ns}}} {}", 8 << 20),
        format!("nvmeof_namespace_ops_in_flight{{{ns}}} 0"),
        format!("nvmeof_namespace_ops_total{{{ns},op=\"write\"}} 1"),
        format!("nvmeof_namespace_ops_total{{{ns},op=\"read\"}} 2"),
        format!("nvmeof_namespace_ops_total{{{ns},op=\"flush\"}} 0"),
        format!("nvmeof_namespace_bytes_total{{{ns},op=\"read\"}} 8192"),
        format!("nvmeof_namespace_bytes_total{{{ns},op=\"write\"}} 4096"),
        format!("nvmeof_namespace_failed_ops_total{{{ns},op=\"read\"}} 0"),
    ] {
        assert!(has(&lines, &want), "missing {want:?} in\n{text}");
    }
    // the read latency histogram: cumulative buckets ending in +Inf = count = 2
    let read_buckets: Vec<f64> = lines
        .iter()
        .filter(|l| {
            l.starts_with(&format!(
                "nvmeof_namespace_op_duration_seconds_bucket{{{ns},op=\"read\",le="
            ))
        })
        .map(|l| l.rsplit(' ').next().unwrap().parse().unwrap())
        .collect();
    assert_eq!(
        read_buckets.len(),
        14,
        "13 bounds and +Inf: {read_buckets:?}"
    );
    assert!(
        read_buckets.windows(2).all(|w| w[0] <= w[1]),
        "{read_buckets:?}"
    );
    assert_eq!(read_buckets.last(), Some(&2.0));
    assert!(has(
        &lines,
        &format!("nvmeof_namespace_op_duration_seconds_bucket{{{ns},op=\"read\",le=\"+Inf\"}} 2")
    ));
    assert!(has(
        &lines,
        &format!("nvmeof_namespace_op_duration_seconds_count{{{ns},op=\"read\"}} 2")
    ));
    assert!(
        !lines
            .iter()
            .any(|l| l.contains("op_duration") && l.contains("op=\"flush\"")),
        "only reads and writes have a histogram"
    );
    let read_seconds = lines
        .iter()
        .find(|l| {
            l.starts_with(&format!(
                "nvmeof_namespace_op_seconds_total{{{ns},op=\"read\"}}"
            ))
        })
        .expect("read seconds");
    assert!(
        read_seconds
            .rsplit(' ')
            .next()
            .unwrap()
            .parse::<f64>()
            .unwrap()
            >= 0.0
    );

    // after the controller goes, its line goes
    f.target
        .subsystem(SUBNQN)
        .unwrap()
        .set_ana_state(1, crate::spec::ana::INACCESSIBLE);
    drop((_admin, io));
    let lines = samples(&render(&f.target, "gw-a"));
    assert!(!lines.iter().any(|l| l.contains(HOSTNQN)), "{lines:#?}");
    assert!(has(
        &lines,
        &format!(
            "nvmeof_ana_group_state{{subsystem=\"{SUBNQN}\",ana_group=\"1\",state=\"inaccessible\"}} 1"
        )
    ));
}

#[test]
fn namespaces_waiting_for_their_device_are_listed_until_served() {
    let f = fixture();
    f.target.mark_unavailable(SUBNQN, 2, "rbd/late");
    f.target.mark_unavailable(SUBNQN, 1, "rbd/served-meanwhile");
    let lines = samples(&render(&f.target, ""));
    let waiting = format!(
        "nvmeof_namespace_unavailable{{subsystem=\"{SUBNQN}\",nsid=\"2\",device=\"rbd/late\"}} 1"
    );
    assert!(has(&lines, &waiting), "{lines:#?}");
    assert!(
        !lines.iter().any(|l| l.contains("served-meanwhile")),
        "namespace 1 is served: not unavailable"
    );
    f.target.clear_unavailable(SUBNQN, 2);
    let lines = samples(&render(&f.target, ""));
    assert!(!lines
        .iter()
        .any(|l| l.starts_with("nvmeof_namespace_unavailable{")));
}

#[test]
fn bucket_labels_are_the_backend_bounds() {
    assert_eq!(
        latency_bucket_labels(),
        [
            "0.0001", "0.00025", "0.0005", "0.001", "0.0025", "0.005", "0.01", "0.025", "0.05",
            "0.1", "0.25", "1", "5"
        ]
    );
}
