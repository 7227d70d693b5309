//! Two `nvmeof-control` processes on one group state in RADOS: kill -9 the leader, the other
//! takes over the lease, and a gateway failover after that is still fenced and pushed; kill -9
//! the replica serving a `namespace move` while it waits for the drain, and the new leader
//! ends the move once the old group's gateway has drained it.
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
use control_plane::proto;
use control_plane::proto::admin_client::AdminClient;
use control_plane::proto::gateway_control_client::GatewayControlClient;
use control_plane::test_support::{
    add_subsystem_open_to_any_host, ana_state_of, ceph_conf, ceph_pool, free_port, until_optimized,
};
use tonic::transport::Channel;

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

/// The two replicas, the one that leads first: waits (at most 20 s) for one of them to lead.
async fn leader_first(r1: Replica, r2: Replica) -> (Replica, Replica) {
    let started = Instant::now();
    loop {
        if leader(&r1.addr).await {
            return (r1, r2);
        }
        if leader(&r2.addr).await {
            return (r2, r1);
        }
        assert!(started.elapsed() < Duration::from_secs(20), "nobody leads");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A gateway-control client of each replica at `addrs`.
async fn gateway_clients(addrs: &[String]) -> Vec<GatewayControlClient<Channel>> {
    let mut clients = Vec::new();
    for a in addrs {
        clients.push(GatewayControlClient::new(channel(a).await));
    }
    clients
}

/// Beacons `gw` to every replica every 200 ms until aborted.
fn beacons(gw: &'static str, group: u32, addrs: Vec<String>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut clients = gateway_clients(&addrs).await;
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
                        ..Default::default()
                    })
                    .await;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
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
    let (lead, other) = leader_first(r1, r2).await;
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
    wait_for_groups(&other.addr, 2).await;
    // gw1 follows its assignment on the replica that will survive.
    let mut g = GatewayControlClient::new(channel(&other.addr).await);
    let mut stream = g
        .join(proto::JoinRequest {
            gateway: "gw1".into(),
            incarnation: 7,
            presence_only: false,
        })
        .await
        .expect("join")
        .into_inner();
    let last = stream.message().await.expect("stream").expect("first");
    assert_eq!(ana_state_of(&last, 2), Some(AnaState::Inaccessible));

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
    until_optimized(&mut stream, last, 2, Duration::from_secs(20)).await;
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

/// Group beacons (with `applied_state_version` from `applied`) to every replica every 200 ms.
fn group_beacons(
    gw: &'static str,
    group: u32,
    addrs: Vec<String>,
    applied: std::sync::Arc<std::sync::atomic::AtomicU64>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut clients = gateway_clients(&addrs).await;
        loop {
            for c in clients.iter_mut() {
                let addr = format!("127.0.0.1:0/{}", 910_000 + group);
                let _ = c
                    .send_group_beacon(proto::GroupBeacon {
                        beacon: Some(proto::Beacon {
                            gateway: gw.into(),
                            ana_group: group,
                            incarnation: 7,
                            client_addrs: vec![addr.clone()],
                            ..Default::default()
                        }),
                        group_clients: vec![proto::GroupClients {
                            ana_group: group,
                            addrs: vec![addr],
                        }],
                        applied_state_version: applied.load(std::sync::atomic::Ordering::SeqCst),
                        ..Default::default()
                    })
                    .await;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
}

/// (ana_group, moving_from_group) of namespace 1 of `nqn`, as `addr` lists it.
async fn placement(addr: &str, nqn: &str) -> Option<(u32, u32)> {
    let mut a = AdminClient::new(channel(addr).await);
    let list = a
        .namespace_list(proto::NamespaceListRequest {
            subsystem_nqn: nqn.into(),
        })
        .await
        .ok()?
        .into_inner();
    list.namespaces
        .iter()
        .find(|n| n.nsid == 1)
        .map(|n| (n.ana_group, n.moving_from_group))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_move_whose_replica_is_killed_is_ended_by_the_new_leader() {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;
    let group = format!("move-{}-{}", std::process::id(), free_port());
    let pool = ceph_pool();
    let image = format!("move-{}", free_port());
    let out = Command::new("rbd")
        .args(["create", "--size", "16M", &format!("{pool}/{image}")])
        .output()
        .expect("rbd");
    assert!(out.status.success(), "rbd create: {out:?}");
    let r1 = replica(&group);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let r2 = replica(&group);
    let addrs = vec![r1.addr.clone(), r2.addr.clone()];
    let gw1_applied = Arc::new(AtomicU64::new(0));
    let b1 = group_beacons("gw1", 1, addrs.clone(), gw1_applied.clone());
    let b2 = group_beacons("gw2", 2, addrs.clone(), Arc::new(AtomicU64::new(u64::MAX)));
    let (lead, other) = leader_first(r1, r2).await;
    wait_for_groups(&lead.addr, 2).await;
    let nqn = "nqn.2016-06.io.test:move";
    let mut a = AdminClient::new(channel(&lead.addr).await);
    add_subsystem_open_to_any_host(&mut a, nqn).await;
    a.namespace_add(proto::NamespaceAddRequest {
        subsystem_nqn: nqn.into(),
        nsid: 1,
        pool: pool.clone(),
        image: image.clone(),
        ana_group: 1,
        ..Default::default()
    })
    .await
    .expect("namespace");
    // The move waits for gw1 (group 1) to drain, which it does not acknowledge yet.
    let mut mover = a.clone();
    let request = tokio::spawn(async move {
        mover
            .namespace_move(proto::NamespaceMoveRequest {
                subsystem_nqn: nqn.into(),
                nsid: 1,
                ana_group: 2,
            })
            .await
    });
    let started = Instant::now();
    while placement(&other.addr, nqn).await != Some((2, 1)) {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "move not marked"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // kill -9 the replica serving the request, mid-drain.
    let killed = Instant::now();
    drop(lead);
    assert!(request.await.expect("task").is_err(), "the request ended");
    while !leader(&other.addr).await {
        assert!(killed.elapsed() < Duration::from_secs(15), "no takeover");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!("takeover {} ms after kill -9", killed.elapsed().as_millis());
    // Not drained yet: still moving.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(
        placement(&other.addr, nqn).await,
        Some((2, 1)),
        "ended undrained"
    );
    // gw1 acknowledges the current state: the new leader ends the move.
    let mut o = AdminClient::new(channel(&other.addr).await);
    let version = o
        .namespace_list(proto::NamespaceListRequest::default())
        .await
        .expect("list")
        .into_inner()
        .version;
    gw1_applied.store(version, Ordering::SeqCst);
    let acked = Instant::now();
    while placement(&other.addr, nqn).await != Some((2, 0)) {
        assert!(
            acked.elapsed() < Duration::from_secs(10),
            "the new leader never ended the move: {:?}",
            placement(&other.addr, nqn).await
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!(
        "move ended by the new leader {} ms after gw1's acknowledgement",
        acked.elapsed().as_millis()
    );
    b1.abort();
    b2.abort();
    let _ = Command::new("rbd")
        .args(["rm", &format!("{pool}/{image}")])
        .output();
    drop(other);
}

/// Waits (at most 10 s) until the replica at `addr` reports `count` ANA groups.
async fn wait_for_groups(addr: &str, count: usize) {
    let started = Instant::now();
    loop {
        let mut a = AdminClient::new(channel(addr).await);
        let n = a
            .ana_show(proto::Empty {})
            .await
            .map(|r| r.into_inner().groups.len())
            .unwrap_or(0);
        if n == count {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "groups not seen"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
