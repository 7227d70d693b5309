//! Fixtures for the tests of this crate and of the gateway: certificates made on the fly with
//! rcgen (the mTLS tests, `tests/tls.rs` and `gateway/tests/group_tls.rs`), control-plane
//! replicas run inside the test and served on a loopback port (in plain text or mTLS), and
//! the Ceph cluster of the tests that need one.
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

use rbd_backend::rbd::CephSettings;
use tonic::transport::Channel;

use crate::ana::AnaState;
use crate::proto::admin_client::AdminClient;
use crate::proto::{Assignment, SubsystemAddRequest};
use crate::server::{self, ControlPlane, Options};
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

/// A state backend in memory in which the RBD images `images` (`pool/image`) exist.
pub fn memory_backend_with_images(images: impl IntoIterator<Item = String>) -> Arc<MemoryBackend> {
    let backend = Arc::new(MemoryBackend::default());
    backend.images.lock().expect("images").extend(images);
    backend
}

/// Starts a control plane replica (`replica` is its ID) keeping its state in `store`; it runs
/// until the test's runtime ends.
pub async fn start_replica(store: Store, replica: &str, options: Options) -> Arc<ControlPlane> {
    let cp = ControlPlane::start(store, replica.into(), options)
        .await
        .expect("control plane");
    tokio::spawn(cp.clone().run());
    cp
}

/// Waits until `cp` holds the lease (before that, it refuses beacons: its first renewal,
/// spawned by [`start_replica`], may not have run yet on a busy machine); panics after `within`.
pub async fn wait_for_lease(cp: &ControlPlane, within: Duration) {
    let started = Instant::now();
    while !cp.is_leader() {
        assert!(
            started.elapsed() < within,
            "the replica never took the lease"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A listener on an ephemeral loopback port, and its `address:port`.
async fn loopback_listener() -> (tokio::net::TcpListener, String) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    (listener, addr)
}

/// Serves `cp`'s gRPC API in plain text on an ephemeral loopback port until the test's
/// runtime ends; returns `address:port`.
pub async fn serve_plain(cp: Arc<ControlPlane>) -> String {
    let (listener, addr) = loopback_listener().await;
    tokio::spawn(server::serve(cp, listener, std::future::pending::<()>()));
    addr
}

/// A plain-text gRPC channel to the replica at `addr` (served by [`serve_plain`]).
pub async fn plain_channel(addr: &str) -> Channel {
    Channel::from_shared(format!("http://{addr}"))
        .expect("url")
        .connect_timeout(Duration::from_secs(3))
        .connect()
        .await
        .expect("connect to the control plane")
}

/// Reads `stream`'s assignments, from `last` on, until one makes `group` optimized, and
/// returns it; panics ("no failover") when none has within `within`.
pub async fn until_optimized(
    stream: &mut tonic::Streaming<Assignment>,
    mut last: Assignment,
    group: u32,
    within: Duration,
) -> Assignment {
    let started = Instant::now();
    while ana_state_of(&last, group) != Some(AnaState::Optimized) {
        assert!(started.elapsed() < within, "no failover");
        last = tokio::time::timeout(within, stream.message())
            .await
            .expect("in time")
            .expect("stream")
            .expect("assignment");
    }
    last
}

/// Adds the subsystem `nqn`, open to any host; panics if the control plane refuses it.
pub async fn add_subsystem_open_to_any_host(admin: &mut AdminClient<Channel>, nqn: &str) {
    admin
        .subsystem_add(SubsystemAddRequest {
            nqn: nqn.into(),
            allow_any_host: true,
            ..Default::default()
        })
        .await
        .expect("subsystem add");
}

/// The ANA state of `group` in an assignment, if it has one.
pub fn ana_state_of(assignment: &Assignment, group: u32) -> Option<AnaState> {
    assignment
        .ana_states
        .iter()
        .find(|g| g.ana_group == group)
        .and_then(|g| u8::try_from(g.state).ok())
        .and_then(AnaState::from_code)
}

/// Starts a control plane replica (`replica` is its ID) with its state in memory, serving
/// mTLS with `files` on an ephemeral loopback port; returns `address:port` once the replica
/// leads (before that, beacons are refused). Runs until the test's runtime ends.
pub async fn serve_in_memory_over_tls(files: &TlsFiles, replica: &str) -> String {
    let store = Store::new(Arc::new(MemoryBackend::default()));
    let cp = start_replica(store, replica, Options::default()).await;
    wait_for_lease(&cp, Duration::from_secs(10)).await;
    let (listener, addr) = loopback_listener().await;
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

/// The Ceph cluster's ceph.conf (`$CEPH_CONF`); panics, saying how to start one, when there
/// is none: run without a cluster, a Ceph test fails rather than passes without having run.
pub fn ceph_conf() -> String {
    let conf = std::env::var("CEPH_CONF").unwrap_or_default();
    assert!(
        !conf.is_empty() && Path::new(&conf).is_file(),
        "this test needs a Ceph cluster: CEPH_CONF ({conf:?}) must name its ceph.conf.\n\
         Start one with: eval \"$(scripts/micro-ceph.sh start)\"  (or run rbd-backend/tests/ceph-tests.sh)"
    );
    conf
}

/// The pool of the tests' objects and images (`$MICRO_CEPH_POOL`, default `rbd`).
pub fn ceph_pool() -> String {
    std::env::var("MICRO_CEPH_POOL").unwrap_or_else(|_| "rbd".into())
}

/// How the test's own librados clients reach the cluster (`$CEPH_CONF`, `$CEPH_KEYRING`):
/// one connection is enough for them.
pub fn ceph_settings() -> CephSettings {
    CephSettings {
        conf: Some(PathBuf::from(ceph_conf())),
        keyring: std::env::var("CEPH_KEYRING").ok().map(PathBuf::from),
        max_connections: 1,
        ..CephSettings::default()
    }
}

/// A loopback TCP port free at the time of the call, for a listener a test process starts
/// later (a gateway's or a replica's). The kernel may hand out a port again once the probing
/// listener is dropped, so two calls in a row could return the same one (seen: a gateway's
/// NVMe/TCP and metrics ports equal, its configuration refused): never the same port twice
/// in one process.
pub fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<std::collections::BTreeSet<u16>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());
    loop {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free port");
        if GIVEN.lock().unwrap_or_else(|e| e.into_inner()).insert(port) {
            return port;
        }
    }
}

/// `GET path` on the HTTP endpoint at `addr` (a metrics port): the status code and body, or
/// None when nothing answers (not listening, or closed without an answer). Blocking, with a
/// 5 s timeout.
pub fn http_get(addr: &str, path: &str) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    stream
        .write_all(format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\n\r\n").as_bytes())
        .ok()?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer).ok()?;
    let status = answer.split(' ').nth(1)?.parse().ok()?;
    let body = answer.split_once("\r\n\r\n")?.1.to_string();
    Some((status, body))
}
