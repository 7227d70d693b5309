//! The gRPC services of `nvmeof-control`: [`proto::admin_server::Admin`] for `nvmeofctl` and
//! [`proto::gateway_control_server::GatewayControl`] for gateways, over one [`ControlPlane`].
//!
//! Every replica serves both. The state lives in the RADOS object (see [`crate::state`]);
//! each replica caches it and re-reads it on every watch notify. One replica leads (RADOS lock
//! with a lease, renewed every third of it): it alone feeds beacons into the group model
//! ([`crate::ana`]), runs its timer, fences dead gateways and persists the group map. Every
//! replica pushes each joined gateway its assignment whenever the cached state changes.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

use crate::ana::{self, Action, Event, GroupMap, Timing};
use crate::proto;
use crate::qos::QosLimits;
use crate::state::{self, ConfigError, GroupState, ListenerEntry, NamespaceEntry};
use crate::store::{Delta, ImageError, Store, StoreError};

/// Timers of a control-plane replica.
#[derive(Debug, Clone, Copy)]
pub struct Options {
    pub timing: Timing,
    /// Leader lease; renewed every third.
    pub lease: Duration,
    /// How often the leader checks beacons.
    pub tick: Duration,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            timing: Timing::default(),
            lease: Duration::from_secs(6),
            tick: Duration::from_millis(200),
        }
    }
}

/// Namespaces in one `NamespaceAddMany` (a subsystem's NSIDs, [`state::DEFAULT_MAX_NAMESPACES`]).
const MAX_BATCH: usize = state::DEFAULT_MAX_NAMESPACES as usize;

/// How long a namespace move waits for the old group's gateway to drain it.
const MOVE_DRAIN_TIMEOUT: Duration = Duration::from_secs(10);
/// How long `namespace del --delete-image` waits for the gateways to close the image before
/// it reports the image still open.
const IMAGE_CLOSE_WAIT: Duration = Duration::from_secs(15);

/// How long a check of the connected hosts waits for the gateways still reporting one to
/// beacon twice ([`ControlPlane::connected_hosts_settled`]): two beacon intervals at their
/// longest (`beacon_interval_ms` is at most 1000), plus the time a leader may take to answer
/// a beacon.
const CONNECTIONS_SETTLE_WAIT: Duration = Duration::from_secs(3);

/// One replica.
pub struct ControlPlane {
    store: Store,
    /// This replica's name (its gRPC address), the lease cookie.
    id: String,
    opts: Options,
    started: Instant,
    cached: RwLock<Arc<GroupState>>,
    /// Bumped whenever `cached` changes: joined gateways re-send their assignment.
    changed: watch::Sender<u64>,
    leader: AtomicBool,
    /// When the lease this replica holds lapses at the latest (measured from before the
    /// request that took or renewed it): past it, it stops acting even if the renewal is
    /// still in flight, so two replicas never decide at once.
    lease_until: Mutex<Option<Instant>>,
    /// The leader's live map (with beacon times); None when not leading.
    live: Mutex<Option<GroupMap>>,
    /// The leader's last persisted map, to write only changes.
    persisted: Mutex<Vec<u8>>,
    /// The map's writes for beacons, in the background (see [`ControlPlane::beacon_with_groups`]).
    background_persist: Mutex<BackgroundPersist>,
    /// The last background write request whose write has ended.
    background_written: tokio::sync::watch::Sender<u64>,
    /// Host connections per gateway, from the last beacon this replica received.
    connections: Mutex<std::collections::BTreeMap<String, Vec<proto::Connection>>>,
    /// Beacons this replica received, per gateway, and in all (to wait on): how a check of
    /// the connections knows a gateway has spoken since it began.
    beacons_seen: Mutex<std::collections::BTreeMap<String, u64>>,
    beacon_arrived: tokio::sync::watch::Sender<u64>,
    /// The state version each gateway last reported applied (group beacons), per replica:
    /// what a namespace move waits for.
    applied_state: Mutex<std::collections::BTreeMap<String, u64>>,
    /// Namespace moves this replica is ending (an admin request waiting for the drain, or
    /// the leader ending a move whose request died with its replica).
    ending_moves: Mutex<std::collections::BTreeSet<(String, u32)>>,
    /// Set when this replica's server stops: the gateways' streams it ends then say nothing
    /// about the gateways.
    stopping: AtomicBool,
    /// The gateways' reports of OSDs that do not answer them, as the leader checked them.
    osd_reports: Mutex<crate::osd_reports::OsdReports>,
    /// The gateways' I/O counters from their group beacons (every replica keeps them, as it
    /// keeps connections), and the state version they were last pruned at.
    io_stats: Mutex<(crate::io_stats::IoStatsBook, u64)>,
}

/// How long the leader waits for the OSDs a gateway reports not answering it.
const OSD_CHECK_WAIT: Duration = Duration::from_secs(1);

fn status(e: StoreError) -> Status {
    match e {
        StoreError::Config(c) => config_status(c),
        StoreError::Contended(_) => Status::aborted(e.to_string()),
        StoreError::Image(i) => image_status(i),
        other => Status::unavailable(other.to_string()),
    }
}

fn config_status(e: ConfigError) -> Status {
    let msg = e.to_string();
    match e {
        ConfigError::NoSubsystem(_)
        | ConfigError::NoNamespace { .. }
        | ConfigError::NoListener(_)
        | ConfigError::NoHost { .. }
        | ConfigError::NoNamespaceHost { .. }
        | ConfigError::NoAnaGroup(_) => Status::not_found(msg),
        ConfigError::SubsystemExists(_)
        | ConfigError::NamespaceExists { .. }
        | ConfigError::ListenerExists(_)
        | ConfigError::HostExists { .. }
        | ConfigError::NamespaceHostExists { .. }
        | ConfigError::ImageInUse(..)
        | ConfigError::IdentityInUse { .. } => Status::already_exists(msg),
        ConfigError::SubsystemNotEmpty { .. }
        | ConfigError::NamespaceHasHosts { .. }
        | ConfigError::NoFreeNsid { .. }
        | ConfigError::NamespaceAutoVisible { .. } => Status::failed_precondition(msg),
        ConfigError::TooManyNamespaceHosts { .. } => Status::resource_exhausted(msg),
        ConfigError::Corrupt { .. } => Status::internal(msg),
        _ => Status::invalid_argument(msg),
    }
}

fn image_status(e: ImageError) -> Status {
    let msg = e.to_string();
    match e {
        ImageError::NoPool(_) | ImageError::NotFound(_) => Status::not_found(msg),
        ImageError::Exists(_) => Status::already_exists(msg),
        ImageError::NoSpace(..) => Status::resource_exhausted(msg),
        ImageError::Busy(_) => Status::failed_precondition(msg),
        ImageError::Other(..) => Status::unavailable(msg),
    }
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, StoreError> + Send + 'static,
) -> Result<T, Status> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Status::internal(format!("task failed: {e}")))?
        .map_err(status)
}

impl ControlPlane {
    /// Loads the state and starts watching it. Call [`ControlPlane::run`] to take part in the
    /// leader election.
    pub async fn start(store: Store, id: String, opts: Options) -> Result<Arc<Self>, StoreError> {
        let s = store.clone();
        let state = tokio::task::spawn_blocking(move || s.load())
            .await
            .map_err(|e| StoreError::Other(e.to_string()))??;
        let (changed, _) = watch::channel(0);
        let cp = Arc::new(ControlPlane {
            store,
            id,
            opts,
            started: Instant::now(),
            cached: RwLock::new(Arc::new(state)),
            changed,
            leader: AtomicBool::new(false),
            lease_until: Mutex::new(None),
            live: Mutex::new(None),
            persisted: Mutex::new(Vec::new()),
            background_persist: Mutex::new(BackgroundPersist::default()),
            background_written: tokio::sync::watch::Sender::new(0),
            connections: Mutex::new(std::collections::BTreeMap::new()),
            beacons_seen: Mutex::new(std::collections::BTreeMap::new()),
            beacon_arrived: tokio::sync::watch::Sender::new(0),
            applied_state: Mutex::new(std::collections::BTreeMap::new()),
            osd_reports: Mutex::new(crate::osd_reports::OsdReports::with_witness_ids_from(
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(1, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX / 2)),
            )),
            ending_moves: Mutex::new(std::collections::BTreeSet::new()),
            stopping: AtomicBool::new(false),
            io_stats: Mutex::new(Default::default()),
        });
        if let Err(e) = crate::log_level::follow(cp.snapshot().settings.log_level.as_deref()) {
            tracing::warn!("group log level: {e}");
        }
        // Follow every notify off the librados thread: apply the write it carries, or re-read.
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Option<Vec<u8>>>();
        let weak = Arc::downgrade(&cp);
        tokio::spawn(async move {
            while let Some(first) = rx.recv().await {
                let Some(cp) = weak.upgrade() else { return };
                let mut reread = !cp.follow(first);
                while let Ok(next) = rx.try_recv() {
                    reread |= !cp.follow(next);
                }
                if reread {
                    cp.refresh().await;
                }
            }
        });
        let backend = cp.store.backend().clone();
        let guard = tokio::task::spawn_blocking(move || {
            backend.watch(Box::new(move |payload| {
                let _ = tx.send(payload);
            }))
        })
        .await
        .map_err(|e| StoreError::Other(e.to_string()))??;
        // The watch lives as long as the process (replicas are never torn down in-process
        // except by tests, where a leaked watch is harmless).
        std::mem::forget(guard);
        Ok(cp)
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    pub fn is_leader(&self) -> bool {
        self.leader.load(Ordering::SeqCst)
            && self
                .lease_until
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .is_some_and(|t| Instant::now() < t)
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    /// A copy of the cached state.
    pub fn state(&self) -> GroupState {
        GroupState::clone(&self.snapshot())
    }

    /// The cached state, shared (no copy).
    pub fn snapshot(&self) -> Arc<GroupState> {
        self.cached
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn set_cached(&self, st: Arc<GroupState>) {
        let mut c = self.cached.write().unwrap_or_else(|e| e.into_inner());
        if st.version > c.version || (st.version == c.version && st != *c) {
            let level = st.settings.log_level.clone();
            *c = st;
            drop(c);
            // The group's log level applies to the replicas too (not only to the gateways).
            if let Err(e) = crate::log_level::follow(level.as_deref()) {
                tracing::warn!("group log level: {e}");
            }
            self.changed.send_modify(|v| *v += 1);
        }
    }

    /// Follows one watch event. A notify carrying a write made from the cached version is
    /// applied; one this replica has already seen (its own writes) is skipped. False: the
    /// state must be re-read (the watch broke, a version was missed, or the writer did not
    /// say what it wrote).
    fn follow(&self, event: Option<Vec<u8>>) -> bool {
        let Some(delta) = event.as_deref().and_then(Delta::parse) else {
            return false;
        };
        let cached = self.snapshot();
        if delta.to <= cached.version {
            return true;
        }
        match delta.applied_to(&cached) {
            Some(Ok(next)) => {
                self.set_cached(Arc::new(next));
                true
            }
            Some(Err(e)) => {
                tracing::warn!("applying a notified state change: {e}; re-reading");
                false
            }
            None => false,
        }
    }

    /// Re-reads the state (after a notify).
    pub async fn refresh(&self) {
        let s = self.store.clone();
        match tokio::task::spawn_blocking(move || s.load()).await {
            Ok(Ok(st)) => self.set_cached(Arc::new(st)),
            Ok(Err(e)) => tracing::warn!("re-reading the group state: {e}"),
            Err(e) => tracing::warn!("re-reading the group state: {e}"),
        }
    }

    /// Applies `change` from the cached state (see [`Store::update_from`]); the cache then
    /// holds the state written.
    async fn update<T: Send + 'static>(
        self: &Arc<Self>,
        change: impl FnMut(&mut GroupState) -> Result<T, ConfigError> + Send + 'static,
    ) -> Result<(T, Arc<GroupState>), Status> {
        self.try_update(change).await.map_err(status)
    }

    /// [`ControlPlane::update`] with the refusal as it is (the ceph-nvmeof API answers each
    /// [`ConfigError`] with its own errno, which a gRPC status would blur).
    pub(crate) async fn try_update<T: Send + 'static>(
        self: &Arc<Self>,
        change: impl FnMut(&mut GroupState) -> Result<T, ConfigError> + Send + 'static,
    ) -> Result<(T, Arc<GroupState>), StoreError> {
        let s = self.store.clone();
        let me = self.clone();
        let (out, st) =
            tokio::task::spawn_blocking(move || s.update_from(|| Some(me.snapshot()), change))
                .await
                .map_err(|e| StoreError::Other(format!("task failed: {e}")))??;
        let st = Arc::new(st);
        self.set_cached(st.clone());
        Ok((out, st))
    }

    /// The state object's backend (RBD image checks and resizes go through it).
    pub(crate) fn backend(&self) -> &Arc<dyn crate::store::Backend> {
        self.store.backend()
    }

    /// Adds `entry` to the group state; when its image was just made for it (`created`) and
    /// the add is refused (the state changed since it was checked), the image is removed
    /// again, so nothing is left behind. For the Admin API and the ceph-nvmeof API alike.
    pub(crate) async fn add_namespace_with_image(
        self: &Arc<Self>,
        entry: NamespaceEntry,
        created: bool,
    ) -> Result<(NamespaceEntry, Arc<GroupState>), StoreError> {
        let e = entry.clone();
        let added = self.try_update(move |st| st.add_namespace(e.clone())).await;
        if added.is_err() && created {
            let backend = self.backend().clone();
            let e = entry.clone();
            let removed = tokio::task::spawn_blocking(move || {
                backend.remove_image(&e.pool, &e.rados_namespace, &e.image)
            })
            .await;
            if !matches!(removed, Ok(Ok(()))) {
                tracing::error!(image = %state::image_spec(&entry), "image created for a refused namespace not removed: {removed:?}");
            }
        }
        added
    }

    /// Adds subsystem `nqn`, requiring TLS or not, in one state change: the Admin API's
    /// SubsystemAdd and the ceph-nvmeof API's create_subsystem.
    pub(crate) async fn add_subsystem(
        self: &Arc<Self>,
        nqn: &str,
        serial: &str,
        allow_any_host: bool,
        max_namespaces: u32,
        require_tls: bool,
    ) -> Result<Arc<GroupState>, StoreError> {
        let (nqn, serial) = (nqn.to_string(), serial.to_string());
        let (_, st) = self
            .try_update(move |st| {
                st.add_subsystem(&nqn, &serial, allow_any_host, max_namespaces)?;
                st.set_require_tls(&nqn, require_tls)
            })
            .await?;
        Ok(st)
    }

    /// Sets whether subsystem `nqn` requires TLS: the Admin API's SubsystemSet. Returns
    /// whether it changed. The gateways follow with their next assignment (connected
    /// controllers without TLS are closed when it turns on: `Subsystem::set_tls_required`).
    pub(crate) async fn set_require_tls(
        self: &Arc<Self>,
        nqn: &str,
        required: bool,
    ) -> Result<(bool, Arc<GroupState>), StoreError> {
        let nqn = nqn.to_string();
        self.try_update(move |st| {
            let was = st.subsystems.get(&nqn).map(|s| s.require_tls);
            st.set_require_tls(&nqn, required)?;
            Ok(was != Some(required))
        })
        .await
    }

    /// Adds a listener (secure or not): the Admin API's ListenerAdd and the ceph-nvmeof
    /// API's create_listener.
    pub(crate) async fn add_listener(
        self: &Arc<Self>,
        l: ListenerEntry,
    ) -> Result<Arc<GroupState>, StoreError> {
        let (_, st) = self
            .try_update(move |st| st.add_listener(l.clone()))
            .await?;
        Ok(st)
    }

    /// Allows a host with its keys as an admin gives them (empty: none), each checked with
    /// the gateway's parser: the Admin API's HostAdd and the ceph-nvmeof API's add_host.
    /// Returns the keys as stored.
    pub(crate) async fn add_host(
        self: &Arc<Self>,
        nqn: &str,
        host: &str,
        keys: state::HostKeyText,
    ) -> Result<(state::HostAuth, Arc<GroupState>), StoreError> {
        let (nqn, host) = (nqn.to_string(), host.to_string());
        self.try_update(move |st| st.add_host_with_key_text(&nqn, &host, &keys))
            .await
    }

    /// Moves a namespace to ANA group `group` and waits for the gateway serving the group it
    /// leaves to drain it: the Admin API's NamespaceMove and the ceph-nvmeof API's
    /// namespace_change_load_balancing_group. Returns the state and a note on the drain.
    pub(crate) async fn move_namespace(
        self: &Arc<Self>,
        nqn: &str,
        nsid: u32,
        group: u32,
    ) -> Result<(Arc<GroupState>, String), StoreError> {
        let key = (nqn.to_string(), nsid);
        // Claimed before the move is marked, so the leader never takes it for one whose
        // request died.
        let _claim = EndingClaim::new(self, &key);
        let n = nqn.to_string();
        let (_, st) = self
            .try_update(move |st| st.move_namespace(&n, nsid, group))
            .await?;
        // Drain: the gateway serving the old group moves the namespace at once and
        // acknowledges once its commands in flight are done; everyone else keeps it in the
        // old group (not served) until then. Only then does the new group's gateway serve it.
        let moving_from = st.namespaces.get(&key).map(|n| n.moving_from).unwrap_or(0);
        if moving_from == 0 {
            return Ok((st, String::new()));
        }
        let drained = self.wait_for_drain(moving_from, st.version).await;
        let k = key.clone();
        let (_, st) = self
            .try_update(move |st| st.finish_move_from(&k.0, k.1, moving_from))
            .await?;
        Ok((st, drained))
    }

    /// Sets the group's log level (None: each process its own), live on every replica and
    /// gateway: the Admin API's LogLevelSet and the ceph-nvmeof API's set_gateway_log_level.
    pub(crate) async fn set_log_level(
        self: &Arc<Self>,
        level: Option<String>,
    ) -> Result<(bool, Arc<GroupState>), StoreError> {
        self.try_update(move |st| st.set_log_level(level.as_deref()))
            .await
    }

    /// Changes a namespace's visibility (`force`: dropping its host list) and its
    /// trash-on-delete flag in one state change: the Admin API's NamespaceSet (the
    /// ceph-nvmeof API's namespace_change_visibility and namespace_set_rbd_trash_image set
    /// one each). Returns what changed, for the reply.
    pub(crate) async fn set_namespace(
        self: &Arc<Self>,
        nqn: &str,
        nsid: u32,
        auto_visible: Option<bool>,
        trash_image: Option<bool>,
        auto_resize: Option<bool>,
        force: bool,
    ) -> Result<(Vec<String>, Arc<GroupState>), StoreError> {
        let n = nqn.to_string();
        // Turning auto-resize off freezes the size hosts see now: the image's. Read before
        // the state change (a cluster round trip); an already frozen namespace keeps its
        // size ([`GroupState::set_auto_resize`]), so it is not read again.
        let frozen = match auto_resize {
            Some(false) => {
                let st = self.snapshot();
                let ns = st.namespaces.get(&(n.clone(), nsid)).ok_or_else(|| {
                    ConfigError::NoNamespace {
                        nqn: n.clone(),
                        nsid,
                    }
                })?;
                Some(match ns.frozen_size {
                    Some(kept) => kept,
                    None => self.image_size_of(ns).await?,
                })
            }
            _ => None,
        };
        let (notes, st) = self
            .try_update(move |st| {
                let mut notes = Vec::new();
                if let Some(on) = auto_resize {
                    let changed = st.set_auto_resize(&n, nsid, if on { None } else { frozen })?;
                    let kept = st
                        .namespaces
                        .get(&(n.clone(), nsid))
                        .and_then(|e| e.frozen_size);
                    notes.push(format!(
                        "{}{}",
                        match kept {
                            Some(size) => format!("auto-resize off, size kept at {size} bytes"),
                            None => "auto-resize on: follows its image".into(),
                        },
                        if changed { "" } else { " (unchanged)" }
                    ));
                }
                if let Some(auto) = auto_visible {
                    let changed = st.set_namespace_visibility(&n, nsid, auto, force)?;
                    notes.push(format!(
                        "visible to {}{}",
                        if auto {
                            "every allowed host"
                        } else {
                            "the hosts on its list"
                        },
                        if changed { "" } else { " (unchanged)" }
                    ));
                }
                if let Some(trash) = trash_image {
                    let changed = st.set_trash_image(&n, nsid, trash)?;
                    notes.push(format!(
                        "image {} the RBD trash when deleted{}",
                        if trash { "goes to" } else { "does not go to" },
                        if changed { "" } else { " (unchanged)" }
                    ));
                }
                Ok(notes)
            })
            .await?;
        tracing::info!(
            nqn,
            nsid,
            ?auto_visible,
            ?trash_image,
            ?auto_resize,
            "namespace settings changed"
        );
        Ok((notes, st))
    }

    /// A namespace's image size in bytes as RBD has it now (off the runtime).
    pub async fn image_size_of(&self, ns: &NamespaceEntry) -> Result<u64, StoreError> {
        let backend = self.backend().clone();
        let n = ns.clone();
        tokio::task::spawn_blocking(move || {
            backend.image_size(&n.pool, &n.rados_namespace, &n.image)
        })
        .await
        .map_err(|e| StoreError::Other(format!("task failed: {e}")))?
    }

    /// An explicit resize (`namespace resize`, ceph-nvmeof's `namespace_resize`) of a
    /// namespace whose auto-resize is off: its image grows to at least `size` (left alone
    /// when already larger: `rbd resize` may have grown it while frozen), then the frozen
    /// size becomes `size`, which every gateway reports. A shrink of the frozen size is
    /// refused before the image is touched. Returns the size frozen before (equal to
    /// `size`: no change).
    pub(crate) async fn resize_frozen_namespace(
        self: &Arc<Self>,
        ns: &NamespaceEntry,
        size: u64,
    ) -> Result<(u64, Arc<GroupState>), StoreError> {
        let (nqn, nsid) = (ns.subsystem_nqn.clone(), ns.nsid);
        // Checked on the cached state first (no image change for a refused resize); the
        // state change checks again.
        ns.check_frozen_resize(size)?;
        let image = self.image_size_of(ns).await?;
        if size > image {
            let backend = self.backend().clone();
            let n = ns.clone();
            tokio::task::spawn_blocking(move || {
                backend.grow_image(&n.pool, &n.rados_namespace, &n.image, size)
            })
            .await
            .map_err(|e| StoreError::Other(format!("task failed: {e}")))??;
        }
        let (old, st) = self
            .try_update(move |st| st.resize_frozen(&nqn, nsid, size))
            .await?;
        tracing::info!(nqn = %ns.subsystem_nqn, nsid, image = %state::image_spec(ns), old, new = size, image_size = image.max(size), "frozen namespace resized");
        Ok((old, st))
    }

    /// Sets (or, empty, removes) a subsystem's DH-HMAC-CHAP key: the Admin API's
    /// SubsystemChangeKey and the ceph-nvmeof API's change_subsystem_key. Returns whether it
    /// changed.
    pub(crate) async fn set_subsystem_key(
        self: &Arc<Self>,
        nqn: &str,
        key: String,
    ) -> Result<(bool, Arc<GroupState>), StoreError> {
        let n = nqn.to_string();
        let set = !key.is_empty();
        let out = self
            .try_update(move |st| st.set_subsystem_key(&n, &key))
            .await?;
        tracing::info!(
            nqn,
            set,
            changed = out.0,
            "subsystem DH-HMAC-CHAP key changed"
        );
        Ok(out)
    }

    /// The host connections to `nqn` the gateways reported in their last beacons.
    pub(crate) fn connections_of(&self, nqn: &str) -> Vec<proto::Connection> {
        self.connections
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .flatten()
            .filter(|c| c.subsystem_nqn == nqn)
            .cloned()
            .collect()
    }

    /// Leader election and the leader's timer; runs until the process ends.
    pub async fn run(self: Arc<Self>) {
        let mut renew = tokio::time::interval(self.opts.lease / 3);
        let mut tick = tokio::time::interval(self.opts.tick);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = renew.tick() => self.renew_lease().await,
                _ = tick.tick() => {
                    if self.is_leader() {
                        let now = self.now_ms();
                        if let Err(e) = self.feed(Event::Tick { now_ms: now }).await {
                            tracing::debug!("tick: {}", e.message());
                        }
                        self.adopt_moves();
                    }
                }
            }
        }
    }

    async fn renew_lease(self: &Arc<Self>) {
        let backend = self.store.backend().clone();
        let (id, lease) = (self.id.clone(), self.opts.lease);
        let asked = Instant::now();
        let held = match tokio::task::spawn_blocking(move || backend.lead(&id, lease)).await {
            Ok(Ok(h)) => h,
            Ok(Err(e)) => {
                tracing::warn!("leader lease: {e}");
                false
            }
            Err(_) => false,
        };
        *self.lease_until.lock().unwrap_or_else(|e| e.into_inner()) = held.then_some(asked + lease);
        let was = self.leader.swap(held, Ordering::SeqCst);
        if held && !was {
            // Take over from the stored map: every gateway's grace starts now.
            self.refresh().await;
            let st = self.snapshot();
            let mut map = st
                .map
                .clone()
                .unwrap_or_else(|| GroupMap::new(self.opts.timing));
            tracing::info!(replica = %self.id, epoch = map.epoch, "leading the gateway group");
            *self.persisted.lock().unwrap_or_else(|e| e.into_inner()) =
                serde_json::to_vec(&map).unwrap_or_default();
            // Differs from what is persisted, so the next tick writes the map with this
            // replica's name: the other replicas then report it as the leader.
            map.leader = self.id.clone();
            let pending = map.pending_fences();
            *self.live.lock().unwrap_or_else(|e| e.into_inner()) = Some(map);
            // Fences the previous leader asked and may not have finished (it died while
            // fencing, e.g. every process killed at once): asked again, or those groups
            // would wait for a result that never comes.
            for fence in pending {
                tracing::warn!(replica = %self.id, fence, "a fence the previous leader asked is asked again");
                if let Err(e) = self.feed(Event::FenceFailed { fence }).await {
                    tracing::error!(fence, "cannot ask the fence again: {}", e.message());
                }
            }
        } else if !held && was {
            tracing::warn!(replica = %self.id, "lost the leader lease");
            *self.live.lock().unwrap_or_else(|e| e.into_inner()) = None;
        }
    }

    /// Feeds one event to the leader's map, carries out its actions and persists changes.
    async fn feed(self: &Arc<Self>, event: Event) -> Result<Vec<Action>, Status> {
        let (actions, dirty) = self.feed_without_persisting(event).map_err(|e| *e)?;
        if dirty {
            self.persist_live_map().await;
        }
        Ok(actions)
    }

    /// [`ControlPlane::feed`] whose caller waits for the map's write at most `wait`; the
    /// write goes on in the background past that. Writes asked for while one runs are made
    /// as one more write of the map as it is then.
    async fn feed_waiting_at_most(
        self: &Arc<Self>,
        event: Event,
        wait: Duration,
    ) -> Result<Vec<Action>, Status> {
        let (actions, dirty) = self.feed_without_persisting(event).map_err(|e| *e)?;
        if dirty {
            let asked = self.persist_in_background();
            let mut written = self.background_written.subscribe();
            let done = tokio::time::timeout(wait, written.wait_for(|w| *w >= asked)).await;
            if done.is_err() {
                tracing::warn!(
                    wait_ms = wait.as_millis() as u64,
                    "the group map's write is slow (the cluster may be stalled): answered \
                     before it, the write goes on"
                );
            }
        }
        Ok(actions)
    }

    /// Asks the background writer to write the live map: the number of this request, which
    /// `background_written` reaches once a write that started after it has ended.
    fn persist_in_background(self: &Arc<Self>) -> u64 {
        let asked = {
            let mut p = self
                .background_persist
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            p.requested += 1;
            if p.running {
                return p.requested;
            }
            p.running = true;
            p.requested
        };
        let me = self.clone();
        tokio::spawn(async move {
            let mut writing = asked;
            loop {
                me.persist_live_map().await;
                me.background_written.send_replace(writing);
                let mut p = me
                    .background_persist
                    .lock()
                    .unwrap_or_else(|e| e.into_inner());
                if p.requested == writing {
                    p.running = false;
                    return;
                }
                writing = p.requested;
            }
        });
        asked
    }

    /// Runs `event` through the live map and starts the fences it asks for: its actions, and
    /// whether the map now differs from the one last persisted.
    fn feed_without_persisting(
        self: &Arc<Self>,
        event: Event,
    ) -> Result<(Vec<Action>, bool), Box<Status>> {
        let not_leading = || {
            Box::new(Status::unavailable(format!(
                "replica {} does not lead the group",
                self.id
            )))
        };
        if !self.is_leader() {
            return Err(not_leading());
        }
        let (actions, bytes) = {
            let mut live = self.live.lock().unwrap_or_else(|e| e.into_inner());
            let Some(map) = live.as_mut() else {
                return Err(not_leading());
            };
            let actions = map
                .handle(event)
                .map_err(|e| Box::new(Status::invalid_argument(e.to_string())))?;
            (actions, serde_json::to_vec(&*map).unwrap_or_default())
        };
        // Fencing first: it is what failover waits for; persisting the map can follow.
        for a in &actions {
            if let Action::Blocklist { gateway, addrs } = a.clone() {
                self.spawn_blocklist(gateway, addrs);
            }
            if let Action::Fence {
                fence,
                group,
                gateway,
                addrs,
                scope,
            } = a.clone()
            {
                self.spawn_fence(fence, group, gateway, addrs, scope);
            }
        }
        let dirty = {
            let mut p = self.persisted.lock().unwrap_or_else(|e| e.into_inner());
            if *p != bytes {
                *p = bytes;
                true
            } else {
                false
            }
        };
        Ok((actions, dirty))
    }

    /// Writes the live map to the group state.
    async fn persist_live_map(self: &Arc<Self>) {
        // Concurrent feeds persist concurrently and their compare-and-set retries may land
        // in any order: each writes the live map as it is when its write is (re)tried, so
        // a slower writer never puts back an older map (a regressed map would un-promote a
        // group that just failed over).
        let me = self.clone();
        let written = self
            .update(move |st| {
                // None: no longer leading, and the new leader writes its own map.
                let live = me.live.lock().unwrap_or_else(|e| e.into_inner()).clone();
                if let Some(live) = live {
                    st.map = Some(live);
                }
                Ok(())
            })
            .await;
        if let Err(e) = written {
            tracing::error!("persisting the group map: {e}");
            // Try again on the next change.
            self.persisted
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clear();
        }
    }

    /// The leader ends every namespace move that nobody on this replica is ending: the
    /// replica whose `namespace move` request marked it may have died while it waited for the
    /// drain. Same steps as the request: wait for the old group's gateway to acknowledge a
    /// state with the move in it (at most [`MOVE_DRAIN_TIMEOUT`]), then end the move, if it
    /// still leaves the same group. Ending a move twice (that replica is alive after all and
    /// ends it too) changes nothing.
    fn adopt_moves(self: &Arc<Self>) {
        let st = self.snapshot();
        for n in st.namespaces.values().filter(|n| n.moving_from != 0) {
            let key = (n.subsystem_nqn.clone(), n.nsid);
            if !self.begin_ending(&key) {
                continue;
            }
            // Also the moves requested on another replica that is alive: it ends them too.
            tracing::info!(
                nqn = %key.0,
                nsid = key.1,
                from = n.moving_from,
                to = n.ana_group,
                "namespace move not ended by a request here (its replica may have died); ending it after the drain"
            );
            let (me, from, version) = (self.clone(), n.moving_from, st.version);
            tokio::spawn(async move {
                let drained = me.wait_for_drain(from, version).await;
                match me.end_move(&key, from).await {
                    Ok(_) => {
                        tracing::info!(nqn = %key.0, nsid = key.1, "namespace move ended{drained}")
                    }
                    Err(e) => {
                        tracing::warn!(nqn = %key.0, nsid = key.1, "ending a namespace move: {}", e.message())
                    }
                }
                me.done_ending(&key);
            });
        }
    }

    /// Claims ending the move of `key` on this replica; false: already being ended here.
    fn begin_ending(&self, key: &(String, u32)) -> bool {
        self.ending_moves
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key.clone())
    }

    fn done_ending(&self, key: &(String, u32)) {
        self.ending_moves
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(key);
    }

    /// Ends the move of `key` away from group `from` (nothing if it no longer leaves `from`).
    async fn end_move(
        self: &Arc<Self>,
        key: &(String, u32),
        from: u32,
    ) -> Result<Arc<GroupState>, Status> {
        let (nqn, nsid) = key.clone();
        let (_, st) = self
            .update(move |st| st.finish_move_from(&nqn, nsid, from))
            .await?;
        Ok(st)
    }

    /// `shutdown`, which marks this replica stopping when it resolves: the gateways' streams
    /// its server then ends are no sign of their death.
    pub(crate) fn stopping_on(
        self: &Arc<Self>,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> impl std::future::Future<Output = ()> + Send + 'static {
        let cp = Arc::downgrade(self);
        async move {
            shutdown.await;
            if let Some(cp) = cp.upgrade() {
                cp.stopping.store(true, Ordering::SeqCst);
            }
        }
    }

    /// A gateway's `Join` stream ended (see [`Event::StreamEnded`]): on the leader, the
    /// gateway is suspected dead and what it holds is fenced at once, without waiting out the
    /// beacon grace. Nothing on a replica that does not lead (the gateway holds a stream to
    /// every replica: the leader has its own) or whose server is stopping. A stream without
    /// an incarnation (an old gateway) says nothing about which process ended.
    async fn stream_ended(self: &Arc<Self>, gateway: String, incarnation: u64) {
        if incarnation == 0 || self.stopping.load(Ordering::SeqCst) || !self.is_leader() {
            return;
        }
        let now = self.now_ms();
        match self
            .feed(Event::StreamEnded {
                gateway: gateway.clone(),
                incarnation,
                now_ms: now,
            })
            .await
        {
            Ok(actions) if actions.iter().any(|a| matches!(a, Action::Fence { .. })) => {
                tracing::warn!(gateway = %gateway, incarnation, "gateway's control stream ended: fencing it now")
            }
            Ok(_) => {
                tracing::debug!(gateway = %gateway, incarnation, "gateway's control stream ended")
            }
            Err(e) => {
                tracing::debug!(gateway = %gateway, "stream end not applied: {}", e.message())
            }
        }
    }

    /// The leader's verdict on the OSDs `gateway` reports not answering it (None: it reports
    /// none, or this replica does not lead).
    pub fn osd_report(&self, gateway: &str) -> Option<crate::osd_reports::Verdict> {
        self.osd_reports
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .verdict(gateway)
    }

    /// How many witnesses' answers the leader took for `gateway`'s current OSD report (None:
    /// it reports none, or this replica never led).
    pub fn osd_report_witness_answers(&self, gateway: &str) -> Option<u32> {
        self.osd_reports
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .witness_answers(gateway)
    }

    /// Asks the OSDs `gateway` reports not answering it, in the background; the verdict
    /// applies from its next beacon (`crate::osd_reports`).
    fn spawn_osd_check(self: &Arc<Self>, gateway: String, osds: Vec<i32>) {
        let backend = self.store.backend().clone();
        let me = Arc::downgrade(self);
        tokio::spawn(async move {
            let ids = osds.clone();
            let answer =
                tokio::task::spawn_blocking(move || backend.probe_osds(&ids, OSD_CHECK_WAIT)).await;
            let unanswered = match answer {
                Ok(Ok(u)) => u,
                Ok(Err(e)) => {
                    tracing::warn!(gateway = %gateway, "cannot ask the OSDs it reports: {e}");
                    None
                }
                Err(e) => {
                    tracing::warn!("OSD check task failed: {e}");
                    None
                }
            };
            let Some(me) = me.upgrade() else { return };
            let verdict = me
                .osd_reports
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .probe_finished(&gateway, &osds, unanswered.as_deref());
            match verdict {
                Some(crate::osd_reports::Verdict::Confirmed) => tracing::warn!(
                    gateway = %gateway,
                    osds = ?osds,
                    leader_unanswered = ?unanswered,
                    "OSDs the gateway cannot reach answer the leader: it is cut off from them; \
                     taken as cut off from the cluster (failed over while another gateway \
                     reaches it)"
                ),
                Some(crate::osd_reports::Verdict::Shared) => tracing::warn!(
                    gateway = %gateway,
                    osds = ?osds,
                    "OSDs the gateway cannot reach do not answer the leader either (a hung \
                     OSD, or the leader cut off from them too): another gateway is asked to \
                     probe them"
                ),
                Some(crate::osd_reports::Verdict::Unchecked) | None => {}
            }
        });
    }

    /// Blocklists a restarted gateway's previous clients in the background (logged; nothing
    /// waits for it).
    fn spawn_blocklist(&self, gateway: String, addrs: Vec<String>) {
        let backend = self.store.backend().clone();
        tokio::spawn(async move {
            let a = addrs.clone();
            match tokio::task::spawn_blocking(move || backend.fence(&a)).await {
                Ok(Ok(())) => tracing::info!(
                    gateway = %gateway,
                    addrs = ?addrs,
                    "previous incarnation's clients blocklisted"
                ),
                Ok(Err(e)) => tracing::warn!(
                    gateway = %gateway,
                    "cannot blocklist the previous incarnation's clients: {e}"
                ),
                Err(e) => tracing::warn!("blocklist task failed: {e}"),
            }
        });
    }

    fn spawn_fence(
        self: &Arc<Self>,
        fence: u64,
        group: u32,
        gateway: String,
        addrs: Vec<String>,
        scope: ana::FenceScope,
    ) {
        let backend = self.store.backend().clone();
        let me = Arc::downgrade(self);
        tokio::spawn(async move {
            let started = Instant::now();
            tracing::warn!(fence, group, gateway = %gateway, ?scope, addrs = ?addrs, "fencing");
            let a = addrs.clone();
            let result = tokio::task::spawn_blocking(move || backend.fence(&a)).await;
            let event = match result {
                Ok(Ok(())) => {
                    tracing::warn!(
                        fence,
                        group,
                        gateway = %gateway,
                        ms = started.elapsed().as_millis() as u64,
                        "fenced (blocklist committed, osdmap refreshed)"
                    );
                    Event::Fenced { fence }
                }
                Ok(Err(e)) => {
                    tracing::error!(fence, gateway = %gateway, "fence failed: {e}; retrying");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    Event::FenceFailed { fence }
                }
                Err(e) => {
                    tracing::error!(fence, "fence task failed: {e}");
                    Event::FenceFailed { fence }
                }
            };
            if let Some(cp) = me.upgrade() {
                if let Err(e) = cp.feed(event).await {
                    tracing::warn!(fence, "fence result not applied: {}", e.message());
                }
            }
        });
    }
}

// ------------------------------------------------------------------ conversions

/// A subsystem as replies and assignments carry it: `hosts` lists the hosts without keys
/// (DH-HMAC-CHAP or TLS PSK: what a gateway that knows no keys may let in), `host_entries`
/// every host, with its keys only when `with_keys` (an assignment, for the gateways).
fn subsystem_proto(
    st: &GroupState,
    s: &state::SubsystemEntry,
    with_keys: bool,
) -> proto::Subsystem {
    let entries: Vec<proto::Host> = st
        .host_entries_of(&s.nqn)
        .map(|(host, auth)| host_proto(&s.nqn, host, &st.auth_in_force(&s.nqn, auth), with_keys))
        .collect();
    proto::Subsystem {
        nqn: s.nqn.clone(),
        serial: s.serial.clone(),
        allow_any_host: s.allow_any_host,
        hosts: entries
            .iter()
            // A host with a PSK is not one a gateway that knows no keys may let in.
            .filter(|h| h.auth == "none" && h.psk.is_none())
            .map(|h| h.host_nqn.clone())
            .collect(),
        max_namespaces: s.max_namespaces,
        host_entries: entries,
        require_tls: s.require_tls,
        has_dhchap_key: s.dhchap_key.is_some(),
    }
}

fn host_proto(nqn: &str, host: &str, auth: &state::HostAuth, with_keys: bool) -> proto::Host {
    let key = |k: &Option<String>| {
        if with_keys {
            k.clone().unwrap_or_default()
        } else {
            String::new()
        }
    };
    proto::Host {
        subsystem_nqn: nqn.to_string(),
        host_nqn: host.to_string(),
        dhchap_key: key(&auth.dhchap_key),
        dhchap_ctrl_key: key(&auth.dhchap_ctrl_key),
        auth: auth.mode().to_string(),
        // Replies say only that there is a PSK (a derivation, no key).
        psk: auth.psk.as_ref().map(|k| proto::TlsPsk {
            key: key(&Some(k.clone())),
            derivation: auth
                .psk_derivation
                .clone()
                .unwrap_or_else(|| "rfc8446".into()),
        }),
    }
}

/// The keys of a HostAdd / HostChangeKey request, as given.
fn key_text(h: &proto::Host) -> state::HostKeyText {
    let psk = h.psk.clone().unwrap_or_default();
    state::HostKeyText {
        dhchap_key: h.dhchap_key.clone(),
        dhchap_ctrl_key: h.dhchap_ctrl_key.clone(),
        psk: psk.key,
        psk_derivation: psk.derivation,
    }
}

// ------------------------------------------------------------------ I/O statistics

/// The UUID the gateways serve `n` under (what they report their counters with).
fn namespace_uuid(n: &NamespaceEntry) -> Option<Vec<u8>> {
    uuid::Uuid::parse_str(&namespace_proto(n).uuid)
        .ok()
        .map(|u| u.as_bytes().to_vec())
}

impl ControlPlane {
    /// Takes in the I/O counters of a gateway's group beacon ([`crate::io_stats`]), and
    /// forgets those of namespaces deleted since the last time.
    fn record_io_stats(
        &self,
        gateway: &str,
        incarnation: u64,
        counters: &[proto::SubsystemIoCounters],
        totals: Option<&proto::GatewayIoTotals>,
    ) {
        // Refused as a beacon anyway (no gateway to count them for).
        if gateway.is_empty() {
            return;
        }
        let now = self.now_ms();
        let st = self.snapshot();
        let mut guard = self.io_stats.lock().unwrap_or_else(|e| e.into_inner());
        let (book, pruned) = &mut *guard;
        book.on_beacon(gateway, incarnation, now, counters, totals);
        // Namespaces go only with a state change: look again only after one.
        if *pruned != st.version {
            book.retain(|nqn, nsid, uuid| {
                st.namespaces
                    .get(&(nqn.to_string(), nsid))
                    .is_some_and(|n| uuid.is_empty() || namespace_uuid(n).as_deref() == Some(uuid))
            });
            *pruned = st.version;
        }
    }

    /// A namespace's I/O counters summed over the gateways that reported it, with each
    /// gateway's share and how long ago (ms) it last reported.
    pub(crate) fn namespace_io_stats(
        &self,
        nqn: &str,
        nsid: u32,
    ) -> Result<
        (
            NamespaceEntry,
            crate::io_stats::NamespaceTotals,
            Vec<crate::io_stats::GatewayShare>,
        ),
        ConfigError,
    > {
        let st = self.snapshot();
        if !st.subsystems.contains_key(nqn) {
            return Err(ConfigError::NoSubsystem(nqn.to_string()));
        }
        let n = st
            .namespaces
            .get(&(nqn.to_string(), nsid))
            .cloned()
            .ok_or_else(|| ConfigError::NoNamespace {
                nqn: nqn.to_string(),
                nsid,
            })?;
        let uuid = namespace_uuid(&n);
        let now = self.now_ms();
        let guard = self.io_stats.lock().unwrap_or_else(|e| e.into_inner());
        let (total, mut shares) = guard.0.namespace(nqn, nsid, uuid.as_deref());
        for s in &mut shares {
            s.at_ms = now.saturating_sub(s.at_ms);
        }
        Ok((n, total, shares))
    }

    /// Every gateway's I/O totals over its namespaces, as reported to this replica.
    pub(crate) fn gateway_io_totals(
        &self,
    ) -> std::collections::BTreeMap<String, crate::io_stats::GatewayTotals> {
        self.io_stats
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .0
            .gateways()
    }

    /// Host connections per gateway, from the last beacons: (controllers, I/O queues).
    pub(crate) fn queues_by_gateway(&self) -> std::collections::BTreeMap<String, (u64, u64)> {
        self.connections
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|(gw, conns)| {
                let io: u64 = conns.iter().map(|c| u64::from(c.io_queues)).sum();
                (gw.clone(), (conns.len() as u64, io))
            })
            .collect()
    }
}

fn namespace_proto(n: &NamespaceEntry) -> proto::Namespace {
    proto::Namespace {
        subsystem_nqn: n.subsystem_nqn.clone(),
        nsid: n.nsid,
        pool: n.pool.clone(),
        rados_namespace: n.rados_namespace.clone(),
        image: n.image.clone(),
        block_size: n.block_size,
        ana_group: n.ana_group,
        nguid: n.nguid.clone(),
        uuid: n.uuid.clone(),
        moving_from_group: n.moving_from,
        no_auto_visible: n.no_auto_visible,
        hosts: n.hosts.iter().cloned().collect(),
        qos: (!n.qos.is_unlimited()).then(|| n.qos.to_proto()),
        trash_image: n.trash_image,
        frozen_size: n.frozen_size.unwrap_or(0),
    }
}

fn namespace_entry(r: proto::NamespaceAddRequest) -> NamespaceEntry {
    NamespaceEntry {
        qos: QosLimits::from_proto(r.qos.as_ref()),
        subsystem_nqn: r.subsystem_nqn,
        nsid: r.nsid,
        pool: r.pool,
        rados_namespace: r.rados_namespace,
        image: r.image,
        block_size: r.block_size,
        ana_group: r.ana_group,
        moving_from: 0,
        no_auto_visible: r.no_auto_visible,
        hosts: std::collections::BTreeSet::new(),
        nguid: String::new(),
        uuid: r.uuid,
        trash_image: false,
        frozen_size: None,
    }
}

fn listener_proto(l: &ListenerEntry) -> proto::Listener {
    proto::Listener {
        subsystem_nqn: l.subsystem_nqn.clone(),
        gateway: l.gateway.clone(),
        transport: l.transport.clone(),
        address: l.address.clone(),
        port: u32::from(l.port),
        secure: l.secure,
    }
}

#[allow(clippy::result_large_err)] // tonic handlers return Status
fn listener_entry(l: proto::Listener) -> Result<ListenerEntry, Status> {
    let port = u16::try_from(l.port)
        .map_err(|_| Status::invalid_argument(format!("port {} out of range", l.port)))?;
    Ok(ListenerEntry {
        subsystem_nqn: l.subsystem_nqn,
        gateway: l.gateway,
        transport: if l.transport.is_empty() {
            "tcp".into()
        } else {
            l.transport.to_ascii_lowercase()
        },
        address: l.address,
        port,
        secure: l.secure,
    })
}

impl ControlPlane {
    /// The hosts connected to subsystem `nqn` through any gateway (sorted, each once), as
    /// the gateways' last beacons to this replica said.
    pub fn connected_hosts(&self, nqn: &str) -> Vec<String> {
        let hosts: std::collections::BTreeSet<String> = self
            .connections
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .flatten()
            .filter(|c| c.subsystem_nqn == nqn)
            .map(|c| c.host_nqn.clone())
            .collect();
        hosts.into_iter().collect()
    }

    /// The hosts connected to subsystem `nqn` (sorted, each once), as fresh as the gateways
    /// can say, for a refusal that must not be stale (`namespace del --delete-image`). A
    /// beacon is up to a beacon interval old, and a host's disconnect can reach this request
    /// before the beacon that reports it (a gateway beacons at once when a host's controller
    /// ends, but the host's `nvme disconnect` returns without waiting for the gateway). So
    /// while a gateway still reports a connection to `nqn`, wait until it has beaconed twice
    /// since this call began, at most `CONNECTIONS_SETTLE_WAIT`; then decide from what the
    /// gateways said last. The second was sent after this call began (a gateway sends its
    /// next beacon only once the last one is answered, and the first was received after the
    /// call began), so the gateway had had a beacon interval to see the disconnect. No
    /// connection: no wait.
    pub async fn connected_hosts_settled(&self, nqn: &str) -> Vec<String> {
        let started = Instant::now();
        let deadline = tokio::time::Instant::now() + CONNECTIONS_SETTLE_WAIT;
        let mut arrived = self.beacon_arrived.subscribe();
        let counts = || {
            self.beacons_seen
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone()
        };
        let at_start = counts();
        let mut waited = false;
        loop {
            let reporting: std::collections::BTreeSet<String> = self
                .connections_of(nqn)
                .into_iter()
                .map(|c| c.gateway)
                .collect();
            let hosts = self.connected_hosts(nqn);
            if hosts.is_empty() {
                if waited {
                    tracing::info!(
                        nqn,
                        waited_ms = started.elapsed().as_millis() as u64,
                        "the hosts the gateways reported connected have disconnected"
                    );
                }
                return hosts;
            }
            let now = counts();
            let settled = reporting.iter().all(|g| {
                now.get(g).copied().unwrap_or(0) >= at_start.get(g).copied().unwrap_or(0) + 2
            });
            if settled || tokio::time::Instant::now() >= deadline {
                tracing::debug!(
                    nqn,
                    ?hosts,
                    settled,
                    waited_ms = started.elapsed().as_millis() as u64,
                    "hosts connected"
                );
                return hosts;
            }
            waited = true;
            // Err: the sender is ours and lives as long as `self`; the deadline ends the wait.
            let _ = tokio::time::timeout_at(deadline, arrived.changed()).await;
        }
    }

    /// What `gateway` serves, from the cached state; None before it ever beaconed.
    pub fn assignment(&self, gateway: &str) -> Option<proto::Assignment> {
        let st = self.snapshot();
        let map = st.map.as_ref()?;
        let gw = map.gateways.get(gateway)?;
        Some(proto::Assignment {
            version: map.epoch,
            gateway: gateway.to_string(),
            own_ana_group: gw.ana_group,
            subsystems: st
                .subsystems
                .values()
                .map(|s| subsystem_proto(&st, s, true))
                .collect(),
            namespaces: st.namespaces.values().map(namespace_proto).collect(),
            listeners: st
                .listeners
                .iter()
                .filter(|l| l.gateway == gateway)
                .map(listener_proto)
                .collect(),
            ana_states: map
                .ana_states(gateway)
                .into_iter()
                .map(|(g, s)| proto::GroupState {
                    ana_group: g,
                    state: u32::from(s.code()),
                })
                .collect(),
            wait_for_osdmap: true,
            group_listeners: st.listeners.iter().map(listener_proto).collect(),
            state_version: st.version,
            log_level: st.settings.log_level.clone().unwrap_or_default(),
        })
    }

    pub async fn beacon(self: &Arc<Self>, b: proto::Beacon) -> Result<proto::BeaconReply, Status> {
        self.beacon_with_groups(b, None).await
    }

    /// Waits until the gateway holding `group` has applied state `version` (it drained a
    /// namespace moving away from the group), at most [`MOVE_DRAIN_TIMEOUT`]; no wait when
    /// the holder is not available (failover fences it instead). Returns a note for the
    /// reply.
    async fn wait_for_drain(&self, group: u32, version: u64) -> String {
        let started = Instant::now();
        let holder = self.snapshot().map.as_ref().and_then(|m| {
            let g = m.groups.get(&group)?;
            let gw = m.gateways.get(&g.holder)?;
            (gw.availability == ana::Availability::Available).then(|| g.holder.clone())
        });
        let Some(holder) = holder else {
            return " (no gateway serving the old group: nothing to drain)".into();
        };
        loop {
            let Some(applied) = self
                .applied_state
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(&holder)
                .copied()
            else {
                // It never sent a group beacon: it does not report drains.
                return format!(" ({holder} does not report drains)");
            };
            if applied >= version {
                let ms = started.elapsed().as_millis();
                tracing::info!(group, gateway = %holder, ms, "namespace move drained");
                return format!(" (drained on {holder} in {ms} ms)");
            }
            if started.elapsed() >= MOVE_DRAIN_TIMEOUT {
                tracing::warn!(group, gateway = %holder, "namespace move: no drain acknowledgement in time");
                return format!(" ({holder} did not acknowledge the drain in time)");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// A beacon; `group_addrs`: the gateway's client addresses per ANA group (None: it does
    /// not shard its connections per group, so every fence takes all of `client_addrs`).
    pub async fn beacon_with_groups(
        self: &Arc<Self>,
        b: proto::Beacon,
        group_addrs: Option<std::collections::BTreeMap<u32, Vec<String>>>,
    ) -> Result<proto::BeaconReply, Status> {
        if b.gateway.is_empty() {
            return Err(Status::invalid_argument("beacon without a gateway name"));
        }
        let name = b.gateway.clone();
        let now = self.now_ms();
        // Every replica keeps the connections it hears about (gateways beacon them all).
        let mut conns = b.connections.clone();
        for c in &mut conns {
            c.gateway = name.clone();
        }
        self.connections
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name.clone(), conns);
        *self
            .beacons_seen
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(name.clone())
            .or_default() += 1;
        self.beacon_arrived.send_modify(|n| *n += 1);
        // OSDs that do not answer the gateway but answer the leader: cut off from them, as
        // good as cut off from the cluster (`crate::osd_reports`).
        let osds_cut_off = self
            .osd_reports
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .on_beacon(&name, &b.osds_unanswered);
        let cluster = if osds_cut_off {
            ana::ClusterReach::Stalled
        } else {
            cluster_reach(b.cluster)
        };
        // The reply waits for the map's write (a gateway that joins right after its first
        // beacon finds itself in the state), but at most a quarter of the grace. A gateway
        // sends its next beacon only once this one is answered, so a write waiting on a
        // stalled cluster (the state object's PG peering, its OSD stopped) would otherwise
        // silence every gateway whose beacon changed the map, and after the grace make
        // them unavailable here though they serve. The write goes on in the background.
        let wait = Duration::from_millis(self.opts.timing.grace_ms / 4);
        self.feed_waiting_at_most(
            Event::Beacon {
                gateway: b.gateway,
                ana_group: b.ana_group,
                incarnation: b.incarnation,
                addrs: b.client_addrs,
                group_addrs,
                applied_epoch: b.applied_version,
                cluster,
                now_ms: now,
            },
            wait,
        )
        .await?;
        // Only the leader gets here (`feed` refuses otherwise): it checks the report.
        let due = self
            .osd_reports
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .probe_due(&name, now, self.opts.timing.grace_ms);
        if let Some(osds) = due {
            self.spawn_osd_check(name.clone(), osds);
        }
        let (group, availability) = self
            .live
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .and_then(|m| m.gateways.get(&name).map(|g| (g.ana_group, g.availability)))
            .unwrap_or((0, ana::Availability::Unavailable));
        let witness_fit =
            availability == ana::Availability::Available && cluster != ana::ClusterReach::Stalled;
        let osd_probe = self.osd_witness(&name, b.osd_probe, witness_fit, now);
        Ok(proto::BeaconReply {
            ana_group: group,
            leader: self.id.clone(),
            fenced: availability == ana::Availability::Fenced,
            grace_ms: self.opts.timing.grace_ms,
            osd_probe,
        })
    }

    /// Applies the answer to a witness request that `gateway`'s beacon carries, and returns
    /// what to ask it now if it can be a witness (`fit`: available, not reporting the cluster
    /// stalled or OSDs not answering it): `crate::osd_reports`.
    fn osd_witness(
        &self,
        gateway: &str,
        answer: Option<proto::OsdProbeAnswer>,
        fit: bool,
        now_ms: u64,
    ) -> Option<proto::OsdProbeRequest> {
        use crate::osd_reports::Verdict;
        let mut reports = self.osd_reports.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(a) = answer.filter(|a| a.id != 0) {
            let unanswered = (!a.not_asked).then_some(a.unanswered.as_slice());
            match reports.witness_answered(gateway, a.id, unanswered) {
                Some(v) if v.verdict == Verdict::Confirmed => tracing::warn!(
                    gateway = %v.reporter,
                    osds = ?v.osds,
                    witness = gateway,
                    "OSDs the gateway cannot reach answer another gateway: it is cut off from \
                     them; taken as cut off from the cluster (failed over while another \
                     gateway reaches it)"
                ),
                Some(v) if a.not_asked => tracing::warn!(
                    gateway = %v.reporter,
                    witness = gateway,
                    "the gateway asked as a witness could not ask the OSDs that another \
                     gateway reports (no cluster connection)"
                ),
                Some(v) => tracing::warn!(
                    gateway = %v.reporter,
                    osds = ?v.osds,
                    witness = gateway,
                    "OSDs the gateway cannot reach answer neither the leader nor another \
                     gateway (a hung OSD?): nothing moves"
                ),
                None => {}
            }
        }
        if !fit || reports.verdict(gateway).is_some() {
            return None;
        }
        let r = reports.witness_request(gateway, now_ms, self.opts.timing.grace_ms)?;
        Some(proto::OsdProbeRequest {
            id: r.id,
            osds: r.osds,
        })
    }

    /// The ANA groups (owner, holder, phase, namespaces) and every gateway's ANA states, as
    /// the live map (leader) or the stored one (other replicas) has them.
    pub(crate) fn ana_show(&self) -> proto::AnaShowReply {
        let st = self.snapshot();
        let live = self.live.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let map = live.or(st.map.clone()).unwrap_or_default();
        let groups = map
            .groups
            .values()
            .map(|g| proto::AnaGroupInfo {
                ana_group: g.id,
                owner: g.owner.clone(),
                holder: g.holder.clone(),
                phase: g.phase.name().into(),
                namespaces: st
                    .namespaces
                    .values()
                    .filter(|n| n.ana_group == g.id)
                    .count() as u32,
            })
            .collect();
        let mut states = Vec::new();
        for gw in map.gateways.keys() {
            for (g, s) in map.ana_states(gw) {
                states.push(proto::GatewayAnaState {
                    gateway: gw.clone(),
                    ana_group: g,
                    state: u32::from(s.code()),
                });
            }
        }
        proto::AnaShowReply { groups, states }
    }

    /// The gateways of the group, as the live map (leader) or the stored one has them.
    pub(crate) fn gateway_infos(&self) -> Vec<proto::GatewayInfo> {
        let now = self.now_ms();
        let live = self.live.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let map = live.or_else(|| self.snapshot().map.clone());
        let Some(map) = map else {
            return Vec::new();
        };
        map.gateways
            .values()
            .map(|g| {
                let (lo, hi) = ana::cntlid_range(g.ana_group).unwrap_or((0, 0));
                proto::GatewayInfo {
                    name: g.name.clone(),
                    ana_group: g.ana_group,
                    availability: g.availability.name().into(),
                    last_beacon_ms_ago: g
                        .last_beacon_ms
                        .map(|t| now.saturating_sub(t))
                        .unwrap_or(0),
                    client_addrs: g.addrs.clone(),
                    cntlid_min: u32::from(lo),
                    cntlid_max: u32::from(hi),
                    cluster: g.cluster.name().into(),
                }
            })
            .collect()
    }
}

/// A beacon's `cluster` field (`proto::ClusterReach`) in the group model's terms; a value
/// this replica does not know is unknown.
fn cluster_reach(wire: i32) -> ana::ClusterReach {
    match proto::ClusterReach::try_from(wire) {
        Ok(proto::ClusterReach::Reachable) => ana::ClusterReach::Reachable,
        Ok(proto::ClusterReach::Stalled) => ana::ClusterReach::Stalled,
        Ok(proto::ClusterReach::Unknown) | Err(_) => ana::ClusterReach::Unknown,
    }
}

// ------------------------------------------------------------------ services

/// Whether a background write of the map runs, and the requests made so far.
#[derive(Default)]
struct BackgroundPersist {
    running: bool,
    requested: u64,
}

/// This replica ends the move of a namespace until dropped (unless it already did: then
/// nothing is claimed or released).
struct EndingClaim {
    cp: Arc<ControlPlane>,
    key: (String, u32),
    claimed: bool,
}

impl EndingClaim {
    fn new(cp: &Arc<ControlPlane>, key: &(String, u32)) -> EndingClaim {
        EndingClaim {
            cp: cp.clone(),
            key: key.clone(),
            claimed: cp.begin_ending(key),
        }
    }
}

impl Drop for EndingClaim {
    fn drop(&mut self) {
        if self.claimed {
            self.cp.done_ending(&self.key);
        }
    }
}

/// `Admin` on a replica.
pub struct AdminService(pub Arc<ControlPlane>);

/// `GatewayControl` on a replica.
pub struct GatewayService(pub Arc<ControlPlane>);

fn reply(st: &GroupState, message: String) -> Response<proto::Reply> {
    Response::new(proto::Reply {
        version: st.version,
        message,
    })
}

#[tonic::async_trait]
impl proto::admin_server::Admin for AdminService {
    async fn subsystem_add(
        &self,
        r: Request<proto::SubsystemAddRequest>,
    ) -> Result<Response<proto::Reply>, Status> {
        let r = r.into_inner();
        let (nqn, require_tls) = (r.nqn.clone(), r.require_tls);
        let st = self
            .0
            .add_subsystem(
                &r.nqn,
                &r.serial,
                r.allow_any_host,
                r.max_namespaces,
                r.require_tls,
            )
            .await
            .map_err(status)?;
        tracing::info!(nqn = %nqn, require_tls, "subsystem added");
        let mut text = format!("subsystem {nqn} added");
        if require_tls {
            text.push_str(" (hosts must connect over TLS)");
        }
        if let Some(warning) = crate::nqn::format_warning("subsystem NQN", &nqn) {
            tracing::warn!("{warning}");
            text = format!("{text}\nwarning: {warning}");
        }
        Ok(reply(&st, text))
    }

    async fn subsystem_set(
        &self,
        r: Request<proto::SubsystemSetRequest>,
    ) -> Result<Response<proto::Reply>, Status> {
        let r = r.into_inner();
        let Some(required) = r.require_tls else {
            return Err(Status::invalid_argument(
                "subsystem set: give a setting to change (require_tls)",
            ));
        };
        let (changed, st) = self
            .0
            .set_require_tls(&r.nqn, required)
            .await
            .map_err(status)?;
        tracing::info!(nqn = %r.nqn, require_tls = required, changed, "subsystem TLS requirement set");
        // Which connections the gateways will close, from their last beacons: the admin
        // learns here who is about to be disconnected.
        let plain: std::collections::BTreeSet<String> = self
            .0
            .connections_of(&r.nqn)
            .into_iter()
            .filter(|c| !c.secure)
            .map(|c| c.host_nqn)
            .collect();
        let text = match (changed, required) {
            (false, true) => format!("subsystem {}: TLS already required (unchanged)", r.nqn),
            (false, false) => format!("subsystem {}: TLS already not required (unchanged)", r.nqn),
            (true, false) => format!(
                "subsystem {}: TLS no longer required (hosts may connect through plain \
                 listeners too)",
                r.nqn
            ),
            (true, true) if plain.is_empty() => format!(
                "subsystem {}: TLS required (no host was connected without TLS)",
                r.nqn
            ),
            (true, true) => format!(
                "subsystem {}: TLS required; the gateways close the connections of {} host(s) \
                 connected without TLS ({}); they must reconnect through a secure listener",
                r.nqn,
                plain.len(),
                plain.into_iter().collect::<Vec<_>>().join(", ")
            ),
        };
        Ok(reply(&st, text))
    }

    async fn subsystem_del(
        &self,
        r: Request<proto::SubsystemDelRequest>,
    ) -> Result<Response<proto::Reply>, Status> {
        let r = r.into_inner();
        let nqn = r.nqn.clone();
        let (_, st) = self
            .0
            .update(move |st| st.del_subsystem(&r.nqn, r.force))
            .await?;
        tracing::info!(nqn = %nqn, "subsystem deleted");
        Ok(reply(&st, format!("subsystem {nqn} deleted")))
    }

    async fn subsystem_list(
        &self,
        _: Request<proto::Empty>,
    ) -> Result<Response<proto::SubsystemListReply>, Status> {
        let st = self.0.snapshot();
        Ok(Response::new(proto::SubsystemListReply {
            subsystems: st
                .subsystems
                .values()
                .map(|s| subsystem_proto(&st, s, false))
                .collect(),
            version: st.version,
        }))
    }

    async fn namespace_add(
        &self,
        r: Request<proto::NamespaceAddRequest>,
    ) -> Result<Response<proto::Reply>, Status> {
        let r = r.into_inner();
        let (create_image, size) = (r.create_image, r.size_bytes);
        let entry = namespace_entry(r);
        // Syntax and references first (cheap, and no cluster round trip for a bad request).
        let checked = self
            .0
            .snapshot()
            .check_namespace(entry.clone())
            .map_err(config_status)?;
        let backend = self.0.store.backend().clone();
        let spec = state::image_spec(&entry);
        if create_image {
            let block = u64::from(checked.block_size);
            if size == 0 || !size.is_multiple_of(block) {
                return Err(Status::invalid_argument(format!(
                    "--create-image needs --size, a non-zero multiple of the block size \
                     {block} (got {size})"
                )));
            }
            let (b, e) = (backend.clone(), entry.clone());
            blocking(move || b.create_image(&e.pool, &e.rados_namespace, &e.image, size)).await?;
            tracing::info!(image = %spec, size, "image created for a namespace");
        } else {
            if size != 0 {
                return Err(Status::invalid_argument(
                    "--size is the size of an image to create: it needs --create-image \
                     (namespace resize grows an existing one)",
                ));
            }
            let e = entry.clone();
            let b = backend.clone();
            let exists =
                blocking(move || b.image_exists(&e.pool, &e.rados_namespace, &e.image)).await?;
            if !exists {
                return Err(Status::not_found(format!(
                    "image {spec} not found (create it with --create-image --size, or rbd create)"
                )));
            }
        }
        let (added, st) = self
            .0
            .add_namespace_with_image(entry, create_image)
            .await
            .map_err(status)?;
        tracing::info!(nqn = %added.subsystem_nqn, nsid = added.nsid, ana_group = added.ana_group, image = %state::image_spec(&added), qos = %added.qos, "namespace added");
        Ok(reply(
            &st,
            format!(
                "namespace {} added to {} (ANA group {}){}",
                added.nsid,
                added.subsystem_nqn,
                added.ana_group,
                if create_image {
                    format!(", image {spec} created ({size} bytes)")
                } else {
                    String::new()
                }
            ),
        ))
    }

    async fn namespace_add_many(
        &self,
        r: Request<proto::NamespaceAddManyRequest>,
    ) -> Result<Response<proto::NamespaceAddManyReply>, Status> {
        let entries: Vec<NamespaceEntry> = r
            .into_inner()
            .namespaces
            .into_iter()
            .map(namespace_entry)
            .collect();
        if entries.len() > MAX_BATCH {
            return Err(Status::invalid_argument(format!(
                "{} namespaces in one request: at most {MAX_BATCH}",
                entries.len()
            )));
        }
        // Checks in order against the cached state (each namespace sees the ones before it),
        // then the images, up to the first refusal.
        let mut trial = self.0.state();
        let mut refusal: Option<(usize, Status)> = None;
        for (i, e) in entries.iter().enumerate() {
            if let Err(err) = trial.add_namespace(e.clone()) {
                refusal = Some((i, config_status(err)));
                break;
            }
        }
        let checked = refusal.as_ref().map_or(entries.len(), |(i, _)| *i);
        let backend = self.0.store.backend().clone();
        let to_check = entries[..checked].to_vec();
        let missing = blocking(move || {
            for (i, e) in to_check.iter().enumerate() {
                if !backend.image_exists(&e.pool, &e.rados_namespace, &e.image)? {
                    return Ok(Some(i));
                }
            }
            Ok(None)
        })
        .await?;
        if let Some(i) = missing {
            refusal = Some((
                i,
                Status::not_found(format!(
                    "image {} not found",
                    state::image_spec(&entries[i])
                )),
            ));
        }
        let accepted: Vec<NamespaceEntry> =
            entries[..refusal.as_ref().map_or(entries.len(), |(i, _)| *i)].to_vec();
        // Applied together; a namespace refused now (the state changed since the check)
        // ends the batch there like one refused above.
        let ((added, late), st) = self
            .0
            .update(move |st| {
                let mut added = Vec::with_capacity(accepted.len());
                for (i, e) in accepted.iter().enumerate() {
                    match st.add_namespace(e.clone()) {
                        Ok(n) => added.push(n),
                        Err(err) => return Ok((added, Some((i, err)))),
                    }
                }
                Ok((added, None))
            })
            .await?;
        if let Some((i, err)) = late {
            refusal = Some((i, config_status(err)));
        }
        tracing::info!(
            added = added.len(),
            refused = ?refusal.as_ref().map(|(i, s)| (i, s.message().to_string())),
            version = st.version,
            "namespaces added"
        );
        Ok(Response::new(proto::NamespaceAddManyReply {
            version: st.version,
            added: added.iter().map(namespace_proto).collect(),
            refused: refusal.map(|(i, s)| proto::NamespaceAddRefusal {
                index: u32::try_from(i).unwrap_or(u32::MAX),
                code: s.code() as i32,
                message: s.message().to_string(),
            }),
        }))
    }

    async fn namespace_del(
        &self,
        r: Request<proto::NamespaceDelRequest>,
    ) -> Result<Response<proto::Reply>, Status> {
        let r = r.into_inner();
        let (nqn, nsid) = (r.subsystem_nqn.clone(), r.nsid);
        let entry = self
            .0
            .snapshot()
            .namespaces
            .get(&(nqn.clone(), nsid))
            .cloned();
        if let Some(e) = entry.as_ref().filter(|e| e.trash_image && !r.delete_image) {
            // The image goes to the trash with the namespace: the admin says so (as
            // ceph-nvmeof's i_am_sure), or clears the flag first.
            return Err(Status::failed_precondition(format!(
                "namespace {nsid} of {nqn} moves its image {} to the RBD trash when deleted: \
                 give --delete-image, or clear that with namespace set --trash-image false",
                state::image_spec(e)
            )));
        }
        if r.delete_image {
            // Refused before anything changes: a connected host would lose its data.
            let Some(entry) = entry.as_ref() else {
                return Err(config_status(ConfigError::NoNamespace { nqn, nsid }));
            };
            // Forced: no need to know.
            let connected = if r.force {
                Vec::new()
            } else {
                self.0.connected_hosts_settled(&nqn).await
            };
            if !connected.is_empty() {
                return Err(Status::failed_precondition(format!(
                    "hosts are connected to {nqn} ({}): disconnect them first, or --force to \
                     delete the image {} anyway",
                    connected.join(", "),
                    state::image_spec(entry)
                )));
            }
        }
        let (_, st) = self
            .0
            .update(move |st| st.del_namespace(&r.subsystem_nqn, r.nsid))
            .await?;
        let Some(entry) = entry.filter(|_| r.delete_image) else {
            return Ok(reply(&st, format!("namespace {nsid} deleted from {nqn}")));
        };
        // The gateways close the image once they applied the deletion: librbd refuses to
        // remove an image that is still open (watched), so retry for a while.
        let spec = state::image_spec(&entry);
        let backend = self.0.store.backend().clone();
        let started = Instant::now();
        loop {
            let (b, e) = (backend.clone(), entry.clone());
            let gone = blocking(move || {
                if e.trash_image {
                    b.trash_image(&e.pool, &e.rados_namespace, &e.image)
                } else {
                    b.remove_image(&e.pool, &e.rados_namespace, &e.image)
                }
            });
            match gone.await {
                Ok(()) => break,
                Err(s)
                    if s.code() == tonic::Code::FailedPrecondition
                        && started.elapsed() < IMAGE_CLOSE_WAIT =>
                {
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
                Err(s) => {
                    return Err(Status::new(
                        s.code(),
                        format!(
                            "namespace {nsid} deleted from {nqn}, but its image was not: {}",
                            s.message()
                        ),
                    ))
                }
            }
        }
        let gone = if entry.trash_image {
            "moved to the RBD trash"
        } else {
            "removed"
        };
        tracing::info!(nqn = %nqn, nsid, image = %spec, gone, "namespace and its image deleted");
        Ok(reply(
            &st,
            format!("namespace {nsid} deleted from {nqn}, image {spec} {gone}"),
        ))
    }

    async fn namespace_set_qos(
        &self,
        r: Request<proto::NamespaceSetQosRequest>,
    ) -> Result<Response<proto::Reply>, Status> {
        let r = r.into_inner();
        let (nqn, nsid) = (r.subsystem_nqn.clone(), r.nsid);
        let change = r.limits.unwrap_or_default();
        let (limits, st) = self
            .0
            .update(move |st| st.set_qos(&r.subsystem_nqn, r.nsid, &change))
            .await?;
        tracing::info!(nqn = %nqn, nsid, qos = %limits, "namespace QoS limits set");
        Ok(reply(
            &st,
            format!(
                "namespace {nsid} of {nqn}: QoS limits {}",
                if limits.is_unlimited() {
                    "cleared (unlimited)".to_string()
                } else {
                    limits.to_string()
                }
            ),
        ))
    }

    async fn namespace_set(
        &self,
        r: Request<proto::NamespaceSetRequest>,
    ) -> Result<Response<proto::Reply>, Status> {
        let r = r.into_inner();
        if r.auto_visible.is_none() && r.trash_image.is_none() && r.auto_resize.is_none() {
            return Err(Status::invalid_argument(
                "namespace set: give a setting to change (auto_visible, trash_image, \
                 auto_resize)",
            ));
        }
        let (nqn, nsid) = (r.subsystem_nqn.clone(), r.nsid);
        let (notes, st) = self
            .0
            .set_namespace(
                &nqn,
                nsid,
                r.auto_visible,
                r.trash_image,
                r.auto_resize,
                r.force,
            )
            .await
            .map_err(status)?;
        Ok(reply(
            &st,
            format!("namespace {nsid} of {nqn}: {}", notes.join(", ")),
        ))
    }

    async fn subsystem_change_key(
        &self,
        r: Request<proto::SubsystemKeyRequest>,
    ) -> Result<Response<proto::Reply>, Status> {
        let r = r.into_inner();
        let set = !r.dhchap_key.is_empty();
        let (changed, st) = self
            .0
            .set_subsystem_key(&r.nqn, r.dhchap_key)
            .await
            .map_err(status)?;
        Ok(reply(
            &st,
            format!(
                "subsystem {}: DH-HMAC-CHAP key {}{}",
                r.nqn,
                if set { "set" } else { "removed" },
                if changed { "" } else { " (unchanged)" }
            ),
        ))
    }

    async fn log_level_get(
        &self,
        _: Request<proto::Empty>,
    ) -> Result<Response<proto::LogLevelReply>, Status> {
        Ok(Response::new(proto::LogLevelReply {
            group: self
                .0
                .snapshot()
                .settings
                .log_level
                .clone()
                .unwrap_or_default(),
            replica: crate::log_level::current(),
        }))
    }

    async fn log_level_set(
        &self,
        r: Request<proto::LogLevelRequest>,
    ) -> Result<Response<proto::Reply>, Status> {
        let level = r.into_inner().level;
        let group = (!level.is_empty()).then(|| level.clone());
        let (changed, st) = self.0.set_log_level(group).await.map_err(status)?;
        tracing::info!(level = %level, changed, "group log level set");
        Ok(reply(
            &st,
            if level.is_empty() {
                "log level: each gateway and replica its own again (RUST_LOG, else info)".into()
            } else {
                format!("log level {level} on every gateway and replica")
            },
        ))
    }

    async fn namespace_move(
        &self,
        r: Request<proto::NamespaceMoveRequest>,
    ) -> Result<Response<proto::Reply>, Status> {
        let r = r.into_inner();
        let (nqn, nsid, g) = (r.subsystem_nqn.clone(), r.nsid, r.ana_group);
        let (st, drained) = self.0.move_namespace(&nqn, nsid, g).await.map_err(status)?;
        Ok(reply(
            &st,
            format!("namespace {nsid} of {nqn} moved to ANA group {g}{drained}"),
        ))
    }

    async fn namespace_resize(
        &self,
        r: Request<proto::NamespaceResizeRequest>,
    ) -> Result<Response<proto::Reply>, Status> {
        let r = r.into_inner();
        let st = self.0.snapshot();
        let ns = st
            .namespaces
            .get(&(r.subsystem_nqn.clone(), r.nsid))
            .cloned()
            .ok_or_else(|| {
                config_status(ConfigError::NoNamespace {
                    nqn: r.subsystem_nqn.clone(),
                    nsid: r.nsid,
                })
            })?;
        if !r.size_bytes.is_multiple_of(u64::from(ns.block_size.max(1))) {
            return Err(Status::invalid_argument(format!(
                "size {} is not a multiple of the block size {}",
                r.size_bytes, ns.block_size
            )));
        }
        if ns.frozen_size.is_some() {
            // Auto-resize off: the frozen size is what hosts see; it becomes this one.
            let size = r.size_bytes;
            let (old, st) = self
                .0
                .resize_frozen_namespace(&ns, size)
                .await
                .map_err(status)?;
            return Ok(reply(
                &st,
                format!(
                    "namespace {} of {} ({}, auto-resize off) resized from {old} to {size} bytes",
                    ns.nsid,
                    ns.subsystem_nqn,
                    state::image_spec(&ns)
                ),
            ));
        }
        let backend = self.0.store.backend().clone();
        let (n, size) = (ns.clone(), r.size_bytes);
        let old = blocking(move || backend.grow_image(&n.pool, &n.rados_namespace, &n.image, size))
            .await?;
        tracing::info!(nqn = %ns.subsystem_nqn, nsid = ns.nsid, image = %state::image_spec(&ns), old, new = size, "namespace grown");
        Ok(reply(
            &st,
            format!(
                "namespace {} of {} ({}) grown from {old} to {size} bytes",
                ns.nsid,
                ns.subsystem_nqn,
                state::image_spec(&ns)
            ),
        ))
    }

    async fn namespace_list(
        &self,
        r: Request<proto::NamespaceListRequest>,
    ) -> Result<Response<proto::NamespaceListReply>, Status> {
        let nqn = r.into_inner().subsystem_nqn;
        let st = self.0.snapshot();
        if !nqn.is_empty() && !st.subsystems.contains_key(&nqn) {
            return Err(config_status(ConfigError::NoSubsystem(nqn)));
        }
        Ok(Response::new(proto::NamespaceListReply {
            namespaces: st
                .namespaces
                .values()
                .filter(|n| nqn.is_empty() || n.subsystem_nqn == nqn)
                .map(namespace_proto)
                .collect(),
            version: st.version,
        }))
    }

    async fn listener_add(
        &self,
        r: Request<proto::Listener>,
    ) -> Result<Response<proto::Reply>, Status> {
        let l = listener_entry(r.into_inner())?;
        let mut text = format!("{} {}:{} on {}", l.transport, l.address, l.port, l.gateway);
        if l.secure {
            text.push_str(" (secure: TLS)");
        }
        let st = self.0.add_listener(l).await.map_err(status)?;
        Ok(reply(&st, format!("listener {text} added")))
    }

    async fn listener_del(
        &self,
        r: Request<proto::Listener>,
    ) -> Result<Response<proto::Reply>, Status> {
        let l = listener_entry(r.into_inner())?;
        let text = format!("{} {}:{} on {}", l.transport, l.address, l.port, l.gateway);
        let (_, st) = self.0.update(move |st| st.del_listener(&l)).await?;
        Ok(reply(&st, format!("listener {text} deleted")))
    }

    async fn listener_list(
        &self,
        r: Request<proto::ListenerListRequest>,
    ) -> Result<Response<proto::ListenerListReply>, Status> {
        let nqn = r.into_inner().subsystem_nqn;
        let st = self.0.snapshot();
        if !nqn.is_empty() && !st.subsystems.contains_key(&nqn) {
            return Err(config_status(ConfigError::NoSubsystem(nqn)));
        }
        Ok(Response::new(proto::ListenerListReply {
            listeners: st
                .listeners
                .iter()
                .filter(|l| nqn.is_empty() || l.subsystem_nqn == nqn)
                .map(listener_proto)
                .collect(),
            version: st.version,
        }))
    }

    async fn host_add(&self, r: Request<proto::Host>) -> Result<Response<proto::Reply>, Status> {
        let h = r.into_inner();
        let (nqn, host) = (h.subsystem_nqn.clone(), h.host_nqn.clone());
        let keys = key_text(&h);
        let (auth, st) = self
            .0
            .add_host(&h.subsystem_nqn, &h.host_nqn, keys)
            .await
            .map_err(status)?;
        tracing::info!(nqn = %nqn, host = %host, auth = auth.mode(), tls_psk = auth.psk.is_some(), "host allowed");
        let mut text = match auth.mode() {
            "none" => format!("host {host} allowed on {nqn}"),
            mode => format!("host {host} allowed on {nqn} (DH-HMAC-CHAP: {mode})"),
        };
        if auth.psk.is_some() {
            text.push_str(" with a TLS PSK");
        }
        if let Some(warning) = crate::nqn::format_warning("host NQN", &host) {
            tracing::warn!("{warning}");
            text = format!("{text}\nwarning: {warning}");
        }
        Ok(reply(&st, text))
    }

    async fn host_change_key(
        &self,
        r: Request<proto::Host>,
    ) -> Result<Response<proto::Reply>, Status> {
        let h = r.into_inner();
        let (nqn, host) = (h.subsystem_nqn.clone(), h.host_nqn.clone());
        let ((auth, changed), st) = self
            .0
            .update(move |st| {
                let auth = key_text(&h).parse()?;
                st.change_host_auth(&h.subsystem_nqn, &h.host_nqn, auth)
            })
            .await?;
        let psk = auth.psk.is_some();
        tracing::info!(nqn = %nqn, host = %host, auth = auth.mode(), tls_psk = psk, changed, "host keys set");
        // The request replaces every key: a PSK not given is cleared, as a DH-HMAC-CHAP key.
        let what = match (auth.mode(), psk, changed) {
            (_, _, false) => "unchanged".to_string(),
            ("none", false, true) => "cleared: it connects without authenticating".to_string(),
            (mode, false, true) => format!("changed (DH-HMAC-CHAP: {mode})"),
            (mode, true, true) => format!("changed (DH-HMAC-CHAP: {mode}; TLS PSK set)"),
        };
        Ok(reply(&st, format!("keys of host {host} on {nqn} {what}")))
    }

    async fn host_del(&self, r: Request<proto::Host>) -> Result<Response<proto::Reply>, Status> {
        let h = r.into_inner();
        let text = format!("host {} removed from {}", h.host_nqn, h.subsystem_nqn);
        let (_, st) = self
            .0
            .update(move |st| st.del_host(&h.subsystem_nqn, &h.host_nqn))
            .await?;
        Ok(reply(&st, text))
    }

    async fn namespace_add_host(
        &self,
        r: Request<proto::NamespaceHostRequest>,
    ) -> Result<Response<proto::Reply>, Status> {
        let r = r.into_inner();
        let (nqn, nsid, host) = (r.subsystem_nqn.clone(), r.nsid, r.host_nqn.clone());
        let (_, st) = self
            .0
            .update(move |st| st.add_namespace_host(&r.subsystem_nqn, r.nsid, &r.host_nqn))
            .await?;
        tracing::info!(nqn = %nqn, nsid, host = %host, "namespace made visible to a host");
        let mut text = format!("namespace {nsid} of {nqn} visible to host {host}");
        if !st.host_allowed(&nqn, &host) {
            text.push_str(&format!(
                "\nhost {host} is not allowed on {nqn} yet: it sees the namespace once it is \
                 (nvmeofctl host add)"
            ));
        }
        if let Some(warning) = crate::nqn::format_warning("host NQN", &host) {
            text = format!("{text}\nwarning: {warning}");
        }
        Ok(reply(&st, text))
    }

    async fn namespace_del_host(
        &self,
        r: Request<proto::NamespaceHostRequest>,
    ) -> Result<Response<proto::Reply>, Status> {
        let r = r.into_inner();
        let text = format!(
            "namespace {} of {} hidden from host {}",
            r.nsid, r.subsystem_nqn, r.host_nqn
        );
        let (nqn, nsid, host) = (r.subsystem_nqn.clone(), r.nsid, r.host_nqn.clone());
        let (_, st) = self
            .0
            .update(move |st| st.del_namespace_host(&r.subsystem_nqn, r.nsid, &r.host_nqn))
            .await?;
        tracing::info!(nqn = %nqn, nsid, host = %host, "namespace hidden from a host");
        Ok(reply(&st, text))
    }

    async fn host_list(
        &self,
        r: Request<proto::HostListRequest>,
    ) -> Result<Response<proto::HostListReply>, Status> {
        let nqn = r.into_inner().subsystem_nqn;
        let st = self.0.snapshot();
        if !nqn.is_empty() && !st.subsystems.contains_key(&nqn) {
            return Err(config_status(ConfigError::NoSubsystem(nqn)));
        }
        Ok(Response::new(proto::HostListReply {
            hosts: st
                .hosts
                .iter()
                .filter(|((n, _), _)| nqn.is_empty() || *n == nqn)
                .map(|((n, h), auth)| host_proto(n, h, auth, false))
                .collect(),
            version: st.version,
        }))
    }

    async fn gateway_list(
        &self,
        _: Request<proto::Empty>,
    ) -> Result<Response<proto::GatewayListReply>, Status> {
        Ok(Response::new(proto::GatewayListReply {
            gateways: self.0.gateway_infos(),
            leader: if self.0.is_leader() {
                self.0.id.clone()
            } else {
                String::new()
            },
            known_leader: if self.0.is_leader() {
                self.0.id.clone()
            } else {
                self.0
                    .snapshot()
                    .map
                    .as_ref()
                    .map(|m| m.leader.clone())
                    .unwrap_or_default()
            },
        }))
    }

    async fn connection_list(
        &self,
        r: Request<proto::ConnectionListRequest>,
    ) -> Result<Response<proto::ConnectionListReply>, Status> {
        let nqn = r.into_inner().subsystem_nqn;
        let connections = self
            .0
            .connections
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .flatten()
            .filter(|c| nqn.is_empty() || c.subsystem_nqn == nqn)
            .cloned()
            .collect();
        Ok(Response::new(proto::ConnectionListReply { connections }))
    }

    async fn ana_show(
        &self,
        _: Request<proto::Empty>,
    ) -> Result<Response<proto::AnaShowReply>, Status> {
        Ok(Response::new(self.0.ana_show()))
    }

    async fn namespace_io_stats(
        &self,
        r: Request<proto::NamespaceIoStatsRequest>,
    ) -> Result<Response<proto::NamespaceIoStatsReply>, Status> {
        let r = r.into_inner();
        let (n, total, shares) = self
            .0
            .namespace_io_stats(&r.subsystem_nqn, r.nsid)
            .map_err(config_status)?;
        let ids = |mut c: proto::NamespaceIoCounters| {
            c.nsid = n.nsid;
            c.uuid = namespace_uuid(&n).unwrap_or_default();
            c
        };
        let in_flight = shares.iter().map(|s| s.in_flight).sum();
        Ok(Response::new(proto::NamespaceIoStatsReply {
            total: Some(proto::NamespaceIoCounters {
                in_flight,
                ..ids(total.to_wire())
            }),
            gateways: shares
                .into_iter()
                .map(|s| proto::GatewayNamespaceIo {
                    gateway: s.gateway,
                    counters: Some(proto::NamespaceIoCounters {
                        in_flight: s.in_flight,
                        ..ids(s.totals.to_wire())
                    }),
                    reported_ms_ago: s.at_ms,
                })
                .collect(),
        }))
    }
}

type AssignmentStream = Pin<Box<dyn Stream<Item = Result<proto::Assignment, Status>> + Send>>;

#[tonic::async_trait]
impl proto::gateway_control_server::GatewayControl for GatewayService {
    async fn send_beacon(
        &self,
        r: Request<proto::Beacon>,
    ) -> Result<Response<proto::BeaconReply>, Status> {
        Ok(Response::new(self.0.beacon(r.into_inner()).await?))
    }

    async fn send_group_beacon(
        &self,
        r: Request<proto::GroupBeacon>,
    ) -> Result<Response<proto::BeaconReply>, Status> {
        let r = r.into_inner();
        let beacon = r
            .beacon
            .ok_or_else(|| Status::invalid_argument("group beacon without a beacon"))?;
        self.0
            .applied_state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(beacon.gateway.clone(), r.applied_state_version);
        self.0.record_io_stats(
            &beacon.gateway,
            beacon.incarnation,
            &r.io_counters,
            r.io_totals.as_ref(),
        );
        let mut groups = std::collections::BTreeMap::<u32, Vec<String>>::new();
        for g in r.group_clients {
            groups.entry(g.ana_group).or_default().extend(g.addrs);
        }
        Ok(Response::new(
            self.0.beacon_with_groups(beacon, Some(groups)).await?,
        ))
    }

    async fn leave(
        &self,
        r: Request<proto::LeaveRequest>,
    ) -> Result<Response<proto::LeaveReply>, Status> {
        let r = r.into_inner();
        let current = self
            .0
            .live
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .and_then(|m| m.gateways.get(&r.gateway).map(|g| g.incarnation));
        if current != Some(r.incarnation) {
            return Err(Status::failed_precondition(format!(
                "gateway {} incarnation {} is not the registered one",
                r.gateway, r.incarnation
            )));
        }
        let now = self.0.now_ms();
        self.0
            .feed(Event::Leave {
                gateway: r.gateway.clone(),
                now_ms: now,
            })
            .await?;
        let moving: Vec<u32> = self
            .0
            .live
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(|m| {
                m.groups
                    .values()
                    .filter(|g| g.holder == r.gateway && g.phase != ana::Phase::Active)
                    .map(|g| g.id)
                    .collect()
            })
            .unwrap_or_default();
        tracing::info!(gateway = %r.gateway, ?moving, "gateway leaving (planned)");
        Ok(Response::new(proto::LeaveReply { moving }))
    }

    type JoinStream = AssignmentStream;

    async fn join(
        &self,
        r: Request<proto::JoinRequest>,
    ) -> Result<Response<Self::JoinStream>, Status> {
        let r = r.into_inner();
        let (gateway, incarnation, presence_only) = (r.gateway, r.incarnation, r.presence_only);
        if gateway.is_empty() {
            return Err(Status::invalid_argument("join without a gateway name"));
        }
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let cp = self.0.clone();
        let mut changed = cp.changed.subscribe();
        tokio::spawn(async move {
            let mut last: Option<proto::Assignment> = None;
            loop {
                let a = if presence_only {
                    None
                } else {
                    cp.assignment(&gateway)
                };
                if a.is_some() && a != last {
                    if let Some(a) = a.clone() {
                        if tx.send(Ok(a)).await.is_err() {
                            break;
                        }
                    }
                    last = a;
                }
                tokio::select! {
                    r = changed.changed() => if r.is_err() { return },
                    _ = tx.closed() => break,
                }
            }
            // The gateway's end of the stream is gone: its process died (the kernel reset
            // its connection), it dropped the stream, or the network broke.
            cp.stream_ended(gateway, incarnation).await;
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }
}

/// Serves the admin, gateway and ceph-nvmeof API ([`crate::ceph_api`]) services on
/// `listener` until `shutdown` resolves.
pub async fn serve(
    cp: Arc<ControlPlane>,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), tonic::transport::Error> {
    let shutdown = cp.stopping_on(shutdown);
    tonic::transport::Server::builder()
        .add_service(proto::admin_server::AdminServer::new(AdminService(
            cp.clone(),
        )))
        .add_service(proto::gateway_control_server::GatewayControlServer::new(
            GatewayService(cp.clone()),
        ))
        .add_service(crate::ceph_api::service(cp))
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::TcpListenerStream::new(listener),
            shutdown,
        )
        .await
}
