//! The target: every subsystem this gateway serves, and the ports it listens on.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use super::auth::{AuthCounters, AuthPolicy};
use super::controller::TeardownReason;
use super::refusals::ConnectRefusals;
use super::subsystem::{HostAccess, Subsystem, SubsystemKind, SubsystemSpec};
use crate::spec::{cntlid, DISCOVERY_NQN};

/// The fabric a listener serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransportType {
    Tcp,
    Rdma,
}

/// One listening address, as reported in discovery log entries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListenerInfo {
    pub transport: TransportType,
    /// Numeric address (IPv4 or IPv6), as the host should dial it.
    pub address: String,
    pub port: u16,
    /// Port ID in discovery entries; unique per listener within the gateway group.
    pub port_id: u16,
}

/// What a transport can carry, which shapes Identify Controller fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransportCaps {
    /// Bytes of data a command capsule may carry (IOCCSZ = (64 + this) / 16).
    pub in_capsule_data_size: u32,
    /// Keyed SGL data block descriptors (RDMA).
    pub keyed_sgls: bool,
}

/// Product identity shared by every gateway of a group.
#[derive(Debug, Clone)]
pub struct TargetIdentity {
    pub model: String,
    pub firmware: String,
}

impl Default for TargetIdentity {
    fn default() -> Self {
        Self {
            model: "Ceph RBD NVMe-oF gateway".into(),
            firmware: env!("CARGO_PKG_VERSION").into(),
        }
    }
}

/// A configured namespace that is not served because its device could not be opened (an
/// RBD image missing, the cluster unreachable); the daemon retries it in the background.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnavailableNamespace {
    pub nqn: String,
    pub nsid: u32,
    /// `pool/image` for RBD.
    pub device: String,
}

/// All subsystems and listeners of one gateway.
pub struct Target {
    pub identity: TargetIdentity,
    discovery: Arc<Subsystem>,
    subsystems: RwLock<BTreeMap<String, Arc<Subsystem>>>,
    listeners: RwLock<Vec<ListenerInfo>>,
    discovery_generation: AtomicU64,
    /// (NQN, NSID) -> device of the namespaces waiting for their device.
    unavailable: RwLock<BTreeMap<(String, u32), String>>,
    auth_policy: AuthPolicy,
    auth_counters: AuthCounters,
    connect_refusals: ConnectRefusals,
    /// Whether namespaces offer reservations (see `core::pr`).
    reservations: bool,
    /// The NVMe/TCP listeners that take TLS connections only.
    pub secure_listeners: super::tls::SecureListeners,
    /// Whether each reservation change is stored with the namespace's device before it
    /// completes (a gateway of a group, see `core::pr`).
    reservations_persisted: bool,
    /// Called when a host's controller of an NVM subsystem ends: a group gateway beacons at
    /// once, so the control plane's view of who is connected (which `namespace del
    /// --delete-image` checks) follows a disconnect without waiting for the next beacon.
    on_controller_gone: RwLock<Option<ControllerGone>>,
}

/// What [`Target::set_on_controller_gone`] installs.
pub type ControllerGone = Arc<dyn Fn() + Send + Sync>;

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Target").finish_non_exhaustive()
    }
}

impl Target {
    pub fn new(identity: TargetIdentity) -> Self {
        let discovery = Subsystem::new(
            SubsystemKind::Discovery,
            SubsystemSpec {
                nqn: DISCOVERY_NQN.into(),
                serial: "discovery".into(),
                model: identity.model.clone(),
                access: HostAccess::AnyHost,
                cntlid_min: cntlid::MIN,
                cntlid_max: cntlid::MAX,
            },
        );
        Self {
            identity,
            discovery: Arc::new(discovery),
            subsystems: RwLock::new(BTreeMap::new()),
            listeners: RwLock::new(Vec::new()),
            discovery_generation: AtomicU64::new(1),
            unavailable: RwLock::new(BTreeMap::new()),
            auth_policy: AuthPolicy::default(),
            auth_counters: AuthCounters::default(),
            connect_refusals: ConnectRefusals::default(),
            reservations: true,
            secure_listeners: Default::default(),
            reservations_persisted: false,
            on_controller_gone: RwLock::new(None),
        }
    }

    /// Installs what runs each time a host controller of an NVM subsystem ends (see
    /// `on_controller_gone`); it must not block.
    pub fn set_on_controller_gone(&self, f: ControllerGone) {
        *self
            .on_controller_gone
            .write()
            .unwrap_or_else(|e| e.into_inner()) = Some(f);
    }

    /// A host controller of an NVM subsystem ended.
    pub(crate) fn controller_gone(&self) {
        let f = self
            .on_controller_gone
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        if let Some(f) = f {
            f();
        }
    }

    /// Whether namespaces offer reservations: on by default (`[gateway] reservations`).
    pub fn with_reservations(mut self, enabled: bool) -> Self {
        self.reservations = enabled;
        self
    }

    pub fn reservations_enabled(&self) -> bool {
        self.reservations
    }

    /// Whether every reservation change is stored with the namespace's device
    /// ([`rbd_backend::IoOp::StoreRecord`]) before the command completes, and only a path
    /// in the optimized ANA state runs reservation commands: a gateway of a group, where
    /// the ANA owner of a namespace keeps its state and the next owner loads it
    /// ([`crate::core::pr::Reservations::load`]) before its path turns optimized.
    pub fn with_persisted_reservations(mut self, persisted: bool) -> Self {
        self.reservations_persisted = persisted;
        self
    }

    pub fn reservations_persisted(&self) -> bool {
        self.reservations_persisted
    }

    /// Sets the hashes and DH groups in-band authentication accepts, in order of preference.
    pub fn with_auth_policy(mut self, policy: AuthPolicy) -> Self {
        self.auth_policy = policy;
        self
    }

    pub fn auth_policy(&self) -> &AuthPolicy {
        &self.auth_policy
    }

    pub fn auth_counters(&self) -> &AuthCounters {
        &self.auth_counters
    }

    /// Refused Connects (and authentications), by reason.
    pub fn connect_refusals(&self) -> &ConnectRefusals {
        &self.connect_refusals
    }

    /// Records that namespace `nsid` of `nqn` is configured but its device (`device`) could
    /// not be opened, for whoever reports on the gateway (metrics).
    pub fn mark_unavailable(&self, nqn: &str, nsid: u32, device: &str) {
        self.unavailable
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert((nqn.to_string(), nsid), device.to_string());
    }

    /// The namespace is served now, or no longer wanted.
    pub fn clear_unavailable(&self, nqn: &str, nsid: u32) {
        self.unavailable
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&(nqn.to_string(), nsid));
    }

    /// Namespaces waiting for their device and not served meanwhile (another open of the
    /// same namespace, by a later configuration push, may have succeeded first).
    pub fn unavailable_namespaces(&self) -> Vec<UnavailableNamespace> {
        let marked = self
            .unavailable
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        marked
            .into_iter()
            .filter(|((nqn, nsid), _)| {
                self.subsystem(nqn)
                    .is_none_or(|s| s.namespace(*nsid).is_none())
            })
            .map(|((nqn, nsid), device)| UnavailableNamespace { nqn, nsid, device })
            .collect()
    }

    pub fn add_subsystem(&self, subsystem: Arc<Subsystem>) {
        self.subsystems
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(subsystem.nqn().to_string(), subsystem);
        self.discovery_changed();
    }

    pub fn add_listener(&self, listener: ListenerInfo) {
        self.listeners
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .push(listener);
        self.discovery_changed();
    }

    /// Takes an NVM subsystem out (`nvmeofctl subsystem del`): it leaves the discovery log
    /// (discovery controllers get a Discovery Log Change event), new Connects to it are
    /// refused, and its controllers are torn down (their connections close). Its namespaces'
    /// devices close once the last command in flight and the returned subsystem are gone.
    pub fn remove_subsystem(&self, nqn: &str) -> Option<Arc<Subsystem>> {
        let removed = self
            .subsystems
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(nqn)?;
        self.discovery_changed();
        for ctrl in removed.controllers() {
            ctrl.teardown(TeardownReason::SubsystemRemoved);
        }
        Some(removed)
    }

    /// Takes a listener out of the discovery log (the transport stops listening itself);
    /// discovery controllers get a Discovery Log Change event. False: no such listener.
    pub fn remove_listener(&self, transport: TransportType, address: &str, port: u16) -> bool {
        let removed = {
            let mut listeners = self.listeners.write().unwrap_or_else(|e| e.into_inner());
            let before = listeners.len();
            listeners
                .retain(|l| !(l.transport == transport && l.address == address && l.port == port));
            listeners.len() != before
        };
        if removed {
            self.discovery_changed();
        }
        removed
    }

    /// The subsystem named `nqn`, the discovery subsystem included.
    pub fn subsystem(&self, nqn: &str) -> Option<Arc<Subsystem>> {
        if nqn == DISCOVERY_NQN {
            return Some(self.discovery.clone());
        }
        self.subsystems
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(nqn)
            .cloned()
    }

    /// NVM subsystems, in NQN order.
    pub fn subsystems(&self) -> Vec<Arc<Subsystem>> {
        self.subsystems
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .cloned()
            .collect()
    }

    pub fn listeners(&self) -> Vec<ListenerInfo> {
        self.listeners
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    pub fn discovery_generation(&self) -> u64 {
        self.discovery_generation.load(Ordering::SeqCst)
    }

    /// Bumps the discovery log's generation and raises a Discovery Log Change event on every
    /// discovery controller. Called for every change of what the log lists: subsystems and
    /// listeners here, and by whoever changes a subsystem's TLS requirement or a listener's
    /// secure flag, which decide where a subsystem is offered.
    pub fn discovery_changed(&self) {
        self.discovery_generation.fetch_add(1, Ordering::SeqCst);
        for ctrl in self.discovery.controllers() {
            ctrl.notify_discovery_change();
        }
    }
}
