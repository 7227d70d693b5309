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

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use control_plane::server::{ControlPlane, Options};
use control_plane::store::{Backend, RadosBackend, Store};
use control_plane::test_support::{ceph_pool, ceph_settings};

static NEXT: AtomicU64 = AtomicU64::new(0);

fn group() -> String {
    format!(
        "store-test-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::SeqCst)
    )
}

fn backend(group: &str) -> Arc<RadosBackend> {
    Arc::new(RadosBackend::connect(&ceph_settings(), &ceph_pool(), group).expect("state object"))
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

/// Serves `cp`'s admin API on loopback; returns a client.
async fn admin(
    cp: &Arc<ControlPlane>,
) -> control_plane::proto::admin_client::AdminClient<tonic::transport::Channel> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(control_plane::server::serve(
        cp.clone(),
        listener,
        std::future::pending::<()>(),
    ));
    let channel = tonic::transport::Channel::from_shared(format!("http://{addr}"))
        .expect("url")
        .connect()
        .await
        .expect("connect");
    control_plane::proto::admin_client::AdminClient::new(channel)
}

/// Two replicas take admin requests at once, each updating from its own cached state: every
/// write lands once (a write from a stale cache is refused by the compare on `version` and
/// redone), and both caches end equal to the stored state, following each other's writes
/// from the notifies. A write announced the old way (`changed`, no delta) is re-read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_writing_at_once_from_their_caches_converge() {
    let g = group();
    let a = ControlPlane::start(Store::new(backend(&g)), "a".into(), Options::default())
        .await
        .expect("a");
    let b = ControlPlane::start(Store::new(backend(&g)), "b".into(), Options::default())
        .await
        .expect("b");
    let mut tasks = Vec::new();
    for (t, cp) in [a.clone(), b.clone()].into_iter().enumerate() {
        let mut client = admin(&cp).await;
        tasks.push(tokio::spawn(async move {
            for i in 0..20 {
                client
                    .subsystem_add(control_plane::proto::SubsystemAddRequest {
                        nqn: nqn(t * 100 + i),
                        allow_any_host: true,
                        ..Default::default()
                    })
                    .await
                    .expect("subsystem add");
            }
        }));
    }
    for t in tasks {
        t.await.expect("client");
    }
    let store = Store::new(backend(&g));
    let stored = store.load().expect("load");
    assert_eq!(stored.subsystems.len(), 40);
    assert_eq!(stored.version, 40);
    let converged = |cp: &Arc<ControlPlane>, want: &control_plane::state::GroupState| {
        let st = cp.state();
        st.version == want.version && st.subsystems == want.subsystems
    };
    let started = Instant::now();
    while !(converged(&a, &stored) && converged(&b, &stored)) {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "caches never converged: a at {}, b at {}, stored {}",
            a.state().version,
            b.state().version,
            stored.version
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // An older replica's write: the keys, the version, and a bare `changed`.
    let raw = backend(&g);
    let mut old = stored.clone();
    old.add_subsystem(&nqn(999), "", true, 0).expect("add");
    let (set, remove) = old.diff(&stored);
    assert!(raw.compare_and_set(40, set, remove).expect("write"));
    raw.notify(b"changed");
    let started = Instant::now();
    while !(a.state().subsystems.contains_key(&nqn(999))
        && b.state().subsystems.contains_key(&nqn(999)))
    {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "a plain notify was not followed by a re-read"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(a.state().version, 41);
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
    let spec = format!("{}/{name}", ceph_pool());
    let out = std::process::Command::new("rbd")
        .args(["create", "--size", "1M", &spec])
        .output()
        .expect("rbd create");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(b.image_exists(&ceph_pool(), "", &name).expect("exists"));
    assert!(!b
        .image_exists(&ceph_pool(), "", "no-such-image")
        .expect("missing"));
    assert!(!b.image_exists("no-such-pool", "", &name).expect("no pool"));
    let _ = std::process::Command::new("rbd")
        .args(["rm", "--no-progress", &spec])
        .output();
}

/// `namespace add --create-image` / `namespace del --delete-image` against the cluster: an
/// image created with its size, a second create refused as existing, a missing pool named,
/// an image still open refused as busy, then removed; removing it again: not found.
#[test]
fn images_are_created_and_removed_in_the_cluster() {
    use control_plane::store::{ImageError, StoreError};
    let g = group();
    let b = backend(&g);
    let pool = ceph_pool();
    let name = format!("store-new-{}", std::process::id());
    let size = 8u64 << 20;
    b.create_image(&pool, "", &name, size).expect("created");
    assert!(b.image_exists(&pool, "", &name).expect("exists"));
    let info = std::process::Command::new("rbd")
        .args(["info", "--format", "json", &format!("{pool}/{name}")])
        .output()
        .expect("rbd info");
    let info = String::from_utf8_lossy(&info.stdout);
    assert!(info.contains(&format!("\"size\":{size}")), "{info}");
    match b.create_image(&pool, "", &name, size) {
        Err(StoreError::Image(ImageError::Exists(spec))) => {
            assert_eq!(spec, format!("{pool}/{name}"))
        }
        other => panic!("a second create: {other:?}"),
    }
    match b.create_image("no-such-pool", "", &name, size) {
        Err(StoreError::Image(ImageError::NoPool(p))) => assert_eq!(p, "no-such-pool"),
        other => panic!("create in a missing pool: {other:?}"),
    }
    // Open (watched) by a client: librbd refuses to remove it.
    let images = rbd_backend::ClusterPool::new(ceph_settings());
    let open = images
        .open(&rbd_backend::rbd::ImageSpec {
            pool: pool.clone(),
            namespace: None,
            image: name.clone(),
        })
        .expect("open");
    match b.remove_image(&pool, "", &name) {
        Err(StoreError::Image(ImageError::Busy(_))) => {}
        other => panic!("remove while open: {other:?}"),
    }
    drop(open);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match b.remove_image(&pool, "", &name) {
            Ok(()) => break,
            Err(StoreError::Image(ImageError::Busy(_))) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(200))
            }
            other => panic!("remove once closed: {other:?}"),
        }
    }
    assert!(!b.image_exists(&pool, "", &name).expect("gone"));
    match b.remove_image(&pool, "", &name) {
        Err(StoreError::Image(ImageError::NotFound(_))) => {}
        other => panic!("remove again: {other:?}"),
    }
}

/// The ceph-nvmeof API's `rbd_image_size` and trash-on-delete against the cluster: an
/// image's size as RBD has it (after a grow too), a missing image named; the image moved to
/// the pool's RBD trash while a client has it open (`rbd trash ls` lists it, `rbd ls` no
/// longer); trashing it again: not found.
#[test]
fn image_sizes_are_read_and_images_go_to_the_trash() {
    use control_plane::store::{ImageError, StoreError};
    let g = group();
    let b = backend(&g);
    let pool = ceph_pool();
    let name = format!("store-trash-{}", std::process::id());
    b.create_image(&pool, "", &name, 8 << 20).expect("created");
    assert_eq!(b.image_size(&pool, "", &name).expect("size"), 8 << 20);
    b.grow_image(&pool, "", &name, 16 << 20).expect("grown");
    assert_eq!(b.image_size(&pool, "", &name).expect("size"), 16 << 20);
    match b.image_size(&pool, "", "no-such-image") {
        Err(StoreError::Image(ImageError::NotFound(spec))) => {
            assert_eq!(spec, format!("{pool}/no-such-image"))
        }
        other => panic!("size of a missing image: {other:?}"),
    }
    // librbd moves an image that a client has open to the trash (that client's handle
    // works on until it closes it): the control plane trashes a deleted namespace's image
    // without waiting for the gateways to close it.
    let images = rbd_backend::ClusterPool::new(ceph_settings());
    let open = images
        .open(&rbd_backend::rbd::ImageSpec {
            pool: pool.clone(),
            namespace: None,
            image: name.clone(),
        })
        .expect("open");
    b.trash_image(&pool, "", &name).expect("trashed while open");
    drop(open);
    assert!(!b.image_exists(&pool, "", &name).expect("not in the pool"));
    let rbd = |args: &[&str]| {
        let out = std::process::Command::new("rbd")
            .args(args)
            .output()
            .expect("rbd");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let trash = rbd(&["trash", "ls", &pool]);
    let line = trash
        .lines()
        .find(|l| l.split_whitespace().nth(1) == Some(name.as_str()))
        .unwrap_or_else(|| panic!("{name} not in the trash: {trash}"));
    assert!(!rbd(&["ls", &pool]).lines().any(|l| l == name));
    match b.trash_image(&pool, "", &name) {
        Err(StoreError::Image(ImageError::NotFound(_))) => {}
        other => panic!("trash again: {other:?}"),
    }
    // Leave the cluster as found.
    let id = line.split_whitespace().next().unwrap_or_default();
    rbd(&["trash", "rm", &format!("{pool}/{id}")]);
}
