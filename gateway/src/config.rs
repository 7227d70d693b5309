//! The gateway's configuration file (TOML), validated before anything starts.

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::sync::Arc;

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
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListenerConfig {
    pub transport: String,
    pub address: String,
    pub port: u16,
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
        if self.listeners.is_empty() {
            return Err(invalid("listener", "at least one [[listener]] is required"));
        }
        let mut seen_addrs = BTreeSet::new();
        for (i, l) in self.listeners.iter().enumerate() {
            let field = format!("listener[{i}]");
            if l.transport != "tcp" {
                return Err(invalid(
                    format!("{field}.transport"),
                    format!("{:?} is not supported (supported: \"tcp\")", l.transport),
                ));
            }
            if l.address.parse::<IpAddr>().is_err() {
                return Err(invalid(
                    format!("{field}.address"),
                    format!("{:?} is not a numeric IPv4/IPv6 address", l.address),
                ));
            }
            if l.port == 0 {
                return Err(invalid(format!("{field}.port"), "must not be 0"));
            }
            if !seen_addrs.insert((l.address.clone(), l.port)) {
                return Err(invalid(
                    field,
                    format!("{}:{} is listed twice", l.address, l.port),
                ));
            }
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
        let mut seen_nqns = BTreeSet::new();
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
                    other => {
                        return Err(invalid(
                            format!("{nfield}.backend"),
                            format!("{other:?} is not supported (supported: \"memory\")"),
                        ))
                    }
                }
            }
        }
        Ok(())
    }

    fn cntlid_range(&self) -> (u16, u16) {
        (
            self.gateway.cntlid_min.unwrap_or(cntlid::MIN),
            self.gateway.cntlid_max.unwrap_or(cntlid::MAX),
        )
    }

    pub fn listen_addrs(&self) -> Vec<SocketAddr> {
        self.listeners
            .iter()
            .filter_map(|l| Some(SocketAddr::new(l.address.parse().ok()?, l.port)))
            .collect()
    }

    /// Builds the target: subsystems, namespaces (opening their devices) and listeners.
    pub fn build_target(&self) -> Result<Arc<Target>, ConfigError> {
        self.validate()?;
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
                    other => {
                        return Err(invalid(
                            format!("{nfield}.backend"),
                            format!("{other:?} is not supported"),
                        ))
                    }
                };
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
                    &subsystem, ns.nsid,
                )));
                subsystem.add_namespace(namespace);
            }
            target.add_subsystem(subsystem);
        }
        for (i, l) in self.listeners.iter().enumerate() {
            target.add_listener(ListenerInfo {
                transport: TransportType::Tcp,
                address: l.address.clone(),
                port: l.port,
                port_id: i as u16 + 1,
            });
        }
        Ok(target)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn unknown_keys_are_refused() {
        let err = parse(&GOOD.replace("port = 4420", "port = 4420\nprot = 1")).unwrap_err();
        assert!(err.to_string().contains("prot"), "{err}");
    }
}
