//! Where the group state lives and how the cluster is acted on: [`Backend`] (RADOS in
//! production, [`RadosBackend`]; an in-process one for the server's own unit tests,
//! [`MemoryBackend`]) and [`Store`], the read / compare-and-set update loop over it.
//!
//! Every method blocks: call them from `spawn_blocking`.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rbd_backend::rados::{self, Client, Pool, RadosError};
use rbd_backend::rbd::CephSettings;

use crate::state::{ConfigError, GroupState, Omap};

#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    #[error("group state: {0}")]
    Rados(#[from] RadosError),
    #[error("group state changed concurrently {0} times in a row; try again")]
    Contended(u32),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("{0}")]
    Other(String),
    #[error(transparent)]
    Image(#[from] ImageError),
}

/// Why an image could not be created or removed (`namespace add --create-image`, `namespace
/// del --delete-image`), each with what the operator must fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ImageError {
    #[error("pool {0:?} not found (create it: ceph osd pool create {0}; rbd pool init {0})")]
    NoPool(String),
    #[error("image {0} already exists (add it without --create-image, or pick another name)")]
    Exists(String),
    #[error("image {0} not found")]
    NotFound(String),
    #[error("no space for image {0}: the pool's quota or the cluster is full ({1})")]
    NoSpace(String, String),
    #[error("image {0} is still open (watched) by a client; try again when no gateway or other client has it open")]
    Busy(String),
    #[error("image {0}: {1}")]
    Other(String, String),
}

impl ImageError {
    /// From librbd's answer for `spec` (`pool[/namespace]/image`).
    pub fn from_rbd(spec: &str, pool: &str, e: &rbd_backend::RbdError) -> ImageError {
        use rbd_backend::RbdError;
        // Linux errno values (asm-generic/errno-base.h, errno.h).
        const ENOENT: i32 = 2;
        const EBUSY: i32 = 16;
        const EEXIST: i32 = 17;
        const ENOSPC: i32 = 28;
        const EDQUOT: i32 = 122;
        match e {
            RbdError::PoolNotFound { .. } => ImageError::NoPool(pool.to_string()),
            RbdError::Connect { source, .. } if source.errno() == Some(ENOENT) => {
                ImageError::NoPool(pool.to_string())
            }
            RbdError::Image { source, .. } | RbdError::Open { source, .. } => {
                match source.errno() {
                    Some(EEXIST) => ImageError::Exists(spec.to_string()),
                    Some(ENOENT) => ImageError::NotFound(spec.to_string()),
                    Some(ENOSPC) | Some(EDQUOT) => {
                        ImageError::NoSpace(spec.to_string(), source.to_string())
                    }
                    Some(EBUSY) => ImageError::Busy(spec.to_string()),
                    _ => ImageError::Other(spec.to_string(), e.to_string()),
                }
            }
            RbdError::ImageNotFound { .. } => ImageError::NotFound(spec.to_string()),
            other => ImageError::Other(spec.to_string(), other.to_string()),
        }
    }
}

/// `pool/image` or `pool/namespace/image`.
pub fn image_spec(pool: &str, namespace: &str, image: &str) -> String {
    if namespace.is_empty() {
        format!("{pool}/{image}")
    } else {
        format!("{pool}/{namespace}/{image}")
    }
}

/// A registration that ends when dropped (a RADOS watch).
pub trait Guard: Send + Sync {}
impl<T: Send + Sync> Guard for T {}

/// A watcher's callback: `Some(payload)` per notify, None when the watch broke.
pub type OnChange = Box<dyn Fn(Option<Vec<u8>>) + Send + Sync>;

/// The state object and the cluster operations the control plane needs.
pub trait Backend: Send + Sync + 'static {
    /// The state object's omap (empty when it does not exist yet).
    fn read(&self) -> Result<Omap, StoreError>;
    /// Writes `set`/`remove` and `version = expect + 1` if `version` is still `expect`
    /// (0: absent). `Ok(false)`: it was not (nothing written).
    fn compare_and_set(
        &self,
        expect: u64,
        set: Vec<(String, Vec<u8>)>,
        remove: Vec<String>,
    ) -> Result<bool, StoreError>;
    /// Wakes every watcher with `payload` (best effort).
    fn notify(&self, payload: &[u8]);
    /// Calls `on_change` (on some library thread; it must not block) after every notify with
    /// its payload, and with None when the watch breaks (the state must then be re-read).
    fn watch(&self, on_change: OnChange) -> Result<Box<dyn Guard>, StoreError>;
    /// Takes or renews the leader lease for `id`. `Ok(false)`: another replica holds it.
    fn lead(&self, id: &str, lease: Duration) -> Result<bool, StoreError>;
    /// Blocklists every address, then refreshes this client's osdmap.
    fn fence(&self, addrs: &[String]) -> Result<(), StoreError>;
    /// Asks the OSDs `ids` for their version, waiting at most `wait` (blocking): those that
    /// did not answer. `Ok(None)`: no cluster connection to ask through.
    fn probe_osds(&self, ids: &[i32], wait: Duration) -> Result<Option<Vec<i32>>, StoreError>;
    /// Whether an RBD image exists.
    fn image_exists(&self, pool: &str, namespace: &str, image: &str) -> Result<bool, StoreError>;
    /// Grows an RBD image to `size` bytes; returns the old size. Shrinking is refused.
    fn grow_image(
        &self,
        pool: &str,
        namespace: &str,
        image: &str,
        size: u64,
    ) -> Result<u64, StoreError>;
    /// Creates an RBD image of `size` bytes; refused ([`ImageError::Exists`]) if it exists.
    fn create_image(
        &self,
        pool: &str,
        namespace: &str,
        image: &str,
        size: u64,
    ) -> Result<(), StoreError>;
    /// Removes an RBD image; [`ImageError::Busy`] while a client has it open.
    fn remove_image(&self, pool: &str, namespace: &str, image: &str) -> Result<(), StoreError>;
    /// Moves an RBD image to its pool's trash; [`ImageError::Busy`] while a client has it
    /// open.
    fn trash_image(&self, pool: &str, namespace: &str, image: &str) -> Result<(), StoreError>;
    /// An RBD image's size in bytes ([`ImageError::NotFound`] when it does not exist).
    fn image_size(&self, pool: &str, namespace: &str, image: &str) -> Result<u64, StoreError>;
}

/// How long a fence blocklists a client: long enough to outlive any fenced process (a
/// restarted gateway has new client addresses).
pub const BLOCKLIST_EXPIRE: Duration = Duration::from_secs(24 * 3600);

/// The RADOS object `nvmeof.<group>.state` in a pool.
pub struct RadosBackend {
    settings: CephSettings,
    /// Image connections, opened on the first resize.
    images: std::sync::OnceLock<Arc<rbd_backend::ClusterPool>>,
    client: Client,
    pool: Pool,
    pool_name: String,
    oid: String,
}

impl RadosBackend {
    /// Connects and makes sure the state object exists (so it can be watched).
    pub fn connect(
        settings: &CephSettings,
        pool: &str,
        group: &str,
    ) -> Result<RadosBackend, StoreError> {
        let client = Client::connect(settings)?;
        let p = client.pool(pool, None)?;
        let oid = format!("nvmeof.{group}.state");
        p.omap_compare_and_set(&oid, &[], &[], &[])?;
        Ok(RadosBackend {
            settings: settings.clone(),
            images: std::sync::OnceLock::new(),
            client,
            pool: p,
            pool_name: pool.to_string(),
            oid,
        })
    }

    pub fn oid(&self) -> &str {
        &self.oid
    }

    /// Image administration on `pool` (connections opened on first use).
    fn image_admin(
        &self,
        pool: &str,
        namespace: &str,
        spec: &str,
    ) -> Result<rbd_backend::rbd::PoolAdmin, StoreError> {
        let images = self
            .images
            .get_or_init(|| rbd_backend::ClusterPool::new(self.settings.clone()));
        images
            .admin(pool, (!namespace.is_empty()).then_some(namespace))
            .map_err(|e| ImageError::from_rbd(spec, pool, &e).into())
    }
}

fn version_bytes(v: u64) -> Vec<u8> {
    if v == 0 {
        Vec::new()
    } else {
        v.to_string().into_bytes()
    }
}

/// Why a grow to the image's own size is refused ([`ConfigError::Invalid`]'s `why`): callers
/// for which that is no change (the ceph-nvmeof API's resize) tell it from a shrink by it.
pub const SIZE_UNCHANGED: &str = "is the image's size already";

fn refuse_shrink(image: String, old: u64, size: u64) -> StoreError {
    StoreError::Config(ConfigError::Invalid {
        what: "size",
        value: format!("{size} for {image} (now {old} bytes)"),
        why: if size == old {
            SIZE_UNCHANGED
        } else {
            "is smaller than the image (namespaces only grow)"
        },
    })
}

impl Backend for RadosBackend {
    fn read(&self) -> Result<Omap, StoreError> {
        match self.pool.omap_get_all(&self.oid) {
            Ok(m) => Ok(m),
            Err(RadosError::NotFound(_)) => Ok(Omap::new()),
            Err(e) => Err(e.into()),
        }
    }

    fn compare_and_set(
        &self,
        expect: u64,
        mut set: Vec<(String, Vec<u8>)>,
        remove: Vec<String>,
    ) -> Result<bool, StoreError> {
        set.push(("version".into(), version_bytes(expect + 1)));
        match self.pool.omap_compare_and_set(
            &self.oid,
            &[("version".into(), version_bytes(expect))],
            &set,
            &remove,
        ) {
            Ok(()) => Ok(true),
            Err(RadosError::CompareFailed(_)) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    fn notify(&self, payload: &[u8]) {
        if let Err(e) = self.pool.notify(&self.oid, payload, Duration::from_secs(2)) {
            tracing::debug!("notify {}: {e}", self.oid);
        }
    }

    fn watch(&self, on_change: OnChange) -> Result<Box<dyn Guard>, StoreError> {
        let w = self.pool.watch(&self.oid, move |e| match e {
            rados::WatchEvent::Notify(payload) => on_change(Some(payload)),
            rados::WatchEvent::Error(errno) => {
                tracing::warn!(errno, "state watch broke; re-reading");
                on_change(None);
            }
        })?;
        Ok(Box::new(w))
    }

    fn lead(&self, id: &str, lease: Duration) -> Result<bool, StoreError> {
        match self
            .pool
            .lock_lease(&self.oid, "leader", id, "nvmeof-control leader", lease)
        {
            Ok(()) => Ok(true),
            Err(RadosError::LockBusy { .. }) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    fn fence(&self, addrs: &[String]) -> Result<(), StoreError> {
        // All at once: one osdmap commit for all of them (one by one, each after the first
        // waited up to the monitor's propose interval, ~1 s).
        for status in self
            .client
            .blocklist_add_all(addrs, Some(BLOCKLIST_EXPIRE))?
        {
            tracing::warn!("blocklisted: {status}");
        }
        // A few ms: the survivor refreshes its own clients' osdmaps before it turns the group
        // optimized (what keeps the fenced writer out); this one keeps the replica's view
        // current for whatever it reads next.
        self.client.wait_for_latest_osdmap()?;
        Ok(())
    }

    fn probe_osds(&self, ids: &[i32], wait: Duration) -> Result<Option<Vec<i32>>, StoreError> {
        Ok(rbd_backend::osd_probe::probe_these_osds(ids, wait)?.map(|p| p.unanswered))
    }

    fn grow_image(
        &self,
        pool: &str,
        namespace: &str,
        image: &str,
        size: u64,
    ) -> Result<u64, StoreError> {
        let images = self
            .images
            .get_or_init(|| rbd_backend::ClusterPool::new(self.settings.clone()));
        let admin = images
            .admin(pool, (!namespace.is_empty()).then_some(namespace))
            .map_err(|e| StoreError::Other(e.to_string()))?;
        let old = admin
            .image_size(image)
            .map_err(|e| StoreError::Other(e.to_string()))?;
        if size <= old {
            return Err(refuse_shrink(image.to_string(), old, size));
        }
        admin
            .resize_image(image, size)
            .map_err(|e| StoreError::Other(e.to_string()))?;
        Ok(old)
    }

    fn create_image(
        &self,
        pool: &str,
        namespace: &str,
        image: &str,
        size: u64,
    ) -> Result<(), StoreError> {
        let spec = image_spec(pool, namespace, image);
        let admin = self.image_admin(pool, namespace, &spec)?;
        admin
            .create_image(image, size)
            .map_err(|e| ImageError::from_rbd(&spec, pool, &e).into())
    }

    fn remove_image(&self, pool: &str, namespace: &str, image: &str) -> Result<(), StoreError> {
        let spec = image_spec(pool, namespace, image);
        let admin = self.image_admin(pool, namespace, &spec)?;
        admin
            .remove_image(image)
            .map_err(|e| ImageError::from_rbd(&spec, pool, &e).into())
    }

    fn trash_image(&self, pool: &str, namespace: &str, image: &str) -> Result<(), StoreError> {
        let spec = image_spec(pool, namespace, image);
        let admin = self.image_admin(pool, namespace, &spec)?;
        admin
            .trash_image(image)
            .map_err(|e| ImageError::from_rbd(&spec, pool, &e).into())
    }

    fn image_size(&self, pool: &str, namespace: &str, image: &str) -> Result<u64, StoreError> {
        let spec = image_spec(pool, namespace, image);
        let admin = self.image_admin(pool, namespace, &spec)?;
        admin
            .image_size(image)
            .map_err(|e| ImageError::from_rbd(&spec, pool, &e).into())
    }

    fn image_exists(&self, pool: &str, namespace: &str, image: &str) -> Result<bool, StoreError> {
        let p = if pool == self.pool_name && namespace.is_empty() {
            self.pool.clone()
        } else {
            match self
                .client
                .pool(pool, (!namespace.is_empty()).then_some(namespace))
            {
                Ok(p) => p,
                Err(RadosError::Connect(rbd_backend::RbdError::PoolNotFound { .. })) => {
                    return Ok(false)
                }
                Err(e) => return Err(e.into()),
            }
        };
        // A format-2 image has its `rbd_id.<name>` object.
        match p.omap_get_all(&format!("rbd_id.{image}")) {
            Ok(_) => Ok(true),
            Err(RadosError::NotFound(_)) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }
}

type Watcher = Arc<dyn Fn(Option<Vec<u8>>) + Send + Sync>;

/// An in-process backend for unit tests of the server (the RADOS backend is tested against
/// a real cluster).
#[derive(Default)]
pub struct MemoryBackend {
    omap: Mutex<Omap>,
    watchers: Mutex<Vec<Watcher>>,
    /// Full reads of the omap (`read`), so tests can tell an update that re-read from one
    /// that started from the cached state.
    pub reads: std::sync::atomic::AtomicU64,
    lease: Mutex<Option<(String, Instant)>>,
    pub fenced: Mutex<Vec<String>>,
    pub images: Mutex<BTreeSet<String>>,
    /// Image sizes for `grow_image` (absent: 1 GiB).
    pub sizes: Mutex<std::collections::BTreeMap<String, u64>>,
    /// Pools `create_image` finds (empty: every pool exists).
    pub pools: Mutex<BTreeSet<String>>,
    /// Images `remove_image` finds open by a client.
    pub busy_images: Mutex<BTreeSet<String>>,
    /// Images `trash_image` moved to the trash.
    pub trashed: Mutex<BTreeSet<String>>,
    /// The OSDs that do not answer this replica (`probe_osds`); None: it has no cluster
    /// connection to ask through.
    pub osds_unanswered: Mutex<Option<Vec<i32>>>,
    /// While set, writes (`compare_and_set`) wait, as on a cluster whose state object's PG
    /// does not take writes.
    pub writes_stalled: std::sync::atomic::AtomicBool,
}

impl Backend for MemoryBackend {
    fn read(&self) -> Result<Omap, StoreError> {
        self.reads
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(self.omap.lock().unwrap_or_else(|e| e.into_inner()).clone())
    }

    fn compare_and_set(
        &self,
        expect: u64,
        set: Vec<(String, Vec<u8>)>,
        remove: Vec<String>,
    ) -> Result<bool, StoreError> {
        while self
            .writes_stalled
            .load(std::sync::atomic::Ordering::SeqCst)
        {
            std::thread::sleep(Duration::from_millis(5));
        }
        let mut m = self.omap.lock().unwrap_or_else(|e| e.into_inner());
        if m.get("version").cloned().unwrap_or_default() != version_bytes(expect) {
            return Ok(false);
        }
        for (k, v) in set {
            m.insert(k, v);
        }
        for k in remove {
            m.remove(&k);
        }
        m.insert("version".into(), version_bytes(expect + 1));
        Ok(true)
    }

    fn notify(&self, payload: &[u8]) {
        let w = self
            .watchers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        for f in w {
            f(Some(payload.to_vec()));
        }
    }

    fn watch(&self, on_change: OnChange) -> Result<Box<dyn Guard>, StoreError> {
        self.watchers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(Arc::from(on_change));
        Ok(Box::new(()))
    }

    fn lead(&self, id: &str, lease: Duration) -> Result<bool, StoreError> {
        let mut l = self.lease.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        match l.as_ref() {
            Some((holder, until)) if holder != id && *until > now => Ok(false),
            _ => {
                *l = Some((id.to_string(), now + lease));
                Ok(true)
            }
        }
    }

    fn fence(&self, addrs: &[String]) -> Result<(), StoreError> {
        self.fenced
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend(addrs.iter().cloned());
        Ok(())
    }

    fn probe_osds(&self, ids: &[i32], _wait: Duration) -> Result<Option<Vec<i32>>, StoreError> {
        Ok(self
            .osds_unanswered
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(|none_answer| {
                ids.iter()
                    .copied()
                    .filter(|i| none_answer.contains(i))
                    .collect()
            }))
    }

    fn grow_image(
        &self,
        pool: &str,
        namespace: &str,
        image: &str,
        size: u64,
    ) -> Result<u64, StoreError> {
        let spec = if namespace.is_empty() {
            format!("{pool}/{image}")
        } else {
            format!("{pool}/{namespace}/{image}")
        };
        let mut sizes = self.sizes.lock().unwrap_or_else(|e| e.into_inner());
        let old = sizes.get(&spec).copied().unwrap_or(1 << 30);
        if size <= old {
            return Err(refuse_shrink(spec, old, size));
        }
        sizes.insert(spec, size);
        Ok(old)
    }

    fn create_image(
        &self,
        pool: &str,
        namespace: &str,
        image: &str,
        size: u64,
    ) -> Result<(), StoreError> {
        let spec = image_spec(pool, namespace, image);
        let pools = self.pools.lock().unwrap_or_else(|e| e.into_inner());
        if !pools.is_empty() && !pools.contains(pool) {
            return Err(ImageError::NoPool(pool.to_string()).into());
        }
        drop(pools);
        let mut images = self.images.lock().unwrap_or_else(|e| e.into_inner());
        if !images.insert(spec.clone()) {
            return Err(ImageError::Exists(spec).into());
        }
        self.sizes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(spec, size);
        Ok(())
    }

    fn remove_image(&self, pool: &str, namespace: &str, image: &str) -> Result<(), StoreError> {
        let spec = image_spec(pool, namespace, image);
        if self
            .busy_images
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(&spec)
        {
            return Err(ImageError::Busy(spec).into());
        }
        if !self
            .images
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&spec)
        {
            return Err(ImageError::NotFound(spec).into());
        }
        Ok(())
    }

    fn trash_image(&self, pool: &str, namespace: &str, image: &str) -> Result<(), StoreError> {
        self.remove_image(pool, namespace, image)?;
        self.trashed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(image_spec(pool, namespace, image));
        Ok(())
    }

    fn image_size(&self, pool: &str, namespace: &str, image: &str) -> Result<u64, StoreError> {
        let spec = image_spec(pool, namespace, image);
        if !self.image_exists(pool, namespace, image)? {
            return Err(ImageError::NotFound(spec).into());
        }
        Ok(self
            .sizes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&spec)
            .copied()
            .unwrap_or(1 << 30))
    }

    fn image_exists(&self, pool: &str, namespace: &str, image: &str) -> Result<bool, StoreError> {
        let spec = if namespace.is_empty() {
            format!("{pool}/{image}")
        } else {
            format!("{pool}/{namespace}/{image}")
        };
        Ok(self
            .images
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(&spec))
    }
}

/// Compare-and-set retries before giving up.
const MAX_ATTEMPTS: u32 = 32;

/// The state store: reads and atomic read-modify-write updates.
#[derive(Clone)]
pub struct Store {
    backend: Arc<dyn Backend>,
}

impl Store {
    pub fn new(backend: Arc<dyn Backend>) -> Store {
        Store { backend }
    }

    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    pub fn load(&self) -> Result<GroupState, StoreError> {
        Ok(GroupState::from_omap(&self.backend.read()?)?)
    }

    /// Applies `change` to the current state and writes the difference if the state did not
    /// change meanwhile (else re-reads and tries again). A refused change writes nothing.
    /// Returns the change's result and the state after it.
    pub fn update<T>(
        &self,
        change: impl FnMut(&mut GroupState) -> Result<T, ConfigError>,
    ) -> Result<(T, GroupState), StoreError> {
        self.update_from(|| None, change)
    }

    /// [`Store::update`] starting from `cached` (a state this replica read or wrote, with
    /// its version) instead of reading the whole object: the compare-and-set on `version`
    /// refuses the write if the object moved past it, and then `cached` is asked again (it
    /// may have caught up meanwhile) or, when it has not, the object is re-read. A state at
    /// a given version is always the same state (every write bumps `version` in the same
    /// atomic operation), so a write from a current cache is exactly a write from a fresh
    /// read; a stale one never lands.
    pub fn update_from<T>(
        &self,
        mut cached: impl FnMut() -> Option<Arc<GroupState>>,
        mut change: impl FnMut(&mut GroupState) -> Result<T, ConfigError>,
    ) -> Result<(T, GroupState), StoreError> {
        let mut refused_at: Option<u64> = None;
        for _ in 0..MAX_ATTEMPTS {
            let old = match cached() {
                Some(c) if refused_at.is_none_or(|v| c.version > v) => c,
                _ => Arc::new(self.load()?),
            };
            let mut new = GroupState::clone(&old);
            let out = change(&mut new)?;
            let (set, remove) = new.diff(&old);
            if set.is_empty() && remove.is_empty() {
                return Ok((out, new));
            }
            let note = Delta::note(old.version, &set, &remove);
            if self.backend.compare_and_set(old.version, set, remove)? {
                new.version = old.version + 1;
                // A notify waits for every watcher's ack, up to its timeout for a dead one
                // (a killed replica stays a watcher for a while): never on the caller's path.
                let backend = self.backend.clone();
                if let Err(e) = std::thread::Builder::new()
                    .name("state-notify".into())
                    .spawn(move || backend.notify(&note))
                {
                    tracing::warn!("cannot notify the state change: {e}");
                }
                return Ok((out, new));
            }
            tracing::debug!(
                version = old.version,
                "state changed concurrently; retrying"
            );
            refused_at = Some(refused_at.map_or(old.version, |v| v.max(old.version)));
        }
        Err(StoreError::Contended(MAX_ATTEMPTS))
    }
}

/// Largest notify payload that carries the change itself; a bigger change (a batch) is
/// announced by its versions only and watchers re-read the object.
const MAX_DELTA_NOTE: usize = 64 * 1024;

/// The payload of a state notify: the write that took the state from version `from` to
/// `to`, so a watcher at `from` applies it instead of re-reading the whole object. Watchers
/// that cannot use it (another version, no `set`, or an older writer's `changed`) re-read.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Delta {
    pub from: u64,
    pub to: u64,
    /// None: too big to carry; re-read.
    pub set: Option<Vec<(String, String)>>,
    #[serde(default)]
    pub remove: Vec<String>,
}

impl Delta {
    fn note(from: u64, set: &[(String, Vec<u8>)], remove: &[String]) -> Vec<u8> {
        let size: usize = set.iter().map(|(k, v)| k.len() + v.len()).sum::<usize>()
            + remove.iter().map(String::len).sum::<usize>();
        let text: Option<Vec<(String, String)>> = if size <= MAX_DELTA_NOTE {
            set.iter()
                .map(|(k, v)| Some((k.clone(), String::from_utf8(v.clone()).ok()?)))
                .collect()
        } else {
            None
        };
        let delta = Delta {
            from,
            to: from + 1,
            remove: if text.is_some() {
                remove.to_vec()
            } else {
                Vec::new()
            },
            set: text,
        };
        serde_json::to_vec(&delta).unwrap_or_default()
    }

    /// Decodes a notify payload; None for anything else (an older writer's `changed`).
    pub fn parse(payload: &[u8]) -> Option<Delta> {
        serde_json::from_slice(payload).ok()
    }

    /// The state after this write, when `st` is the state it was made from.
    pub fn applied_to(&self, st: &GroupState) -> Option<Result<GroupState, ConfigError>> {
        let set = self.set.as_ref()?;
        if st.version != self.from {
            return None;
        }
        let set: Vec<(String, Vec<u8>)> = set
            .iter()
            .map(|(k, v)| (k.clone(), v.clone().into_bytes()))
            .collect();
        let mut next = st.clone();
        Some(next.apply(&set, &self.remove).map(|()| {
            next.version = self.to;
            next
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn concurrent_updates_all_land() {
        let store = Store::new(Arc::new(MemoryBackend::default()));
        std::thread::scope(|s| {
            for t in 0..4 {
                let store = store.clone();
                s.spawn(move || {
                    for i in 0..10 {
                        store
                            .update(|st| {
                                st.add_subsystem(
                                    &format!("nqn.2016-06.io.test:t{t}-{i}"),
                                    "",
                                    true,
                                    0,
                                )
                            })
                            .expect("update");
                    }
                });
            }
        });
        let st = store.load().expect("load");
        assert_eq!(st.subsystems.len(), 40);
        assert_eq!(st.version, 40);
    }

    fn add(store: &Store, cached: Option<Arc<GroupState>>, name: &str) -> GroupState {
        store
            .update_from(
                || cached.clone(),
                |st| st.add_subsystem(&format!("nqn.2016-06.io.test:{name}"), "", true, 0),
            )
            .expect("update")
            .1
    }

    #[test]
    fn an_update_from_a_current_cache_reads_nothing_and_a_stale_one_never_lands() {
        let backend = Arc::new(MemoryBackend::default());
        let store = Store::new(backend.clone());
        let reads = || backend.reads.load(std::sync::atomic::Ordering::Relaxed);
        let v1 = add(&store, None, "a");
        assert_eq!(reads(), 1);
        // From the state it wrote: no read.
        let v2 = add(&store, Some(Arc::new(v1.clone())), "b");
        assert_eq!((reads(), v2.version), (1, 2));
        // From a stale state (version 1, before "b"): the compare-and-set refuses it, the
        // object is re-read and "b" is kept.
        let v3 = add(&store, Some(Arc::new(v1)), "c");
        assert_eq!((reads(), v3.version), (2, 3));
        let stored = store.load().expect("load");
        assert_eq!(stored, v3);
        assert_eq!(stored.subsystems.len(), 3);
    }

    #[test]
    fn a_notified_delta_rebuilds_the_written_state() {
        let backend = Arc::new(MemoryBackend::default());
        let notes = Arc::new(Mutex::new(Vec::new()));
        let n = notes.clone();
        let _guard = backend
            .watch(Box::new(move |p| {
                n.lock().expect("notes").push(p);
            }))
            .expect("watch");
        let store = Store::new(backend.clone());
        let mut follower = store.load().expect("load");
        type Write = Box<dyn Fn(&mut GroupState) -> Result<(), ConfigError>>;
        let writes: Vec<Write> = vec![
            Box::new(|st| st.add_subsystem("nqn.2016-06.io.test:x/y", "", false, 0)),
            Box::new(|st| st.add_host("nqn.2016-06.io.test:x/y", "nqn.2016-06.io.test:h%2F")),
            Box::new(|st| st.del_host("nqn.2016-06.io.test:x/y", "nqn.2016-06.io.test:h%2F")),
            Box::new(|st| st.del_subsystem("nqn.2016-06.io.test:x/y", true)),
        ];
        for w in writes {
            store.update(&w).expect("write");
            // The notify is sent from a thread of its own.
            let started = Instant::now();
            let note = loop {
                if let Some(p) = notes.lock().expect("notes").pop() {
                    break p;
                }
                assert!(started.elapsed() < Duration::from_secs(5), "no notify");
                std::thread::sleep(Duration::from_millis(1));
            };
            let delta = Delta::parse(&note.expect("payload")).expect("a delta");
            follower = delta
                .applied_to(&follower)
                .expect("applies to its base")
                .expect("decodes");
            assert_eq!(follower, store.load().expect("load"));
            // Not to another version.
            assert!(delta.applied_to(&follower).is_none());
        }
    }

    #[test]
    fn a_refused_change_writes_nothing() {
        let store = Store::new(Arc::new(MemoryBackend::default()));
        store
            .update(|st| st.add_subsystem("nqn.2016-06.io.test:a", "", true, 0))
            .expect("add");
        let r = store.update(|st| st.add_subsystem("nqn.2016-06.io.test:a", "", true, 0));
        assert!(matches!(
            r,
            Err(StoreError::Config(ConfigError::SubsystemExists(_)))
        ));
        assert_eq!(store.load().expect("load").version, 1);
    }
}
