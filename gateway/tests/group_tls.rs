//! mTLS between the gateway's group agent and `nvmeof-control`: with `[group] tls_ca`,
//! `tls_cert` and `tls_key` the agent joins a replica that serves only clients whose
//! certificate its CA signed (beacons reach it, the assignment stream is applied); the same
//! agent with a certificate from another CA, or without TLS, gets nothing. The `[group]` TLS
//! fields are checked when the file is read (all three or none, readable, the field named).
//! Certificates and the TLS replica come from `control_plane::test_support`, shared with
//! control-plane/tests/tls.rs. No Ceph needed: the control plane keeps its state in memory and
//! the gateway serves a memory namespace.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use control_plane::proto::{self, admin_client::AdminClient};
use control_plane::test_support::{serve_in_memory_over_tls, TestPki};
use control_plane::tls::{self, TlsFiles};
use nvmeof_gateway::config::Config;
use nvmeof_gateway::group::{self, GroupSettings};

/// The gateway's file: gateway `gwN` owns ANA group N, serves a memory namespace in group 1;
/// the `[group]` section has the `tls` lines.
fn gateway_toml(name: &str, cp: &str, tls: &str) -> String {
    let own_group: u32 = name.trim_start_matches("gw").parse().expect("gwN");
    format!(
        r#"
[gateway]
name = "{name}"
[group]
control_plane = ["{cp}"]
ana_group = {own_group}
beacon_interval_ms = 200
{tls}
[[listener]]
transport = "tcp"
address = "127.0.0.1"
port = 4420
[[subsystem]]
nqn = "nqn.2016-06.io.test:group-tls"
allow_any_host = true
[[subsystem.namespace]]
nsid = 1
backend = "memory"
size = "1MiB"
ana_group = 1
"#
    )
}

/// The `[group]` TLS lines of a gateway using `files`.
fn tls_lines_for(files: &TlsFiles) -> String {
    let file = |path: &Option<PathBuf>| path.clone().expect("a TLS file");
    tls_lines(&file(&files.ca), &file(&files.cert), &file(&files.key))
}

fn tls_lines(ca: &Path, cert: &Path, key: &Path) -> String {
    format!(
        "tls_ca = {:?}\ntls_cert = {:?}\ntls_key = {:?}",
        ca.display().to_string(),
        cert.display().to_string(),
        key.display().to_string()
    )
}

/// Starts the group agent as `nvmeof-gateway` does for this file.
fn start_agent(toml: &str) -> group::GroupAgent {
    let config = Config::from_toml_str(toml).expect("gateway config");
    let g = config.group.clone().expect("[group]");
    let tls = tls::client_tls_config(&g.tls_files(), None).expect("client TLS");
    let target = config.build_target().expect("target");
    group::start_inaccessible(&target);
    group::spawn(
        target,
        GroupSettings {
            gateway: config.gateway.name.clone().unwrap_or_default(),
            control_plane: g.control_plane.clone(),
            ana_group: g.ana_group.unwrap_or(0),
            beacon_interval: Duration::from_millis(200),
            stall_window: g.stall_window(),
            config: None,
            tls,
        },
    )
}

async fn gateways_known(addr: &str, admin_files: &TlsFiles) -> Vec<String> {
    let config = tls::client_tls_config(admin_files, None)
        .expect("admin TLS")
        .expect("TLS");
    let channel = tls::client_endpoint(addr, Some(&config))
        .expect("endpoint")
        .connect()
        .await
        .expect("admin connection");
    AdminClient::new(channel)
        .gateway_list(proto::Empty {})
        .await
        .expect("gateway list")
        .into_inner()
        .gateways
        .into_iter()
        .filter(|g| g.last_beacon_ms_ago > 0 || g.availability == "available")
        .map(|g| g.name)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_group_agent_joins_a_control_plane_over_mtls() {
    let pki = TestPki::create("gw-group-tls-agent");
    let addr = serve_in_memory_over_tls(&pki.server, "tls-replica").await;
    // The gateways' certificate also serves the admin requests that check what arrived.
    let admin_files = &pki.client;

    // The agent with the CA's certificate: beacons arrive, the assignment is applied.
    let good = start_agent(&gateway_toml("gw1", &addr, &tls_lines_for(&pki.client)));
    // Another CA's certificate, and no TLS at all: refused by the replica.
    let stranger = start_agent(&gateway_toml("gw2", &addr, &tls_lines_for(&pki.stranger)));
    let plain = start_agent(&gateway_toml("gw3", &addr, ""));

    let started = Instant::now();
    while good.applied_epoch() == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "no assignment applied over mTLS"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!(
        "assignment {} applied over mTLS after {} ms",
        good.applied_epoch(),
        started.elapsed().as_millis()
    );
    let started = Instant::now();
    loop {
        let known = gateways_known(&addr, admin_files).await;
        if known.iter().any(|n| n == "gw1") {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "gw1's beacons never arrived: {known:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The refused agents have had the same time and more (a few beacon periods).
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(
        stranger.applied_epoch(),
        0,
        "another CA's certificate was served"
    );
    assert_eq!(plain.applied_epoch(), 0, "a plain-text agent was served");
    let known = gateways_known(&addr, admin_files).await;
    assert!(
        !known.iter().any(|n| n == "gw2" || n == "gw3"),
        "a refused agent's beacons arrived: {known:?}"
    );
    // Control: a second gateway like gw2 and gw3 but with the CA's certificate is served, so
    // what kept them out was TLS, not being a second gateway of group 1.
    let second = start_agent(&gateway_toml("gw4", &addr, &tls_lines_for(&pki.client)));
    let started = Instant::now();
    while second.applied_epoch() == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "a second gateway with a good certificate got no assignment"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(stranger.applied_epoch(), 0);
    assert_eq!(plain.applied_epoch(), 0);
    drop((good, stranger, plain, second));
}

#[test]
fn the_group_tls_fields_go_together_and_must_be_readable() {
    let pki = TestPki::create("gw-group-tls-fields");
    let ca = &pki.ca;
    let (cert, key) = (
        pki.client.cert.as_ref().expect("client certificate"),
        pki.client.key.as_ref().expect("client key"),
    );
    let ok = Config::from_toml_str(&gateway_toml(
        "gw1",
        "127.0.0.1:5500",
        &tls_lines(ca, cert, key),
    ))
    .expect("all three");
    let g = ok.group.expect("group");
    assert_eq!(g.tls_files().ca.as_deref(), Some(ca.as_path()));
    assert!(
        Config::from_toml_str(&gateway_toml("gw1", "127.0.0.1:5500", ""))
            .expect("none")
            .group
            .expect("group")
            .tls_files()
            .is_empty()
    );

    let without_key = format!(
        "tls_ca = {:?}\ntls_cert = {:?}",
        ca.display().to_string(),
        cert.display().to_string()
    );
    let e = Config::from_toml_str(&gateway_toml("gw1", "127.0.0.1:5500", &without_key))
        .expect_err("key missing")
        .to_string();
    assert!(e.contains("group.tls_key") && e.contains("together"), "{e}");
    let only_ca = format!("tls_ca = {:?}", ca.display().to_string());
    let e = Config::from_toml_str(&gateway_toml("gw1", "127.0.0.1:5500", &only_ca))
        .expect_err("cert missing")
        .to_string();
    assert!(e.contains("group.tls_cert"), "{e}");

    let missing = pki.dir.join("nope.crt");
    let e = Config::from_toml_str(&gateway_toml(
        "gw1",
        "127.0.0.1:5500",
        &tls_lines(ca, &missing, key),
    ))
    .expect_err("unreadable cert")
    .to_string();
    assert!(
        e.contains("group.tls_cert") && e.contains("nope.crt"),
        "{e}"
    );
}
