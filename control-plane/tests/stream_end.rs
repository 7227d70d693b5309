//! A gateway's `Join` stream ending is a fast suspicion of its death: the leader fences what
//! the gateway holds at once (not after the beacon grace), and only then moves its groups.
//! Over loopback with the in-process state backend.

use std::sync::Arc;
use std::time::{Duration, Instant};

use control_plane::ana::{AnaState, Timing};
use control_plane::proto;
use control_plane::proto::admin_client::AdminClient;
use control_plane::proto::gateway_control_client::GatewayControlClient;
use control_plane::server::{ControlPlane, Options};
use control_plane::store::{MemoryBackend, Store};
use control_plane::test_support::{self, ana_state_of, plain_channel};
use tonic::transport::Channel;

/// Far longer than any of these tests: a failover in them cannot come from missed beacons.
const GRACE_MS: u64 = 60_000;

struct Fixture {
    backend: Arc<MemoryBackend>,
    addr: String,
    cp: Arc<ControlPlane>,
}

async fn start() -> Fixture {
    let backend = Arc::new(MemoryBackend::default());
    let options = Options {
        timing: Timing {
            grace_ms: GRACE_MS,
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

/// A beacon of gateway `gwN` (incarnation N, client `127.0.0.1:0/N`) owning group N.
async fn beacon(c: &mut GatewayControlClient<Channel>, group: u32) {
    c.send_beacon(proto::Beacon {
        gateway: format!("gw{group}"),
        ana_group: group,
        incarnation: u64::from(group),
        client_addrs: vec![format!("127.0.0.1:0/{group}")],
        ..Default::default()
    })
    .await
    .expect("beacon");
}

/// A `Join` of `gateway` as `incarnation`, on a connection of its own (a process's).
async fn join(
    addr: &str,
    gateway: &str,
    incarnation: u64,
    presence_only: bool,
) -> tonic::Streaming<proto::Assignment> {
    GatewayControlClient::new(plain_channel(addr).await)
        .join(proto::JoinRequest {
            gateway: gateway.into(),
            incarnation,
            presence_only,
        })
        .await
        .expect("join")
        .into_inner()
}

async fn availability(addr: &str, gateway: &str) -> String {
    AdminClient::new(plain_channel(addr).await)
        .gateway_list(proto::Empty {})
        .await
        .expect("gateway list")
        .into_inner()
        .gateways
        .into_iter()
        .find(|g| g.name == gateway)
        .map(|g| g.availability)
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_whose_stream_ends_is_fenced_at_once_then_its_group_moves() {
    let f = start().await;
    let mut g = GatewayControlClient::new(plain_channel(&f.addr).await);
    beacon(&mut g, 1).await;
    beacon(&mut g, 2).await;
    let mut s1 = join(&f.addr, "gw1", 1, false).await;
    let first = tokio::time::timeout(Duration::from_secs(5), s1.message())
        .await
        .expect("in time")
        .expect("stream")
        .expect("assignment");
    assert_eq!(ana_state_of(&first, 2), Some(AnaState::Inaccessible));
    // gw2 holds a presence stream: nothing comes on it.
    let mut presence = join(&f.addr, "gw2", 2, true).await;
    assert!(
        tokio::time::timeout(Duration::from_millis(300), presence.message())
            .await
            .is_err(),
        "a presence-only stream carries no assignment"
    );
    assert!(f.backend.fenced.lock().expect("fenced").is_empty());
    // gw2's process dies: its connection goes, and with it the stream.
    let died = Instant::now();
    drop(presence);
    let last = test_support::until_optimized(&mut s1, first, 2, Duration::from_secs(5)).await;
    let took = died.elapsed();
    assert!(
        took < Duration::from_secs(2),
        "group 2 optimized on gw1 {took:?} after gw2's stream ended (grace {GRACE_MS} ms)"
    );
    assert_eq!(ana_state_of(&last, 1), Some(AnaState::Optimized));
    assert_eq!(
        f.backend.fenced.lock().expect("fenced").clone(),
        vec!["127.0.0.1:0/2".to_string()],
        "gw2 fenced before its group moved"
    );
    assert_eq!(availability(&f.addr, "gw2").await, "fenced");
    drop(f.cp);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_of_another_process_ending_changes_nothing() {
    let f = start().await;
    let mut g = GatewayControlClient::new(plain_channel(&f.addr).await);
    beacon(&mut g, 1).await;
    beacon(&mut g, 2).await;
    // A stream of an earlier process of gw2 (incarnation 7; gw2 now runs as 2), one without
    // an incarnation, and one of a gateway the group does not know.
    for (gateway, incarnation) in [("gw2", 7), ("gw2", 0), ("gw9", 9)] {
        drop(join(&f.addr, gateway, incarnation, true).await);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    beacon(&mut g, 1).await;
    assert!(f.backend.fenced.lock().expect("fenced").is_empty());
    assert_eq!(availability(&f.addr, "gw2").await, "available");
    let show = AdminClient::new(plain_channel(&f.addr).await)
        .ana_show(proto::Empty {})
        .await
        .expect("ana show")
        .into_inner();
    assert!(show
        .groups
        .iter()
        .all(|g| g.owner == g.holder && g.phase == "active"));
    drop(f.cp);
}
