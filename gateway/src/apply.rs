//! Applying wanted subsystems, namespaces and hosts to a running target while every
//! connection the change does not concern keeps working. One path for both sources of
//! change: the gateway-group agent (`group`: assignments pushed by the control plane) and the
//! configuration reload (`reload`: SIGHUP on a standalone gateway). What is wanted is theirs
//! to decide; how the running target gets there is here:
//! - [`apply_hosts`]: a subsystem's allowed hosts and their DH-HMAC-CHAP keys;
//! - [`remove_unwanted`]: subsystems and namespaces no longer wanted go (their in-flight
//!   commands drain first);
//! - [`add_built`]: subsystems and namespaces built (devices opened) from a configuration
//!   join the target.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use rbd_backend::{DeviceEvent, DeviceEventSink};

use crate::config::HostEntry;
use crate::core::tls::HostPsk;
use crate::core::{HostAccess, HostKeys, Namespace, Subsystem, Target, Visibility};
use crate::events::NamespaceEvents;
use crate::spec::ana;

/// How long a removed namespace's (or a group leaving optimized) in-flight commands may take
/// to finish before the change is reported done anyway.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

/// The hosts wanted for a subsystem, with the keys of those that must authenticate.
#[derive(Debug, Default, Clone)]
pub struct WantedHosts {
    pub allow_any_host: bool,
    /// The hosts allowed, with their keys.
    pub entries: Vec<HostEntry>,
    /// The keys of those that must authenticate, by host NQN.
    pub keys: BTreeMap<String, Arc<HostKeys>>,
}

impl WantedHosts {
    /// A configuration file's host list (validated: every key parses).
    pub fn from_config(allow_any_host: bool, hosts: &[HostEntry]) -> Self {
        let keys = hosts
            .iter()
            .filter_map(|h| match h.keys() {
                Ok(Some(keys)) => Some((h.nqn().to_string(), Arc::new(keys))),
                _ => None,
            })
            .collect();
        Self {
            allow_any_host,
            entries: hosts.to_vec(),
            keys,
        }
    }

    pub fn nqns(&self) -> BTreeSet<String> {
        self.entries.iter().map(|h| h.nqn().to_string()).collect()
    }

    pub fn access(&self) -> HostAccess {
        if self.allow_any_host {
            HostAccess::AnyHost
        } else {
            HostAccess::Only(self.nqns())
        }
    }
}

/// "none", "host" or "bidirectional": what a host's keys make it do, for the logs.
fn auth_mode(keys: Option<&Arc<HostKeys>>) -> &'static str {
    match keys {
        None => "none",
        Some(k) if k.ctrl.is_none() => "host",
        Some(_) => "bidirectional",
    }
}

/// The TLS PSKs of the hosts that have one, by NQN (entries were validated).
pub fn tls_psks(hosts: &[HostEntry]) -> BTreeMap<String, Arc<HostPsk>> {
    hosts
        .iter()
        .filter_map(|h| match h.tls_psk() {
            Ok(Some(psk)) => Some((h.nqn().to_string(), Arc::new(psk))),
            _ => None,
        })
        .collect()
}

/// What [`apply_hosts`] changed.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct HostChanges {
    /// The allowed hosts changed.
    pub access: bool,
    /// Controllers of hosts no longer allowed, closed.
    pub controllers_closed: usize,
    /// Hosts whose keys changed (added, removed or replaced).
    pub keys: usize,
}

/// Makes a subsystem's allowed hosts and their keys `wanted`. A host is never allowed
/// without the keys it is given, not even between two calls: the keys of the hosts allowed
/// from now on are installed before the new host list, and the keys of hosts leaving the list
/// are dropped only after it (their controllers are closed by [`Subsystem::set_access`];
/// every other controller stays). Connected hosts whose keys change keep their controllers;
/// the keys apply from their next authentication. Keys are never logged. `origin` ends the
/// log lines: "in the control plane", "in the configuration file".
pub fn apply_hosts(sub: &Subsystem, wanted: &WantedHosts, origin: &str) -> HostChanges {
    let mut changes = HostChanges::default();
    let access = wanted.access();
    let current = sub.all_host_keys();
    let keys_changed = current != wanted.keys;
    let psks = tls_psks(&wanted.entries);
    if sub.tls.all_psks() != psks {
        changes.keys += 1;
        tracing::info!(nqn = %sub.nqn(), hosts_with_psk = psks.len(), "TLS PSKs changed {origin}");
        sub.tls.set_psks(psks);
    }
    if keys_changed {
        let mut interim = wanted.keys.clone();
        for (h, k) in &current {
            if !access.allows(h) {
                interim.entry(h.clone()).or_insert_with(|| k.clone());
            }
        }
        sub.set_host_keys(interim);
    }
    if sub.access() != access {
        let revoked = sub.set_access(access);
        changes.access = true;
        changes.controllers_closed = revoked.len();
        tracing::info!(
            nqn = %sub.nqn(),
            any_host = wanted.allow_any_host,
            hosts = wanted.entries.len(),
            controllers_closed = revoked.len(),
            "allowed hosts changed {origin}"
        );
    }
    if keys_changed {
        sub.set_host_keys(wanted.keys.clone());
        let changed: BTreeSet<&String> = current.keys().chain(wanted.keys.keys()).collect();
        for h in changed {
            let (old, new) = (current.get(h), wanted.keys.get(h));
            if old != new {
                changes.keys += 1;
                tracing::info!(
                    nqn = %sub.nqn(),
                    host = %h,
                    auth = auth_mode(new),
                    was = auth_mode(old),
                    "DH-HMAC-CHAP keys changed {origin} (in force from the host's next \
                     authentication; its connections stay)"
                );
            }
        }
    }
    changes
}

/// Events of a device that no longer serves its namespace (removed, or replaced by another
/// device): a late report from its in-flight ops must not reach the namespace's subsystem.
pub struct Detached;

impl DeviceEventSink for Detached {
    fn device_event(&self, _event: DeviceEvent) {}
}

/// What is wanted of the subsystems a target serves, for [`remove_unwanted`].
pub trait Wanted {
    /// Whether the subsystem `nqn` stays.
    fn keeps_subsystem(&self, nqn: &str) -> bool;
    /// Whether namespace `ns` of the (staying) subsystem `nqn` stays (its NSID, and for a
    /// source that knows it, its identity: another identity under the NSID is another
    /// namespace).
    fn keeps_namespace(&self, nqn: &str, ns: &Namespace) -> bool;
    /// The hosts wanted for the (staying) subsystem `nqn`; None: its hosts are not this
    /// source's to change.
    fn hosts(&self, nqn: &str) -> Option<WantedHosts>;
    /// The hosts that see the (staying) namespace `nsid` of `nqn`; None: not this source's
    /// to change.
    fn visibility(&self, _nqn: &str, _nsid: u32) -> Option<Visibility> {
        None
    }
}

/// What [`remove_unwanted`] did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Removed {
    pub subsystems: usize,
    pub namespaces: usize,
    /// Subsystems whose allowed hosts or keys changed.
    pub hosts_changed: usize,
    pub controllers_closed: usize,
    /// Namespaces whose visible hosts changed.
    pub visibility_changed: usize,
}

/// Takes out of `target` what `wanted` no longer wants: a subsystem not kept is removed (its
/// controllers torn down, the discovery log changed); a namespace not kept is taken out,
/// every controller of its subsystem gets Namespace Attribute Changed (the Changed Namespace
/// List names it); the allowed hosts and their keys follow [`Wanted::hosts`]
/// ([`apply_hosts`]). The removed namespaces' commands in flight finish (at most
/// [`DRAIN_TIMEOUT`]) before this returns; each device closes with its last reference.
/// `origin` ends the log lines.
pub async fn remove_unwanted(
    target: &Target,
    wanted: &(dyn Wanted + Sync),
    origin: &str,
) -> Removed {
    let mut removed = Removed::default();
    let mut removed_devices = Vec::new();
    for sub in target.subsystems() {
        if sub.is_discovery() {
            continue;
        }
        if !wanted.keeps_subsystem(sub.nqn()) {
            let controllers = sub.controllers().len();
            target.remove_subsystem(sub.nqn());
            tracing::info!(nqn = %sub.nqn(), controllers, "subsystem deleted {origin}: removed");
            removed_devices.extend(sub.namespaces());
            removed.subsystems += 1;
            continue;
        }
        for ns in sub.namespaces() {
            if wanted.keeps_namespace(sub.nqn(), &ns) {
                if let Some(visibility) = wanted.visibility(sub.nqn(), ns.nsid) {
                    if apply_visibility(&sub, ns.nsid, visibility, origin) {
                        removed.visibility_changed += 1;
                    }
                }
                continue;
            }
            if let Some(gone) = sub.remove_namespace(ns.nsid) {
                gone.device.set_event_sink(Arc::new(Detached));
                sub.notify_namespace_changed(ns.nsid);
                tracing::info!(nqn = %sub.nqn(), nsid = ns.nsid, "namespace deleted {origin}: removed");
                removed_devices.push(gone.clone());
                removed.namespaces += 1;
            }
        }
        if let Some(hosts) = wanted.hosts(sub.nqn()) {
            let changes = apply_hosts(&sub, &hosts, origin);
            if changes != HostChanges::default() {
                removed.hosts_changed += 1;
            }
            removed.controllers_closed += changes.controllers_closed;
        }
    }
    drain(
        &removed_devices,
        "removed namespaces drained; their devices close with the last reference",
    )
    .await;
    removed
}

/// Makes namespace `nsid` of `sub` visible to `visibility`'s hosts; the controllers whose
/// view changes are told ([`Subsystem::set_visibility`]). Whether it changed.
pub fn apply_visibility(sub: &Subsystem, nsid: u32, visibility: Visibility, origin: &str) -> bool {
    if sub.visibility(nsid) == visibility {
        return false;
    }
    let hosts = match &visibility {
        Visibility::AllHosts => None,
        Visibility::Only(h) => Some(h.len()),
    };
    let told = sub.set_visibility(nsid, visibility);
    tracing::info!(
        nqn = %sub.nqn(),
        nsid,
        all_hosts = hosts.is_none(),
        hosts = hosts.unwrap_or(0),
        controllers_told = told.len(),
        "namespace visibility changed {origin}"
    );
    true
}

/// Waits until the devices of `namespaces` have no command in flight, nor any waiting for
/// its QoS turn (at most [`DRAIN_TIMEOUT`]); logs `what` when there were any.
async fn drain(namespaces: &[Arc<Namespace>], what: &str) {
    let started = std::time::Instant::now();
    let in_flight = || {
        namespaces
            .iter()
            .map(|n| n.device.in_flight() + n.qos.waiting())
            .sum::<usize>()
    };
    while in_flight() > 0 && started.elapsed() < DRAIN_TIMEOUT {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    if !namespaces.is_empty() {
        tracing::info!(
            devices = namespaces.len(),
            in_flight = in_flight(),
            ms = started.elapsed().as_millis() as u64,
            "{what}"
        );
    }
}

/// How [`add_built`] adds.
pub struct AddOptions<'a> {
    /// ANA groups new to a subsystem start inaccessible (a gateway group: the control plane
    /// decides their states); else they take the state a fresh subsystem gives them.
    pub new_groups_inaccessible: bool,
    /// "pushed", "reloaded": starts the log lines.
    pub what: &'a str,
    /// Ends the host changes' log lines (see [`apply_hosts`]).
    pub origin: &'a str,
}

/// What [`add_built`] did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Added {
    pub subsystems: usize,
    pub namespaces: usize,
    /// Namespaces whose NSID was served already: the new one replaced it.
    pub replaced: usize,
}

/// Moves the subsystems and namespaces of `built` (a target built from a configuration: its
/// devices open) into `target`: a subsystem new to `target` is added whole (after `hosts`
/// gives it its allowed hosts' keys where the build did not); a namespace of a subsystem
/// `target` serves is added to it, replacing one with the same NSID (whose in-flight
/// commands finish first, at most [`DRAIN_TIMEOUT`]), and its controllers get Namespace
/// Attribute Changed. Controllers of other namespaces and subsystems are not touched.
pub async fn add_built(
    target: &Target,
    built: &Target,
    hosts: &(dyn Fn(&str) -> Option<WantedHosts> + Sync),
    options: &AddOptions<'_>,
) -> Added {
    let what = options.what;
    let mut added = Added::default();
    let mut replaced_devices = Vec::new();
    for sub in built.subsystems() {
        if sub.is_discovery() {
            continue;
        }
        match target.subsystem(sub.nqn()) {
            Some(existing) => {
                for ns in sub.namespaces() {
                    if options.new_groups_inaccessible
                        && !existing
                            .ana_groups()
                            .iter()
                            .any(|(g, _)| *g == ns.ana_group)
                    {
                        existing.set_ana_state(ns.ana_group, ana::INACCESSIBLE);
                    }
                    ns.device
                        .set_event_sink(Arc::new(NamespaceEvents::new(&existing, ns.nsid)));
                    let nsid = ns.nsid;
                    if let Some(old) = existing.namespace(nsid) {
                        old.device.set_event_sink(Arc::new(Detached));
                        replaced_devices.push(old.clone());
                        added.replaced += 1;
                    } else {
                        added.namespaces += 1;
                    }
                    // Its hosts before it is served: no host it is hidden from sees it.
                    apply_visibility(&existing, nsid, sub.visibility(nsid), options.origin);
                    existing.add_namespace(ns);
                    existing.notify_namespace_changed(nsid);
                    tracing::info!(nqn = %existing.nqn(), nsid, "{what} namespace served");
                }
            }
            None => {
                if options.new_groups_inaccessible {
                    for ns in sub.namespaces() {
                        sub.set_ana_state(ns.ana_group, ana::INACCESSIBLE);
                    }
                }
                if let Some(wanted) = hosts(sub.nqn()) {
                    // Keys of hosts of a subsystem open to any host (built without a host
                    // list), and the record of the keyed hosts; the rest is as built.
                    apply_hosts(&sub, &wanted, options.origin);
                }
                tracing::info!(
                    nqn = %sub.nqn(),
                    namespaces = sub.namespaces().len(),
                    "{what} subsystem served"
                );
                target.add_subsystem(sub);
                added.subsystems += 1;
            }
        }
    }
    drain(
        &replaced_devices,
        "replaced namespaces drained; their old devices close with the last reference",
    )
    .await;
    added
}
