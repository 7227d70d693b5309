//! What other initiators do, against a gateway process (its log and metrics): SPDK's
//! detach sequence, which reuses an outstanding AER's CID at once (issue 31); a host
//! without a host NQN (SPDK's tools); a refused Connect, logged with its peer and counted.

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::gateway_process::GatewayProcess;
use common::{scrape, scratch_dir};
use nvmeof_gateway::host::cmd::{admin, cc, prop};
use nvmeof_gateway::host::{HostConnection, HostOptions, RawCommand, Sqe};

const SUBNQN: &str = "nqn.2016-06.io.test:interop";
/// The CID the AER is sent with, and SPDK's Property Get of CC then reuses.
const AER_CID: u16 = 0x1a;

fn opts(hostnqn: &str) -> HostOptions {
    let mut o = HostOptions::new(hostnqn);
    o.timeout = Duration::from_secs(10);
    o
}

async fn gateway(name: &str) -> (GatewayProcess, u16, u16) {
    let dir = scratch_dir(&format!("nvmeof-interop-{}-{name}", std::process::id()));
    GatewayProcess::spawn_memory_with_metrics(&dir, SUBNQN, "").await
}

fn loopback(port: u16) -> std::net::SocketAddr {
    std::net::SocketAddr::from(([127, 0, 0, 1], port))
}

/// SPDK's initiator detaching (`nvme_ctrlr_destruct`): it completes its outstanding AER
/// itself, without an Abort, reads CC under that AER's CID at once, sets CC.SHN and polls
/// CSTS until SHST says complete. The gateway answered the Property Get with Command ID
/// Conflict, so SPDK logged "Failed to read the CC register" and never shut down.
#[tokio::test]
async fn spdk_detach_reusing_the_aer_cid_shuts_the_controller_down() {
    let (mut gw, port, _) = gateway("detach").await;
    let host =
        HostConnection::connect(loopback(port), opts("nqn.2014-08.org.nvmexpress:uuid:spdk"))
            .await
            .expect("admin connection");
    host.connect_admin(SUBNQN, 30_000).await.expect("connect");
    host.enable_controller().await.expect("enable");
    let mut aec = Sqe::new(admin::SET_FEATURES);
    aec.set_cdw(10, 0x0b).set_cdw(11, 1 << 8); // Async Event Configuration: NS attribute
    host.submit_ok(aec, nvmeof_gateway::host::Xfer::None)
        .await
        .expect("enable namespace notices");

    let mut aer = Sqe::new(admin::ASYNC_EVENT);
    aer.set_cid(AER_CID).set_sgl_transport(0);
    let raw = |sqe: &Sqe| RawCommand {
        sqe: sqe.0,
        in_capsule: Bytes::new(),
        r2t_data: Bytes::new(),
        read_len: 0,
    };
    let outstanding = host.start_raw(raw(&aer)).await.expect("AER sent");
    // Give the AER time to reach the controller before the CID is reused.
    tokio::time::sleep(Duration::from_millis(200)).await;
    host.forget(AER_CID);
    drop(outstanding);

    let mut get_cc = Sqe::property_get(prop::CC, false);
    get_cc.set_cid(AER_CID).set_sgl_transport(0);
    let cc_read = host
        .submit_raw(raw(&get_cc))
        .await
        .expect("CC read answered");
    assert!(
        cc_read.cqe.is_success(),
        "reading CC under the AER's CID: status {:#x}",
        cc_read.cqe.status()
    );
    assert_ne!(cc_read.cqe.dw0() & cc::EN, 0, "CC as the host set it");
    host.shutdown_controller()
        .await
        .expect("CC.SHN, then CSTS.SHST complete");
    gw.wait_for_log(
        "controller shut down by the host",
        Duration::from_secs(10),
        "no shutdown logged",
    )
    .await;
    assert!(gw.log_text().contains("kind=\"normal\"") || gw.log_text().contains("kind=normal"));
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !host.is_closed(),
        "no completion came for the dropped AER (the host closes on an unknown CID): {:?}",
        host.close_reason()
    );
    assert!(gw.terminate().success());
}

/// SPDK's tools send an empty HOSTNQN unless given one: a subsystem open to any host lets
/// it in (as Linux nvmet and SPDK's target do) and says so; a Connect to a subsystem the
/// gateway does not have is refused, logged with the peer and the reason, and counted.
#[tokio::test]
async fn empty_host_nqns_get_in_and_refusals_are_logged_with_the_peer_and_counted() {
    let (mut gw, port, metrics_port) = gateway("refusals").await;
    let anonymous = HostConnection::connect(loopback(port), opts(""))
        .await
        .expect("connection");
    anonymous
        .connect_admin(SUBNQN, 0)
        .await
        .expect("an empty host NQN is let into an allow-any-host subsystem");
    gw.wait_for_log(
        "host connected without a host NQN",
        Duration::from_secs(10),
        "the empty host NQN was not logged",
    )
    .await;

    let lost =
        HostConnection::connect(loopback(port), opts("nqn.2014-08.org.nvmexpress:uuid:lost"))
            .await
            .expect("connection");
    lost.connect_admin("nqn.2016-06.io.test:absent", 0)
        .await
        .expect_err("no such subsystem");
    gw.wait_for_log(
        "connect refused",
        Duration::from_secs(10),
        "the refusal was not logged",
    )
    .await;
    let log = gw.log_text();
    let line = log
        .lines()
        .find(|l| l.contains("connect refused"))
        .expect("the refusal line");
    for part in [
        "peer=127.0.0.1:",
        "unknown_subsystem",
        "nqn.2014-08.org.nvmexpress:uuid:lost",
        "nqn.2016-06.io.test:absent",
    ] {
        assert!(line.contains(part), "{part:?} missing from {line:?}");
    }
    assert_eq!(
        scrape(
            metrics_port,
            "nvmeof_connect_refusals_total{reason=\"unknown_subsystem\"}"
        ),
        Some(1.0)
    );
    assert_eq!(
        scrape(
            metrics_port,
            "nvmeof_connect_refusals_total{reason=\"host_not_allowed\"}"
        ),
        Some(0.0)
    );
    assert!(gw.terminate().success());
}
