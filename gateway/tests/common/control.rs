//! An `nvmeof-control` replica run inside the test, its group state in RADOS, serving the
//! gRPC API on an ephemeral loopback port, and the admin requests the tests send to it.

use std::sync::Arc;
use std::time::Duration;

use control_plane::ana::Timing;
use control_plane::proto::{self, admin_client::AdminClient};
use control_plane::server::{ControlPlane, Options};
use control_plane::store::{RadosBackend, Store};
use control_plane::test_support;
use tonic::transport::Channel;

use super::ceph::{ceph_settings, pool};
use super::poll_until;

/// How long a gateway may stay silent before it is declared dead and fenced: short, so that
/// failovers happen within the tests' waits, yet several of the gateways' 250 ms beacons.
pub const GRACE_MS: u64 = 1500;

/// A running replica (it runs until the test's runtime ends).
pub struct RadosControlPlane {
    pub cp: Arc<ControlPlane>,
    /// Where its gRPC API listens (`127.0.0.1:port`).
    pub addr: String,
    /// The RADOS object holding the group's state (removed by the tests that clean up).
    pub state_oid: String,
}

/// Starts a replica keeping the state of `group` in the test pool; a gateway is fenced after
/// [`GRACE_MS`] of silence and a group fails back `failback_delay_ms` after its owner is back.
pub async fn start_rados_control_plane(group: &str, failback_delay_ms: u64) -> RadosControlPlane {
    start_rados_control_plane_with_grace(group, failback_delay_ms, GRACE_MS).await
}

/// The same with a beacon grace of `grace_ms`.
pub async fn start_rados_control_plane_with_grace(
    group: &str,
    failback_delay_ms: u64,
    grace_ms: u64,
) -> RadosControlPlane {
    start_rados_control_plane_with(group, failback_delay_ms, grace_ms, LEASE).await
}

/// The same with a leader lease of `lease`: how long the replica still leads once it cannot
/// renew the lease (its state object's OSD stopped).
pub async fn start_rados_control_plane_with_lease(
    group: &str,
    failback_delay_ms: u64,
    lease: Duration,
) -> RadosControlPlane {
    start_rados_control_plane_with(group, failback_delay_ms, GRACE_MS, lease).await
}

const LEASE: Duration = Duration::from_secs(3);

async fn start_rados_control_plane_with(
    group: &str,
    failback_delay_ms: u64,
    grace_ms: u64,
    lease: Duration,
) -> RadosControlPlane {
    let (settings, pool, group) = (ceph_settings(), pool(), group.to_string());
    // Connecting blocks (librados): off the runtime's threads.
    let backend =
        tokio::task::spawn_blocking(move || RadosBackend::connect(&settings, &pool, &group))
            .await
            .expect("join")
            .expect("state object");
    let state_oid = backend.oid().to_string();
    let options = Options {
        timing: Timing {
            grace_ms,
            failback_delay_ms,
        },
        lease,
        tick: Duration::from_millis(100),
    };
    let cp =
        test_support::start_replica(Store::new(Arc::new(backend)), "test-replica", options).await;
    let addr = test_support::serve_plain(cp.clone()).await;
    RadosControlPlane {
        cp,
        addr,
        state_oid,
    }
}

/// A plain-text gRPC channel to the replica at `addr`.
pub use control_plane::test_support::plain_channel as channel;

/// An admin client (what `nvmeofctl` uses) of the replica at `addr`.
pub async fn admin_client(addr: &str) -> AdminClient<Channel> {
    AdminClient::new(channel(addr).await)
}

/// Adds a namespace in an ANA group that exists only once its gateway has beaconed: retried
/// while the replica answers Not Found, for up to 20 s.
pub async fn add_namespace_once_its_group_exists(
    admin: &mut AdminClient<Channel>,
    request: proto::NamespaceAddRequest,
) {
    poll_until(
        Duration::from_secs(20),
        Duration::from_millis(200),
        async || match admin.namespace_add(request.clone()).await {
            Ok(_) => Ok(()),
            Err(s) if s.code() == tonic::Code::NotFound => {
                Err(format!("namespace add: the ANA group never appeared: {s}"))
            }
            Err(s) => panic!("namespace add: {s}"),
        },
    )
    .await
}

/// The `nvmeofctl` binary: `$NVMEOFCTL`, else the one next to the gateway binary built for
/// the tests (`cargo build -p control-plane --bin nvmeofctl` builds it there; the Ceph test
/// script does). Panics with that hint when it is missing.
pub fn nvmeofctl_binary() -> std::path::PathBuf {
    let path = std::env::var_os("NVMEOFCTL")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::Path::new(env!("CARGO_BIN_EXE_nvmeof-gateway")).with_file_name("nvmeofctl")
        });
    assert!(
        path.exists(),
        "{} not found: build it with `cargo build -p control-plane --bin nvmeofctl` (or set \
         NVMEOFCTL)",
        path.display()
    );
    path
}

/// Runs `nvmeofctl --server ADDR ARGS` (see [`nvmeofctl_binary`]), with nothing taken from
/// the environment: its exit code (-1: killed by a signal), standard output and error.
pub fn nvmeofctl(addr: &str, args: &[&str]) -> (i32, String, String) {
    let out = std::process::Command::new(nvmeofctl_binary())
        .args(["--server", addr])
        .args(args)
        .env_remove("NVMEOFCTL_TLS_CA")
        .env_remove("NVMEOFCTL_TLS_CERT")
        .env_remove("NVMEOFCTL_TLS_KEY")
        .env_remove("NVMEOFCTL_SERVER")
        .output()
        .expect("run nvmeofctl");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}
