//! mTLS between clients and `nvmeof-control`, with certificates made by
//! `control_plane::test_support` (a CA, the server's, a client's, and a client's from another
//! CA): a client with a certificate signed by the CA is served; no certificate, another CA's
//! certificate, no TLS at all, or a server certificate the client does not trust are refused,
//! and the server goes on serving. Then the same through the real binaries:
//! `nvmeof-control --tls-*` and `nvmeofctl` with flags and environment variables, and its
//! exit codes.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use control_plane::proto::gateway_control_client::GatewayControlClient;
use control_plane::proto::{self, admin_client::AdminClient};
use control_plane::test_support::{free_port, serve_in_memory_over_tls, TestPki};
use control_plane::tls::{self, TlsFiles};

mod common;

/// A client that trusts only the other CA: the server's certificate is not trusted.
fn trusting_the_other_ca(pki: &TestPki) -> TlsFiles {
    TlsFiles {
        ca: Some(pki.other_ca.clone()),
        ..pki.client.clone()
    }
}

/// A client that trusts the CA but has no certificate of its own.
fn without_certificate(pki: &TestPki) -> TlsFiles {
    TlsFiles {
        ca: Some(pki.ca.clone()),
        cert: None,
        key: None,
    }
}

/// One admin request through a fresh connection: Ok(number of subsystems) or the error text.
async fn list_subsystems(addr: &str, files: &TlsFiles) -> Result<usize, String> {
    let config = tls::client_tls_config(files, None).map_err(|e| e.to_string())?;
    let endpoint = tls::client_endpoint(addr, config.as_ref())
        .map_err(|e| e.to_string())?
        .connect_timeout(Duration::from_secs(3))
        .timeout(Duration::from_secs(5));
    let channel = endpoint.connect().await.map_err(|e| tls::chain(&e))?;
    AdminClient::new(channel)
        .subsystem_list(proto::Empty {})
        .await
        .map(|r| r.into_inner().subsystems.len())
        .map_err(|s| format!("{s}: {}", tls::chain(&s)))
}

/// One gateway beacon through a fresh connection (as `gateway/src/group.rs` would send it).
async fn beacon(addr: &str, files: &TlsFiles) -> Result<proto::BeaconReply, String> {
    let config = tls::client_tls_config(files, None).map_err(|e| e.to_string())?;
    let channel = tls::client_endpoint(addr, config.as_ref())
        .map_err(|e| e.to_string())?
        .connect_timeout(Duration::from_secs(3))
        .timeout(Duration::from_secs(5))
        .connect()
        .await
        .map_err(|e| tls::chain(&e))?;
    GatewayControlClient::new(channel)
        .send_beacon(proto::Beacon {
            gateway: "gw1".into(),
            incarnation: 7,
            ..Default::default()
        })
        .await
        .map(|r| r.into_inner())
        .map_err(|s| tls::chain(&s))
}

#[tokio::test]
async fn only_clients_with_a_certificate_from_the_ca_are_served() {
    let pki = TestPki::create("cp-tls-api");
    let addr = serve_in_memory_over_tls(&pki.server, "tls-test").await;

    assert_eq!(list_subsystems(&addr, &pki.client).await, Ok(0));

    let no_cert = list_subsystems(&addr, &without_certificate(&pki)).await;
    assert!(no_cert.is_err(), "a client without certificate was served");
    let stranger = list_subsystems(&addr, &pki.stranger).await;
    assert!(stranger.is_err(), "another CA's certificate was accepted");
    let plain = list_subsystems(&addr, &TlsFiles::default()).await;
    assert!(plain.is_err(), "a plain-text client was served");
    let untrusted = list_subsystems(&addr, &trusting_the_other_ca(&pki))
        .await
        .expect_err("the client trusted a server its CA did not sign");
    assert!(
        untrusted.contains("certificate"),
        "unclear refusal: {untrusted}"
    );
    // The name checked is the address's host: an IP that the certificate does not name.
    let misnamed = tls::client_tls_config(&pki.client, Some("control.example"))
        .expect("config")
        .expect("TLS");
    let wrong_name = tls::client_endpoint(&addr, Some(&misnamed))
        .expect("endpoint")
        .connect()
        .await;
    assert!(
        wrong_name.is_err(),
        "a misnamed server certificate was accepted"
    );

    // The gateways' service is behind the same TLS: a gateway with a certificate beacons.
    assert!(beacon(&addr, &pki.client).await.is_ok());
    assert!(beacon(&addr, &without_certificate(&pki)).await.is_err());
    assert!(beacon(&addr, &pki.stranger).await.is_err());

    // The refused handshakes did not stop the server.
    assert_eq!(list_subsystems(&addr, &pki.client).await, Ok(0));
}

#[test]
fn incomplete_or_contradictory_options_are_refused() {
    let pki = TestPki::create("cp-tls-options");
    let no_key = TlsFiles {
        key: None,
        ..pki.server.clone()
    };
    assert!(tls::server_tls_config(&no_key).is_err());
    let no_ca = TlsFiles {
        ca: None,
        ..pki.server.clone()
    };
    assert!(tls::server_tls_config(&no_ca).is_err());
    assert!(matches!(
        tls::server_tls_config(&TlsFiles::default()),
        Ok(None)
    ));
    // Key and certificate swapped: refused when read, not when the first client comes.
    let swapped = TlsFiles {
        cert: pki.server.key.clone(),
        key: pki.server.cert.clone(),
        ..pki.server.clone()
    };
    assert!(tls::server_tls_config(&swapped).is_err());
    let missing = TlsFiles {
        ca: Some(pki.dir.join("nope.crt")),
        ..pki.server.clone()
    };
    let err = tls::server_tls_config(&missing).expect_err("missing file");
    assert!(err.to_string().contains("nope.crt"), "{err}");

    let cert_only = TlsFiles {
        key: None,
        ..pki.client.clone()
    };
    assert!(tls::client_tls_config(&cert_only, None).is_err());
    let client = tls::client_tls_config(&pki.client, None)
        .expect("client")
        .expect("TLS");
    assert!(tls::client_endpoint("http://127.0.0.1:1", Some(&client)).is_err());
    assert!(tls::client_endpoint("https://127.0.0.1:1", None).is_err());
    assert!(tls::client_endpoint("127.0.0.1:1", Some(&client)).is_ok());
    assert!(tls::client_endpoint("127.0.0.1:1", None).is_ok());
}

fn path(p: &Option<PathBuf>) -> &Path {
    p.as_deref().expect("path")
}

struct Daemon(std::process::Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn nvmeofctl(args: &[&str], env: &[(&str, &Path)]) -> Output {
    let mut cmd = common::nvmeofctl(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("run nvmeofctl")
}

#[test]
fn the_binaries_with_tls_options() {
    let pki = TestPki::create("cp-tls-bins");
    let port = free_port();
    let server = format!("127.0.0.1:{port}");
    let daemon = Daemon(
        Command::new(env!("CARGO_BIN_EXE_nvmeof-control"))
            .args([
                "--store",
                "memory",
                "--listen",
                &server,
                "--lease-ms",
                "600",
            ])
            .arg("--tls-cert")
            .arg(path(&pki.server.cert))
            .arg("--tls-key")
            .arg(path(&pki.server.key))
            .arg("--tls-ca")
            .arg(&pki.ca)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start nvmeof-control"),
    );
    let good: Vec<(&str, &Path)> = vec![
        ("NVMEOFCTL_TLS_CA", pki.ca.as_path()),
        ("NVMEOFCTL_TLS_CERT", path(&pki.client.cert)),
        ("NVMEOFCTL_TLS_KEY", path(&pki.client.key)),
    ];
    let started = Instant::now();
    let add = loop {
        let out = nvmeofctl(
            &[
                "-s",
                &server,
                "subsystem",
                "add",
                "--nqn",
                "nqn.2016-06.io.test:tls",
                "--allow-any-host",
            ],
            &good,
        );
        if out.status.code() != Some(3) || started.elapsed() > Duration::from_secs(20) {
            break out;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(
        add.status.code(),
        Some(0),
        "good client through the environment: {}",
        String::from_utf8_lossy(&add.stderr)
    );

    // The same certificate through flags.
    let listed = nvmeofctl(
        &[
            "-s",
            &server,
            "--tls-ca",
            &pki.ca.to_string_lossy(),
            "--tls-cert",
            &path(&pki.client.cert).to_string_lossy(),
            "--tls-key",
            &path(&pki.client.key).to_string_lossy(),
            "-o",
            "json",
            "subsystem",
            "list",
        ],
        &[],
    );
    assert_eq!(listed.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&listed.stdout).contains("nqn.2016-06.io.test:tls"));

    let refused = |name: &str, env: &[(&str, &Path)]| {
        let out = nvmeofctl(&["-s", &server, "subsystem", "list"], env);
        let stderr = String::from_utf8_lossy(&out.stderr).to_string();
        assert_eq!(out.status.code(), Some(4), "{name}: {stderr}");
        assert!(stderr.contains("TLS"), "{name}: unclear message: {stderr}");
        stderr
    };
    let no_cert = refused("no certificate", &[("NVMEOFCTL_TLS_CA", pki.ca.as_path())]);
    eprintln!("no certificate: {no_cert}");
    let stranger = refused(
        "another CA's certificate",
        &[
            ("NVMEOFCTL_TLS_CA", pki.ca.as_path()),
            ("NVMEOFCTL_TLS_CERT", path(&pki.stranger.cert)),
            ("NVMEOFCTL_TLS_KEY", path(&pki.stranger.key)),
        ],
    );
    eprintln!("another CA: {stranger}");
    let untrusted = refused(
        "server not trusted",
        &[
            ("NVMEOFCTL_TLS_CA", pki.other_ca.as_path()),
            ("NVMEOFCTL_TLS_CERT", path(&pki.client.cert)),
            ("NVMEOFCTL_TLS_KEY", path(&pki.client.key)),
        ],
    );
    eprintln!("untrusted server: {untrusted}");
    // Plain gRPC to a TLS server: not served (cannot tell TLS from a dead server: exit 3 or 4).
    let plain = nvmeofctl(&["-s", &server, "subsystem", "list"], &[]);
    assert!(
        matches!(plain.status.code(), Some(3) | Some(4)),
        "plain client: {:?} {}",
        plain.status.code(),
        String::from_utf8_lossy(&plain.stderr)
    );
    // Bad usage: a certificate without its key.
    let usage = nvmeofctl(
        &["-s", &server, "subsystem", "list"],
        &[
            ("NVMEOFCTL_TLS_CA", pki.ca.as_path()),
            ("NVMEOFCTL_TLS_CERT", path(&pki.client.cert)),
        ],
    );
    assert_eq!(usage.status.code(), Some(2));

    // Still serving the good client after all that.
    let again = nvmeofctl(&["-s", &server, "subsystem", "list"], &good);
    assert_eq!(again.status.code(), Some(0));
    drop(daemon);

    // A replica given only part of the TLS options refuses to start (never serves in the clear).
    let partial = Command::new(env!("CARGO_BIN_EXE_nvmeof-control"))
        .args([
            "--store",
            "memory",
            "--listen",
            &format!("127.0.0.1:{}", free_port()),
        ])
        .arg("--tls-cert")
        .arg(path(&pki.server.cert))
        .output()
        .expect("run nvmeof-control");
    assert!(!partial.status.success());
    assert!(String::from_utf8_lossy(&partial.stderr).contains("--tls-key"));
}
