//! Removals made in the control plane reach a running gateway: `namespace del` (the host gets
//! Namespace Attribute Changed, the Changed Namespace List names the NSID, the namespace is
//! gone), `host del` (that host's controller is closed and its new Connects are refused with
//! Connect Invalid Host) and `subsystem del` (its controllers closed, gone from the discovery
//! log, Connects refused). Requests go through the admin gRPC API, as `nvmeofctl` sends them.
//!
//! Needs a cluster, so it is `#[ignore]`d in a plain `cargo test`; run it by hand:
//!
//! ```sh
//! eval "$(scripts/micro-ceph.sh start)"
//! cargo test -p nvmeof-gateway --test group_removals -- --ignored --nocapture
//! ```

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use control_plane::ana::Timing;
use control_plane::proto::{self, admin_client::AdminClient};
use control_plane::server::{self, ControlPlane, Options};
use control_plane::store::{RadosBackend, Store};
use nvmeof_gateway::host::{HostConnection, HostError, HostOptions, Sqe, Xfer};
use nvmeof_gateway::spec::{admin_opcode, aer, feat, log, sc, DISCOVERY_NQN};
use rbd_backend::rbd::CephSettings;

const SUBNQN: &str = "nqn.2016-06.io.test:removals";
const HOST_A: &str = "nqn.2014-08.org.nvmexpress:uuid:0f0f0f0f-0000-0000-0000-0000000000a1";
const HOST_B: &str = "nqn.2014-08.org.nvmexpress:uuid:0f0f0f0f-0000-0000-0000-0000000000b2";

fn ceph_conf() -> String {
    let conf = std::env::var("CEPH_CONF").unwrap_or_default();
    assert!(
        !conf.is_empty() && std::path::Path::new(&conf).is_file(),
        "this test needs a Ceph cluster: CEPH_CONF ({conf:?}) must name its ceph.conf.\n\
         Start one with: eval \"$(scripts/micro-ceph.sh start)\""
    );
    conf
}

fn pool() -> String {
    std::env::var("MICRO_CEPH_POOL").unwrap_or_else(|_| "rbd".into())
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

fn rbd(args: &[&str]) {
    let out = Command::new("rbd").args(args).output().expect("rbd");
    assert!(
        out.status.success(),
        "rbd {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Watchers on an image (an open librbd image holds one).
fn watchers(image: &str) -> usize {
    let out = Command::new("rbd")
        .args(["status", "--format", "json", &format!("{}/{image}", pool())])
        .output()
        .expect("rbd status");
    assert!(out.status.success(), "rbd status {image}");
    let text = String::from_utf8_lossy(&out.stdout);
    text.matches("\"address\"").count()
}

struct Gateway(Child);

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn_gateway(dir: &std::path::Path, port: u16, cp: &str) -> Gateway {
    let config = format!(
        r#"
[gateway]
name = "gw1"
worker_threads = 1

[group]
control_plane = ["{cp}"]
ana_group = 1
beacon_interval_ms = 250

[[listener]]
transport = "tcp"
address = "127.0.0.1"
port = {port}

[ceph]
conf = "{conf}"
connections = 1
"#,
        conf = ceph_conf(),
    );
    let path = dir.join("gw1.toml");
    std::fs::write(&path, config).expect("config");
    let log = std::fs::File::create(dir.join("gw1.log")).expect("log");
    Gateway(
        Command::new(env!("CARGO_BIN_EXE_nvmeof-gateway"))
            .arg("--config")
            .arg(&path)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start nvmeof-gateway"),
    )
}

/// An admin queue of `host` on the subsystem, enabled (one attempt).
async fn try_admin(port: u16, host: &str) -> Result<HostConnection, HostError> {
    let mut o = HostOptions::new(host);
    o.timeout = Duration::from_secs(30);
    let admin = HostConnection::connect(format!("127.0.0.1:{port}").as_str(), o).await?;
    admin.connect_admin(SUBNQN, 120_000).await?;
    admin.enable_controller().await?;
    Ok(admin)
}

async fn admin_queue(port: u16, host: &str) -> HostConnection {
    let started = Instant::now();
    loop {
        match try_admin(port, host).await {
            Ok(a) => return a,
            Err(e) => {
                assert!(
                    started.elapsed() < Duration::from_secs(30),
                    "{host} cannot connect to {SUBNQN}: {e}"
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}

async fn wait_for_namespaces(admin: &HostConnection, want: &[u32]) {
    let started = Instant::now();
    loop {
        let got = admin.active_namespaces(0).await.expect("namespace list");
        if got == want {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "active namespaces {got:?}, expected {want:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Status (SCT and SC, as `spec::sc` spells them) of a refused Connect (panics if it was accepted or failed otherwise).
async fn refused_connect(port: u16, host: &str) -> u16 {
    let c = HostConnection::connect(format!("127.0.0.1:{port}").as_str(), HostOptions::new(host))
        .await
        .expect("TCP connection");
    match c.connect_admin(SUBNQN, 120_000).await {
        Err(HostError::Nvme(cqe)) => (u16::from(cqe.sct()) << 8) | u16::from(cqe.sc()),
        other => panic!("{host}: connect not refused with a status: {other:?}"),
    }
}

/// The subsystems the discovery log lists for `host`.
async fn discovery_subsystems(port: u16, host: &str) -> Vec<String> {
    let d = HostConnection::connect(format!("127.0.0.1:{port}").as_str(), HostOptions::new(host))
        .await
        .expect("discovery connection");
    d.connect_admin(DISCOVERY_NQN, 30_000)
        .await
        .expect("discovery connect");
    d.enable_controller().await.expect("enable");
    d.discovery_log()
        .await
        .expect("discovery log")
        .entries
        .into_iter()
        .map(|e| e.subnqn)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Ceph cluster: eval \"$(scripts/micro-ceph.sh start)\""]
async fn removals_in_the_control_plane_reach_a_running_gateway() {
    ceph_conf();
    let tag = format!("{}-{}", std::process::id(), free_port());
    let images = [format!("removals-{tag}-1"), format!("removals-{tag}-2")];
    for i in &images {
        rbd(&["create", "--size", "16M", &format!("{}/{i}", pool())]);
    }
    let dir = std::env::temp_dir().join(format!("removals-{tag}"));
    std::fs::create_dir_all(&dir).expect("dir");
    let settings = CephSettings {
        conf: Some(PathBuf::from(ceph_conf())),
        keyring: std::env::var("CEPH_KEYRING").ok().map(PathBuf::from),
        max_connections: 1,
        ..CephSettings::default()
    };
    let (p, g) = (pool(), format!("removals-{tag}"));
    let backend = tokio::task::spawn_blocking(move || RadosBackend::connect(&settings, &p, &g))
        .await
        .expect("join")
        .expect("state");
    let cp = ControlPlane::start(
        Store::new(Arc::new(backend)),
        "replica".into(),
        Options {
            timing: Timing {
                grace_ms: 1500,
                failback_delay_ms: 200,
            },
            lease: Duration::from_secs(3),
            tick: Duration::from_millis(100),
        },
    )
    .await
    .expect("control plane");
    tokio::spawn(cp.clone().run());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let cp_addr = listener.local_addr().expect("addr").to_string();
    tokio::spawn(server::serve(cp, listener, std::future::pending::<()>()));

    let port = free_port();
    let _gw = spawn_gateway(&dir, port, &cp_addr);
    let mut admin = AdminClient::new(
        tonic::transport::Channel::from_shared(format!("http://{cp_addr}"))
            .expect("url")
            .connect()
            .await
            .expect("control plane"),
    );
    admin
        .subsystem_add(proto::SubsystemAddRequest {
            nqn: SUBNQN.into(),
            allow_any_host: false,
            ..Default::default()
        })
        .await
        .expect("subsystem");
    for host in [HOST_A, HOST_B] {
        admin
            .host_add(proto::Host {
                subsystem_nqn: SUBNQN.into(),
                host_nqn: host.into(),
            })
            .await
            .expect("host add");
    }
    for (nsid, image) in [(1u32, &images[0]), (2, &images[1])] {
        let started = Instant::now();
        loop {
            let r = admin
                .namespace_add(proto::NamespaceAddRequest {
                    subsystem_nqn: SUBNQN.into(),
                    nsid,
                    pool: pool(),
                    image: image.clone(),
                    ana_group: 1,
                    ..Default::default()
                })
                .await;
            match r {
                Ok(_) => break,
                // Group 1 exists once gw1 has beaconed.
                Err(s)
                    if s.code() == tonic::Code::NotFound
                        && started.elapsed() < Duration::from_secs(20) =>
                {
                    tokio::time::sleep(Duration::from_millis(200)).await
                }
                Err(s) => panic!("namespace add: {s}"),
            }
        }
    }

    // Host A with Namespace Attribute Notices enabled and an AER outstanding.
    let a = admin_queue(port, HOST_A).await;
    wait_for_namespaces(&a, &[1, 2]).await;
    // Whatever notices the adds raised are consumed first (read with RAE = 0).
    let _ = a.get_log_page(log::CHANGED_NS, 0, 4096, 0).await;
    let mut set = Sqe::new(admin_opcode::SET_FEATURES);
    set.set_cdw(10, u32::from(feat::ASYNC_EVENT))
        .set_cdw(11, aer::CFG_NS_ATTR);
    a.submit_ok(set, Xfer::None)
        .await
        .expect("async event config");
    let aer_cmd = a
        .start(Sqe::new(admin_opcode::ASYNC_EVENT), Xfer::None)
        .await
        .expect("AER");

    // namespace del: the event, the changed list, the namespace gone; NSID 1 unaffected.
    let deleted = Instant::now();
    admin
        .namespace_del(proto::NamespaceDelRequest {
            subsystem_nqn: SUBNQN.into(),
            nsid: 2,
        })
        .await
        .expect("namespace del");
    let event = aer_cmd.wait().await.expect("AER completed");
    eprintln!(
        "AER {:#08x} {} ms after namespace del",
        event.cqe.dw0(),
        deleted.elapsed().as_millis()
    );
    assert!(event.cqe.is_success());
    assert_eq!(
        event.cqe.dw0(),
        u32::from(aer::TYPE_NOTICE)
            | (u32::from(aer::NOTICE_NS_CHANGED) << 8)
            | (u32::from(log::CHANGED_NS) << 16)
    );
    let list = a
        .get_log_page(log::CHANGED_NS, 0, 4096, 0)
        .await
        .expect("changed namespace list");
    let first = u32::from_le_bytes([list[0], list[1], list[2], list[3]]);
    assert_eq!(first, 2, "the changed list names NSID 2");
    assert_eq!(a.active_namespaces(0).await.expect("list"), vec![1]);
    let io = {
        let o = HostOptions::new(HOST_A);
        let io = HostConnection::connect(format!("127.0.0.1:{port}").as_str(), o)
            .await
            .expect("io connection");
        let cntlid = a.identify_controller().await.expect("identify").cntlid();
        io.connect_io(SUBNQN, cntlid, 1, 31)
            .await
            .expect("io queue");
        io
    };
    assert!(io.read(2, 0, 8, 512).await.is_err(), "NSID 2 still reads");
    // Its image was closed: no watcher left on it (NSID 1's image keeps one).
    assert!(watchers(&images[0]) > 0, "the check sees an open image");
    let started = Instant::now();
    while watchers(&images[1]) > 0 {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the deleted namespace's image is still open"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    io.read(1, 0, 8, 512).await.expect("NSID 1 reads");

    // host del: A's controller is closed, A cannot come back, B can connect.
    let b = admin_queue(port, HOST_B).await;
    admin
        .host_del(proto::Host {
            subsystem_nqn: SUBNQN.into(),
            host_nqn: HOST_A.into(),
        })
        .await
        .expect("host del");
    assert!(
        a.wait_closed(Duration::from_secs(10)).await,
        "the removed host's admin queue stayed open"
    );
    assert!(
        io.wait_closed(Duration::from_secs(10)).await,
        "its I/O queue stayed open"
    );
    assert_eq!(
        refused_connect(port, HOST_A).await,
        sc::CONNECT_INVALID_HOST
    );
    assert_eq!(
        b.active_namespaces(0).await.expect("B still served"),
        vec![1]
    );

    // subsystem del: B's controller closed, gone from the discovery log, Connects refused.
    assert!(discovery_subsystems(port, HOST_B)
        .await
        .iter()
        .any(|n| n == SUBNQN));
    assert!(
        !discovery_subsystems(port, HOST_A)
            .await
            .iter()
            .any(|n| n == SUBNQN),
        "listed for the removed host"
    );
    admin
        .subsystem_del(proto::SubsystemDelRequest {
            nqn: SUBNQN.into(),
            force: true,
        })
        .await
        .expect("subsystem del");
    assert!(
        b.wait_closed(Duration::from_secs(10)).await,
        "a controller of the deleted subsystem stayed open"
    );
    assert!(!discovery_subsystems(port, HOST_B)
        .await
        .iter()
        .any(|n| n == SUBNQN));
    assert_eq!(
        refused_connect(port, HOST_B).await,
        sc::CONNECT_INVALID_PARAM
    );

    for i in &images {
        let _ = Command::new("rbd")
            .args(["rm", "--no-progress", &format!("{}/{i}", pool())])
            .output();
    }
    let _ = std::fs::remove_dir_all(dir);
}
