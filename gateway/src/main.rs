//! `nvmeof-gateway`: serves the subsystems of a configuration file over NVMe/TCP and NVMe/RDMA.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::Arc;

use clap::Parser;
use metrics_exposition::MetricsServer;
use nvmeof_gateway::config::Config;
use nvmeof_gateway::core::{Target, TransportType};
use nvmeof_gateway::group::PushedListener;
use nvmeof_gateway::health::Health;
use nvmeof_gateway::rdma::server::RdmaServer;
use nvmeof_gateway::reload::{self, Outcome, Prepared, Reloader};
use nvmeof_gateway::tcp::server::TcpServer;
use nvmeof_gateway::tcp::tls::TlsAcceptor;
use tokio::sync::watch;

/// NVMe over Fabrics gateway in front of Ceph RBD.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// Configuration file (TOML): listeners, subsystems, namespaces, allowed hosts.
    #[arg(long, short)]
    config: PathBuf,
    /// Validate the configuration and exit.
    #[arg(long)]
    check: bool,
    /// Print, for each RBD namespace that names no `uuid`/`nguid`, the two lines that keep
    /// the identity earlier gateways gave it (from the NQN and NSID only, before it included
    /// the image), then exit: add them to the file before upgrading a gateway whose hosts
    /// stay connected.
    #[arg(long)]
    print_previous_ids: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    // The log filter follows the group's log level once one is set (`log-level set`).
    control_plane::log_level::init();
    let config = match Config::load(&args.config) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("nvmeof-gateway: invalid configuration: {e}");
            return ExitCode::from(2);
        }
    };
    if args.check {
        println!("configuration OK");
        return ExitCode::SUCCESS;
    }
    if args.print_previous_ids {
        print!("{}", config.previous_identity_pins());
        return ExitCode::SUCCESS;
    }
    match nvmeof_gateway::limits::raise_open_file_limit() {
        Ok(l) if l.before != l.after => tracing::info!(
            before = ?l.before,
            after = ?l.after,
            "open-file limit raised to the hard limit"
        ),
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %e, "cannot raise the open-file limit"),
    }
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if let Some(n) = config.gateway.worker_threads {
        builder.worker_threads(n);
    }
    let runtime = match builder.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("nvmeof-gateway: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(serve(config, args.config)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e}");
            eprintln!("nvmeof-gateway: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn serve(config: Config, path: PathBuf) -> Result<(), String> {
    // SIGHUP reloads the file (nvmeof_gateway::reload); installed first, so that a SIGHUP
    // during the start does not end the process (its default action).
    let mut hangup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
        .map_err(|e| format!("cannot handle SIGHUP: {e}"))?;
    let mut reloader = Reloader::new(&path, config.clone());
    // /healthz and /readyz (see nvmeof_gateway::health).
    let health = Health::new(config.ceph.clone().unwrap_or_default().settings());
    let _heartbeat = health.spawn_heartbeat();
    // Opening RBD images talks to the cluster and may take seconds: keep it off the runtime.
    let to_build = config.clone();
    let (target, skipped) = tokio::task::spawn_blocking(move || to_build.build_target_report())
        .await
        .map_err(|e| format!("building the target failed: {e}"))?
        .map_err(|e| format!("invalid configuration: {e}"))?;
    // Namespaces whose image could not be opened are retried and announced when they open.
    let _retry = config.spawn_namespace_retry(&target, &skipped, Duration::from_secs(10));
    // In a gateway group the control plane decides every ANA state: nothing is optimized
    // before its first assignment.
    let group_tls = match &config.group {
        Some(g) => control_plane::tls::client_tls_config(&g.tls_files(), None)
            .map_err(|e| format!("[group] TLS: {e}"))?,
        None => None,
    };
    if let Some(g) = &config.group {
        // Parses the PEM files (a bad one stops the gateway here, not silently later).
        for addr in &g.control_plane {
            control_plane::tls::client_endpoint(addr, group_tls.as_ref())
                .map_err(|e| format!("[group] control_plane {addr}: {e}"))?;
        }
    }
    let _group = config.group.as_ref().map(|g| {
        nvmeof_gateway::group::start_inaccessible(&target);
        nvmeof_gateway::group::spawn(
            target.clone(),
            nvmeof_gateway::group::GroupSettings {
                gateway: config.gateway.name.clone().unwrap_or_default(),
                control_plane: g.control_plane.clone(),
                ana_group: g.ana_group.unwrap_or(0),
                beacon_interval: Duration::from_millis(g.beacon_interval_ms.unwrap_or(500)),
                stall_window: g.stall_window(),
                config: Some(config.clone()),
                tls: group_tls.clone(),
            },
        )
    });
    if let Some(agent) = &_group {
        health.joining_group(agent.first_applied.clone());
    }
    if !nvmeof_gateway::tcp::set_data_budget_limit(config.tcp_data_budget()) {
        return Err("the NVMe/TCP data budget was set twice".into());
    }
    // /healthz and /readyz answer from here on (a liveness probe must not fail while a group
    // gateway waits for the control plane below).
    let metrics = match config.metrics_addr() {
        Some(addr) => Some(start_metrics(addr, &target, &config, &health).await?),
        None => None,
    };
    let signal = wait_for_signal();
    tokio::pin!(signal);
    let mut listeners = Listeners::new(target.clone(), config.tcp_busy_poll());
    // A group gateway listens once its first assignment is applied. Before, the subsystems
    // the control plane pushes are unknown here, and a host reconnecting at that moment
    // would be refused as for an unknown subsystem, with DNR: Linux 6.10 and later then
    // drop that path for good. A closed port is retried, as for a gateway that is down.
    let stopped_early = match &_group {
        Some(agent) => {
            // The target is built: /readyz now says what a group gateway waits for (the
            // first assignment, after the keyring), not "starting".
            health.serving(&target);
            !wait_for_first_assignment(&agent.first_applied, &mut signal).await
        }
        None => false,
    };
    if !stopped_early {
        for l in reload::listeners_of(&config) {
            listeners.start(l).await?;
        }
        if _group.is_none() {
            // (A group gateway said so before its wait; a listener that cannot be bound
            // ends the process above either way.)
            health.serving(&target);
        }
    }
    for s in target.subsystems() {
        tracing::info!(
            subsystem = s.nqn(),
            namespaces = s.namespaces().len(),
            "subsystem ready"
        );
    }
    // Until a signal: follow this gateway's listeners in the control plane (added: listen;
    // deleted: stop listening and close that listener's connections).
    let mut pushed = _group.as_ref().map(|a| a.listeners.clone());
    let mut previous: BTreeSet<PushedListener> = BTreeSet::new();
    if !stopped_early {
        loop {
            let changed = async {
                match pushed.as_mut() {
                    Some(rx) => rx.changed().await.is_ok(),
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = &mut signal => break,
                _ = hangup.recv() => reload(&mut reloader, &target, &mut listeners).await,
                ok = changed => {
                    if !ok {
                        pushed = None;
                        continue;
                    }
                    let Some(now) = pushed.as_ref().and_then(|rx| rx.borrow().clone()) else {
                        continue;
                    };
                    health.listeners_followed(listeners.follow(&previous, &now).await);
                    previous = now;
                }
            }
        }
    }
    // Out of the endpoints at once, while the groups move away.
    health.shutting_down();
    if let (Some(agent), Some(g)) = (&_group, &config.group) {
        // Planned: let the group move this gateway's ANA groups away before connections close.
        agent.leave(&target, g.leave_timeout()).await;
    }
    tracing::info!("shutting down: closing connections");
    listeners.stop_all().await;
    if let Some((stop, server)) = metrics {
        let _ = stop.send(true);
        let _ = server.await;
    }
    // The agent's tasks hold the target: end them first, so the images close below (and are
    // waited for) instead of during the runtime's teardown, racing librbd's threads at exit.
    if let Some(agent) = _group {
        agent.stop().await;
    }
    // Close every image before exiting, so no exclusive lock is left for the next writer
    // to wait out.
    drop(target);
    let closed =
        tokio::task::spawn_blocking(|| rbd_backend::rbd::wait_for_closes(Duration::from_secs(10)))
            .await
            .unwrap_or(false);
    if !closed {
        tracing::warn!("some RBD images did not close within 10 s");
    }
    tracing::info!("stopped");
    Ok(())
}

/// Waits until the group agent has applied its first assignment (true), or a stop signal
/// came first (false).
async fn wait_for_first_assignment(
    applied: &std::sync::atomic::AtomicBool,
    signal: &mut std::pin::Pin<&mut impl std::future::Future<Output = ()>>,
) -> bool {
    use std::sync::atomic::Ordering;
    if applied.load(Ordering::SeqCst) {
        return true;
    }
    tracing::info!("listening once the control plane's first assignment is applied");
    let started = std::time::Instant::now();
    loop {
        tokio::select! {
            _ = signal.as_mut() => {
                tracing::info!("stopped before the first assignment");
                return false;
            }
            _ = tokio::time::sleep(Duration::from_millis(10)) => {}
        }
        if applied.load(Ordering::SeqCst) {
            tracing::info!(
                ms = started.elapsed().as_millis() as u64,
                "first assignment applied: listening"
            );
            return true;
        }
    }
}

/// Serves `/metrics`, `/healthz` and `/readyz` on `addr`: the stop switch and the server's task.
async fn start_metrics(
    addr: SocketAddr,
    target: &Arc<Target>,
    config: &Config,
    health: &Arc<Health>,
) -> Result<(watch::Sender<bool>, tokio::task::JoinHandle<()>), String> {
    let name = config.gateway.name.clone().unwrap_or_default();
    // Weak: a slow scraper must not keep the target (and its open images) alive through a
    // shutdown.
    let target = Arc::downgrade(target);
    let render = Arc::new(move || match target.upgrade() {
        Some(target) => nvmeof_gateway::metrics::render(&target, &name),
        None => String::new(),
    });
    let server = MetricsServer::bind(addr, render)
        .await
        .map_err(|e| format!("cannot listen for metrics on {addr}: {e}"))?
        .with_health(health.checks());
    tracing::info!(%addr, "metrics at http://{addr}/metrics");
    let (stop, stopped) = watch::channel(false);
    Ok((stop, tokio::spawn(server.serve(stopped))))
}

async fn wait_for_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        // Without signal handlers, fall back to Ctrl-C only.
        let _ = tokio::signal::ctrl_c().await;
        return;
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM received"),
        _ = int.recv() => tracing::info!("SIGINT received"),
    }
}

/// SIGHUP: applies the configuration file again (see `nvmeof_gateway::reload`). New
/// listeners are bound before anything else changes (one that cannot be refuses the reload);
/// removed ones stop after the subsystems changed.
async fn reload(reloader: &mut Reloader, target: &Arc<Target>, listeners: &mut Listeners) {
    let path = reloader.path().display().to_string();
    tracing::info!(config = %path, "SIGHUP received: reloading the configuration");
    let refused = |why: String| {
        reload::record(Outcome::Refused);
        tracing::error!(config = %path, "configuration reload refused, nothing changed: {why}");
    };
    let plan = match reloader.prepare().await {
        Ok(Prepared::Apply(plan)) => plan,
        Ok(Prepared::Unchanged) => {
            reload::record(Outcome::Unchanged);
            tracing::info!(config = %path, "configuration reloaded: nothing changed");
            return;
        }
        Err(e) => return refused(e.to_string()),
    };
    let mut bound = Vec::new();
    for new in plan.listeners_added() {
        if let Err(e) = listeners.start(new.clone()).await {
            for l in &bound {
                listeners.stop(l).await;
            }
            return refused(e);
        }
        bound.push(new);
    }
    let (before, after) = plan.listeners();
    let summary = reloader.apply(target, plan).await;
    listeners.follow(&before, &after).await;
    reload::record(Outcome::Applied);
    tracing::info!(config = %path, ?summary, "configuration reloaded");
}

/// The running listeners, each with its own stop switch (a listener deleted in the control
/// plane stops alone).
struct Listeners {
    target: Arc<Target>,
    /// `[gateway] tcp_busy_poll_us` and `tcp_busy_poll_adaptive`, for every NVMe/TCP listener.
    tcp_busy_poll: Option<nvmeof_gateway::tcp::busy_poll::BusyPollConfig>,
    running: BTreeMap<PushedListener, (watch::Sender<bool>, tokio::task::JoinHandle<()>)>,
    tls: Option<Arc<TlsAcceptor>>,
}

impl Listeners {
    fn new(
        target: Arc<Target>,
        tcp_busy_poll: Option<nvmeof_gateway::tcp::busy_poll::BusyPollConfig>,
    ) -> Self {
        Self {
            target,
            tcp_busy_poll,
            running: BTreeMap::new(),
            tls: None,
        }
    }

    /// Binds and serves a listener (a no-op when it already runs); a secure one takes TLS
    /// connections only.
    async fn start(&mut self, key: PushedListener) -> Result<(), String> {
        if self.running.contains_key(&key) {
            return Ok(());
        }
        let PushedListener { rdma, addr, secure } = key;
        let (stop, stopped) = watch::channel(false);
        let task = if rdma {
            let server = RdmaServer::bind(addr, self.target.clone())
                .map_err(|e| format!("cannot listen on rdma {addr}: {e}"))?;
            tokio::spawn(server.serve(stopped))
        } else {
            let mut server = TcpServer::bind(addr, self.target.clone())
                .await
                .map_err(|e| format!("cannot listen on {addr}: {e}"))?
                .with_busy_poll(self.tcp_busy_poll);
            if secure {
                server = server.with_tls(self.tls_acceptor()?);
            }
            tokio::spawn(server.serve(stopped))
        };
        self.running.insert(key, (stop, task));
        Ok(())
    }

    /// The TLS server side every secure listener shares (made at the first one).
    fn tls_acceptor(&mut self) -> Result<Arc<TlsAcceptor>, String> {
        if let Some(acceptor) = &self.tls {
            return Ok(acceptor.clone());
        }
        let acceptor = Arc::new(
            TlsAcceptor::new(self.target.clone())
                .map_err(|e| format!("cannot set up TLS for secure listeners: {e}"))?,
        );
        self.tls = Some(acceptor.clone());
        Ok(acceptor)
    }

    async fn stop(&mut self, key: &PushedListener) {
        if let Some((stop, task)) = self.running.remove(key) {
            let _ = stop.send(true);
            let _ = task.await;
        }
    }

    /// Applies a change of this gateway's listeners in the control plane: the new ones (and
    /// earlier ones that could not be bound) are served, the deleted ones (in `before`, not in
    /// `now`) stop, whether they came from the file or from the control plane. A pushed
    /// listener that cannot be bound is logged and returned (address, why).
    async fn follow(
        &mut self,
        before: &BTreeSet<PushedListener>,
        now: &BTreeSet<PushedListener>,
    ) -> Vec<(String, String)> {
        for gone in before.difference(now) {
            if self.running.contains_key(gone) {
                tracing::info!(addr = %gone.addr, rdma = gone.rdma, secure = gone.secure, "listener deleted: stop listening");
                self.stop(gone).await;
            }
            // One whose `secure` flag changed starts again below: it stays listed.
            if !now
                .iter()
                .any(|n| n.rdma == gone.rdma && n.addr == gone.addr)
            {
                self.forget(gone);
            }
        }
        let mut failed = Vec::new();
        for new in now {
            if !self.running.contains_key(new) {
                tracing::info!(addr = %new.addr, rdma = new.rdma, secure = new.secure, "listener added: listening");
                if let Err(e) = self.start(new.clone()).await {
                    tracing::error!("{e}");
                    failed.push((new.addr.to_string(), e));
                }
            }
        }
        failed
    }

    /// Takes a deleted listener out of the discovery log (a file's listener is listed under
    /// the file's spelling of its address, hence the comparison as addresses).
    fn forget(&self, gone: &PushedListener) {
        let transport = if gone.rdma {
            TransportType::Rdma
        } else {
            TransportType::Tcp
        };
        for l in self.target.listeners() {
            let same_ip = l.address.parse::<std::net::IpAddr>().ok() == Some(gone.addr.ip());
            if l.transport == transport && l.port == gone.addr.port() && same_ip {
                self.target.remove_listener(transport, &l.address, l.port);
            }
        }
    }

    /// Stops every listener (and its connections).
    async fn stop_all(mut self) {
        let keys: Vec<PushedListener> = self.running.keys().cloned().collect();
        for (stop, _) in self.running.values() {
            let _ = stop.send(true);
        }
        for k in keys {
            self.stop(&k).await;
        }
    }
}
