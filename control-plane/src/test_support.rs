//! Fixtures for the mTLS tests of this crate (`tests/tls.rs`) and of the gateway
//! (`gateway/tests/group_tls.rs`): certificates made on the fly with rcgen, and an in-memory
//! control plane served over mTLS.
//!
//! Compiled only with the `test-support` feature, which the two crates enable through their
//! dev-dependencies: rcgen never reaches the release binaries. Being test code, these helpers
//! panic (with what failed) instead of returning errors.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};

use crate::server::{ControlPlane, Options};
use crate::store::{MemoryBackend, Store};
use crate::tls::{self, TlsFiles};

/// What a leaf certificate may be used for (its extended key usage).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CertUse {
    /// A server (`nvmeof-control`) presenting itself to clients.
    Server,
    /// A client (`nvmeofctl`, a gateway's agent) presenting itself to the server.
    Client,
}

/// A certificate authority able to sign leaf certificates.
pub struct TestCa {
    cert: rcgen::Certificate,
    key: KeyPair,
}

impl TestCa {
    /// A self-signed CA whose subject is `common_name`.
    pub fn new(common_name: &str) -> TestCa {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, common_name);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let key = KeyPair::generate().expect("CA key");
        let cert = params.self_signed(&key).expect("CA certificate");
        TestCa { cert, key }
    }

    /// Writes the CA certificate (PEM) to `path`, for the parties that trust this CA.
    pub fn write_certificate(&self, path: &Path) {
        std::fs::write(path, self.cert.pem()).expect("write CA certificate");
    }

    /// Writes `<name>.crt` and `<name>.key` into `dir`: a certificate for `sans` (DNS names
    /// or IP addresses) signed by this CA. Returns their paths (certificate, key).
    pub fn issue(
        &self,
        dir: &Path,
        name: &str,
        sans: &[&str],
        usage: CertUse,
    ) -> (PathBuf, PathBuf) {
        let mut params =
            CertificateParams::new(sans.iter().map(|s| s.to_string()).collect::<Vec<_>>())
                .expect("leaf params");
        params.distinguished_name.push(DnType::CommonName, name);
        params.extended_key_usages = vec![match usage {
            CertUse::Server => ExtendedKeyUsagePurpose::ServerAuth,
            CertUse::Client => ExtendedKeyUsagePurpose::ClientAuth,
        }];
        let key = KeyPair::generate().expect("leaf key");
        let cert = params
            .signed_by(&key, &self.cert, &self.key)
            .expect("leaf certificate");
        let (crt_path, key_path) = (
            dir.join(format!("{name}.crt")),
            dir.join(format!("{name}.key")),
        );
        std::fs::write(&crt_path, cert.pem()).expect("write certificate");
        std::fs::write(&key_path, key.serialize_pem()).expect("write key");
        (crt_path, key_path)
    }
}

/// The certificates of one test, in a directory of its own (removed when dropped): a CA, the
/// server's and a client's certificates signed by it, and a client certificate signed by
/// another CA.
pub struct TestPki {
    /// Where the files are.
    pub dir: PathBuf,
    /// The CA certificate every party trusts.
    pub ca: PathBuf,
    /// Another CA's certificate (trusting it instead, a client does not trust the server).
    pub other_ca: PathBuf,
    /// The server's files: its certificate (for `localhost` and `127.0.0.1`), key, the CA.
    pub server: TlsFiles,
    /// A client signed by the CA, trusting the CA.
    pub client: TlsFiles,
    /// A client signed by the other CA but trusting the right one: only the server can
    /// refuse it.
    pub stranger: TlsFiles,
}

impl TestPki {
    /// Makes the certificates in `$TMPDIR/<name>-<pid>`. Tests run concurrently: each gives
    /// its own `name`.
    pub fn create(name: &str) -> TestPki {
        let dir = std::env::temp_dir().join(format!("{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("certificate directory");
        let ca = TestCa::new("nvmeof test CA");
        let other = TestCa::new("some other CA");
        let ca_path = dir.join("ca.crt");
        let other_path = dir.join("other-ca.crt");
        ca.write_certificate(&ca_path);
        other.write_certificate(&other_path);
        let (server_crt, server_key) = ca.issue(
            &dir,
            "control",
            &["localhost", "127.0.0.1"],
            CertUse::Server,
        );
        let (client_crt, client_key) = ca.issue(&dir, "client", &[], CertUse::Client);
        let (stranger_crt, stranger_key) = other.issue(&dir, "stranger", &[], CertUse::Client);
        let trusting_ca = |cert: PathBuf, key: PathBuf| TlsFiles {
            ca: Some(ca_path.clone()),
            cert: Some(cert),
            key: Some(key),
        };
        TestPki {
            server: trusting_ca(server_crt, server_key),
            client: trusting_ca(client_crt, client_key),
            stranger: trusting_ca(stranger_crt, stranger_key),
            ca: ca_path,
            other_ca: other_path,
            dir,
        }
    }
}

impl Drop for TestPki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Starts a control plane replica (`replica` is its ID) with its state in memory, serving
/// mTLS with `files` on an ephemeral loopback port; returns `address:port` once the replica
/// leads (before that, beacons are refused). Runs until the test's runtime ends.
pub async fn serve_in_memory_over_tls(files: &TlsFiles, replica: &str) -> String {
    let cp = ControlPlane::start(
        Store::new(Arc::new(MemoryBackend::default())),
        replica.into(),
        Options::default(),
    )
    .await
    .expect("control plane");
    tokio::spawn(cp.clone().run());
    let started = Instant::now();
    while !cp.is_leader() {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the replica never took the lease"
        );
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
