//! The control plane's RADOS store against a real Ceph cluster (never a mock): concurrent
//! compare-and-set updates, watch-driven refresh of another replica, the leader lease and its
//! takeover, state surviving a restart, image existence checks.
//!
//! Compiled only with `--features ceph-tests` (then a missing cluster fails the tests):
//!
//! ```sh
//! eval "$(scripts/micro-ceph.sh start)"
//! cargo test -p control-plane --features ceph-tests --test rados_store
//! ```
#![cfg(feature = "ceph-tests")]

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use control_plane::server::{ControlPlane, Options};
use control_plane::store::{Backend, RadosBackend, Store};
use rbd_backend::rbd::CephSettings;

fn settings() -> CephSettings {
    let conf = std::env::var("CEPH_CONF").unwrap_or_default();
    assert!(
        !conf.is_empty() && std::path::Path::new(&conf).is_file(),
        "these tests need a Ceph cluster: CEPH_CONF ({conf:?}) must name its ceph.conf.\n\
         Start one with: eval \"$(scripts/micro-ceph.sh start)\"  (or run rbd-backend/tests/ceph-tests.sh)"
    );
    CephSettings {
        conf: Some(PathBuf::from(conf)),
        keyring: std::env::var("CEPH_KEYRING").ok().map(PathBuf::from),
        max_connections: 1,
        ..CephSettings::default()
    }
}

fn pool() -> String {
    std::env::var("MICRO_CEPH_POOL").unwrap_or_else(|_| "rbd".into())
}

static NEXT: AtomicU64 = AtomicU64::new(0);

fn group() -> String {
    format!(
        "store-test-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::SeqCst)
    )
}

fn backend(group: &str) -> Arc<RadosBackend> {
    Arc::new(RadosBackend::connect(&settings(), &pool(), group).expect("state object"))
}

fn nqn(i: usize) -> String {
    format!("nqn.2016-06.io.test:store-{i}")
}

#[test]
fn concurrent_writers_on_two_clients_all_land() {
    let g = group();
    let stores = [Store::new(backend(&g)), Store::new(backend(&g))];
    std::thread::scope(|s| {
        for (t, store) in stores.iter().enumerate() {
            s.spawn(move || {
                for i in 0..10 {
                    store
                        .update(|st| st.add_subsystem(&nqn(t * 100 + i), "", true, 0))
                        .expect("update");
                }
            });
        }
    });
    let st = stores[0].load().expect("load");
    assert_eq!(st.subsystems.len(), 20);
    assert_eq!(st.version, 20);
    // A refused change leaves the stored state as it was.
    let r = stores[1].update(|st| st.add_subsystem(&nqn(0), "", true, 0));
    assert!(r.is_err());
    assert_eq!(stores[1].load().expect("load").version, 20);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_sees_another_replicas_change_by_watch() {
    let g = group();
    let a = Store::new(backend(&g));
    let b = ControlPlane::start(Store::new(backend(&g)), "b".into(), Options::default())
        .await
        .expect("replica b");
    let a2 = a.clone();
    tokio::task::spawn_blocking(move || a2.update(|st| st.add_subsystem(&nqn(1), "", true, 0)))
        .await
        .expect("join")
        .expect("update");
    let started = Instant::now();
    while !b.state().subsystems.contains_key(&nqn(1)) {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "replica b never saw the change"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!("watch -> refresh: {} ms", started.elapsed().as_millis());
    // A restarted replica loads the same state from RADOS.
    let c = ControlPlane::start(Store::new(backend(&g)), "c".into(), Options::default())
        .await
        .expect("replica c");
    assert!(c.state().subsystems.contains_key(&nqn(1)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_replica_leads_and_another_takes_over_when_its_lease_lapses() {
    let g = group();
    let opts = Options {
        lease: Duration::from_millis(1500),
        ..Options::default()
    };
    let a = ControlPlane::start(Store::new(backend(&g)), "a".into(), opts)
        .await
        .expect("a");
    let b = ControlPlane::start(Store::new(backend(&g)), "b".into(), opts)
        .await
        .expect("b");
    let run_a = tokio::spawn(a.clone().run());
    tokio::time::sleep(Duration::from_millis(300)).await;
    let run_b = tokio::spawn(b.clone().run());
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert!(a.is_leader() && !b.is_leader(), "a leads, b waits");
    // a dies: b leads once the lease lapses.
    run_a.abort();
    let started = Instant::now();
    while !b.is_leader() {
        assert!(
            started.elapsed() < Duration::from_secs(6),
            "b never took over"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!(
        "takeover {} ms after the leader stopped renewing",
        started.elapsed().as_millis()
    );
    run_b.abort();
}

#[test]
fn images_are_checked_in_the_cluster() {
    let g = group();
    let b = backend(&g);
    let name = format!("store-img-{}", std::process::id());
    let spec = format!("{}/{name}", pool());
    let out = std::process::Command::new("rbd")
        .args(["create", "--size", "1M", &spec])
        .output()
        .expect("rbd create");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(b.image_exists(&pool(), "", &name).expect("exists"));
    assert!(!b
        .image_exists(&pool(), "", "no-such-image")
        .expect("missing"));
    assert!(!b.image_exists("no-such-pool", "", &name).expect("no pool"));
    let _ = std::process::Command::new("rbd")
        .args(["rm", "--no-progress", &spec])
        .output();
}
