use super::*;
use std::time::{Duration, Instant};

/// Needs no cluster: nothing listens on the monitor address. (Without librbd on the
/// machine every open fails at once with the library error, which is fine too.)
#[test]
fn an_unreachable_cluster_fails_the_next_opens_fast() {
    let dir = std::env::temp_dir().join(format!("rbd-unreachable-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let conf = dir.join("ceph.conf");
    std::fs::write(
        &conf,
        "[global]\nmon_host = 127.0.0.1:9\nauth_client_required = none\nlog_file = /dev/null\n",
    )
    .unwrap();
    let pool = ClusterPool::new(CephSettings {
        conf: Some(conf),
        use_ceph_args_env: false,
        args: vec!["--client_mount_timeout=2".into()],
        max_connections: 2,
        ..CephSettings::default()
    });
    let spec = ImageSpec {
        pool: "rbd".into(),
        namespace: None,
        image: "img".into(),
    };
    let t = Instant::now();
    let first = pool.open(&spec).expect_err("nothing listens there");
    let first_took = t.elapsed();
    assert!(
        matches!(first, RbdError::Connect { .. } | RbdError::Library(_)),
        "{first:?}"
    );
    let t = Instant::now();
    for _ in 0..3 {
        let again = pool.open(&spec).expect_err("still unreachable");
        assert_eq!(again.to_string(), first.to_string());
    }
    assert!(
        t.elapsed() < Duration::from_millis(500),
        "later opens fail fast (first took {first_took:?}, the next three {:?})",
        t.elapsed()
    );
    assert_eq!(
        pool.images_per_connection(),
        vec![0, 0],
        "failed opens hold no slot"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
