//! Shared by the integration tests: an in-process gateway on an ephemeral loopback port, and
//! (in the submodules) the fixtures of the tests against a real Ceph cluster.
//!
//! - [`ceph`]: the micro Ceph the environment names, its `rbd`/`ceph` tools.
//! - [`control`]: an in-process `nvmeof-control` replica with its state in RADOS.
//! - [`gateway_process`]: `nvmeof-gateway` processes and their configuration files.
//! - [`host`]: the Rust NVMe/TCP host connected to a subsystem, ANA and namespace checks.
//!
//! Every test binary compiles this module on its own and uses only part of it, hence the
//! `dead_code` allowance (which covers the submodules too).

#![allow(dead_code)]

pub mod ceph;
pub mod control;
pub mod gateway_process;
pub mod host;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nvmeof_gateway::config::Config;
use nvmeof_gateway::core::Target;
use nvmeof_gateway::tcp::server::TcpServer;
use tokio::sync::watch;

/// A running gateway; dropping `shutdown` (or sending `true`) stops it.
pub struct TestGateway {
    pub addr: SocketAddr,
    pub shutdown: watch::Sender<bool>,
    pub server: tokio::task::JoinHandle<()>,
}

/// The configuration of a gateway listening on 127.0.0.1:`port` and serving `subnqn` with one
/// in-memory namespace of `size` to any host.
pub fn memory_gateway_toml(port: u16, subnqn: &str, size: &str) -> String {
    format!(
        r#"
        [[listener]]
        transport = "tcp"
        address = "127.0.0.1"
        port = {port}

        [[subsystem]]
        nqn = "{subnqn}"
        allow_any_host = true

        [[subsystem.namespace]]
        nsid = 1
        backend = "memory"
        size = "{size}"
        "#
    )
}

/// Starts a gateway serving `subnqn` with one in-memory namespace of `size` to any host.
pub async fn start_gateway(subnqn: &str, size: &str) -> TestGateway {
    let config = Config::from_toml_str(&memory_gateway_toml(4420, subnqn, size))
        .expect("valid test configuration");
    serve_target(config.build_target().expect("target")).await
}

/// A target with one subsystem `subnqn`, open to any host, whose namespace 1 (512-byte
/// blocks) is `device`: for tests that need a device of their own (one that stalls, or
/// completes late).
pub fn target_with_device(subnqn: &str, device: Arc<dyn rbd_backend::BlockDevice>) -> Arc<Target> {
    use nvmeof_gateway::core::{
        HostAccess, Namespace, Subsystem, SubsystemKind, SubsystemSpec, TargetIdentity,
    };
    let target = Arc::new(Target::new(TargetIdentity::default()));
    let sub = Arc::new(Subsystem::new(
        SubsystemKind::Nvm,
        SubsystemSpec {
            nqn: subnqn.into(),
            serial: "test".into(),
            model: "test".into(),
            access: HostAccess::AnyHost,
            cntlid_min: 1,
            cntlid_max: 100,
        },
    ));
    sub.add_namespace(Arc::new(Namespace {
        nsid: 1,
        device,
        lba_shift: 9,
        nguid: [3; 16],
        uuid: [4; 16],
        ana_group: 1,
        read_only: false,
        qos: Default::default(),
        frozen_size: Default::default(),
    }));
    target.add_subsystem(sub);
    target
}

/// Serves `target` over NVMe/TCP on an ephemeral loopback port (the configured listeners are
/// not used: tests run concurrently).
pub async fn serve_target(target: Arc<Target>) -> TestGateway {
    serve_target_polling(target, None).await
}

/// [`serve_target`], with its connections busy polling as `busy_poll` says.
pub async fn serve_target_polling(
    target: Arc<Target>,
    busy_poll: Option<nvmeof_gateway::tcp::busy_poll::BusyPollConfig>,
) -> TestGateway {
    let server = TcpServer::bind("127.0.0.1:0".parse().expect("address"), target)
        .await
        .expect("bind an ephemeral port")
        .with_busy_poll(busy_poll);
    let addr = server.local_addr().expect("local address");
    let (shutdown, rx) = watch::channel(false);
    let server = tokio::spawn(server.serve(rx));
    TestGateway {
        addr,
        shutdown,
        server,
    }
}

/// Resident memory of process `pid` in KiB (`VmRSS` in /proc).
pub fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in proc status")
}

/// The value of `series` in a scrape of the metrics endpoint on 127.0.0.1:`port`.
pub fn scrape(port: u16, series: &str) -> Option<f64> {
    let answer = http_exchange(loopback(port), b"GET /metrics HTTP/1.1\r\nHost: gw\r\n\r\n");
    metric_value(&answer, series)
}

/// Sends `request` as is to an HTTP endpoint (the metrics one) and returns the whole answer
/// (the server closes after one).
pub fn http_exchange(addr: SocketAddr, request: &[u8]) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).expect("connect to the metrics endpoint");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    s.write_all(request).expect("send the request");
    let mut answer = String::new();
    s.read_to_string(&mut answer).expect("read the answer");
    answer
}

/// The value of the sample `series` (metric name and labels, as printed) in exposition text.
pub fn metric_value(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

/// The process-wide transport counter `name` (no labels), as the metrics report it.
pub fn transport_counter(name: &str) -> f64 {
    let empty = Target::new(nvmeof_gateway::core::TargetIdentity::default());
    let text = nvmeof_gateway::metrics::render(&empty, "");
    metric_value(&text, name).unwrap_or_else(|| panic!("{name} not in the metrics:\n{text}"))
}

pub use control_plane::test_support::free_port;

/// An in-memory device that completes every op `delay` later, on a thread of its own, as a
/// cluster does (an RBD op completes on a librbd callback thread).
pub struct DelayedDevice {
    inner: rbd_backend::MemoryDevice,
    delay: Duration,
}

impl DelayedDevice {
    pub fn new(inner: rbd_backend::MemoryDevice, delay: Duration) -> Self {
        Self { inner, delay }
    }
}

impl rbd_backend::BlockDevice for DelayedDevice {
    fn name(&self) -> &str {
        "delayed"
    }

    fn size_bytes(&self) -> u64 {
        self.inner.size_bytes()
    }

    fn submit(
        &self,
        tag: u64,
        op: rbd_backend::IoOp,
        completion: &Arc<dyn rbd_backend::IoCompletion>,
    ) {
        struct Later(std::sync::Mutex<Option<rbd_backend::IoDone>>);
        impl rbd_backend::IoCompletion for Later {
            fn complete(&self, done: rbd_backend::IoDone) {
                *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(done);
            }
        }
        let later = Arc::new(Later(std::sync::Mutex::new(None)));
        let sink: Arc<dyn rbd_backend::IoCompletion> = later.clone();
        self.inner.submit(tag, op, &sink);
        let (completion, delay) = (completion.clone(), self.delay);
        std::thread::spawn(move || {
            std::thread::sleep(delay);
            let done = later.0.lock().unwrap_or_else(|e| e.into_inner()).take();
            if let Some(done) = done {
                completion.complete(done);
            }
        });
    }

    fn set_event_sink(&self, sink: Arc<dyn rbd_backend::DeviceEventSink>) {
        self.inner.set_event_sink(sink);
    }
}

/// `127.0.0.1:port`.
pub fn loopback(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// A name part unique to this run and test (the process ID and a free port): tests of several
/// runs may share one cluster, and the tests of one binary run concurrently.
pub fn unique_tag() -> String {
    format!("{}-{}", std::process::id(), free_port())
}

/// A fresh directory `$TMPDIR/<name>` for configuration files and logs.
pub fn scratch_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(name);
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

/// `len` bytes of data that differ for each `seed` and from zeroes.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[2] ^ seed)
        .collect()
}

/// Calls `probe` every `every` until it returns `Ok`, and returns that value; once `within`
/// has passed since the first call, panics with the last `Err` (which says what was awaited
/// and what was seen instead).
pub async fn poll_until<T>(
    within: Duration,
    every: Duration,
    mut probe: impl AsyncFnMut() -> Result<T, String>,
) -> T {
    let started = Instant::now();
    loop {
        match probe().await {
            Ok(value) => return value,
            Err(what) => {
                assert!(started.elapsed() < within, "{what}");
                tokio::time::sleep(every).await;
            }
        }
    }
}
