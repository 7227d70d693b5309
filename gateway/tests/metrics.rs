//! The gateway process's Prometheus endpoint (`[gateway] metrics_listen`): a scrape after
//! I/O by a host shows that I/O and the host's controller; requests a scraper would not send
//! get a 4xx answer and the gateway keeps serving.

mod common;

use std::net::TcpStream;
use std::time::Duration;

use common::gateway_process::GatewayProcess;
use common::host::{connect_within, Attach};
use common::{http_exchange, loopback, metric_value, pattern, scratch_dir};

const SUBNQN: &str = "nqn.2016-06.io.ceph-nvmeof-rs:metrics";
const HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:0f0f0f0f-0000-0000-0000-00000000e7e7";

#[tokio::test]
async fn a_scrape_counts_the_hosts_io_and_bad_requests_are_refused() {
    let dir = scratch_dir(&format!("nvmeof-metrics-{}", std::process::id()));
    let (gateway, port, metrics_port) =
        GatewayProcess::spawn_memory_with_metrics(&dir, SUBNQN, "name = \"gw-metrics\"\n").await;
    let host = connect_within(port, &Attach::new(HOSTNQN, SUBNQN), Duration::from_secs(20)).await;
    let data = pattern(8192, 7);
    for slba in [0u64, 64, 128] {
        host.io
            .write(1, slba, data.clone(), 512)
            .await
            .expect("write");
    }
    assert_eq!(host.io.read(1, 64, 16, 512).await.expect("read"), data);
    host.io.flush(1).await.expect("flush");

    let metrics = loopback(metrics_port);
    let answer = http_exchange(metrics, b"GET /metrics HTTP/1.1\r\nHost: gw\r\n\r\n");
    let (head, body) = answer.split_once("\r\n\r\n").expect("a head and a body");
    assert!(head.starts_with("HTTP/1.1 200 OK"), "{head}");
    assert!(
        head.contains("Content-Type: text/plain; version=0.0.4"),
        "{head}"
    );
    let ns = format!("subsystem=\"{SUBNQN}\",nsid=\"1\",device=\"memory:{SUBNQN}/1\"");
    let expect = [
        (format!("nvmeof_namespace_ops_total{{{ns},op=\"write\"}}"), 3.0),
        (format!("nvmeof_namespace_bytes_total{{{ns},op=\"write\"}}"), 3.0 * 8192.0),
        (format!("nvmeof_namespace_ops_total{{{ns},op=\"read\"}}"), 1.0),
        (format!("nvmeof_namespace_bytes_total{{{ns},op=\"read\"}}"), 8192.0),
        (format!("nvmeof_namespace_ops_total{{{ns},op=\"flush\"}}"), 1.0),
        (format!("nvmeof_namespace_failed_ops_total{{{ns},op=\"write\"}}"), 0.0),
        (format!("nvmeof_namespace_capacity_bytes{{{ns}}}"), 16.0 * 1048576.0),
        // the host's admin and I/O queues
        ("nvmeof_tcp_connections".to_string(), 2.0),
        ("nvmeof_tcp_fatal_pdu_errors_total".to_string(), 0.0),
        (
            format!(
                "nvmeof_subsystem_controllers{{subsystem=\"{SUBNQN}\",host=\"{HOSTNQN}\",transport=\"tcp\"}}"
            ),
            1.0,
        ),
        (
            "nvmeof_gateway_info{name=\"gw-metrics\",version=\"".to_string()
                + env!("CARGO_PKG_VERSION")
                + "\"}",
            1.0,
        ),
    ];
    for (series, want) in &expect {
        assert_eq!(
            metric_value(body, series),
            Some(*want),
            "{series} in\n{body}"
        );
    }

    // What a scraper would not send: an answer that says so, then the next scrape works.
    for (request, status) in [
        (&b"POST /metrics HTTP/1.1\r\n\r\n"[..], "405"),
        (b"GET /favicon.ico HTTP/1.1\r\n\r\n", "404"),
        (
            b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n",
            "400",
        ),
        (&[b'A'; 20000][..], "400"),
    ] {
        let answer = http_exchange(metrics, request);
        assert!(
            answer.starts_with(&format!("HTTP/1.1 {status} ")),
            "{status} expected, got {answer:?}"
        );
    }
    // A client that connects and says nothing does not block others.
    let _silent = TcpStream::connect(metrics).expect("connect");
    let again = http_exchange(metrics, b"GET /metrics HTTP/1.0\r\n\r\n");
    assert!(again.starts_with("HTTP/1.1 200 OK"), "{again}");
    let (_, body) = again.split_once("\r\n\r\n").expect("body");
    assert_eq!(
        metric_value(
            body,
            &format!("nvmeof_namespace_ops_total{{{ns},op=\"write\"}}")
        ),
        Some(3.0)
    );
    assert_eq!(
        host.io.read(1, 0, 16, 512).await.expect("still serving"),
        data
    );
    drop(gateway);
    let _ = std::fs::remove_dir_all(&dir);
}
