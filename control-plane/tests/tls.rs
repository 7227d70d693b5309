//! mTLS between clients and `nvmeof-control`, with certificates made here (a CA, the
//! server's, a client's, and a client's from another CA): a client with a certificate signed
//! by the CA is served; no certificate, another CA's certificate, no TLS at all, or a server
//! certificate the client does not trust are refused, and the server goes on serving. Then
//! the same through the real binaries: `nvmeof-control --tls-*` and `nvmeofctl` with flags and
//! environment variables, and its exit codes.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use control_plane::proto::gateway_control_client::GatewayControlClient;
use control_plane::proto::{self, admin_client::AdminClient};
use control_plane::server::{ControlPlane, Options};
use control_plane::store::{MemoryBackend, Store};
use control_plane::tls::{self, TlsFiles};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};

/// A CA able to sign leaf certificates.
struct Ca {
    cert: rcgen::Certificate,
    key: KeyPair,
}

fn new_ca(name: &str) -> Ca {
    let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let key = KeyPair::generate().expect("CA key");
    let cert = params.self_signed(&key).expect("CA certificate");
    Ca { cert, key }
}

/// Writes `<name>.crt` and `<name>.key` signed by `ca` into `dir`.
fn leaf(
    dir: &Path,
    ca: &Ca,
    name: &str,
    sans: &[&str],
    usage: ExtendedKeyUsagePurpose,
) -> (PathBuf, PathBuf) {
    let mut params = CertificateParams::new(sans.iter().map(|s| s.to_string()).collect::<Vec<_>>())
        .expect("leaf params");
    params.distinguished_name.push(DnType::CommonName, name);
    params.extended_key_usages = vec![usage];
    let key = KeyPair::generate().expect("leaf key");
    let cert = params
        .signed_by(&key, &ca.cert, &ca.key)
        .expect("leaf certificate");
    let (crt_path, key_path) = (
        dir.join(format!("{name}.crt")),
        dir.join(format!("{name}.key")),
    );
    std::fs::write(&crt_path, cert.pem()).expect("write certificate");
    std::fs::write(&key_path, key.serialize_pem()).expect("write key");
    (crt_path, key_path)
}

struct Pki {
    dir: PathBuf,
    ca: PathBuf,
    other_ca: PathBuf,
    server: TlsFiles,
    client: TlsFiles,
    /// Signed by another CA (trusts the right CA, so only the server can refuse it).
    stranger: TlsFiles,
    /// Trusts only the other CA: the server's certificate is not trusted.
    wrong_trust: TlsFiles,
    no_cert: TlsFiles,
}

fn pki(tag: &str) -> Pki {
    let dir = std::env::temp_dir().join(format!("cp-tls-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    let ca = new_ca("nvmeof test CA");
    let other = new_ca("some other CA");
    let ca_path = dir.join("ca.crt");
    let other_path = dir.join("other-ca.crt");
    std::fs::write(&ca_path, ca.cert.pem()).expect("write CA");
    std::fs::write(&other_path, other.cert.pem()).expect("write other CA");
    let (scrt, skey) = leaf(
        &dir,
        &ca,
        "control",
        &["localhost", "127.0.0.1"],
        ExtendedKeyUsagePurpose::ServerAuth,
    );
    let (ccrt, ckey) = leaf(&dir, &ca, "admin", &[], ExtendedKeyUsagePurpose::ClientAuth);
    let (xcrt, xkey) = leaf(
        &dir,
        &other,
        "stranger",
        &[],
        ExtendedKeyUsagePurpose::ClientAuth,
    );
    let files = |ca: &Path, cert: Option<&Path>, key: Option<&Path>| TlsFiles {
        ca: Some(ca.to_path_buf()),
        cert: cert.map(Path::to_path_buf),
        key: key.map(Path::to_path_buf),
    };
    Pki {
        server: files(&ca_path, Some(&scrt), Some(&skey)),
        client: files(&ca_path, Some(&ccrt), Some(&ckey)),
        stranger: files(&ca_path, Some(&xcrt), Some(&xkey)),
        wrong_trust: files(&other_path, Some(&ccrt), Some(&ckey)),
        no_cert: files(&ca_path, None, None),
        ca: ca_path,
        other_ca: other_path,
        dir,
    }
}

async fn start_server(files: &TlsFiles) -> String {
    let cp = ControlPlane::start(
        Store::new(Arc::new(MemoryBackend::default())),
        "tls-test".into(),
        Options::default(),
    )
    .await
    .expect("control plane");
    tokio::spawn(cp.clone().run());
    // Beacons are refused until this replica holds the lease.
    let started = std::time::Instant::now();
    while !cp.is_leader() {
        assert!(started.elapsed() < Duration::from_secs(10), "never led");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    let config = tls::server_tls_config(files)
        .expect("server TLS")
        .expect("TLS on");
    tokio::spawn(tls::serve(
        cp,
        listener,
        Some(config),
        std::future::pending::<()>(),
    ));
    addr
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
    let pki = pki("api");
    let addr = start_server(&pki.server).await;

    assert_eq!(list_subsystems(&addr, &pki.client).await, Ok(0));

    let no_cert = list_subsystems(&addr, &pki.no_cert).await;
    assert!(no_cert.is_err(), "a client without certificate was served");
    let stranger = list_subsystems(&addr, &pki.stranger).await;
    assert!(stranger.is_err(), "another CA's certificate was accepted");
    let plain = list_subsystems(&addr, &TlsFiles::default()).await;
    assert!(plain.is_err(), "a plain-text client was served");
    let untrusted = list_subsystems(&addr, &pki.wrong_trust)
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
    assert!(beacon(&addr, &pki.no_cert).await.is_err());
    assert!(beacon(&addr, &pki.stranger).await.is_err());

    // The refused handshakes did not stop the server.
    assert_eq!(list_subsystems(&addr, &pki.client).await, Ok(0));
    let _ = std::fs::remove_dir_all(&pki.dir);
}

#[test]
fn incomplete_or_contradictory_options_are_refused() {
    let pki = pki("options");
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
    let _ = std::fs::remove_dir_all(&pki.dir);
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
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
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_nvmeofctl"));
    cmd.args(args)
        .env_remove("NVMEOFCTL_TLS_CA")
        .env_remove("NVMEOFCTL_TLS_CERT")
        .env_remove("NVMEOFCTL_TLS_KEY")
        .env_remove("NVMEOFCTL_SERVER");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("run nvmeofctl")
}

#[test]
fn the_binaries_with_tls_options() {
    let pki = pki("bins");
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
    let _ = std::fs::remove_dir_all(&pki.dir);
}
