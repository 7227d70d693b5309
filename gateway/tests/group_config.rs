//! Configuration from the control plane: a gateway whose file has no subsystem at all serves
//! what the admin API put in RADOS, picks up a namespace added later (the host sees it after
//! the Namespace Attribute Changed event), a resize, a namespace moved to another gateway's
//! ANA group (and back to optimized here once that gateway is fenced), the group's listeners
//! in its discovery log, and serves it all again after a restart.
//!
//! Needs a cluster, so it is `#[ignore]`d in a plain `cargo test`; run it with
//! `bash rbd-backend/tests/ceph-tests.sh` or by hand:
//!
//! ```sh
//! eval "$(scripts/micro-ceph.sh start)"
//! cargo test -p nvmeof-gateway --test group_config -- --ignored --nocapture
//! ```

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use control_plane::ana::Timing;
use control_plane::proto::{self, admin_client::AdminClient};
use control_plane::server::{self, ControlPlane, Options};
use control_plane::store::{RadosBackend, Store};
use nvmeof_gateway::host::{HostConnection, HostOptions};
use nvmeof_gateway::spec::{ana, log};
use rbd_backend::rbd::CephSettings;

const SUBNQN: &str = "nqn.2016-06.io.test:pushed";
const HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:0f0f0f0f-0000-0000-0000-0000000000f1";

fn ceph_conf() -> String {
    let conf = std::env::var("CEPH_CONF").unwrap_or_default();
    assert!(
        !conf.is_empty() && std::path::Path::new(&conf).is_file(),
        "this test needs a Ceph cluster: CEPH_CONF ({conf:?}) must name its ceph.conf.\n\
         Start one with: eval \"$(scripts/micro-ceph.sh start)\"  (or run rbd-backend/tests/ceph-tests.sh)"
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

/// Admin + one I/O queue, retried until the subsystem is served.
async fn connect(port: u16) -> (HostConnection, HostConnection) {
    let addr = format!("127.0.0.1:{port}");
    let started = Instant::now();
    loop {
        let mut o = HostOptions::new(HOSTNQN);
        o.timeout = Duration::from_secs(60);
        let attempt = async {
            let admin = HostConnection::connect(addr.as_str(), o.clone()).await?;
            let cntlid = admin.connect_admin(SUBNQN, 120_000).await?;
            admin.enable_controller().await?;
            let ctrl = admin.identify_controller().await?;
            let io = HostConnection::connect(addr.as_str(), o).await?;
            io.set_in_capsule_data_max(ctrl.in_capsule_data_max());
            io.connect_io(SUBNQN, cntlid, 1, 31).await?;
            Ok::<_, nvmeof_gateway::host::HostError>((admin, io))
        };
        match attempt.await {
            Ok(h) => return h,
            Err(e) => {
                assert!(
                    started.elapsed() < Duration::from_secs(30),
                    "cannot connect to {SUBNQN} on {addr}: {e}"
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

async fn wait_optimized(admin: &HostConnection, group: u32) {
    let started = Instant::now();
    loop {
        let page = admin
            .get_log_page(log::ANA, 0, 4096, 0)
            .await
            .expect("ANA log");
        let n = u16::from_le_bytes([page[8], page[9]]);
        let mut off = 16usize;
        let mut state = None;
        for _ in 0..n {
            let d = &page[off..];
            let id = u32::from_le_bytes([d[0], d[1], d[2], d[3]]);
            let nnsid = u32::from_le_bytes([d[4], d[5], d[6], d[7]]) as usize;
            if id == group {
                state = Some(d[16]);
            }
            off += 32 + 4 * nnsid;
        }
        if state == Some(ana::OPTIMIZED) {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "group {group}: {state:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The ports the discovery log of the gateway on `port` lists for the subsystem.
async fn discovery_ports(port: u16) -> Vec<String> {
    let d = HostConnection::connect(
        format!("127.0.0.1:{port}").as_str(),
        HostOptions::new(HOSTNQN),
    )
    .await
    .expect("discovery connection");
    d.connect_admin("nqn.2014-08.org.nvmexpress.discovery", 30_000)
        .await
        .expect("discovery connect");
    d.enable_controller().await.expect("enable");
    let log = d.discovery_log().await.expect("discovery log");
    log.entries
        .iter()
        .filter(|e| e.subnqn == SUBNQN)
        .map(|e| e.trsvcid.trim().to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Ceph cluster: bash rbd-backend/tests/ceph-tests.sh"]
async fn a_gateway_serves_what_the_control_plane_stores() {
    ceph_conf();
    let tag = format!("{}-{}", std::process::id(), free_port());
    let images = [format!("pushed-{tag}-1"), format!("pushed-{tag}-2")];
    for i in &images {
        rbd(&["create", "--size", "16M", &format!("{}/{i}", pool())]);
    }
    let dir = std::env::temp_dir().join(format!("pushed-{tag}"));
    std::fs::create_dir_all(&dir).expect("dir");
    let settings = CephSettings {
        conf: Some(PathBuf::from(ceph_conf())),
        keyring: std::env::var("CEPH_KEYRING").ok().map(PathBuf::from),
        max_connections: 1,
        ..CephSettings::default()
    };
    let (p, g) = (pool(), format!("pushed-{tag}"));
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

    // The admin API: a subsystem and namespace 1 (the gateway registers group 1 first).
    let port = free_port();
    let gw = spawn_gateway(&dir, port, &cp_addr);
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
            allow_any_host: true,
            ..Default::default()
        })
        .await
        .expect("subsystem");
    let started = Instant::now();
    loop {
        let r = admin
            .namespace_add(proto::NamespaceAddRequest {
                subsystem_nqn: SUBNQN.into(),
                nsid: 1,
                pool: pool(),
                image: images[0].clone(),
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
    let (h_admin, h_io) = connect(port).await;
    wait_for_namespaces(&h_admin, &[1]).await;
    wait_optimized(&h_admin, 1).await;
    // The gateway reports the host's controller in its beacons.
    let started = Instant::now();
    loop {
        let c = admin
            .connection_list(proto::ConnectionListRequest::default())
            .await
            .expect("connections")
            .into_inner();
        if c.connections
            .iter()
            .any(|c| c.gateway == "gw1" && c.host_nqn == HOSTNQN && c.cntlid >= 1)
        {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "connection not reported: {c:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let data: Vec<u8> = (0..4096u32).map(|i| (i % 251) as u8).collect();
    h_io.write(1, 0, data.clone(), 512)
        .await
        .expect("write ns 1");

    // A namespace added later appears without reconnecting.
    admin
        .namespace_add(proto::NamespaceAddRequest {
            subsystem_nqn: SUBNQN.into(),
            pool: pool(),
            image: images[1].clone(),
            ana_group: 1,
            ..Default::default()
        })
        .await
        .expect("namespace 2");
    wait_for_namespaces(&h_admin, &[1, 2]).await;
    h_io.write(2, 0, data.clone(), 512)
        .await
        .expect("write ns 2");

    // Resize through the admin API: grow only; the host sees the new size.
    let shrink = admin
        .namespace_resize(proto::NamespaceResizeRequest {
            subsystem_nqn: SUBNQN.into(),
            nsid: 2,
            size_bytes: 8 << 20,
        })
        .await;
    assert_eq!(
        shrink.err().map(|s| s.code()),
        Some(tonic::Code::InvalidArgument)
    );
    admin
        .namespace_resize(proto::NamespaceResizeRequest {
            subsystem_nqn: SUBNQN.into(),
            nsid: 2,
            size_bytes: 32 << 20,
        })
        .await
        .expect("grow");
    let started = Instant::now();
    while h_admin
        .identify_namespace(2)
        .await
        .expect("identify")
        .nsze()
        != (32 << 20) / 512
    {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the host never saw the new size"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // A second gateway (a gRPC client beaconing like one) owns group 2; namespace 2 moves
    // there: on gw1 its ANAGRPID becomes 2 and its path inaccessible. When the second
    // gateway goes silent it is fenced and group 2 becomes optimized on gw1.
    let fake_addr = format!("127.0.0.1:0/{}", 800_000 + port as u32);
    let beacons = {
        let mut g = control_plane::proto::gateway_control_client::GatewayControlClient::new(
            tonic::transport::Channel::from_shared(format!("http://{cp_addr}"))
                .expect("url")
                .connect()
                .await
                .expect("control plane"),
        );
        let fake_addr = fake_addr.clone();
        tokio::spawn(async move {
            loop {
                let _ = g
                    .send_beacon(proto::Beacon {
                        gateway: "gw2".into(),
                        ana_group: 2,
                        incarnation: 99,
                        client_addrs: vec![fake_addr.clone()],
                        applied_version: u64::MAX,
                        connections: vec![],
                    })
                    .await;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
    };
    let started = Instant::now();
    loop {
        let r = admin
            .namespace_move(proto::NamespaceMoveRequest {
                subsystem_nqn: SUBNQN.into(),
                nsid: 2,
                ana_group: 2,
            })
            .await;
        match r {
            Ok(reply) => {
                // The control plane ended the move only once gw1 (serving the old group)
                // acknowledged it, its commands in flight done.
                let msg = reply.into_inner().message;
                assert!(msg.contains("drained on gw1"), "{msg}");
                eprintln!("move: {msg}");
                break;
            }
            Err(s)
                if s.code() == tonic::Code::NotFound
                    && started.elapsed() < Duration::from_secs(10) =>
            {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            Err(s) => panic!("move: {s}"),
        }
    }
    let started = Instant::now();
    loop {
        let raw = h_admin.identify_namespace(2).await.expect("identify").raw;
        if u32::from_le_bytes([raw[92], raw[93], raw[94], raw[95]]) == 2 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "ANAGRPID never 2"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        h_io.write(2, 0, data.clone(), 512).await.is_err(),
        "gw1 wrote namespace 2 while its group is on gw2"
    );
    beacons.abort();
    wait_optimized(&h_admin, 2).await;
    h_io.write(2, 0, data.clone(), 512)
        .await
        .expect("write ns 2 after gw2 was fenced");
    let _ = Command::new("ceph")
        .args(["osd", "blocklist", "rm", &fake_addr])
        .output();

    // Listeners registered for the group (this gateway's and another's) are all in this
    // gateway's discovery log.
    for (gw, port) in [("gw1", port), ("gw2", 4999)] {
        admin
            .listener_add(proto::Listener {
                subsystem_nqn: SUBNQN.into(),
                gateway: gw.into(),
                transport: "tcp".into(),
                address: "127.0.0.1".into(),
                port: u32::from(port),
            })
            .await
            .expect("listener");
    }
    let started = Instant::now();
    loop {
        let d = HostConnection::connect(
            format!("127.0.0.1:{port}").as_str(),
            HostOptions::new(HOSTNQN),
        )
        .await
        .expect("discovery connection");
        d.connect_admin("nqn.2014-08.org.nvmexpress.discovery", 30_000)
            .await
            .expect("discovery connect");
        d.enable_controller().await.expect("enable");
        let log = d.discovery_log().await.expect("discovery log");
        let ports: Vec<String> = log
            .entries
            .iter()
            .filter(|e| e.subnqn == SUBNQN)
            .map(|e| e.trsvcid.trim().to_string())
            .collect();
        if ports.contains(&port.to_string()) && ports.contains(&"4999".to_string()) {
            assert_eq!(ports.len(), 2, "{ports:?}");
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "discovery log ports {ports:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // A listener added for this gateway is listened on; deleted, it stops (new connections
    // refused) while the file's listener keeps serving.
    let extra = free_port();
    let extra_listener = proto::Listener {
        subsystem_nqn: SUBNQN.into(),
        gateway: "gw1".into(),
        transport: "tcp".into(),
        address: "127.0.0.1".into(),
        port: u32::from(extra),
    };
    admin
        .listener_add(extra_listener.clone())
        .await
        .expect("listener add");
    let (x_admin, x_io) = connect(extra).await;
    assert_eq!(x_io.read(1, 0, 8, 512).await.expect("read ns 1"), data);
    admin
        .listener_del(extra_listener)
        .await
        .expect("listener del");
    let started = Instant::now();
    while tokio::net::TcpStream::connect(("127.0.0.1", extra))
        .await
        .is_ok()
    {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "still listening on {extra} after listener del"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        x_io.read(1, 0, 8, 512).await.is_err(),
        "a connection through the deleted listener still works"
    );
    drop((x_admin, x_io));
    // Deleted listeners leave the discovery log: this gateway's (just stopped) and another
    // gateway's (gw2's 4999).
    admin
        .listener_del(proto::Listener {
            subsystem_nqn: SUBNQN.into(),
            gateway: "gw2".into(),
            transport: "tcp".into(),
            address: "127.0.0.1".into(),
            port: 4999,
        })
        .await
        .expect("listener del gw2");
    let started = Instant::now();
    loop {
        let ports = discovery_ports(port).await;
        if ports == [port.to_string()] {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "discovery log ports after listener del: {ports:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(
        h_io.read(1, 0, 8, 512)
            .await
            .expect("read via the file's listener"),
        data
    );

    // Restart (SIGTERM: the only gateway has no one to move its groups to, so it stops at
    // once); everything comes back from RADOS.
    drop(h_io);
    drop(h_admin);
    let mut gw = gw;
    let stopping = Instant::now();
    let out = Command::new("kill")
        .args(["-TERM", &gw.0.id().to_string()])
        .output()
        .expect("kill");
    assert!(out.status.success());
    let status = loop {
        if let Some(s) = gw.0.try_wait().expect("wait") {
            break s;
        }
        assert!(
            stopping.elapsed() < Duration::from_secs(5),
            "the lone gateway waited for a move that cannot happen"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(status.success(), "{status}");
    drop(gw);
    let gw = spawn_gateway(&dir, port, &cp_addr);
    let (h_admin, h_io) = connect(port).await;
    wait_for_namespaces(&h_admin, &[1, 2]).await;
    wait_optimized(&h_admin, 1).await;
    // Group 2 stayed with gw1 (gw2 is fenced), as stored in RADOS.
    wait_optimized(&h_admin, 2).await;
    assert_eq!(h_io.read(1, 0, 8, 512).await.expect("read ns 1"), data);
    assert_eq!(h_io.read(2, 0, 8, 512).await.expect("read ns 2"), data);

    drop(h_io);
    drop(h_admin);
    drop(gw);
    for i in &images {
        let _ = Command::new("rbd")
            .args(["rm", "--no-progress", &format!("{}/{i}", pool())])
            .output();
    }
    let _ = std::fs::remove_dir_all(dir);
}
