//! Control-plane scale figures: how long a running `nvmeof-control` (RADOS-backed) takes to
//! apply many namespaces through the admin gRPC API, the requests `nvmeofctl namespace add`
//! sends, one RPC per namespace.
//!
//! `scripts/bench-scale.sh` runs it against a micro Ceph and then times a gateway starting
//! with the namespaces; by hand:
//!
//! ```sh
//! eval "$(scripts/micro-ceph.sh start)"
//! target/release/nvmeof-control --listen 127.0.0.1:5500 --pool rbd --group scale &
//! cargo run --release -p control-plane --example scale -- --namespaces 1000 --create-images
//! ```
//!
//! Printed: image creation rate (librbd `rbd_create`, setup, not the control plane), then per
//! batch of namespace adds their median and 99th percentile latency (the state grows as
//! they are added), the total and the rate, and as the baseline measured in the same run the
//! latency of a read-only RPC (`SubsystemList`) against the same replica: the ratio says what
//! the state update (compare-and-set write from the cached state, notify) costs per
//! namespace. Lines starting with `scale:` are `key=value` for scripts.

use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use control_plane::proto::{self, admin_client::AdminClient};
use control_plane::tls::{self, TlsFiles};
use rbd_backend::rbd::CephSettings;
use rbd_backend::ClusterPool;
use tonic::transport::Channel;

#[derive(Debug, Parser)]
#[command(about = "Times adding namespaces through the control plane's admin API")]
struct Args {
    /// The control-plane replica.
    #[arg(long, default_value = "127.0.0.1:5500")]
    server: String,
    /// Namespaces to add.
    #[arg(long, default_value_t = 1000)]
    namespaces: u32,
    /// Concurrent clients (each its own connection); namespaces are dealt round-robin.
    #[arg(long, default_value_t = 1)]
    clients: u32,
    /// Pool of the images.
    #[arg(long, default_value = "rbd")]
    pool: String,
    /// Image names: <prefix>-<n>, n = 1..=namespaces (also the NSIDs).
    #[arg(long, default_value = "scale")]
    prefix: String,
    /// Subsystem to add them to (created when missing).
    #[arg(long, default_value = "nqn.2016-06.io.ceph-nvmeof-rs:scale")]
    nqn: String,
    /// ANA group of every namespace (0: the control plane balances).
    #[arg(long, default_value_t = 1)]
    ana_group: u32,
    /// Create the images first (librbd, $CEPH_CONF / $CEPH_KEYRING); existing ones are kept.
    #[arg(long)]
    create_images: bool,
    /// Only create the images.
    #[arg(long)]
    images_only: bool,
    /// Only open the images through librbd (the gateway's `ClusterPool`, 8 opens at a time as
    /// the gateway does) and print the time and this process's RSS growth: the librbd share
    /// of a gateway's start time and memory per namespace.
    #[arg(long)]
    open_only: bool,
    /// With --open-only: cluster connections (default: the gateway's default, one per CPU up
    /// to 8).
    #[arg(long)]
    connections: Option<usize>,
    /// Image size in MiB (thin: nothing is written).
    #[arg(long, default_value_t = 64)]
    image_mib: u64,
    /// First NSID (to add a second batch to the same subsystem).
    #[arg(long, default_value_t = 1)]
    first: u32,
    /// Latency percentiles per this many adds.
    #[arg(long, default_value_t = 100)]
    batch: usize,
    #[arg(long, env = "NVMEOFCTL_TLS_CA")]
    tls_ca: Option<std::path::PathBuf>,
    #[arg(long, env = "NVMEOFCTL_TLS_CERT")]
    tls_cert: Option<std::path::PathBuf>,
    #[arg(long, env = "NVMEOFCTL_TLS_KEY")]
    tls_key: Option<std::path::PathBuf>,
}

fn image_name(prefix: &str, n: u32) -> String {
    format!("{prefix}-{n:05}")
}

fn create_images(args: &Args) -> Result<(), String> {
    let settings = CephSettings {
        max_connections: 1,
        ..CephSettings::default()
    };
    let cluster = ClusterPool::new(settings);
    let admin = cluster
        .admin(&args.pool, None)
        .map_err(|e| format!("cannot open pool {}: {e}", args.pool))?;
    let started = Instant::now();
    let (mut created, mut existing) = (0u32, 0u32);
    for n in args.first..args.first + args.namespaces {
        let name = image_name(&args.prefix, n);
        if admin.image_size(&name).is_ok() {
            existing += 1;
            continue;
        }
        admin
            .create_image(&name, args.image_mib << 20)
            .map_err(|e| e.to_string())?;
        created += 1;
    }
    let secs = started.elapsed().as_secs_f64();
    println!(
        "scale: images created={created} existing={existing} seconds={secs:.2} rate_per_s={:.0}",
        f64::from(created) / secs.max(1e-9)
    );
    Ok(())
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

/// Opens every image (8 at a time, the gateway's start-up parallelism) and keeps them open
/// while measuring.
fn open_images(args: &Args) -> Result<(), String> {
    const PARALLEL_OPENS: u32 = 8;
    let defaults = CephSettings::default();
    let connections = args.connections.unwrap_or(defaults.max_connections).max(1);
    let cluster = ClusterPool::new(CephSettings {
        max_connections: connections,
        ..defaults
    });
    // Connect first so that the figures are the images', not the cluster connections'.
    cluster
        .admin(&args.pool, None)
        .map_err(|e| format!("cannot open pool {}: {e}", args.pool))?;
    let before = rss_kib();
    let started = Instant::now();
    let next = std::sync::atomic::AtomicU32::new(args.first);
    let opened = std::sync::Mutex::new(Vec::new());
    let failed = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for _ in 0..PARALLEL_OPENS {
            scope.spawn(|| loop {
                let n = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if n >= args.first + args.namespaces {
                    break;
                }
                let spec = rbd_backend::ImageSpec {
                    pool: args.pool.clone(),
                    namespace: None,
                    image: image_name(&args.prefix, n),
                };
                match cluster.open_in_group(&spec, 1) {
                    Ok(d) => opened.lock().unwrap_or_else(|e| e.into_inner()).push(d),
                    Err(e) => failed
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push(format!("{spec}: {e}")),
                }
            });
        }
    });
    let secs = started.elapsed().as_secs_f64();
    std::thread::sleep(Duration::from_secs(2));
    let after = rss_kib();
    let opened = opened.into_inner().unwrap_or_else(|e| e.into_inner());
    let failed = failed.into_inner().unwrap_or_else(|e| e.into_inner());
    if let Some(first) = failed.first() {
        return Err(format!(
            "{} images not opened, first: {first}",
            failed.len()
        ));
    }
    println!(
        "scale: librbd_open images={} connections={} seconds={secs:.2} rate_per_s={:.0} \
         rss_kib_before={before} rss_kib_after={after} per_image_kib={}",
        opened.len(),
        connections,
        opened.len() as f64 / secs.max(1e-9),
        after.saturating_sub(before) / (opened.len() as u64).max(1),
    );
    drop(opened);
    Ok(())
}

async fn client(args: &Args) -> Result<AdminClient<Channel>, String> {
    let files = TlsFiles {
        ca: args.tls_ca.clone(),
        cert: args.tls_cert.clone(),
        key: args.tls_key.clone(),
    };
    let config = tls::client_tls_config(&files, None).map_err(|e| e.to_string())?;
    let channel = tls::client_endpoint(&args.server, config.as_ref())
        .map_err(|e| e.to_string())?
        .connect_timeout(Duration::from_secs(3))
        .timeout(Duration::from_secs(60))
        .connect()
        .await
        .map_err(|e| format!("{}: {}", args.server, tls::chain(&e)))?;
    Ok(AdminClient::new(channel))
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    // Nearest rank.
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Median latency of `count` read-only RPCs (the baseline: a round trip served from the
/// replica's cached state, no RADOS).
async fn read_rpc_latency(c: &mut AdminClient<Channel>, count: usize) -> Result<Duration, String> {
    let mut lat = Vec::with_capacity(count);
    for _ in 0..count {
        let t = Instant::now();
        c.subsystem_list(proto::Empty {})
            .await
            .map_err(|s| s.to_string())?;
        lat.push(t.elapsed());
    }
    lat.sort();
    Ok(percentile(&lat, 50.0))
}

async fn run(args: Arc<Args>) -> Result<(), String> {
    if args.create_images || args.images_only {
        let a = args.clone();
        tokio::task::spawn_blocking(move || create_images(&a))
            .await
            .map_err(|e| e.to_string())??;
        if args.images_only {
            return Ok(());
        }
    }
    if args.open_only {
        let a = args.clone();
        return tokio::task::spawn_blocking(move || open_images(&a))
            .await
            .map_err(|e| e.to_string())?;
    }
    let mut c = client(&args).await?;
    let listed = c
        .subsystem_list(proto::Empty {})
        .await
        .map_err(|s| s.to_string())?
        .into_inner();
    if !listed.subsystems.iter().any(|s| s.nqn == args.nqn) {
        c.subsystem_add(proto::SubsystemAddRequest {
            nqn: args.nqn.clone(),
            serial: String::new(),
            allow_any_host: true,
            max_namespaces: 0,
            require_tls: false,
        })
        .await
        .map_err(|s| format!("subsystem add: {}", s.message()))?;
    }
    let before = read_rpc_latency(&mut c, 50).await?;

    let started = Instant::now();
    let mut tasks = Vec::new();
    for k in 0..args.clients.max(1) {
        let args = args.clone();
        let mut c = client(&args).await?;
        tasks.push(tokio::spawn(async move {
            // (sequence number, latency) of each add this client made.
            let mut lat = Vec::new();
            let mut n = args.first + k;
            while n < args.first + args.namespaces {
                let t = Instant::now();
                c.namespace_add(proto::NamespaceAddRequest {
                    subsystem_nqn: args.nqn.clone(),
                    nsid: n,
                    pool: args.pool.clone(),
                    rados_namespace: String::new(),
                    image: image_name(&args.prefix, n),
                    block_size: 512,
                    ana_group: args.ana_group,
                    no_auto_visible: false,
                    ..Default::default()
                })
                .await
                .map_err(|s| format!("namespace add {n}: {}", s.message()))?;
                lat.push((t.duration_since(started), t.elapsed()));
                n += args.clients.max(1);
            }
            Ok::<_, String>(lat)
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.map_err(|e| e.to_string())??);
    }
    let total = started.elapsed();
    all.sort();
    let lat: Vec<Duration> = all.iter().map(|(_, l)| *l).collect();
    for (i, chunk) in lat.chunks(args.batch.max(1)).enumerate() {
        let mut s = chunk.to_vec();
        s.sort();
        println!(
            "scale: batch={} adds={}..{} p50_ms={:.2} p99_ms={:.2}",
            i + 1,
            i * args.batch + 1,
            i * args.batch + chunk.len(),
            ms(percentile(&s, 50.0)),
            ms(percentile(&s, 99.0)),
        );
    }
    let mut sorted = lat.clone();
    sorted.sort();
    let after = read_rpc_latency(&mut c, 50).await?;
    let p50 = percentile(&sorted, 50.0);
    println!(
        "scale: namespace_add count={} clients={} seconds={:.2} rate_per_s={:.1} p50_ms={:.2} \
         p99_ms={:.2} max_ms={:.2}",
        lat.len(),
        args.clients.max(1),
        total.as_secs_f64(),
        lat.len() as f64 / total.as_secs_f64().max(1e-9),
        ms(p50),
        ms(percentile(&sorted, 99.0)),
        ms(sorted.last().copied().unwrap_or_default()),
    );
    println!(
        "scale: baseline read_rpc_p50_ms_before={:.3} read_rpc_p50_ms_after={:.3} \
         add_over_read_ratio={:.1}",
        ms(before),
        ms(after),
        p50.as_secs_f64() / after.as_secs_f64().max(1e-9),
    );
    let t = Instant::now();
    let listed = c
        .namespace_list(proto::NamespaceListRequest {
            subsystem_nqn: args.nqn.clone(),
        })
        .await
        .map_err(|s| s.to_string())?
        .into_inner();
    println!(
        "scale: namespace_list count={} ms={:.2}",
        listed.namespaces.len(),
        ms(t.elapsed())
    );
    Ok(())
}

fn main() -> std::process::ExitCode {
    let args = Arc::new(Args::parse());
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("scale: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(args)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("scale: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
