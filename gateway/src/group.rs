//! Gateway-group agent: registers this gateway with `nvmeof-control`, beacons, and applies the
//! ANA states the control plane pushes (`Subsystem::set_ana_state`, which raises the ANA
//! Change asynchronous event on every controller).
//!
//! - Beacons go to every configured replica every `beacon_interval_ms` (only the leader acts
//!   on them); each carries this process's librados client addresses (what a fence
//!   blocklists), a random per-process incarnation and the last assignment applied.
//! - The assignment stream is taken from the first replica that answers, and re-opened
//!   (next replica) when it breaks.
//! - A group turning optimized on this gateway is applied only after every librados client of
//!   this process has fetched the latest osdmap, so a blocklist that fenced the previous
//!   holder is in force here first.
//! - Librados connections are sharded per ANA group (`ClusterPool::open_in_group`): beacons
//!   carry each group's client addresses, so the control plane fences exactly one group.
//!   A group that was taken away from this gateway (its clients may have been fenced since)
//!   or whose client was found blocklisted is given fresh clients before it turns optimized
//!   here again: its connections are retired and its images reopened on new ones.
//! - Configuration the control plane pushed is followed both ways: added subsystems and
//!   namespaces are opened ([`apply_config`]); deleted ones, and host list changes, are applied
//!   to a running gateway ([`apply_removals`]); what the gateway's own file declares is never
//!   removed. Deleted listeners leave the discovery log ([`apply_listeners`]).
//! - Hosts' DH-HMAC-CHAP keys come with the pushed hosts (`Subsystem.host_entries`): a new
//!   subsystem is built with them, an existing one gets them with `Subsystem::set_host_keys`
//!   when they change (connected hosts keep their controllers; the keys apply from their next
//!   authentication). A host is never allowed here without the keys it was given, not even
//!   for the moment between two calls, and a host whose pushed keys do not parse is not
//!   allowed at all. Keys are never logged.
//! - With `[group] tls_*` the replicas are dialled over mTLS (`control_plane::tls`).
//! - The data path never waits for the control plane: when it is unreachable the last
//!   applied states stay, as long as the cluster answers. Cut off from both past the
//!   leader's grace, the gateway gives its groups up by itself (`crate::lease`): they turn
//!   inaccessible and controllers with commands stuck at the cluster are closed, so hosts
//!   retry on the survivor; a beacon accepted again takes the current assignment afresh.
//! - Cut off from the cluster only, the gateway says so in its beacons (`crate::stall`); the
//!   leader fails it over, and when the assignment takes a group away while its commands are
//!   stuck at the cluster, the controllers holding them are closed as above.

use std::collections::{BTreeMap, BTreeSet};
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use control_plane::proto::gateway_control_client::GatewayControlClient;
use control_plane::proto::{
    Assignment, Beacon, Connection, GatewayIoTotals, GroupBeacon, GroupClients, JoinRequest,
};
use rbd_backend::rbd::{ClusterPool, RbdDevice};
use rbd_backend::BlockDevice;
use tonic::transport::{Channel, ClientTlsConfig};

use crate::apply::{self, Detached, WantedHosts, DRAIN_TIMEOUT};
use crate::config::{Config, HostEntry, HostTable, NamespaceConfig, SubsystemConfig};
use crate::core::{ListenerInfo, Namespace, Subsystem, Target, TransportType, Visibility};
use crate::events::NamespaceEvents;
use crate::lease::{LeaseAction, LeaseWatch};
use crate::spec::ana;
use crate::stall::{Reach, StallWatch};

/// What the agent needs from the configuration.
#[derive(Debug, Clone)]
pub struct GroupSettings {
    pub gateway: String,
    pub control_plane: Vec<String>,
    /// 0: the control plane assigns one.
    pub ana_group: u32,
    pub beacon_interval: Duration,
    /// `[group] stall_window_ms`; None: half the leader's grace (`crate::stall`).
    pub stall_window: Option<Duration>,
    /// The gateway's own configuration (Ceph settings, controller IDs): subsystems and
    /// namespaces the control plane pushes are opened with it. None: pushed configuration is
    /// not applied (ANA states only).
    pub config: Option<Config>,
    /// mTLS to the replicas (`[group] tls_*`, built with
    /// `control_plane::tls::client_tls_config`); None: plain gRPC.
    pub tls: Option<ClientTlsConfig>,
}

/// The running agent (its tasks end when it is dropped).
pub struct GroupAgent {
    tasks: Vec<tokio::task::JoinHandle<()>>,
    applied: Arc<AtomicU64>,
    /// Set once the first assignment is applied (every state in force): the gateway's
    /// readiness waits for it (`health::Health::joining_group`).
    pub first_applied: Arc<AtomicBool>,
    pub incarnation: u64,
    gateway: String,
    channels: Vec<(String, Channel)>,
    /// The ANA groups' cluster clients.
    pub clients: Arc<GroupClientsState>,
    /// This gateway's listeners as the control plane stores them (`nvmeofctl listener
    /// add/del -g <this gateway>`), after each assignment; None before the first one.
    pub listeners: tokio::sync::watch::Receiver<Option<BTreeSet<PushedListener>>>,
}

/// A listener the control plane (or the file) has for this gateway.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PushedListener {
    /// NVMe/RDMA (else NVMe/TCP).
    pub rdma: bool,
    pub addr: std::net::SocketAddr,
    /// TLS connections only (NVMe/TCP). Part of the identity: a listener whose flag changed
    /// is another one, so the running socket stops and one of the new kind starts.
    pub secure: bool,
}

/// This gateway's listeners in an assignment (any subsystem; a listener serves them all);
/// unparsable ones are left out.
pub fn own_listeners(a: &Assignment, gateway: &str) -> BTreeSet<PushedListener> {
    a.listeners
        .iter()
        .filter(|l| l.gateway == gateway || l.gateway.is_empty())
        .filter_map(|l| {
            let rdma = match l.transport.as_str() {
                "tcp" | "" => false,
                "rdma" => true,
                _ => return None,
            };
            let ip: std::net::IpAddr = l.address.parse().ok()?;
            let port = u16::try_from(l.port).ok()?;
            Some(PushedListener {
                rdma,
                addr: std::net::SocketAddr::new(ip, port),
                secure: l.secure && !rdma,
            })
        })
        .collect()
}

/// What the agent remembers about each ANA group's cluster clients between assignments.
#[derive(Default)]
pub struct GroupClientsState {
    /// The settings of the process's image connections (None: nothing to reopen). The pool is
    /// looked up when needed, not held: it lives as long as its images, so its connections
    /// are shut down with them before the process exits.
    ceph: Option<rbd_backend::rbd::CephSettings>,
    /// Groups that were served here (optimized or change) and then taken away: the control
    /// plane may have fenced this gateway's clients for them since.
    lost: Mutex<BTreeSet<u32>>,
    /// Lost groups given fresh clients since they were taken away (for new namespaces, or
    /// on a fence notice): not refreshed again for the next new namespace.
    fresh_while_lost: Mutex<BTreeSet<u32>>,
    /// The configuration state version of the last assignment applied (beaconed: a
    /// namespace move waits for the old group's gateway to reach it).
    applied_state: AtomicU64,
    /// The lease ran out with the cluster unreachable (`crate::lease`): no group turns
    /// optimized here until a beacon is accepted again.
    demoted: AtomicBool,
    /// This gateway reports the cluster stalled (`crate::stall`): a group taken away does not
    /// wait for its stuck commands.
    cluster_stalled: AtomicBool,
    /// This gateway reports OSDs that do not answer it (`crate::stall`): the same.
    osds_unanswered: AtomicBool,
    /// The agent's connection for OSD probes ([`kept_probe_client`]): its own, and the ones
    /// the leader asks of it as a witness (`crate::osd_witness`).
    osd_probe_client: Arc<Mutex<Option<rbd_backend::rados::Client>>>,
    /// An osdmap refresh that outlived [`OSDMAP_REFRESH_BOUND`] (it blocks in librados until
    /// the monitors answer): the next one waits for it rather than block a second thread.
    stuck_osdmap_refresh: tokio::sync::Mutex<Option<OsdmapRefresh>>,
}

type OsdmapRefresh = tokio::task::JoinHandle<Result<usize, rbd_backend::rados::RadosError>>;

/// How long an assignment waits for the osdmap refresh before turning groups optimized. Past
/// it the groups stay as they are and the assignment is applied again a second later; newer
/// assignments are taken in between (a gateway whose monitors do not answer would otherwise
/// be stuck here, deaf to the control plane).
const OSDMAP_REFRESH_BOUND: Duration = Duration::from_secs(5);

impl GroupClientsState {
    pub fn new(ceph: Option<rbd_backend::rbd::CephSettings>) -> Self {
        Self {
            ceph,
            ..Self::default()
        }
    }

    fn pool(&self) -> Option<Arc<ClusterPool>> {
        self.ceph.clone().map(ClusterPool::shared)
    }

    /// Runs `refresh` (every client of this process fetching the latest osdmap:
    /// `rados::wait_for_latest_osdmap_all`) on a blocking thread, waiting at most `bound`.
    /// At most one refresh blocks at a time: one still stuck from an earlier call is waited
    /// for first (within the same bound), and does not count (its osdmap may predate the
    /// fence this call must see). Returns the clients refreshed.
    async fn refresh_osdmap(
        &self,
        bound: Duration,
        refresh: fn() -> Result<usize, rbd_backend::rados::RadosError>,
    ) -> Result<usize, String> {
        let mut stuck = self.stuck_osdmap_refresh.lock().await;
        if let Some(earlier) = stuck.as_mut() {
            if tokio::time::timeout(bound, earlier).await.is_err() {
                return Err(format!(
                    "an earlier osdmap refresh has waited more than {} ms for the monitors",
                    bound.as_millis()
                ));
            }
            *stuck = None;
        }
        let mut refresh = tokio::task::spawn_blocking(refresh);
        match tokio::time::timeout(bound, &mut refresh).await {
            Ok(Ok(Ok(n))) => Ok(n),
            Ok(Ok(Err(e))) => Err(e.to_string()),
            Ok(Err(e)) => Err(format!("osdmap refresh task failed: {e}")),
            Err(_) => {
                *stuck = Some(refresh);
                Err(format!(
                    "the monitors did not answer within {} ms",
                    bound.as_millis()
                ))
            }
        }
    }

    fn lost(&self) -> std::sync::MutexGuard<'_, BTreeSet<u32>> {
        self.lost.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn fresh_while_lost(&self) -> std::sync::MutexGuard<'_, BTreeSet<u32>> {
        self.fresh_while_lost
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// This gateway was told it is fenced: the clients of every group it does not serve
    /// (optimized or change) may be blocklisted, so they are retired (beacons stop reporting
    /// them; the control plane lets the gateway serve again once none of the fenced
    /// addresses is reported) and each such group gets fresh clients before it is served
    /// here again. Idempotent (a retired group has no connection left to retire).
    pub fn drop_unserved_clients(&self, target: &Target) {
        let Some(pool) = self.pool() else {
            return;
        };
        let served = served_groups(target);
        for g in pool.connected_groups() {
            if g != 0 && !served.contains(&g) {
                self.lost().insert(g);
                self.fresh_while_lost().insert(g);
                let retired = pool.retire_group(g);
                tracing::warn!(
                    group = g,
                    retired,
                    "fenced: clients of a group not served here dropped"
                );
            }
        }
    }

    /// Before the namespaces `a` adds are opened here: a group taken away from this gateway
    /// (a failback or a move fences the gateway that held it) may have only blocklisted
    /// clients left, on which an image does not open (ESHUTDOWN), so the new namespace would
    /// stay unserved on this path. Such a group gets fresh clients first; it stays lost, so it
    /// is refreshed again before it turns optimized here (its older images are still on the
    /// fenced clients). A group served here keeps its clients.
    pub fn refresh_lost_groups_before_opening(&self, target: &Target, a: &Assignment) {
        let Some(pool) = self.pool() else {
            return;
        };
        let groups: BTreeSet<u32> = a
            .namespaces
            .iter()
            .filter(|n| n.ana_group != 0)
            .filter(|n| {
                target
                    .subsystem(&n.subsystem_nqn)
                    .is_none_or(|s| s.namespace(n.nsid).is_none())
            })
            .map(|n| n.ana_group)
            .collect();
        for g in groups {
            let served = target
                .subsystems()
                .iter()
                .filter(|s| !s.is_discovery())
                .any(|s| matches!(s.ana_state(g), ana::OPTIMIZED | ana::CHANGE));
            if served || !self.lost().contains(&g) || !self.fresh_while_lost().insert(g) {
                continue;
            }
            let retired = pool.retire_group(g);
            if retired > 0 {
                tracing::info!(
                    group = g,
                    retired,
                    "new namespaces of a group taken away from this gateway: opened on fresh clients (the old ones may be fenced)"
                );
            }
        }
    }

    /// Whether `group` must get fresh clients before it is served here again.
    pub fn needs_fresh_clients(&self, group: u32) -> bool {
        self.lost().contains(&group) || self.pool().is_some_and(|p| p.group_blocklisted(group))
    }
}

impl Drop for GroupAgent {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl GroupAgent {
    /// A planned shutdown: asks the control plane to move this gateway's groups away (drain,
    /// fence, optimized elsewhere) and waits until no group is optimized or changing here,
    /// at most `timeout` (a group nobody can take stays until then).
    pub async fn leave(&self, target: &Target, timeout: Duration) {
        let started = std::time::Instant::now();
        let mut moving = None;
        for (addr, ch) in &self.channels {
            let mut c = GatewayControlClient::new(ch.clone());
            match c
                .leave(control_plane::proto::LeaveRequest {
                    gateway: self.gateway.clone(),
                    incarnation: self.incarnation,
                })
                .await
            {
                Ok(r) => {
                    moving = Some(r.into_inner().moving);
                    break;
                }
                Err(s) => tracing::debug!(control_plane = %addr, "leave: {}", s.message()),
            }
        }
        let Some(moving) = moving else {
            tracing::warn!(
                "no control plane took the leave request: stopping without moving groups"
            );
            return;
        };
        if moving.is_empty() {
            tracing::info!("no group to move away; stopping");
            return;
        }
        tracing::info!(groups = ?moving, "waiting for the groups to move away");
        let serving = || {
            served_groups(target)
                .into_iter()
                .filter(|g| moving.contains(g))
                .collect::<BTreeSet<u32>>()
        };
        loop {
            let left = serving();
            if left.is_empty() {
                tracing::info!(
                    groups = ?moving,
                    moved = moving.len(),
                    ms = started.elapsed().as_millis() as u64,
                    "planned leave: groups moved away; stopping"
                );
                return;
            }
            if started.elapsed() >= timeout {
                tracing::warn!(
                    groups = ?left,
                    moved = moving.len() - left.len(),
                    ms = started.elapsed().as_millis() as u64,
                    timeout_ms = timeout.as_millis() as u64,
                    "planned leave: groups still served here after [group] leave_timeout_ms; stopping anyway"
                );
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Stops the agent's tasks and waits until they are gone, so the target (and the RBD
    /// images) they hold are released: call before closing the images at exit.
    pub async fn stop(mut self) {
        let tasks = std::mem::take(&mut self.tasks);
        for t in &tasks {
            t.abort();
        }
        for t in tasks {
            let _ = t.await;
        }
    }

    /// The epoch of the last assignment applied (0: none yet).
    pub fn applied_epoch(&self) -> u64 {
        self.applied.load(Ordering::SeqCst)
    }
}

fn random_u64() -> u64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.write_u32(std::process::id());
    h.finish()
}

/// A lazily connected channel to one replica: `https://` with TLS (the replica's certificate
/// checked against the CA, ours presented), `http://` without.
fn channel(addr: &str, tls: Option<&ClientTlsConfig>) -> Option<Channel> {
    match control_plane::tls::client_endpoint(addr, tls) {
        Ok(e) => Some(
            e.connect_timeout(Duration::from_secs(1))
                .timeout(Duration::from_secs(5))
                .connect_lazy(),
        ),
        Err(e) => {
            tracing::error!(addr, "bad control-plane address: {e}");
            None
        }
    }
}

/// The ANA groups this gateway serves: optimized, or changing (a failback drain), in any
/// NVM subsystem.
fn served_groups(target: &Target) -> BTreeSet<u32> {
    target
        .subsystems()
        .iter()
        .filter(|s| !s.is_discovery())
        .flat_map(|s| s.ana_groups())
        .filter(|(_, st)| matches!(*st, ana::OPTIMIZED | ana::CHANGE))
        .map(|(g, _)| g)
        .collect()
}

/// Every ANA group of every NVM subsystem: reported inaccessible until the control plane
/// says otherwise (another gateway may hold them).
pub fn start_inaccessible(target: &Target) {
    for s in target.subsystems() {
        if s.is_discovery() {
            continue;
        }
        for ns in s.namespaces() {
            s.set_ana_state(ns.ana_group, ana::INACCESSIBLE);
        }
    }
}

/// Starts beaconing and applying assignments (on the current tokio runtime).
pub fn spawn(target: Arc<Target>, settings: GroupSettings) -> GroupAgent {
    let incarnation = random_u64();
    let applied = Arc::new(AtomicU64::new(0));
    let first_applied = Arc::new(AtomicBool::new(false));
    // The settings every RBD image of this process is opened with (one shared pool).
    let ceph = settings
        .config
        .as_ref()
        .map(|c| c.ceph.clone().unwrap_or_default().settings());
    let clients = Arc::new(GroupClientsState::new(ceph));
    let (listeners_tx, listeners) = tokio::sync::watch::channel(None);
    let channels: Vec<(String, Channel)> = settings
        .control_plane
        .iter()
        .filter_map(|a| channel(a, settings.tls.as_ref()).map(|c| (a.clone(), c)))
        .collect();
    tracing::info!(
        gateway = %settings.gateway,
        incarnation,
        control_plane = ?settings.control_plane,
        tls = settings.tls.is_some(),
        stall_window = ?settings.stall_window,
        "joining the gateway group"
    );
    // An applied assignment is beaconed at once: a drain (planned move, failback) waits for
    // that acknowledgement before the fence, so the next tick would add up to a beacon
    // interval to the hosts' I/O pause.
    let beacon_now = Arc::new(tokio::sync::Notify::new());
    // A host that disconnected is beaconed at once too: the control plane refuses to delete
    // an image while a host is connected (`namespace del --delete-image`), and a script or
    // ceph-csi deletes right after the host disconnected.
    {
        let beacon_now = beacon_now.clone();
        target.set_on_controller_gone(Arc::new(move || beacon_now.notify_one()));
    }
    let lease = Arc::new(Mutex::new(LeaseWatch::default()));
    let stall = Arc::new(Mutex::new(
        settings
            .stall_window
            .map_or_else(StallWatch::default, StallWatch::with_fixed_window),
    ));
    // The lease came back after a demotion: the assignment stream is joined afresh.
    let resync = Arc::new(tokio::sync::Notify::new());
    let beacons = tokio::spawn(beacon_loop(
        target.clone(),
        settings.clone(),
        channels.clone(),
        incarnation,
        (applied.clone(), beacon_now.clone()),
        clients.clone(),
        (lease.clone(), stall.clone()),
    ));
    let stall_watch = tokio::spawn(stall_loop(
        target.clone(),
        clients.clone(),
        stall,
        beacon_now.clone(),
    ));
    let gateway = settings.gateway.clone();
    let lease_watch = tokio::spawn(lease_loop(
        target.clone(),
        clients.clone(),
        lease,
        resync.clone(),
    ));
    let assignments = tokio::spawn(assignment_loop(
        target,
        settings,
        channels.clone(),
        incarnation,
        (applied.clone(), first_applied.clone(), beacon_now, resync),
        clients.clone(),
        listeners_tx,
    ));
    let mut tasks = vec![beacons, assignments, lease_watch, stall_watch];
    for (addr, ch) in &channels {
        tasks.push(tokio::spawn(presence_loop(
            gateway.clone(),
            incarnation,
            addr.clone(),
            ch.clone(),
        )));
    }
    GroupAgent {
        tasks,
        applied,
        first_applied,
        incarnation,
        gateway,
        channels,
        clients,
        listeners,
    }
}

/// The host controllers of every NVM subsystem, for the beacon.
fn connections(target: &Target) -> Vec<Connection> {
    let mut out = Vec::new();
    for s in target.subsystems() {
        if s.is_discovery() {
            continue;
        }
        for c in s.controllers() {
            if c.is_torn_down() {
                continue;
            }
            out.push(Connection {
                gateway: String::new(),
                subsystem_nqn: s.nqn().to_string(),
                host_nqn: c.hostnqn.clone(),
                cntlid: u32::from(c.cntlid),
                io_queues: u32::from(c.io_queues_granted()),
                secure: c.is_secure(),
            });
        }
    }
    out
}

async fn beacon_loop(
    target: Arc<Target>,
    settings: GroupSettings,
    channels: Vec<(String, Channel)>,
    incarnation: u64,
    (applied, beacon_now): (Arc<AtomicU64>, Arc<tokio::sync::Notify>),
    clients: Arc<GroupClientsState>,
    (lease, stall): (Arc<Mutex<LeaseWatch>>, Arc<Mutex<StallWatch>>),
) {
    let mut tick = tokio::time::interval(settings.beacon_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing: BTreeMap<String, bool> = BTreeMap::new();
    let mut fenced_logged = false;
    let witness = Arc::new(Mutex::new(crate::osd_witness::Witness::default()));
    let mut io_report = crate::io_report::IoReport::default();
    // Replicas that did not take a beacon since they last did: they may lack the counters of
    // namespaces that went idle meanwhile, so the beacon after they take one again reports
    // every namespace.
    let mut missed_counters: BTreeSet<String> = BTreeSet::new();
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = beacon_now.notified() => tick.reset(),
        }
        // Local calls (no cluster round trip), but librados: keep them off the runtime.
        let (addrs, per_group) = tokio::task::spawn_blocking(|| {
            (
                rbd_backend::rados::process_client_addrs(),
                rbd_backend::rados::client_addrs_by_group(),
            )
        })
        .await
        .unwrap_or_default();
        // One lock: a guard taken inside the literal below would live to its end.
        let (reach, osds_unanswered) = {
            let stall = stall.lock().unwrap_or_else(|e| e.into_inner());
            (stall.reach(), stall.osds_unanswered().to_vec())
        };
        let beacon = GroupBeacon {
            beacon: Some(Beacon {
                gateway: settings.gateway.clone(),
                ana_group: settings.ana_group,
                incarnation,
                client_addrs: addrs,
                applied_version: applied.load(Ordering::SeqCst),
                connections: connections(&target),
                cluster: cluster_reach_wire(reach),
                osds_unanswered,
                osd_probe: witness.lock().unwrap_or_else(|e| e.into_inner()).answer(),
            }),
            group_clients: per_group
                .into_iter()
                .map(|(ana_group, addrs)| GroupClients { ana_group, addrs })
                .collect(),
            applied_state_version: clients.applied_state.load(Ordering::SeqCst),
            io_counters: io_report.next(&target),
            io_totals: Some(GatewayIoTotals {
                admin_queues: crate::core::fabrics::QUEUES_CONNECTED
                    .admin
                    .load(Ordering::Relaxed),
                io_queues: crate::core::fabrics::QUEUES_CONNECTED
                    .io
                    .load(Ordering::Relaxed),
            }),
        };
        let sent = Instant::now();
        let sends = channels.iter().map(|(addr, ch)| {
            let mut client = GatewayControlClient::new(ch.clone());
            let b = beacon.clone();
            let addr = addr.clone();
            async move { (addr, client.send_group_beacon(b).await) }
        });
        for (addr, result) in futures_join_all(sends).await {
            let was_failing = failing.get(&addr).copied().unwrap_or(false);
            // A replica that does not lead takes the counters before it refuses the beacon.
            let took_counters = match &result {
                Ok(_) => true,
                Err(s) => s.code() == tonic::Code::Unavailable && s.message().contains("lead"),
            };
            if !took_counters {
                missed_counters.insert(addr.clone());
            } else if missed_counters.remove(&addr) {
                io_report.resend_all();
            }
            if let Ok(reply) = &result {
                // Only the leader answers a beacon: the lease runs from this one's send.
                let mut lease = lease.lock().unwrap_or_else(|e| e.into_inner());
                lease.set_grace_ms(reply.get_ref().grace_ms);
                lease.beacon_accepted(sent);
                stall
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .set_grace_ms(reply.get_ref().grace_ms);
                let asked = witness
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .on_request(reply.get_ref().osd_probe.as_ref());
                if let Some((id, osds)) = asked {
                    spawn_witness_probe(
                        (id, osds),
                        witness.clone(),
                        clients.clone(),
                        beacon_now.clone(),
                    );
                }
            }
            match result {
                Ok(reply) if reply.get_ref().fenced => {
                    clients.drop_unserved_clients(&target);
                    if !fenced_logged {
                        tracing::error!(
                            control_plane = %addr,
                            "this gateway was fenced: its Ceph clients for the groups it held \
                             are blocklisted; it serves a group again only when the control \
                             plane gives it back (through fresh clients)"
                        );
                        fenced_logged = true;
                    }
                }
                Ok(_) => {
                    if fenced_logged {
                        tracing::info!(control_plane = %addr, "no longer fenced");
                        fenced_logged = false;
                    }
                    if was_failing {
                        tracing::info!(control_plane = %addr, "beacons accepted again");
                    }
                    failing.insert(addr, false);
                }
                Err(s) => {
                    // A replica that does not lead refuses beacons: expected, not logged.
                    if s.code() != tonic::Code::Unavailable || !s.message().contains("lead") {
                        if !was_failing {
                            tracing::warn!(control_plane = %addr, "beacon refused: {}", s.message());
                        }
                        failing.insert(addr, true);
                    }
                }
            }
        }
    }
}

/// How often the lease is looked at: well under a beacon interval.
const LEASE_POLL: Duration = Duration::from_millis(50);

/// Self-demotions (the lease ran out with the cluster unreachable) since the start, and
/// whether the gateway is demoted now: metrics.
static SELF_DEMOTIONS: AtomicU64 = AtomicU64::new(0);
static DEMOTED_NOW: AtomicBool = AtomicBool::new(false);

/// Carries out what the lease (`crate::lease`) says: probes the cluster, demotes this
/// gateway, or has the assignment stream joined afresh once beacons are accepted again.
async fn lease_loop(
    target: Arc<Target>,
    clients: Arc<GroupClientsState>,
    lease: Arc<Mutex<LeaseWatch>>,
    resync: Arc<tokio::sync::Notify>,
) {
    let mut tick = tokio::time::interval(LEASE_POLL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let now = Instant::now();
        let (action, lease_ms) = {
            let mut l = lease.lock().unwrap_or_else(|e| e.into_inner());
            (l.poll(now), l.lease().as_millis() as u64)
        };
        match action {
            LeaseAction::Nothing => {}
            LeaseAction::ProbeCluster => {
                let lease = lease.clone();
                tokio::spawn(async move {
                    // Blocks while the monitors are out of reach: one probe at a time.
                    let answered = matches!(
                        tokio::task::spawn_blocking(rbd_backend::rados::wait_for_latest_osdmap_all)
                            .await,
                        Ok(Ok(_))
                    );
                    lease
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .probe_finished(now, answered);
                });
            }
            LeaseAction::Demote => {
                clients.demoted.store(true, Ordering::SeqCst);
                DEMOTED_NOW.store(true, Ordering::Relaxed);
                SELF_DEMOTIONS.fetch_add(1, Ordering::Relaxed);
                let (groups, closed) = demote(&target, &clients);
                tracing::error!(
                    lease_ms,
                    groups = ?groups,
                    controllers_closed = closed,
                    "no beacon accepted for the control plane's grace and the cluster does \
                     not answer: this gateway gave up its ANA groups (inaccessible) so hosts \
                     use the survivor; it serves them again only when the control plane \
                     answers and hands them back"
                );
            }
            LeaseAction::Restore => {
                clients.demoted.store(false, Ordering::SeqCst);
                DEMOTED_NOW.store(false, Ordering::Relaxed);
                tracing::info!(
                    "beacons accepted again: taking the current assignment from the control plane"
                );
                resync.notify_one();
            }
        }
    }
}

fn cluster_reach_wire(reach: Reach) -> i32 {
    use control_plane::proto::ClusterReach as Wire;
    match reach {
        Reach::Unknown => Wire::Unknown as i32,
        Reach::Reachable => Wire::Reachable as i32,
        Reach::Stalled => Wire::Stalled as i32,
    }
}

/// How often the commands at the cluster are looked at: a tenth of the default stall window
/// (`stall::DEFAULT_WINDOW`), well under the shortest.
const STALL_POLL: Duration = Duration::from_millis(100);

/// 1 while this gateway reports the cluster stalled: a metric.
static CLUSTER_STALLED_NOW: AtomicBool = AtomicBool::new(false);

/// Watches whether this gateway reaches the cluster (`crate::stall`): the commands of every
/// namespace at the cluster, and monitor probes. A change is beaconed at once.
async fn stall_loop(
    target: Arc<Target>,
    clients: Arc<GroupClientsState>,
    stall: Arc<Mutex<StallWatch>>,
    beacon_now: Arc<tokio::sync::Notify>,
) {
    let mut tick = tokio::time::interval(STALL_POLL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Connected now, while the cluster answers, so that its address is in the beacons from
    // the start: one that first appears during an outage changes the group map, whose write
    // then waits for the cluster too. (If this fails, the first probe connects.)
    if let Some(ceph) = clients.ceph.clone() {
        let kept = clients.osd_probe_client.clone();
        tokio::task::spawn_blocking(move || {
            if let Err(e) = kept_probe_client(&ceph, &kept) {
                tracing::warn!(
                    "cluster connection for OSD probes: {e}; retried at the first probe"
                );
            }
        });
    }
    loop {
        tick.tick().await;
        let now = Instant::now();
        // The devices tell ages up to `op_ages::SPAN`: a longer window asks sooner.
        let window = stall.lock().unwrap_or_else(|e| e.into_inner()).window();
        let window = window.min(rbd_backend::op_ages::SPAN - rbd_backend::op_ages::SLICE);
        let (mut in_flight, mut completed, mut old_command) = (0usize, 0u64, false);
        for s in target.subsystems().iter().filter(|s| !s.is_discovery()) {
            for ns in s.namespaces() {
                in_flight += ns.device.in_flight();
                if let Some(stats) = ns.device.io_stats() {
                    completed += stats.iter().map(|(_, t)| t.completed).sum::<u64>();
                }
                old_command = old_command || ns.device.has_op_older_than(now, window);
            }
        }
        let polled = {
            let mut stall = stall.lock().unwrap_or_else(|e| e.into_inner());
            stall.set_old_command(old_command);
            stall.poll(now, in_flight, completed)
        };
        if polled.probe {
            let stall = stall.clone();
            let (clients, beacon_now) = (clients.clone(), beacon_now.clone());
            tokio::spawn(async move {
                // Blocks while the monitors are out of reach: one probe at a time.
                let answered = matches!(
                    tokio::task::spawn_blocking(rbd_backend::rados::probe_monitors).await,
                    Ok(Ok(true))
                );
                let changed = stall
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .probe_finished(Instant::now(), now, answered);
                if let Some(reach) = changed {
                    reach_changed(reach, &clients, &beacon_now);
                }
            });
        }
        if let Some(wait) = polled.osd_probe {
            let stall = stall.clone();
            let (clients, beacon_now) = (clients.clone(), beacon_now.clone());
            tokio::spawn(async move {
                // Blocks while the monitors do not answer; waits at most `wait` for the OSDs.
                let found = probe_osds(&clients, None, wait, "OSD probe").await;
                let changed = stall
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .osd_probe_finished(now, found);
                if let Some(osds) = changed {
                    clients
                        .osds_unanswered
                        .store(!osds.is_empty(), Ordering::SeqCst);
                    osds_unanswered_changed(&osds);
                    beacon_now.notify_one();
                }
            });
        }
        if let Some(reach) = polled.changed {
            reach_changed(reach, &clients, &beacon_now);
        }
    }
}

/// How long a witness probe waits for the OSDs' answers: as long as the leader's own.
const WITNESS_PROBE_WAIT: Duration = Duration::from_secs(1);

/// Probes the OSDs of the leader's witness request `id` (`crate::osd_witness`) in the
/// background, through the agent's probe connection, and beacons the answer at once.
fn spawn_witness_probe(
    (id, osds): (u64, Vec<i32>),
    witness: Arc<Mutex<crate::osd_witness::Witness>>,
    clients: Arc<GroupClientsState>,
    beacon_now: Arc<tokio::sync::Notify>,
) {
    tracing::info!(
        osds = ?osds,
        "the leader asks this gateway to probe OSDs that another gateway reports not answering it"
    );
    tokio::spawn(async move {
        let asked = Some(osds.clone());
        let what = "OSD probe asked by the leader";
        let unanswered = probe_osds(&clients, asked, WITNESS_PROBE_WAIT, what).await;
        tracing::info!(
            osds = ?osds,
            unanswered = ?unanswered,
            "OSD probe asked by the leader done (unanswered None: could not ask)"
        );
        witness
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .probe_finished(id, unanswered);
        beacon_now.notify_one();
    });
}

/// An OSD probe through the agent's own cluster connection ([`kept_probe_client`]) on a
/// blocking thread: of the OSDs `asked`, or of every OSD of the cluster (None). Returns the
/// OSDs that did not answer within `wait`; None if it could not ask (no Ceph settings, a
/// memory-only gateway; or an error, logged with `what`).
async fn probe_osds(
    clients: &GroupClientsState,
    asked: Option<Vec<i32>>,
    wait: Duration,
    what: &'static str,
) -> Option<Vec<i32>> {
    let ceph = clients.ceph.clone()?;
    let kept = clients.osd_probe_client.clone();
    let found = tokio::task::spawn_blocking(move || {
        let client = kept_probe_client(&ceph, &kept)?;
        match asked {
            Some(ids) => Ok(rbd_backend::osd_probe::probe_these_osds_through(
                &client, &ids, wait,
            )),
            None => rbd_backend::osd_probe::probe_osds_through(&client, wait),
        }
    })
    .await;
    match found {
        Ok(Ok(probe)) => Some(probe.unanswered),
        Ok(Err(e)) => {
            tracing::warn!("{what}: {e}");
            None
        }
        Err(e) => {
            tracing::warn!("{what}: {e}");
            None
        }
    }
}

/// The agent's connection for OSD probes, connected if there is none yet (blocking), then
/// kept: the ANA groups' connections are retired when a group is fenced, and a gateway fenced
/// for unanswered OSDs has none until it gets a group back, which it does only once its probe
/// finds the OSDs answering. It serves no image, so no group's fence takes it.
fn kept_probe_client(
    ceph: &rbd_backend::rbd::CephSettings,
    kept: &Mutex<Option<rbd_backend::rados::Client>>,
) -> Result<rbd_backend::rados::Client, rbd_backend::rados::RadosError> {
    let mut kept = kept.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(c) = kept.as_ref() {
        return Ok(c.clone());
    }
    let c = rbd_backend::rados::Client::connect(ceph)?;
    tracing::info!(
        client = c.instance_id(),
        "cluster connection for OSD probes"
    );
    Ok(kept.insert(c).clone())
}

/// How many OSDs did not answer this gateway's last OSD probe, while its commands wait and
/// the monitors answer (`crate::stall`): a metric.
static OSDS_UNANSWERED_NOW: AtomicU64 = AtomicU64::new(0);

/// The OSDs that do not answer this gateway changed: logged and counted (and beaconed by
/// the caller). The leader asks those OSDs itself before it fails this gateway over: a hung
/// OSD process answers no one, and moving the groups would not help there.
fn osds_unanswered_changed(osds: &[i32]) {
    let was = OSDS_UNANSWERED_NOW.swap(osds.len() as u64, Ordering::Relaxed);
    if osds.is_empty() {
        if was > 0 {
            tracing::info!("the OSDs answer this gateway again");
        }
        return;
    }
    tracing::error!(
        osds = ?osds,
        "commands at the cluster have made no progress while the monitors answer, and these \
         OSDs (up in the osdmap) do not answer this gateway: its network may reach the \
         monitors but not their hosts; the control plane fails it over if they answer the \
         leader"
    );
}

/// What the gateway reports changed (after a look at the commands, or a probe's answer):
/// logged, and beaconed at once when it turns stalled or back.
fn reach_changed(reach: Reach, clients: &GroupClientsState, beacon_now: &tokio::sync::Notify) {
    let stalled = reach == Reach::Stalled;
    let was = clients.cluster_stalled.swap(stalled, Ordering::SeqCst);
    CLUSTER_STALLED_NOW.store(stalled, Ordering::Relaxed);
    if was == stalled {
        return;
    }
    if stalled {
        tracing::error!(
            "commands at the cluster have made no progress and the monitors do not answer: \
             this gateway is cut off from Ceph; the control plane moves its groups while \
             another gateway reaches the cluster"
        );
    } else {
        tracing::info!(reach = ?reach, "the cluster answers this gateway again");
    }
    beacon_now.notify_one();
}

/// Closes the host controllers of `subsystems` that have commands of `groups` at the cluster
/// or waiting for their QoS turn: the hosts then retry those commands on another path at once
/// instead of after their I/O timeout. Returns how many were closed.
fn close_stuck_controllers(
    subsystems: &[Arc<Subsystem>],
    groups: &BTreeSet<u32>,
    reason: crate::core::TeardownReason,
) -> usize {
    let mut closed = 0;
    for s in subsystems {
        let stuck: usize = s
            .namespaces()
            .iter()
            .filter(|ns| groups.contains(&ns.ana_group))
            .map(|ns| ns.device.in_flight() + ns.qos.waiting())
            .sum();
        if stuck == 0 {
            continue;
        }
        for c in s.controllers() {
            if !c.is_torn_down() {
                c.teardown(reason);
                closed += 1;
            }
        }
    }
    closed
}

/// Turns every group optimized or changing here inaccessible, remembers them as lost (the
/// control plane may fence their clients), and closes the host controllers of their
/// subsystems if commands of those groups are stuck at the cluster: the hosts then retry
/// them on another path at once instead of after their I/O timeout. Returns the groups and
/// how many controllers were closed.
fn demote(target: &Target, clients: &GroupClientsState) -> (Vec<u32>, usize) {
    let subsystems: Vec<_> = target
        .subsystems()
        .into_iter()
        .filter(|s| !s.is_discovery())
        .collect();
    let held = served_groups(target);
    for &g in &held {
        clients.lost().insert(g);
        clients.fresh_while_lost().remove(&g);
        for s in &subsystems {
            if s.ana_state(g) != ana::INACCESSIBLE {
                s.set_ana_state(g, ana::INACCESSIBLE);
            }
        }
    }
    let closed =
        close_stuck_controllers(&subsystems, &held, crate::core::TeardownReason::LeaseLost);
    (held.into_iter().collect(), closed)
}

/// The lease's metrics (Prometheus text).
pub fn render_lease_metrics(out: &mut String) {
    metrics_exposition::Family::new(
        out,
        "nvmeof_group_self_demotions_total",
        "counter",
        "Times this gateway gave up its ANA groups itself: no beacon accepted for the control \
         plane's grace while the cluster did not answer.",
    )
    .sample(&[], SELF_DEMOTIONS.load(Ordering::Relaxed));
    metrics_exposition::Family::new(
        out,
        "nvmeof_group_demoted",
        "gauge",
        "1 while this gateway holds no ANA group because of a self-demotion, until the control \
         plane answers again.",
    )
    .sample(&[], u64::from(DEMOTED_NOW.load(Ordering::Relaxed)));
    metrics_exposition::Family::new(
        out,
        "nvmeof_group_cluster_stalled",
        "gauge",
        "1 while this gateway reports itself cut off from the cluster: commands at Ceph make \
         no progress and the monitors do not answer.",
    )
    .sample(&[], u64::from(CLUSTER_STALLED_NOW.load(Ordering::Relaxed)));
    metrics_exposition::Family::new(
        out,
        "nvmeof_group_osds_unanswered",
        "gauge",
        "OSDs that did not answer this gateway's last OSD probe, made while its commands at \
         Ceph made no progress and the monitors answered; 0 once a probe finds them all \
         answering.",
    )
    .sample(&[], OSDS_UNANSWERED_NOW.load(Ordering::Relaxed));
}

/// Holds a `Join` stream that carries no assignment (`presence_only`) open with the replica at
/// `addr`, re-opened whenever it ends: the leader (whichever replica it is) sees this process
/// die at once, from its connection being reset, instead of after the beacon grace. Nothing
/// arrives on it (an older replica that ignores the flag sends assignments: skipped).
async fn presence_loop(gateway: String, incarnation: u64, addr: String, ch: Channel) {
    loop {
        let mut client = GatewayControlClient::new(ch.clone());
        match client
            .join(JoinRequest {
                gateway: gateway.clone(),
                incarnation,
                presence_only: true,
            })
            .await
        {
            Ok(stream) => {
                let mut stream = stream.into_inner();
                while let Ok(Some(_)) = stream.message().await {}
                tracing::debug!(control_plane = %addr, "presence stream ended; re-opening it");
            }
            Err(s) => tracing::debug!(control_plane = %addr, "presence stream: {}", s.message()),
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// Runs the futures concurrently and collects their outputs in order.
async fn futures_join_all<F>(futs: impl Iterator<Item = F>) -> Vec<F::Output>
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    let handles: Vec<_> = futs.map(tokio::spawn).collect();
    let mut out = Vec::with_capacity(handles.len());
    for h in handles {
        if let Ok(v) = h.await {
            out.push(v);
        }
    }
    out
}

async fn assignment_loop(
    target: Arc<Target>,
    settings: GroupSettings,
    channels: Vec<(String, Channel)>,
    incarnation: u64,
    (applied, first_applied, beacon_now, resync): (
        Arc<AtomicU64>,
        Arc<AtomicBool>,
        Arc<tokio::sync::Notify>,
        Arc<tokio::sync::Notify>,
    ),
    clients: Arc<GroupClientsState>,
    listeners: tokio::sync::watch::Sender<Option<BTreeSet<PushedListener>>>,
) {
    if channels.is_empty() {
        return;
    }
    let mut i = 0usize;
    loop {
        let (addr, ch) = &channels[i % channels.len()];
        i += 1;
        let mut client = GatewayControlClient::new(ch.clone());
        match client
            .join(JoinRequest {
                gateway: settings.gateway.clone(),
                incarnation,
                presence_only: false,
            })
            .await
        {
            Ok(stream) => {
                let mut stream = stream.into_inner();
                let mut pending: Option<Assignment> = None;
                let mut last: Option<Assignment> = None;
                tracing::info!(control_plane = %addr, "assignment stream open");
                // A resync asked before this join is served by it (a join starts with the
                // current assignment): a stored permit would only break this stream again.
                tokio::select! {
                    biased;
                    _ = resync.notified() => {}
                    _ = std::future::ready(()) => {}
                }
                'stream: loop {
                    // An assignment whose states are not all in force (osdmap refresh or a
                    // group's reopen failed) is applied again every second until it is, or a
                    // newer one arrives: the control plane does not resend it by itself.
                    let next = match pending.take() {
                        Some(a) => tokio::select! {
                            m = stream.message() => m,
                            _ = resync.notified() => break 'stream,
                            _ = tokio::time::sleep(Duration::from_secs(1)) => {
                                tracing::info!(epoch = a.version, "applying the assignment again");
                                Ok(Some(a))
                            }
                        },
                        None => loop {
                            // Removals are applied again while no assignment comes: a
                            // namespace deleted while its image was being retried in the
                            // background (`Config::spawn_namespace_retry`) may be attached
                            // after the deletion; it goes again within this period.
                            tokio::select! {
                                m = stream.message() => break m,
                                _ = resync.notified() => break 'stream,
                                _ = tokio::time::sleep(REMOVALS_RECHECK) => {
                                    if let (Some(config), Some(a)) = (&settings.config, &last) {
                                        apply_removals(&target, config, a).await;
                                    }
                                }
                            }
                        },
                    };
                    if let Ok(Some(a)) = &next {
                        last = Some(a.clone());
                    }
                    match next {
                        Ok(Some(a)) => {
                            // The group's log level, live (empty: this process's own).
                            let level = Some(a.log_level.as_str()).filter(|l| !l.is_empty());
                            if let Err(e) = control_plane::log_level::follow(level) {
                                tracing::warn!("group log level: {e}");
                            }
                            if let Some(config) = &settings.config {
                                clients.refresh_lost_groups_before_opening(&target, &a);
                                apply_config(&target, config, &a).await;
                                apply_qos(&target, config, &a);
                                apply_frozen_sizes(&target, config, &a);
                                apply_removals(&target, config, &a).await;
                                apply_listeners(&target, &a);
                                apply_tls(&target, &a);
                                let own = Some(own_listeners(&a, &settings.gateway));
                                listeners.send_if_modified(|l| {
                                    let changed = *l != own;
                                    *l = own;
                                    changed
                                });
                            }
                            // Acknowledged only when every state is in force (a failback
                            // drain waits for this).
                            if apply_with_clients(&target, &a, &clients).await {
                                applied.store(a.version, Ordering::SeqCst);
                                if !first_applied.swap(true, Ordering::SeqCst) {
                                    tracing::info!(epoch = a.version, "first assignment applied");
                                }
                            } else {
                                pending = Some(a.clone());
                            }
                            if settings.config.is_some() {
                                // Its namespaces (moves drained) are in force.
                                clients
                                    .applied_state
                                    .store(a.state_version, Ordering::SeqCst);
                            }
                            // Acknowledged now rather than at the next tick.
                            beacon_now.notify_one();
                        }
                        Ok(None) => break,
                        Err(s) => {
                            tracing::warn!(control_plane = %addr, "assignment stream: {}", s.message());
                            break;
                        }
                    }
                }
            }
            Err(s) => tracing::debug!(control_plane = %addr, "join: {}", s.message()),
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// Port IDs of the listeners taken from the control plane start here, clear of the local
/// listeners' 1.. (the file's).
const PUSHED_PORT_ID_BASE: u16 = 0x8000;

/// Secure channels as the control plane has them: which listeners the discovery log lists
/// as secure, and which subsystems require TLS. Hosts' PSKs come with the host entries
/// (`pushed_hosts`); whether this gateway's own sockets take TLS comes with them
/// ([`own_listeners`]).
pub fn apply_tls(target: &Target, a: &Assignment) {
    // Both decide where the discovery log offers a subsystem: a change is announced.
    let mut changed = false;
    for l in a.group_listeners.iter().chain(&a.listeners) {
        if let (Ok(port), "tcp") = (u16::try_from(l.port), l.transport.as_str()) {
            changed |= target.secure_listeners.is_secure(&l.address, port) != l.secure;
            target.secure_listeners.set(&l.address, port, l.secure);
        }
    }
    for s in &a.subsystems {
        if let Some(sub) = target.subsystem(&s.nqn) {
            let was = sub.tls.required();
            let closed = sub.set_tls_required(s.require_tls);
            if was != s.require_tls {
                changed = true;
                tracing::info!(nqn = %s.nqn, require_tls = s.require_tls, controllers_closed = closed.len(), "TLS requirement changed in the control plane (controllers without TLS closed)");
            }
        }
    }
    if changed {
        target.discovery_changed();
    }
}

/// Makes this gateway's discovery log list every gateway's listeners of an assignment: the new
/// ones are added (once each), and the ones taken from an earlier assignment that are gone
/// (`nvmeofctl listener del`) are removed. Each change raises a Discovery Log Change event on
/// the discovery controllers. Listeners from the gateway's own file stay.
pub fn apply_listeners(target: &Target, a: &Assignment) {
    let mut all: Vec<(TransportType, String, u16)> = a
        .group_listeners
        .iter()
        .filter_map(|l| {
            let transport = match l.transport.as_str() {
                "tcp" => TransportType::Tcp,
                "rdma" => TransportType::Rdma,
                _ => return None,
            };
            Some((transport, l.address.clone(), u16::try_from(l.port).ok()?))
        })
        .collect();
    all.sort_by(|a, b| (a.1.as_str(), a.2).cmp(&(b.1.as_str(), b.2)));
    all.dedup();
    if a.state_version != 0 {
        for gone in target.listeners().into_iter().filter(|k| {
            k.port_id >= PUSHED_PORT_ID_BASE
                && !all.iter().any(|(t, addr, port)| {
                    k.transport == *t && k.address == *addr && k.port == *port
                })
        }) {
            tracing::info!(address = %gone.address, port = gone.port, "group listener removed from the discovery log");
            target.remove_listener(gone.transport, &gone.address, gone.port);
        }
    }
    for (transport, address, port) in all {
        let known = target.listeners();
        if known
            .iter()
            .any(|k| k.transport == transport && k.address == address && k.port == port)
        {
            continue;
        }
        let port_id = (PUSHED_PORT_ID_BASE..=u16::MAX)
            .find(|id| known.iter().all(|k| k.port_id != *id))
            .unwrap_or(u16::MAX);
        tracing::info!(%address, port, port_id, "group listener added to the discovery log");
        target.add_listener(ListenerInfo {
            transport,
            address,
            port,
            port_id,
        });
    }
}

/// The hosts of a pushed subsystem: `host_entries`, with their keys; from a control plane
/// that predates keys, `hosts`. A host whose keys do not parse here (the control plane
/// checks them with the same parser, so only a corrupt state or a newer format gets here) is
/// left out, logged with the field and why but not the key: it cannot connect here, which
/// is better than connecting without authenticating.
fn pushed_hosts(s: &control_plane::proto::Subsystem) -> WantedHosts {
    let mut out = WantedHosts {
        allow_any_host: s.allow_any_host,
        ..WantedHosts::default()
    };
    if s.host_entries.is_empty() {
        out.entries = s.hosts.iter().cloned().map(HostEntry::Nqn).collect();
        return out;
    }
    let given = |k: &str| (!k.is_empty()).then(|| k.to_string());
    for h in &s.host_entries {
        let psk = h.psk.as_ref().filter(|p| !p.key.is_empty());
        let entry = if h.dhchap_key.is_empty() && h.dhchap_ctrl_key.is_empty() && psk.is_none() {
            HostEntry::Nqn(h.host_nqn.clone())
        } else {
            HostEntry::WithKeys(HostTable {
                nqn: h.host_nqn.clone(),
                dhchap_key: given(&h.dhchap_key),
                dhchap_ctrl_key: given(&h.dhchap_ctrl_key),
                psk: psk.map(|p| p.key.clone()),
                psk_derivation: psk.and_then(|p| given(&p.derivation)),
            })
        };
        if let Err((field, why)) = entry.tls_psk() {
            tracing::error!(
                nqn = %s.nqn,
                host = %h.host_nqn,
                "pushed host not allowed here: its {field} is refused ({why})"
            );
            continue;
        }
        match entry.keys() {
            Ok(keys) => {
                if let Some(keys) = keys {
                    out.keys.insert(h.host_nqn.clone(), Arc::new(keys));
                }
                out.entries.push(entry);
            }
            Err((field, why)) => tracing::error!(
                nqn = %s.nqn,
                host = %h.host_nqn,
                "pushed host not allowed here: its {field} is refused ({why})"
            ),
        }
    }
    out
}

/// Applies what the control plane removed (`nvmeofctl subsystem/namespace/host del`) to the
/// subsystems and namespaces it pushed: a subsystem no longer in the assignment is removed
/// (its controllers torn down, discovery log changed); a namespace no longer in it is taken
/// out, every controller of its subsystem gets Namespace Attribute Changed (the Changed
/// Namespace List names it) and its commands in flight finish before the assignment is
/// acknowledged (the device closes with the last of them); the allowed hosts and their
/// DH-HMAC-CHAP keys follow the assignment ([`apply::apply_hosts`]; see [`Subsystem::set_access`]
/// for the controllers of a removed host). Subsystems and namespaces of the gateway's own
/// file are never removed, and an assignment built from no state at all (`state_version` 0)
/// removes nothing.
pub async fn apply_removals(target: &Target, base: &Config, a: &Assignment) {
    if a.state_version == 0 {
        return;
    }
    apply::remove_unwanted(target, &AssignmentWanted { base, a }, ORIGIN).await;
}

/// Ends the log lines of the changes an assignment makes.
const ORIGIN: &str = "in the control plane";

/// What an assignment wants of the subsystems a gateway serves: its own, and those of the
/// gateway's file (never removed; their hosts are the file's).
struct AssignmentWanted<'a> {
    base: &'a Config,
    a: &'a Assignment,
}

impl AssignmentWanted<'_> {
    fn in_file(&self, nqn: &str) -> Option<&SubsystemConfig> {
        self.base.subsystems.iter().find(|s| s.nqn == nqn)
    }

    fn pushed(&self, nqn: &str) -> Option<&control_plane::proto::Subsystem> {
        self.a.subsystems.iter().find(|s| s.nqn == nqn)
    }
}

impl apply::Wanted for AssignmentWanted<'_> {
    fn keeps_subsystem(&self, nqn: &str) -> bool {
        self.in_file(nqn).is_some() || self.pushed(nqn).is_some()
    }

    /// The file's namespaces by NSID; a pushed one only while the control plane pushes the
    /// identity it is served with ([`same_identity`]).
    fn keeps_namespace(&self, nqn: &str, ns: &Namespace) -> bool {
        let file_has = self
            .in_file(nqn)
            .is_some_and(|f| f.namespaces.iter().any(|n| n.nsid == ns.nsid));
        file_has
            || self
                .a
                .namespaces
                .iter()
                .any(|n| n.subsystem_nqn == nqn && n.nsid == ns.nsid && same_identity(n, ns))
    }

    fn hosts(&self, nqn: &str) -> Option<WantedHosts> {
        if self.in_file(nqn).is_some() {
            return None;
        }
        self.pushed(nqn).map(pushed_hosts)
    }

    /// A pushed namespace's hosts (`nvmeofctl namespace add-host/del-host`); the file's
    /// namespaces keep the file's.
    fn visibility(&self, nqn: &str, nsid: u32) -> Option<Visibility> {
        if self.in_file(nqn).is_some() {
            return None;
        }
        self.a
            .namespaces
            .iter()
            .find(|n| n.subsystem_nqn == nqn && n.nsid == nsid)
            .map(|n| Visibility::from_hosts(!n.no_auto_visible, n.hosts.iter().map(String::as_str)))
    }
}

/// Whether `served` is the namespace `pushed` names: the same NGUID and UUID. A control plane
/// stores a namespace's identity with it (never derives it from the NSID), so another
/// identity under the same NSID is another namespace: an image added after the one this
/// gateway serves was deleted, perhaps while this gateway was cut off. Serving the old
/// device under the NSID would put the new namespace's writes into the old image (or
/// the reverse). An identity the push leaves empty or that does not parse (never sent by
/// this project's control planes) is not compared.
fn same_identity(pushed: &control_plane::proto::Namespace, served: &Namespace) -> bool {
    let nguid_matches = parse_pushed_id(&pushed.nguid).is_none_or(|id| id == served.nguid);
    let uuid_matches = parse_pushed_id(&pushed.uuid).is_none_or(|id| id == served.uuid);
    nguid_matches && uuid_matches
}

/// A pushed NGUID (32 hex digits) or UUID (hyphenated) as the 16 bytes hosts read.
fn parse_pushed_id(text: &str) -> Option<[u8; 16]> {
    uuid::Uuid::try_parse(text).ok().map(|u| *u.as_bytes())
}

/// What an assignment wants of the namespaces served under its NSIDs: every one but those
/// served with another identity than the one pushed ([`same_identity`]). Nothing else is
/// changed (subsystems, hosts, visibility).
/// The gateway file's namespaces are its own: never taken out.
struct PushedIdentities<'a> {
    base: &'a Config,
    a: &'a Assignment,
}

impl apply::Wanted for PushedIdentities<'_> {
    fn keeps_subsystem(&self, _nqn: &str) -> bool {
        true
    }

    fn keeps_namespace(&self, nqn: &str, ns: &Namespace) -> bool {
        let in_file = self
            .base
            .subsystems
            .iter()
            .any(|s| s.nqn == nqn && s.namespaces.iter().any(|n| n.nsid == ns.nsid));
        in_file
            || self
                .a
                .namespaces
                .iter()
                .filter(|n| n.subsystem_nqn == nqn && n.nsid == ns.nsid)
                .all(|n| same_identity(n, ns))
    }

    fn hosts(&self, _nqn: &str) -> Option<WantedHosts> {
        None
    }
}

/// Takes out the namespaces served under an NSID that the assignment gives to another
/// namespace (another identity): hosts are told the NSID changed, commands in flight finish,
/// and [`apply_config`] then adds the pushed namespace with its own identity and image. A
/// host rescanning sees new identifiers under the NSID and drops the old device (Linux:
/// "identifiers changed"), so no write meant for one image reaches the other.
async fn take_out_reused_nsids(target: &Target, base: &Config, a: &Assignment) {
    if a.state_version == 0 {
        return;
    }
    let removed = apply::remove_unwanted(
        target,
        &PushedIdentities { base, a },
        "in the control plane: its NSID now names another namespace (another identity)",
    )
    .await;
    if removed.namespaces > 0 {
        tracing::warn!(
            namespaces = removed.namespaces,
            "namespaces served with an identity the control plane no longer has were taken out"
        );
    }
}

/// Namespaces whose ANA group the control plane changed (`nvmeofctl namespace move`): the
/// namespace is re-registered with the new group and hosts are told (Namespace Attribute
/// Changed: they re-read ANAGRPID). An RBD image is reopened on the new group's cluster
/// clients first, so fencing that group covers it (if that fails it stays on the old
/// group's clients, logged). A group new to the subsystem starts inaccessible; [`apply()`] sets
/// the pushed state right after.
pub async fn move_namespaces(target: &Target, a: &Assignment) {
    for n in &a.namespaces {
        let Some(sub) = target.subsystem(&n.subsystem_nqn) else {
            continue;
        };
        let Some(ns) = sub.namespace(n.nsid) else {
            continue;
        };
        if ns.ana_group == n.ana_group || n.ana_group == 0 {
            continue;
        }
        if n.moving_from_group != 0
            && ns.ana_group == n.moving_from_group
            && sub.ana_state(n.moving_from_group) != ana::OPTIMIZED
        {
            // A move still draining on the gateway serving the old group: stay in the old
            // group (not served here) until the control plane ends the move.
            continue;
        }
        if !sub.ana_groups().iter().any(|(g, _)| *g == n.ana_group) {
            sub.set_ana_state(n.ana_group, ana::INACCESSIBLE);
        }
        let device = match reopen_rbd(&ns.device, n.ana_group).await {
            Some(Ok(fresh)) => fresh,
            Some(Err(e)) => {
                tracing::warn!(
                    nqn = %n.subsystem_nqn,
                    nsid = n.nsid,
                    group = n.ana_group,
                    "cannot reopen the moved namespace on its new group's clients ({e}); \
                     it stays on the old group's"
                );
                ns.device.clone()
            }
            None => ns.device.clone(),
        };
        tracing::info!(
            nqn = %n.subsystem_nqn,
            nsid = n.nsid,
            from = ns.ana_group,
            to = n.ana_group,
            "namespace moved to another ANA group"
        );
        let was_optimized = sub.ana_state(ns.ana_group) == ana::OPTIMIZED;
        replace_namespace(&sub, &ns, device, n.ana_group);
        sub.notify_namespace_changed(n.nsid);
        if was_optimized {
            // Served here until now: its commands in flight finish before the assignment is
            // acknowledged.
            let started = std::time::Instant::now();
            while ns.device.in_flight() + ns.qos.waiting() > 0 && started.elapsed() < DRAIN_TIMEOUT
            {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            tracing::info!(
                nqn = %n.subsystem_nqn,
                nsid = n.nsid,
                in_flight = ns.device.in_flight(),
                ms = started.elapsed().as_millis() as u64,
                "moved namespace drained here"
            );
        }
    }
}

/// Re-registers `old` with `device` in `group` (same NSID and identifiers); the old device's
/// events are detached when the device changes.
fn replace_namespace(
    sub: &Arc<Subsystem>,
    old: &Namespace,
    device: Arc<dyn BlockDevice>,
    group: u32,
) {
    if !Arc::ptr_eq(&old.device, &device) {
        old.device.set_event_sink(Arc::new(Detached));
        device.set_event_sink(Arc::new(NamespaceEvents::new(sub, old.nsid)));
    }
    sub.add_namespace(Arc::new(Namespace {
        nsid: old.nsid,
        device,
        lba_shift: old.lba_shift,
        nguid: old.nguid,
        uuid: old.uuid,
        ana_group: group,
        read_only: old.read_only,
        qos: old.qos.clone(),
        frozen_size: old.frozen_size.clone(),
    }));
}

/// Opens an RBD device's image again on `group`'s current clients (off the runtime). None:
/// not an RBD device.
async fn reopen_rbd(
    device: &Arc<dyn BlockDevice>,
    group: u32,
) -> Option<Result<Arc<dyn BlockDevice>, String>> {
    device
        .as_any()
        .and_then(|a| a.downcast_ref::<RbdDevice>())?;
    let device = device.clone();
    let reopened = tokio::task::spawn_blocking(move || {
        let rbd = device
            .as_any()
            .and_then(|a| a.downcast_ref::<RbdDevice>())
            .ok_or_else(|| "not an RBD device".to_string())?;
        rbd.reopen_in_group(group)
            .map(|d| Arc::new(d) as Arc<dyn BlockDevice>)
            .map_err(|e| e.to_string())
    })
    .await;
    Some(reopened.unwrap_or_else(|e| Err(format!("reopen task failed: {e}"))))
}

/// Gives `group` fresh cluster clients on this gateway: retires its connections and reopens
/// every RBD image of the group on new ones (blocking work off the runtime), replacing the
/// namespaces' devices. In-flight ops of the old devices complete on their old clients (a
/// fenced one fails them with a path status). Returns whether every image reopened.
pub async fn refresh_group_clients(target: &Target, pool: &Arc<ClusterPool>, group: u32) -> bool {
    let started = std::time::Instant::now();
    let retired = pool.retire_group(group);
    let mut all_ok = true;
    let mut reopened = 0usize;
    for sub in target.subsystems() {
        if sub.is_discovery() {
            continue;
        }
        for ns in sub.namespaces() {
            if ns.ana_group != group {
                continue;
            }
            match reopen_rbd(&ns.device, group).await {
                None => {}
                Some(Ok(device)) => {
                    replace_namespace(&sub, &ns, device, group);
                    reopened += 1;
                }
                Some(Err(e)) => {
                    tracing::error!(
                        nqn = %sub.nqn(),
                        nsid = ns.nsid,
                        group,
                        "cannot reopen the image on a fresh client: {e}"
                    );
                    all_ok = false;
                }
            }
        }
    }
    tracing::info!(
        group,
        retired,
        reopened,
        ms = started.elapsed().as_millis() as u64,
        "ANA group given fresh cluster clients"
    );
    all_ok
}

/// Adds the subsystems and namespaces of an assignment that this gateway does not serve yet
/// (opening their RBD images off the runtime). Nothing is removed or changed: subsystems and
/// namespaces from the gateway's own file stay, and a pushed namespace whose NSID is taken is
/// left out. New ANA groups start inaccessible; [`apply()`] then sets the pushed states. A new
/// subsystem has its hosts' DH-HMAC-CHAP keys before it is served.
pub async fn apply_config(target: &Arc<Target>, base: &Config, a: &Assignment) {
    take_out_reused_nsids(target, base, a).await;
    move_namespaces(target, a).await;
    let mut wanted = Vec::new();
    for s in &a.subsystems {
        let existing = target.subsystem(&s.nqn);
        let namespaces: Vec<NamespaceConfig> = a
            .namespaces
            .iter()
            .filter(|n| n.subsystem_nqn == s.nqn)
            .filter(|n| {
                existing
                    .as_ref()
                    .is_none_or(|sub| sub.namespace(n.nsid).is_none())
            })
            .map(|n| NamespaceConfig {
                nsid: n.nsid,
                backend: "rbd".into(),
                size: None,
                block_size: n.block_size,
                // During a move, a gateway new to the namespace keeps it in the old group
                // (see `move_namespaces`) until the move ends.
                ana_group: if n.moving_from_group != 0 {
                    n.moving_from_group
                } else {
                    n.ana_group
                },
                read_only: false,
                uuid: (!n.uuid.is_empty()).then(|| n.uuid.clone()),
                nguid: (!n.nguid.is_empty()).then(|| n.nguid.clone()),
                pool: Some(n.pool.clone()),
                rados_namespace: (!n.rados_namespace.is_empty()).then(|| n.rados_namespace.clone()),
                image: Some(n.image.clone()),
                auto_visible: !n.no_auto_visible,
                hosts: n.hosts.clone(),
                rw_ios_per_second: pushed_qos(n).rw_ios_per_second,
                rw_megabytes_per_second: pushed_qos(n).rw_megabytes_per_second,
                r_megabytes_per_second: pushed_qos(n).r_megabytes_per_second,
                w_megabytes_per_second: pushed_qos(n).w_megabytes_per_second,
                frozen_size: (n.frozen_size != 0).then_some(n.frozen_size),
            })
            .collect();
        if existing.is_none() || !namespaces.is_empty() {
            wanted.push(SubsystemConfig {
                nqn: s.nqn.clone(),
                serial: (!s.serial.is_empty()).then(|| s.serial.clone()),
                model: None,
                allow_any_host: s.allow_any_host,
                // With their keys (the build sets them). A subsystem open to any host has no
                // host list in a configuration (refused as contradictory): its hosts' keys
                // are set below.
                hosts: if s.allow_any_host {
                    Vec::new()
                } else {
                    pushed_hosts(s).entries
                },
                require_tls: s.require_tls,
                namespaces,
            });
        }
    }
    if wanted.is_empty() {
        return;
    }
    let mut config = base.clone();
    config.subsystems = wanted;
    let to_build = config.clone();
    let built = tokio::task::spawn_blocking(move || to_build.build_target_report()).await;
    let (built, skipped) = match built {
        Ok(Ok(b)) => b,
        Ok(Err(e)) => {
            tracing::error!("pushed configuration refused: {e}");
            return;
        }
        Err(e) => {
            tracing::error!("opening pushed namespaces failed: {e}");
            return;
        }
    };
    for k in &skipped {
        tracing::error!(nqn = %k.nqn, nsid = k.nsid, image = %k.device, "pushed namespace not served yet: {}", k.error);
    }
    // Added to the target below; the ones that could not be opened (an OSD down, image not
    // there yet) are retried in the background like the file's, and next assignments try them
    // again too (whichever opens first serves; a second open replaces it harmlessly).
    let hosts = |nqn: &str| a.subsystems.iter().find(|s| s.nqn == nqn).map(pushed_hosts);
    apply::add_built(
        target,
        &built,
        &hosts,
        &apply::AddOptions {
            new_groups_inaccessible: true,
            what: "pushed",
            origin: ORIGIN,
        },
    )
    .await;
    if !skipped.is_empty() {
        // The retry thread attaches to the subsystems of `target` by NQN.
        let _ = config.spawn_namespace_retry(target, &skipped, Duration::from_secs(5));
    }
}

/// A pushed namespace's QoS limits (absent: none).
fn pushed_qos(n: &control_plane::proto::Namespace) -> control_plane::qos::QosLimits {
    control_plane::qos::QosLimits::from_proto(n.qos.as_ref())
}

/// Gives every pushed namespace this gateway serves the QoS limits of the assignment, live
/// (`nvmeofctl namespace set-qos`; the next op is held to them). Whichever gateway serves a
/// namespace, after a failover too, enforces the limits the group state has. Namespaces from
/// the gateway's own file keep the file's. Returns how many namespaces' limits changed.
pub fn apply_qos(target: &Target, base: &Config, a: &Assignment) -> usize {
    let mut changed = 0;
    for n in &a.namespaces {
        let in_file = base
            .subsystems
            .iter()
            .any(|s| s.nqn == n.subsystem_nqn && s.namespaces.iter().any(|f| f.nsid == n.nsid));
        if in_file {
            continue;
        }
        let Some(ns) = target
            .subsystem(&n.subsystem_nqn)
            .and_then(|sub| sub.namespace(n.nsid))
        else {
            continue;
        };
        let q = pushed_qos(n);
        let limits = crate::core::qos::QosLimits {
            rw_ios_per_second: q.rw_ios_per_second,
            rw_megabytes_per_second: q.rw_megabytes_per_second,
            r_megabytes_per_second: q.r_megabytes_per_second,
            w_megabytes_per_second: q.w_megabytes_per_second,
        };
        if ns.qos.set_limits(limits) {
            changed += 1;
            tracing::info!(nqn = %n.subsystem_nqn, nsid = n.nsid, qos = %limits, "QoS limits changed in the control plane");
        }
    }
    changed
}

/// Gives every pushed namespace this gateway serves the frozen size of the assignment, live
/// (`nvmeofctl namespace set --auto-resize`, `namespace resize` of a frozen namespace):
/// whichever gateway serves a namespace, after a failover or a restart too, reports the size
/// the group state has. Hosts get a Namespace Attribute Changed notice when the size they see
/// changes. Namespaces from the gateway's own file keep following their devices. Returns how
/// many namespaces' sizes changed for hosts.
pub fn apply_frozen_sizes(target: &Target, base: &Config, a: &Assignment) -> usize {
    let mut changed = 0;
    for n in &a.namespaces {
        let in_file = base
            .subsystems
            .iter()
            .any(|s| s.nqn == n.subsystem_nqn && s.namespaces.iter().any(|f| f.nsid == n.nsid));
        if in_file {
            continue;
        }
        let Some(sub) = target.subsystem(&n.subsystem_nqn) else {
            continue;
        };
        let Some(ns) = sub.namespace(n.nsid) else {
            continue;
        };
        let frozen = (n.frozen_size != 0).then_some(n.frozen_size);
        let seen = ns.size_in_lbas();
        if !ns.frozen_size.set(frozen) {
            continue;
        }
        let now = ns.size_in_lbas();
        tracing::info!(nqn = %n.subsystem_nqn, nsid = n.nsid, ?frozen, lbas_before = seen, lbas = now, "namespace's frozen size changed in the control plane");
        if now != seen {
            changed += 1;
            sub.notify_namespace_changed(n.nsid);
        }
    }
    changed
}

/// How often the last assignment's removals are applied again between assignments.
const REMOVALS_RECHECK: Duration = Duration::from_secs(5);

/// Waits until no command is in flight on the devices of `group`'s namespaces (at most
/// [`DRAIN_TIMEOUT`]).
async fn drain_group(subsystems: &[Arc<Subsystem>], group: u32) {
    let started = std::time::Instant::now();
    let in_flight = || -> usize {
        subsystems
            .iter()
            .flat_map(|s| s.namespaces())
            .filter(|ns| ns.ana_group == group)
            // Commands waiting for their QoS turn would reach the device after the drain.
            .map(|ns| ns.device.in_flight() + ns.qos.waiting())
            .sum()
    };
    let mut waited = false;
    loop {
        let n = in_flight();
        if n == 0 {
            if waited {
                tracing::info!(
                    group,
                    ms = started.elapsed().as_millis() as u64,
                    "ANA group drained: no command in flight"
                );
            }
            return;
        }
        if started.elapsed() >= DRAIN_TIMEOUT {
            tracing::warn!(
                group,
                in_flight = n,
                "ANA group not drained in time; acknowledging anyway (the fence cuts them off)"
            );
            return;
        }
        waited = true;
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Applies one assignment's ANA states to every NVM subsystem: first every group leaving
/// optimized, then (after refreshing the osdmap) every group becoming optimized. Returns
/// whether all of them are in force (false: the osdmap could not be refreshed, the groups to
/// promote stay as they were).
pub async fn apply(target: &Target, a: &Assignment) -> bool {
    apply_with_clients(target, a, &GroupClientsState::default()).await
}

/// [`apply()`], also keeping each group's cluster clients fresh: a group leaving optimized or
/// change here is remembered as lost, and a lost (or found blocklisted) group gets fresh
/// clients and reopened images before it turns optimized here again. A group whose images
/// cannot all be reopened is not promoted (the assignment is not acknowledged; the next one
/// retries).
pub async fn apply_with_clients(
    target: &Target,
    a: &Assignment,
    clients: &GroupClientsState,
) -> bool {
    let subsystems: Vec<_> = target
        .subsystems()
        .into_iter()
        .filter(|s| !s.is_discovery())
        .collect();
    let mut promote = Vec::new();
    let mut draining = Vec::new();
    for g in &a.ana_states {
        let Ok(state) = u8::try_from(g.state) else {
            tracing::warn!(
                group = g.ana_group,
                state = g.state,
                "bad ANA state ignored"
            );
            continue;
        };
        if state == ana::OPTIMIZED {
            let already = subsystems
                .iter()
                .all(|s| s.ana_state(g.ana_group) == ana::OPTIMIZED);
            if !already {
                promote.push(g.ana_group);
            }
            continue;
        }
        if state != ana::CHANGE
            && subsystems
                .iter()
                .any(|s| matches!(s.ana_state(g.ana_group), ana::OPTIMIZED | ana::CHANGE))
        {
            // Taken away from this gateway: its clients for the group may be fenced next.
            clients.lost().insert(g.ana_group);
            clients.fresh_while_lost().remove(&g.ana_group);
        }
        if subsystems
            .iter()
            .any(|s| s.ana_state(g.ana_group) == ana::OPTIMIZED)
        {
            // Leaving optimized (drain for a failback or a planned move): new commands get
            // a path status from now on; the ones already in flight finish before the
            // assignment is acknowledged, i.e. before the control plane fences this gateway
            // and turns the group optimized elsewhere.
            draining.push(g.ana_group);
        }
        for s in &subsystems {
            if s.ana_state(g.ana_group) != state {
                tracing::info!(group = g.ana_group, state, epoch = a.version, "ANA state");
                s.set_ana_state(g.ana_group, state);
            }
        }
    }
    if clients.cluster_stalled.load(Ordering::SeqCst)
        || clients.osds_unanswered.load(Ordering::SeqCst)
    {
        // Cut off from the cluster, or from some of its OSDs: a group taken away
        // (inaccessible, not a drain) was fenced before it moved, and its commands here
        // would wait for the hosts' I/O timeout. Hand them back to the hosts now.
        let moved: BTreeSet<u32> = draining
            .iter()
            .copied()
            .filter(|g| {
                subsystems
                    .iter()
                    .all(|s| s.ana_state(*g) == ana::INACCESSIBLE)
            })
            .collect();
        if !moved.is_empty() {
            let closed = close_stuck_controllers(
                &subsystems,
                &moved,
                crate::core::TeardownReason::ClusterStalled,
            );
            tracing::warn!(
                groups = ?moved,
                controllers_closed = closed,
                "groups moved away while this gateway is cut off from the cluster (or from \
                 OSDs): controllers with commands stuck there closed, so hosts re-send them \
                 on the new path"
            );
            draining.retain(|g| !moved.contains(g));
        }
    }
    for g in draining {
        drain_group(&subsystems, g).await;
    }
    if promote.is_empty() {
        return true;
    }
    if a.wait_for_osdmap {
        let started = std::time::Instant::now();
        match clients
            .refresh_osdmap(
                OSDMAP_REFRESH_BOUND,
                rbd_backend::rados::wait_for_latest_osdmap_all,
            )
            .await
        {
            Ok(n) => tracing::info!(
                clients = n,
                ms = started.elapsed().as_millis() as u64,
                "osdmap refreshed before turning groups optimized"
            ),
            Err(e) => {
                // Our own clients cannot reach the cluster: serving would fail anyway, and
                // the previous holder's fence may not be visible here. Stay as we are; the
                // assignment is applied again (or a newer one) a second later.
                tracing::error!(
                    "cannot refresh the osdmap ({e}); groups {promote:?} stay as they are"
                );
                return false;
            }
        }
    }
    let mut all = true;
    for g in promote {
        if let Some(pool) = clients.pool() {
            if clients.needs_fresh_clients(g) {
                if !refresh_group_clients(target, &pool, g).await {
                    tracing::error!(
                        group = g,
                        "ANA group not turned optimized: its images could not all be reopened"
                    );
                    all = false;
                    continue;
                }
                clients.lost().remove(&g);
                clients.fresh_while_lost().remove(&g);
            }
        }
        if clients.demoted.load(Ordering::SeqCst) {
            // The lease ran out while this was being prepared: wait for the control plane.
            tracing::warn!(
                group = g,
                "ANA group not turned optimized: this gateway is demoted until the control \
                 plane answers"
            );
            all = false;
            continue;
        }
        if target.reservations_persisted() && !load_reservations(&subsystems, g).await {
            tracing::error!(
                group = g,
                "ANA group not turned optimized: its reservations could not all be loaded"
            );
            all = false;
            continue;
        }
        tracing::info!(group = g, epoch = a.version, "ANA state optimized");
        for s in &subsystems {
            s.set_ana_state(g, ana::OPTIMIZED);
        }
    }
    all
}

/// Loads the reservation state of every namespace of ANA group `group` from its device (the
/// record the previous owner stored, through this gateway's fresh clients), before the group
/// turns optimized here: the hosts then see the same registrations, holder and generation
/// as through the previous owner. False if any could not be read (the group stays as it is;
/// the next assignment retries).
pub(crate) async fn load_reservations(subsystems: &[Arc<Subsystem>], group: u32) -> bool {
    let mut all = true;
    for sub in subsystems {
        for ns in sub
            .namespaces()
            .into_iter()
            .filter(|n| n.ana_group == group)
        {
            let device = ns.device.clone();
            let started = std::time::Instant::now();
            let loaded = tokio::task::spawn_blocking(move || {
                device.load_record(crate::core::pr::RECORD_KEY)
            })
            .await;
            let state = match loaded {
                Ok(Ok(None)) => crate::core::pr::ReservationState::default(),
                Ok(Ok(Some(record))) => match crate::core::pr::ReservationState::decode(&record) {
                    Ok(state) => state,
                    Err(e) => {
                        tracing::error!(subsystem = %sub.nqn(), nsid = ns.nsid, "{e}");
                        all = false;
                        continue;
                    }
                },
                Ok(Err(e)) => {
                    tracing::error!(
                        subsystem = %sub.nqn(),
                        nsid = ns.nsid,
                        "cannot load the reservation state: {e}"
                    );
                    all = false;
                    continue;
                }
                Err(e) => {
                    tracing::error!("reservation load task failed: {e}");
                    all = false;
                    continue;
                }
            };
            tracing::info!(
                subsystem = %sub.nqn(),
                nsid = ns.nsid,
                group,
                generation = state.generation,
                registrants = state.registrants.len(),
                reserved = state.holder.is_some(),
                ms = started.elapsed().as_millis() as u64,
                "reservation state loaded"
            );
            sub.reservations.load(ns.nsid, state);
        }
    }
    all
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use control_plane::proto::GroupState;

    const TOML: &str = r#"
[gateway]
name = "gw1"
[group]
control_plane = ["127.0.0.1:5500"]
ana_group = 1
[[listener]]
transport = "tcp"
address = "127.0.0.1"
port = 4420
[[subsystem]]
nqn = "nqn.2016-06.io.test:group"
allow_any_host = true
[[subsystem.namespace]]
nsid = 1
backend = "memory"
size = "1MiB"
ana_group = 1
[[subsystem.namespace]]
nsid = 2
backend = "memory"
size = "1MiB"
ana_group = 2
"#;

    #[test]
    fn the_group_section_is_checked() {
        let c = Config::from_toml_str(TOML).expect("config");
        let g = c.group.expect("group");
        assert_eq!(g.control_plane, vec!["127.0.0.1:5500"]);
        assert_eq!(g.ana_group, Some(1));
        let e = Config::from_toml_str(&TOML.replace("name = \"gw1\"", ""))
            .expect_err("no name")
            .to_string();
        assert!(e.contains("gateway.name"), "{e}");
        let e = Config::from_toml_str(&TOML.replace(
            "ana_group = 1\n[[listener]]",
            "beacon_interval_ms = 5000\n[[listener]]",
        ))
        .expect_err("slow beacons")
        .to_string();
        assert!(e.contains("group.beacon_interval_ms"), "{e}");
    }

    #[test]
    fn a_group_member_may_leave_its_listeners_to_the_control_plane() {
        let pushed_only =
            "[gateway]\nname = \"gw1\"\n[group]\ncontrol_plane = [\"127.0.0.1:5500\"]\n";
        let c = Config::from_toml_str(pushed_only).expect("no [[listener]] in a group");
        assert!(c.listen_addrs().is_empty());
        let e = Config::from_toml_str("[gateway]\nname = \"gw1\"\n")
            .expect_err("standalone without a listener")
            .to_string();
        assert!(
            e.starts_with("listener: at least one [[listener]] is required"),
            "{e}"
        );
    }

    /// `TOML` with one more line in its `[group]` section.
    fn with_group_line(line: &str) -> Result<Config, crate::config::ConfigError> {
        Config::from_toml_str(&TOML.replace(
            "ana_group = 1\n[[listener]]",
            &format!("ana_group = 1\n{line}\n[[listener]]"),
        ))
    }

    #[test]
    fn the_leave_timeout_is_configurable_and_checked() {
        let g = Config::from_toml_str(TOML)
            .expect("config")
            .group
            .expect("group");
        assert_eq!(g.leave_timeout(), Duration::from_secs(10), "the default");
        let with = with_group_line;
        let g = with("leave_timeout_ms = 2500")
            .expect("config")
            .group
            .expect("group");
        assert_eq!(g.leave_timeout(), Duration::from_millis(2500));
        for bad in ["leave_timeout_ms = 0", "leave_timeout_ms = 600001"] {
            let e = with(bad).expect_err(bad).to_string();
            assert!(
                e.starts_with("group.leave_timeout_ms: ") && e.contains("is not 1..=600000"),
                "{e}"
            );
        }
        let e = with("leave_timeout_ms = \"10s\"")
            .expect_err("a string")
            .to_string();
        assert!(e.contains("leave_timeout_ms"), "{e}");
    }

    #[test]
    fn the_stall_window_is_configurable_and_checked() {
        let g = Config::from_toml_str(TOML)
            .expect("config")
            .group
            .expect("group");
        assert_eq!(
            g.stall_window(),
            None,
            "the default: half the leader's grace"
        );
        let with = with_group_line;
        for (line, ms) in [
            ("stall_window_ms = 400", 400),
            ("stall_window_ms = 5000", 5000),
        ] {
            let g = with(line).expect(line).group.expect("group");
            assert_eq!(g.stall_window(), Some(Duration::from_millis(ms)));
        }
        for bad in [
            "stall_window_ms = 399",
            "stall_window_ms = 600001",
            "stall_window_ms = 0",
        ] {
            let e = with(bad).expect_err(bad).to_string();
            assert!(
                e.starts_with("group.stall_window_ms: ") && e.contains("is not 400..=600000"),
                "{e}"
            );
        }
        let e = with("stall_window_ms = -1")
            .expect_err("negative")
            .to_string();
        assert!(e.contains("stall_window_ms"), "{e}");
    }

    fn assignment(version: u64, states: &[(u32, u8)]) -> Assignment {
        Assignment {
            version,
            ana_states: states
                .iter()
                .map(|&(g, s)| GroupState {
                    ana_group: g,
                    state: u32::from(s),
                })
                .collect(),
            wait_for_osdmap: true,
            ..Assignment::default()
        }
    }

    /// The file's subsystem plus one "pushed" subsystem (built from the same file here, but
    /// absent from the base configuration passed to `apply_removals`, as a pushed one is).
    const PUSHED: &str = "nqn.2016-06.io.test:pushed";

    fn pushed_assignment(state_version: u64, nsids: &[u32], hosts: &[&str]) -> Assignment {
        Assignment {
            version: state_version,
            state_version,
            subsystems: vec![control_plane::proto::Subsystem {
                nqn: PUSHED.into(),
                allow_any_host: hosts.is_empty(),
                hosts: hosts.iter().map(|h| h.to_string()).collect(),
                ..Default::default()
            }],
            namespaces: nsids
                .iter()
                .map(|&nsid| control_plane::proto::Namespace {
                    subsystem_nqn: PUSHED.into(),
                    nsid,
                    ana_group: 1,
                    ..Default::default()
                })
                .collect(),
            ..Assignment::default()
        }
    }

    /// A pushed namespace with the identity `uuid` (its NGUID: the same bytes, as a control
    /// plane chooses them).
    fn pushed_namespace(nqn: &str, nsid: u32, uuid: &str) -> control_plane::proto::Namespace {
        control_plane::proto::Namespace {
            subsystem_nqn: nqn.into(),
            nsid,
            ana_group: 1,
            uuid: uuid.into(),
            nguid: uuid.replace('-', ""),
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn an_nsid_pushed_with_another_identity_is_another_namespace() {
        let base = Config::from_toml_str(TOML).expect("config");
        let (old, new) = (
            "3f2504e0-4f89-41d3-9a0c-0305e82c3301",
            "9b6a4c52-1d0e-4a5f-8c3b-2e7f6d1a0b94",
        );
        let served = format!(
            "{TOML}\n[[subsystem]]\nnqn = \"{PUSHED}\"\nallow_any_host = true\n\
             [[subsystem.namespace]]\nnsid = 1\nbackend = \"memory\"\nsize = \"1MiB\"\n\
             uuid = \"{old}\"\nnguid = \"{}\"\n\
             [[subsystem.namespace]]\nnsid = 2\nbackend = \"memory\"\nsize = \"1MiB\"\n",
            old.replace('-', "")
        );
        let target = Config::from_toml_str(&served)
            .expect("config")
            .build_target()
            .expect("target");
        let pushed = target.subsystem(PUSHED).expect("pushed");
        let file_sub = target.subsystem("nqn.2016-06.io.test:group").expect("file");
        let mut a = pushed_assignment(7, &[], &[]);
        a.namespaces = vec![
            // The namespace served as NSID 1, still pushed with its identity: it stays.
            pushed_namespace(PUSHED, 1, old),
            // NSID 2 with an identity the push leaves empty (not compared): it stays.
            control_plane::proto::Namespace {
                subsystem_nqn: PUSHED.into(),
                nsid: 2,
                ana_group: 1,
                ..Default::default()
            },
            // The file's NSID 1 pushed with another identity: the file's own stays.
            pushed_namespace("nqn.2016-06.io.test:group", 1, new),
        ];
        take_out_reused_nsids(&target, &base, &a).await;
        apply_removals(&target, &base, &a).await;
        assert_eq!(pushed.namespaces().len(), 2, "nothing reused: nothing out");
        assert_eq!(file_sub.namespaces().len(), 2);

        // NSID 1 deleted and another image added under it (a new identity), in one push.
        a.namespaces[0] = pushed_namespace(PUSHED, 1, new);
        let (taken_out, kept) = (pushed.namespace(1).expect("ns 1"), pushed.namespace(2));
        take_out_reused_nsids(&target, &base, &a).await;
        assert!(
            pushed.namespace(1).is_none(),
            "the old image is no longer served under NSID 1"
        );
        assert!(
            taken_out.device.in_flight() == 0,
            "drained before it returned"
        );
        assert!(kept.is_some() && pushed.namespace(2).is_some());
        assert_eq!(file_sub.namespaces().len(), 2, "the file's namespaces stay");

        // The removals pass agrees: a namespace served with another identity than the
        // pushed one is not kept (the add then brings the pushed one).
        let target = Config::from_toml_str(&served)
            .expect("config")
            .build_target()
            .expect("target");
        apply_removals(&target, &base, &a).await;
        let nsids: Vec<u32> = target
            .subsystem(PUSHED)
            .expect("pushed")
            .namespaces()
            .iter()
            .map(|n| n.nsid)
            .collect();
        assert_eq!(nsids, vec![2]);
    }

    #[tokio::test]
    async fn removals_touch_only_what_the_control_plane_pushed() {
        let base = Config::from_toml_str(TOML).expect("config");
        let with_pushed = format!(
            "{TOML}\n[[subsystem]]\nnqn = \"{PUSHED}\"\nallow_any_host = true\n\
             [[subsystem.namespace]]\nnsid = 1\nbackend = \"memory\"\nsize = \"1MiB\"\n\
             [[subsystem.namespace]]\nnsid = 2\nbackend = \"memory\"\nsize = \"1MiB\"\n"
        );
        let target = Config::from_toml_str(&with_pushed)
            .expect("config")
            .build_target()
            .expect("target");
        let file_sub = target.subsystem("nqn.2016-06.io.test:group").expect("file");
        let pushed = target.subsystem(PUSHED).expect("pushed");
        // Built from no state: nothing removed although nothing is listed.
        apply_removals(&target, &base, &Assignment::default()).await;
        assert_eq!(pushed.namespaces().len(), 2);
        assert!(target.subsystem(PUSHED).is_some());

        // Namespace 2 deleted: it goes, namespace 1 and the file's subsystem stay.
        apply_removals(&target, &base, &pushed_assignment(5, &[1], &[])).await;
        let nsids: Vec<u32> = pushed.namespaces().iter().map(|n| n.nsid).collect();
        assert_eq!(nsids, vec![1]);
        assert_eq!(file_sub.namespaces().len(), 2, "the file's namespaces stay");

        // Host list from the control plane.
        let host = "nqn.2014-08.org.nvmexpress:uuid:allowed";
        apply_removals(&target, &base, &pushed_assignment(6, &[1], &[host])).await;
        assert!(pushed.allows_host(host));
        assert!(!pushed.allows_host("nqn.2014-08.org.nvmexpress:uuid:other"));
        assert!(file_sub.allows_host("nqn.2014-08.org.nvmexpress:uuid:other"));

        // Subsystem deleted: it goes; the file's subsystem is never removed.
        let generation = target.discovery_generation();
        apply_removals(
            &target,
            &base,
            &Assignment {
                state_version: 7,
                ..Assignment::default()
            },
        )
        .await;
        assert!(target.subsystem(PUSHED).is_none());
        assert!(target.subsystem("nqn.2016-06.io.test:group").is_some());
        assert!(target.discovery_generation() > generation);
    }

    /// `nvmeofctl namespace add-host/del-host` reach a gateway as the pushed namespace's
    /// hosts: the served namespace follows each assignment, no device is reopened.
    #[tokio::test]
    async fn pushed_namespace_hosts_set_who_sees_a_served_namespace() {
        let base = Config::from_toml_str(TOML).expect("config");
        let with_pushed = format!(
            "{TOML}\n[[subsystem]]\nnqn = \"{PUSHED}\"\nallow_any_host = true\n\
             [[subsystem.namespace]]\nnsid = 1\nbackend = \"memory\"\nsize = \"1MiB\"\n"
        );
        let target = Config::from_toml_str(&with_pushed)
            .expect("config")
            .build_target()
            .expect("target");
        let pushed = target.subsystem(PUSHED).expect("pushed");
        let device = pushed.namespace(1).expect("ns 1").device.clone();
        let host = "nqn.2014-08.org.nvmexpress:uuid:only";
        let with_hosts = |version: u64, no_auto_visible: bool, hosts: &[&str]| {
            let mut a = pushed_assignment(version, &[1], &[]);
            a.namespaces[0].no_auto_visible = no_auto_visible;
            a.namespaces[0].hosts = hosts.iter().map(|h| h.to_string()).collect();
            a
        };
        apply_removals(&target, &base, &with_hosts(5, true, &[host])).await;
        assert_eq!(
            pushed.visibility(1),
            Visibility::Only([host.to_string()].into())
        );
        assert!(pushed.namespace_for_host(1, host).is_some());
        assert!(pushed
            .namespace_for_host(1, "nqn.2014-08.org.nvmexpress:uuid:other")
            .is_none());
        apply_removals(&target, &base, &with_hosts(6, true, &[])).await;
        assert!(pushed.namespace_for_host(1, host).is_none());
        apply_removals(&target, &base, &with_hosts(7, false, &[])).await;
        assert_eq!(pushed.visibility(1), Visibility::AllHosts);
        let same = pushed.namespace(1).expect("still served").device.clone();
        assert!(Arc::ptr_eq(&device, &same), "the device was not reopened");
    }

    const PLAIN: &str = "nqn.2014-08.org.nvmexpress:uuid:0f0f0f0f-0000-0000-0000-0000000000c1";
    const KEYED: &str = "nqn.2014-08.org.nvmexpress:uuid:0f0f0f0f-0000-0000-0000-0000000000c2";

    fn secret(byte: u8) -> crate::auth::DhchapSecret {
        crate::auth::DhchapSecret::from_bytes(&[byte; 32], None).expect("32 bytes")
    }

    fn text(key: &crate::auth::DhchapSecret) -> String {
        key.to_representation().to_string()
    }

    /// A pushed subsystem `nqn` as a control plane that knows keys sends it: `hosts` has the
    /// hosts without keys, `host_entries` every host (host NQN, host key, controller key).
    fn keyed_subsystem(
        nqn: &str,
        allow_any_host: bool,
        hosts: &[(&str, Option<&str>, Option<&str>)],
    ) -> control_plane::proto::Subsystem {
        control_plane::proto::Subsystem {
            nqn: nqn.into(),
            allow_any_host,
            hosts: hosts
                .iter()
                .filter(|(_, k, _)| k.is_none())
                .map(|(h, _, _)| h.to_string())
                .collect(),
            host_entries: hosts
                .iter()
                .map(|&(h, k, c)| control_plane::proto::Host {
                    subsystem_nqn: nqn.into(),
                    host_nqn: h.into(),
                    dhchap_key: k.unwrap_or_default().into(),
                    dhchap_ctrl_key: c.unwrap_or_default().into(),
                    auth: String::new(),
                    psk: None,
                })
                .collect(),
            ..Default::default()
        }
    }

    fn keyed_assignment(
        state_version: u64,
        subsystems: Vec<control_plane::proto::Subsystem>,
    ) -> Assignment {
        Assignment {
            version: state_version,
            state_version,
            subsystems,
            ..Assignment::default()
        }
    }

    /// What the gateway logs while the test runs (on this thread), to check no key shows.
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().expect("log").extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl Captured {
        fn text(&self) -> String {
            String::from_utf8_lossy(&self.0.lock().expect("log")).into_owned()
        }
    }

    fn capture_logs() -> (Captured, tracing::subscriber::DefaultGuard) {
        let captured = Captured::default();
        let writer = captured.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::TRACE)
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish();
        (captured, tracing::subscriber::set_default(subscriber))
    }

    /// Pushed keys on a running gateway: a subsystem built from an assignment has them; on
    /// an existing one they are set, replaced and cleared as the control plane says, for a
    /// host list and for a subsystem open to any host; a host whose keys do not parse is not
    /// let in; a control plane without keys (`hosts` only) still works; nothing logged shows
    /// a key.
    #[tokio::test]
    async fn pushed_host_keys_are_enforced_and_follow_changes() {
        let (logs, _guard) = capture_logs();
        let base = Config::from_toml_str(TOML).expect("config");
        let target = base.build_target().expect("target");
        let (k1, c1, k2) = (secret(0x11), secret(0x22), secret(0x33));
        let (k1t, c1t, k2t) = (text(&k1), text(&c1), text(&k2));
        const OPEN: &str = "nqn.2016-06.io.test:open";

        // New subsystems from an assignment: a host list, and one open to any host.
        let a = keyed_assignment(
            1,
            vec![
                keyed_subsystem(
                    PUSHED,
                    false,
                    &[(PLAIN, None, None), (KEYED, Some(&k1t), Some(&c1t))],
                ),
                keyed_subsystem(OPEN, true, &[(KEYED, Some(&k1t), None)]),
            ],
        );
        apply_config(&target, &base, &a).await;
        apply_removals(&target, &base, &a).await;
        let pushed = target.subsystem(PUSHED).expect("built");
        let open = target.subsystem(OPEN).expect("built");
        assert!(pushed.allows_host(PLAIN) && pushed.allows_host(KEYED));
        assert!(!pushed.allows_host("nqn.2016-06.io.test:other"));
        assert_eq!(pushed.host_keys(PLAIN), None);
        let keys = pushed.host_keys(KEYED).expect("KEYED must authenticate");
        assert_eq!((&keys.host, keys.ctrl.as_ref()), (&k1, Some(&c1)));
        assert!(open.allows_host("nqn.2016-06.io.test:other"));
        assert_eq!(
            open.host_keys(KEYED).map(|k| k.host.clone()),
            Some(k1.clone())
        );
        assert_eq!(open.host_keys("nqn.2016-06.io.test:other"), None);

        // Replaced (host key only now), on both; PLAIN given a key.
        let a = keyed_assignment(
            2,
            vec![
                keyed_subsystem(
                    PUSHED,
                    false,
                    &[(PLAIN, Some(&k1t), None), (KEYED, Some(&k2t), None)],
                ),
                keyed_subsystem(OPEN, true, &[(KEYED, Some(&k2t), None)]),
            ],
        );
        apply_config(&target, &base, &a).await;
        apply_removals(&target, &base, &a).await;
        let keys = pushed.host_keys(KEYED).expect("still keyed");
        assert_eq!((&keys.host, keys.ctrl.as_ref()), (&k2, None));
        assert_eq!(
            pushed.host_keys(PLAIN).map(|k| k.host.clone()),
            Some(k1.clone())
        );
        assert_eq!(
            open.host_keys(KEYED).map(|k| k.host.clone()),
            Some(k2.clone())
        );
        let logged = logs.text();
        assert!(
            logged.contains("DH-HMAC-CHAP keys changed in the control plane")
                && logged.contains(KEYED)
                && logged.contains("auth=\"host\" was=\"bidirectional\""),
            "{logged}"
        );

        // Cleared on PUSHED (the host stays); KEYED removed from the open subsystem: its key
        // goes although no host list names it.
        let a = keyed_assignment(
            3,
            vec![
                keyed_subsystem(PUSHED, false, &[(PLAIN, None, None), (KEYED, None, None)]),
                keyed_subsystem(OPEN, true, &[]),
            ],
        );
        apply_removals(&target, &base, &a).await;
        assert!(pushed.allows_host(KEYED) && pushed.allows_host(PLAIN));
        assert_eq!(pushed.host_keys(KEYED), None);
        assert_eq!(pushed.host_keys(PLAIN), None);
        assert_eq!(open.host_keys(KEYED), None);

        // A key that does not parse: that host is not let in at all; the others are.
        let mut bad = k1t.clone().into_bytes();
        bad[14] = if bad[14] == b'A' { b'B' } else { b'A' };
        let bad = String::from_utf8(bad).expect("ASCII");
        let a = keyed_assignment(
            4,
            vec![
                keyed_subsystem(
                    PUSHED,
                    false,
                    &[(PLAIN, None, None), (KEYED, Some(&bad), None)],
                ),
                keyed_subsystem(OPEN, true, &[]),
            ],
        );
        apply_removals(&target, &base, &a).await;
        assert!(pushed.allows_host(PLAIN));
        assert!(!pushed.allows_host(KEYED), "let in without its key");
        assert!(logs
            .text()
            .contains("pushed host not allowed here: its dhchap_key is refused"));

        // A control plane that predates keys: `hosts` alone.
        let mut old = keyed_subsystem(PUSHED, false, &[(PLAIN, None, None), (KEYED, None, None)]);
        old.host_entries.clear();
        apply_removals(&target, &base, &keyed_assignment(5, vec![old])).await;
        assert!(pushed.allows_host(KEYED) && pushed.allows_host(PLAIN));
        assert_eq!(pushed.host_keys(KEYED), None);

        let logged = logs.text();
        for k in [&k1t, &c1t, &k2t, &bad] {
            assert!(!logged.contains(&k[10..50]), "a key in the log:\n{logged}");
        }
    }

    fn psk_text(byte: u8) -> String {
        nvme_auth::tls_psk::ConfiguredPsk::from_bytes(&[byte; 32], None)
            .expect("32 bytes")
            .to_interchange()
            .to_string()
    }

    /// A pushed subsystem whose hosts have TLS PSKs (host NQN, key, derivation).
    fn tls_subsystem(
        require_tls: bool,
        hosts: &[(&str, &str, &str)],
    ) -> control_plane::proto::Subsystem {
        control_plane::proto::Subsystem {
            nqn: PUSHED.into(),
            require_tls,
            host_entries: hosts
                .iter()
                .map(|&(h, key, derivation)| control_plane::proto::Host {
                    subsystem_nqn: PUSHED.into(),
                    host_nqn: h.into(),
                    psk: (!key.is_empty()).then(|| control_plane::proto::TlsPsk {
                        key: key.into(),
                        derivation: derivation.into(),
                    }),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }
    }

    fn tls_assignment(
        version: u64,
        subsystem: control_plane::proto::Subsystem,
        secure: bool,
    ) -> Assignment {
        let listener = |gateway: &str, address: &str| control_plane::proto::Listener {
            subsystem_nqn: PUSHED.into(),
            gateway: gateway.into(),
            transport: "tcp".into(),
            address: address.into(),
            port: 4430,
            secure,
        };
        Assignment {
            version,
            state_version: version,
            subsystems: vec![subsystem],
            listeners: vec![listener("gw1", "127.0.0.1")],
            group_listeners: vec![listener("gw1", "127.0.0.1"), listener("gw2", "127.0.0.2")],
            ..Assignment::default()
        }
    }

    async fn apply_all(target: &Arc<Target>, base: &Config, a: &Assignment) {
        apply_config(target, base, a).await;
        apply_removals(target, base, a).await;
        apply_listeners(target, a);
        apply_tls(target, a);
    }

    /// TLS settings from the control plane, as the file gives them: a subsystem built from
    /// an assignment requires TLS and has its hosts' PSKs (each with its derivation); the
    /// listeners are secure in the discovery log and this gateway's socket is a TLS one;
    /// all of it follows the next assignment (plain again, PSK cleared); a PSK that does
    /// not parse keeps its host out; no PSK is logged.
    #[tokio::test]
    async fn pushed_tls_settings_are_applied_and_follow_changes() {
        use nvme_auth::tls_psk::{ConfiguredPsk, LabelEncoding};
        let (logs, _guard) = capture_logs();
        let base = Config::from_toml_str(TOML).expect("config");
        let target = base.build_target().expect("target");
        let (p1, p2) = (psk_text(0x41), psk_text(0x42));

        let a = tls_assignment(
            1,
            tls_subsystem(true, &[(KEYED, &p1, ""), (PLAIN, &p2, "libnvme-compat")]),
            true,
        );
        apply_all(&target, &base, &a).await;
        let pushed = target.subsystem(PUSHED).expect("built");
        assert!(pushed.tls.required());
        let psk = pushed.tls.psk(KEYED).expect("KEYED's PSK");
        assert_eq!(psk.psk, ConfiguredPsk::parse(&p1).expect("p1"));
        assert_eq!(psk.derivation, LabelEncoding::Rfc8446);
        let psk = pushed.tls.psk(PLAIN).expect("PLAIN's PSK");
        assert_eq!(psk.psk, ConfiguredPsk::parse(&p2).expect("p2"));
        assert_eq!(psk.derivation, LabelEncoding::LibnvmeCompat);
        assert!(pushed.allows_host(KEYED) && pushed.allows_host(PLAIN));
        assert!(target.secure_listeners.is_secure("127.0.0.1", 4430));
        assert!(target.secure_listeners.is_secure("127.0.0.2", 4430));
        let own = own_listeners(&a, "gw1");
        assert!(
            own.len() == 1 && own.iter().all(|l| l.secure && !l.rdma),
            "{own:?}"
        );

        // Plain again: not required, KEYED's PSK cleared, listeners plain.
        let a = tls_assignment(2, tls_subsystem(false, &[(KEYED, "", "")]), false);
        apply_all(&target, &base, &a).await;
        assert!(!pushed.tls.required());
        assert!(pushed.tls.psk(KEYED).is_none());
        assert!(pushed.allows_host(KEYED) && !pushed.allows_host(PLAIN));
        assert!(!target.secure_listeners.is_secure("127.0.0.1", 4430));
        assert!(!target.secure_listeners.is_secure("127.0.0.2", 4430));
        assert!(own_listeners(&a, "gw1").iter().all(|l| !l.secure));

        // A PSK that does not parse here (a CRC mismatch): that host is not let in.
        let mut bad = p1.clone().into_bytes();
        bad[20] = if bad[20] == b'A' { b'B' } else { b'A' };
        let bad = String::from_utf8(bad).expect("ASCII");
        let a = tls_assignment(
            3,
            tls_subsystem(true, &[(KEYED, &bad, ""), (PLAIN, &p2, "")]),
            true,
        );
        apply_all(&target, &base, &a).await;
        assert!(!pushed.allows_host(KEYED), "let in without its PSK");
        assert!(pushed.tls.psk(KEYED).is_none());
        assert!(pushed.allows_host(PLAIN) && pushed.tls.psk(PLAIN).is_some());
        let logged = logs.text();
        assert!(
            logged.contains("pushed host not allowed here: its psk is refused"),
            "{logged}"
        );
        for k in [&p1, &p2, &bad] {
            assert!(!logged.contains(&k[16..48]), "a PSK in the log:\n{logged}");
        }
    }

    /// The (subsystem NQN, address, port, TREQ) of every NVM subsystem record of `host`'s
    /// discovery log on `target`.
    fn offered_paths(target: &Target, host: &str) -> Vec<(String, String, u16, u8)> {
        use crate::spec::disc;
        let page = crate::core::log_page::discovery_page(target, host, None);
        let n = u64::from_le_bytes(page[8..16].try_into().expect("NUMREC")) as usize;
        let mut out: Vec<_> = (0..n)
            .map(|i| &page[disc::HEADER_LEN + i * disc::ENTRY_LEN..][..disc::ENTRY_LEN])
            .filter(|e| e[2] == disc::SUBTYPE_NVME)
            .map(|e| {
                let text = |r: std::ops::Range<usize>| {
                    String::from_utf8_lossy(&e[r])
                        .trim_end_matches(['\0', ' '])
                        .to_string()
                };
                let port = text(32..64).parse().expect("TRSVCID");
                (text(256..512), text(512..768), port, e[3])
            })
            .collect();
        out.sort();
        out
    }

    /// Every gateway lists the group's listeners (those of the other gateways too): a
    /// subsystem the control plane makes require TLS is offered on the secure ones only, on
    /// every gateway's address, with TREQ "required"; the change raises a Discovery Log
    /// Change (the generation moves), and the plain listeners offer it again once TLS is no
    /// longer required.
    #[tokio::test]
    async fn pushed_listeners_offer_a_tls_required_subsystem_on_secure_ones_only() {
        use crate::spec::disc;
        let base = Config::from_toml_str(TOML).expect("config");
        let target = base.build_target().expect("target");
        let listener = |gateway: &str, address: &str, port: u32, secure: bool| {
            control_plane::proto::Listener {
                subsystem_nqn: PUSHED.into(),
                gateway: gateway.into(),
                transport: "tcp".into(),
                address: address.into(),
                port,
                secure,
            }
        };
        let group = vec![
            listener("gw1", "127.0.0.1", 4430, true),
            listener("gw1", "127.0.0.1", 4431, false),
            listener("gw2", "127.0.0.2", 4430, true),
            listener("gw2", "127.0.0.2", 4431, false),
        ];
        let assignment = |version: u64, require_tls: bool| Assignment {
            version,
            state_version: version,
            subsystems: vec![tls_subsystem(require_tls, &[(KEYED, &psk_text(0x41), "")])],
            listeners: group[..2].to_vec(),
            group_listeners: group.clone(),
            ..Assignment::default()
        };
        apply_all(&target, &base, &assignment(1, true)).await;
        let required = disc::TREQ_SECURE_CHANNEL_REQUIRED | disc::TREQ_DISABLE_SQFLOW;
        let plain = disc::TREQ_SECURE_CHANNEL_NOT_SPECIFIED | disc::TREQ_DISABLE_SQFLOW;
        let pushed: Vec<_> = offered_paths(&target, KEYED)
            .into_iter()
            .filter(|p| p.0 == PUSHED)
            .collect();
        assert_eq!(
            pushed,
            vec![
                (PUSHED.into(), "127.0.0.1".into(), 4430, required),
                (PUSHED.into(), "127.0.0.2".into(), 4430, required),
            ]
        );

        let generation = target.discovery_generation();
        apply_all(&target, &base, &assignment(2, false)).await;
        assert!(
            target.discovery_generation() > generation,
            "no Discovery Log Change for the TLS requirement"
        );
        let pushed: Vec<_> = offered_paths(&target, KEYED)
            .into_iter()
            .filter(|p| p.0 == PUSHED)
            .collect();
        assert_eq!(
            pushed,
            vec![
                (PUSHED.into(), "127.0.0.1".into(), 4420, plain),
                (PUSHED.into(), "127.0.0.1".into(), 4430, required),
                (PUSHED.into(), "127.0.0.1".into(), 4431, plain),
                (PUSHED.into(), "127.0.0.2".into(), 4430, required),
                (PUSHED.into(), "127.0.0.2".into(), 4431, plain),
            ]
        );
    }

    /// The target of `TOML`, every group inaccessible as at a group gateway's start, and its
    /// subsystem.
    fn group_target() -> (Arc<Target>, Arc<Subsystem>) {
        let c = Config::from_toml_str(TOML).expect("config");
        let target = c.build_target().expect("target");
        start_inaccessible(&target);
        let s = target
            .subsystem("nqn.2016-06.io.test:group")
            .expect("subsystem");
        (target, s)
    }

    /// How many slow refreshes run at once, and the most that ever did.
    static SLOW_REFRESHES: AtomicU64 = AtomicU64::new(0);
    static MOST_SLOW_REFRESHES: AtomicU64 = AtomicU64::new(0);

    /// A refresh whose monitors answer after 400 ms.
    fn slow_refresh() -> Result<usize, rbd_backend::rados::RadosError> {
        let now = SLOW_REFRESHES.fetch_add(1, Ordering::SeqCst) + 1;
        MOST_SLOW_REFRESHES.fetch_max(now, Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(400));
        SLOW_REFRESHES.fetch_sub(1, Ordering::SeqCst);
        Ok(1)
    }

    fn quick_refresh() -> Result<usize, rbd_backend::rados::RadosError> {
        Ok(2)
    }

    #[tokio::test]
    async fn an_osdmap_refresh_is_bounded_and_never_blocks_two_threads() {
        let clients = GroupClientsState::default();
        let bound = Duration::from_millis(100);
        let started = Instant::now();
        // The monitors do not answer in time: refused after the bound, not after the answer.
        let first = clients.refresh_osdmap(bound, slow_refresh).await;
        assert!(first.is_err_and(|e| e.contains("did not answer within 100 ms")));
        assert!(started.elapsed() < Duration::from_millis(350));
        // Retried while the first still blocks: no second blocking call.
        let second = clients.refresh_osdmap(bound, slow_refresh).await;
        assert!(second.is_err_and(|e| e.contains("an earlier osdmap refresh")));
        assert_eq!(MOST_SLOW_REFRESHES.load(Ordering::SeqCst), 1);
        // Once the stuck one is done, a fresh refresh runs (the stuck one does not count).
        tokio::time::sleep(Duration::from_millis(250)).await;
        assert_eq!(clients.refresh_osdmap(bound, quick_refresh).await, Ok(2));
        assert_eq!(MOST_SLOW_REFRESHES.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn a_demoted_gateway_reports_its_groups_inaccessible_until_restored() {
        let (target, s) = group_target();
        let clients = GroupClientsState::default();
        let held = assignment(3, &[(1, ana::OPTIMIZED), (2, ana::CHANGE)]);
        assert!(apply_with_clients(&target, &held, &clients).await);
        let before = s.ana_change_count();
        // Nothing in flight (the memory device completes at once): no controller to close.
        assert_eq!(demote(&target, &clients), (vec![1, 2], 0));
        assert_eq!(s.ana_state(1), ana::INACCESSIBLE);
        assert_eq!(s.ana_state(2), ana::INACCESSIBLE);
        assert!(
            s.ana_change_count() > before,
            "hosts are told (ANA change event)"
        );
        assert!(clients.needs_fresh_clients(1) && clients.needs_fresh_clients(2));
        // While demoted, an assignment does not turn a group optimized (not acknowledged).
        clients.demoted.store(true, Ordering::SeqCst);
        assert!(!apply_with_clients(&target, &held, &clients).await);
        assert_eq!(s.ana_state(1), ana::INACCESSIBLE);
        // Restored: the current assignment applies as usual.
        clients.demoted.store(false, Ordering::SeqCst);
        assert!(apply_with_clients(&target, &held, &clients).await);
        assert_eq!(s.ana_state(1), ana::OPTIMIZED);
        // A gateway holding nothing demotes to nothing.
        let none = assignment(4, &[(1, ana::INACCESSIBLE), (2, ana::INACCESSIBLE)]);
        assert!(apply_with_clients(&target, &none, &clients).await);
        assert_eq!(demote(&target, &clients).0, Vec::<u32>::new());
    }

    #[tokio::test]
    async fn pushed_states_are_applied_and_counted() {
        let (target, s) = group_target();
        assert_eq!(s.ana_state(1), ana::INACCESSIBLE);
        assert_eq!(s.ana_state(2), ana::INACCESSIBLE);
        let before = s.ana_change_count();
        apply(
            &target,
            &assignment(3, &[(1, ana::OPTIMIZED), (2, ana::INACCESSIBLE)]),
        )
        .await;
        assert_eq!(s.ana_state(1), ana::OPTIMIZED);
        assert_eq!(s.ana_state(2), ana::INACCESSIBLE);
        assert_eq!(s.ana_change_count(), before + 1);
        // Takeover of group 2, then failback drain (change), then back.
        apply(
            &target,
            &assignment(4, &[(1, ana::OPTIMIZED), (2, ana::OPTIMIZED)]),
        )
        .await;
        assert_eq!(s.ana_state(2), ana::OPTIMIZED);
        apply(
            &target,
            &assignment(5, &[(1, ana::OPTIMIZED), (2, ana::CHANGE)]),
        )
        .await;
        assert_eq!(s.ana_state(2), ana::CHANGE);
        apply(
            &target,
            &assignment(6, &[(1, ana::OPTIMIZED), (2, ana::INACCESSIBLE)]),
        )
        .await;
        assert_eq!(s.ana_state(2), ana::INACCESSIBLE);
        assert_eq!(s.ana_change_count(), before + 4);
        // The same assignment again changes nothing.
        apply(
            &target,
            &assignment(6, &[(1, ana::OPTIMIZED), (2, ana::INACCESSIBLE)]),
        )
        .await;
        assert_eq!(s.ana_change_count(), before + 4);
    }

    /// A pushed frozen size (auto-resize off) applies live to the namespace served here, with
    /// a notice only when the size hosts see changes; cleared, the namespace follows its
    /// device again. A namespace of the gateway's own file keeps following its device.
    #[test]
    fn a_pushed_frozen_size_applies_live() {
        let base = Config::from_toml_str(TOML).expect("config");
        let served = format!(
            "{TOML}\n[[subsystem]]\nnqn = \"{PUSHED}\"\nallow_any_host = true\n\
             [[subsystem.namespace]]\nnsid = 1\nbackend = \"memory\"\nsize = \"1MiB\"\n"
        );
        let target = Config::from_toml_str(&served)
            .expect("config")
            .build_target()
            .expect("target");
        let ns = target
            .subsystem(PUSHED)
            .and_then(|s| s.namespace(1))
            .expect("pushed namespace");
        let mut a = pushed_assignment(3, &[1], &[]);
        // Frozen at the device's size: what hosts see does not change (no notice).
        a.namespaces[0].frozen_size = 1 << 20;
        assert_eq!(apply_frozen_sizes(&target, &base, &a), 0);
        assert_eq!(ns.frozen_size.get(), Some(1 << 20));
        // Below the device's (it grew while frozen, the admin resized below it): told.
        a.namespaces[0].frozen_size = 512 << 10;
        assert_eq!(apply_frozen_sizes(&target, &base, &a), 1);
        assert_eq!(ns.size_in_lbas(), (512 << 10) / 512);
        assert_eq!(apply_frozen_sizes(&target, &base, &a), 0, "same again");
        // Auto-resize on: the device's size, told.
        a.namespaces[0].frozen_size = 0;
        assert_eq!(apply_frozen_sizes(&target, &base, &a), 1);
        assert_eq!(ns.frozen_size.get(), None);
        assert_eq!(ns.size_in_lbas(), (1 << 20) / 512);
        // The file's namespace: not the control plane's to freeze.
        let file_ns = target
            .subsystem("nqn.2016-06.io.test:group")
            .and_then(|s| s.namespace(1))
            .expect("file namespace");
        a.namespaces[0].subsystem_nqn = "nqn.2016-06.io.test:group".into();
        a.namespaces[0].frozen_size = 512 << 10;
        assert_eq!(apply_frozen_sizes(&target, &base, &a), 0);
        assert_eq!(file_ns.frozen_size.get(), None);
    }
}
