//! The gateway's configuration file (TOML), validated before anything starts.

use std::collections::{BTreeSet, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rbd_backend::rbd::{CephSettings, ClusterPool, ImageSpec, RbdDevice, RbdError};
use rbd_backend::{BlockDevice, MemoryDevice};
use serde::Deserialize;

use crate::core::{
    HostAccess, ListenerInfo, Namespace, Subsystem, SubsystemKind, SubsystemSpec, Target,
    TargetIdentity, TransportType,
};
use crate::spec::{cntlid, DISCOVERY_NQN, NQN_MAX_LEN};

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

#[derive(Debug, Clone, Default, Deserialize)]
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
    /// Where Prometheus scrapes `/metrics` ("0.0.0.0:10008", "[::1]:10008"); unset: no
    /// metrics endpoint.
    #[serde(default)]
    pub metrics_listen: Option<String>,
    /// Microseconds an NVMe/TCP queue keeps polling its socket after it received a command,
    /// before it sleeps (0 or unset: never polls). Trades CPU for QD1 latency where waking
    /// a sleeping thread is slow (a VM whose idle vCPUs halt): see `tcp::connection`.
    #[serde(default)]
    pub tcp_busy_poll_us: Option<u32>,
    /// With `tcp_busy_poll_us`: each queue measures whether polling makes its host's
    /// commands come faster and polls only then (default); `false`: it always polls.
    #[serde(default)]
    pub tcp_busy_poll_adaptive: Option<bool>,
}

/// Upper bound of `[gateway] tcp_busy_poll_us`: longer than any op worth polling for.
pub const MAX_TCP_BUSY_POLL_US: u32 = 10_000;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListenerConfig {
    pub transport: String,
    /// A numeric address: "192.0.2.10", "::1" or "[::1]"; it may carry the port, as in
    /// "192.0.2.10:4420" or "[::]:4420".
    pub address: String,
    /// Required unless `address` carries the port.
    #[serde(default)]
    pub port: Option<u16>,
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

/// `[gateway] metrics_listen`: a numeric address with its port.
fn metrics_socket_addr(text: &str) -> Result<SocketAddr, String> {
    match parse_listen_address(text)? {
        (_, Some(0)) => Err("the port must not be 0".into()),
        (ip, Some(port)) => Ok(SocketAddr::new(ip, port)),
        (ip, None) => Err(format!(
            "missing the port: {}",
            with_port_example(ip, text, 10008)
        )),
    }
}

/// How `ip` with `port` is written for `ip`'s family; `text` is how the address was given.
fn with_port_example(ip: IpAddr, text: &str, port: u16) -> String {
    match ip {
        IpAddr::V4(_) => format!("\"{ip}:{port}\""),
        // "::1:4420" is itself a valid IPv6 address (::1:4420), hence the brackets.
        IpAddr::V6(_) if !text.starts_with('[') => format!(
            "\"[{ip}]:{port}\"; an IPv6 address takes its port after brackets: {text:?} is read \
             as the address {ip}"
        ),
        IpAddr::V6(_) => format!("\"[{ip}]:{port}\""),
    }
}

/// A listener address: a numeric IPv4/IPv6 address, an IPv6 address in brackets, or either
/// with a port ("192.0.2.10:4420", "[::1]:4420"). Host names are refused: a listener binds
/// one address, and the discovery log must give hosts an address they can dial.
fn parse_listen_address(text: &str) -> Result<(IpAddr, Option<u16>), String> {
    if let Ok(ip) = text.parse::<IpAddr>() {
        return Ok((ip, None));
    }
    if let Ok(sa) = text.parse::<SocketAddr>() {
        if let SocketAddr::V6(v6) = sa {
            if v6.scope_id() != 0 {
                return Err(format!(
                    "{text:?}: scoped (%zone) IPv6 addresses are not supported"
                ));
            }
        }
        return Ok((sa.ip(), Some(sa.port())));
    }
    if let Some(inner) = text.strip_prefix('[').and_then(|t| t.strip_suffix(']')) {
        if let Ok(ip) = inner.parse::<std::net::Ipv6Addr>() {
            return Ok((IpAddr::V6(ip), None));
        }
    }
    Err(format!(
        "{text:?} is not a numeric IPv4/IPv6 address (e.g. \"192.0.2.10\", \"::1\", \"[::]\", \
         or with the port \"192.0.2.10:4420\", \"[::1]:4420\")"
    ))
}

/// Whether two listeners of one transport cannot both bind: on Linux a wildcard address
/// takes its port on every address of its family, and `::` (dual-stack unless
/// net.ipv6.bindv6only=1) on IPv4 addresses as well.
fn listeners_overlap(a: SocketAddr, b: SocketAddr) -> bool {
    if a.port() != b.port() {
        return false;
    }
    let (a, b) = (a.ip(), b.ip());
    let takes = |w: IpAddr, other: IpAddr| {
        w.is_unspecified() && (w.is_ipv6() || other.to_canonical().is_ipv4())
    };
    a.to_canonical() == b.to_canonical() || takes(a, b) || takes(b, a)
}

#[derive(Debug, Clone, Deserialize)]
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
    /// Namespace UUID; derived from the subsystem NQN and NSID when absent, so it is the same
    /// on every gateway and after restarts.
    #[serde(default)]
    pub uuid: Option<String>,
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
}

/// A Ceph option value in `[ceph.options]`: `rados_osd_op_timeout = 30`, `rbd_cache = false`.
#[derive(Debug, Clone, Deserialize)]
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
#[derive(Debug, Clone, Default, Deserialize)]
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

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SubsystemConfig {
    pub nqn: String,
    #[serde(default)]
    pub serial: Option<String>,
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub allow_any_host: bool,
    #[serde(default)]
    pub hosts: Vec<String>,
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
#[derive(Debug, Clone, Deserialize)]
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

impl GroupSection {
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

/// An NQN as the NVMe spec shapes it: "nqn." prefix, at most 223 bytes, UTF-8.
fn check_nqn(field: &str, nqn: &str) -> Result<(), ConfigError> {
    if !nqn.starts_with("nqn.") {
        return Err(invalid(
            field,
            format!("{nqn:?} does not start with \"nqn.\""),
        ));
    }
    if nqn.len() > NQN_MAX_LEN {
        return Err(invalid(field, format!("longer than {NQN_MAX_LEN} bytes")));
    }
    if nqn.chars().any(|c| c.is_control() || c.is_whitespace()) {
        return Err(invalid(field, "contains whitespace or control characters"));
    }
    Ok(())
}

/// Stable 16-byte identities for a namespace, from a name that is the same on every gateway.
fn derived_ids(identity: &str) -> ([u8; 16], [u8; 16]) {
    // A fixed namespace for v5 UUIDs of this product.
    const PRODUCT: uuid::Uuid = uuid::Uuid::from_u128(0x6c1d_7a1e_52c4_4f0e_9a6b_8e0b_3f2d_a001);
    let uuid = uuid::Uuid::new_v5(&PRODUCT, identity.as_bytes());
    let nguid = uuid::Uuid::new_v5(&PRODUCT, format!("nguid:{identity}").as_bytes());
    (*nguid.as_bytes(), *uuid.as_bytes())
}

/// Serial number shared by every gateway: derived from the NQN, 20 ASCII characters.
fn derived_serial(nqn: &str) -> String {
    let id = uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_OID, nqn.as_bytes());
    id.simple().to_string()[..20].to_string()
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

fn validate_ceph(ceph: &CephSection) -> Result<(), ConfigError> {
    if let Some(n) = ceph.connections {
        if n == 0 || n > 64 {
            return Err(invalid(
                "ceph.connections",
                format!("{n} is outside 1..=64"),
            ));
        }
    }
    for (key, value) in [
        ("conf", &ceph.conf),
        ("keyring", &ceph.keyring),
        ("client_name", &ceph.client_name),
        ("cluster", &ceph.cluster),
    ] {
        if let Some(v) = value {
            if v.is_empty() || v.contains('\0') {
                return Err(invalid(format!("ceph.{key}"), "must be a non-empty string"));
            }
        }
    }
    if let Some(conf) = &ceph.conf {
        if !Path::new(conf).is_file() {
            return Err(invalid(
                "ceph.conf",
                format!("{conf:?} is not a readable file"),
            ));
        }
    }
    if let Some(args) = &ceph.args {
        if let Some(bad) = args.split_whitespace().find(|a| a.contains('\0')) {
            return Err(invalid("ceph.args", format!("{bad:?} contains a NUL byte")));
        }
        if let Some(first) = args.split_whitespace().next() {
            if !first.starts_with('-') {
                return Err(invalid(
                    "ceph.args",
                    format!("{first:?}: expected options like \"--rados_osd_op_timeout=30\""),
                ));
            }
        }
    }
    for (key, value) in &ceph.options {
        if key.is_empty() || key.contains(['\0', ' ', '=']) {
            return Err(invalid(format!("ceph.options.{key}"), "not an option name"));
        }
        if value.to_string().contains('\0') {
            return Err(invalid(
                format!("ceph.options.{key}"),
                "contains a NUL byte",
            ));
        }
    }
    Ok(())
}

/// Adds a namespace with its device to `subsystem` and routes the device's events to it.
fn attach_namespace(
    subsystem: &Arc<Subsystem>,
    s: &SubsystemConfig,
    ns: &NamespaceConfig,
    device: Arc<dyn BlockDevice>,
) {
    let (nguid, mut uuid) = derived_ids(&format!("{}/{}", s.nqn, ns.nsid));
    if let Some(u) = ns
        .uuid
        .as_deref()
        .and_then(|u| uuid::Uuid::parse_str(u).ok())
    {
        uuid = *u.as_bytes();
    }
    let namespace = Arc::new(Namespace {
        nsid: ns.nsid,
        device: device.clone(),
        lba_shift: ns.block_size.trailing_zeros() as u8,
        nguid,
        uuid,
        ana_group: ns.ana_group,
        read_only: ns.read_only,
    });
    device.set_event_sink(Arc::new(crate::events::NamespaceEvents::new(
        subsystem, ns.nsid,
    )));
    subsystem.add_namespace(namespace);
}

/// How long start-up waits for the next RBD image to open before serving without the ones
/// still opening (see `Config::open_rbd_devices`).
pub const OPEN_STALL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

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

    /// Checks everything that can be checked without opening devices or sockets.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if let Some(g) = &self.group {
            if g.control_plane.is_empty() {
                return Err(invalid(
                    "group.control_plane",
                    "at least one control-plane address is required",
                ));
            }
            if self.gateway.name.as_deref().unwrap_or("").is_empty() {
                return Err(invalid(
                    "gateway.name",
                    "required when [group] is set (the gateway's name in the group)",
                ));
            }
            g.validate_tls()?;
            if let Some(ms) = g.beacon_interval_ms {
                if ms == 0 || ms > 1000 {
                    return Err(invalid(
                        "group.beacon_interval_ms",
                        format!("{ms} is not 1..=1000"),
                    ));
                }
            }
        }
        if self.listeners.is_empty() {
            return Err(invalid("listener", "at least one [[listener]] is required"));
        }
        let mut seen: Vec<(&str, SocketAddr)> = Vec::new();
        for (i, l) in self.listeners.iter().enumerate() {
            let field = format!("listener[{i}]");
            if l.transport != "tcp" && l.transport != "rdma" {
                return Err(invalid(
                    format!("{field}.transport"),
                    format!(
                        "{:?} is not supported (supported: \"tcp\", \"rdma\")",
                        l.transport
                    ),
                ));
            }
            let addr = l
                .socket_addr()
                .map_err(|(key, problem)| invalid(format!("{field}.{key}"), problem))?;
            // TCP and rdma_cm have separate port spaces: one port may serve both.
            if let Some(j) = seen
                .iter()
                .position(|(t, other)| *t == l.transport && listeners_overlap(*other, addr))
            {
                let problem = if seen[j].1.ip().to_canonical() == addr.ip().to_canonical() {
                    format!("{addr} is listed twice (listener[{j}])")
                } else {
                    format!(
                        "{addr} overlaps listener[{j}] {}: a wildcard address (0.0.0.0, ::) \
                         takes the port on every address, and :: on IPv4 ones too",
                        seen[j].1
                    )
                };
                return Err(invalid(field, problem));
            }
            seen.push((l.transport.as_str(), addr));
        }
        let (min, max) = self.cntlid_range();
        if min < cntlid::MIN || max > cntlid::MAX || min > max {
            return Err(invalid(
                "gateway.cntlid_min/cntlid_max",
                format!("range {min}..={max} must lie within 1..=65519 and not be empty"),
            ));
        }
        if let Some(0) = self.gateway.worker_threads {
            return Err(invalid("gateway.worker_threads", "must be at least 1"));
        }
        if let Some(us) = self.gateway.tcp_busy_poll_us {
            if us > MAX_TCP_BUSY_POLL_US {
                return Err(invalid(
                    "gateway.tcp_busy_poll_us",
                    format!("{us} is more than {MAX_TCP_BUSY_POLL_US}"),
                ));
            }
        }
        // Set alone it would be silently ignored. (Beside `tcp_busy_poll_us = 0`, polling
        // explicitly off, it is a setting kept for when the window is set.)
        if self.gateway.tcp_busy_poll_adaptive.is_some() && self.gateway.tcp_busy_poll_us.is_none()
        {
            return Err(invalid(
                "gateway.tcp_busy_poll_adaptive",
                "has no effect without tcp_busy_poll_us (the polling window, in µs)",
            ));
        }
        if let Some(text) = &self.gateway.metrics_listen {
            let field = "gateway.metrics_listen";
            let metrics = metrics_socket_addr(text).map_err(|problem| invalid(field, problem))?;
            for (transport, addr) in &seen {
                if *transport == "tcp" && listeners_overlap(metrics, *addr) {
                    return Err(invalid(
                        field,
                        format!("{metrics} overlaps the NVMe/TCP listener {addr}"),
                    ));
                }
            }
        }
        let mut seen_nqns = BTreeSet::new();
        let mut seen_images = HashMap::new();
        for (i, s) in self.subsystems.iter().enumerate() {
            let field = format!("subsystem[{i}]");
            check_nqn(&format!("{field}.nqn"), &s.nqn)?;
            if s.nqn == DISCOVERY_NQN {
                return Err(invalid(
                    format!("{field}.nqn"),
                    "the discovery NQN is reserved",
                ));
            }
            if !seen_nqns.insert(s.nqn.clone()) {
                return Err(invalid(
                    format!("{field}.nqn"),
                    format!("{:?} is listed twice", s.nqn),
                ));
            }
            if s.allow_any_host && !s.hosts.is_empty() {
                return Err(invalid(
                    format!("{field}.hosts"),
                    "allow_any_host = true and a host list contradict each other",
                ));
            }
            for (h, host) in s.hosts.iter().enumerate() {
                check_nqn(&format!("{field}.hosts[{h}]"), host)?;
            }
            if let Some(serial) = &s.serial {
                if serial.is_empty() || serial.len() > 20 || !serial.is_ascii() {
                    return Err(invalid(
                        format!("{field}.serial"),
                        "must be 1 to 20 ASCII characters",
                    ));
                }
            }
            let mut seen_nsids = BTreeSet::new();
            for (j, ns) in s.namespaces.iter().enumerate() {
                let nfield = format!("{field}.namespace[{j}]");
                if ns.nsid == 0 || ns.nsid > crate::core::identify::MAX_NAMESPACES {
                    return Err(invalid(
                        format!("{nfield}.nsid"),
                        format!(
                            "{} is outside 1..={}",
                            ns.nsid,
                            crate::core::identify::MAX_NAMESPACES
                        ),
                    ));
                }
                if !seen_nsids.insert(ns.nsid) {
                    return Err(invalid(
                        format!("{nfield}.nsid"),
                        format!("{} is used twice", ns.nsid),
                    ));
                }
                if ns.block_size != 512 && ns.block_size != 4096 {
                    return Err(invalid(
                        format!("{nfield}.block_size"),
                        format!("{} is not 512 or 4096", ns.block_size),
                    ));
                }
                if ns.ana_group == 0 || ns.ana_group > crate::core::identify::MAX_ANA_GROUPS {
                    return Err(invalid(
                        format!("{nfield}.ana_group"),
                        "must be within 1..=128",
                    ));
                }
                if let Some(u) = &ns.uuid {
                    if uuid::Uuid::parse_str(u).map(|u| u.is_nil()).unwrap_or(true) {
                        return Err(invalid(
                            format!("{nfield}.uuid"),
                            format!("{u:?} is not a non-nil UUID"),
                        ));
                    }
                }
                match ns.backend.as_str() {
                    "memory" => {
                        for (name, set) in [
                            ("pool", ns.pool.is_some()),
                            ("rados_namespace", ns.rados_namespace.is_some()),
                            ("image", ns.image.is_some()),
                        ] {
                            if set {
                                return Err(invalid(
                                    format!("{nfield}.{name}"),
                                    "only used by the rbd backend",
                                ));
                            }
                        }
                        let size = ns.size.as_deref().ok_or_else(|| {
                            invalid(format!("{nfield}.size"), "required for the memory backend")
                        })?;
                        let bytes = parse_size(size).ok_or_else(|| {
                            invalid(
                                format!("{nfield}.size"),
                                format!("{size:?} is not a size like \"1GiB\""),
                            )
                        })?;
                        if bytes == 0 || bytes % u64::from(ns.block_size) != 0 {
                            return Err(invalid(
                                format!("{nfield}.size"),
                                format!(
                                    "{bytes} bytes is not a non-zero multiple of the block size"
                                ),
                            ));
                        }
                    }
                    "rbd" => {
                        if ns.size.is_some() {
                            return Err(invalid(
                                format!("{nfield}.size"),
                                "not used by the rbd backend: the image has its size (rbd resize)",
                            ));
                        }
                        let spec = rbd_spec(&nfield, ns)?;
                        if let Some(other) = seen_images.insert(spec.clone(), nfield.clone()) {
                            return Err(invalid(
                                format!("{nfield}.image"),
                                format!("{spec} is already served by {other}"),
                            ));
                        }
                    }
                    other => {
                        return Err(invalid(
                            format!("{nfield}.backend"),
                            format!("{other:?} is not supported (supported: \"memory\", \"rbd\")"),
                        ))
                    }
                }
            }
        }
        if let Some(ceph) = &self.ceph {
            validate_ceph(ceph)?;
        }
        Ok(())
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

    /// How an NVMe/TCP queue polls its socket before it sleeps; `None`: it never polls.
    pub fn tcp_busy_poll(&self) -> Option<crate::tcp::busy_poll::BusyPollConfig> {
        match self.gateway.tcp_busy_poll_us {
            None | Some(0) => None,
            Some(us) => Some(crate::tcp::busy_poll::BusyPollConfig {
                window: std::time::Duration::from_micros(u64::from(us)),
                adaptive: self.gateway.tcp_busy_poll_adaptive.unwrap_or(true),
            }),
        }
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
        let target = Arc::new(Target::new(identity.clone()));
        let (cntlid_min, cntlid_max) = self.cntlid_range();
        for (i, s) in self.subsystems.iter().enumerate() {
            let access = if s.allow_any_host {
                HostAccess::AnyHost
            } else {
                HostAccess::Only(s.hosts.iter().cloned().collect())
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
        }
        Ok((target, skipped))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tcp::busy_poll::BusyPollConfig;

    fn parse(text: &str) -> Result<Config, ConfigError> {
        let c: Config = toml::from_str(text).map_err(|source| ConfigError::Parse {
            path: "test".into(),
            source,
        })?;
        c.validate()?;
        Ok(c)
    }

    const GOOD: &str = r#"
        [[listener]]
        transport = "tcp"
        address = "127.0.0.1"
        port = 4420

        [[subsystem]]
        nqn = "nqn.2016-06.io.example:demo"
        allow_any_host = true

        [[subsystem.namespace]]
        nsid = 1
        backend = "memory"
        size = "1GiB"
    "#;

    #[test]
    fn sizes_parse_with_binary_units() {
        assert_eq!(parse_size("1GiB"), Some(1 << 30));
        assert_eq!(parse_size("256 MiB"), Some(256 << 20));
        assert_eq!(parse_size("4096"), Some(4096));
        assert_eq!(parse_size("1 parsec"), None);
        assert_eq!(parse_size("99999999999T"), None, "overflow is refused");
    }

    #[test]
    fn a_good_config_builds_a_target_with_stable_ids() {
        let c = parse(GOOD).unwrap();
        let t1 = c.build_target().unwrap();
        let t2 = c.build_target().unwrap();
        let ns1 = t1
            .subsystem("nqn.2016-06.io.example:demo")
            .unwrap()
            .namespace(1)
            .unwrap();
        let ns2 = t2
            .subsystem("nqn.2016-06.io.example:demo")
            .unwrap()
            .namespace(1)
            .unwrap();
        assert_eq!(
            ns1.nguid, ns2.nguid,
            "same NGUID on every build (restart, other gateway)"
        );
        assert_ne!(ns1.nguid, [0; 16]);
        assert_ne!(ns1.uuid, [0; 16]);
        assert_ne!(ns1.nguid, ns1.uuid);
        assert_eq!(ns1.lba_shift, 9);
        assert_eq!(ns1.device.size_bytes(), 1 << 30);
    }

    #[test]
    fn one_subsystem_is_served_over_tcp_and_rdma_on_the_same_port() {
        let both = GOOD.replace(
            "[[subsystem]]",
            "[[listener]]\n        transport = \"rdma\"\n        address = \"127.0.0.1\"\n        port = 4420\n\n        [[subsystem]]",
        );
        let c = parse(&both).unwrap();
        assert_eq!(c.listen_addrs(), vec!["127.0.0.1:4420".parse().unwrap()]);
        assert_eq!(
            c.rdma_listen_addrs(),
            vec!["127.0.0.1:4420".parse().unwrap()]
        );
        let t = c.build_target().unwrap();
        let transports: Vec<_> = t.listeners().iter().map(|l| l.transport).collect();
        assert_eq!(transports, vec![TransportType::Tcp, TransportType::Rdma]);
        let twice = both.replace("\"tcp\"", "\"rdma\"");
        let e = parse(&twice).unwrap_err().to_string();
        assert!(e.contains("listener[1]"), "{e}");
    }

    #[test]
    fn errors_name_the_bad_field() {
        let cases = [
            (
                GOOD.replace("\"tcp\"", "\"carrier-pigeon\""),
                "listener[0].transport",
            ),
            (
                GOOD.replace("127.0.0.1", "localhost"),
                "listener[0].address",
            ),
            (
                GOOD.replace("nqn.2016-06.io.example:demo", "iqn.bad"),
                "subsystem[0].nqn",
            ),
            (
                GOOD.replace("size = \"1GiB\"", "size = \"1GiB\"\nblock_size = 1000"),
                "subsystem[0].namespace[0].block_size",
            ),
            (
                GOOD.replace("nsid = 1", "nsid = 0"),
                "subsystem[0].namespace[0].nsid",
            ),
            (
                GOOD.replace("\"1GiB\"", "\"lots\""),
                "subsystem[0].namespace[0].size",
            ),
            (
                GOOD.replace("\"memory\"", "\"floppy\""),
                "subsystem[0].namespace[0].backend",
            ),
        ];
        for (text, field) in cases {
            let err = parse(&text).unwrap_err().to_string();
            assert!(err.starts_with(field), "{err:?} should name {field}");
        }
    }

    /// GOOD with its listener's address and port lines replaced by `listener` (TOML lines).
    fn with_listener(listener: &str) -> String {
        GOOD.replace("address = \"127.0.0.1\"\n        port = 4420", listener)
    }

    #[test]
    fn ipv6_listener_addresses_parse_with_or_without_brackets_and_port() {
        let cases = [
            ("address = \"::1\"\nport = 4420", "[::1]:4420"),
            ("address = \"[::1]\"\nport = 4420", "[::1]:4420"),
            ("address = \"[::1]:4420\"", "[::1]:4420"),
            ("address = \"[::]:4420\"\nport = 4420", "[::]:4420"),
            ("address = \"[0:0::1]:4421\"", "[::1]:4421"),
            ("address = \"0.0.0.0:4422\"", "0.0.0.0:4422"),
        ];
        for (lines, want) in cases {
            let c = parse(&with_listener(lines)).unwrap_or_else(|e| panic!("{lines}: {e}"));
            let want: SocketAddr = want.parse().unwrap();
            assert_eq!(c.listen_addrs(), vec![want], "{lines}");
            // The discovery log's TRADDR is the canonical text: no brackets, no port.
            let t = c.build_target().unwrap();
            let l = &t.listeners()[0];
            assert_eq!(l.address, want.ip().to_string(), "{lines}");
            assert_eq!(l.port, want.port(), "{lines}");
        }
    }

    #[test]
    fn bad_listener_addresses_name_the_field_and_the_problem() {
        let cases = [
            (
                "address = \"[::1]:4420\"\nport = 4421",
                "listener[0].port",
                "differs",
            ),
            ("address = \"[::1]\"", "listener[0].port", "[::1]:4420"),
            (
                "address = \"192.0.2.1\"",
                "listener[0].port",
                "192.0.2.1:4420",
            ),
            ("address = \"[::1]:0\"", "listener[0].port", "must not be 0"),
            (
                "address = \"::1:4420\"",
                "listener[0].port",
                "is read as the address ::1:4420",
            ),
            (
                "address = \"[127.0.0.1]\"\nport = 1",
                "listener[0].address",
                "not a numeric",
            ),
            (
                "address = \"[::1\"\nport = 1",
                "listener[0].address",
                "not a numeric",
            ),
            (
                "address = \"::1]:4420\"",
                "listener[0].address",
                "not a numeric",
            ),
            (
                "address = \"localhost:4420\"",
                "listener[0].address",
                "not a numeric",
            ),
            (
                "address = \"\"\nport = 1",
                "listener[0].address",
                "not a numeric",
            ),
            (
                "address = \" ::1\"\nport = 1",
                "listener[0].address",
                "not a numeric",
            ),
            (
                "address = \"[fe80::1%2]:4420\"",
                "listener[0].address",
                "scoped",
            ),
        ];
        for (lines, field, words) in cases {
            let err = parse(&with_listener(lines)).unwrap_err().to_string();
            assert!(
                err.starts_with(field),
                "{lines}: {err:?} should name {field}"
            );
            assert!(err.contains(words), "{lines}: {err:?} should say {words:?}");
        }
    }

    #[test]
    fn busy_polling_is_off_unless_set_and_bounded() {
        let with_poll = |us: &str| format!("[gateway]\ntcp_busy_poll_us = {us}\n{GOOD}");
        assert_eq!(parse(GOOD).expect("valid").tcp_busy_poll(), None);
        assert_eq!(parse(&with_poll("0")).expect("valid").tcp_busy_poll(), None);
        let window = std::time::Duration::from_micros(250);
        assert_eq!(
            parse(&with_poll("250")).expect("valid").tcp_busy_poll(),
            Some(BusyPollConfig {
                window,
                adaptive: true
            }),
            "adaptive unless told otherwise"
        );
        let always =
            format!("[gateway]\ntcp_busy_poll_us = 250\ntcp_busy_poll_adaptive = false\n{GOOD}");
        assert_eq!(
            parse(&always).expect("valid").tcp_busy_poll(),
            Some(BusyPollConfig {
                window,
                adaptive: false
            })
        );
        let not_bool =
            format!("[gateway]\ntcp_busy_poll_us = 250\ntcp_busy_poll_adaptive = 1\n{GOOD}");
        assert!(parse(&not_bool).is_err());
        let alone = format!("[gateway]\ntcp_busy_poll_adaptive = true\n{GOOD}");
        let err = parse(&alone).unwrap_err().to_string();
        assert!(err.starts_with("gateway.tcp_busy_poll_adaptive"), "{err}");
        assert!(err.contains("without tcp_busy_poll_us"), "{err}");
        let off = format!("[gateway]\ntcp_busy_poll_us = 0\ntcp_busy_poll_adaptive = true\n{GOOD}");
        assert_eq!(parse(&off).expect("valid: off").tcp_busy_poll(), None);
        let err = parse(&with_poll("10001")).unwrap_err().to_string();
        assert!(err.starts_with("gateway.tcp_busy_poll_us"), "{err}");
        assert!(err.contains("more than 10000"), "{err}");
        assert!(parse(&with_poll("-1")).is_err());
    }

    #[test]
    fn the_metrics_address_needs_a_port_and_its_own_socket() {
        let with_metrics = |addr: &str| format!("[gateway]\nmetrics_listen = \"{addr}\"\n{GOOD}");
        let ok = parse(&with_metrics("[::]:10008")).expect("valid");
        assert_eq!(ok.metrics_addr(), Some("[::]:10008".parse().unwrap()));
        assert_eq!(
            parse(GOOD).expect("valid").metrics_addr(),
            None,
            "off unless set"
        );
        for (addr, words) in [
            ("127.0.0.1", "missing the port: \"127.0.0.1:10008\""),
            ("127.0.0.1:0", "must not be 0"),
            ("metrics.example:10008", "not a numeric"),
            (
                "0.0.0.0:4420",
                "overlaps the NVMe/TCP listener 127.0.0.1:4420",
            ),
        ] {
            let err = parse(&with_metrics(addr)).unwrap_err().to_string();
            assert!(
                err.starts_with("gateway.metrics_listen") && err.contains(words),
                "{addr}: {err:?} should name the field and say {words:?}"
            );
        }
    }

    #[test]
    fn listeners_that_cannot_both_bind_are_refused() {
        let two = |a: &str, b: &str| {
            with_listener(&format!(
                "address = \"{a}\"\n\n        [[listener]]\n        transport = \"tcp\"\n        address = \"{b}\""
            ))
        };
        for (a, b, words) in [
            ("[::]:4420", "127.0.0.1:4420", "overlaps listener[0]"),
            ("127.0.0.1:4420", "[::]:4420", "overlaps listener[0]"),
            ("0.0.0.0:4420", "10.0.0.1:4420", "overlaps listener[0]"),
            ("[::]:4420", "[::1]:4420", "overlaps listener[0]"),
            ("[::1]:4420", "[0::1]:4420", "listed twice"),
            ("[::ffff:127.0.0.1]:4420", "127.0.0.1:4420", "listed twice"),
        ] {
            let err = parse(&two(a, b)).unwrap_err().to_string();
            assert!(err.starts_with("listener[1]"), "{a} + {b}: {err:?}");
            assert!(err.contains(words), "{a} + {b}: {err:?}");
        }
        // Different ports, or an IPv4 wildcard next to an IPv6 address: both bind.
        for (a, b) in [
            ("[::]:4420", "127.0.0.1:4421"),
            ("0.0.0.0:4420", "[::1]:4420"),
            ("[::1]:4420", "127.0.0.1:4420"),
        ] {
            let c = parse(&two(a, b)).unwrap_or_else(|e| panic!("{a} + {b}: {e}"));
            assert_eq!(c.listen_addrs().len(), 2);
        }
    }

    const RBD: &str = r#"
        [[listener]]
        transport = "tcp"
        address = "127.0.0.1"
        port = 4420

        [[subsystem]]
        nqn = "nqn.2016-06.io.example:demo"
        allow_any_host = true

        [[subsystem.namespace]]
        nsid = 1
        backend = "memory"
        size = "1GiB"

        [[subsystem.namespace]]
        nsid = 2
        backend = "rbd"
        pool = "rbd"
        image = "img0"

        [ceph]
        client_name = "admin"
        args = "--rados_osd_op_timeout=30"
        connections = 2

        [ceph.options]
        rados_mon_op_timeout = 30
        rbd_cache = false
    "#;

    #[test]
    fn rbd_namespaces_and_the_ceph_section_parse() {
        let c = parse(RBD).unwrap();
        let ns = &c.subsystems[0].namespaces[1];
        assert_eq!(ns.pool.as_deref(), Some("rbd"));
        assert_eq!(ns.image.as_deref(), Some("img0"));
        let s = c.ceph.as_ref().unwrap().settings();
        assert_eq!(s.entity_name(), "client.admin");
        assert_eq!(s.max_connections, 2);
        assert_eq!(s.args, vec!["--rados_osd_op_timeout=30".to_string()]);
        assert_eq!(
            s.options,
            vec![
                ("rados_mon_op_timeout".to_string(), "30".to_string()),
                ("rbd_cache".to_string(), "false".to_string())
            ]
        );
        let spec = rbd_spec("x", ns).unwrap();
        assert_eq!(spec.to_string(), "rbd/img0");
        let with_ns = parse(&RBD.replace(
            "image = \"img0\"",
            "image = \"img0\"\nrados_namespace = \"tenant1\"",
        ))
        .unwrap();
        let spec = rbd_spec("x", &with_ns.subsystems[0].namespaces[1]).unwrap();
        assert_eq!(spec.to_string(), "rbd/tenant1/img0");
    }

    #[test]
    fn rbd_errors_name_the_bad_field() {
        let cases = [
            (RBD.replace("pool = \"rbd\"\n", ""), "subsystem[0].namespace[1].pool"),
            (RBD.replace("image = \"img0\"", "image = \"\""), "subsystem[0].namespace[1].image"),
            (RBD.replace("image = \"img0\"", "image = \"a/b\""), "subsystem[0].namespace[1].image"),
            (RBD.replace("image = \"img0\"", "image = \"img0\"\nsize = \"1GiB\""), "subsystem[0].namespace[1].size"),
            (RBD.replace("size = \"1GiB\"", "size = \"1GiB\"\nimage = \"x\""), "subsystem[0].namespace[0].image"),
            (RBD.replace("image = \"img0\"", "image = \"img0\"\nrados_namespace = \"a@b\""), "subsystem[0].namespace[1].rados_namespace"),
            (RBD.replace("connections = 2", "connections = 0"), "ceph.connections"),
            (RBD.replace("--rados_osd_op_timeout=30", "rados_osd_op_timeout=30"), "ceph.args"),
            (RBD.replace("client_name = \"admin\"", "conf = \"/nonexistent/ceph.conf\""), "ceph.conf"),
            (
                RBD.replace(
                    "[ceph]",
                    "[[subsystem]]\nnqn = \"nqn.2016-06.io.example:two\"\n[[subsystem.namespace]]\nnsid = 1\nbackend = \"rbd\"\npool = \"rbd\"\nimage = \"img0\"\n[ceph]",
                ),
                "subsystem[1].namespace[0].image",
            ),
        ];
        for (text, field) in cases {
            let err = match parse(&text) {
                Err(e) => e.to_string(),
                Ok(_) => panic!("accepted, should fail on {field}:\n{text}"),
            };
            assert!(err.starts_with(field), "{err:?} should name {field}");
        }
    }

    /// The cluster in this conf has no monitors, so the image cannot be opened (on a machine
    /// without librbd, the library is missing: same outcome). The namespace is left out and
    /// reported; the memory namespace still serves.
    #[test]
    fn a_namespace_whose_image_cannot_be_opened_is_skipped_and_reported() {
        let dir = std::env::temp_dir().join(format!("cfgtest-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let conf = dir.join("ceph.conf");
        std::fs::write(&conf, "[global]\nlog_file = /dev/null\n").unwrap();
        let text = RBD
            .replace(
                "client_name = \"admin\"",
                &format!(
                    "client_name = \"admin\"\nconf = \"{}\"\nuse_ceph_args_env = false",
                    conf.display()
                ),
            )
            .replace("--rados_osd_op_timeout=30", "--client_mount_timeout=2");
        let c = parse(&text).unwrap();
        let (target, skipped) = c.build_target_report().unwrap();
        let sub = target.subsystem("nqn.2016-06.io.example:demo").unwrap();
        assert!(sub.namespace(1).is_some(), "the memory namespace serves");
        assert!(sub.namespace(2).is_none(), "the rbd namespace is left out");
        assert_eq!(skipped.len(), 1);
        assert_eq!(skipped[0].field, "subsystem[0].namespace[1]");
        assert_eq!(skipped[0].device, "rbd/img0");
        assert_eq!(skipped[0].nsid, 2);
        assert!(!skipped[0].error.is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn unknown_keys_are_refused() {
        let err = parse(&GOOD.replace("port = 4420", "port = 4420\nprot = 1")).unwrap_err();
        assert!(err.to_string().contains("prot"), "{err}");
    }
}
