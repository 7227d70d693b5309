//! Two `nvmeof-control` processes on one group state in RADOS: kill -9 the leader, the other
//! takes over the lease, and a gateway failover after that is still fenced and pushed.
//! The gateways are gRPC clients that beacon like `nvmeof-gateway` does (the real gateways'
//! failover is in gateway/tests/failover.rs).
//!
//! Compiled only with `--features ceph-tests` (then a missing cluster fails the test):
//!
//! ```sh
//! eval "$(scripts/micro-ceph.sh start)"
//! cargo test -p control-plane --features ceph-tests --test replicas -- --nocapture
//! ```
#![cfg(feature = "ceph-tests")]

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use control_plane::ana::AnaState;
use control_plane::proto::admin_client::AdminClient;
use control_plane::proto::gateway_control_client::GatewayControlClient;
use control_plane::proto::{self, Assignment};
use tonic::transport::Channel;

fn ceph_conf() -> String {
    let conf = std::env::var("CEPH_CONF").unwrap_or_default();
    assert!(
        !conf.is_empty() && std::path::Path::new(&conf).is_file(),
        "this test needs a Ceph cluster: CEPH_CONF ({conf:?}) must name its ceph.conf.\n\
         Start one with: eval \"$(scripts/micro-ceph.sh start)\"  (or run rbd-backend/tests/ceph-tests.sh)"
    );
    conf
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

struct Replica {
    child: Child,
    addr: String,
}

impl Drop for Replica {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn replica(group: &str) -> Replica {
    let addr = format!("127.0.0.1:{}", free_port());
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_nvmeof-control"));
    cmd.args([
        "--listen",
        &addr,
        "--group",
        group,
        "--grace-ms",
        "1500",
        "--lease-ms",
        "3000",
        "--ceph-conf",
        &ceph_conf(),
    ]);
    if let Ok(k) = std::env::var("CEPH_KEYRING") {
        cmd.args(["--keyring", &k]);
    }
    if let Ok(p) = std::env::var("MICRO_CEPH_POOL") {
        cmd.args(["--pool", &p]);
    }
    let child = cmd
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start nvmeof-control");
    Replica { child, addr }
}

async fn channel(addr: &str) -> Channel {
    let started = Instant::now();
    loop {
        match Channel::from_shared(format!("http://{addr}"))
            .expect("url")
            .connect()
            .await
        {
            Ok(c) => return c,
            Err(e) => {
                assert!(
                    started.elapsed() < Duration::from_secs(20),
                    "{addr} never answered: {e}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

async fn leader(addr: &str) -> bool {
    let mut a = AdminClient::new(channel(addr).await);
    a.gateway_list(proto::Empty {})
        .await
        .map(|r| !r.into_inner().leader.is_empty())
        .unwrap_or(false)
}

/// Beacons `gw` to every replica every 200 ms until aborted.
fn beacons(gw: &'static str, group: u32, addrs: Vec<String>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut clients = Vec::new();
        for a in &addrs {
            clients.push(GatewayControlClient::new(channel(a).await));
        }
        loop {
            for c in clients.iter_mut() {
                let _ = c
                    .send_beacon(proto::Beacon {
                        gateway: gw.into(),
                        ana_group: group,
                        incarnation: 7,
                        client_addrs: vec![format!("127.0.0.1:0/{}", 900_000 + group)],
                        applied_version: 0,
                        connections: vec![],
                    })
                    .await;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
}

fn state_of(a: &Assignment, group: u32) -> Option<AnaState> {
    a.ana_states
        .iter()
        .find(|g| g.ana_group == group)
        .and_then(|g| u8::try_from(g.state).ok())
        .and_then(AnaState::from_code)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_other_replica_takes_over_and_still_fails_over() {
    let group = format!("replicas-{}-{}", std::process::id(), free_port());
    let r1 = replica(&group);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let r2 = replica(&group);
    let addrs = vec![r1.addr.clone(), r2.addr.clone()];
    let b1 = beacons("gw1", 1, addrs.clone());
    let b2 = beacons("gw2", 2, addrs.clone());
    // One of them leads.
    let started = Instant::now();
    let (lead, other) = loop {
        if leader(&r1.addr).await {
            break (r1, r2);
        }
        if leader(&r2.addr).await {
            break (r2, r1);
        }
        assert!(started.elapsed() < Duration::from_secs(20), "nobody leads");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    // The replica that does not lead names the leader (from the map the leader stored).
    let started = Instant::now();
    loop {
        let mut a = AdminClient::new(channel(&other.addr).await);
        let r = a
            .gateway_list(proto::Empty {})
            .await
            .expect("gateway list")
            .into_inner();
        assert!(r.leader.is_empty(), "{} does not lead", other.addr);
        if r.known_leader == lead.addr {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the other replica names {:?} as leader, not {}",
            r.known_leader,
            lead.addr
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Both gateways registered (via the leader, visible to the other through RADOS).
    let started = Instant::now();
    loop {
        let mut a = AdminClient::new(channel(&other.addr).await);
        let n = a
            .ana_show(proto::Empty {})
            .await
            .map(|r| r.into_inner().groups.len())
            .unwrap_or(0);
        if n == 2 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "groups not seen"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // gw1 follows its assignment on the replica that will survive.
    let mut g = GatewayControlClient::new(channel(&other.addr).await);
    let mut stream = g
        .join(proto::JoinRequest {
            gateway: "gw1".into(),
            incarnation: 7,
        })
        .await
        .expect("join")
        .into_inner();
    let mut last = stream.message().await.expect("stream").expect("first");
    assert_eq!(state_of(&last, 2), Some(AnaState::Inaccessible));

    // kill -9 the leader.
    let killed = Instant::now();
    drop(lead);
    while !leader(&other.addr).await {
        assert!(killed.elapsed() < Duration::from_secs(15), "no takeover");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!(
        "replica takeover {} ms after kill -9 of the leader (lease 3000 ms)",
        killed.elapsed().as_millis()
    );

    // Now gw2 dies: the new leader fences it and pushes group 2 to gw1.
    b2.abort();
    let died = Instant::now();
    while state_of(&last, 2) != Some(AnaState::Optimized) {
        assert!(died.elapsed() < Duration::from_secs(20), "no failover");
        last = tokio::time::timeout(Duration::from_secs(20), stream.message())
            .await
            .expect("in time")
            .expect("stream")
            .expect("assignment");
    }
    eprintln!(
        "group 2 optimized on gw1 {} ms after gw2's last beacon",
        died.elapsed().as_millis()
    );
    let out = Command::new("ceph")
        .args(["osd", "blocklist", "ls"])
        .output()
        .expect("ceph");
    let list = String::from_utf8_lossy(&out.stdout);
    assert!(
        list.contains("127.0.0.1:0/900002"),
        "gw2 not fenced:\n{list}"
    );
    let _ = Command::new("ceph")
        .args(["osd", "blocklist", "rm", "127.0.0.1:0/900002"])
        .output();
    b1.abort();
    drop(other);
}
