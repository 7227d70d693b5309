//! `nvmeofctl namespace add-many`: many namespaces over one connection, from a file, against
//! an in-process control plane (in-memory state): all added in order; a refusal stops at
//! its line (the ones before stay, the message names the line); a malformed file sends
//! nothing.

use std::time::Duration;

use control_plane::proto::gateway_control_client::GatewayControlClient;
use control_plane::proto::{self, admin_client::AdminClient};
use control_plane::server::Options;
use control_plane::store::Store;
use control_plane::test_support::{self, add_subsystem_open_to_any_host, plain_channel};
use tonic::transport::Channel;

mod common;

use common::ctl;

const NQN: &str = "nqn.2016-06.io.test:add-many";

async fn start() -> String {
    let backend = test_support::memory_backend_with_images((1..=6).map(|i| format!("rbd/img{i}")));
    let cp = test_support::start_replica(Store::new(backend), "test", Options::default()).await;
    test_support::wait_for_lease(&cp, Duration::from_secs(10)).await;
    test_support::serve_plain(cp).await
}

async fn namespaces(a: &mut AdminClient<Channel>) -> Vec<(u32, String, u32)> {
    a.namespace_list(proto::NamespaceListRequest::default())
        .await
        .expect("list")
        .into_inner()
        .namespaces
        .into_iter()
        .map(|n| (n.nsid, n.image, n.ana_group))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn namespaces_from_a_file() {
    let addr = start().await;
    let mut a = AdminClient::new(plain_channel(&addr).await);
    // Two gateways, so that ANA groups 1 and 2 exist.
    let mut g = GatewayControlClient::new(plain_channel(&addr).await);
    for group in [1u32, 2] {
        g.send_beacon(proto::Beacon {
            gateway: format!("gw{group}"),
            ana_group: group,
            incarnation: u64::from(group),
            ..Default::default()
        })
        .await
        .expect("beacon");
    }
    add_subsystem_open_to_any_host(&mut a, NQN).await;

    let dir = std::env::temp_dir().join(format!("cp-add-many-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let file = |name: &str, text: &str| {
        let p = dir.join(name);
        std::fs::write(&p, text).expect("write");
        p.to_string_lossy().into_owned()
    };

    // A malformed file: usage error, nothing sent.
    let bad = file("bad.txt", "img1\nimg2 two\n");
    let (rc, _, err) = ctl(&addr, &["namespace", "add-many", "-n", NQN, "--file", &bad]);
    assert_eq!(rc, 2, "{err}");
    assert!(err.contains("bad.txt:2"), "{err}");
    assert!(
        namespaces(&mut a).await.is_empty(),
        "a malformed file added something"
    );

    let version = |a: &mut AdminClient<Channel>| {
        let mut a = a.clone();
        async move {
            a.namespace_list(proto::NamespaceListRequest::default())
                .await
                .expect("list")
                .into_inner()
                .version
        }
    };
    let before = version(&mut a).await;
    let good = file(
        "good.txt",
        "# three images\nimg1\nimg2 10 2\nimg3   # next free NSID\n",
    );
    let (rc, out, err) = ctl(
        &addr,
        &[
            "namespace",
            "add-many",
            "-n",
            NQN,
            "--ana-group",
            "1",
            "--file",
            &good,
        ],
    );
    assert_eq!(rc, 0, "{err}");
    assert!(out.contains("3 namespaces added"), "{out}");
    assert_eq!(
        namespaces(&mut a).await,
        vec![
            (1, "img1".to_string(), 1),
            (2, "img3".to_string(), 1),
            (10, "img2".to_string(), 2),
        ]
    );
    // The three went in one state update (one NamespaceAddMany).
    assert_eq!(version(&mut a).await, before + 1);

    // The second line names an image that does not exist: the first is added, the rest not.
    let partial = file("partial.txt", "img4\nmissing\nimg5\n");
    let (rc, _, err) = ctl(
        &addr,
        &["namespace", "add-many", "-n", NQN, "--file", &partial],
    );
    assert_eq!(rc, 1, "{err}");
    assert!(err.contains("partial.txt:2 (missing)"), "{err}");
    assert!(err.contains("not found"), "{err}");
    assert!(
        err.contains("the 1 namespaces before it were added"),
        "{err}"
    );
    let images: Vec<String> = namespaces(&mut a)
        .await
        .into_iter()
        .map(|(_, image, _)| image)
        .collect();
    assert!(images.contains(&"img4".to_string()), "{images:?}");
    assert!(!images.contains(&"img5".to_string()), "{images:?}");
    let _ = std::fs::remove_dir_all(&dir);
}
