//! Ceph RBD images as [`BlockDevice`]s: cluster connections shared by a bounded number of
//! images, and [`RbdDevice`], which turns [`IoOp`]s into `rbd_aio_*` calls.
//!
//! # Threads
//! - [`ClusterPool::open`] blocks (connect, `rbd_open`): call it from a blocking thread or at
//!   start-up. It takes no lock that I/O of open images needs, and connecting a new shard holds
//!   only that shard's lock.
//! - [`RbdDevice::submit`] never waits for the cluster: librbd dispatches the op on the
//!   calling thread down to the messenger's queue (`rbd_non_blocking_aio=false`, without the
//!   Objecter throttle, see [`GATEWAY_DEFAULT_ARGS`]) and returns; the completion runs on a
//!   librados callback thread, which calls
//!   [`IoCompletion::complete`] directly. Reads land directly in the op's buffer. Writes pass
//!   a small non-blocking gate that orders them against emulated compare-and-writes (see
//!   [`WriteGate`]); compare-and-write beyond one 512-byte sector runs on an `rbd-caw` thread.
//! - Resize notifications (`rbd_update_watch`) arrive on a librbd thread, which must not call
//!   librbd synchronously; they are forwarded to one `rbd-events` thread that reads the new
//!   size and reports [`DeviceEvent::Resized`].
//! - Dropping a device closes its image on an `rbd-close` thread; [`wait_for_closes`] waits.
//!
//! # Sharding
//! A [`ClusterPool`] has up to `max_connections` `rados_t` handles (each with its own messenger
//! threads). A new image goes to the shard with the fewest open images, connecting that shard
//! on first use, so with N images and C connections every connection serves at most
//! ceil(N / C) images. One context shared by every image roughly halves IOPS on many-core
//! machines (spdk #2580, ceph-nvmeof #939); one per image costs threads and memory. Measured
//! here (micro cluster, 2 vCPUs): an idle connection ~8 MiB RSS and 12 threads; an open image
//! ~0.35 MiB before I/O, ~1 MiB after, 0.6 threads. Default: one connection per CPU, at most 8.
//!
//! # Defaults
//! Before the user's `args`/`options`, the gateway sets `rbd_cache=false` (writes are
//! acknowledged durable; FUA = write + flush stays correct either way),
//! `client_mount_timeout=30`, inline dispatch and no Objecter throttle (see
//! [`GATEWAY_DEFAULT_ARGS`]).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use crate::device::{
    BlockDevice, DeviceEvent, DeviceEventSink, IoCompletion, IoDone, IoError, IoOp,
};
use crate::ffi::{self, AioAction, AioRequest, FfiError};
use crate::stats::{IoStats, IoStatsSnapshot};

pub use crate::ffi::versions as library_versions;

/// The largest aligned range librbd 16.2 compare-and-writes natively.
const CAW_SECTOR: u64 = 512;

const ENOENT: i32 = 2;
const EIO: i32 = 5;
const EINVAL: i32 = 22;
const EROFS: i32 = 30;
const EILSEQ: i32 = 84;
const ESHUTDOWN: i32 = 108; // EBLOCKLISTED
const ETIMEDOUT: i32 = 110;

/// How the gateway connects to Ceph: the settings Ceph users know from `rbd`/`ceph` CLIs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CephSettings {
    /// Cluster name (`ceph`): selects `/etc/ceph/$cluster.conf` when `conf` is unset.
    pub cluster: String,
    /// Entity name, `client.admin` or just `admin`.
    pub client_name: String,
    /// ceph.conf path; `None`: `$CEPH_CONF`, then Ceph's default search list.
    pub conf: Option<PathBuf>,
    /// Keyring path; `None`: whatever the conf file (or `$CEPH_KEYRING`) says.
    pub keyring: Option<PathBuf>,
    /// Whether to apply `$CEPH_ARGS` from the environment (after the conf file).
    pub use_ceph_args_env: bool,
    /// CEPH_ARGS-style options, applied after the environment: `["--rados_osd_op_timeout=30"]`.
    pub args: Vec<String>,
    /// `option = value` overrides, applied last (`rados_conf_set`).
    pub options: Vec<(String, String)>,
    /// Upper bound of cluster connections (`rados_t`) images are spread over; at least 1.
    pub max_connections: usize,
}

impl Default for CephSettings {
    fn default() -> Self {
        Self {
            cluster: "ceph".into(),
            client_name: "client.admin".into(),
            conf: None,
            keyring: None,
            use_ceph_args_env: true,
            args: Vec::new(),
            options: Vec::new(),
            max_connections: default_connections(),
        }
    }
}

/// One connection per core (the runtime runs one worker per core), at most 8.
pub fn default_connections() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .clamp(1, 8)
}

/// Options the gateway sets before the user's `args`/`options`, which may override them.
/// - `rbd_cache=false`: the gateway acknowledges writes to hosts that expect them durable
///   after Flush/FUA; librbd's write-back cache would only add a copy (and with several
///   gateways in a group, stale reads).
/// - `client_mount_timeout=30`: a dead cluster fails start-up in 30 s, not 300 s.
/// - `rbd_non_blocking_aio=false`: librbd dispatches an op on the calling thread instead of
///   posting it to its `io_context_pool` thread first (librbd's QueueImageDispatch layer).
///   That post is one thread wake-up per I/O, which on a busy machine is a large part of the
///   latency the gateway adds; measured at 4K: context switches per I/O of the gateway
///   process 8.1 -> 7.2 (QD1 read), 8.2 -> 5.0 (QD1 write), 1.9 -> 1.4 (QD16 read). The
///   option exists for applications whose submitting thread must not wait; in librbd 16.2
///   every layer below it (exclusive lock, refresh, QoS, scheduler) queues and continues
///   asynchronously, so the one place the caller could still wait is the next option.
/// - `objecter_inflight_ops=0`, `objecter_inflight_op_bytes=0`: no Objecter throttle (0 =
///   unlimited). librados sets a balanced budget, so an op beyond 1024 ops / 100 MiB in
///   flight on one connection would make the submitting thread (with the option above: a
///   runtime worker) sleep until others complete. The gateway's own bound is the hosts'
///   queues: every op's buffer is allocated before it is submitted, so the throttle bounded
///   no memory, it only moved the wait into a thread that serves other queues.
///
/// Left at librbd's default on purpose: `rbd_disable_zero_copy_writes` (true: `rbd_aio_write`
/// copies the caller's buffer). Turned off, librbd holds a completion back until it has let go
/// of the caller's buffer, and in 16.2 some completions then never come: with it,
/// `rbd-backend/tests/ceph.rs` `compare_and_write_match_and_mismatch` and
/// `a_fence_of_one_ana_group_leaves_the_other_working` wait forever for an op. The copy it
/// saves (4 KiB per write) was not measurable at QD16 (gateway CPU per write 35.0 vs 35.3 us).
pub const GATEWAY_DEFAULT_ARGS: &[&str] = &[
    "--rbd_cache=false",
    "--client_mount_timeout=30",
    "--rbd_non_blocking_aio=false",
    "--objecter_inflight_ops=0",
    "--objecter_inflight_op_bytes=0",
];

impl CephSettings {
    /// `client.X` for `X` or `client.X`.
    pub fn entity_name(&self) -> String {
        if self.client_name.contains('.') {
            self.client_name.clone()
        } else {
            format!("client.{}", self.client_name)
        }
    }
}

/// Which image a namespace serves.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ImageSpec {
    pub pool: String,
    /// RADOS namespace inside the pool; `None` or empty: the default namespace.
    pub namespace: Option<String>,
    pub image: String,
}

impl std::fmt::Display for ImageSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.namespace.as_deref().filter(|n| !n.is_empty()) {
            Some(ns) => write!(f, "{}/{}/{}", self.pool, ns, self.image),
            None => write!(f, "{}/{}", self.pool, self.image),
        }
    }
}

/// Why a cluster or image could not be used.
#[derive(Debug, Clone, thiserror::Error)]
pub enum RbdError {
    #[error(transparent)]
    Library(FfiError),
    #[error("ceph configuration: {0}")]
    Config(String),
    #[error("cannot connect to the Ceph cluster as {client} (conf {conf}): {source}")]
    Connect {
        client: String,
        conf: String,
        source: FfiError,
    },
    #[error("pool {pool:?} not found")]
    PoolNotFound { pool: String },
    #[error("image {image} not found")]
    ImageNotFound { image: String },
    #[error("cannot open image {image}: {source}")]
    Open { image: String, source: FfiError },
    #[error(
        "image {image}: rbd_open did not finish within {secs} s (cluster slow or an OSD down)"
    )]
    OpenTimedOut { image: String, secs: u64 },
    #[error("{what} on image {image}: {source}")]
    Image {
        what: &'static str,
        image: String,
        source: FfiError,
    },
}

// ------------------------------------------------------------------ connections

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
    group: u32,
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
    fn mark_blocklisted(&self) -> bool {
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
struct ShardLease(Arc<Shard>);

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
                return Err(e);
            }
        };
        *self.last_failure.lock().unwrap_or_else(|e| e.into_inner()) = None;
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
            stats: IoStats::default(),
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

// ------------------------------------------------------------------ resize events

/// The shared state of an open image (what in-flight requests hold on to).
pub struct DeviceState {
    name: String,
    image: Arc<ffi::Image>,
    size: AtomicU64,
    object_size: u64,
    sink: Mutex<Option<Arc<dyn DeviceEventSink>>>,
    gate: Arc<WriteGate>,
    /// Whether this handle holds the exclusive lock in exclusive mode (taken for the first
    /// emulated compare-and-write); `Some(false)`: the image has no exclusive-lock feature.
    caw_lock: Mutex<Option<bool>>,
    /// The cluster connection the image is open on.
    client: Arc<ClientHealth>,
    /// Whether the fence was reported to the sink already (once per device).
    fence_reported: AtomicBool,
    /// Ops handed to librbd (or queued behind the write gate) and not completed yet.
    in_flight: AtomicUsize,
    /// Every op's outcome, recorded just before its completion is delivered.
    stats: IoStats,
}

impl DeviceState {
    /// Counts the op and hands its result to the caller.
    fn deliver(
        &self,
        started: Instant,
        completion: &Arc<dyn IoCompletion>,
        tag: u64,
        op: IoOp,
        result: Result<(), IoError>,
    ) {
        self.stats.record(&op, started, &result);
        completion.complete(IoDone { tag, op, result });
    }

    /// The connection was blocklisted: mark it (no op goes through it again) and tell the
    /// sink once, so the gateway reports the path inaccessible.
    fn fenced(&self) {
        if self.client.mark_blocklisted() {
            tracing::error!(
                image = %self.name,
                group = self.client.group,
                "the cluster blocklisted this gateway's client for the ANA group (fenced): \
                 no more I/O through it until the group is given back on a fresh client"
            );
        }
        if !self.fence_reported.swap(true, Ordering::SeqCst) {
            let sink = self.sink.lock().unwrap_or_else(|e| e.into_inner()).clone();
            if let Some(sink) = sink {
                sink.device_event(DeviceEvent::Fenced);
            }
        }
    }

    /// Re-reads the size (blocking) and reports a change.
    fn refresh_size(&self) {
        let new_size = match self.image.size() {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(image = %self.name, "cannot read the size after an update: {e}");
                return;
            }
        };
        let old = self.size.swap(new_size, Ordering::SeqCst);
        if old == new_size {
            return;
        }
        tracing::info!(image = %self.name, old, new_size, "rbd image resized");
        let sink = self.sink.lock().unwrap_or_else(|e| e.into_inner()).clone();
        if let Some(sink) = sink {
            sink.device_event(DeviceEvent::Resized { new_size });
        }
    }
}

/// Runs on a librbd thread: only queues the work.
fn notify_update(state: Weak<DeviceState>) {
    let tx = EVENTS.get_or_init(start_event_thread);
    if let Some(tx) = tx {
        if let Ok(tx) = tx.lock() {
            let _ = tx.send(state);
        }
    }
}

static EVENTS: OnceLock<Option<Mutex<mpsc::Sender<Weak<DeviceState>>>>> = OnceLock::new();

fn start_event_thread() -> Option<Mutex<mpsc::Sender<Weak<DeviceState>>>> {
    let (tx, rx) = mpsc::channel::<Weak<DeviceState>>();
    let spawned = std::thread::Builder::new()
        .name("rbd-events".into())
        .spawn(move || {
            while let Ok(state) = rx.recv() {
                if let Some(state) = state.upgrade() {
                    state.refresh_size();
                }
            }
        });
    match spawned {
        Ok(_) => Some(Mutex::new(tx)),
        Err(e) => {
            tracing::error!("cannot start the rbd-events thread ({e}); resizes go unnoticed");
            None
        }
    }
}

// ------------------------------------------------------------------ the device

/// An open RBD image serving one namespace.
pub struct RbdDevice {
    state: Arc<DeviceState>,
    _lease: ShardLease,
    pool: Arc<ClusterPool>,
    spec: ImageSpec,
    group: u32,
}

impl std::fmt::Debug for RbdDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RbdDevice")
            .field("image", &self.state.name)
            .field("size", &self.size_bytes())
            .finish()
    }
}

impl RbdDevice {
    /// The RADOS object size of the image.
    pub fn object_size(&self) -> u64 {
        self.state.object_size
    }

    /// The image this device serves.
    pub fn spec(&self) -> &ImageSpec {
        &self.spec
    }

    /// The ANA group whose connections the image is open on.
    pub fn group(&self) -> u32 {
        self.group
    }

    /// The connection the image is open on.
    pub fn client(&self) -> &Arc<ClientHealth> {
        &self.state.client
    }

    /// Opens the same image again on `group`'s current connections (blocking): after
    /// [`ClusterPool::retire_group`] that is a fresh client; after a namespace moved to
    /// another ANA group, that group's clients.
    pub fn reopen_in_group(&self, group: u32) -> Result<RbdDevice, RbdError> {
        self.pool.open_in_group(&self.spec, group)
    }

    /// Re-reads the size from the cluster now (blocking), reporting a change like a watch
    /// notification would.
    pub fn refresh_size(&self) {
        self.state.refresh_size();
    }

    /// Checks that can fail before librbd sees the op.
    fn precheck(&self, op: &IoOp) -> Result<(), IoError> {
        let size = self.size_bytes();
        let range = |offset: u64, len: u64| match offset.checked_add(len) {
            Some(end) if end <= size => Ok(()),
            _ => Err(IoError::OutOfRange { offset, len, size }),
        };
        match op {
            IoOp::Read { offset, buf } | IoOp::Write { offset, buf, .. } => {
                range(*offset, buf.len() as u64)
            }
            IoOp::Flush => Ok(()),
            IoOp::Discard { offset, len } | IoOp::WriteZeroes { offset, len } => {
                range(*offset, *len)
            }
            IoOp::CompareAndWrite {
                offset,
                compare,
                write,
            } => {
                if compare.len() != write.len() {
                    return Err(IoError::Device(format!(
                        "compare ({}) and write ({}) lengths differ",
                        compare.len(),
                        write.len()
                    )));
                }
                range(*offset, write.len() as u64)?;
                Ok(())
            }
        }
    }
}

/// Maps librbd's result for `req` to the op's result.
fn op_result(req: &AioRequest, rv: i64) -> Result<(), IoError> {
    if rv >= 0 {
        if let IoOp::Read { buf, .. } = &req.op {
            if req.action == AioAction::Op && rv as u64 != buf.len() as u64 {
                return Err(IoError::Device(format!(
                    "rbd_aio_read returned {rv} of {} bytes",
                    buf.len()
                )));
            }
        }
        return Ok(());
    }
    let errno = i32::try_from(rv.saturating_neg()).unwrap_or(EIO);
    let what = match (&req.op, req.action) {
        (_, AioAction::Flush) | (IoOp::Flush, _) => "flush",
        (IoOp::Read { .. }, _) => "read",
        (IoOp::Write { .. }, _) => "write",
        (IoOp::Discard { .. }, _) => "discard",
        (IoOp::WriteZeroes { .. }, _) => "write zeroes",
        (IoOp::CompareAndWrite { .. }, _) => "compare-and-write",
    };
    Err(match (&req.op, errno) {
        (IoOp::CompareAndWrite { offset, write, .. }, EILSEQ) => IoError::Miscompare {
            offset_in_range: mismatch_in_range(req.mismatch_off, *offset, write.len() as u64),
        },
        (_, EROFS) => IoError::ReadOnly,
        (_, ESHUTDOWN) => IoError::Fenced(format!(
            "{what}: this client was blocklisted by the cluster (errno {errno})"
        )),
        (_, ETIMEDOUT) => IoError::Device(format!(
            "{what}: the cluster did not answer in time (rados_osd_op_timeout; errno {errno})"
        )),
        (_, EINVAL) => IoError::Device(format!(
            "{what}: librbd refused the request (errno {errno})"
        )),
        _ => IoError::Device(format!("{what}: {} (errno {errno})", ffi::strerror(errno))),
    })
}

/// librbd 16.2 reports the mismatch relative to the request (seen: 100 for a difference at
/// byte 100 of a compare at image offset 65536); later releases may report the image offset.
/// Accept both: a value inside `offset..offset+len` is an image offset.
fn mismatch_in_range(mismatch_off: u64, offset: u64, len: u64) -> u64 {
    if mismatch_off >= offset && mismatch_off - offset < len && mismatch_off >= len {
        mismatch_off - offset
    } else {
        mismatch_off.min(len.saturating_sub(1))
    }
}

/// Completion of one librbd request, on the librbd callback thread.
fn on_aio_done(mut req: Box<AioRequest>, rv: i64) {
    let result = op_result(&req, rv);
    if matches!(result, Err(IoError::Fenced(_))) {
        // Before the host hears of it: the path is reported inaccessible first.
        req.device.fenced();
    }
    if result.is_ok()
        && req.action == AioAction::Op
        && matches!(req.op, IoOp::Write { fua: true, .. })
    {
        // FUA: the write is done; make it durable before completing. (With rbd_cache=false
        // an acknowledged write is already on the OSDs and this flush returns at once.)
        req.action = AioAction::Flush;
        match ffi::submit(req) {
            Ok(()) => return,
            Err((r, e)) => {
                req = r;
                let err = match e.errno() {
                    Some(ESHUTDOWN) => {
                        req.device.fenced();
                        IoError::Fenced(format!("FUA flush: {e}"))
                    }
                    _ => IoError::Device(format!("FUA flush: {e}")),
                };
                return finish(req, Err(err));
            }
        }
    }
    if let Err(e) = &result {
        if !matches!(e, IoError::Miscompare { .. }) {
            tracing::debug!(tag = req.tag, error = %e, "rbd request failed");
        }
    }
    finish(req, result);
}

#[allow(clippy::boxed_local)] // the request arrives boxed from librbd
fn finish(req: Box<AioRequest>, result: Result<(), IoError>) {
    let AioRequest {
        tag,
        op,
        completion,
        gate,
        device,
        started,
        ..
    } = *req;
    device.deliver(started, &completion, tag, op, result);
    device.in_flight.fetch_sub(1, Ordering::SeqCst);
    if let Some(gate) = gate {
        gate.write_done();
    }
}

/// Hands a request to librbd; a request librbd refuses completes with the error.
fn start(req: Box<AioRequest>) {
    if req.device.client.is_blocklisted() {
        // Queued behind the gate before the fence was seen: never sent.
        req.device.fenced();
        return finish(req, Err(IoError::Fenced("client blocklisted".into())));
    }
    if let Err((req, e)) = ffi::submit(req) {
        tracing::warn!(tag = req.tag, "cannot start an rbd request: {e}");
        let err = match e.errno() {
            Some(ESHUTDOWN) => {
                req.device.fenced();
                IoError::Fenced(e.to_string())
            }
            _ => IoError::Device(e.to_string()),
        };
        finish(req, Err(err));
    }
}

// ------------------------------------------------------------------ compare-and-write

/// Whether librbd 16.2 does this compare-and-write itself: `rbd_aio_compare_and_write` is
/// atomic on the OSD (cmpext + write in one RADOS transaction) but refuses (-EINVAL) any
/// range with `offset % 512 + len > 512`.
fn native_compare_and_write(offset: u64, len: u64) -> bool {
    offset % CAW_SECTOR + len <= CAW_SECTOR
}

/// Orders writes against emulated compare-and-writes on one device.
///
/// A compare-and-write that librbd 16.2 cannot do natively (more than one 512-byte sector,
/// e.g. one 4 KiB block) is done as read, compare, write, and is atomic because:
/// - against other clients: the device first takes the image's exclusive lock in exclusive
///   mode (`rbd_lock_acquire`) and keeps it until the image is closed. librbd then refuses to
///   hand the lock to another client, whose writes fail (EROFS) instead of interleaving.
///   (An image without the exclusive-lock feature has no such guard; this is logged once and
///   the compare-and-write is then atomic only against I/O through this gateway.)
/// - against this gateway's own I/O: this gate. Writes (write, discard, write zeroes, native
///   compare-and-write) count themselves in while no emulated compare-and-write runs; an
///   emulated one starts only when no write is in flight, and writes arriving meanwhile queue
///   behind it in arrival order. Reads and flushes are not gated.
///
/// Nothing here blocks the submitting thread: queued ops are started by whichever completion
/// opens the gate. The read-compare-write itself runs on an `rbd-caw` thread (one per running
/// compare-and-write; at most one per device at a time) with synchronous librbd calls.
#[derive(Default)]
pub struct WriteGate {
    state: Mutex<GateState>,
}

#[derive(Default)]
struct GateState {
    writes_in_flight: usize,
    caw_running: bool,
    queue: std::collections::VecDeque<Queued>,
}

enum Queued {
    Write(Box<AioRequest>),
    Caw(CawJob),
}

struct CawJob {
    state: Arc<DeviceState>,
    started: Instant,
    tag: u64,
    op: IoOp,
    completion: Arc<dyn IoCompletion>,
}

impl WriteGate {
    fn lock(&self) -> std::sync::MutexGuard<'_, GateState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Returns the request if it may start now; otherwise it is queued.
    fn admit_write(&self, req: Box<AioRequest>) -> Option<Box<AioRequest>> {
        let mut g = self.lock();
        if g.caw_running || !g.queue.is_empty() {
            g.queue.push_back(Queued::Write(req));
            return None;
        }
        g.writes_in_flight += 1;
        Some(req)
    }

    fn admit_caw(&self, job: CawJob) -> Option<CawJob> {
        let mut g = self.lock();
        if g.caw_running || g.writes_in_flight > 0 || !g.queue.is_empty() {
            g.queue.push_back(Queued::Caw(job));
            return None;
        }
        g.caw_running = true;
        Some(job)
    }

    fn write_done(&self) {
        let ready = {
            let mut g = self.lock();
            g.writes_in_flight = g.writes_in_flight.saturating_sub(1);
            Self::pump(&mut g)
        };
        Self::run(ready);
    }

    fn caw_done(&self) {
        let ready = {
            let mut g = self.lock();
            g.caw_running = false;
            Self::pump(&mut g)
        };
        Self::run(ready);
    }

    /// Takes from the queue what may start now (in order), marking it started.
    fn pump(g: &mut GateState) -> Vec<Queued> {
        let mut ready = Vec::new();
        while let Some(front) = g.queue.front() {
            match front {
                Queued::Write(_) if !g.caw_running => {
                    g.writes_in_flight += 1;
                }
                Queued::Caw(_) if !g.caw_running && g.writes_in_flight == 0 => {
                    g.caw_running = true;
                }
                _ => break,
            }
            if let Some(q) = g.queue.pop_front() {
                ready.push(q);
            }
        }
        ready
    }

    /// Starts what `pump` released, outside the lock (a failed start completes at once and
    /// may come back here).
    fn run(ready: Vec<Queued>) {
        for q in ready {
            match q {
                Queued::Write(req) => start(req),
                Queued::Caw(job) => spawn_caw(job),
            }
        }
    }
}

fn spawn_caw(job: CawJob) {
    // The closure owns the job; if the spawn fails it is dropped with the closure, so the
    // op is completed from a guard instead.
    struct Guard(Option<CawJob>);
    impl Drop for Guard {
        fn drop(&mut self) {
            if let Some(job) = self.0.take() {
                let gate = job.state.gate.clone();
                job.state.deliver(
                    job.started,
                    &job.completion,
                    job.tag,
                    job.op,
                    Err(IoError::Device(
                        "compare-and-write: could not start its worker thread".into(),
                    )),
                );
                job.state.in_flight.fetch_sub(1, Ordering::SeqCst);
                gate.caw_done();
            }
        }
    }
    let mut guard = Guard(Some(job));
    let spawned = std::thread::Builder::new()
        .name("rbd-caw".into())
        .spawn(move || {
            if let Some(job) = guard.0.take() {
                let CawJob {
                    state,
                    started,
                    tag,
                    mut op,
                    completion,
                } = job;
                let result = if state.client.is_blocklisted() {
                    Err(IoError::Fenced("client blocklisted".into()))
                } else {
                    emulate_compare_and_write(&state, &mut op)
                };
                if matches!(result, Err(IoError::Fenced(_))) {
                    state.fenced();
                }
                state.deliver(started, &completion, tag, op, result);
                state.in_flight.fetch_sub(1, Ordering::SeqCst);
                state.gate.caw_done();
            }
        });
    if let Err(e) = spawned {
        tracing::error!("cannot spawn an rbd-caw thread: {e}");
    }
}

/// Read, compare, write, with the gate closed (see [`WriteGate`]). Blocking.
fn emulate_compare_and_write(state: &DeviceState, op: &mut IoOp) -> Result<(), IoError> {
    let IoOp::CompareAndWrite {
        offset,
        compare,
        write,
    } = op
    else {
        return Err(IoError::Device("not a compare-and-write".into()));
    };
    {
        let mut lock = state.caw_lock.lock().unwrap_or_else(|e| e.into_inner());
        if lock.is_none() {
            match state.image.acquire_exclusive_lock() {
                Ok(()) => {
                    tracing::info!(
                        image = %state.name,
                        "took the exclusive lock for multi-sector compare-and-write (held until the image closes; other clients' writes get EROFS)"
                    );
                    *lock = Some(true);
                }
                Err(e) if e.errno() == Some(EINVAL) => {
                    tracing::warn!(
                        image = %state.name,
                        "image has no exclusive-lock feature: multi-sector compare-and-write is atomic only against I/O through this gateway"
                    );
                    *lock = Some(false);
                }
                Err(e) => {
                    return Err(IoError::Device(format!(
                        "compare-and-write: cannot take the exclusive lock: {e}"
                    )));
                }
            }
        }
    }
    let mut current = vec![0u8; compare.len()];
    let n = state
        .image
        .read_blocking(*offset, &mut current)
        .map_err(|e| match e.errno() {
            Some(ESHUTDOWN) => IoError::Fenced(format!("compare-and-write (read): {e}")),
            _ => IoError::Device(format!("compare-and-write (read): {e}")),
        })?;
    if n != current.len() {
        return Err(IoError::Device(format!(
            "compare-and-write (read): {n} of {} bytes",
            current.len()
        )));
    }
    if let Some(i) = current
        .iter()
        .zip(compare.as_slice())
        .position(|(a, b)| a != b)
    {
        return Err(IoError::Miscompare {
            offset_in_range: i as u64,
        });
    }
    let n = state
        .image
        .write_blocking(*offset, write.as_slice())
        .map_err(|e| match e.errno() {
            Some(EROFS) => IoError::ReadOnly,
            Some(ESHUTDOWN) => IoError::Fenced(format!("compare-and-write (write): {e}")),
            _ => IoError::Device(format!("compare-and-write (write): {e}")),
        })?;
    if n != write.len() {
        return Err(IoError::Device(format!(
            "compare-and-write (write): {n} of {} bytes",
            write.len()
        )));
    }
    Ok(())
}

impl BlockDevice for RbdDevice {
    fn name(&self) -> &str {
        &self.state.name
    }

    fn size_bytes(&self) -> u64 {
        self.state.size.load(Ordering::SeqCst)
    }

    fn submit(&self, tag: u64, op: IoOp, completion: &Arc<dyn IoCompletion>) {
        let started = Instant::now();
        if self.state.client.is_blocklisted() {
            // Fenced: nothing goes through this client again, not even a read.
            self.state.fenced();
            return self.state.deliver(
                started,
                completion,
                tag,
                op,
                Err(IoError::Fenced("client blocklisted".into())),
            );
        }
        if let Err(e) = self.precheck(&op) {
            return self.state.deliver(started, completion, tag, op, Err(e));
        }
        let empty = match &op {
            IoOp::Read { buf, .. } | IoOp::Write { buf, .. } => buf.is_empty(),
            IoOp::Discard { len, .. } | IoOp::WriteZeroes { len, .. } => *len == 0,
            IoOp::CompareAndWrite { write, .. } => write.is_empty(),
            IoOp::Flush => false,
        };
        if empty {
            return self.state.deliver(started, completion, tag, op, Ok(()));
        }
        // Counted down when the completion has been delivered (`finish`, the caw worker).
        self.state.in_flight.fetch_add(1, Ordering::SeqCst);
        if let IoOp::CompareAndWrite { offset, write, .. } = &op {
            if !native_compare_and_write(*offset, write.len() as u64) {
                let job = CawJob {
                    state: self.state.clone(),
                    started,
                    tag,
                    op,
                    completion: completion.clone(),
                };
                if let Some(job) = self.state.gate.admit_caw(job) {
                    spawn_caw(job);
                }
                return;
            }
        }
        let is_write = matches!(
            op,
            IoOp::Write { .. }
                | IoOp::Discard { .. }
                | IoOp::WriteZeroes { .. }
                | IoOp::CompareAndWrite { .. }
        );
        let req = Box::new(AioRequest {
            image: self.state.image.clone(),
            tag,
            op,
            completion: completion.clone(),
            action: AioAction::Op,
            mismatch_off: 0,
            on_done: on_aio_done,
            gate: is_write.then(|| self.state.gate.clone()),
            device: self.state.clone(),
            started,
        });
        if is_write {
            if let Some(req) = self.state.gate.admit_write(req) {
                start(req);
            }
        } else {
            start(req);
        }
    }

    fn set_event_sink(&self, sink: Arc<dyn DeviceEventSink>) {
        *self.state.sink.lock().unwrap_or_else(|e| e.into_inner()) = Some(sink);
    }

    fn in_flight(&self) -> usize {
        self.state.in_flight.load(Ordering::SeqCst)
    }

    fn io_stats(&self) -> Option<IoStatsSnapshot> {
        Some(self.state.stats.snapshot())
    }

    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
