//! The gateway's configuration file (TOML), validated before anything starts.
//!
//! Files: this one (the sections as read, `load`), `address.rs` (listener and metrics
//! addresses), `validate.rs` (everything checked before start), `build.rs` (the target built
//! from it: subsystems, namespaces, opening RBD images and retrying those that fail).

mod address;
mod build;
#[cfg(test)]
mod tests;
mod validate;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use rbd_backend::rbd::{CephSettings, ImageSpec};
use serde::Deserialize;

use crate::auth::{DhGroup, DhchapSecret, HashFunction};
use crate::core::tls::HostPsk;
use crate::core::{AuthPolicy, HostKeys};
use crate::spec::cntlid;
use address::{metrics_socket_addr, parse_listen_address, with_port_example};
use nvme_auth::tls_psk::{ConfiguredPsk, LabelEncoding};

pub use build::OPEN_STALL_TIMEOUT;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: {source}")]
    Parse {
        path: String,
        source: toml::de::Error,
    },
    #[error("{field}: {problem}")]
    Invalid { field: String, problem: String },
}

fn invalid(field: impl Into<String>, problem: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field: field.into(),
        problem: problem.into(),
    }
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct GatewaySection {
    /// Name in logs and (later) in the gateway group.
    #[serde(default)]
    pub name: Option<String>,
    /// This gateway's controller ID range; gateways of a group use disjoint ranges.
    #[serde(default)]
    pub cntlid_min: Option<u16>,
    #[serde(default)]
    pub cntlid_max: Option<u16>,
    /// Runtime worker threads (default: one per CPU).
    #[serde(default)]
    pub worker_threads: Option<usize>,
    /// Where Prometheus scrapes `/metrics` (`0.0.0.0:10008`, `[::1]:10008`); unset: no
    /// metrics endpoint.
    #[serde(default)]
    pub metrics_listen: Option<String>,
    /// Microseconds an NVMe/TCP queue keeps polling its socket after it received a command,
    /// before it sleeps (unset: [`DEFAULT_TCP_BUSY_POLL_US`]; 0: never polls). Trades CPU
    /// for QD1 latency where waking a sleeping thread is slow (a VM whose idle vCPUs halt):
    /// see `tcp::connection`.
    #[serde(default)]
    pub tcp_busy_poll_us: Option<u32>,
    /// Each queue measures whether polling makes its host's commands come faster and polls
    /// only then (default); `false`: it always polls (within the window).
    #[serde(default)]
    pub tcp_busy_poll_adaptive: Option<bool>,
    /// Bytes of data buffers all NVMe/TCP queues together may hold for hosts' commands
    /// ("256MiB", the default); beyond it a command waits for buffers to be released
    /// instead of growing the gateway (see `core::budget`). At least MDTS (1 MiB).
    #[serde(default)]
    pub tcp_data_budget: Option<String>,
    /// Hashes in-band authentication (DH-HMAC-CHAP) accepts, in order of preference:
    /// `sha256`, `sha384`, `sha512` (default: all, strongest first).
    #[serde(default)]
    pub dhchap_hashes: Option<Vec<String>>,
    /// DH groups it accepts, in order of preference: `ffdhe2048` ... `ffdhe8192`, `null`
    /// (none: the host's key alone). Default: every group, cheapest first, `null` last; leave
    /// `null` out to require a key exchange.
    #[serde(default)]
    pub dhchap_dhgroups: Option<Vec<String>>,
    /// Namespaces offer reservations (Register, Acquire, Release, Report): default true. In a
    /// gateway group the ANA owner of a namespace stores every change with the namespace's
    /// image before completing it, and the next owner loads it (see `core::pr`).
    #[serde(default)]
    pub reservations: Option<bool>,
}

impl GatewaySection {
    /// `dhchap_hashes` and `dhchap_dhgroups` as the core takes them.
    pub fn auth_policy(&self) -> Result<AuthPolicy, ConfigError> {
        let mut policy = AuthPolicy::default();
        if let Some(names) = &self.dhchap_hashes {
            policy.hashes = parse_preferences(
                "gateway.dhchap_hashes",
                names,
                HashFunction::from_name,
                "sha256, sha384, sha512",
            )?;
        }
        if let Some(names) = &self.dhchap_dhgroups {
            policy.dhgroups = parse_preferences(
                "gateway.dhchap_dhgroups",
                names,
                DhGroup::from_name,
                "ffdhe2048, ffdhe3072, ffdhe4096, ffdhe6144, ffdhe8192, null",
            )?;
        }
        Ok(policy)
    }
}

/// A non-empty list of known names without repeats, in order.
fn parse_preferences<T: PartialEq>(
    field: &str,
    names: &[String],
    parse: impl Fn(&str) -> Option<T>,
    known: &str,
) -> Result<Vec<T>, ConfigError> {
    if names.is_empty() {
        return Err(invalid(field, format!("must name at least one of {known}")));
    }
    let mut out = Vec::new();
    for name in names {
        let value =
            parse(name).ok_or_else(|| invalid(field, format!("{name:?} is not one of {known}")))?;
        if out.contains(&value) {
            return Err(invalid(field, format!("{name:?} is listed twice")));
        }
        out.push(value);
    }
    Ok(out)
}

/// Upper bound of `[gateway] tcp_busy_poll_us`: longer than any op worth polling for.
pub const MAX_TCP_BUSY_POLL_US: u32 = 10_000;
/// `[gateway] tcp_busy_poll_us` when unset. Polling is on by default because it only ever
/// follows the host's bytes (an idle queue spins nothing) and the adaptive choice keeps it
/// only where it makes the host faster. The window is short, so a queue whose host pauses
/// wastes little (at most this much CPU per read), and long enough for a QD1 host to send
/// its next command after an in-memory read: in the tcp_loopback bench, on 2 loaded
/// shared cores, windows of 10, 20, 50 and 100 µs caught 0.80, 0.83, 0.98 and 0.99 of the
/// commands (docs/performance.md, "Busy polling by default").
pub const DEFAULT_TCP_BUSY_POLL_US: u32 = 50;

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ListenerConfig {
    pub transport: String,
    /// A numeric address: `192.0.2.10`, `::1` or `[::1]`; it may carry the port, as in
    /// `192.0.2.10:4420` or `[::]:4420`.
    pub address: String,
    /// Required unless `address` carries the port.
    #[serde(default)]
    pub port: Option<u16>,
    /// A secure listener (NVMe/TCP only): every connection must first complete a TLS 1.3
    /// handshake with a host's PSK (`psk` of a host entry); the discovery log says TLS is
    /// required here.
    #[serde(default)]
    pub secure: bool,
}

impl ListenerConfig {
    /// The socket address to listen on; Err names the field at fault (`address` or `port`)
    /// and the problem.
    pub fn socket_addr(&self) -> Result<SocketAddr, (&'static str, String)> {
        let (ip, in_address) = parse_listen_address(&self.address).map_err(|e| ("address", e))?;
        let port = match (in_address, self.port) {
            (Some(a), Some(p)) if a != p => {
                return Err((
                    "port",
                    format!("{p} differs from the port in address {:?}", self.address),
                ))
            }
            (Some(p), _) | (None, Some(p)) => p,
            (None, None) => {
                return Err((
                    "port",
                    format!(
                        "missing: give `port = 4420` or put it in the address ({})",
                        with_port_example(ip, &self.address, 4420)
                    ),
                ))
            }
        };
        if port == 0 {
            return Err(("port", "must not be 0".into()));
        }
        Ok(SocketAddr::new(ip, port))
    }
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct NamespaceConfig {
    pub nsid: u32,
    pub backend: String,
    /// Size with a unit: "1GiB", "256MiB", "4096" (bytes).
    #[serde(default)]
    pub size: Option<String>,
    #[serde(default = "default_block_size")]
    pub block_size: u32,
    #[serde(default = "default_ana_group")]
    pub ana_group: u32,
    #[serde(default)]
    pub read_only: bool,
    /// Namespace UUID (hyphenated). Absent: derived from the subsystem NQN, the NSID and
    /// the device (an RBD image's pool, RADOS namespace and name), so it is the same on every
    /// gateway and after restarts, and another image under the same NSID gets another one
    /// (see `config::build`). A group gateway's pushed namespaces carry the control plane's.
    #[serde(default)]
    pub uuid: Option<String>,
    /// Namespace NGUID (32 hex digits). Absent: derived as `uuid` is.
    #[serde(default)]
    pub nguid: Option<String>,
    /// `backend = "rbd"`: the Ceph pool of the image.
    #[serde(default)]
    pub pool: Option<String>,
    /// `backend = "rbd"`: RADOS namespace inside the pool (default: none).
    #[serde(default)]
    pub rados_namespace: Option<String>,
    /// `backend = "rbd"`: the RBD image; its size is the namespace size (`rbd resize` is
    /// reported to connected hosts).
    #[serde(default)]
    pub image: Option<String>,
    /// Whether every host allowed on the subsystem sees the namespace (the default); false:
    /// only the `hosts` named here (see `core::visibility`). Changed by a reload without
    /// reopening the device.
    #[serde(default = "default_auto_visible")]
    pub auto_visible: bool,
    /// With `auto_visible = false`: the host NQNs that see the namespace (at most
    /// [`MAX_HOSTS_PER_NAMESPACE`]; none: no host yet).
    #[serde(default)]
    pub hosts: Vec<String>,
    /// QoS limits (ceph-nvmeof's names; 0 = no limit, a megabyte is 2^20 bytes): read and
    /// write commands per second, and read plus write, read, and write bandwidth in MB/s.
    /// A reload (SIGHUP) that changes only these applies them live.
    #[serde(default)]
    pub rw_ios_per_second: u64,
    #[serde(default)]
    pub rw_megabytes_per_second: u64,
    #[serde(default)]
    pub r_megabytes_per_second: u64,
    #[serde(default)]
    pub w_megabytes_per_second: u64,
    /// Auto-resize off: the size the namespace keeps (pushed by the control plane only; a
    /// configuration file has no such setting).
    #[serde(skip)]
    pub frozen_size: Option<u64>,
}

/// Hosts a namespace may be made visible to (the control plane's limit).
pub const MAX_HOSTS_PER_NAMESPACE: usize = control_plane::visibility::MAX_HOSTS_PER_NAMESPACE;

fn default_auto_visible() -> bool {
    true
}

impl NamespaceConfig {
    /// The hosts that see this namespace.
    pub fn visibility(&self) -> crate::core::Visibility {
        crate::core::Visibility::from_hosts(
            self.auto_visible,
            self.hosts.iter().map(String::as_str),
        )
    }

    /// The namespace's QoS limits.
    pub fn qos_limits(&self) -> crate::core::qos::QosLimits {
        crate::core::qos::QosLimits {
            rw_ios_per_second: self.rw_ios_per_second,
            rw_megabytes_per_second: self.rw_megabytes_per_second,
            r_megabytes_per_second: self.r_megabytes_per_second,
            w_megabytes_per_second: self.w_megabytes_per_second,
        }
    }

    /// Whether `other` serves the same device the same way: equal but for the hosts that see
    /// it, its QoS limits and its frozen size (changed live, without a new device).
    pub fn same_device(&self, other: &NamespaceConfig) -> bool {
        let strip = |n: &NamespaceConfig| NamespaceConfig {
            auto_visible: true,
            hosts: Vec::new(),
            rw_ios_per_second: 0,
            rw_megabytes_per_second: 0,
            r_megabytes_per_second: 0,
            w_megabytes_per_second: 0,
            frozen_size: None,
            ..n.clone()
        };
        strip(self) == strip(other)
    }

    /// Whether `other` has other QoS limits than this namespace.
    pub fn qos_differs(&self, other: &NamespaceConfig) -> bool {
        self.qos_limits() != other.qos_limits()
    }
}

/// A Ceph option value in `[ceph.options]`: `rados_osd_op_timeout = 30`, `rbd_cache = false`.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum CephOptionValue {
    Text(String),
    Integer(i64),
    Float(f64),
    Bool(bool),
}

impl std::fmt::Display for CephOptionValue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CephOptionValue::Text(s) => f.write_str(s),
            CephOptionValue::Integer(i) => write!(f, "{i}"),
            CephOptionValue::Float(x) => write!(f, "{x}"),
            CephOptionValue::Bool(b) => write!(f, "{b}"),
        }
    }
}

/// `[ceph]`: how RBD namespaces reach the cluster, in the terms of Ceph's own tools.
///
/// Precedence (lowest first): the conf file, `$CEPH_ARGS` (unless `use_ceph_args_env =
/// false`), the gateway's defaults (`rbd_cache=false`, `client_mount_timeout=30`), `args`,
/// `options`.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CephSection {
    /// ceph.conf path (default: `$CEPH_CONF`, then /etc/ceph/$cluster.conf and Ceph's search
    /// list).
    #[serde(default)]
    pub conf: Option<String>,
    /// Keyring path (default: what the conf file or `$CEPH_KEYRING` say).
    #[serde(default)]
    pub keyring: Option<String>,
    /// Client entity: `client.admin`, `client.nvmeof` or just `nvmeof`.
    #[serde(default)]
    pub client_name: Option<String>,
    /// Cluster name (default `ceph`).
    #[serde(default)]
    pub cluster: Option<String>,
    /// CEPH_ARGS-style options: `"--rados_osd_op_timeout=30 --ms_crc_data=false"`.
    #[serde(default)]
    pub args: Option<String>,
    /// Single options, applied last.
    #[serde(default)]
    pub options: std::collections::BTreeMap<String, CephOptionValue>,
    /// Apply `$CEPH_ARGS` from the environment (default true).
    #[serde(default)]
    pub use_ceph_args_env: Option<bool>,
    /// Cluster connections (`rados_t`) the images are spread over (default: one per CPU, at
    /// most 8).
    #[serde(default)]
    pub connections: Option<usize>,
}

impl CephSection {
    /// The backend's settings for this section.
    pub fn settings(&self) -> CephSettings {
        let d = CephSettings::default();
        CephSettings {
            cluster: self.cluster.clone().unwrap_or(d.cluster),
            client_name: self.client_name.clone().unwrap_or(d.client_name),
            conf: self.conf.as_ref().map(Into::into),
            keyring: self.keyring.as_ref().map(Into::into),
            use_ceph_args_env: self.use_ceph_args_env.unwrap_or(true),
            args: self
                .args
                .as_deref()
                .unwrap_or("")
                .split_whitespace()
                .map(str::to_string)
                .collect(),
            options: self
                .options
                .iter()
                .map(|(k, v)| (k.clone(), v.to_string()))
                .collect(),
            max_connections: self.connections.unwrap_or(d.max_connections),
        }
    }
}

/// A namespace that [`Config::build_target_report`] left out because its device could not be
/// opened (e.g. a missing RBD image). The other namespaces are served.
#[derive(Debug, Clone)]
pub struct SkippedNamespace {
    /// `subsystem[0].namespace[1]`
    pub field: String,
    /// Indexes into `subsystems` and its `namespaces`.
    pub subsystem_index: usize,
    pub namespace_index: usize,
    pub nqn: String,
    pub nsid: u32,
    /// `pool/image`
    pub device: String,
    pub error: String,
}

fn default_block_size() -> u32 {
    512
}

fn default_ana_group() -> u32 {
    1
}

/// An allowed host: `"nqn..."`, or `{ nqn = "nqn...", dhchap_key = "DHHC-1:..." }` for a
/// host that must authenticate (in-band, DH-HMAC-CHAP) before anything else.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(try_from = "toml::Value")]
pub enum HostEntry {
    Nqn(String),
    WithKeys(HostTable),
}

/// A host entry's table form. `Debug` leaves the keys out.
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostTable {
    pub nqn: String,
    /// The host's secret (`nvme connect --dhchap-secret`), `DHHC-1:XX:...:` as `nvme
    /// gen-dhchap-key` prints it.
    #[serde(default)]
    pub dhchap_key: Option<String>,
    /// The gateway's secret, which it proves itself with to a host that asks
    /// (`nvme connect --dhchap-ctrl-secret`); needs `dhchap_key`.
    #[serde(default)]
    pub dhchap_ctrl_key: Option<String>,
    /// The host's TLS pre-shared key for secure listeners, `NVMeTLSkey-1:HH:...:` as `nvme
    /// gen-tls-key` prints it.
    #[serde(default)]
    pub psk: Option<String>,
    /// How the host's nvme-cli derives its TLS keys from `psk`: `rfc8446` (the NVMe/TCP
    /// specification's HKDF-Expand-Label, libnvme since August 2025, the default) or
    /// `libnvme-compat` (older libnvme, e.g. Debian trixie's nvme-cli 2.13).
    #[serde(default)]
    pub psk_derivation: Option<String>,
}

impl std::fmt::Debug for HostTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostTable")
            .field("nqn", &self.nqn)
            .field("dhchap_key", &self.dhchap_key.as_ref().map(|_| "<set>"))
            .field(
                "dhchap_ctrl_key",
                &self.dhchap_ctrl_key.as_ref().map(|_| "<set>"),
            )
            .field("psk", &self.psk.as_ref().map(|_| "<set>"))
            .field("psk_derivation", &self.psk_derivation)
            .finish()
    }
}

impl TryFrom<toml::Value> for HostEntry {
    type Error = String;

    fn try_from(value: toml::Value) -> Result<Self, Self::Error> {
        match value {
            toml::Value::String(nqn) => Ok(HostEntry::Nqn(nqn)),
            toml::Value::Table(table) => toml::Value::Table(table)
                .try_into()
                .map(HostEntry::WithKeys)
                .map_err(|e: toml::de::Error| e.message().to_string()),
            other => Err(format!(
                "a host is an NQN string or a table {{ nqn = ..., dhchap_key = ... }}, not a {}",
                other.type_str()
            )),
        }
    }
}

impl HostEntry {
    pub fn nqn(&self) -> &str {
        match self {
            HostEntry::Nqn(nqn) => nqn,
            HostEntry::WithKeys(table) => &table.nqn,
        }
    }

    /// The host's TLS PSK, if it has one; Err names the field at fault (`psk` or
    /// `psk_derivation`) and why, without the key.
    pub fn tls_psk(&self) -> Result<Option<HostPsk>, (&'static str, String)> {
        let HostEntry::WithKeys(table) = self else {
            return Ok(None);
        };
        let derivation = match table.psk_derivation.as_deref() {
            None => LabelEncoding::default(),
            Some(name) => LabelEncoding::from_name(name).ok_or_else(|| {
                (
                    "psk_derivation",
                    format!("{name:?} is not one of rfc8446, libnvme-compat"),
                )
            })?,
        };
        match table.psk.as_deref() {
            Some(text) => Ok(Some(HostPsk {
                psk: ConfiguredPsk::parse(text).map_err(|e| ("psk", e.to_string()))?,
                derivation,
            })),
            None if table.psk_derivation.is_some() => Err((
                "psk_derivation",
                "needs psk: it says how the host derives its TLS keys from it".into(),
            )),
            None => Ok(None),
        }
    }

    /// The host's DH-HMAC-CHAP keys, if it must authenticate; Err names the field at fault
    /// (`dhchap_key` or `dhchap_ctrl_key`) and why, without the secret.
    pub fn keys(&self) -> Result<Option<HostKeys>, (&'static str, String)> {
        let HostEntry::WithKeys(table) = self else {
            return Ok(None);
        };
        let parse = |field: &'static str, text: &str| {
            DhchapSecret::parse(text).map_err(|e| (field, e.to_string()))
        };
        let ctrl = table
            .dhchap_ctrl_key
            .as_deref()
            .map(|k| parse("dhchap_ctrl_key", k))
            .transpose()?;
        match table.dhchap_key.as_deref() {
            Some(key) => Ok(Some(HostKeys {
                host: parse("dhchap_key", key)?,
                ctrl,
            })),
            None if ctrl.is_some() => Err((
                "dhchap_ctrl_key",
                "needs dhchap_key: the gateway proves itself only to a host that authenticates"
                    .into(),
            )),
            None => Ok(None),
        }
    }
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SubsystemConfig {
    pub nqn: String,
    #[serde(default)]
    pub serial: Option<String>,
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub allow_any_host: bool,
    /// The hosts allowed: NQNs, or tables that also give the host's DH-HMAC-CHAP keys.
    #[serde(default)]
    pub hosts: Vec<HostEntry>,
    /// Hosts must connect through a secure listener (TLS); a Connect over a plain
    /// connection is refused.
    #[serde(default)]
    pub require_tls: bool,
    #[serde(default, rename = "namespace")]
    pub namespaces: Vec<NamespaceConfig>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default)]
    pub gateway: GatewaySection,
    #[serde(default, rename = "listener")]
    pub listeners: Vec<ListenerConfig>,
    #[serde(default, rename = "subsystem")]
    pub subsystems: Vec<SubsystemConfig>,
    /// Ceph connection settings for `backend = "rbd"` namespaces.
    #[serde(default)]
    pub ceph: Option<CephSection>,
    /// Membership of a gateway group run by `nvmeof-control` (see [`crate::group`]).
    #[serde(default)]
    pub group: Option<GroupSection>,
}

/// `[group]`: this gateway is one of a group whose ANA states the control plane decides.
/// Until the control plane's first assignment arrives every ANA group is reported
/// inaccessible (another gateway may hold it); after that the last assignment stays in force
/// while the control plane is unreachable.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct GroupSection {
    /// gRPC addresses of the `nvmeof-control` replicas (`127.0.0.1:5500`).
    pub control_plane: Vec<String>,
    /// The ANA group this gateway owns (default: the control plane assigns one).
    #[serde(default)]
    pub ana_group: Option<u32>,
    /// Beacon period in milliseconds (default 500, at most 1000).
    #[serde(default)]
    pub beacon_interval_ms: Option<u64>,
    /// On SIGTERM, how long the gateway waits for the control plane to move its ANA groups
    /// to a peer before it stops anyway, in milliseconds (default 10000, 1..=600000). A
    /// supervisor's kill timeout (Kubernetes' terminationGracePeriodSeconds, systemd's
    /// TimeoutStopSec) must be longer, with room for closing the images.
    #[serde(default)]
    pub leave_timeout_ms: Option<u64>,
    /// How long commands may wait at the cluster, none completing, with the monitors silent
    /// too, before the gateway reports its Ceph network cut and the leader moves its ANA
    /// groups, in milliseconds (default: half the leader's `--grace-ms`, so a cut gateway
    /// moves about when a frozen one would; 400..=600000).
    #[serde(default)]
    pub stall_window_ms: Option<u64>,
    /// mTLS to the control plane (its replicas run with `--tls-*`): the CA that signed the
    /// replicas' certificates (PEM). `tls_ca`, `tls_cert` and `tls_key` go together: all three
    /// or none (plain gRPC).
    #[serde(default)]
    pub tls_ca: Option<PathBuf>,
    /// This gateway's client certificate (chain, PEM), signed by the CA the replicas trust.
    #[serde(default)]
    pub tls_cert: Option<PathBuf>,
    /// Its private key (PEM: PKCS#8, PKCS#1 or SEC1).
    #[serde(default)]
    pub tls_key: Option<PathBuf>,
}

/// `[group] leave_timeout_ms` when unset.
pub const DEFAULT_LEAVE_TIMEOUT_MS: u64 = 10_000;
/// The largest `[group] leave_timeout_ms`: ten minutes.
pub const MAX_LEAVE_TIMEOUT_MS: u64 = 600_000;
/// The largest `[group] stall_window_ms`: ten minutes.
pub const MAX_STALL_WINDOW_MS: u64 = 600_000;

impl GroupSection {
    /// How long a planned leave waits for the groups to move away (`leave_timeout_ms`).
    pub fn leave_timeout(&self) -> std::time::Duration {
        std::time::Duration::from_millis(self.leave_timeout_ms.unwrap_or(DEFAULT_LEAVE_TIMEOUT_MS))
    }

    /// The configured stall window (`stall_window_ms`); None: half the leader's grace.
    pub fn stall_window(&self) -> Option<std::time::Duration> {
        self.stall_window_ms.map(std::time::Duration::from_millis)
    }

    /// The TLS files, for `control_plane::tls::client_tls_config` (empty: plain gRPC).
    pub fn tls_files(&self) -> control_plane::tls::TlsFiles {
        control_plane::tls::TlsFiles {
            ca: self.tls_ca.clone(),
            cert: self.tls_cert.clone(),
            key: self.tls_key.clone(),
        }
    }

    /// All three TLS files or none, each readable.
    fn validate_tls(&self) -> Result<(), ConfigError> {
        let fields = [
            ("group.tls_ca", &self.tls_ca),
            ("group.tls_cert", &self.tls_cert),
            ("group.tls_key", &self.tls_key),
        ];
        let given = fields.iter().filter(|(_, p)| p.is_some()).count();
        if given == 0 {
            return Ok(());
        }
        for (field, path) in fields {
            let Some(path) = path else {
                return Err(invalid(
                    field,
                    "missing: mTLS to the control plane needs group.tls_ca, group.tls_cert and \
                     group.tls_key together",
                ));
            };
            if let Err(e) = std::fs::File::open(path) {
                return Err(invalid(
                    field,
                    format!("cannot read {}: {e}", path.display()),
                ));
            }
        }
        Ok(())
    }
}

/// Parses "1GiB", "256 MiB", "10G", "4096".
pub fn parse_size(text: &str) -> Option<u64> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num.parse().ok()?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kib" | "kb" => 10,
        "m" | "mib" | "mb" => 20,
        "g" | "gib" | "gb" => 30,
        "t" | "tib" | "tb" => 40,
        _ => return None,
    };
    n.checked_mul(1u64 << shift)
}

/// The image a `backend = "rbd"` namespace names, checked.
fn rbd_spec(nfield: &str, ns: &NamespaceConfig) -> Result<ImageSpec, ConfigError> {
    // Names go to librados as C strings; '/' and '@' would be read as pool/namespace/snapshot
    // separators by Ceph's tools, so such a name is surely a mistake here.
    fn name(
        nfield: &str,
        key: &str,
        value: Option<&str>,
        required: bool,
    ) -> Result<Option<String>, ConfigError> {
        let Some(v) = value else {
            return if required {
                Err(invalid(
                    format!("{nfield}.{key}"),
                    "required for the rbd backend",
                ))
            } else {
                Ok(None)
            };
        };
        if v.is_empty() && !required {
            return Ok(None);
        }
        if v.is_empty() || v.contains(['/', '@', '\0']) || v.trim() != v {
            return Err(invalid(
                format!("{nfield}.{key}"),
                format!(
                    "{v:?} is not a valid Ceph name (non-empty, no '/', '@' or surrounding spaces)"
                ),
            ));
        }
        Ok(Some(v.to_string()))
    }
    let pool = name(nfield, "pool", ns.pool.as_deref(), true)?.unwrap_or_default();
    let image = name(nfield, "image", ns.image.as_deref(), true)?.unwrap_or_default();
    let namespace = name(
        nfield,
        "rados_namespace",
        ns.rados_namespace.as_deref(),
        false,
    )?;
    Ok(ImageSpec {
        pool,
        namespace,
        image,
    })
}

impl Config {
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        let config: Config = toml::from_str(&text).map_err(|source| ConfigError::Parse {
            path: path.display().to_string(),
            source,
        })?;
        config.validate()?;
        for warning in config.warnings() {
            tracing::warn!("{}: {warning}", path.display());
        }
        Ok(config)
    }

    /// Parses and validates configuration text (tests, benchmarks, embedded use).
    pub fn from_toml_str(text: &str) -> Result<Self, ConfigError> {
        let config: Config = toml::from_str(text).map_err(|source| ConfigError::Parse {
            path: "<inline>".into(),
            source,
        })?;
        config.validate()?;
        Ok(config)
    }

    fn cntlid_range(&self) -> (u16, u16) {
        (
            self.gateway.cntlid_min.unwrap_or(cntlid::MIN),
            self.gateway.cntlid_max.unwrap_or(cntlid::MAX),
        )
    }

    /// NVMe/TCP listener addresses.
    pub fn listen_addrs(&self) -> Vec<SocketAddr> {
        self.transport_addrs("tcp")
    }

    /// NVMe/RDMA listener addresses (the RDMA device's IP address and an rdma_cm port).
    pub fn rdma_listen_addrs(&self) -> Vec<SocketAddr> {
        self.transport_addrs("rdma")
    }

    /// How an NVMe/TCP queue polls its socket before it sleeps; `None`: it never polls
    /// (`tcp_busy_poll_us = 0`).
    pub fn tcp_busy_poll(&self) -> Option<crate::tcp::busy_poll::BusyPollConfig> {
        match self
            .gateway
            .tcp_busy_poll_us
            .unwrap_or(DEFAULT_TCP_BUSY_POLL_US)
        {
            0 => None,
            us => Some(crate::tcp::busy_poll::BusyPollConfig {
                window: std::time::Duration::from_micros(u64::from(us)),
                adaptive: self.gateway.tcp_busy_poll_adaptive.unwrap_or(true),
            }),
        }
    }

    /// Bytes NVMe/TCP data buffers may hold in all (`[gateway] tcp_data_budget`, validated).
    pub fn tcp_data_budget(&self) -> usize {
        self.gateway
            .tcp_data_budget
            .as_deref()
            .and_then(parse_size)
            .and_then(|bytes| usize::try_from(bytes).ok())
            .unwrap_or(crate::core::budget::DEFAULT_LIMIT)
    }

    /// Where the metrics endpoint listens, when configured (and valid).
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        let text = self.gateway.metrics_listen.as_ref()?;
        metrics_socket_addr(text).ok()
    }

    fn transport_addrs(&self, transport: &str) -> Vec<SocketAddr> {
        self.listeners
            .iter()
            .filter(|l| l.transport == transport)
            .filter_map(|l| l.socket_addr().ok())
            .collect()
    }
}
