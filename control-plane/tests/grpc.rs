//! The gRPC services end to end over loopback, with the in-process state backend (the RADOS
//! backend has its own tests against a cluster): admin requests and their refusals, gateways'
//! beacons and assignment streams through a failover, and the `nvmeofctl` binary's output and
//! exit codes.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use control_plane::ana::{AnaState, Timing};
use control_plane::metrics::render;
use control_plane::proto;
use control_plane::proto::admin_client::AdminClient;
use control_plane::proto::gateway_control_client::GatewayControlClient;
use control_plane::server::{ControlPlane, Options};
use control_plane::store::{MemoryBackend, Store};
use control_plane::test_support::{
    self, add_subsystem_open_to_any_host, ana_state_of, plain_channel,
};
use tonic::transport::Channel;

mod common;

const NQN: &str = "nqn.2016-06.io.test:grpc";

struct Fixture {
    backend: Arc<MemoryBackend>,
    addr: String,
    cp: Arc<ControlPlane>,
}

async fn start() -> Fixture {
    let backend = test_support::memory_backend_with_images(
        ["rbd/img1", "rbd/img2", "rbd/img3"].map(String::from),
    );
    let options = Options {
        timing: Timing {
            grace_ms: 600,
            failback_delay_ms: 200,
        },
        lease: Duration::from_secs(3),
        tick: Duration::from_millis(50),
    };
    let cp = test_support::start_replica(Store::new(backend.clone()), "test", options).await;
    let addr = test_support::serve_plain(cp.clone()).await;
    test_support::wait_for_lease(&cp, Duration::from_secs(5)).await;
    Fixture { backend, addr, cp }
}

/// A beacon from `gw`, which reaches the cluster.
async fn beacon(c: &mut GatewayControlClient<Channel>, gw: &str, group: u32, epoch: u64) {
    beacon_saying(c, gw, group, epoch, proto::ClusterReach::Reachable).await
}

async fn beacon_saying(
    c: &mut GatewayControlClient<Channel>,
    gw: &str,
    group: u32,
    epoch: u64,
    cluster: proto::ClusterReach,
) {
    beacon_naming_osds(c, gw, group, epoch, cluster, &[]).await
}

/// A beacon that also names OSDs that do not answer the gateway.
async fn beacon_naming_osds(
    c: &mut GatewayControlClient<Channel>,
    gw: &str,
    group: u32,
    epoch: u64,
    cluster: proto::ClusterReach,
    osds_unanswered: &[i32],
) {
    beacon_with(c, (gw, group, epoch), cluster, osds_unanswered, None).await;
}

/// gw1's beacon (reaching the cluster, reporting no OSDs) as a witness of the leader
/// (`control_plane::osd_reports`): it carries `answer`, and a request in the reply is
/// answered in the next one, the OSDs of `unanswered_by_gw1` not answering gw1.
async fn gw1_witness_beacon(
    c: &mut GatewayControlClient<Channel>,
    answer: &mut Option<proto::OsdProbeAnswer>,
    unanswered_by_gw1: &[i32],
) -> Option<proto::OsdProbeRequest> {
    let reach = proto::ClusterReach::Reachable;
    let reply = beacon_with(c, ("gw1", 1, 0), reach, &[], answer.clone()).await;
    let request = reply.osd_probe?;
    *answer = Some(proto::OsdProbeAnswer {
        id: request.id,
        unanswered: request
            .osds
            .iter()
            .filter(|o| unanswered_by_gw1.contains(o))
            .copied()
            .collect(),
        not_asked: false,
    });
    Some(request)
}

async fn beacon_with(
    c: &mut GatewayControlClient<Channel>,
    (gw, group, epoch): (&str, u32, u64),
    cluster: proto::ClusterReach,
    osds_unanswered: &[i32],
    osd_probe: Option<proto::OsdProbeAnswer>,
) -> proto::BeaconReply {
    c.send_beacon(proto::Beacon {
        gateway: gw.into(),
        ana_group: group,
        incarnation: u64::from(group),
        client_addrs: vec![format!("127.0.0.1:0/{group}")],
        applied_version: epoch,
        connections: vec![proto::Connection {
            gateway: String::new(),
            subsystem_nqn: NQN.into(),
            host_nqn: format!(
                "nqn.2014-08.org.nvmexpress:uuid:0f0f0f0f-0000-0000-0000-00000000000{group}"
            ),
            cntlid: group * 2040 - 2039,
            io_queues: 4,
            secure: false,
        }],
        cluster: cluster as i32,
        osds_unanswered: osds_unanswered.to_vec(),
        osd_probe,
    })
    .await
    .expect("beacon")
    .into_inner()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_requests_and_their_refusals() {
    let f = start().await;
    let mut a = AdminClient::new(plain_channel(&f.addr).await);
    let mut g = GatewayControlClient::new(plain_channel(&f.addr).await);
    beacon(&mut g, "gw1", 1, 0).await;
    beacon(&mut g, "gw2", 2, 0).await;
    add_subsystem_open_to_any_host(&mut a, NQN).await;
    let namespace = |subsystem_nqn: &str, nsid: u32, image: &str| proto::NamespaceAddRequest {
        subsystem_nqn: subsystem_nqn.into(),
        nsid,
        pool: "rbd".into(),
        image: image.into(),
        ..Default::default()
    };
    for img in ["img1", "img2"] {
        a.namespace_add(namespace(NQN, 0, img))
            .await
            .expect("namespace");
    }
    let ns = a
        .namespace_list(proto::NamespaceListRequest::default())
        .await
        .expect("list")
        .into_inner();
    let placed: Vec<(u32, u32)> = ns
        .namespaces
        .iter()
        .map(|n| (n.nsid, n.ana_group))
        .collect();
    assert_eq!(placed, vec![(1, 1), (2, 2)], "spread over the two groups");
    assert_eq!(ns.namespaces[0].nguid.len(), 32);
    let version = ns.version;

    let code = |r: Result<tonic::Response<proto::Reply>, tonic::Status>| {
        r.err().map(|s| s.code()).unwrap_or(tonic::Code::Ok)
    };
    use tonic::Code;
    let subsystem = |nqn: &str| proto::SubsystemAddRequest {
        nqn: nqn.into(),
        ..Default::default()
    };
    let refusals = [
        (
            code(a.subsystem_add(subsystem(NQN)).await),
            Code::AlreadyExists,
        ),
        (
            // whitespace: a name Linux nvmet cannot take either
            code(a.subsystem_add(subsystem("not an nqn")).await),
            Code::InvalidArgument,
        ),
        (
            code(a.namespace_add(namespace(NQN, 0, "no-such-image")).await),
            Code::NotFound,
        ),
        (
            code(
                a.namespace_add(namespace("nqn.2016-06.io.test:unknown", 0, "img1"))
                    .await,
            ),
            Code::NotFound,
        ),
        (
            code(a.namespace_add(namespace(NQN, 1, "img1")).await),
            Code::AlreadyExists,
        ),
        (
            // another namespace's UUID: a namespace's identity is its own
            code(
                a.namespace_add(proto::NamespaceAddRequest {
                    uuid: ns.namespaces[0].uuid.clone(),
                    ..namespace(NQN, 0, "img3")
                })
                .await,
            ),
            Code::AlreadyExists,
        ),
        (
            code(
                a.namespace_add(proto::NamespaceAddRequest {
                    uuid: "not-a-uuid".into(),
                    ..namespace(NQN, 0, "img3")
                })
                .await,
            ),
            Code::InvalidArgument,
        ),
        (
            code(
                a.namespace_move(proto::NamespaceMoveRequest {
                    subsystem_nqn: NQN.into(),
                    nsid: 1,
                    ana_group: 9,
                })
                .await,
            ),
            Code::NotFound,
        ),
        (
            code(
                a.subsystem_del(proto::SubsystemDelRequest {
                    nqn: NQN.into(),
                    force: false,
                })
                .await,
            ),
            Code::FailedPrecondition,
        ),
        (
            code(
                a.listener_add(proto::Listener {
                    subsystem_nqn: NQN.into(),
                    gateway: "gw1".into(),
                    transport: "tcp".into(),
                    address: "not-an-ip".into(),
                    port: 4420,
                    secure: false,
                })
                .await,
            ),
            Code::InvalidArgument,
        ),
        (
            code(
                a.host_add(proto::Host {
                    subsystem_nqn: NQN.into(),
                    host_nqn: "bad host".into(),
                    ..Default::default()
                })
                .await,
            ),
            Code::InvalidArgument,
        ),
    ];
    for (i, (got, want)) in refusals.iter().enumerate() {
        assert_eq!(got, want, "refusal {i}");
    }
    let after = a
        .namespace_list(proto::NamespaceListRequest::default())
        .await
        .expect("list")
        .into_inner();
    assert_eq!(
        after.version, version,
        "a refused request changed the state"
    );

    a.namespace_move(proto::NamespaceMoveRequest {
        subsystem_nqn: NQN.into(),
        nsid: 1,
        ana_group: 2,
    })
    .await
    .expect("move");
    // Resize: grow only, whole blocks, known namespaces.
    let resize = |nsid, size_bytes| proto::NamespaceResizeRequest {
        subsystem_nqn: NQN.into(),
        nsid,
        size_bytes,
    };
    assert_eq!(
        a.namespace_resize(resize(1, 1 << 20))
            .await
            .err()
            .map(|s| s.code()),
        Some(Code::InvalidArgument)
    );
    assert_eq!(
        a.namespace_resize(resize(1, (2 << 30) + 1))
            .await
            .err()
            .map(|s| s.code()),
        Some(Code::InvalidArgument)
    );
    assert_eq!(
        a.namespace_resize(resize(7, 2 << 30))
            .await
            .err()
            .map(|s| s.code()),
        Some(Code::NotFound)
    );
    a.namespace_resize(resize(1, 2 << 30)).await.expect("grow");
    let show = a.ana_show(proto::Empty {}).await.expect("ana").into_inner();
    let g2 = show
        .groups
        .iter()
        .find(|g| g.ana_group == 2)
        .expect("group 2");
    assert_eq!((g2.owner.as_str(), g2.namespaces), ("gw2", 2));
    let gws = a
        .gateway_list(proto::Empty {})
        .await
        .expect("gateways")
        .into_inner();
    assert_eq!(gws.leader, "test");
    assert_eq!(gws.gateways.len(), 2);
    assert_eq!(
        (gws.gateways[1].cntlid_min, gws.gateways[1].cntlid_max),
        (2041, 4080)
    );
    drop(f.cp);
}

/// gw1 and gw2 beacon (both reaching the cluster), gw1 joins its assignment stream: the
/// fixture, gw1's client, its stream and the current assignment, which comes at once.
async fn two_gateways_gw1_joined() -> (
    Fixture,
    GatewayControlClient<Channel>,
    tonic::Streaming<proto::Assignment>,
    proto::Assignment,
) {
    let f = start().await;
    let mut g = GatewayControlClient::new(plain_channel(&f.addr).await);
    beacon(&mut g, "gw1", 1, 0).await;
    beacon(&mut g, "gw2", 2, 0).await;
    let mut s1 = g
        .join(proto::JoinRequest {
            gateway: "gw1".into(),
            incarnation: 1,
            presence_only: false,
        })
        .await
        .expect("join")
        .into_inner();
    let last = tokio::time::timeout(Duration::from_secs(5), s1.message())
        .await
        .expect("in time")
        .expect("stream")
        .expect("assignment");
    (f, g, s1, last)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn assignments_follow_a_fenced_failover() {
    let (f, g, mut s1, last) = two_gateways_gw1_joined().await;
    assert_eq!(ana_state_of(&last, 1), Some(AnaState::Optimized));
    assert_eq!(ana_state_of(&last, 2), Some(AnaState::Inaccessible));
    let metrics = render(&f.cp);
    for line in [
        "nvmeof_control_leader 1",
        "nvmeof_control_gateway_info{gateway=\"gw2\",ana_group=\"2\",availability=\"available\",cluster=\"reachable\"} 1",
        "nvmeof_control_ana_group_info{ana_group=\"2\",owner=\"gw2\",holder=\"gw2\",phase=\"active\"} 1",
    ] {
        assert!(metrics.lines().any(|l| l == line), "{line} in\n{metrics}");
    }
    // gw1 keeps beaconing, gw2 stops: gw2 is fenced, then group 2 is pushed optimized.
    let beacons = {
        let mut g = g.clone();
        tokio::spawn(async move {
            loop {
                beacon(&mut g, "gw1", 1, 0).await;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    let last = test_support::until_optimized(&mut s1, last, 2, Duration::from_secs(10)).await;
    let fenced = f.backend.fenced.lock().expect("fenced").clone();
    assert_eq!(
        fenced,
        vec!["127.0.0.1:0/2".to_string()],
        "fenced before the push"
    );
    assert_eq!(ana_state_of(&last, 1), Some(AnaState::Optimized));
    // the metrics tell the same story: gw2 fenced, its group held by gw1
    let metrics = render(&f.cp);
    for line in [
        "nvmeof_control_gateway_info{gateway=\"gw2\",ana_group=\"2\",availability=\"fenced\",cluster=\"reachable\"} 1",
        "nvmeof_control_ana_group_info{ana_group=\"2\",owner=\"gw2\",holder=\"gw1\",phase=\"active\"} 1",
    ] {
        assert!(metrics.lines().any(|l| l == line), "{line} in\n{metrics}");
    }
    beacons.abort();
}

/// gw1 and gw2 keep beaconing, gw2 saying `cluster` and naming `osds`: gw2 must be fenced
/// before group 2 is pushed optimized to gw1, and the metrics must show gw2 fenced and taken
/// as cut off from the cluster.
async fn gw2_is_fenced_and_its_group_moves(
    f: &Fixture,
    g: &GatewayControlClient<Channel>,
    mut s1: tonic::Streaming<proto::Assignment>,
    last: proto::Assignment,
    cluster: proto::ClusterReach,
    osds: &'static [i32],
) {
    assert_eq!(ana_state_of(&last, 2), Some(AnaState::Inaccessible));
    let beacons = {
        let mut g = g.clone();
        tokio::spawn(async move {
            // gw1 reaches every OSD, should the leader ask it.
            let mut answer = None;
            loop {
                gw1_witness_beacon(&mut g, &mut answer, &[]).await;
                beacon_naming_osds(&mut g, "gw2", 2, 0, cluster, osds).await;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    let last = test_support::until_optimized(&mut s1, last, 2, Duration::from_secs(10)).await;
    assert_eq!(
        f.backend.fenced.lock().expect("fenced").clone(),
        vec!["127.0.0.1:0/2".to_string()],
        "fenced before the push"
    );
    assert_eq!(ana_state_of(&last, 1), Some(AnaState::Optimized));
    let metrics = render(&f.cp);
    let line = "nvmeof_control_gateway_info{gateway=\"gw2\",ana_group=\"2\",availability=\"fenced\",cluster=\"stalled\"} 1";
    assert!(metrics.lines().any(|l| l == line), "{line} in\n{metrics}");
    beacons.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn beacons_are_answered_and_nobody_is_taken_for_dead_while_the_map_cannot_be_written() {
    let (f, g, _s1, _last) = two_gateways_gw1_joined().await;
    let mut g = g.clone();
    /// Lets writes through again when dropped, so a failing assertion does not leave the
    /// runtime waiting on a stalled write at its shutdown.
    struct Unstall(Arc<MemoryBackend>);
    impl Drop for Unstall {
        fn drop(&mut self) {
            self.0.writes_stalled.store(false, Ordering::SeqCst);
        }
    }
    f.backend.writes_stalled.store(true, Ordering::SeqCst);
    let unstall = Unstall(f.backend.clone());
    // Each round both report a newer applied epoch: every beacon changes the map, whose
    // write waits. Three graces (600 ms) long.
    let until = Instant::now() + Duration::from_millis(1800);
    let mut epoch = 0;
    while Instant::now() < until {
        epoch += 1;
        for (gw, group) in [("gw1", 1), ("gw2", 2)] {
            tokio::time::timeout(Duration::from_millis(300), beacon(&mut g, gw, group, epoch))
                .await
                .unwrap_or_else(|_| panic!("{gw}'s beacon answered while the map's write waits"));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let metrics = render(&f.cp);
    for gw in ["gw1", "gw2"] {
        let group = &gw[2..];
        let line = format!("nvmeof_control_gateway_info{{gateway=\"{gw}\",ana_group=\"{group}\",availability=\"available\",cluster=\"reachable\"}} 1");
        assert!(metrics.lines().any(|l| l == line), "{line} in\n{metrics}");
    }
    assert!(
        f.backend.fenced.lock().expect("fenced").is_empty(),
        "nobody fenced"
    );
    // Once the cluster takes writes again, the map's last change is written.
    drop(unstall);
    let written = Instant::now() + Duration::from_secs(5);
    loop {
        let stored = Store::new(f.backend.clone()).load().expect("load");
        let applied = stored
            .map
            .as_ref()
            .and_then(|m| m.gateways.get("gw2"))
            .map(|g| g.applied_epoch);
        if applied == Some(epoch) {
            break;
        }
        assert!(
            Instant::now() < written,
            "gw2's applied epoch {epoch} written, stored {applied:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_beaconing_that_it_cannot_reach_the_cluster_is_fenced_and_its_group_moves() {
    let (f, g, s1, last) = two_gateways_gw1_joined().await;
    // Both keep beaconing; gw2's Ceph network is gone.
    gw2_is_fenced_and_its_group_moves(&f, &g, s1, last, proto::ClusterReach::Stalled, &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_cut_off_from_osds_that_answer_the_leader_is_fenced_and_its_group_moves() {
    let (f, g, s1, last) = two_gateways_gw1_joined().await;
    // The OSDs answer the leader.
    *f.backend.osds_unanswered.lock().expect("osds") = Some(vec![]);
    // Both keep beaconing and reach the monitors; osd.3 and osd.5 do not answer gw2.
    let reach = proto::ClusterReach::Reachable;
    gw2_is_fenced_and_its_group_moves(&f, &g, s1, last, reach, &[5, 3]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_cut_off_from_osds_the_leader_cannot_reach_either_is_failed_over_once_a_witness_reaches_them(
) {
    let (f, g, s1, last) = two_gateways_gw1_joined().await;
    // The leader is cut off from osd.3 and osd.5 too; they answer gw1 (asked as a witness).
    *f.backend.osds_unanswered.lock().expect("osds") = Some(vec![3, 5]);
    let reach = proto::ClusterReach::Reachable;
    gw2_is_fenced_and_its_group_moves(&f, &g, s1, last, reach, &[5, 3]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn osds_that_answer_neither_the_gateway_nor_the_leader_nor_a_witness_move_nothing() {
    let (f, g, _s1, last) = two_gateways_gw1_joined().await;
    assert_eq!(ana_state_of(&last, 2), Some(AnaState::Inaccessible));
    // osd.3 answers nobody (a hung OSD); another probe would not answer either.
    *f.backend.osds_unanswered.lock().expect("osds") = Some(vec![3]);
    let mut g = g.clone();
    let (mut answer, mut asked) = (None, Vec::new());
    let until = Instant::now() + Duration::from_secs(2);
    while Instant::now() < until {
        if let Some(request) = gw1_witness_beacon(&mut g, &mut answer, &[3]).await {
            asked.push(request);
        }
        beacon_naming_osds(&mut g, "gw2", 2, 0, proto::ClusterReach::Reachable, &[3]).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        f.backend.fenced.lock().expect("fenced").is_empty(),
        "nothing fenced"
    );
    assert!(
        asked.iter().any(|r| r.osds == vec![3]),
        "gw1 was asked to probe osd.3: {asked:?}"
    );
    // gw2 reports OSDs itself: it is never asked to witness.
    let reply = beacon_with(
        &mut g,
        ("gw2", 2, 0),
        proto::ClusterReach::Reachable,
        &[3],
        None,
    )
    .await;
    assert_eq!(reply.osd_probe, None);
    let metrics = render(&f.cp);
    let line = "nvmeof_control_gateway_info{gateway=\"gw2\",ana_group=\"2\",availability=\"available\",cluster=\"reachable\"} 1";
    assert!(metrics.lines().any(|l| l == line), "{line} in\n{metrics}");
    let line = "nvmeof_control_ana_group_info{ana_group=\"2\",owner=\"gw2\",holder=\"gw2\",phase=\"active\"} 1";
    assert!(metrics.lines().any(|l| l == line), "{line} in\n{metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_namespaces_in_one_update_up_to_the_first_refusal() {
    let f = start().await;
    f.backend
        .images
        .lock()
        .expect("images")
        .extend((3..=5).map(|i| format!("rbd/img{i}")));
    let mut a = AdminClient::new(plain_channel(&f.addr).await);
    let mut g = GatewayControlClient::new(plain_channel(&f.addr).await);
    beacon(&mut g, "gw1", 1, 0).await;
    beacon(&mut g, "gw2", 2, 0).await;
    add_subsystem_open_to_any_host(&mut a, NQN).await;
    let ns = |image: &str, nsid: u32| proto::NamespaceAddRequest {
        subsystem_nqn: NQN.into(),
        nsid,
        pool: "rbd".into(),
        image: image.into(),
        ..Default::default()
    };
    let v0 = f.cp.state().version;
    // The third takes the second's NSID: the first two are added, in one write.
    let r = a
        .namespace_add_many(proto::NamespaceAddManyRequest {
            namespaces: vec![ns("img1", 0), ns("img2", 7), ns("img3", 7), ns("img4", 0)],
        })
        .await
        .expect("add many")
        .into_inner();
    let got: Vec<(u32, String)> = r.added.iter().map(|n| (n.nsid, n.image.clone())).collect();
    assert_eq!(got, vec![(1, "img1".into()), (7, "img2".into())]);
    assert_eq!(r.added[0].ana_group, 1);
    assert_eq!(r.added[1].ana_group, 2, "spread over the groups");
    let refused = r.refused.expect("refused");
    assert_eq!(refused.index, 2);
    assert_eq!(refused.code, tonic::Code::AlreadyExists as i32);
    assert!(
        refused.message.contains("namespace 7"),
        "{}",
        refused.message
    );
    assert_eq!(r.version, v0 + 1);
    let stored = Store::new(f.backend.clone()).load().expect("load");
    assert_eq!(stored.namespaces.len(), 2);
    assert_eq!(stored.version, v0 + 1);
    // A missing image refuses from there on; nothing is written when the first is refused.
    let r = a
        .namespace_add_many(proto::NamespaceAddManyRequest {
            namespaces: vec![ns("missing", 0), ns("img5", 0)],
        })
        .await
        .expect("add many")
        .into_inner();
    assert!(r.added.is_empty());
    let refused = r.refused.expect("refused");
    assert_eq!(
        (refused.index, refused.code),
        (0, tonic::Code::NotFound as i32)
    );
    assert_eq!(
        Store::new(f.backend.clone()).load().expect("load").version,
        v0 + 1
    );
    // More than a subsystem's NSIDs in one request.
    let e = a
        .namespace_add_many(proto::NamespaceAddManyRequest {
            namespaces: (0..1025).map(|i| ns(&format!("x{i}"), 0)).collect(),
        })
        .await
        .expect_err("too many");
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
}

/// Group beacons from `gw` every 100 ms, acknowledging the state version in `applied`.
fn group_beacons(
    g: &GatewayControlClient<Channel>,
    gw: &'static str,
    group: u32,
    applied: Arc<std::sync::atomic::AtomicU64>,
) -> tokio::task::JoinHandle<()> {
    let mut g = g.clone();
    tokio::spawn(async move {
        loop {
            let r = g
                .send_group_beacon(proto::GroupBeacon {
                    beacon: Some(proto::Beacon {
                        gateway: gw.into(),
                        ana_group: group,
                        incarnation: u64::from(group),
                        client_addrs: vec![format!("127.0.0.1:0/{group}")],
                        ..Default::default()
                    }),
                    group_clients: vec![proto::GroupClients {
                        ana_group: group,
                        addrs: vec![format!("127.0.0.1:0/{group}")],
                    }],
                    applied_state_version: applied.load(std::sync::atomic::Ordering::SeqCst),
                    ..Default::default()
                })
                .await;
            if let Err(e) = r {
                eprintln!("{gw} beacon: {e}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
}

/// A `namespace move` marks the namespace moving and waits for the old group's gateway to
/// drain it; the replica serving that request dies (here: the test writes the request's
/// first step itself and never does the rest). The leader must end the move, and only once
/// that gateway acknowledged the state with the move.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_leader_ends_a_move_whose_replica_died() {
    use std::sync::atomic::{AtomicU64, Ordering};
    let f = start().await;
    let mut a = AdminClient::new(plain_channel(&f.addr).await);
    let g = GatewayControlClient::new(plain_channel(&f.addr).await);
    let gw1_applied = Arc::new(AtomicU64::new(0));
    let b1 = group_beacons(&g, "gw1", 1, gw1_applied.clone());
    let b2 = group_beacons(&g, "gw2", 2, Arc::new(AtomicU64::new(u64::MAX)));
    let started = Instant::now();
    while f.cp.state().groups() != vec![1, 2] {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "groups never mapped"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    add_subsystem_open_to_any_host(&mut a, NQN).await;
    a.namespace_add(proto::NamespaceAddRequest {
        subsystem_nqn: NQN.into(),
        nsid: 1,
        pool: "rbd".into(),
        image: "img1".into(),
        ana_group: 1,
        ..Default::default()
    })
    .await
    .expect("namespace");
    // The dead replica's half of `namespace move --nsid 1 --ana-group 2`.
    let store = Store::new(f.backend.clone());
    let (_, moved) = store
        .update(|st| st.move_namespace(NQN, 1, 2))
        .expect("mark moving");
    let key = (NQN.to_string(), 1);
    assert_eq!(moved.namespaces[&key].moving_from, 1);
    // gw1 (group 1) has not drained it: still moving, well within the drain timeout.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let now = store.load().expect("load");
    assert_eq!(
        now.namespaces[&key].moving_from, 1,
        "ended before the drain"
    );
    // gw1 acknowledges the state with the move: the leader ends it.
    gw1_applied.store(moved.version, Ordering::SeqCst);
    let started = Instant::now();
    loop {
        let now = store.load().expect("load");
        if now.namespaces[&key].moving_from == 0 {
            assert_eq!(now.namespaces[&key].ana_group, 2);
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the move was never ended"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let listed = a
        .namespace_list(proto::NamespaceListRequest::default())
        .await
        .expect("list")
        .into_inner();
    assert_eq!(listed.namespaces[0].moving_from_group, 0);
    assert_eq!(listed.namespaces[0].ana_group, 2);
    b1.abort();
    b2.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nvmeofctl_prints_tables_json_and_exit_codes() {
    let f = start().await;
    let ctl = |args: &[&str]| common::ctl(&f.addr, args);
    let (rc, out, _) = ctl(&["subsystem", "add", "--nqn", NQN, "--allow-any-host"]);
    assert_eq!(rc, 0);
    assert!(out.contains("added"), "{out}");
    let (rc, _, err) = ctl(&["subsystem", "add", "--nqn", NQN]);
    assert_eq!(rc, 1);
    assert!(err.contains("already exists"), "{err}");
    // Names Linux nvmet takes pass, with a warning; what it cannot take is refused, the
    // message naming the field.
    let (rc, out, err) = ctl(&["subsystem", "add", "--nqn", "testnqn"]);
    assert_eq!(rc, 0);
    assert!(out.contains("added"), "{out}");
    assert!(
        err.contains("warning: subsystem NQN \"testnqn\" is not in the NVMe formats"),
        "{err}"
    );
    let (rc, _, err) = ctl(&[
        "host",
        "add",
        "--subsystem",
        "testnqn",
        "--host",
        "testhost",
    ]);
    assert_eq!(rc, 0);
    assert!(err.contains("warning: host NQN \"testhost\""), "{err}");
    let too_long = "n".repeat(224);
    for bad in [too_long.as_str(), "test nqn", "test\u{1}nqn"] {
        let (rc, _, err) = ctl(&["subsystem", "add", "--nqn", bad]);
        assert_eq!(rc, 1, "{bad:?}");
        assert!(err.contains("invalid subsystem NQN"), "{bad:?}: {err}");
        let (rc, _, err) = ctl(&["host", "add", "--subsystem", "testnqn", "--host", bad]);
        assert_eq!(rc, 1, "{bad:?}");
        assert!(err.contains("invalid host NQN"), "{bad:?}: {err}");
    }
    let (rc, _, _) = ctl(&["subsystem", "del", "--nqn", "testnqn", "--force"]);
    assert_eq!(rc, 0);
    let (rc, out, _) = ctl(&["subsystem", "list"]);
    assert_eq!(rc, 0);
    assert!(out.starts_with("NQN"), "{out}");
    assert!(out.contains(NQN), "{out}");
    let (rc, out, _) = ctl(&["--output", "json", "subsystem", "list"]);
    assert_eq!(rc, 0);
    let v: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!(v["subsystems"][0]["nqn"], NQN);
    // Gateways, their info and the connections they report.
    let mut g = GatewayControlClient::new(plain_channel(&f.addr).await);
    beacon(&mut g, "gw1", 1, 0).await;
    beacon(&mut g, "gw2", 2, 0).await;
    let (rc, out, _) = ctl(&["gateway", "info", "--name", "gw2"]);
    assert_eq!(rc, 0);
    assert!(out.contains("ANA group    2"), "{out}");
    assert!(out.contains("optimized"), "{out}");
    let (rc, _, err) = ctl(&["gateway", "info", "--name", "gw9"]);
    assert_eq!(rc, 1);
    assert!(err.contains("gw9 not found"), "{err}");
    let (rc, out, _) = ctl(&["-o", "json", "connection", "list"]);
    assert_eq!(rc, 0);
    let v: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!(v["connections"].as_array().map(Vec::len), Some(2), "{out}");
    assert_eq!(v["connections"][1]["gateway"], "gw2");
    assert_eq!(v["connections"][1]["cntlid"], 2041);
    let (rc, out, _) = ctl(&["connection", "list", "-n", "nqn.2016-06.io.test:other"]);
    assert_eq!(rc, 0);
    assert!(out.contains("(none)"), "{out}");
    let (rc, _, _) = ctl(&["subsystem", "frobnicate"]);
    assert_eq!(rc, 2);
    let (rc, _, _) = common::ctl("127.0.0.1:1", &["subsystem", "list"]);
    assert_eq!(rc, 3);
}
