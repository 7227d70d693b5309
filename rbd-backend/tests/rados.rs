//! `rbd_backend::rados` against a real Ceph cluster (never a mock): omap compare-and-set,
//! lock leases between two clients, watch/notify, and blocklisting a client.
//!
//! Compiled only with `--features ceph-tests` (then a missing cluster fails the tests):
//!
//! ```sh
//! eval "$(scripts/micro-ceph.sh start)"
//! cargo test -p rbd-backend --features ceph-tests --test rados
//! ```
#![cfg(feature = "ceph-tests")]

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use rbd_backend::rados::{Client, RadosError, WatchEvent};
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

fn pool_name() -> String {
    std::env::var("MICRO_CEPH_POOL").unwrap_or_else(|_| "rbd".into())
}

static NEXT: AtomicU64 = AtomicU64::new(0);

fn oid(what: &str) -> String {
    format!(
        "rados-test.{what}.{}.{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::SeqCst)
    )
}

fn kv(k: &str, v: &str) -> (String, Vec<u8>) {
    (k.to_string(), v.as_bytes().to_vec())
}

#[test]
fn omap_compare_and_set_is_atomic() {
    let c = Client::connect(&settings()).expect("connect");
    let p = c.pool(&pool_name(), None).expect("pool");
    let o = oid("cas");
    assert!(matches!(p.omap_get_all(&o), Err(RadosError::NotFound(_))));
    // First write: "version" missing compares as empty.
    p.omap_compare_and_set(
        &o,
        &[kv("version", "")],
        &[kv("version", "1"), kv("a", "x")],
        &[],
    )
    .expect("create");
    let m = p.omap_get_all(&o).expect("read");
    assert_eq!(m.get("version").map(Vec::as_slice), Some(&b"1"[..]));
    assert_eq!(m.get("a").map(Vec::as_slice), Some(&b"x"[..]));
    // A stale writer fails and changes nothing.
    let r = p.omap_compare_and_set(&o, &[kv("version", "")], &[kv("a", "stale")], &[]);
    assert!(matches!(r, Err(RadosError::CompareFailed(_))), "{r:?}");
    assert_eq!(p.omap_get_all(&o).expect("read"), m);
    // The current writer sets and removes in one op.
    p.omap_compare_and_set(
        &o,
        &[kv("version", "1")],
        &[kv("version", "2"), kv("b", "y")],
        &["a".into()],
    )
    .expect("update");
    let m = p.omap_get_all(&o).expect("read");
    assert_eq!(m.len(), 2);
    assert_eq!(m.get("b").map(Vec::as_slice), Some(&b"y"[..]));
    // More entries than one page.
    let many: Vec<_> = (0..1300).map(|i| kv(&format!("k{i:05}"), "v")).collect();
    p.omap_compare_and_set(&o, &[kv("version", "2")], &many, &[])
        .expect("many");
    assert_eq!(p.omap_get_all(&o).expect("read").len(), 1302);
    p.remove(&o).expect("remove");
}

#[test]
fn a_lock_lease_excludes_other_clients_until_it_lapses() {
    let a = Client::connect(&settings()).expect("a");
    let b = Client::connect(&settings()).expect("b");
    let pa = a.pool(&pool_name(), None).expect("pool");
    let pb = b.pool(&pool_name(), None).expect("pool");
    let o = oid("lock");
    let lease = Duration::from_secs(2);
    pa.lock_lease(&o, "leader", "a", "test", lease)
        .expect("a takes it");
    pa.lock_lease(&o, "leader", "a", "test", lease)
        .expect("a renews it");
    let r = pb.lock_lease(&o, "leader", "b", "test", lease);
    assert!(matches!(r, Err(RadosError::LockBusy { .. })), "{r:?}");
    // a stops renewing: b gets it once the lease lapses.
    let started = Instant::now();
    loop {
        match pb.lock_lease(&o, "leader", "b", "test", lease) {
            Ok(()) => break,
            Err(RadosError::LockBusy { .. }) if started.elapsed() < Duration::from_secs(10) => {
                std::thread::sleep(Duration::from_millis(200))
            }
            Err(e) => panic!("b never got the lock: {e}"),
        }
    }
    assert!(started.elapsed() >= Duration::from_millis(1500));
    let r = pa.lock_lease(&o, "leader", "a", "test", lease);
    assert!(matches!(r, Err(RadosError::LockBusy { .. })), "{r:?}");
    pb.unlock(&o, "leader", "b").expect("unlock");
    pa.lock_lease(&o, "leader", "a", "test", lease)
        .expect("a again");
    pa.unlock(&o, "leader", "a").expect("unlock");
    pa.remove(&o).expect("remove");
}

#[test]
fn watchers_get_notifies() {
    let a = Client::connect(&settings()).expect("a");
    let b = Client::connect(&settings()).expect("b");
    let pa = a.pool(&pool_name(), None).expect("pool");
    let pb = b.pool(&pool_name(), None).expect("pool");
    let o = oid("watch");
    pa.omap_compare_and_set(&o, &[], &[kv("version", "1")], &[])
        .expect("create");
    let (tx, rx) = mpsc::channel();
    let tx = std::sync::Mutex::new(tx);
    let watch = pb
        .watch(&o, move |e| {
            let _ = tx.lock().map(|t| t.send(e));
        })
        .expect("watch");
    pa.notify(&o, b"changed 2", Duration::from_secs(5))
        .expect("notify");
    assert_eq!(
        rx.recv_timeout(Duration::from_secs(5)).expect("event"),
        WatchEvent::Notify(b"changed 2".to_vec())
    );
    drop(watch);
    pa.notify(&o, b"after", Duration::from_secs(5))
        .expect("notify");
    assert!(rx.recv_timeout(Duration::from_millis(500)).is_err());
    pa.remove(&o).expect("remove");
}

#[test]
fn a_blocklisted_client_can_no_longer_write() {
    let admin = Client::connect(&settings()).expect("admin");
    let victim = Client::connect(&settings()).expect("victim");
    let pv = victim.pool(&pool_name(), None).expect("pool");
    let o = oid("fence");
    pv.omap_compare_and_set(&o, &[], &[kv("k", "before")], &[])
        .expect("write before");
    let addrs = victim.addrs().expect("addrs");
    assert!(addrs.contains('/'), "{addrs}");
    assert!(rbd_backend::rados::process_client_addrs().contains(&addrs));
    let epoch_before = admin.osdmap_epoch().expect("epoch");
    admin
        .blocklist_add(&addrs, Some(Duration::from_secs(600)))
        .expect("blocklist");
    assert!(admin.osdmap_epoch().expect("epoch") > epoch_before);
    victim.wait_for_latest_osdmap().expect("osdmap");
    let started = Instant::now();
    let r = pv.omap_compare_and_set(&o, &[], &[kv("k", "after")], &[]);
    assert!(r.is_err(), "a blocklisted client wrote");
    assert!(started.elapsed() < Duration::from_secs(10));
    let pa = admin.pool(&pool_name(), None).expect("pool");
    let m = pa.omap_get_all(&o).expect("read");
    assert_eq!(m.get("k").map(Vec::as_slice), Some(&b"before"[..]));
    admin.blocklist_rm(&addrs).expect("unblock");
    pa.remove(&o).expect("remove");
}
