//! Live reload of a standalone gateway's configuration file (SIGHUP).
//!
//! The file is read and validated as `--check` does, then compared with the configuration in
//! force. Settings that cannot change in a running process (`[gateway]`, `[ceph]`, `[group]`,
//! a subsystem's serial or model) refuse the reload, naming them. Otherwise the new
//! subsystems and the new or changed namespaces are built first, their RBD images opened: one
//! that does not open refuses the reload. Only then is anything changed, through the path the
//! gateway-group agent takes for the control plane's changes (`crate::apply`): subsystems and
//! namespaces removed (their in-flight commands drained) and added, a changed namespace
//! replaced under the same NSID, allowed hosts and their DH-HMAC-CHAP keys set (a removed
//! host's controllers close; a host whose keys change keeps its connections, the keys apply
//! from its next authentication). Listeners added or removed are the caller's (main.rs binds
//! the new ones before [`Reloader::apply`] and stops the removed ones after it). A refused
//! reload changes nothing, and says why.
//!
//! In a gateway group the subsystems, namespaces, hosts and listeners come from the control
//! plane (`nvmeofctl`): a reload that changes those parts of the file is refused.
//!
//! Metrics: `nvmeof_config_reloads_total{result}` (applied, unchanged, refused) and
//! `nvmeof_config_last_reload_success_timestamp_seconds` (the start counts as one).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use metrics_exposition::Family;

use crate::apply::{self, WantedHosts};
use crate::config::{Config, NamespaceConfig, SubsystemConfig};
use crate::core::{ListenerInfo, Target, TransportType};
use crate::group::PushedListener;

/// Ends the log lines of the changes a reload makes.
const ORIGIN: &str = "in the configuration file";

/// Port IDs of the file's listeners (1.. as the start gives them) stay below the ones a
/// gateway group pushes (`group::apply_listeners`).
const MAX_FILE_PORT_ID: u16 = 0x7fff;

/// How a reload ended, for the metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The difference was applied.
    Applied,
    /// The file says what is in force already.
    Unchanged,
    /// Nothing was changed (invalid file, a setting that cannot change live, an image that
    /// does not open, a listener that cannot be bound).
    Refused,
}

static APPLIED: AtomicU64 = AtomicU64::new(0);
static UNCHANGED: AtomicU64 = AtomicU64::new(0);
static REFUSED: AtomicU64 = AtomicU64::new(0);
/// Unix time of the last configuration that loaded (start or reload); 0: none.
static LAST_SUCCESS: AtomicU64 = AtomicU64::new(0);

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Counts a reload's outcome.
pub fn record(outcome: Outcome) {
    let counter = match outcome {
        Outcome::Applied => &APPLIED,
        Outcome::Unchanged => &UNCHANGED,
        Outcome::Refused => &REFUSED,
    };
    counter.fetch_add(1, Ordering::Relaxed);
    if outcome != Outcome::Refused {
        LAST_SUCCESS.store(unix_now(), Ordering::Relaxed);
    }
}

/// The reload metrics, in the Prometheus text format.
pub fn render_metrics(out: &mut String) {
    let mut reloads = Family::new(
        out,
        "nvmeof_config_reloads_total",
        "counter",
        "Configuration reloads (SIGHUP) by result: applied, unchanged, refused (nothing changed).",
    );
    for (result, counter) in [
        ("applied", &APPLIED),
        ("unchanged", &UNCHANGED),
        ("refused", &REFUSED),
    ] {
        reloads.sample(&[("result", result)], counter.load(Ordering::Relaxed));
    }
    Family::new(
        out,
        "nvmeof_config_last_reload_success_timestamp_seconds",
        "gauge",
        "Unix time the configuration in force was loaded (the start, or the last reload that \
         did not fail).",
    )
    .sample(&[], LAST_SUCCESS.load(Ordering::Relaxed));
}

/// Why a reload was refused (nothing was changed).
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    #[error("invalid configuration: {0}")]
    Invalid(#[from] crate::config::ConfigError),
    #[error("these settings cannot change without a restart: {}", .0.join(", "))]
    NotLive(Vec<String>),
    #[error(
        "this gateway is in a gateway group: its subsystems, namespaces, hosts and listeners \
         come from the control plane (nvmeofctl), not from the file ({})",
        .0.join(", ")
    )]
    GroupManaged(Vec<String>),
    #[error("{field} ({nqn} namespace {nsid}, {device}) cannot be opened: {error}")]
    Open {
        field: String,
        nqn: String,
        nsid: u32,
        device: String,
        error: String,
    },
    #[error("building the new namespaces failed: {0}")]
    Build(String),
}

/// What a reload changes, for its log line.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Summary {
    pub subsystems_added: usize,
    pub subsystems_removed: usize,
    pub namespaces_added: usize,
    pub namespaces_changed: usize,
    pub namespaces_removed: usize,
    /// Namespaces whose QoS limits only changed: applied live, the device stays open.
    pub namespaces_qos_changed: usize,
    pub hosts_changed: usize,
    pub controllers_closed: usize,
    /// Namespaces whose visible hosts changed.
    pub visibility_changed: usize,
    pub listeners_added: usize,
    pub listeners_removed: usize,
}

/// A validated reload, ready to apply: its new devices are open.
pub struct Plan {
    config: Config,
    /// The new subsystems and the new or changed namespaces (None: none).
    built: Option<Arc<Target>>,
    before: BTreeSet<PushedListener>,
    after: BTreeSet<PushedListener>,
}

impl Plan {
    /// The listeners to bind (before [`Reloader::apply`]).
    pub fn listeners_added(&self) -> Vec<PushedListener> {
        self.after.difference(&self.before).cloned().collect()
    }

    /// The file's listeners in force, then the new file's.
    pub fn listeners(&self) -> (BTreeSet<PushedListener>, BTreeSet<PushedListener>) {
        (self.before.clone(), self.after.clone())
    }
}

/// What [`Reloader::prepare`] found.
pub enum Prepared {
    Unchanged,
    Apply(Box<Plan>),
}

/// The configuration in force and where it came from.
pub struct Reloader {
    path: PathBuf,
    current: Config,
}

impl Reloader {
    /// `current`: the configuration the gateway started with, read from `path`.
    pub fn new(path: &Path, current: Config) -> Self {
        LAST_SUCCESS.store(unix_now(), Ordering::Relaxed);
        Self {
            path: path.to_path_buf(),
            current,
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Reads and validates the file, compares it with the configuration in force and opens
    /// the devices of what it adds or changes. Changes nothing in the running target.
    pub async fn prepare(&self) -> Result<Prepared, ReloadError> {
        let new = Config::load(&self.path)?;
        let old = &self.current;
        let not_live = not_live_changes(old, &new);
        if !not_live.is_empty() {
            return Err(ReloadError::NotLive(not_live));
        }
        let (before, after) = (listeners_of(old), listeners_of(&new));
        if old.group.is_some() {
            let mut parts = Vec::new();
            if subsystems_differ(old, &new) {
                parts.push("subsystem".to_string());
            }
            if before != after {
                parts.push("listener".to_string());
            }
            if !parts.is_empty() {
                return Err(ReloadError::GroupManaged(parts));
            }
        }
        if !subsystems_differ(old, &new) && before == after {
            return Ok(Prepared::Unchanged);
        }
        let built = match to_build(old, &new) {
            Some((config, fields)) => Some(build(config, &fields).await?),
            None => None,
        };
        Ok(Prepared::Apply(Box::new(Plan {
            config: new,
            built,
            before,
            after,
        })))
    }

    /// Applies a prepared reload to `target` (listeners: see the module's documentation) and
    /// makes its configuration the one in force.
    pub async fn apply(&mut self, target: &Arc<Target>, plan: Box<Plan>) -> Summary {
        let new = plan.config;
        let diff = Diff::new(&self.current, &new);
        let mut summary = Summary {
            subsystems_added: diff.added_subsystems.len(),
            namespaces_added: diff.added_namespaces,
            namespaces_changed: diff.changed_namespaces,
            namespaces_qos_changed: diff.qos_changed_namespaces,
            listeners_added: plan.after.difference(&plan.before).count(),
            listeners_removed: plan.before.difference(&plan.after).count(),
            ..Summary::default()
        };
        let removed = apply::remove_unwanted(target, &FileWanted(&new), ORIGIN).await;
        summary.subsystems_removed = removed.subsystems;
        summary.namespaces_removed = removed.namespaces;
        summary.hosts_changed = removed.hosts_changed;
        summary.controllers_closed = removed.controllers_closed;
        summary.visibility_changed = removed.visibility_changed;
        if let Some(built) = &plan.built {
            let hosts = |nqn: &str| {
                new.subsystems
                    .iter()
                    .find(|s| s.nqn == nqn)
                    .map(|s| WantedHosts::from_config(s.allow_any_host, &s.hosts))
            };
            apply::add_built(
                target,
                built,
                &hosts,
                &apply::AddOptions {
                    // The standalone gateway's groups are optimized, as at the start.
                    new_groups_inaccessible: false,
                    what: "reloaded",
                    origin: ORIGIN,
                },
            )
            .await;
        }
        apply_file_qos(target, &new);
        add_to_discovery_log(target, &new);
        for s in &new.subsystems {
            if let Some(sub) = target.subsystem(&s.nqn) {
                let was = sub.tls.required();
                let closed = sub.set_tls_required(s.require_tls);
                if was != s.require_tls {
                    tracing::info!(nqn = %s.nqn, require_tls = s.require_tls, controllers_closed = closed.len(), "TLS requirement changed in the configuration file (controllers without TLS closed)");
                    // It decides which listeners the discovery log offers the subsystem on.
                    target.discovery_changed();
                }
            }
        }
        self.current = new;
        summary
    }
}

/// The listeners a file declares.
pub fn listeners_of(config: &Config) -> BTreeSet<PushedListener> {
    let tcp = config
        .listen_addrs()
        .into_iter()
        .map(|addr| PushedListener {
            rdma: false,
            addr,
            secure: config
                .listeners
                .iter()
                .any(|c| c.secure && c.transport != "rdma" && c.socket_addr().ok() == Some(addr)),
        });
    let rdma = config
        .rdma_listen_addrs()
        .into_iter()
        .map(|addr| PushedListener {
            rdma: true,
            addr,
            secure: false,
        });
    tcp.chain(rdma).collect()
}

/// The file's listeners that the discovery log does not list yet, added with port IDs no
/// listener has (a removed listener leaves it in main.rs' `Listeners::forget`).
fn add_to_discovery_log(target: &Target, config: &Config) {
    for l in listeners_of(config) {
        let transport = if l.rdma {
            TransportType::Rdma
        } else {
            TransportType::Tcp
        };
        let address = l.addr.ip().to_string();
        let known = target.listeners();
        if known
            .iter()
            .any(|k| k.transport == transport && k.address == address && k.port == l.addr.port())
        {
            continue;
        }
        let Some(port_id) =
            (1..=MAX_FILE_PORT_ID).find(|id| known.iter().all(|k| k.port_id != *id))
        else {
            continue;
        };
        let secure = transport == TransportType::Tcp
            && config
                .listeners
                .iter()
                .any(|c| c.secure && c.transport != "rdma" && c.socket_addr().ok() == Some(l.addr));
        target.secure_listeners.set(&address, l.addr.port(), secure);
        target.add_listener(ListenerInfo {
            transport,
            address,
            port: l.addr.port(),
            port_id,
        });
    }
}

/// The settings that differ and cannot change in a running gateway, by field.
fn not_live_changes(old: &Config, new: &Config) -> Vec<String> {
    let mut out = Vec::new();
    macro_rules! fields {
        ($section:literal, $old:expr, $new:expr, [$($field:ident),* $(,)?]) => {{
            let before = out.len();
            $(
                if $old.$field != $new.$field {
                    out.push(concat!($section, ".", stringify!($field)).to_string());
                }
            )*
            // A field added to the section since this list was written.
            if out.len() == before && $old != $new {
                out.push(format!("[{}]", $section));
            }
        }};
    }
    // Busy polling as it takes effect: unset and the default value are the same setting, and
    // with polling off (0) the adaptive flag means nothing.
    let effective = |c: &Config| {
        let mut g = c.gateway.clone();
        let poll = c.tcp_busy_poll();
        g.tcp_busy_poll_us = Some(poll.map_or(0, |p| {
            u32::try_from(p.window.as_micros()).unwrap_or(u32::MAX)
        }));
        g.tcp_busy_poll_adaptive = poll.map(|p| p.adaptive);
        g
    };
    let (og, ng) = (&effective(old), &effective(new));
    fields!(
        "gateway",
        og,
        ng,
        [
            name,
            cntlid_min,
            cntlid_max,
            worker_threads,
            metrics_listen,
            tcp_busy_poll_us,
            tcp_busy_poll_adaptive,
            tcp_data_budget,
            dhchap_hashes,
            dhchap_dhgroups,
            reservations,
        ]
    );
    let default_ceph = Default::default();
    let (oc, nc) = (
        old.ceph.as_ref().unwrap_or(&default_ceph),
        new.ceph.as_ref().unwrap_or(&default_ceph),
    );
    fields!(
        "ceph",
        oc,
        nc,
        [
            conf,
            keyring,
            client_name,
            cluster,
            args,
            options,
            use_ceph_args_env,
            connections,
        ]
    );
    match (&old.group, &new.group) {
        (Some(og), Some(ng)) => fields!(
            "group",
            og,
            ng,
            [
                control_plane,
                ana_group,
                beacon_interval_ms,
                stall_window_ms,
                tls_ca,
                tls_cert,
                tls_key,
            ]
        ),
        (None, None) => {}
        _ => out.push("[group]".into()),
    }
    // A socket is bound as TLS or plain: the listener must be deleted (a reload) and added
    // again (another one), or the gateway restarted.
    let (before, after) = (listeners_of(old), listeners_of(new));
    for (i, l) in new.listeners.iter().enumerate() {
        let Ok(addr) = l.socket_addr() else {
            continue;
        };
        let flipped = |set: &BTreeSet<PushedListener>, secure: bool| {
            set.iter()
                .any(|p| !p.rdma && p.addr == addr && p.secure == secure)
        };
        if l.transport != "rdma" && flipped(&before, !l.secure) && flipped(&after, l.secure) {
            out.push(format!("listener[{i}].secure"));
        }
    }
    for (i, s) in new.subsystems.iter().enumerate() {
        let Some(o) = old.subsystems.iter().find(|o| o.nqn == s.nqn) else {
            continue;
        };
        if o.serial != s.serial {
            out.push(format!("subsystem[{i}].serial"));
        }
        if o.model != s.model {
            out.push(format!("subsystem[{i}].model"));
        }
    }
    out
}

/// The subsystems and namespaces a new file adds, changes and removes.
struct Diff {
    /// NQNs of subsystems new in the file.
    added_subsystems: BTreeSet<String>,
    /// New namespaces of subsystems served already.
    added_namespaces: usize,
    /// Namespaces whose settings changed (the NSID stays; the device is opened again).
    changed_namespaces: usize,
    /// Namespaces whose QoS limits only changed (applied live).
    qos_changed_namespaces: usize,
}

impl Diff {
    fn new(old: &Config, new: &Config) -> Self {
        let mut diff = Diff {
            added_subsystems: BTreeSet::new(),
            added_namespaces: 0,
            changed_namespaces: 0,
            qos_changed_namespaces: 0,
        };
        for s in &new.subsystems {
            let Some(o) = old.subsystems.iter().find(|o| o.nqn == s.nqn) else {
                diff.added_subsystems.insert(s.nqn.clone());
                continue;
            };
            for ns in &s.namespaces {
                match o.namespaces.iter().find(|n| n.nsid == ns.nsid) {
                    None => diff.added_namespaces += 1,
                    // The hosts that see it and its QoS limits change without a new
                    // device.
                    Some(on) if !on.same_device(ns) => diff.changed_namespaces += 1,
                    Some(on) if on.qos_differs(ns) => diff.qos_changed_namespaces += 1,
                    Some(_) => {}
                }
            }
        }
        diff
    }
}

/// Gives every namespace of `config` its QoS limits (live: the next op is held to them).
fn apply_file_qos(target: &Target, config: &Config) {
    for s in &config.subsystems {
        let Some(sub) = target.subsystem(&s.nqn) else {
            continue;
        };
        for n in &s.namespaces {
            let Some(ns) = sub.namespace(n.nsid) else {
                continue;
            };
            let limits = n.qos_limits();
            if ns.qos.set_limits(limits) {
                tracing::info!(nqn = %s.nqn, nsid = n.nsid, qos = %limits, "QoS limits changed {ORIGIN}");
            }
        }
    }
}

/// Whether the subsystems (with their hosts and namespaces) differ, whatever their order.
fn subsystems_differ(old: &Config, new: &Config) -> bool {
    let by_nqn = |c: &Config| -> Vec<SubsystemConfig> {
        let mut v = c.subsystems.clone();
        v.sort_by(|a, b| a.nqn.cmp(&b.nqn));
        for s in &mut v {
            s.namespaces.sort_by_key(|n| n.nsid);
        }
        v
    };
    by_nqn(old) != by_nqn(new)
}

/// The configuration to build for a reload from `old` to `new`: the new subsystems whole, and
/// the subsystems served already with only their new or changed namespaces (listeners as the
/// new file's: the built target's are not used); with each built namespace's field in the
/// new file, in build order. None: nothing to open.
fn to_build(old: &Config, new: &Config) -> Option<(Config, Vec<Vec<String>>)> {
    let mut config = new.clone();
    config.subsystems = Vec::new();
    let mut fields = Vec::new();
    for (i, s) in new.subsystems.iter().enumerate() {
        let existing = old.subsystems.iter().find(|o| o.nqn == s.nqn);
        let wanted: Vec<(usize, &NamespaceConfig)> = s
            .namespaces
            .iter()
            .enumerate()
            // A namespace whose visible hosts or QoS limits only changed is not opened
            // again: those change live (`apply_file_qos`, the visibility pass).
            .filter(|(_, ns)| {
                existing.is_none_or(|o| !o.namespaces.iter().any(|on| on.same_device(ns)))
            })
            .collect();
        if existing.is_some() && wanted.is_empty() {
            continue;
        }
        fields.push(
            wanted
                .iter()
                .map(|(j, _)| format!("subsystem[{i}].namespace[{j}]"))
                .collect(),
        );
        config.subsystems.push(SubsystemConfig {
            namespaces: wanted.into_iter().map(|(_, ns)| ns.clone()).collect(),
            ..s.clone()
        });
    }
    (!config.subsystems.is_empty()).then_some((config, fields))
}

/// Opens what `config` declares (blocking work off the runtime); a namespace that does not
/// open refuses the reload (its devices close when dropped). `fields[i][j]`: the field in the
/// reloaded file of `config.subsystems[i].namespaces[j]`.
async fn build(config: Config, fields: &[Vec<String>]) -> Result<Arc<Target>, ReloadError> {
    let (built, skipped) = tokio::task::spawn_blocking(move || config.build_target_report())
        .await
        .map_err(|e| ReloadError::Build(e.to_string()))??;
    if let Some(k) = skipped.first() {
        let field = fields
            .get(k.subsystem_index)
            .and_then(|f| f.get(k.namespace_index))
            .cloned()
            .unwrap_or_else(|| k.field.clone());
        return Err(ReloadError::Open {
            field,
            nqn: k.nqn.clone(),
            nsid: k.nsid,
            device: k.device.clone(),
            error: k.error.clone(),
        });
    }
    Ok(built)
}

/// What a reloaded file wants: its subsystems, their namespaces and hosts.
struct FileWanted<'a>(&'a Config);

impl FileWanted<'_> {
    fn subsystem(&self, nqn: &str) -> Option<&SubsystemConfig> {
        self.0.subsystems.iter().find(|s| s.nqn == nqn)
    }
}

impl apply::Wanted for FileWanted<'_> {
    fn keeps_subsystem(&self, nqn: &str) -> bool {
        self.subsystem(nqn).is_some()
    }

    /// By NSID: a namespace whose device changed under its NSID is replaced by the reload's
    /// build (with the identity of its new settings, see `config::build`).
    fn keeps_namespace(&self, nqn: &str, ns: &crate::core::Namespace) -> bool {
        self.subsystem(nqn).is_some_and(|s| {
            s.namespaces
                .iter()
                .any(|n: &NamespaceConfig| n.nsid == ns.nsid)
        })
    }

    fn hosts(&self, nqn: &str) -> Option<WantedHosts> {
        self.subsystem(nqn)
            .map(|s| WantedHosts::from_config(s.allow_any_host, &s.hosts))
    }

    fn visibility(&self, nqn: &str, nsid: u32) -> Option<crate::core::Visibility> {
        self.subsystem(nqn)?
            .namespaces
            .iter()
            .find(|n| n.nsid == nsid)
            .map(NamespaceConfig::visibility)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scratch::ScratchDir;

    const LISTENER: &str =
        "[[listener]]\ntransport = \"tcp\"\naddress = \"127.0.0.1\"\nport = 4420\n";

    fn subsystem(nqn: &str, extra: &str) -> String {
        format!(
            "\n[[subsystem]]\nnqn = \"{nqn}\"\nallow_any_host = true\n{extra}\n[[subsystem.namespace]]\nnsid = 1\nbackend = \"memory\"\nsize = \"1MiB\"\n"
        )
    }

    /// A reloader of `first` (written to a fresh file), then `second` written over it; with
    /// the file's directory, which must outlive it.
    fn reloader(name: &str, first: &str, second: &str) -> (Reloader, ScratchDir) {
        let dir = ScratchDir::new(&format!("nvmeof-reload-unit-{name}"));
        let path = dir.join("gateway.toml");
        std::fs::write(&path, first).expect("write");
        let current = Config::load(&path).expect("first file valid");
        std::fs::write(&path, second).expect("write");
        (Reloader::new(&path, current), dir)
    }

    #[test]
    fn settings_that_cannot_change_live_are_named() {
        let old = Config::from_toml_str(&format!(
            "[gateway]\nname = \"a\"\n{LISTENER}{}",
            subsystem("nqn.2016-06.io.x:a", "serial = \"S1\"")
        ))
        .expect("valid");
        let new = Config::from_toml_str(&format!(
            "[gateway]\nname = \"b\"\nworker_threads = 2\n[ceph]\ncluster = \"other\"\n{LISTENER}{}",
            subsystem("nqn.2016-06.io.x:a", "serial = \"S2\"")
        ))
        .expect("valid");
        assert_eq!(
            not_live_changes(&old, &new),
            [
                "gateway.name",
                "gateway.worker_threads",
                "ceph.cluster",
                "subsystem[0].serial"
            ]
        );
        assert!(not_live_changes(&old, &old).is_empty());
    }

    #[test]
    fn busy_polling_is_compared_as_it_takes_effect() {
        let sub = subsystem("nqn.2016-06.io.x:a", "");
        let with = |gateway: &str| {
            Config::from_toml_str(&format!("[gateway]\n{gateway}\n{LISTENER}{sub}")).expect("valid")
        };
        let default = with("");
        let explicit = with(&format!(
            "tcp_busy_poll_us = {}\ntcp_busy_poll_adaptive = true",
            crate::config::DEFAULT_TCP_BUSY_POLL_US
        ));
        assert!(
            not_live_changes(&default, &explicit).is_empty(),
            "the default, written out, is no change"
        );
        let off = with("tcp_busy_poll_us = 0");
        assert_eq!(
            not_live_changes(&default, &off),
            ["gateway.tcp_busy_poll_us", "gateway.tcp_busy_poll_adaptive"]
        );
        let off_adaptive = with("tcp_busy_poll_us = 0\ntcp_busy_poll_adaptive = false");
        assert!(
            not_live_changes(&off, &off_adaptive).is_empty(),
            "the adaptive flag of polling that is off"
        );
        let always = with("tcp_busy_poll_adaptive = false");
        assert_eq!(
            not_live_changes(&default, &always),
            ["gateway.tcp_busy_poll_adaptive"]
        );
        assert_eq!(
            not_live_changes(&default, &with("tcp_busy_poll_us = 200")),
            ["gateway.tcp_busy_poll_us"]
        );
    }

    #[test]
    fn a_listener_turning_secure_or_plain_is_not_live() {
        let sub = subsystem("nqn.2016-06.io.x:a", "");
        let plain = Config::from_toml_str(&format!("{LISTENER}{sub}")).expect("valid");
        let secure =
            Config::from_toml_str(&format!("{LISTENER}secure = true\n{sub}")).expect("valid");
        assert_eq!(not_live_changes(&plain, &secure), ["listener[0].secure"]);
        assert_eq!(not_live_changes(&secure, &plain), ["listener[0].secure"]);
        assert!(not_live_changes(&secure, &secure).is_empty());
        // The socket's kind follows the file.
        assert!(listeners_of(&secure).iter().all(|l| l.secure));
        assert!(listeners_of(&plain).iter().all(|l| !l.secure));
    }

    #[tokio::test]
    async fn qos_limits_change_live_without_reopening_the_device() {
        let nqn = "nqn.2016-06.io.x:qos";
        let first = format!("{LISTENER}{}", subsystem(nqn, ""));
        let limited = format!("{first}rw_ios_per_second = 2000\nw_megabytes_per_second = 40\n");
        let (mut r, _r_dir) = reloader("qos", &first, &limited);
        let target = r.current.build_target().expect("target");
        let before = target
            .subsystem(nqn)
            .and_then(|s| s.namespace(1))
            .expect("ns");
        assert!(!before.qos.is_limited());
        let Ok(Prepared::Apply(plan)) = r.prepare().await else {
            panic!("the new limits are a change");
        };
        assert!(plan.built.is_none(), "no device to open for new limits");
        let summary = r.apply(&target, plan).await;
        assert_eq!(
            (summary.namespaces_qos_changed, summary.namespaces_changed),
            (1, 0)
        );
        let after = target
            .subsystem(nqn)
            .and_then(|s| s.namespace(1))
            .expect("ns");
        assert!(
            Arc::ptr_eq(&before, &after),
            "the namespace was not replaced"
        );
        let want = crate::core::qos::QosLimits {
            rw_ios_per_second: 2000,
            w_megabytes_per_second: 40,
            ..crate::core::qos::QosLimits::UNLIMITED
        };
        assert_eq!(after.qos.limits(), want);
        // Back to no limits.
        std::fs::write(r.path(), &first).expect("write");
        let Ok(Prepared::Apply(plan)) = r.prepare().await else {
            panic!("cleared limits are a change");
        };
        r.apply(&target, plan).await;
        assert!(!after.qos.is_limited());
    }

    #[test]
    fn bad_qos_limits_are_refused_with_their_field() {
        let nqn = "nqn.2016-06.io.x:qos";
        for (bad, field) in [
            ("rw_ios_per_second = 3", "rw_ios_per_second"),
            (
                "r_megabytes_per_second = 99999999",
                "r_megabytes_per_second",
            ),
        ] {
            let text = format!("{LISTENER}{}{bad}\n", subsystem(nqn, ""));
            let config: Config = toml::from_str(&text).expect("parses");
            let e = config.validate().expect_err("refused").to_string();
            assert!(
                e.contains(&format!("subsystem[0].namespace[0].{field}")),
                "{e}"
            );
        }
    }

    #[tokio::test]
    async fn the_same_subsystems_in_another_order_change_nothing() {
        let (a, b) = (
            subsystem("nqn.2016-06.io.x:a", ""),
            subsystem("nqn.2016-06.io.x:b", ""),
        );
        let (r, _r_dir) = reloader(
            "order",
            &format!("{LISTENER}{a}{b}"),
            &format!("{LISTENER}{b}{a}"),
        );
        assert!(matches!(r.prepare().await, Ok(Prepared::Unchanged)));
    }

    /// `require_tls` turned on by a reload closes the subsystem's plain controllers and keeps
    /// those whose queues all came over TLS; turned off again, it closes nothing.
    #[tokio::test]
    async fn a_reload_requiring_tls_closes_the_plain_controllers_only() {
        let nqn = "nqn.2016-06.io.x:tls";
        let plain = format!("{LISTENER}{}", subsystem(nqn, ""));
        let required = format!("{LISTENER}{}", subsystem(nqn, "require_tls = true"));
        let target = Config::from_toml_str(&plain)
            .expect("valid")
            .build_target()
            .expect("target");
        let sub = target.subsystem(nqn).expect("subsystem");
        let connect = |host: &str, secure: bool| {
            let c = sub
                .register_controller(|id| {
                    Arc::new(crate::core::Controller::new(
                        id,
                        sub.clone(),
                        target.clone(),
                        host.into(),
                        [0; 16],
                        0,
                        crate::core::TransportCaps {
                            in_capsule_data_size: 8192,
                            keyed_sgls: false,
                        },
                    ))
                })
                .expect("a controller ID");
            if !secure {
                c.note_plain_queue();
            }
            c
        };
        let clear = connect("nqn.2014-08.org.nvmexpress:uuid:clear", false);
        let tls = connect("nqn.2014-08.org.nvmexpress:uuid:tls", true);

        let (mut r, _r_dir) = reloader("require-tls", &plain, &required);
        let Ok(Prepared::Apply(plan)) = r.prepare().await else {
            panic!("require_tls changed: a reload to apply");
        };
        r.apply(&target, plan).await;
        assert!(sub.tls.required());
        assert!(clear.is_torn_down(), "the plain controller is closed");
        assert!(!tls.is_torn_down(), "the TLS controller stays");

        let (mut back, _back_dir) = reloader("require-tls-off", &required, &plain);
        let Ok(Prepared::Apply(plan)) = back.prepare().await else {
            panic!("require_tls changed: a reload to apply");
        };
        back.apply(&target, plan).await;
        assert!(!sub.tls.required());
        assert!(!tls.is_torn_down());
    }

    /// A reload that changes only who sees a namespace keeps its device and tells only the
    /// hosts whose view changed (the core's tests check whom); the NSID stays served.
    #[tokio::test]
    async fn a_reload_changes_a_namespaces_hosts_without_reopening_it() {
        let nqn = "nqn.2016-06.io.x:vis";
        let host = "nqn.2014-08.org.nvmexpress:uuid:only";
        let first = format!("{LISTENER}{}", subsystem(nqn, ""));
        let second = format!("{first}auto_visible = false\nhosts = [\"{host}\"]\n");
        let (mut r, _r_dir) = reloader("visibility", &first, &second);
        let target = Config::from_toml_str(&first)
            .expect("valid")
            .build_target()
            .expect("target");
        let sub = target.subsystem(nqn).expect("subsystem");
        let device = sub.namespace(1).expect("ns").device.clone();
        let Ok(Prepared::Apply(plan)) = r.prepare().await else {
            panic!("the hosts changed: a reload to apply");
        };
        let summary = r.apply(&target, plan).await;
        assert_eq!(summary.visibility_changed, 1);
        assert_eq!(summary.namespaces_changed, 0, "{summary:?}");
        assert!(sub.namespace_for_host(1, host).is_some());
        assert!(sub
            .namespace_for_host(1, "nqn.2014-08.org.nvmexpress:uuid:other")
            .is_none());
        let same = sub.namespace(1).expect("still served").device.clone();
        assert!(Arc::ptr_eq(&device, &same), "the device was not reopened");
    }

    #[tokio::test]
    async fn a_group_gateway_refuses_changes_of_what_the_control_plane_manages() {
        let head = format!(
            "[gateway]\nname = \"gw1\"\n[group]\ncontrol_plane = [\"127.0.0.1:5500\"]\n{LISTENER}"
        );
        let a = subsystem("nqn.2016-06.io.x:a", "");
        let b = subsystem("nqn.2016-06.io.x:b", "");
        let (r, _r_dir) = reloader("group", &format!("{head}{a}"), &format!("{head}{a}{b}"));
        match r.prepare().await {
            Err(e @ ReloadError::GroupManaged(_)) => {
                assert!(e.to_string().contains("come from the control plane"), "{e}")
            }
            Err(e) => panic!("expected a refusal for the group, got {e}"),
            Ok(_) => panic!("expected a refusal for the group"),
        }
        let (same, _same_dir) =
            reloader("group-same", &format!("{head}{a}"), &format!("{head}{a}"));
        assert!(matches!(same.prepare().await, Ok(Prepared::Unchanged)));
    }
}
