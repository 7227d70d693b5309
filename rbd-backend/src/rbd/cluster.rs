//! Cluster connections (`rados_t`), sharded per ANA group, that images are opened on; and
//! image administration for tools and tests.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use super::device::{notify_update, DeviceState, RbdDevice};
use super::{CephSettings, ImageSpec, RbdError, WriteGate, ENOENT, GATEWAY_DEFAULT_ARGS};
use crate::ffi::{self, FfiError};
use crate::stats::IoStats;

struct Connection {
    rados: Arc<ffi::Rados>,
    /// One context per (pool, namespace), shared by the images on this connection (librbd
    /// duplicates it per image anyway).
    ioctxs: Mutex<HashMap<(String, String), Arc<ffi::IoCtx>>>,
    health: Arc<ClientHealth>,
}

/// What the gateway knows about one cluster connection (`rados_t`): the ANA group it serves
/// and whether the cluster blocklisted it.
#[derive(Debug)]
pub struct ClientHealth {
    pub(super) group: u32,
    /// librbd answered -ESHUTDOWN (-EBLOCKLISTED) on this connection: it is fenced for good.
    blocklisted: AtomicBool,
    /// Replaced by a fresh connection for its group ([`ClusterPool::retire_group`]); it stays
    /// only until the images still open on it are closed.
    retired: AtomicBool,
}

impl ClientHealth {
    fn new(group: u32) -> Self {
        Self {
            group,
            blocklisted: AtomicBool::new(false),
            retired: AtomicBool::new(false),
        }
    }

    /// The ANA group this connection serves (0: none, tools and tests).
    pub fn group(&self) -> u32 {
        self.group
    }

    pub fn is_blocklisted(&self) -> bool {
        self.blocklisted.load(Ordering::SeqCst)
    }

    pub fn is_retired(&self) -> bool {
        self.retired.load(Ordering::SeqCst)
    }

    /// Returns whether this call was the first to mark it.
    pub(super) fn mark_blocklisted(&self) -> bool {
        !self.blocklisted.swap(true, Ordering::SeqCst)
    }
}

struct Shard {
    index: usize,
    /// Images assigned (open or opening).
    images: AtomicUsize,
    conn: Mutex<Option<Arc<Connection>>>,
}

/// Keeps an image's place on its shard; released when the device is dropped.
pub(super) struct ShardLease(Arc<Shard>);

impl Drop for ShardLease {
    fn drop(&mut self) {
        self.0.images.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The connections of one ANA group (bounded; images spread over them).
struct ShardSet {
    group: u32,
    shards: Vec<Arc<Shard>>,
    /// Serialises only the choice of shard (a few loads), never I/O or connects.
    assign: Mutex<()>,
}

impl ShardSet {
    fn new(group: u32, n: usize) -> Arc<Self> {
        Arc::new(Self {
            group,
            shards: (0..n.max(1))
                .map(|index| {
                    Arc::new(Shard {
                        index,
                        images: AtomicUsize::new(0),
                        conn: Mutex::new(None),
                    })
                })
                .collect(),
            assign: Mutex::new(()),
        })
    }

    fn lease_shard(&self) -> ShardLease {
        let _g = self.assign.lock().unwrap_or_else(|e| e.into_inner());
        // Fewest images first; ties go to the lowest index, so connections open one by one.
        let shard = self
            .shards
            .iter()
            .min_by_key(|s| (s.images.load(Ordering::SeqCst), s.index))
            .cloned()
            .unwrap_or_else(|| {
                Arc::new(Shard {
                    index: 0,
                    images: AtomicUsize::new(0),
                    conn: Mutex::new(None),
                })
            });
        shard.images.fetch_add(1, Ordering::SeqCst);
        ShardLease(shard)
    }

    fn connections(&self) -> Vec<Arc<Connection>> {
        self.shards
            .iter()
            .filter_map(|s| s.conn.lock().unwrap_or_else(|e| e.into_inner()).clone())
            .collect()
    }
}

/// Cluster connections that images are spread over, sharded per ANA group.
///
/// Every ANA group has its own bounded set of connections (up to `max_connections`), used by
/// that group's images only, so blocklisting the addresses of one group's connections (the
/// gateway group's fence) stops exactly that group's I/O on this gateway. Group 0 is for
/// images outside any ANA group (tools, tests).
pub struct ClusterPool {
    settings: CephSettings,
    groups: Mutex<HashMap<u32, Arc<ShardSet>>>,
    /// The last failed connect, to fail fast for a while (see `CONNECT_RETRY_AFTER`).
    last_failure: Mutex<Option<(Instant, RbdError)>>,
}

/// How long a failed connect is reported again without trying.
const CONNECT_RETRY_AFTER: Duration = Duration::from_secs(5);

impl std::fmt::Debug for ClusterPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterPool")
            .field("client", &self.settings.entity_name())
            .field("max_connections", &self.settings.max_connections.max(1))
            .field("connected", &self.connected())
            .finish()
    }
}

/// Why the last image-connection attempt of this process failed; None once one succeeded
/// (or none failed yet). Kept outside the pools: a pool whose every open failed is dropped.
static LAST_CONNECT_FAILURE: Mutex<Option<RbdError>> = Mutex::new(None);

/// Why this process could not connect to the Ceph cluster for images at its last attempt
/// (missing keyring, cluster unreachable...); None when the last attempt succeeded or none
/// failed. What a readiness check reports while namespaces wait for their images.
pub fn last_connect_failure() -> Option<RbdError> {
    LAST_CONNECT_FAILURE
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone()
}

/// The process-wide pools, one per distinct setting (see [`ClusterPool::shared`]).
static SHARED_POOLS: Mutex<Vec<(CephSettings, Weak<ClusterPool>)>> = Mutex::new(Vec::new());

impl ClusterPool {
    /// A pool that connects lazily, on the first image of each shard.
    pub fn new(settings: CephSettings) -> Arc<Self> {
        Arc::new(Self {
            settings,
            groups: Mutex::new(HashMap::new()),
            last_failure: Mutex::new(None),
        })
    }

    /// The process's pool for `settings` (created on first use, kept while any of its images
    /// is open): the gateway opens every image through it, at start, on retries and when the
    /// control plane pushes namespaces, so one ANA group never has more than
    /// `max_connections` connections and a group's fence covers all of them.
    pub fn shared(settings: CephSettings) -> Arc<Self> {
        let mut all = SHARED_POOLS.lock().unwrap_or_else(|e| e.into_inner());
        all.retain(|(_, w)| w.strong_count() > 0);
        if let Some(pool) = all
            .iter()
            .find(|(s, _)| *s == settings)
            .and_then(|(_, w)| w.upgrade())
        {
            return pool;
        }
        let pool = Self::new(settings.clone());
        all.push((settings, Arc::downgrade(&pool)));
        pool
    }

    fn shard_set(&self, group: u32) -> Arc<ShardSet> {
        self.groups
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(group)
            .or_insert_with(|| ShardSet::new(group, self.settings.max_connections))
            .clone()
    }

    fn sets_in_order(&self) -> Vec<Arc<ShardSet>> {
        let mut sets: Vec<_> = self
            .groups
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .cloned()
            .collect();
        sets.sort_by_key(|s| s.group);
        sets
    }

    /// Replaces `group`'s connections by fresh ones (connected on the next open): images
    /// opened from now on use clients the cluster has never seen, so a blocklist of the old
    /// ones does not apply to them. Images still open on the old connections keep them until
    /// they are closed; their ops keep failing if those were blocklisted. Returns how many
    /// connections were retired.
    pub fn retire_group(&self, group: u32) -> usize {
        let old = self
            .groups
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(group, ShardSet::new(group, self.settings.max_connections));
        let Some(old) = old else {
            return 0;
        };
        let conns = old.connections();
        for c in &conns {
            c.health.retired.store(true, Ordering::SeqCst);
        }
        tracing::info!(
            group,
            connections = conns.len(),
            "cluster connections of the ANA group retired; new opens use fresh clients"
        );
        conns.len()
    }

    /// The groups that have at least one current (not retired) connection.
    pub fn connected_groups(&self) -> Vec<u32> {
        let mut groups: Vec<u32> = self
            .sets_in_order()
            .iter()
            .filter(|set| !set.connections().is_empty())
            .map(|set| set.group)
            .collect();
        groups.dedup();
        groups
    }

    /// Whether one of `group`'s current connections was found blocklisted.
    pub fn group_blocklisted(&self, group: u32) -> bool {
        self.groups
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&group)
            .is_some_and(|set| set.connections().iter().any(|c| c.health.is_blocklisted()))
    }

    /// The addresses (`rados_getaddrs`) of `group`'s current connections (blocking: local).
    pub fn group_addrs(&self, group: u32) -> Vec<String> {
        self.shard_set(group)
            .connections()
            .iter()
            .filter_map(|c| c.rados.getaddrs().ok())
            .collect()
    }

    pub fn settings(&self) -> &CephSettings {
        &self.settings
    }

    /// Connections established so far (every group).
    pub fn connected(&self) -> usize {
        self.sets_in_order()
            .iter()
            .map(|set| set.connections().len())
            .sum()
    }

    /// Images currently assigned to each shard (every group, in group order).
    pub fn images_per_connection(&self) -> Vec<usize> {
        self.sets_in_order()
            .iter()
            .flat_map(|set| {
                set.shards
                    .iter()
                    .map(|s| s.images.load(Ordering::SeqCst))
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    fn connection(&self, group: u32, shard: &Shard) -> Result<Arc<Connection>, RbdError> {
        let mut slot = shard.conn.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = slot.as_ref() {
            return Ok(c.clone());
        }
        // A connect that just failed (dead cluster, bad key) fails the next opens at once
        // instead of each waiting client_mount_timeout again; retried after a pause.
        {
            let failed = self.last_failure.lock().unwrap_or_else(|e| e.into_inner());
            if let Some((at, err)) = failed.as_ref() {
                if at.elapsed() < CONNECT_RETRY_AFTER {
                    return Err(err.clone());
                }
            }
        }
        let started = Instant::now();
        let rados = match self.connect() {
            Ok(r) => r,
            Err(e) => {
                tracing::error!(
                    group,
                    shard = shard.index,
                    ms = started.elapsed().as_millis() as u64,
                    "{e}"
                );
                *self.last_failure.lock().unwrap_or_else(|e| e.into_inner()) =
                    Some((Instant::now(), e.clone()));
                *LAST_CONNECT_FAILURE
                    .lock()
                    .unwrap_or_else(|e| e.into_inner()) = Some(e.clone());
                return Err(e);
            }
        };
        *self.last_failure.lock().unwrap_or_else(|e| e.into_inner()) = None;
        *LAST_CONNECT_FAILURE
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = None;
        let health = Arc::new(ClientHealth::new(group));
        let conn = Arc::new(Connection {
            rados: Arc::new(rados),
            ioctxs: Mutex::new(HashMap::new()),
            health: health.clone(),
        });
        tracing::info!(
            group,
            shard = shard.index,
            client = %self.settings.entity_name(),
            addrs = %conn.rados.getaddrs().unwrap_or_default(),
            ms = started.elapsed().as_millis() as u64,
            "connected to the Ceph cluster"
        );
        crate::rados::register_client(&conn.rados, Some(health));
        *slot = Some(conn.clone());
        Ok(conn)
    }

    /// A configured, connected `rados_t` (blocking).
    fn connect(&self) -> Result<ffi::Rados, RbdError> {
        connect_rados(&self.settings)
    }

    fn ioctx(
        &self,
        conn: &Connection,
        pool: &str,
        namespace: Option<&str>,
    ) -> Result<Arc<ffi::IoCtx>, RbdError> {
        let ns = namespace.unwrap_or("");
        let key = (pool.to_string(), ns.to_string());
        if let Some(c) = conn
            .ioctxs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&key)
        {
            return Ok(c.clone());
        }
        // Created outside the map's lock: a slow pool lookup delays only this open.
        let ctx =
            ffi::IoCtx::create(&conn.rados, pool, (!ns.is_empty()).then_some(ns)).map_err(|e| {
                if e.errno() == Some(ENOENT) {
                    RbdError::PoolNotFound {
                        pool: pool.to_string(),
                    }
                } else {
                    RbdError::Config(format!("pool {pool:?}: {e}"))
                }
            })?;
        let ctx = Arc::new(ctx);
        Ok(conn
            .ioctxs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(key)
            .or_insert(ctx)
            .clone())
    }

    /// A pool context on the least-loaded connection, for tools and tests (create, remove and
    /// resize images). Blocking.
    pub fn admin(&self, pool: &str, namespace: Option<&str>) -> Result<PoolAdmin, RbdError> {
        let lease = self.shard_set(0).lease_shard();
        let conn = self.connection(0, &lease.0)?;
        let ioctx = self.ioctx(&conn, pool, namespace)?;
        Ok(PoolAdmin {
            ioctx,
            pool: pool.to_string(),
        })
    }

    /// The value of a Ceph option as the first connection sees it (connects if needed).
    pub fn conf_get(&self, option: &str) -> Result<String, RbdError> {
        let shard = self
            .shard_set(0)
            .shards
            .first()
            .cloned()
            .ok_or_else(|| RbdError::Config("no connections configured".into()))?;
        let conn = self.connection(0, &shard)?;
        conn.rados
            .conf_get(option)
            .map_err(|e| RbdError::Config(format!("{option}: {e}")))
    }

    /// Opens an image outside any ANA group (group 0; tools and tests). Blocking.
    pub fn open(self: &Arc<Self>, spec: &ImageSpec) -> Result<RbdDevice, RbdError> {
        self.open_in_group(spec, 0)
    }

    /// Opens an image on one of `group`'s connections (blocking: connects the chosen shard if
    /// needed, then `rbd_open`).
    pub fn open_in_group(
        self: &Arc<Self>,
        spec: &ImageSpec,
        group: u32,
    ) -> Result<RbdDevice, RbdError> {
        self.open_with_stats(spec, group, Arc::default())
    }

    /// The same, counting the device's ops into `stats` (an earlier device's, when reopening).
    pub(super) fn open_with_stats(
        self: &Arc<Self>,
        spec: &ImageSpec,
        group: u32,
        stats: Arc<IoStats>,
    ) -> Result<RbdDevice, RbdError> {
        let started = Instant::now();
        let name = spec.to_string();
        let lease = self.shard_set(group).lease_shard();
        let conn = self.connection(group, &lease.0)?;
        let ioctx = self.ioctx(&conn, &spec.pool, spec.namespace.as_deref())?;
        let image = ffi::Image::open(&ioctx, &spec.image).map_err(|source| {
            if source.errno() == Some(ENOENT) {
                RbdError::ImageNotFound {
                    image: name.clone(),
                }
            } else {
                RbdError::Open {
                    image: name.clone(),
                    source,
                }
            }
        })?;
        let image_err = |what| {
            let name = name.clone();
            move |source| RbdError::Image {
                what,
                image: name,
                source,
            }
        };
        let size = image.size().map_err(image_err("rbd_get_size"))?;
        let object_size = image.object_size().map_err(image_err("rbd_stat"))?;
        let state = Arc::new(DeviceState {
            name: name.clone(),
            image: Arc::new(image),
            size: AtomicU64::new(size),
            object_size,
            sink: Mutex::new(None),
            gate: Arc::new(WriteGate::default()),
            caw_lock: Mutex::new(None),
            client: conn.health.clone(),
            fence_reported: AtomicBool::new(false),
            in_flight: AtomicUsize::new(0),
            ages: Default::default(),
            stats,
        });
        let weak = Arc::downgrade(&state);
        state
            .image
            .update_watch(Box::new(move || notify_update(weak.clone())))
            .map_err(image_err("rbd_update_watch"))?;
        tracing::info!(
            image = %name,
            size,
            object_size,
            group,
            shard = lease.0.index,
            ms = started.elapsed().as_millis() as u64,
            "rbd image open"
        );
        Ok(RbdDevice {
            state,
            _lease: lease,
            pool: self.clone(),
            spec: spec.clone(),
            group,
        })
    }
}

/// A configured, connected `rados_t` for `settings` (blocking): conf file, `$CEPH_ARGS`,
/// keyring, gateway defaults, `args`, `options`, in that order.
pub(crate) fn connect_rados(settings: &CephSettings) -> Result<ffi::Rados, RbdError> {
    let s = settings;
    s.check_files()?;
    let entity = s.entity_name();
    let conf_desc = s
        .conf
        .as_ref()
        .map(|p| p.display().to_string())
        .unwrap_or_else(|| "default search path".into());
    let mut rados = ffi::Rados::create(&s.cluster, &entity).map_err(|e| match e {
        FfiError::Library(_) => RbdError::Library(e),
        other => RbdError::Connect {
            client: entity.clone(),
            conf: conf_desc.clone(),
            source: other,
        },
    })?;
    let conf_path = s.conf.as_ref().map(|p| p.to_string_lossy().into_owned());
    rados
        .conf_read_file(conf_path.as_deref())
        .map_err(|e| RbdError::Config(format!("reading conf {conf_desc}: {e}")))?;
    if s.use_ceph_args_env {
        rados
            .conf_parse_env()
            .map_err(|e| RbdError::Config(format!("CEPH_ARGS: {e}")))?;
    }
    if let Some(k) = &s.keyring {
        rados
            .conf_set("keyring", &k.to_string_lossy())
            .map_err(|e| RbdError::Config(format!("keyring: {e}")))?;
    }
    let defaults: Vec<String> = GATEWAY_DEFAULT_ARGS.iter().map(|a| a.to_string()).collect();
    rados
        .conf_parse_argv(&defaults)
        .map_err(|e| RbdError::Config(format!("gateway defaults: {e}")))?;
    if !s.args.is_empty() {
        let unknown = rados
            .conf_parse_argv(&s.args)
            .map_err(|e| RbdError::Config(format!("args: {e}")))?;
        if !unknown.is_empty() {
            return Err(RbdError::Config(format!(
                "args: not Ceph options: {}",
                unknown.join(" ")
            )));
        }
    }
    for (k, v) in &s.options {
        rados.conf_set(k, v).map_err(|e| {
            RbdError::Config(format!(
                "options.{k}: {}",
                if e.errno() == Some(ENOENT) {
                    "no such Ceph option".to_string()
                } else {
                    e.to_string()
                }
            ))
        })?;
    }
    rados.connect().map_err(|source| RbdError::Connect {
        client: entity,
        conf: conf_desc,
        source,
    })?;
    Ok(rados)
}

/// Image administration on one pool (tests, tools): never used on the I/O path.
pub struct PoolAdmin {
    ioctx: Arc<ffi::IoCtx>,
    pool: String,
}

impl std::fmt::Debug for PoolAdmin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolAdmin")
            .field("pool", &self.pool)
            .finish()
    }
}

impl PoolAdmin {
    pub fn create_image(&self, name: &str, size: u64) -> Result<(), RbdError> {
        self.ioctx
            .create_image(name, size)
            .map_err(|source| RbdError::Image {
                what: "rbd_create",
                image: format!("{}/{name}", self.pool),
                source,
            })
    }

    pub fn remove_image(&self, name: &str) -> Result<(), RbdError> {
        self.ioctx
            .remove_image(name)
            .map_err(|source| RbdError::Image {
                what: "rbd_remove",
                image: format!("{}/{name}", self.pool),
                source,
            })
    }

    /// Moves an image to the pool's RBD trash.
    pub fn trash_image(&self, name: &str) -> Result<(), RbdError> {
        self.ioctx
            .trash_image(name)
            .map_err(|source| RbdError::Image {
                what: "rbd_trash_move",
                image: format!("{}/{name}", self.pool),
                source,
            })
    }

    /// The size of an image in bytes (opens it briefly).
    pub fn image_size(&self, name: &str) -> Result<u64, RbdError> {
        let image = ffi::Image::open(&self.ioctx, name).map_err(|source| RbdError::Image {
            what: "rbd_open",
            image: format!("{}/{name}", self.pool),
            source,
        })?;
        image.size().map_err(|source| RbdError::Image {
            what: "rbd_get_size",
            image: format!("{}/{name}", self.pool),
            source,
        })
    }

    /// Resizes through a separate handle, as `rbd resize` from elsewhere would.
    pub fn resize_image(&self, name: &str, size: u64) -> Result<(), RbdError> {
        let err = |what| {
            let image = format!("{}/{name}", self.pool);
            move |source| RbdError::Image {
                what,
                image,
                source,
            }
        };
        let image = ffi::Image::open(&self.ioctx, name).map_err(err("rbd_open"))?;
        image.resize(size).map_err(err("rbd_resize"))
    }
}

/// Waits until all dropped images are closed (their exclusive locks released), up to
/// `timeout`; returns whether they all were. Call before the process exits: an image left
/// open keeps its exclusive lock until the watch times out (~30 s), stalling the next writer.
pub fn wait_for_closes(timeout: Duration) -> bool {
    ffi::wait_for_closes(timeout)
}
