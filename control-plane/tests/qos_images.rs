//! Per-namespace QoS limits and the image lifecycle (`namespace add --create-image`, `namespace
//! del --delete-image`) through the admin API, with the in-process state backend: limits set,
//! changed, cleared and refused (state unchanged), kept in the group state and pushed in the
//! assignment; images created and removed, and the refusals that leave everything as it was;
//! the namespace settings (`namespace set`: visibility, trash on delete), the subsystem key
//! (`subsystem change-key`) and the group log level (`log-level`).

use std::sync::Arc;
use std::time::Duration;

use control_plane::ana::Timing;
use control_plane::proto;
use control_plane::proto::admin_client::AdminClient;
use control_plane::proto::gateway_control_client::GatewayControlClient;
use control_plane::server::{ControlPlane, Options};
use control_plane::store::{MemoryBackend, Store};
use control_plane::test_support::{self, add_subsystem_open_to_any_host, plain_channel};
use tonic::transport::Channel;
use tonic::Code;

const NQN: &str = "nqn.2016-06.io.test:qos";
const HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:0f0f0f0f-0000-0000-0000-000000000001";

struct Fixture {
    backend: Arc<MemoryBackend>,
    cp: Arc<ControlPlane>,
    admin: AdminClient<Channel>,
    gateways: GatewayControlClient<Channel>,
}

async fn start() -> Fixture {
    let backend = test_support::memory_backend_with_images(["rbd/img1"].map(String::from));
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
    let mut admin = AdminClient::new(plain_channel(&addr).await);
    let mut gateways = GatewayControlClient::new(plain_channel(&addr).await);
    beacon(&mut gateways, false).await;
    add_subsystem_open_to_any_host(&mut admin, NQN).await;
    Fixture {
        backend,
        cp,
        admin,
        gateways,
    }
}

/// gw1's beacon, with a host connected to the subsystem or not.
async fn beacon(g: &mut GatewayControlClient<Channel>, connected: bool) {
    g.send_beacon(proto::Beacon {
        gateway: "gw1".into(),
        ana_group: 1,
        incarnation: 1,
        client_addrs: vec!["127.0.0.1:0/1".into()],
        applied_version: 0,
        connections: if connected {
            vec![proto::Connection {
                gateway: String::new(),
                subsystem_nqn: NQN.into(),
                host_nqn: HOST.into(),
                cntlid: 1,
                io_queues: 1,
                secure: false,
            }]
        } else {
            Vec::new()
        },
        cluster: 0,
        osds_unanswered: vec![],
        osd_probe: None,
    })
    .await
    .expect("beacon");
}

/// gw1 beaconing every 100 ms, as a live gateway does, until aborted.
fn keep_beaconing(
    g: &GatewayControlClient<Channel>,
    connected: bool,
) -> tokio::task::JoinHandle<()> {
    let mut g = g.clone();
    tokio::spawn(async move {
        loop {
            beacon(&mut g, connected).await;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
}

fn add(image: &str, create: bool, size: u64) -> proto::NamespaceAddRequest {
    proto::NamespaceAddRequest {
        subsystem_nqn: NQN.into(),
        pool: "rbd".into(),
        image: image.into(),
        create_image: create,
        size_bytes: size,
        ..Default::default()
    }
}

fn set_qos(nsid: u32, limits: proto::QosLimits) -> proto::NamespaceSetQosRequest {
    proto::NamespaceSetQosRequest {
        subsystem_nqn: NQN.into(),
        nsid,
        limits: Some(limits),
    }
}

async fn limits_of(a: &mut AdminClient<Channel>, nsid: u32) -> Option<proto::QosLimits> {
    a.namespace_list(proto::NamespaceListRequest::default())
        .await
        .expect("list")
        .into_inner()
        .namespaces
        .into_iter()
        .find(|n| n.nsid == nsid)
        .expect("namespace listed")
        .qos
}

fn code<T>(r: Result<T, tonic::Status>) -> Code {
    r.err().map(|s| s.code()).unwrap_or(Code::Ok)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qos_limits_are_set_changed_cleared_and_pushed() {
    let mut f = start().await;
    let a = &mut f.admin;
    a.namespace_add(proto::NamespaceAddRequest {
        qos: Some(proto::QosLimits {
            w_megabytes_per_second: Some(50),
            ..Default::default()
        }),
        ..add("img1", false, 0)
    })
    .await
    .expect("added with a limit");
    assert_eq!(
        limits_of(a, 1).await.and_then(|l| l.w_megabytes_per_second),
        Some(50)
    );
    a.namespace_set_qos(set_qos(
        1,
        proto::QosLimits {
            rw_ios_per_second: Some(2000),
            ..Default::default()
        },
    ))
    .await
    .expect("set");
    let now = limits_of(a, 1).await.expect("limited");
    assert_eq!(
        (now.rw_ios_per_second, now.w_megabytes_per_second),
        (Some(2000), Some(50)),
        "a limit not named stays"
    );
    // Pushed to the gateways with the namespace.
    let pushed = f.cp.assignment("gw1").expect("assignment");
    let ns = &pushed.namespaces[0];
    assert_eq!(
        ns.qos.as_ref().and_then(|q| q.rw_ios_per_second),
        Some(2000)
    );

    // Refused: state unchanged.
    let before = f.cp.snapshot().version;
    for (request, want) in [
        (
            set_qos(
                1,
                proto::QosLimits {
                    rw_ios_per_second: Some(5),
                    ..Default::default()
                },
            ),
            Code::InvalidArgument,
        ),
        (
            set_qos(
                1,
                proto::QosLimits {
                    r_megabytes_per_second: Some(u64::MAX),
                    ..Default::default()
                },
            ),
            Code::InvalidArgument,
        ),
        (
            set_qos(
                7,
                proto::QosLimits {
                    rw_ios_per_second: Some(1000),
                    ..Default::default()
                },
            ),
            Code::NotFound,
        ),
    ] {
        let got = a.namespace_set_qos(request).await;
        let message = got.as_ref().err().map(|s| s.message().to_string());
        assert_eq!(code(got), want, "{message:?}");
    }
    assert_eq!(f.cp.snapshot().version, before, "nothing written");
    assert_eq!(
        limits_of(a, 1).await.and_then(|l| l.rw_ios_per_second),
        Some(2000)
    );

    // 0 clears; all cleared: no limits at all.
    a.namespace_set_qos(set_qos(
        1,
        proto::QosLimits {
            rw_ios_per_second: Some(0),
            w_megabytes_per_second: Some(0),
            ..Default::default()
        },
    ))
    .await
    .expect("cleared");
    assert_eq!(limits_of(a, 1).await, None);
    // Kept in the stored state: a fresh load has what the replica has.
    let stored = Store::new(f.backend.clone()).load().expect("load");
    assert!(stored.namespaces.values().all(|n| n.qos.is_unlimited()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn images_are_created_and_deleted_with_their_namespaces() {
    let mut f = start().await;
    let a = &mut f.admin;
    let size = 64 << 20;
    a.namespace_add(add("fresh", true, size))
        .await
        .expect("created and added");
    assert!(f.backend.images.lock().unwrap().contains("rbd/fresh"));
    assert_eq!(
        f.backend.sizes.lock().unwrap().get("rbd/fresh"),
        Some(&size)
    );

    let before = f.cp.snapshot().version;
    for (request, want) in [
        // It exists now.
        (add("img1", true, size), Code::AlreadyExists),
        // No size, or not a multiple of the block size.
        (add("other", true, 0), Code::InvalidArgument),
        (add("other", true, 1000), Code::InvalidArgument),
        // A size without --create-image.
        (add("img1", false, size), Code::InvalidArgument),
        // Not there and not to be created.
        (add("missing", false, 0), Code::NotFound),
    ] {
        let got = a.namespace_add(request).await;
        let message = got.as_ref().err().map(|s| s.message().to_string());
        assert_eq!(code(got), want, "{message:?}");
    }
    f.backend.pools.lock().unwrap().insert("rbd".into());
    let got = a
        .namespace_add(proto::NamespaceAddRequest {
            pool: "nopool".into(),
            ..add("x", true, size)
        })
        .await;
    let status = got.expect_err("no pool");
    assert_eq!(status.code(), Code::NotFound);
    assert!(
        status.message().contains("pool \"nopool\" not found"),
        "{}",
        status.message()
    );
    assert_eq!(f.cp.snapshot().version, before, "nothing written");
    assert!(!f.backend.images.lock().unwrap().contains("rbd/other"));

    // A host connected: --delete-image refused unless forced; the namespace stays.
    beacon(&mut f.gateways, true).await;
    let del = |force| proto::NamespaceDelRequest {
        subsystem_nqn: NQN.into(),
        nsid: 1,
        delete_image: true,
        force,
    };
    // The gateway goes on beaconing the connection: the control plane decides on fresh
    // beacons (and gw1 stays available, so the map is not written meanwhile).
    let beaconing = keep_beaconing(&f.gateways, true);
    let refused = a.namespace_del(del(false)).await.expect_err("connected");
    beaconing.abort();
    let _ = beaconing.await;
    assert_eq!(refused.code(), Code::FailedPrecondition);
    assert!(refused.message().contains(HOST), "{}", refused.message());
    assert_eq!(f.cp.snapshot().version, before, "nothing written");
    assert!(f.backend.images.lock().unwrap().contains("rbd/fresh"));

    // Forced: namespace and image go. The image is still open by a client for a while: the
    // deletion waits for it to close.
    f.backend
        .busy_images
        .lock()
        .unwrap()
        .insert("rbd/fresh".into());
    let backend = f.backend.clone();
    let closer = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(600)).await;
        backend.busy_images.lock().unwrap().clear();
    });
    a.namespace_del(del(true)).await.expect("forced");
    closer.await.expect("closer");
    assert!(!f.backend.images.lock().unwrap().contains("rbd/fresh"));
    assert!(f.cp.snapshot().namespaces.is_empty());

    // Without --delete-image the image stays.
    beacon(&mut f.gateways, false).await;
    a.namespace_add(add("img1", false, 0)).await.expect("added");
    a.namespace_del(proto::NamespaceDelRequest {
        subsystem_nqn: NQN.into(),
        nsid: 1,
        ..Default::default()
    })
    .await
    .expect("deleted");
    assert!(f.backend.images.lock().unwrap().contains("rbd/img1"));
}

fn dhchap(byte: u8) -> String {
    nvme_auth::DhchapSecret::from_bytes(&[byte; 32], None)
        .expect("32 bytes")
        .to_representation()
        .to_string()
}

/// `namespace set` (visibility, trash on delete; the image then goes to the trash with
/// `namespace del --delete-image`, and a delete without it is refused), `subsystem
/// change-key` and `log-level`: each changes the group state the gateways are pushed, and
/// every refusal leaves it as it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn namespace_settings_subsystem_key_and_log_level() {
    let mut f = start().await;
    let a = &mut f.admin;
    a.namespace_add(proto::NamespaceAddRequest {
        subsystem_nqn: NQN.into(),
        pool: "rbd".into(),
        image: "img1".into(),
        ..Default::default()
    })
    .await
    .expect("add");
    let set = |auto_visible: Option<bool>, trash_image: Option<bool>, force: bool| {
        proto::NamespaceSetRequest {
            subsystem_nqn: NQN.into(),
            nsid: 1,
            auto_visible,
            trash_image,
            auto_resize: None,
            force,
        }
    };
    let entry = |cp: &ControlPlane| cp.state().namespaces[&(NQN.to_string(), 1)].clone();

    // Visibility: to listed hosts only, one added; back to all needs --force.
    a.namespace_set(set(Some(false), None, false))
        .await
        .expect("restrict");
    assert!(entry(&f.cp).no_auto_visible);
    a.namespace_add_host(proto::NamespaceHostRequest {
        subsystem_nqn: NQN.into(),
        nsid: 1,
        host_nqn: HOST.into(),
    })
    .await
    .expect("add host");
    let before = f.cp.state();
    let e = a
        .namespace_set(set(Some(true), None, false))
        .await
        .expect_err("a host list");
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    let e = a
        .namespace_set(set(None, None, false))
        .await
        .expect_err("nothing to set");
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    let mut missing = set(None, Some(true), false);
    missing.nsid = 9;
    let e = a.namespace_set(missing).await.expect_err("no namespace 9");
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
    assert_eq!(f.cp.state(), before, "refusals changed the state");
    a.namespace_set(set(Some(true), Some(true), true))
        .await
        .expect("all hosts, trash");
    let e1 = entry(&f.cp);
    assert!(!e1.no_auto_visible && e1.hosts.is_empty() && e1.trash_image);
    let pushed = f.cp.assignment("gw1").expect("assignment");
    assert!(pushed.namespaces[0].trash_image && !pushed.namespaces[0].no_auto_visible);

    // Auto-resize off: the image's size now is kept (stored, pushed); `namespace resize`
    // then changes the kept size (a shrink of it refused); on again follows the image.
    let auto_resize = |on: bool| proto::NamespaceSetRequest {
        auto_resize: Some(on),
        ..set(None, None, false)
    };
    let r = a
        .namespace_set(auto_resize(false))
        .await
        .expect("auto-resize off")
        .into_inner();
    assert!(r.message.contains("auto-resize off"), "{r:?}");
    assert_eq!(entry(&f.cp).frozen_size, Some(1 << 30), "the image's size");
    let pushed = f.cp.assignment("gw1").expect("assignment");
    assert_eq!(pushed.namespaces[0].frozen_size, 1 << 30);
    let resize = |size_bytes: u64| proto::NamespaceResizeRequest {
        subsystem_nqn: NQN.into(),
        nsid: 1,
        size_bytes,
    };
    let before = f.cp.state();
    let e = a
        .namespace_resize(resize(512 << 20))
        .await
        .expect_err("below the kept size");
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    let mut missing = auto_resize(false);
    missing.nsid = 9;
    let e = a.namespace_set(missing).await.expect_err("no namespace 9");
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
    assert_eq!(f.cp.state(), before, "refusals changed the state");
    a.namespace_resize(resize(2 << 30))
        .await
        .expect("resize while frozen");
    assert_eq!(entry(&f.cp).frozen_size, Some(2 << 30));
    assert_eq!(f.backend.sizes.lock().expect("sizes")["rbd/img1"], 2 << 30);
    a.namespace_set(auto_resize(true))
        .await
        .expect("auto-resize on");
    assert_eq!(entry(&f.cp).frozen_size, None);
    let pushed = f.cp.assignment("gw1").expect("assignment");
    assert_eq!(pushed.namespaces[0].frozen_size, 0);

    // Deleting a namespace whose image goes to the trash needs --delete-image; then the
    // image is in the trash.
    let del = |delete_image: bool| proto::NamespaceDelRequest {
        subsystem_nqn: NQN.into(),
        nsid: 1,
        delete_image,
        force: false,
    };
    let before = f.cp.state();
    let e = a.namespace_del(del(false)).await.expect_err("unconfirmed");
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(e.message().contains("RBD trash"), "{e:?}");
    assert_eq!(f.cp.state(), before);
    let r = a
        .namespace_del(del(true))
        .await
        .expect("deleted")
        .into_inner();
    assert!(r.message.contains("moved to the RBD trash"), "{r:?}");
    assert!(f
        .backend
        .trashed
        .lock()
        .expect("trashed")
        .contains("rbd/img1"));
    assert!(!f
        .backend
        .images
        .lock()
        .expect("images")
        .contains("rbd/img1"));

    // The subsystem key: refused while a host has no key of its own, and when malformed.
    let plain = "nqn.2014-08.org.nvmexpress:uuid:0f0f0f0f-0000-0000-0000-000000000002";
    a.host_add(proto::Host {
        subsystem_nqn: NQN.into(),
        host_nqn: HOST.into(),
        dhchap_key: dhchap(1),
        ..Default::default()
    })
    .await
    .expect("keyed host");
    a.host_add(proto::Host {
        subsystem_nqn: NQN.into(),
        host_nqn: plain.into(),
        ..Default::default()
    })
    .await
    .expect("plain host");
    let key = |k: &str| proto::SubsystemKeyRequest {
        nqn: NQN.into(),
        dhchap_key: k.into(),
    };
    let before = f.cp.state();
    let e = a
        .subsystem_change_key(key(&dhchap(9)))
        .await
        .expect_err("a host without a key");
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains(plain), "{e:?}");
    let e = a
        .subsystem_change_key(key("DHHC-1:00:nope:"))
        .await
        .expect_err("malformed");
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(!e.message().contains("nope"), "the key in {e:?}");
    assert_eq!(f.cp.state(), before, "refusals changed the state");
    a.host_del(proto::Host {
        subsystem_nqn: NQN.into(),
        host_nqn: plain.into(),
        ..Default::default()
    })
    .await
    .expect("del plain");
    a.subsystem_change_key(key(&dhchap(9)))
        .await
        .expect("key set");
    let pushed = f.cp.assignment("gw1").expect("assignment");
    let s = &pushed.subsystems[0];
    assert!(s.has_dhchap_key);
    assert_eq!(s.host_entries[0].dhchap_ctrl_key, dhchap(9));
    let listed = a
        .subsystem_list(proto::Empty {})
        .await
        .expect("list")
        .into_inner();
    assert!(listed.subsystems[0].has_dhchap_key);
    assert!(
        listed.subsystems[0]
            .host_entries
            .iter()
            .all(|h| h.dhchap_key.is_empty() && h.dhchap_ctrl_key.is_empty()),
        "keys in a listing"
    );
    a.subsystem_change_key(key("")).await.expect("key removed");
    assert_eq!(f.cp.state().subsystems[NQN].dhchap_key, None);

    // The log level: group-wide, pushed; refused when unknown; reset.
    let level = |l: &str| proto::LogLevelRequest { level: l.into() };
    let before = f.cp.state();
    let e = a
        .log_level_set(level("loud"))
        .await
        .expect_err("unknown level");
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert_eq!(f.cp.state(), before);
    a.log_level_set(level("debug")).await.expect("debug");
    let got = a
        .log_level_get(proto::Empty {})
        .await
        .expect("get")
        .into_inner();
    assert_eq!(got.group, "debug");
    assert_eq!(
        f.cp.assignment("gw1").expect("assignment").log_level,
        "debug"
    );
    a.log_level_set(level("")).await.expect("reset");
    assert_eq!(f.cp.state().settings.log_level, None);
    assert_eq!(f.cp.assignment("gw1").expect("assignment").log_level, "");
}

/// `namespace del --delete-image` right after the last host disconnected: the request can
/// reach the control plane before the gateway's beacon that reports the disconnect (issue
/// 51: refused for about 2 s with "hosts are connected"). The control plane waits for the
/// gateway's next beacons before it refuses: here the disconnect is beaconed 150 ms after
/// the request, and the deletion succeeds. A host that stays connected (the gateway keeps
/// beaconing it) is refused, within two beacons, and nothing is deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_image_right_after_the_last_disconnect_is_not_refused() {
    let mut f = start().await;
    let size = 64 << 20;
    let del = proto::NamespaceDelRequest {
        subsystem_nqn: NQN.into(),
        nsid: 1,
        delete_image: true,
        force: false,
    };

    // Still connected: the gateway beacons the connection every 100 ms.
    f.admin
        .namespace_add(add("kept", true, size))
        .await
        .expect("added");
    beacon(&mut f.gateways, true).await;
    let beaconing = keep_beaconing(&f.gateways, true);
    let t0 = std::time::Instant::now();
    let refused = f
        .admin
        .namespace_del(del.clone())
        .await
        .expect_err("a host is connected");
    beaconing.abort();
    let _ = beaconing.await;
    assert_eq!(refused.code(), Code::FailedPrecondition);
    assert!(refused.message().contains(HOST), "{}", refused.message());
    assert!(
        t0.elapsed() < Duration::from_millis(2500),
        "decided on two fresh beacons, not the bound: {:?}",
        t0.elapsed()
    );
    assert!(f.backend.images.lock().unwrap().contains("rbd/kept"));
    assert_eq!(f.cp.snapshot().namespaces.len(), 1);

    // The host disconnects; the request is sent before the gateway's beacon says so.
    let mut g = f.gateways.clone();
    let disconnect = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(150)).await;
        beacon(&mut g, false).await;
    });
    let t0 = std::time::Instant::now();
    let deleted = f.admin.namespace_del(del.clone()).await;
    disconnect.await.expect("beacon task");
    deleted.expect("no host connected any more: deleted, not refused");
    assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    assert!(!f.backend.images.lock().unwrap().contains("rbd/kept"));
    assert!(f.cp.snapshot().namespaces.is_empty());

    // Already reported gone: deleted at once.
    f.admin
        .namespace_add(add("again", true, size))
        .await
        .expect("added");
    let t0 = std::time::Instant::now();
    f.admin.namespace_del(del).await.expect("deleted");
    assert!(
        t0.elapsed() < Duration::from_millis(500),
        "{:?}",
        t0.elapsed()
    );
    assert!(!f.backend.images.lock().unwrap().contains("rbd/again"));
}
