//! Busy polling (`[gateway] tcp_busy_poll_us`): a queue that polls its socket between
//! commands serves them as a sleeping one does, and what it must notice meanwhile (the host
//! leaving, a shutdown, the other connections of its worker) it still notices. Adaptive
//! polling (the default) measures both modes and settles on one.

mod common;

use std::time::Duration;

use common::gateway_process::GatewayProcess;
use common::host::{connect_within, Attach};
use common::{http_exchange, loopback, memory_gateway_toml, metric_value, pattern, scratch_dir};
use nvmeof_gateway::config::Config;
use nvmeof_gateway::tcp::busy_poll::BusyPollConfig;
use nvmeof_gateway::tcp::pdu::{encode_icreq, IcReq};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const SUBNQN: &str = "nqn.2016-06.io.ceph-nvmeof-rs:busy-poll";
const HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:0f0f0f0f-0000-0000-0000-00000000b0b0";

/// Longer than any of these tests: a window that closing early cannot explain away.
const LONG_WINDOW: Duration = Duration::from_secs(120);

/// Held by every test here for its whole run: each one spins a CPU (the polling queues of
/// a gateway), and side by side on a 2-core machine they would be measuring each other.
static ONE_POLLING_TEST_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn polling_gateway(window: Duration) -> common::TestGateway {
    let config = Config::from_toml_str(&memory_gateway_toml(4420, SUBNQN, "16MiB"))
        .expect("valid test configuration");
    let target = config.build_target().expect("target");
    let always = BusyPollConfig {
        window,
        adaptive: false,
    };
    common::serve_target_polling(target, Some(always)).await
}

/// A gateway in this process whose namespace's ops complete `delay` later on a thread of
/// their own (as RBD ops do), polling as `busy_poll` says, and a host connected to it.
async fn delayed_gateway(
    delay: Duration,
    busy_poll: BusyPollConfig,
) -> (common::TestGateway, common::host::HostQueues) {
    let device =
        common::DelayedDevice::new(rbd_backend::MemoryDevice::new("delayed", 1 << 20), delay);
    let target = common::target_with_device(SUBNQN, std::sync::Arc::new(device));
    let gw = common::serve_target_polling(target, Some(busy_poll)).await;
    let host = connect_within(
        gw.addr.port(),
        &Attach::new(HOSTNQN, SUBNQN),
        Duration::from_secs(20),
    )
    .await;
    (gw, host)
}

#[tokio::test]
async fn the_configured_window_catches_the_next_command_and_data_reads_back() {
    let _serial = ONE_POLLING_TEST_AT_A_TIME.lock().await;
    let dir = scratch_dir(&format!("nvmeof-busy-poll-{}", std::process::id()));
    let (gateway, port, metrics_port) = GatewayProcess::spawn_memory_with_metrics(
        &dir,
        SUBNQN,
        "tcp_busy_poll_us = 10000\ntcp_busy_poll_adaptive = false\n",
    )
    .await;
    let host = connect_within(port, &Attach::new(HOSTNQN, SUBNQN), Duration::from_secs(20)).await;
    // QD1: each command goes out as soon as the previous one completed, well within 10 ms.
    const PAIRS: u64 = 32;
    for i in 0..PAIRS {
        let data = pattern(4096, i as u8);
        host.io
            .write(1, i * 8, data.clone(), 512)
            .await
            .expect("write");
        assert_eq!(host.io.read(1, i * 8, 8, 512).await.expect("read"), data);
    }
    let answer = http_exchange(loopback(metrics_port), b"GET /metrics HTTP/1.0\r\n\r\n");
    let caught = metric_value(&answer, "nvmeof_tcp_busy_poll_reads_total")
        .unwrap_or_else(|| panic!("no busy-poll counter in\n{answer}"));
    // Every command after the first is polled for; a stall of the machine may let a window
    // close now and then, so half is the bar.
    assert!(
        caught >= PAIRS as f64,
        "busy polling caught {caught} of {} commands",
        2 * PAIRS
    );
    drop(host);
    drop(gateway);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_completion_that_outlasts_the_window_opens_one_for_the_next_command() {
    let _serial = ONE_POLLING_TEST_AT_A_TIME.lock().await;
    // Ops complete 20 ms later on another thread, as RBD ops do; the window is 5 ms. The
    // window a command opens has closed long before its completion, so only one opened by
    // the completion catches the host's next command.
    let always = BusyPollConfig {
        window: Duration::from_millis(5),
        adaptive: false,
    };
    let (gw, host) = delayed_gateway(Duration::from_millis(20), always).await;
    let caught_before = common::transport_counter("nvmeof_tcp_busy_poll_reads_total");
    const READS: u64 = 40;
    for i in 0..READS {
        host.io.read(1, i * 8, 8, 512).await.expect("read");
    }
    let caught = common::transport_counter("nvmeof_tcp_busy_poll_reads_total") - caught_before;
    // Every read after the first is sent within 5 ms of the previous response; a stall of
    // the machine may let a window close now and then, so half is the bar.
    assert!(
        caught >= (READS / 2) as f64,
        "polling windows caught {caught} of {READS} reads"
    );
    drop(host);
    gw.shutdown.send(true).expect("shutdown");
}

#[tokio::test]
async fn an_adaptive_queue_whose_ops_outlast_the_idle_gap_still_decides() {
    let _serial = ONE_POLLING_TEST_AT_A_TIME.lock().await;
    // The default window (50 µs) makes a gap of more than 1 ms between two commands count
    // as the host pausing. Ops here take 3 ms, as a QD1 op on a real cluster may (0.2-2 ms
    // over a network, more on disks): every gap is longer than that, yet the host answers
    // each response at once, so these are cycles to measure, not pauses.
    let adaptive = BusyPollConfig {
        window: Duration::from_micros(50),
        adaptive: true,
    };
    let (gw, host) = delayed_gateway(Duration::from_millis(3), adaptive).await;
    let decisions = || {
        common::transport_counter("nvmeof_tcp_busy_poll_chose_poll_total")
            + common::transport_counter("nvmeof_tcp_busy_poll_chose_sleep_total")
    };
    let before = decisions();
    // The first two epochs (one polling, one sleeping) take 2 x 128 gaps.
    const READS: u64 = 300;
    for i in 0..READS {
        host.io.read(1, (i % 64) * 8, 8, 512).await.expect("read");
    }
    let decided = decisions() - before;
    assert!(
        decided >= 1.0,
        "no adaptive decision after {READS} QD1 reads of 3 ms each"
    );
    drop(host);
    gw.shutdown.send(true).expect("shutdown");
}

#[tokio::test]
async fn an_adaptive_queue_measures_both_modes_and_settles_on_one() {
    let _serial = ONE_POLLING_TEST_AT_A_TIME.lock().await;
    let dir = scratch_dir(&format!("nvmeof-busy-poll-adaptive-{}", std::process::id()));
    let (gateway, port, metrics_port) =
        GatewayProcess::spawn_memory_with_metrics(&dir, SUBNQN, "tcp_busy_poll_us = 1000\n").await;
    let host = connect_within(port, &Attach::new(HOSTNQN, SUBNQN), Duration::from_secs(20)).await;
    // QD1 pairs: 800 commands, more than the two first epochs (one polling, one sleeping)
    // need even if a stalled machine makes some gaps too long to count.
    const PAIRS: u64 = 400;
    for i in 0..PAIRS {
        let data = pattern(4096, i as u8);
        let lba = (i % 64) * 8;
        host.io
            .write(1, lba, data.clone(), 512)
            .await
            .expect("write");
        assert_eq!(host.io.read(1, lba, 8, 512).await.expect("read"), data);
    }
    let answer = http_exchange(loopback(metrics_port), b"GET /metrics HTTP/1.0\r\n\r\n");
    let counter = |name: &str| {
        metric_value(&answer, name).unwrap_or_else(|| panic!("no {name} in\n{answer}"))
    };
    let decisions = counter("nvmeof_tcp_busy_poll_chose_poll_total")
        + counter("nvmeof_tcp_busy_poll_chose_sleep_total");
    assert!(
        decisions >= 1.0,
        "no queue decided whether to poll after {} QD1 commands\n{answer}",
        2 * PAIRS
    );
    assert!(
        counter("nvmeof_tcp_busy_poll_reads_total") >= 1.0,
        "the first epoch polls"
    );
    drop(host);
    drop(gateway);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_polling_queue_leaves_the_worker_to_other_queues_and_sees_shutdown() {
    let _serial = ONE_POLLING_TEST_AT_A_TIME.lock().await;
    // One runtime thread (tokio::test): the host, both queues and the server share it, so a
    // queue that spun without yielding would hang this test.
    let gw = polling_gateway(LONG_WINDOW).await;
    let port = gw.addr.port();
    let attach = Attach::new(HOSTNQN, SUBNQN);
    let first = connect_within(port, &attach, Duration::from_secs(20)).await;
    let second = connect_within(port, &attach, Duration::from_secs(20)).await;
    for i in 0..8u64 {
        let data = pattern(4096, 40 + i as u8);
        let (queue, other) = if i % 2 == 0 {
            (&first, &second)
        } else {
            (&second, &first)
        };
        queue
            .io
            .write(1, i * 8, data.clone(), 512)
            .await
            .expect("write");
        // A pause longer than a polling slice, so the queues poll across yields.
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(other.io.read(1, i * 8, 8, 512).await.expect("read"), data);
    }
    // Both queues are polling now (the window is two minutes): a shutdown still stops them.
    gw.shutdown
        .send(true)
        .expect("the server listens for shutdown");
    tokio::time::timeout(Duration::from_secs(10), gw.server)
        .await
        .expect("the server stopped within 10 s although its queues were polling")
        .expect("the server task did not panic");
}

#[tokio::test]
async fn a_host_leaving_while_its_queue_polls_gets_the_connection_closed() {
    let _serial = ONE_POLLING_TEST_AT_A_TIME.lock().await;
    let gw = polling_gateway(LONG_WINDOW).await;
    let mut s = TcpStream::connect(gw.addr).await.expect("connect");
    let mut icreq = Vec::new();
    encode_icreq(&mut icreq, &IcReq::default());
    s.write_all(&icreq).await.expect("send ICReq");
    let mut icresp = [0u8; 128];
    s.read_exact(&mut icresp).await.expect("ICResp");
    assert_eq!(icresp[0], 0x01, "ICResp");
    // The ICReq opened the window; the host's FIN must end the connection, not wait for it.
    s.shutdown().await.expect("half-close");
    let mut rest = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut rest)).await;
    assert!(
        matches!(read, Ok(Ok(0))),
        "the gateway did not close a polling connection whose host left: {read:?}"
    );
}

#[tokio::test]
async fn data_larger_than_a_probe_reads_arrives_whole() {
    let _serial = ONE_POLLING_TEST_AT_A_TIME.lock().await;
    // The probe reads at most PROBE_BYTES (8 KiB and a header); a write's data beyond that
    // comes through the read that follows it and the next probes.
    let gw = polling_gateway(LONG_WINDOW).await;
    let host = connect_within(
        gw.addr.port(),
        &Attach::new(HOSTNQN, SUBNQN),
        Duration::from_secs(20),
    )
    .await;
    for (i, bytes) in [8192usize, 8192 + 512, 64 << 10, 1 << 20]
        .into_iter()
        .enumerate()
    {
        let data = pattern(bytes, 70 + i as u8);
        let lba = i as u64 * 4096;
        host.io
            .write(1, lba, data.clone(), 512)
            .await
            .expect("write");
        let blocks = (bytes / 512) as u32;
        assert_eq!(
            host.io.read(1, lba, blocks, 512).await.expect("read"),
            data,
            "{bytes} bytes"
        );
    }
}

/// Reads caught by a polling window and adaptive decisions, after `pairs` QD1 write/read
/// pairs on a gateway process started with `gateway_lines`.
async fn polling_counters(name: &str, gateway_lines: &str, pairs: u64) -> (f64, f64) {
    let dir = scratch_dir(&format!("nvmeof-busy-poll-{name}-{}", std::process::id()));
    let (gateway, port, metrics_port) =
        GatewayProcess::spawn_memory_with_metrics(&dir, SUBNQN, gateway_lines).await;
    let host = connect_within(port, &Attach::new(HOSTNQN, SUBNQN), Duration::from_secs(20)).await;
    for i in 0..pairs {
        let data = pattern(4096, i as u8);
        let lba = (i % 64) * 8;
        host.io
            .write(1, lba, data.clone(), 512)
            .await
            .expect("write");
        assert_eq!(host.io.read(1, lba, 8, 512).await.expect("read"), data);
    }
    let answer = http_exchange(loopback(metrics_port), b"GET /metrics HTTP/1.0\r\n\r\n");
    let counter = |name: &str| {
        metric_value(&answer, name).unwrap_or_else(|| panic!("no {name} in\n{answer}"))
    };
    let counters = (
        counter("nvmeof_tcp_busy_poll_reads_total"),
        counter("nvmeof_tcp_busy_poll_chose_poll_total")
            + counter("nvmeof_tcp_busy_poll_chose_sleep_total"),
    );
    drop(host);
    drop(gateway);
    let _ = std::fs::remove_dir_all(&dir);
    counters
}

#[tokio::test]
async fn a_gateway_polls_adaptively_by_default_and_not_at_all_with_zero() {
    let _serial = ONE_POLLING_TEST_AT_A_TIME.lock().await;
    // As many pairs as the adaptive test: the first two epochs end.
    // Whether the 50 µs windows catch commands depends on how fast this (debug) host is;
    // that a queue decides at all says it measures, i.e. polling is on and adaptive.
    let (_, decisions) = polling_counters("default", "", 400).await;
    assert!(decisions >= 1.0, "no adaptive decision by default");
    let (polled, decisions) = polling_counters("off", "tcp_busy_poll_us = 0\n", 400).await;
    assert_eq!((polled, decisions), (0.0, 0.0), "polling off");
}
