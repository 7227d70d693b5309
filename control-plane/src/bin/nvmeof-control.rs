//! `nvmeof-control`: one replica of the gateway group's control plane (gRPC).
//!
//! The group state lives in the RADOS object `nvmeof.<group>.state` of `--pool`; run several
//! replicas against the same object: one leads (RADOS lock with a lease), the others serve
//! admin requests and gateways' assignment streams and take over when the lease lapses.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use clap::Parser;
use control_plane::ana::Timing;
use control_plane::health::{retry_pause, ReplicaHealth};
use control_plane::server::{ControlPlane, Options};
use control_plane::store::{Backend, MemoryBackend, RadosBackend, Store};
use control_plane::tls::{self, TlsFiles};
use metrics_exposition::MetricsServer;
use rbd_backend::rbd::CephSettings;
use tokio::sync::watch;

#[derive(Debug, Parser)]
#[command(version, about = "NVMe-oF gateway group control plane (gRPC)")]
struct Args {
    /// gRPC address to listen on.
    #[arg(long, default_value = "127.0.0.1:5500")]
    listen: String,
    /// Gateway group name (the state object is `nvmeof.<group>.state`).
    #[arg(long, default_value = "default")]
    group: String,
    /// Pool holding the state object.
    #[arg(long, default_value = "rbd")]
    pool: String,
    /// ceph.conf (default: $CEPH_CONF, then Ceph's search list).
    #[arg(long)]
    ceph_conf: Option<PathBuf>,
    /// Keyring (default: what the conf or $CEPH_KEYRING say).
    #[arg(long)]
    keyring: Option<PathBuf>,
    /// Ceph client entity.
    #[arg(long, default_value = "client.admin")]
    client_name: String,
    /// Replica name (default: the listen address).
    #[arg(long)]
    id: Option<String>,
    /// Missed-beacon time before a gateway is declared dead, in ms.
    #[arg(long, default_value_t = 2000)]
    grace_ms: u64,
    /// How long a returning owner must be up before failback, in ms.
    #[arg(long, default_value_t = 1000)]
    failback_delay_ms: u64,
    /// Leader lease in ms (renewed every third).
    #[arg(long, default_value_t = 6000)]
    lease_ms: u64,
    /// `memory`: keep the state in this process only (tests and demos without Ceph; lost at
    /// exit). Default `rados`.
    #[arg(long, default_value = "rados")]
    store: String,
    /// mTLS: this replica's certificate (PEM). With --tls-key and --tls-ca, gRPC is served
    /// over TLS and only clients with a certificate signed by the CA are accepted.
    #[arg(long, env = "NVMEOF_CONTROL_TLS_CERT")]
    tls_cert: Option<PathBuf>,
    /// mTLS: the private key of --tls-cert (PEM).
    #[arg(long, env = "NVMEOF_CONTROL_TLS_KEY")]
    tls_key: Option<PathBuf>,
    /// mTLS: the CA certificate(s) that clients' (gateways', nvmeofctl's) certificates must
    /// chain to (PEM).
    #[arg(long, env = "NVMEOF_CONTROL_TLS_CA")]
    tls_ca: Option<PathBuf>,
    /// Serve Prometheus metrics (`GET /metrics`) on this address, e.g. 0.0.0.0:10010
    /// (default: none).
    #[arg(long)]
    metrics_listen: Option<std::net::SocketAddr>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    // The log filter follows the group's log level once one is set (`log-level set`).
    control_plane::log_level::init();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("nvmeof-control: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(run(args));
    // A Ceph connect attempt still blocking (up to client_mount_timeout) must not hold the
    // exit past a supervisor's grace period.
    runtime.shutdown_timeout(Duration::from_secs(1));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("nvmeof-control: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> Result<(), String> {
    // Checked first: a TLS mistake must not leave a replica serving in the clear.
    let tls = tls::server_tls_config(&TlsFiles {
        ca: args.tls_ca.clone(),
        cert: args.tls_cert.clone(),
        key: args.tls_key.clone(),
    })
    .map_err(|e| e.to_string())?;
    if args.store != "memory" && args.store != "rados" {
        return Err(format!("--store {}: expected rados or memory", args.store));
    }
    // Shutdown: out of the endpoints at once, then the gRPC server stops.
    let health = ReplicaHealth::new();
    let _heartbeat = health.spawn_heartbeat();
    let (stop_tx, stop) = watch::channel(false);
    {
        let health = health.clone();
        tokio::spawn(async move {
            shutdown_signal().await;
            health.shutting_down();
            let _ = stop_tx.send(true);
        });
    }
    // Served from the start, so the probes say why a replica is not ready yet (and until
    // this function returns: dropping the stop switch ends it).
    let replica: Arc<OnceLock<Weak<ControlPlane>>> = Arc::new(OnceLock::new());
    let _metrics_stop = match args.metrics_listen {
        Some(addr) => Some(serve_metrics(addr, replica.clone(), &health).await?),
        None => None,
    };
    // A replica that cannot reach Ceph (keyring not mounted yet, cluster unreachable) keeps
    // trying and says why, instead of exiting into a restart loop.
    let Some(cp) = start_replica(&args, &health, stop.clone()).await else {
        tracing::info!("stopped before serving");
        return Ok(());
    };
    let _ = replica.set(Arc::downgrade(&cp));
    let listener = tokio::net::TcpListener::bind(&args.listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", args.listen))?;
    tracing::info!(
        listen = %args.listen,
        replica = %cp.id(),
        mtls = tls.is_some(),
        "nvmeof-control serving"
    );
    tokio::spawn(cp.clone().run());
    health.serving();
    let mut stopped = stop.clone();
    tls::serve(cp, listener, tls, async move {
        let _ = stopped.wait_for(|s| *s).await;
    })
    .await
    .map_err(|e| match std::error::Error::source(&e) {
        Some(cause) => format!("gRPC server: {e}: {cause}"),
        None => format!("gRPC server: {e}"),
    })?;
    tracing::info!("stopped");
    Ok(())
}

/// Connects to the group state and loads it, retrying with a growing pause (at most
/// `MAX_RETRY_PAUSE`) while Ceph cannot be reached; None: stopped meanwhile. Each new
/// reason is logged once at error level (then at debug level per attempt) and is what
/// `/readyz` answers.
async fn start_replica(
    args: &Args,
    health: &Arc<ReplicaHealth>,
    mut stop: watch::Receiver<bool>,
) -> Option<Arc<ControlPlane>> {
    let opts = Options {
        timing: Timing {
            grace_ms: args.grace_ms,
            failback_delay_ms: args.failback_delay_ms,
        },
        lease: Duration::from_millis(args.lease_ms.max(300)),
        ..Options::default()
    };
    let id = args.id.clone().unwrap_or_else(|| args.listen.clone());
    let mut last_error = String::new();
    let mut attempt = 0u32;
    // Until the first attempt ends (a cluster that does not answer takes client_mount_timeout).
    health.not_ready(format!(
        "connecting to the Ceph cluster for the group state in pool {}",
        args.pool
    ));
    loop {
        attempt += 1;
        let started = tokio::select! {
            _ = stop.wait_for(|s| *s) => return None,
            r = open_state(args, id.clone(), opts) => r,
        };
        let error = match started {
            Ok(cp) => {
                if attempt > 1 {
                    tracing::info!(attempts = attempt, "group state reached");
                }
                return Some(cp);
            }
            Err(e) => e,
        };
        let pause = retry_pause(attempt);
        if error != last_error {
            tracing::error!(
                retry_in_s = pause.as_secs(),
                "not ready: {error}; retrying until it works"
            );
            last_error = error.clone();
        } else {
            tracing::debug!(attempt, "still failing: {error}");
        }
        health.not_ready(error);
        tokio::select! {
            _ = stop.wait_for(|s| *s) => return None,
            _ = tokio::time::sleep(pause) => {}
        }
    }
}

/// One attempt: the backend (a RADOS connection and the state object), then the state.
async fn open_state(args: &Args, id: String, opts: Options) -> Result<Arc<ControlPlane>, String> {
    let backend: Arc<dyn Backend> = match args.store.as_str() {
        "memory" => Arc::new(MemoryBackend::default()),
        _ => {
            let settings = CephSettings {
                conf: args.ceph_conf.clone(),
                keyring: args.keyring.clone(),
                client_name: args.client_name.clone(),
                max_connections: 1,
                ..CephSettings::default()
            };
            let (pool, group) = (args.pool.clone(), args.group.clone());
            let b = tokio::task::spawn_blocking(move || {
                RadosBackend::connect(&settings, &pool, &group)
            })
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| format!("cannot open the group state in pool {}: {e}", args.pool))?;
            tracing::info!(pool = %args.pool, object = %b.oid(), "group state in RADOS");
            Arc::new(b)
        }
    };
    ControlPlane::start(Store::new(backend), id, opts)
        .await
        .map_err(|e| format!("cannot load the group state: {e}"))
}

/// Serves the replica's metrics (once it runs) and its probes on `addr`; returns the
/// server's stop switch.
async fn serve_metrics(
    addr: std::net::SocketAddr,
    replica: Arc<OnceLock<Weak<ControlPlane>>>,
    health: &Arc<ReplicaHealth>,
) -> Result<watch::Sender<bool>, String> {
    let render = Arc::new(move || {
        replica
            .get()
            .and_then(Weak::upgrade)
            .map(|cp| control_plane::metrics::render(&cp))
            .unwrap_or_default()
    });
    let server = MetricsServer::bind(addr, render)
        .await
        .map_err(|e| format!("cannot listen for metrics on {addr}: {e}"))?
        .with_health(health.checks());
    tracing::info!(%addr, "metrics at http://{addr}/metrics");
    let (stop, stopped) = watch::channel(false);
    tokio::spawn(server.serve(stopped));
    Ok(stop)
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        let _ = tokio::signal::ctrl_c().await;
        return;
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM received"),
        _ = int.recv() => tracing::info!("SIGINT received"),
    }
}
