//! The gateway's metrics in Prometheus' text exposition format (version 0.0.4), served over
//! HTTP ([`metrics_exposition::http`]) when `[gateway] metrics_listen` is set.
//!
//! Everything is read from the live [`Target`] at scrape time: there is no second copy of
//! the state to keep in step. Per namespace the device's own counters (ops, failures, bytes
//! and time per kind of op, see [`rbd_backend::stats`]) are what SPDK's bdev iostat and
//! ceph-nvmeof's `bdev_*` metrics report; the rest says what the gateway serves and who is
//! connected.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};

use metrics_exposition::Family;

use crate::core::{Target, TransportType};
use crate::spec::ana;

mod rdma_registrations;

/// `le` label values (seconds) of the backend's latency buckets.
fn latency_bucket_labels() -> [String; 13] {
    rbd_backend::stats::LATENCY_BUCKETS_NS.map(|ns| (ns as f64 / 1e9).to_string())
}

fn ana_state_name(state: u8) -> &'static str {
    match state {
        ana::OPTIMIZED => "optimized",
        ana::NON_OPTIMIZED => "non_optimized",
        ana::INACCESSIBLE => "inaccessible",
        ana::PERSISTENT_LOSS => "persistent_loss",
        ana::CHANGE => "change",
        _ => "unknown",
    }
}

fn transport_name(transport: TransportType) -> &'static str {
    match transport {
        TransportType::Tcp => "tcp",
        TransportType::Rdma => "rdma",
    }
}

/// The exposition text for `target`; `gateway` is this gateway's name (may be empty).
pub fn render(target: &Target, gateway: &str) -> String {
    let mut out = String::with_capacity(4096);
    Family::new(
        &mut out,
        "nvmeof_gateway_info",
        "gauge",
        "This gateway: its name and version (always 1).",
    )
    .sample(
        &[("name", gateway), ("version", env!("CARGO_PKG_VERSION"))],
        1,
    );
    render_listeners(&mut out, target);
    render_subsystems(&mut out, target);
    render_namespaces(&mut out, target);
    render_unavailable(&mut out, target);
    render_transports(&mut out);
    render_authentication(&mut out, target);
    rdma_registrations::render_rdma_registrations(
        &mut out,
        &rdma_transport::registrations().snapshot(),
    );
    render_connect_refusals(&mut out, target);
    crate::reload::render_metrics(&mut out);
    crate::group::render_lease_metrics(&mut out);
    out
}

/// Refused Fabrics Connects by reason (`core::refusals`), each also logged.
fn render_connect_refusals(out: &mut String, target: &Target) {
    let mut refusals = Family::new(
        out,
        "nvmeof_connect_refusals_total",
        "counter",
        "Refused Fabrics Connects by reason, failed and missing authentications included.",
    );
    for (reason, count) in target.connect_refusals().counts() {
        refusals.sample(&[("reason", reason)], count);
    }
}

/// In-band authentication (DH-HMAC-CHAP) outcomes, per queue transaction.
fn render_authentication(out: &mut String, target: &Target) {
    let counters = target.auth_counters();
    Family::new(
        out,
        "nvmeof_auth_successes_total",
        "counter",
        "Queues that authenticated (DH-HMAC-CHAP), re-authentications included.",
    )
    .sample(&[], counters.successes());
    let mut failures = Family::new(
        out,
        "nvmeof_auth_failures_total",
        "counter",
        "Failed authentications, by reason (each ended its controller).",
    );
    for (reason, count) in counters.failures() {
        failures.sample(&[("reason", reason)], count);
    }
}

/// Process-wide transport counters: connections, and what went wrong on them.
fn render_transports(out: &mut String) {
    let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let tcp = crate::tcp::stats();
    let rdma = crate::rdma::stats();
    let budget = crate::tcp::data_budget();
    let (held_now, held_total) = budget.held();
    let gauges: [(&str, &str, u64); 6] = [
        (
            "nvmeof_tcp_connections",
            "NVMe/TCP connections (queues) open now.",
            load(&tcp.live),
        ),
        (
            "nvmeof_tcp_data_buffer_bytes",
            "Bytes of data buffers NVMe/TCP commands hold now (counted against the data budget).",
            budget.in_use() as u64,
        ),
        (
            "nvmeof_tcp_data_budget_bytes",
            "The data budget: bytes of data buffers NVMe/TCP commands may hold in all ([gateway] tcp_data_budget).",
            budget.limit() as u64,
        ),
        (
            "nvmeof_tcp_commands_waiting_for_buffers",
            "NVMe/TCP commands waiting now for the data budget to admit their buffer.",
            held_now,
        ),
        (
            "nvmeof_tcp_kept_buffer_bytes",
            "Bytes of data buffers NVMe/TCP connections keep for reuse (not in use).",
            load(&tcp.kept_buffer_bytes),
        ),
        (
            "nvmeof_rdma_queue_pairs",
            "NVMe/RDMA queue pairs alive now.",
            load(&rdma.live_qps),
        ),
    ];
    for (name, help, value) in gauges {
        Family::new(out, name, "gauge", help).sample(&[], value);
    }
    let counters: [(&str, &str, u64); 21] = [
        (
            "nvmeof_tcp_connections_accepted_total",
            "NVMe/TCP connections accepted.",
            load(&tcp.accepted),
        ),
        (
            "nvmeof_tcp_commands_waited_for_buffers_total",
            "NVMe/TCP commands that waited for the data budget to admit their buffer.",
            held_total,
        ),
        (
            "nvmeof_tcp_fatal_pdu_errors_total",
            "NVMe/TCP connections closed for a malformed PDU (after a C2HTermReq).",
            load(&tcp.fatal_pdu_errors),
        ),
        (
            "nvmeof_tcp_data_digest_errors_total",
            "H2CData PDUs whose data digest did not match (the command failed for retry).",
            load(&tcp.data_digest_errors),
        ),
        (
            "nvmeof_tcp_host_term_reqs_total",
            "NVMe/TCP connections a host ended with an H2CTermReq.",
            load(&tcp.host_term_reqs),
        ),
        (
            "nvmeof_tcp_busy_poll_reads_total",
            "NVMe/TCP reads while a busy-polling window was open (no wake-up needed).",
            load(&tcp.busy_poll_reads),
        ),
        (
            "nvmeof_tcp_busy_poll_expired_total",
            "NVMe/TCP busy-polling windows that closed with nothing to read.",
            load(&tcp.busy_poll_expired),
        ),
        (
            "nvmeof_tcp_busy_poll_chose_poll_total",
            "Adaptive busy polling: a queue compared both modes and polls (it was faster).",
            load(&tcp.busy_poll_chose_poll),
        ),
        (
            "nvmeof_tcp_busy_poll_chose_sleep_total",
            "Adaptive busy polling: a queue compared both modes and sleeps (polling did not pay).",
            load(&tcp.busy_poll_chose_sleep),
        ),
        (
            "nvmeof_tls_handshakes_total",
            "TLS handshakes completed on secure NVMe/TCP listeners.",
            load(&crate::tcp::tls::stats().handshakes),
        ),
        (
            "nvmeof_tls_handshake_failures_total",
            "Connections to secure NVMe/TCP listeners closed because the TLS handshake failed.",
            load(&crate::tcp::tls::stats().handshake_failures),
        ),
        (
            "nvmeof_tls_ktls_connections_total",
            "Secure NVMe/TCP connections served with kernel TLS (the keys on the socket).",
            load(&crate::tcp::ktls::stats().ktls),
        ),
        (
            "nvmeof_tls_relay_connections_total",
            "Secure NVMe/TCP connections served through the user-space TLS relay (kernel TLS not possible).",
            load(&crate::tcp::ktls::stats().relay),
        ),
        (
            "nvmeof_tls_ktls_aborted_total",
            "Secure NVMe/TCP connections closed because the kernel took one direction's TLS keys and refused the other's.",
            load(&crate::tcp::ktls::stats().aborted),
        ),
        (
            "nvmeof_keep_alive_timeouts_total",
            "Controllers torn down because no keep-alive came within KATO.",
            crate::keep_alive::timeouts(),
        ),
        (
            "nvmeof_rdma_connect_requests_total",
            "NVMe/RDMA connect requests.",
            load(&rdma.connect_requests),
        ),
        (
            "nvmeof_rdma_connects_rejected_total",
            "NVMe/RDMA connect requests rejected (bad private data, no such controller, ...).",
            load(&rdma.rejected),
        ),
        (
            "nvmeof_rdma_work_completion_errors_total",
            "RDMA work completions with an error status (flushes excluded).",
            load(&rdma.wc_errors),
        ),
        (
            "nvmeof_rdma_qp_fatal_events_total",
            "Queue pair error events (QP fatal, request or access error) from the device.",
            load(&rdma.qp_fatal_events),
        ),
        (
            "nvmeof_rdma_buffer_waits_total",
            "Commands that waited for a registered buffer (pool exhausted).",
            load(&rdma.buffer_waits),
        ),
        (
            "nvmeof_rdma_payload_copied_bytes_total",
            "Payload bytes copied into a registered buffer (0 when data moves zero-copy).",
            load(&rdma.payload_copies),
        ),
    ];
    for (name, help, value) in counters {
        Family::new(out, name, "counter", help).sample(&[], value);
    }
}

fn render_unavailable(out: &mut String, target: &Target) {
    let mut f = Family::new(
        out,
        "nvmeof_namespace_unavailable",
        "gauge",
        "A configured namespace not served because its device could not be opened (the \
         log says why; retried in the background). Always 1.",
    );
    for ns in target.unavailable_namespaces() {
        let nsid = ns.nsid.to_string();
        f.sample(&namespace_labels(&ns.nqn, &nsid, &ns.device), 1);
    }
}

fn render_listeners(out: &mut String, target: &Target) {
    let mut f = Family::new(
        out,
        "nvmeof_listener_info",
        "gauge",
        "An address this gateway serves NVMe-oF on (always 1).",
    );
    for l in target.listeners() {
        let port = l.port.to_string();
        f.sample(
            &[
                ("transport", transport_name(l.transport)),
                ("address", &l.address),
                ("port", &port),
            ],
            1,
        );
    }
}

fn render_subsystems(out: &mut String, target: &Target) {
    let subsystems = target.subsystems();
    let mut f = Family::new(
        out,
        "nvmeof_subsystem_namespaces",
        "gauge",
        "Namespaces of the subsystem on this gateway.",
    );
    for s in &subsystems {
        f.sample(&[("subsystem", s.nqn())], s.namespaces().len());
    }
    let mut f = Family::new(
        out,
        "nvmeof_subsystem_controllers",
        "gauge",
        "Connected controllers (host associations) per subsystem, host and transport; \
         subsystem is the discovery NQN for discovery controllers.",
    );
    let discovery = target.subsystem(crate::spec::DISCOVERY_NQN);
    for s in discovery.iter().chain(&subsystems) {
        let mut per_host: BTreeMap<(String, &'static str), usize> = BTreeMap::new();
        for c in s.controllers() {
            let transport = c
                .local_address
                .map_or("unknown", |(t, _)| transport_name(t));
            *per_host.entry((c.hostnqn.clone(), transport)).or_default() += 1;
        }
        for ((host, transport), n) in &per_host {
            f.sample(
                &[
                    ("subsystem", s.nqn()),
                    ("host", host),
                    ("transport", transport),
                ],
                n,
            );
        }
    }
    let mut f = Family::new(
        out,
        "nvmeof_ana_group_state",
        "gauge",
        "The ANA state this gateway reports for the group (1 for the current state).",
    );
    for s in &subsystems {
        for (group, state) in s.ana_groups() {
            let group = group.to_string();
            f.sample(
                &[
                    ("subsystem", s.nqn()),
                    ("ana_group", &group),
                    ("state", ana_state_name(state)),
                ],
                1,
            );
        }
    }
}

fn render_namespaces(out: &mut String, target: &Target) {
    struct Row {
        subsystem: String,
        nsid: String,
        device: String,
        ana_group: String,
        capacity: u64,
        in_flight: usize,
        stats: Option<rbd_backend::IoStatsSnapshot>,
        qos: crate::core::qos::QosLimits,
        /// Commands that waited for their QoS turn, and their total wait (ns).
        throttled: (u64, u64),
    }
    let rows: Vec<Row> = target
        .subsystems()
        .iter()
        .flat_map(|s| {
            s.namespaces().into_iter().map(move |ns| Row {
                subsystem: s.nqn().to_string(),
                nsid: ns.nsid.to_string(),
                device: ns.device.name().to_string(),
                ana_group: ns.ana_group.to_string(),
                capacity: ns.size_bytes(),
                in_flight: ns.device.in_flight(),
                stats: ns.device.io_stats(),
                qos: ns.qos.limits(),
                throttled: ns.qos.throttled(),
            })
        })
        .collect();
    let mut f = Family::new(
        out,
        "nvmeof_namespace_info",
        "gauge",
        "A namespace, its device (pool/image for RBD) and ANA group (always 1).",
    );
    for r in &rows {
        f.sample(
            &[
                ("subsystem", &r.subsystem),
                ("nsid", &r.nsid),
                ("device", &r.device),
                ("ana_group", &r.ana_group),
            ],
            1,
        );
    }
    let mut f = Family::new(
        out,
        "nvmeof_namespace_capacity_bytes",
        "gauge",
        "Size of the namespace's device.",
    );
    for r in &rows {
        f.sample(
            &namespace_labels(r.subsystem.as_str(), &r.nsid, &r.device),
            r.capacity,
        );
    }
    let mut f = Family::new(
        out,
        "nvmeof_namespace_ops_in_flight",
        "gauge",
        "Ops submitted to the device and not completed yet.",
    );
    for r in &rows {
        f.sample(
            &namespace_labels(&r.subsystem, &r.nsid, &r.device),
            r.in_flight,
        );
    }
    let mut f = Family::new(
        out,
        "nvmeof_namespace_qos_limit",
        "gauge",
        "A QoS limit set on the namespace (limit: rw_ios_per_second, or \
         rw_/r_/w_megabytes_per_second in MB of 2^20 bytes); absent: no limit.",
    );
    for r in &rows {
        for (limit, value) in [
            ("rw_ios_per_second", r.qos.rw_ios_per_second),
            ("rw_megabytes_per_second", r.qos.rw_megabytes_per_second),
            ("r_megabytes_per_second", r.qos.r_megabytes_per_second),
            ("w_megabytes_per_second", r.qos.w_megabytes_per_second),
        ] {
            if value != 0 {
                let [a, b, c] = namespace_labels(&r.subsystem, &r.nsid, &r.device);
                f.sample(&[a, b, c, ("limit", limit)], value);
            }
        }
    }
    let mut f = Family::new(
        out,
        "nvmeof_namespace_throttled_commands_total",
        "counter",
        "Commands that waited for their turn under the namespace's QoS limits.",
    );
    for r in &rows {
        f.sample(
            &namespace_labels(&r.subsystem, &r.nsid, &r.device),
            r.throttled.0,
        );
    }
    let mut f = Family::new(
        out,
        "nvmeof_namespace_throttled_seconds_total",
        "counter",
        "Time commands waited under the namespace's QoS limits, summed over commands.",
    );
    for r in &rows {
        f.sample(
            &namespace_labels(&r.subsystem, &r.nsid, &r.device),
            r.throttled.1 as f64 / 1e9,
        );
    }
    type Pick = fn(&rbd_backend::OpTotals) -> String;
    let per_op: [(&str, &str, Pick); 4] = [
        (
            "nvmeof_namespace_ops_total",
            "Ops the device completed, successfully or not, per kind of op.",
            |t| t.completed.to_string(),
        ),
        (
            "nvmeof_namespace_failed_ops_total",
            "Ops the device completed with an error (a compare-and-write miscompare included).",
            |t| t.failed.to_string(),
        ),
        (
            "nvmeof_namespace_bytes_total",
            "Bytes of the ops that succeeded: read or written, the range for discard and \
             write zeroes.",
            |t| t.bytes.to_string(),
        ),
        (
            "nvmeof_namespace_op_seconds_total",
            "Time from submission to the device to completion, summed over completed ops.",
            |t| t.seconds.to_string(),
        ),
    ];
    for (name, help, pick) in per_op {
        let mut f = Family::new(out, name, "counter", help);
        for r in &rows {
            let Some(stats) = &r.stats else { continue };
            for (kind, totals) in stats.iter() {
                f.sample(
                    &[
                        ("subsystem", &r.subsystem),
                        ("nsid", &r.nsid),
                        ("device", &r.device),
                        ("op", kind.name()),
                    ],
                    pick(&totals),
                );
            }
        }
    }
    let bounds = latency_bucket_labels();
    let mut f = Family::new(
        out,
        "nvmeof_namespace_op_duration_seconds",
        "histogram",
        "Reads and writes by time from submission to the device to completion.",
    );
    for r in &rows {
        let Some(stats) = &r.stats else { continue };
        for (kind, totals) in stats.iter() {
            let Some(buckets) = totals.latency_buckets else {
                continue;
            };
            let series = [
                ("subsystem", r.subsystem.as_str()),
                ("nsid", r.nsid.as_str()),
                ("device", r.device.as_str()),
                ("op", kind.name()),
            ];
            let bucket = |le| {
                let [a, b, c, d] = series;
                [a, b, c, d, ("le", le)]
            };
            let mut cumulative = 0;
            for (bound, count) in bounds.iter().zip(buckets) {
                cumulative += count;
                f.sample_of("_bucket", &bucket(bound.as_str()), cumulative);
            }
            f.sample_of("_bucket", &bucket("+Inf"), totals.completed);
            f.sample_of("_sum", &series, totals.seconds);
            f.sample_of("_count", &series, totals.completed);
        }
    }
}

fn namespace_labels<'a>(
    subsystem: &'a str,
    nsid: &'a str,
    device: &'a str,
) -> [(&'a str, &'a str); 3] {
    [("subsystem", subsystem), ("nsid", nsid), ("device", device)]
}

#[cfg(test)]
mod tests;
