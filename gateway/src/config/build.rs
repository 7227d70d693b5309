//! The target built from a [`Config`]: subsystems, namespaces (opening RBD images in
//! parallel, serving without those that do not open, and retrying them in the background).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use rbd_backend::rbd::{ClusterPool, RbdDevice, RbdError};
use rbd_backend::{BlockDevice, MemoryDevice};

use super::{
    invalid, parse_size, rbd_spec, Config, ConfigError, HostEntry, NamespaceConfig,
    SkippedNamespace, SubsystemConfig,
};
use crate::core::{
    HostAccess, HostKeys, ListenerInfo, Namespace, Subsystem, SubsystemKind, SubsystemSpec, Target,
    TargetIdentity, TransportType,
};

/// UUIDv5 pair (NGUID, UUID) of `identity` in the product's namespace (a fixed UUID).
fn derived_ids(identity: &str) -> ([u8; 16], [u8; 16]) {
    const PRODUCT: uuid::Uuid = uuid::Uuid::from_u128(0x6c1d_7a1e_52c4_4f0e_9a6b_8e0b_3f2d_a001);
    let uuid = uuid::Uuid::new_v5(&PRODUCT, identity.as_bytes());
    let nguid = uuid::Uuid::new_v5(&PRODUCT, format!("nguid:{identity}").as_bytes());
    (*nguid.as_bytes(), *uuid.as_bytes())
}

/// A configured namespace's (NGUID, UUID): those the file gives (`nguid`, `uuid`; validated),
/// else derived from what the namespace is, so every gateway reading the file and every
/// restart agree, and another device under the same NSID is another namespace:
/// - an RBD image: `<nqn>/<nsid>/rbd/<pool>/<rados namespace>/<image>`. Before this included
///   the image, it was `<nqn>/<nsid>`: changing the image behind an NSID kept the identity,
///   and a host that kept the old device wrote into the new image.
/// - an in-memory device: `<nqn>/<nsid>`. It starts empty at every start and reload, so its
///   identity names no data to mix up; it keeps the value it always had.
///
/// A group gateway's pushed namespaces carry the control plane's stored identity instead.
pub(crate) fn namespace_identity(nqn: &str, ns: &NamespaceConfig) -> ([u8; 16], [u8; 16]) {
    let derived_from = match ns.backend.as_str() {
        "rbd" => format!(
            "{nqn}/{}/rbd/{}/{}/{}",
            ns.nsid,
            ns.pool.as_deref().unwrap_or_default(),
            ns.rados_namespace.as_deref().unwrap_or_default(),
            ns.image.as_deref().unwrap_or_default()
        ),
        _ => format!("{nqn}/{}", ns.nsid),
    };
    let (mut nguid, mut uuid) = derived_ids(&derived_from);
    let given = |text: &Option<String>| {
        text.as_deref()
            .and_then(|t| uuid::Uuid::try_parse(t).ok())
            .map(|u| *u.as_bytes())
    };
    if let Some(u) = given(&ns.uuid) {
        uuid = u;
    }
    if let Some(g) = given(&ns.nguid) {
        nguid = g;
    }
    (nguid, uuid)
}

impl Config {
    /// For each RBD namespace of the file that names neither `uuid` nor `nguid`: the two lines
    /// that keep the identity gateways derived before it included the image (UUIDv5 of
    /// `<nqn>/<nsid>`, what hosts connected to such a gateway see), as TOML to add to that
    /// namespace. An in-memory namespace keeps that identity anyway; a namespace naming one
    /// of the two has what it names.
    pub fn previous_identity_pins(&self) -> String {
        let mut out = String::new();
        for (i, s) in self.subsystems.iter().enumerate() {
            for (j, ns) in s.namespaces.iter().enumerate() {
                if ns.backend != "rbd" || ns.uuid.is_some() || ns.nguid.is_some() {
                    continue;
                }
                let (nguid, uuid) = derived_ids(&format!("{}/{}", s.nqn, ns.nsid));
                out += &format!(
                    "# subsystem[{i}].namespace[{j}]: {} NSID {} ({}/{})\nuuid = \"{}\"\nnguid = \"{}\"\n",
                    s.nqn,
                    ns.nsid,
                    ns.pool.as_deref().unwrap_or_default(),
                    ns.image.as_deref().unwrap_or_default(),
                    uuid::Uuid::from_bytes(uuid).hyphenated(),
                    uuid::Uuid::from_bytes(nguid).simple(),
                );
            }
        }
        out
    }
}

/// Serial number shared by every gateway: derived from the NQN, 20 ASCII characters.
fn derived_serial(nqn: &str) -> String {
    let id = uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_OID, nqn.as_bytes());
    id.simple().to_string()[..20].to_string()
}

/// Adds a namespace with its device to `subsystem` and routes the device's events to it.
fn attach_namespace(
    subsystem: &Arc<Subsystem>,
    s: &SubsystemConfig,
    ns: &NamespaceConfig,
    device: Arc<dyn BlockDevice>,
) {
    let (nguid, uuid) = namespace_identity(&s.nqn, ns);
    let namespace = Arc::new(Namespace {
        nsid: ns.nsid,
        device: device.clone(),
        lba_shift: ns.block_size.trailing_zeros() as u8,
        nguid,
        uuid,
        ana_group: ns.ana_group,
        read_only: ns.read_only,
        qos: Arc::new(crate::core::qos::NamespaceQos::new(ns.qos_limits())),
        // Set before the namespace is added: no host ever sees it beyond its frozen size.
        frozen_size: Arc::new(crate::core::FrozenSize::new(ns.frozen_size)),
    });
    device.set_event_sink(Arc::new(crate::events::NamespaceEvents::new(
        subsystem, ns.nsid,
    )));
    // Its hosts first: no host it is hidden from ever sees it.
    subsystem.set_visibility(ns.nsid, ns.visibility());
    subsystem.add_namespace(namespace);
}

/// How long start-up waits for the next RBD image to open before serving without the ones
/// still opening (see `Config::open_rbd_devices`).
pub const OPEN_STALL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

impl Config {
    /// Builds the target: subsystems, namespaces (opening their devices) and listeners.
    ///
    /// Blocking: RBD images are opened here (in parallel, each on its own thread). A namespace
    /// whose device cannot be opened (missing pool or image, cluster unreachable) is left out:
    /// it is logged at error level with its field and image, and the other namespaces are
    /// served. [`Config::build_target_report`] also returns the skipped namespaces.
    pub fn build_target(&self) -> Result<Arc<Target>, ConfigError> {
        self.build_target_report().map(|(target, _)| target)
    }

    /// Opens every `backend = "rbd"` namespace's image, several at a time, each on its ANA
    /// group's cluster connections (see [`ClusterPool`]).
    ///
    /// Never waits forever: `rbd_open` blocks while an OSD holding the image header is down
    /// (librbd waits for it). When no open has finished for [`OPEN_STALL_TIMEOUT`], the images
    /// still opening (or not started) are reported as not opened yet; the caller serves the
    /// others and [`Config::spawn_namespace_retry`] keeps trying them in the background.
    fn open_rbd_devices(&self) -> HashMap<(usize, usize), Result<RbdDevice, RbdError>> {
        let mut wanted = Vec::new();
        for (i, s) in self.subsystems.iter().enumerate() {
            for (j, ns) in s.namespaces.iter().enumerate() {
                if ns.backend == "rbd" {
                    let nfield = format!("subsystem[{i}].namespace[{j}]");
                    if let Ok(spec) = rbd_spec(&nfield, ns) {
                        wanted.push(((i, j), spec, ns.ana_group));
                    }
                }
            }
        }
        let mut opened = HashMap::new();
        if wanted.is_empty() {
            return opened;
        }
        let settings = self.ceph.clone().unwrap_or_default().settings();
        tracing::info!(
            client = %settings.entity_name(),
            conf = settings.conf.as_ref().map(|p| p.display().to_string()).unwrap_or_else(|| "(default)".into()),
            images = wanted.len(),
            "opening RBD images"
        );
        let pool = ClusterPool::shared(settings);
        const PARALLEL_OPENS: usize = 8;
        let all: Vec<((usize, usize), String)> = wanted
            .iter()
            .map(|(key, spec, _)| (*key, spec.to_string()))
            .collect();
        let (tx, rx) = std::sync::mpsc::channel();
        let mut queue = wanted.into_iter();
        let mut running = 0usize;
        let mut stalled = false;
        loop {
            while running < PARALLEL_OPENS && !stalled {
                let Some((key, spec, group)) = queue.next() else {
                    break;
                };
                let (pool, tx2) = (pool.clone(), tx.clone());
                let spawned =
                    std::thread::Builder::new()
                        .name("rbd-open".into())
                        .spawn(move || {
                            let _ = tx2.send((key, pool.open_in_group(&spec, group)));
                        });
                match spawned {
                    Ok(_) => running += 1,
                    Err(e) => {
                        opened.insert(
                            key,
                            Err(RbdError::Config(format!(
                                "cannot start a thread to open the image: {e}"
                            ))),
                        );
                    }
                }
            }
            if running == 0 {
                break;
            }
            match rx.recv_timeout(OPEN_STALL_TIMEOUT) {
                Ok((key, result)) => {
                    running -= 1;
                    opened.insert(key, result);
                }
                Err(_) => {
                    // Leave the stuck threads behind (their devices close when they finish)
                    // and the rest to the background retry.
                    tracing::warn!(
                        still_opening = running,
                        secs = OPEN_STALL_TIMEOUT.as_secs(),
                        "RBD images still opening (cluster slow or an OSD down): serving the \
                         others, retrying these in the background"
                    );
                    stalled = true;
                    break;
                }
            }
        }
        if stalled {
            for (key, image) in all {
                opened.entry(key).or_insert(Err(RbdError::OpenTimedOut {
                    image,
                    secs: OPEN_STALL_TIMEOUT.as_secs(),
                }));
            }
        }
        opened
    }

    /// Keeps trying, every `interval` on a background thread, to open the RBD namespaces that
    /// [`Config::build_target_report`] skipped (image created later, cluster back). Each one
    /// that opens is added to its subsystem and connected hosts are told (Namespace Attribute
    /// Changed + Changed Namespace List, so Linux rescans and shows it). The thread ends when
    /// all are served or the target is dropped. `None`: nothing to retry.
    pub fn spawn_namespace_retry(
        &self,
        target: &Arc<Target>,
        skipped: &[SkippedNamespace],
        interval: std::time::Duration,
    ) -> Option<std::thread::JoinHandle<()>> {
        let retried: Vec<&SkippedNamespace> = skipped
            .iter()
            .filter(|k| {
                self.subsystems
                    .get(k.subsystem_index)
                    .and_then(|s| s.namespaces.get(k.namespace_index))
                    .is_some_and(|ns| ns.backend == "rbd")
            })
            .collect();
        if retried.is_empty() {
            return None;
        }
        // Reported (metrics) until served or given up.
        for k in &retried {
            target.mark_unavailable(&k.nqn, k.nsid, &k.device);
        }
        let mut pending: Vec<(usize, usize, String)> = retried
            .iter()
            .map(|k| (k.subsystem_index, k.namespace_index, k.field.clone()))
            .collect();
        let config = self.clone();
        let target = Arc::downgrade(target);
        let spawned = std::thread::Builder::new()
            .name("ns-retry".into())
            .spawn(move || {
                let pool = ClusterPool::shared(config.ceph.clone().unwrap_or_default().settings());
                while !pending.is_empty() {
                    std::thread::sleep(interval);
                    let Some(target) = target.upgrade() else {
                        return;
                    };
                    let attach = |i: usize, j: usize, field: &str| -> bool {
                        let (Some(s), Some(ns)) = (
                            config.subsystems.get(i),
                            config.subsystems.get(i).and_then(|s| s.namespaces.get(j)),
                        ) else {
                            return false;
                        };
                        let Ok(spec) = rbd_spec(field, ns) else {
                            return false;
                        };
                        match pool.open_in_group(&spec, ns.ana_group) {
                            Ok(device) => {
                                let Some(subsystem) = target.subsystem(&s.nqn) else {
                                    return false;
                                };
                                if config.group.is_some()
                                    && !subsystem
                                        .ana_groups()
                                        .iter()
                                        .any(|(g, _)| *g == ns.ana_group)
                                {
                                    // In a gateway group only the control plane makes a
                                    // group optimized.
                                    subsystem.set_ana_state(
                                        ns.ana_group,
                                        crate::spec::ana::INACCESSIBLE,
                                    );
                                }
                                attach_namespace(&subsystem, s, ns, Arc::new(device));
                                subsystem.notify_namespace_changed(ns.nsid);
                                tracing::info!(
                                    field = %field,
                                    nqn = %s.nqn,
                                    nsid = ns.nsid,
                                    image = %spec,
                                    "namespace now served"
                                );
                                false
                            }
                            Err(e) => {
                                tracing::debug!(field = %field, image = %spec, "still not served: {e}");
                                true
                            }
                        }
                    };
                    pending.retain(|(i, j, field)| {
                        let keep = attach(*i, *j, field);
                        if !keep {
                            // served now, or not retried any more: no longer reported
                            if let Some(s) = config.subsystems.get(*i) {
                                if let Some(ns) = s.namespaces.get(*j) {
                                    target.clear_unavailable(&s.nqn, ns.nsid);
                                }
                            }
                        }
                        keep
                    });
                }
            });
        match spawned {
            Ok(handle) => Some(handle),
            Err(e) => {
                tracing::error!("cannot start the namespace retry thread: {e}");
                None
            }
        }
    }

    /// [`Config::build_target`], also returning the namespaces left out.
    pub fn build_target_report(&self) -> Result<(Arc<Target>, Vec<SkippedNamespace>), ConfigError> {
        self.validate()?;
        let mut rbd_devices = self.open_rbd_devices();
        let mut skipped = Vec::new();
        let identity = TargetIdentity::default();
        let reservations = self.gateway.reservations.unwrap_or(true);
        let target = Arc::new(
            Target::new(identity.clone())
                .with_auth_policy(self.gateway.auth_policy()?)
                .with_reservations(reservations)
                .with_persisted_reservations(self.group.is_some()),
        );
        let (cntlid_min, cntlid_max) = self.cntlid_range();
        for (i, s) in self.subsystems.iter().enumerate() {
            let access = if s.allow_any_host {
                HostAccess::AnyHost
            } else {
                HostAccess::Only(s.hosts.iter().map(|h| h.nqn().to_string()).collect())
            };
            let subsystem = Arc::new(Subsystem::new(
                SubsystemKind::Nvm,
                SubsystemSpec {
                    nqn: s.nqn.clone(),
                    serial: s.serial.clone().unwrap_or_else(|| derived_serial(&s.nqn)),
                    model: s.model.clone().unwrap_or_else(|| identity.model.clone()),
                    access,
                    cntlid_min,
                    cntlid_max,
                },
            ));
            subsystem.set_host_keys(host_keys(&s.hosts));
            subsystem.tls.set_psks(crate::apply::tls_psks(&s.hosts));
            subsystem.tls.set_required(s.require_tls);
            for (j, ns) in s.namespaces.iter().enumerate() {
                let nfield = format!("subsystem[{i}].namespace[{j}]");
                let device: Arc<dyn BlockDevice> = match ns.backend.as_str() {
                    "memory" => {
                        let size = ns.size.as_deref().and_then(parse_size).unwrap_or(0);
                        Arc::new(MemoryDevice::new(
                            format!("memory:{}/{}", s.nqn, ns.nsid),
                            size,
                        ))
                    }
                    "rbd" => match rbd_devices.remove(&(i, j)) {
                        Some(Ok(device)) => {
                            let size = device.size_bytes();
                            if size % u64::from(ns.block_size) != 0 {
                                tracing::warn!(
                                    field = %nfield,
                                    image = device.name(),
                                    size,
                                    block_size = ns.block_size,
                                    "image size is not a multiple of the block size; the tail is not served"
                                );
                            }
                            Arc::new(device)
                        }
                        Some(Err(e)) => {
                            let image = rbd_spec(&nfield, ns)
                                .map(|spec| spec.to_string())
                                .unwrap_or_default();
                            tracing::error!(
                                field = %nfield,
                                nqn = %s.nqn,
                                nsid = ns.nsid,
                                image = %image,
                                "namespace not served: {e}"
                            );
                            skipped.push(SkippedNamespace {
                                field: nfield,
                                subsystem_index: i,
                                namespace_index: j,
                                nqn: s.nqn.clone(),
                                nsid: ns.nsid,
                                device: image,
                                error: e.to_string(),
                            });
                            continue;
                        }
                        None => {
                            return Err(invalid(
                                format!("{nfield}.image"),
                                "was not opened (invalid pool or image name)",
                            ))
                        }
                    },
                    other => {
                        return Err(invalid(
                            format!("{nfield}.backend"),
                            format!("{other:?} is not supported"),
                        ))
                    }
                };
                attach_namespace(&subsystem, s, ns, device);
            }
            target.add_subsystem(subsystem);
        }
        for (i, l) in self.listeners.iter().enumerate() {
            // Validated already; the address is kept in its canonical text (no brackets, no
            // port), which is what the discovery log's TRADDR carries.
            let Ok(addr) = l.socket_addr() else {
                continue;
            };
            target.add_listener(ListenerInfo {
                transport: if l.transport == "rdma" {
                    TransportType::Rdma
                } else {
                    TransportType::Tcp
                },
                address: addr.ip().to_string(),
                port: addr.port(),
                port_id: i as u16 + 1,
            });
            target
                .secure_listeners
                .set(&addr.ip().to_string(), addr.port(), l.secure);
        }
        Ok((target, skipped))
    }
}

/// The keys of the hosts that must authenticate, by NQN (entries were validated).
fn host_keys(hosts: &[HostEntry]) -> BTreeMap<String, Arc<HostKeys>> {
    hosts
        .iter()
        .filter_map(|h| match h.keys() {
            Ok(Some(keys)) => Some((h.nqn().to_string(), Arc::new(keys))),
            _ => None,
        })
        .collect()
}
