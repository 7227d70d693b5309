//! NVM subsystems and their namespaces.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};

use rbd_backend::BlockDevice;

use super::auth::HostKeys;
use super::controller::{Controller, TeardownReason};
use super::pr::{Notice, Reservations};
use super::qos::NamespaceQos;
use super::visibility::{NamespaceTable, Visibility};
use crate::spec::{ana, cntlid};

/// One namespace: a block device with the identity the host sees.
pub struct Namespace {
    pub nsid: u32,
    pub device: Arc<dyn BlockDevice>,
    /// log2 of the LBA size (9 for 512 bytes, 12 for 4096).
    pub lba_shift: u8,
    /// Stable identity, identical on every gateway and unique per namespace: the Linux host
    /// joins paths by it and drops namespaces whose IDs collide.
    pub nguid: [u8; 16],
    pub uuid: [u8; 16],
    pub ana_group: u32,
    pub read_only: bool,
    /// QoS limits, shared by the namespace's every queue and changed in place (live); a
    /// namespace re-registered on another device or ANA group keeps them.
    pub qos: Arc<NamespaceQos>,
    /// Auto-resize off: the size the namespace keeps whatever its device grows to. Shared
    /// and changed in place as `qos` is (the control plane pushes it with the namespace).
    pub frozen_size: Arc<FrozenSize>,
}

impl Namespace {
    pub fn lba_size(&self) -> u64 {
        1 << self.lba_shift
    }

    /// The size hosts see in bytes: the device's, or with auto-resize off at most the frozen
    /// size (an image grown by `rbd resize` stays hidden beyond it).
    pub fn size_bytes(&self) -> u64 {
        let device = self.device.size_bytes();
        match self.frozen_size.get() {
            Some(frozen) => device.min(frozen),
            None => device,
        }
    }

    /// Size in logical blocks, rounded down: Identify's NSZE and the end of the LBA range
    /// I/O may address.
    pub fn size_in_lbas(&self) -> u64 {
        self.size_bytes() >> self.lba_shift
    }
}

/// A namespace's frozen size in bytes (ceph-nvmeof's auto-resize off), or none: the
/// namespace follows its device. One atomic, read on every I/O range check and changed
/// live by [`FrozenSize::set`].
#[derive(Debug, Default)]
pub struct FrozenSize(AtomicU64);

impl FrozenSize {
    /// None or 0: no frozen size.
    pub fn new(bytes: Option<u64>) -> Self {
        Self(AtomicU64::new(bytes.unwrap_or(0)))
    }

    pub fn get(&self) -> Option<u64> {
        Some(self.0.load(Ordering::Relaxed)).filter(|b| *b != 0)
    }

    /// Sets (None: clears) the frozen size. Returns whether it changed.
    pub fn set(&self, bytes: Option<u64>) -> bool {
        self.0.swap(bytes.unwrap_or(0), Ordering::Relaxed) != bytes.unwrap_or(0)
    }
}

impl std::fmt::Debug for Namespace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Namespace")
            .field("nsid", &self.nsid)
            .field("device", &self.device.name())
            .field("lba_shift", &self.lba_shift)
            .finish_non_exhaustive()
    }
}

/// Whether a subsystem serves I/O or discovery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SubsystemKind {
    Nvm,
    Discovery,
}

/// Which hosts may connect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostAccess {
    AnyHost,
    Only(BTreeSet<String>),
}

impl HostAccess {
    pub fn allows(&self, hostnqn: &str) -> bool {
        match self {
            HostAccess::AnyHost => true,
            HostAccess::Only(hosts) => hosts.contains(hostnqn),
        }
    }
}

/// Static description of a subsystem, from configuration.
#[derive(Debug, Clone)]
pub struct SubsystemSpec {
    pub nqn: String,
    pub serial: String,
    pub model: String,
    pub access: HostAccess,
    /// Controller IDs this gateway hands out. Gateways of one group get disjoint ranges so a
    /// host never sees the same CNTLID twice in one subsystem.
    pub cntlid_min: u16,
    pub cntlid_max: u16,
}

/// An NVM subsystem (or the discovery subsystem).
pub struct Subsystem {
    pub kind: SubsystemKind,
    pub spec: SubsystemSpec,
    /// The namespaces, with the hosts each is visible to (see `core::visibility`).
    namespaces: RwLock<NamespaceTable>,
    controllers: Mutex<BTreeMap<u16, Weak<Controller>>>,
    next_cntlid: Mutex<u16>,
    /// ANA group states as seen through this gateway's ports.
    ana_groups: RwLock<BTreeMap<u32, u8>>,
    /// Bumped on every ANA change, reported in the ANA log page.
    ana_change_count: AtomicU64,
    /// The hosts allowed now: `spec.access` at start, replaced by [`Self::set_access`]
    /// (`nvmeofctl host add/del` on a running gateway).
    access: RwLock<HostAccess>,
    /// DH-HMAC-CHAP keys of the allowed hosts that must authenticate, by host NQN.
    host_keys: RwLock<BTreeMap<String, Arc<HostKeys>>>,
    /// Every namespace's reservations.
    pub reservations: Reservations,
    /// Secure channels: the hosts' PSKs and whether TLS is required.
    pub tls: super::tls::SubsystemTls,
}

impl std::fmt::Debug for Subsystem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Subsystem")
            .field("nqn", &self.spec.nqn)
            .field("kind", &self.kind)
            .finish_non_exhaustive()
    }
}

/// Why a controller could not be allocated.
#[derive(Debug, PartialEq, Eq)]
pub struct NoFreeControllerId;

impl Subsystem {
    pub fn new(kind: SubsystemKind, spec: SubsystemSpec) -> Self {
        let first = spec.cntlid_min.max(cntlid::MIN);
        Self {
            access: RwLock::new(spec.access.clone()),
            kind,
            spec,
            namespaces: RwLock::new(NamespaceTable::default()),
            controllers: Mutex::new(BTreeMap::new()),
            next_cntlid: Mutex::new(first),
            ana_groups: RwLock::new(BTreeMap::new()),
            ana_change_count: AtomicU64::new(1),
            host_keys: RwLock::new(BTreeMap::new()),
            reservations: Reservations::default(),
            tls: Default::default(),
        }
    }

    /// Replaces the hosts' DH-HMAC-CHAP keys. Connected hosts keep their controllers; their
    /// next (re-)authentication uses the new keys.
    pub fn set_host_keys(&self, keys: BTreeMap<String, Arc<HostKeys>>) {
        *self.host_keys.write().unwrap_or_else(|e| e.into_inner()) = keys;
    }

    /// Every host's keys, by host NQN (what [`Self::set_host_keys`] last set).
    pub fn all_host_keys(&self) -> BTreeMap<String, Arc<HostKeys>> {
        self.host_keys
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The keys `hostnqn` must authenticate with here, if any. The discovery subsystem asks
    /// no host to authenticate.
    pub fn host_keys(&self, hostnqn: &str) -> Option<Arc<HostKeys>> {
        if self.is_discovery() {
            return None;
        }
        self.host_keys
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(hostnqn)
            .cloned()
    }

    pub fn nqn(&self) -> &str {
        &self.spec.nqn
    }

    pub fn is_discovery(&self) -> bool {
        self.kind == SubsystemKind::Discovery
    }

    /// Adds a namespace; its ANA group starts optimized unless it already has a state.
    pub fn add_namespace(&self, ns: Arc<Namespace>) {
        self.ana_groups
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .entry(ns.ana_group)
            .or_insert(ana::OPTIMIZED);
        self.namespaces
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .by_nsid
            .insert(ns.nsid, ns);
    }

    /// Takes a namespace out (`nvmeofctl namespace del`): new commands for it fail with
    /// Invalid Namespace; commands already in flight hold their own reference, so its device
    /// is closed when the last of them finishes and the caller drops the returned one. The
    /// caller tells the hosts ([`Self::notify_namespace_changed`]: the hosts it was visible
    /// to, so its visibility stays until it is set again).
    pub fn remove_namespace(&self, nsid: u32) -> Option<Arc<Namespace>> {
        let gone = self
            .namespaces
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .by_nsid
            .remove(&nsid);
        if gone.is_some() {
            self.reservations.forget(nsid);
        }
        gone
    }

    /// The hosts allowed to connect now.
    pub fn access(&self) -> HostAccess {
        self.access
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Whether `hostnqn` may connect now (Connect, the discovery log).
    pub fn allows_host(&self, hostnqn: &str) -> bool {
        self.access
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .allows(hostnqn)
    }

    /// Replaces the allowed hosts (`nvmeofctl host add/del`): new Connects are checked against
    /// the new list at once. Controllers of hosts no longer allowed are torn down (their
    /// connections close), as ceph-nvmeof does, rather than kept until they reconnect as
    /// Linux nvmet does: removing a host is how an admin revokes its access, and a host whose
    /// keep-alive goes on would otherwise read and write for as long as it stays connected.
    /// Returns the controllers torn down.
    pub fn set_access(&self, access: HostAccess) -> Vec<Arc<Controller>> {
        *self.access.write().unwrap_or_else(|e| e.into_inner()) = access.clone();
        let revoked: Vec<_> = self
            .controllers()
            .into_iter()
            .filter(|c| !access.allows(&c.hostnqn))
            .collect();
        for c in &revoked {
            c.teardown(TeardownReason::HostRemoved);
        }
        revoked
    }

    /// Sets whether hosts must connect over TLS (`require_tls`): new Connects are checked
    /// against it at once. When it turns on, the controllers with a queue that came without
    /// TLS are torn down (their connections close), as for a removed host: the admin asked
    /// that no data cross the network in clear, and a host left connected would go on doing
    /// so for as long as its keep-alive runs. Its reconnects are refused (`tls_required`)
    /// until it connects through a secure listener. Returns the controllers torn down.
    pub fn set_tls_required(&self, required: bool) -> Vec<Arc<Controller>> {
        let was = self.tls.required();
        self.tls.set_required(required);
        if !required || was {
            return Vec::new();
        }
        let plain: Vec<_> = self
            .controllers()
            .into_iter()
            .filter(|c| !c.is_secure())
            .collect();
        for c in &plain {
            c.teardown(TeardownReason::TlsRequired);
        }
        plain
    }

    /// Namespace `nsid`, whichever hosts it is visible to (the gateway's own bookkeeping;
    /// commands of a host use [`Self::namespace_for_host`]).
    pub fn namespace(&self, nsid: u32) -> Option<Arc<Namespace>> {
        self.namespace_table().by_nsid.get(&nsid).cloned()
    }

    /// All namespaces, in NSID order, whichever hosts they are visible to.
    pub fn namespaces(&self) -> Vec<Arc<Namespace>> {
        self.namespace_table().by_nsid.values().cloned().collect()
    }

    pub(super) fn namespace_table(&self) -> std::sync::RwLockReadGuard<'_, NamespaceTable> {
        self.namespaces.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Namespace `nsid` if it is active for `hostnqn`: it exists and is visible to that host.
    /// An invisible namespace is an inactive NSID to the host (Identify, I/O, log pages).
    pub fn namespace_for_host(&self, nsid: u32, hostnqn: &str) -> Option<Arc<Namespace>> {
        self.namespace_table()
            .active_for_host(nsid, hostnqn)
            .cloned()
    }

    /// Whether namespace `nsid` is (or would be, once added) visible to `hostnqn`.
    pub fn is_visible_to(&self, nsid: u32, hostnqn: &str) -> bool {
        self.namespace_table().visible_to(nsid, hostnqn)
    }

    /// The active NSIDs for `hostnqn` above `after`, at most `limit`, in order.
    pub fn active_nsids_for_host(&self, hostnqn: &str, after: u32, limit: usize) -> Vec<u32> {
        self.namespace_table()
            .active_nsids_for_host(hostnqn, after, limit)
    }

    /// The hosts namespace `nsid` is visible to.
    pub fn visibility(&self, nsid: u32) -> Visibility {
        self.namespace_table().visibility(nsid)
    }

    /// Makes namespace `nsid` visible to `visibility`'s hosts (it need not exist yet: set
    /// before [`Self::add_namespace`], no host sees it before it should). The controllers
    /// whose view of an existing namespace changes get Namespace Attribute Changed with the
    /// NSID in their Changed Namespace List, as for a namespace attached to or detached from
    /// them; the others get nothing. Returns the controllers told.
    pub fn set_visibility(&self, nsid: u32, visibility: Visibility) -> Vec<Arc<Controller>> {
        let (exists, before) = {
            let mut table = self.namespaces.write().unwrap_or_else(|e| e.into_inner());
            let before = table.visibility(nsid);
            if before == visibility {
                return Vec::new();
            }
            table.set_visibility(nsid, visibility.clone());
            (table.by_nsid.contains_key(&nsid), before)
        };
        if !exists {
            return Vec::new();
        }
        let affected: Vec<_> = self
            .controllers()
            .into_iter()
            .filter(|c| before.includes(&c.hostnqn) != visibility.includes(&c.hostnqn))
            .collect();
        for ctrl in &affected {
            ctrl.notify_namespace_changed(nsid);
        }
        affected
    }

    /// The highest NSID this subsystem may hold (Identify Controller NN).
    pub fn max_namespaces(&self) -> u32 {
        1024
    }

    pub fn ana_state(&self, group: u32) -> u8 {
        self.ana_groups
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&group)
            .copied()
            .unwrap_or(ana::INACCESSIBLE)
    }

    /// Group ID → state, in group order.
    pub fn ana_groups(&self) -> Vec<(u32, u8)> {
        self.ana_groups
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|(g, s)| (*g, *s))
            .collect()
    }

    pub fn ana_change_count(&self) -> u64 {
        self.ana_change_count.load(Ordering::SeqCst)
    }

    /// Changes one group's state and tells every live controller.
    pub fn set_ana_state(&self, group: u32, state: u8) {
        let changed = {
            let mut groups = self.ana_groups.write().unwrap_or_else(|e| e.into_inner());
            groups.insert(group, state) != Some(state)
        };
        if changed {
            self.ana_change_count.fetch_add(1, Ordering::SeqCst);
            for ctrl in self.controllers() {
                ctrl.notify_ana_change();
            }
        }
    }

    /// Allocates the next free controller ID in this gateway's range and registers the
    /// controller built for it.
    pub fn register_controller(
        &self,
        build: impl FnOnce(u16) -> Arc<Controller>,
    ) -> Result<Arc<Controller>, NoFreeControllerId> {
        let mut controllers = self.controllers.lock().unwrap_or_else(|e| e.into_inner());
        controllers.retain(|_, c| c.strong_count() > 0);
        let min = self.spec.cntlid_min.max(cntlid::MIN);
        let max = self.spec.cntlid_max.min(cntlid::MAX);
        let span = u32::from(max.saturating_sub(min)) + 1;
        let mut next = self.next_cntlid.lock().unwrap_or_else(|e| e.into_inner());
        for _ in 0..span {
            let candidate = if *next < min || *next > max {
                min
            } else {
                *next
            };
            *next = if candidate >= max { min } else { candidate + 1 };
            if let std::collections::btree_map::Entry::Vacant(slot) = controllers.entry(candidate) {
                let ctrl = build(candidate);
                slot.insert(Arc::downgrade(&ctrl));
                return Ok(ctrl);
            }
        }
        Err(NoFreeControllerId)
    }

    pub fn controller(&self, cntlid: u16) -> Option<Arc<Controller>> {
        self.controllers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&cntlid)
            .and_then(Weak::upgrade)
    }

    pub fn controllers(&self) -> Vec<Arc<Controller>> {
        self.controllers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .filter_map(Weak::upgrade)
            .collect()
    }

    /// Delivers reservation notices for `nsid` to every controller of each host named.
    pub fn notify_reservation(&self, nsid: u32, notices: &[Notice]) {
        if notices.is_empty() {
            return;
        }
        for ctrl in self.controllers() {
            for notice in notices.iter().filter(|n| n.host == ctrl.hostid) {
                ctrl.notify_reservation(notice.kind, nsid);
            }
        }
    }

    pub fn remove_controller(&self, cntlid: u16) {
        self.controllers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&cntlid);
    }

    /// Tells every controller the namespace is visible to that it changed (added, removed,
    /// resized); hosts it is hidden from never learn of it.
    pub fn notify_namespace_changed(&self, nsid: u32) {
        for ctrl in self.controllers() {
            if self.is_visible_to(nsid, &ctrl.hostnqn) {
                ctrl.notify_namespace_changed(nsid);
            }
        }
    }
}
