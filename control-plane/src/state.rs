//! The group's configuration (subsystems, namespaces, listeners, hosts) and its group map, as
//! stored in one RADOS object's omap, with the checks every change goes through.
//!
//! Omap layout (one key per item, so a change rewrites only what changed):
//!
//! | key | value |
//! | --- | --- |
//! | `version` | decimal, bumped by every write (the compare-and-set guard) |
//! | `subsystem/<nqn>` | JSON [`SubsystemEntry`] |
//! | `namespace/<nqn>/<nsid, 10 digits>` | JSON [`NamespaceEntry`] |
//! | `listener/<nqn>/<gateway>/<transport>/<address>/<port>` | JSON [`ListenerEntry`] |
//! | `host/<nqn>/<host nqn>` | JSON `[nqn, host nqn]`; a host with DH-HMAC-CHAP keys or a TLS PSK: `[nqn, host nqn, {"dhchap_key": ..., "dhchap_ctrl_key": ..., "psk": ..., "psk_derivation": ...}]` ([`HostAuth`], unset ones left out) |
//! | `groupmap` | JSON [`GroupMap`] (written by the leader) |
//! | `settings` | JSON [`GroupSettings`] (group-wide settings such as the log level; absent while none is set) |
//!
//! Key parts are escaped (`%` → `%25`, `/` → `%2F`): NQNs may contain `/`. Items are decoded
//! from their values, never from their keys. A host without keys is written as before keys
//! existed, so states written by older replicas load unchanged. The keys are stored in clear
//! text: anyone who can read the pool's omap (its cephx caps) can read them.
//!
//! Everything here is pure: no I/O.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::ana::{self, GroupMap};
use crate::qos::{QosError, QosLimits};

pub use crate::nqn::NQN_MAX_LEN;
/// NSIDs a subsystem may hold (the gateway's Identify Controller NN).
pub const DEFAULT_MAX_NAMESPACES: u32 = 1024;

pub type Omap = BTreeMap<String, Vec<u8>>;

#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SubsystemEntry {
    pub nqn: String,
    #[serde(default)]
    pub serial: String,
    #[serde(default)]
    pub allow_any_host: bool,
    pub max_namespaces: u32,
    /// Hosts must connect through a secure listener (TLS). Left out of the JSON when false,
    /// so states of older replicas load and are written unchanged.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub require_tls: bool,
    /// The subsystem's DH-HMAC-CHAP key (canonical `DHHC-1:XX:<base64>:`), ceph-nvmeof's
    /// `change_subsystem_key`: the key the gateway proves itself with to a host that has a
    /// key of its own but no controller key (bidirectional authentication). Left out of the
    /// JSON when unset, so older states load and older replicas read the entry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dhchap_key: Option<String>,
}

/// `Debug` says whether the subsystem has a key, never the key.
impl std::fmt::Debug for SubsystemEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SubsystemEntry")
            .field("nqn", &self.nqn)
            .field("serial", &self.serial)
            .field("allow_any_host", &self.allow_any_host)
            .field("max_namespaces", &self.max_namespaces)
            .field("require_tls", &self.require_tls)
            .field("dhchap_key", &self.dhchap_key.as_ref().map(|_| "<set>"))
            .finish()
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NamespaceEntry {
    pub subsystem_nqn: String,
    pub nsid: u32,
    pub pool: String,
    #[serde(default)]
    pub rados_namespace: String,
    pub image: String,
    pub block_size: u32,
    pub ana_group: u32,
    /// While a move drains: the ANA group it leaves (0: not moving).
    #[serde(default)]
    pub moving_from: u32,
    /// Visible only to `hosts` (`namespace add --no-auto-visible`); false: to every host
    /// allowed on the subsystem (see [`crate::visibility`]). Left out of the stored JSON
    /// when false, so entries without it encode as before.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub no_auto_visible: bool,
    /// With `no_auto_visible`: the host NQNs that see it (`namespace add-host/del-host`).
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    pub hosts: BTreeSet<String>,
    /// QoS limits (absent in the stored JSON when there are none, so states without them
    /// load unchanged and older replicas read the entry).
    #[serde(default, skip_serializing_if = "QosLimits::is_unlimited")]
    pub qos: QosLimits,
    /// The namespace's identity, what hosts read in its identification descriptors: the
    /// NGUID (32 lower-case hex digits) and the UUID (hyphenated, lower case). Chosen when
    /// the namespace is added ([`GroupState::check_namespace`]: a random UUID, or the one a
    /// client names, and an NGUID of the UUID's 16 bytes) and kept for the namespace's whole
    /// life: never derived from the NSID, so another image added under a freed NSID gets
    /// another identity. Empty only in entries written before identities were stored;
    /// decoding gives those the identity their hosts already see ([`legacy_ids`]).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub nguid: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub uuid: String,
    /// Move the image to the RBD trash when the namespace is deleted (ceph-nvmeof's
    /// `trash_image`; the delete then needs `i_am_sure`). Left out of the JSON when false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub trash_image: bool,
    /// Auto-resize off (ceph-nvmeof's `namespace_set_auto_resize` false, `namespace_add`
    /// `disable_auto_resize`): the size in bytes hosts see, whatever the image grows to
    /// (`namespace resize` changes it). None: the namespace follows its image. Stored here,
    /// not on a gateway, so a failover or a restart never changes the size under a host;
    /// left out of the JSON when None, so older states load and older replicas read it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frozen_size: Option<u64>,
}

impl NamespaceEntry {
    /// Whether this namespace's frozen size may become `size` ([`GroupState::resize_frozen`]):
    /// its auto-resize is off and `size` is no shrink. The size frozen now.
    pub fn check_frozen_resize(&self, size: u64) -> Result<u64, ConfigError> {
        let Some(old) = self.frozen_size else {
            return Err(ConfigError::Invalid {
                what: "namespace",
                value: format!("{} {}", self.subsystem_nqn, self.nsid),
                why: "its auto-resize is on: it follows its image",
            });
        };
        if size < old {
            return Err(ConfigError::Invalid {
                what: "namespace size",
                value: size.to_string(),
                why: "smaller than the namespace's (a namespace is never shrunk)",
            });
        }
        Ok(old)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ListenerEntry {
    pub subsystem_nqn: String,
    pub gateway: String,
    pub transport: String,
    pub address: String,
    pub port: u16,
    /// A secure listener: TLS 1.3 with the hosts' PSKs (NVMe/TCP only).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub secure: bool,
}

/// A host's DH-HMAC-CHAP keys on one subsystem, each in the canonical `DHHC-1:XX:<base64>:`
/// text, and its TLS PSK (None: not set). `Debug` leaves the keys out.
#[derive(Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostAuth {
    /// Proves the host: given, it must authenticate every queue.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dhchap_key: Option<String>,
    /// Proves the gateway to a host that asks (bidirectional); only with `dhchap_key`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dhchap_ctrl_key: Option<String>,
    /// The host's TLS PSK (`NVMeTLSkey-1:HH:<base64>:`) for secure listeners.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub psk: Option<String>,
    /// How the host derives its TLS keys from `psk`: "rfc8446" or "libnvme-compat"; None:
    /// "rfc8446".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub psk_derivation: Option<String>,
}

impl std::fmt::Debug for HostAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let psk = if self.psk.is_some() { ", TLS PSK" } else { "" };
        write!(f, "HostAuth({}{psk})", self.mode())
    }
}

impl HostAuth {
    /// Checks keys as an admin gives them (empty: none) with the gateway's parser: each must
    /// parse, and a controller key needs a host key. Stored in canonical text. The error
    /// names the field and why, never the key.
    pub fn parse(dhchap_key: &str, dhchap_ctrl_key: &str) -> Result<HostAuth, ConfigError> {
        let parse = |field: &'static str, text: &str| {
            if text.is_empty() {
                return Ok(None);
            }
            nvme_auth::DhchapSecret::parse(text)
                .map(|k| Some(k.to_representation().to_string()))
                .map_err(|e| ConfigError::BadKey {
                    field,
                    why: e.to_string(),
                })
        };
        let auth = HostAuth {
            dhchap_key: parse("dhchap_key", dhchap_key)?,
            dhchap_ctrl_key: parse("dhchap_ctrl_key", dhchap_ctrl_key)?,
            psk: None,
            psk_derivation: None,
        };
        if auth.dhchap_key.is_none() && auth.dhchap_ctrl_key.is_some() {
            return Err(ConfigError::BadKey {
                field: "dhchap_ctrl_key",
                why: "needs a dhchap_key: the gateway proves itself only to a host that \
                      authenticates"
                    .into(),
            });
        }
        Ok(auth)
    }

    /// "none", "host" (the host authenticates) or "bidirectional" (the gateway too, when
    /// the host asks).
    pub fn mode(&self) -> &'static str {
        match (&self.dhchap_key, &self.dhchap_ctrl_key) {
            (None, _) => "none",
            (Some(_), None) => "host",
            (Some(_), Some(_)) => "bidirectional",
        }
    }

    pub fn is_none(&self) -> bool {
        self.dhchap_key.is_none() && self.dhchap_ctrl_key.is_none() && self.psk.is_none()
    }

    /// Adds a TLS PSK as an admin gives it (empty: none), checked with the gateway's parser
    /// and stored in canonical text; `derivation` "rfc8446", "libnvme-compat" or empty (the
    /// default), and only with a key. The error names the field, never the key.
    pub fn with_psk(mut self, psk: &str, derivation: &str) -> Result<HostAuth, ConfigError> {
        use nvme_auth::tls_psk::{ConfiguredPsk, LabelEncoding};
        if psk.is_empty() {
            if !derivation.is_empty() {
                return Err(ConfigError::BadKey {
                    field: "psk_derivation",
                    why: "needs a psk: it says how the host derives its TLS keys from it".into(),
                });
            }
            return Ok(self);
        }
        let key = ConfiguredPsk::parse(psk).map_err(|e| ConfigError::BadKey {
            field: "psk",
            why: e.to_string(),
        })?;
        self.psk = Some(key.to_interchange().to_string());
        self.psk_derivation = match derivation {
            "" => None,
            name => Some(
                LabelEncoding::from_name(name)
                    .ok_or_else(|| ConfigError::BadKey {
                        field: "psk_derivation",
                        why: format!("{name:?} is not one of rfc8446, libnvme-compat"),
                    })?
                    .name()
                    .to_string(),
            ),
        };
        Ok(self)
    }
}

/// A host's keys as an admin gives them (empty: none), not yet checked: what `nvmeofctl
/// host add` and the ceph-nvmeof API's add_host send. `Debug` says which are given, never
/// what they are.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct HostKeyText {
    pub dhchap_key: String,
    pub dhchap_ctrl_key: String,
    pub psk: String,
    /// "rfc8446", "libnvme-compat" or empty (the default); only with a `psk`.
    pub psk_derivation: String,
}

impl std::fmt::Debug for HostKeyText {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let set = |k: &str| if k.is_empty() { "<none>" } else { "<set>" };
        f.debug_struct("HostKeyText")
            .field("dhchap_key", &set(&self.dhchap_key))
            .field("dhchap_ctrl_key", &set(&self.dhchap_ctrl_key))
            .field("psk", &set(&self.psk))
            .field("psk_derivation", &self.psk_derivation)
            .finish()
    }
}

impl HostKeyText {
    /// The keys checked and in canonical text ([`HostAuth::parse`], [`HostAuth::with_psk`]).
    pub fn parse(&self) -> Result<HostAuth, ConfigError> {
        HostAuth::parse(&self.dhchap_key, &self.dhchap_ctrl_key)?
            .with_psk(&self.psk, &self.psk_derivation)
    }
}

/// A `host/...` value: `[nqn, host]`, or `[nqn, host, keys]` for a host with keys. A decoding
/// error says only that it matched neither (serde's messages may quote a value).
#[derive(Deserialize)]
#[serde(untagged)]
enum StoredHost {
    Plain(String, String),
    Keyed(String, String, HostAuth),
}

fn host_value(nqn: &str, host: &str, auth: &HostAuth) -> Vec<u8> {
    if auth.is_none() {
        json(&(nqn, host))
    } else {
        json(&(nqn, host, auth))
    }
}

/// Why a change is refused. Every message names the offending value (never a key).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("invalid {what} {nqn:?}: {why}")]
    InvalidNqn {
        what: &'static str,
        nqn: String,
        why: String,
    },
    #[error("subsystem {0} already exists")]
    SubsystemExists(String),
    #[error("subsystem {0} not found")]
    NoSubsystem(String),
    #[error("subsystem {nqn} still has {count} namespace(s); delete them or use --force")]
    SubsystemNotEmpty { nqn: String, count: usize },
    #[error("namespace {nsid} already exists in {nqn}")]
    NamespaceExists { nqn: String, nsid: u32 },
    #[error("namespace {nsid} not found in {nqn}")]
    NoNamespace { nqn: String, nsid: u32 },
    #[error("NSID {nsid} out of range 1..={max}")]
    NsidRange { nsid: u32, max: u32 },
    #[error("{nqn} has no free NSID (max {max})")]
    NoFreeNsid { nqn: String, max: u32 },
    #[error("block size {0} is not 512 or 4096")]
    BlockSize(u32),
    #[error("image {0} is already namespace {2} of {1}")]
    ImageInUse(String, String, u32),
    /// A namespace UUID (or the NGUID made of it) that another namespace has.
    #[error("namespace UUID {uuid} is already the identity of namespace {nsid} of {nqn}")]
    IdentityInUse {
        uuid: String,
        nqn: String,
        nsid: u32,
    },
    #[error("ANA group {0} has no gateway")]
    NoAnaGroup(u32),
    #[error("{what} must not be empty")]
    Empty { what: &'static str },
    #[error("invalid {what} {value:?}: {why}")]
    Invalid {
        what: &'static str,
        value: String,
        why: &'static str,
    },
    #[error("listener {0} already exists")]
    ListenerExists(String),
    #[error("listener {0} not found")]
    NoListener(String),
    /// A gateway's address and port is either secure (TLS) or plain for all subsystems.
    #[error(
        "listener {listener}: the same gateway, address and port is already {} for subsystem \
         {other}; a port is secure (TLS) or plain for every subsystem it serves",
        if *secure { "secure" } else { "plain (not secure)" }
    )]
    SecureMismatch {
        listener: String,
        other: String,
        secure: bool,
    },
    #[error("host {host} already allowed on {nqn}")]
    HostExists { nqn: String, host: String },
    #[error("host {host} not allowed on {nqn}")]
    NoHost { nqn: String, host: String },
    #[error("stored state is corrupt: key {key}: {why}")]
    Corrupt { key: String, why: String },
    /// A DH-HMAC-CHAP key or TLS PSK that does not parse, a controller key without a host
    /// key, or a PSK derivation that is unknown or without a PSK.
    #[error("invalid {field}: {why}")]
    BadKey { field: &'static str, why: String },
    /// `namespace add-host/del-host` on a namespace every allowed host sees.
    #[error(
        "namespace {nsid} of {nqn} is visible to every allowed host (it was added without \
         --no-auto-visible): it has no host list"
    )]
    NamespaceAutoVisible { nqn: String, nsid: u32 },
    #[error("host {host} already sees namespace {nsid} of {nqn}")]
    NamespaceHostExists {
        nqn: String,
        nsid: u32,
        host: String,
    },
    #[error("host {host} is not on the host list of namespace {nsid} of {nqn}")]
    NoNamespaceHost {
        nqn: String,
        nsid: u32,
        host: String,
    },
    #[error("namespace {nsid} of {nqn} already has {max} hosts, the most a namespace may have")]
    TooManyNamespaceHosts { nqn: String, nsid: u32, max: usize },
    #[error(transparent)]
    Qos(#[from] QosError),
    /// `change_subsystem_key` while a host of the subsystem has no key.
    #[error(
        "subsystem {nqn} cannot have a DH-HMAC-CHAP key while host {host} has none of its own"
    )]
    HostWithoutKey { nqn: String, host: String },
    /// A namespace with a host list made visible to every host without `force`.
    #[error(
        "namespace {nsid} of {nqn} has {count} host(s) on its list: remove them first, or \
         force it (--force) to make it visible to every allowed host and drop the list"
    )]
    NamespaceHasHosts {
        nqn: String,
        nsid: u32,
        count: usize,
    },
}

/// Checks an NQN as Linux nvmet takes it ([`crate::nqn::check`]); `what` names it in the
/// error ("subsystem NQN", "host NQN"). A name outside the NVMe formats passes: the server
/// adds the warning to its reply.
pub fn check_nqn(what: &'static str, nqn: &str) -> Result<(), ConfigError> {
    crate::nqn::check(nqn)
        .map(|_| ())
        .map_err(|e| ConfigError::InvalidNqn {
            what,
            nqn: nqn.to_string(),
            why: e.to_string(),
        })
}

/// The NGUID and UUID a namespace had before identities were stored with it: UUIDv5 of
/// `<nqn>/<nsid>` in the product's namespace (the derivation gateways used for every
/// namespace). Only entries written by that code get them, so their hosts keep the identity
/// they see; never used for a new namespace, since another image under the same NSID would
/// get the same identity.
pub fn legacy_ids(nqn: &str, nsid: u32) -> (String, String) {
    const PRODUCT: uuid::Uuid = uuid::Uuid::from_u128(0x6c1d_7a1e_52c4_4f0e_9a6b_8e0b_3f2d_a001);
    let identity = format!("{nqn}/{nsid}");
    let uuid = uuid::Uuid::new_v5(&PRODUCT, identity.as_bytes());
    let nguid = uuid::Uuid::new_v5(&PRODUCT, format!("nguid:{identity}").as_bytes());
    (nguid.simple().to_string(), uuid.hyphenated().to_string())
}

/// A stored identity as this code writes it: a 32-digit lower-case hex NGUID and a
/// hyphenated lower-case UUID, neither nil. Anything else is a corrupt entry: pushing it
/// would give hosts an identity nobody chose.
fn check_stored_identity(n: &NamespaceEntry) -> Result<(), String> {
    let nguid = uuid::Uuid::try_parse(&n.nguid).ok();
    let uuid = uuid::Uuid::try_parse(&n.uuid).ok();
    match (nguid, uuid) {
        (Some(g), Some(u))
            if !g.is_nil()
                && !u.is_nil()
                && g.simple().to_string() == n.nguid
                && u.hyphenated().to_string() == n.uuid =>
        {
            Ok(())
        }
        _ => Err(format!(
            "namespace identity nguid {:?} uuid {:?} is not 32 lower-case hex digits and a \
             hyphenated lower-case UUID",
            n.nguid, n.uuid
        )),
    }
}

fn check_name(what: &'static str, value: &str) -> Result<(), ConfigError> {
    if value.is_empty() {
        return Err(ConfigError::Empty { what });
    }
    if value.contains('/') || value.chars().any(|c| c.is_control() || c.is_whitespace()) {
        return Err(ConfigError::Invalid {
            what,
            value: value.to_string(),
            why: "contains '/', whitespace or control characters",
        });
    }
    Ok(())
}

/// The whole group state: configuration plus the group map.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GroupState {
    pub version: u64,
    pub subsystems: BTreeMap<String, SubsystemEntry>,
    pub namespaces: BTreeMap<(String, u32), NamespaceEntry>,
    pub listeners: BTreeSet<ListenerEntry>,
    /// (subsystem NQN, host NQN) → the host's keys.
    pub hosts: BTreeMap<(String, String), HostAuth>,
    pub map: Option<GroupMap>,
    /// Group-wide settings (`settings` key; absent in states written before it).
    pub settings: GroupSettings,
}

/// Settings of the whole group, stored under the omap key `settings` (left out while
/// none is set, so a state without them is written as before).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupSettings {
    /// The log level every gateway and control-plane replica runs at (ceph-nvmeof's
    /// `set_gateway_log_level`, `nvmeofctl log-level set`): one of [`LOG_LEVELS`]. None:
    /// each process keeps its own (`RUST_LOG`, else info).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub log_level: Option<String>,
}

impl GroupSettings {
    fn is_empty(&self) -> bool {
        self.log_level.is_none()
    }
}

/// The log levels a group can be set to, most verbose first.
pub const LOG_LEVELS: [&str; 5] = ["trace", "debug", "info", "warn", "error"];

/// The omap key of [`GroupSettings`].
const SETTINGS_KEY: &str = "settings";

fn json<T: Serialize>(v: &T) -> Vec<u8> {
    // Serialising these plain structs cannot fail.
    serde_json::to_vec(v).unwrap_or_default()
}

impl GroupState {
    /// Decodes an omap. Unknown keys are ignored (newer writers).
    pub fn from_omap(omap: &Omap) -> Result<GroupState, ConfigError> {
        let corrupt = |key: &str, why: String| ConfigError::Corrupt {
            key: key.to_string(),
            why,
        };
        let mut st = GroupState::default();
        for (k, v) in omap {
            if k == "version" {
                let text = String::from_utf8_lossy(v);
                st.version = text.parse().map_err(|e| corrupt(k, format!("{e}")))?;
            } else if k == SETTINGS_KEY {
                st.settings = serde_json::from_slice(v).map_err(|e| corrupt(k, e.to_string()))?;
            } else if k == "groupmap" {
                st.map = Some(serde_json::from_slice(v).map_err(|e| corrupt(k, e.to_string()))?);
            } else if k.starts_with("subsystem/") {
                let s: SubsystemEntry =
                    serde_json::from_slice(v).map_err(|e| corrupt(k, e.to_string()))?;
                st.subsystems.insert(s.nqn.clone(), s);
            } else if k.starts_with("namespace/") {
                let mut n: NamespaceEntry =
                    serde_json::from_slice(v).map_err(|e| corrupt(k, e.to_string()))?;
                if n.uuid.is_empty() || n.nguid.is_empty() {
                    // Written before identities were stored: the one its hosts see.
                    (n.nguid, n.uuid) = legacy_ids(&n.subsystem_nqn, n.nsid);
                }
                check_stored_identity(&n).map_err(|why| corrupt(k, why))?;
                st.namespaces.insert((n.subsystem_nqn.clone(), n.nsid), n);
            } else if k.starts_with("listener/") {
                let l: ListenerEntry =
                    serde_json::from_slice(v).map_err(|e| corrupt(k, e.to_string()))?;
                st.listeners.insert(l);
            } else if k.starts_with("host/") {
                let (nqn, host, auth) = match serde_json::from_slice(v)
                    .map_err(|_| corrupt(k, "not [nqn, host] or [nqn, host, keys]".into()))?
                {
                    StoredHost::Plain(nqn, host) => (nqn, host, HostAuth::default()),
                    StoredHost::Keyed(nqn, host, auth) => (nqn, host, auth),
                };
                st.hosts.insert((nqn, host), auth);
            }
        }
        Ok(st)
    }

    /// Encodes everything but `version`.
    pub fn to_omap(&self) -> Omap {
        let mut m = Omap::new();
        for s in self.subsystems.values() {
            m.insert(subsystem_key(&s.nqn), json(s));
        }
        for n in self.namespaces.values() {
            m.insert(namespace_key(n), json(n));
        }
        for l in &self.listeners {
            m.insert(listener_key(l), json(l));
        }
        for ((nqn, host), auth) in &self.hosts {
            m.insert(host_key(nqn, host), host_value(nqn, host, auth));
        }
        if let Some(map) = &self.map {
            m.insert("groupmap".into(), json(map));
        }
        if !self.settings.is_empty() {
            m.insert(SETTINGS_KEY.into(), json(&self.settings));
        }
        m
    }

    /// The keys to set and remove to go from `old` to `self` (never `version`). Entries are
    /// compared as values and only the changed ones encoded: no full encoding of either state.
    pub fn diff(&self, old: &GroupState) -> (Vec<(String, Vec<u8>)>, Vec<String>) {
        let mut set = Vec::new();
        let mut remove = Vec::new();
        diff_section(
            &old.subsystems,
            &self.subsystems,
            |_, s| subsystem_key(&s.nqn),
            |_, s| json(s),
            &mut set,
            &mut remove,
        );
        diff_section(
            &old.namespaces,
            &self.namespaces,
            |_, n| namespace_key(n),
            |_, n| json(n),
            &mut set,
            &mut remove,
        );
        if self.listeners != old.listeners {
            for l in self.listeners.difference(&old.listeners) {
                set.push((listener_key(l), json(l)));
            }
            for l in old.listeners.difference(&self.listeners) {
                remove.push(listener_key(l));
            }
        }
        diff_section(
            &old.hosts,
            &self.hosts,
            |(nqn, host), _| host_key(nqn, host),
            |(nqn, host), auth| host_value(nqn, host, auth),
            &mut set,
            &mut remove,
        );
        // The map carries beacon times that are not stored: compare its encoding (small,
        // one entry per gateway and ANA group).
        let map_bytes = |m: &Option<GroupMap>| m.as_ref().map(json);
        match (map_bytes(&self.map), map_bytes(&old.map)) {
            (Some(new), old_bytes) if Some(&new) != old_bytes.as_ref() => {
                set.push(("groupmap".into(), new));
            }
            (None, Some(_)) => remove.push("groupmap".into()),
            _ => {}
        }
        if self.settings != old.settings {
            if self.settings.is_empty() {
                remove.push(SETTINGS_KEY.into());
            } else {
                set.push((SETTINGS_KEY.into(), json(&self.settings)));
            }
        }
        (set, remove)
    }

    /// Applies a delta written by another replica (see [`GroupState::diff`]) in place.
    pub fn apply(
        &mut self,
        set: &[(String, Vec<u8>)],
        remove: &[String],
    ) -> Result<(), ConfigError> {
        for k in remove {
            let mut parts = k.split('/');
            match (parts.next(), parts.next(), parts.next()) {
                (Some("namespace"), Some(nqn), Some(nsid)) => {
                    if let Ok(nsid) = nsid.parse::<u32>() {
                        self.namespaces.remove(&(unescape_key_part(nqn), nsid));
                    }
                }
                (Some("subsystem"), Some(nqn), None) => {
                    self.subsystems.remove(&unescape_key_part(nqn));
                }
                (Some("host"), Some(nqn), Some(host)) => {
                    self.hosts
                        .remove(&(unescape_key_part(nqn), unescape_key_part(host)));
                }
                (Some("listener"), ..) => self.listeners.retain(|l| listener_key(l) != *k),
                (Some("groupmap"), None, None) => self.map = None,
                (Some(SETTINGS_KEY), None, None) => self.settings = GroupSettings::default(),
                _ => {} // a newer writer's key
            }
        }
        let mut omap = Omap::new();
        for (k, v) in set {
            omap.insert(k.clone(), v.clone());
        }
        let part = GroupState::from_omap(&omap)?;
        self.subsystems.extend(part.subsystems);
        self.namespaces.extend(part.namespaces);
        self.listeners.extend(part.listeners);
        self.hosts.extend(part.hosts);
        if part.map.is_some() {
            self.map = part.map;
        }
        if set.iter().any(|(k, _)| k == SETTINGS_KEY) {
            self.settings = part.settings;
        }
        Ok(())
    }

    /// ANA groups that have a gateway.
    pub fn groups(&self) -> Vec<u32> {
        self.map
            .as_ref()
            .map(|m| m.groups.keys().copied().collect())
            .unwrap_or_default()
    }

    fn subsystem(&self, nqn: &str) -> Result<&SubsystemEntry, ConfigError> {
        self.subsystems
            .get(nqn)
            .ok_or_else(|| ConfigError::NoSubsystem(nqn.to_string()))
    }

    pub fn add_subsystem(
        &mut self,
        nqn: &str,
        serial: &str,
        allow_any_host: bool,
        max_namespaces: u32,
    ) -> Result<(), ConfigError> {
        check_nqn("subsystem NQN", nqn)?;
        if nqn == "nqn.2014-08.org.nvmexpress.discovery" {
            return Err(ConfigError::InvalidNqn {
                what: "subsystem NQN",
                nqn: nqn.into(),
                why: "that is the discovery subsystem's NQN".into(),
            });
        }
        if self.subsystems.contains_key(nqn) {
            return Err(ConfigError::SubsystemExists(nqn.into()));
        }
        if serial.len() > 20 || !serial.is_ascii() {
            return Err(ConfigError::Invalid {
                what: "serial",
                value: serial.into(),
                why: "more than 20 ASCII characters",
            });
        }
        let max = if max_namespaces == 0 {
            DEFAULT_MAX_NAMESPACES
        } else {
            max_namespaces
        };
        if max > DEFAULT_MAX_NAMESPACES {
            return Err(ConfigError::NsidRange {
                nsid: max,
                max: DEFAULT_MAX_NAMESPACES,
            });
        }
        self.subsystems.insert(
            nqn.into(),
            SubsystemEntry {
                nqn: nqn.into(),
                serial: serial.into(),
                allow_any_host,
                max_namespaces: max,
                require_tls: false,
                dhchap_key: None,
            },
        );
        Ok(())
    }

    /// Sets whether subsystem `nqn` requires TLS.
    pub fn set_require_tls(&mut self, nqn: &str, required: bool) -> Result<(), ConfigError> {
        self.subsystem(nqn)?;
        if let Some(s) = self.subsystems.get_mut(nqn) {
            s.require_tls = required;
        }
        Ok(())
    }

    pub fn del_subsystem(&mut self, nqn: &str, force: bool) -> Result<(), ConfigError> {
        self.subsystem(nqn)?;
        let count = self.namespaces.keys().filter(|(n, _)| n == nqn).count();
        if count > 0 && !force {
            return Err(ConfigError::SubsystemNotEmpty {
                nqn: nqn.into(),
                count,
            });
        }
        self.subsystems.remove(nqn);
        self.namespaces.retain(|(n, _), _| n != nqn);
        self.listeners.retain(|l| l.subsystem_nqn != nqn);
        self.hosts.retain(|(n, _), _| n != nqn);
        Ok(())
    }

    /// Adds a namespace; `nsid` 0 = the lowest free, `ana_group` 0 = the group with the
    /// fewest namespaces. Returns the entry added.
    pub fn add_namespace(&mut self, ns: NamespaceEntry) -> Result<NamespaceEntry, ConfigError> {
        let ns = self.check_namespace(ns)?;
        self.namespaces
            .insert((ns.subsystem_nqn.clone(), ns.nsid), ns.clone());
        Ok(ns)
    }

    /// The checks of [`GroupState::add_namespace`] without adding: the entry as it would be
    /// added (NSID, ANA group and block size chosen).
    pub fn check_namespace(&self, mut ns: NamespaceEntry) -> Result<NamespaceEntry, ConfigError> {
        let max = self.subsystem(&ns.subsystem_nqn)?.max_namespaces;
        ns.qos.check()?;
        check_name("pool", &ns.pool)?;
        check_name("image", &ns.image)?;
        if !ns.rados_namespace.is_empty() {
            check_name("rados namespace", &ns.rados_namespace)?;
        }
        if ns.block_size == 0 {
            ns.block_size = 512;
        }
        if ns.block_size != 512 && ns.block_size != 4096 {
            return Err(ConfigError::BlockSize(ns.block_size));
        }
        let nqn = ns.subsystem_nqn.clone();
        let used = |nsid: u32| self.namespaces.contains_key(&(nqn.clone(), nsid));
        if ns.nsid == 0 {
            // The first gap in this subsystem's NSIDs (keys are sorted).
            let mut free = 1u32;
            for (_, id) in self
                .namespaces
                .range((nqn.clone(), 1)..=(nqn.clone(), u32::MAX))
                .map(|(k, _)| k)
            {
                if *id != free {
                    break;
                }
                free += 1;
            }
            if free > max {
                return Err(ConfigError::NoFreeNsid { nqn, max });
            }
            ns.nsid = free;
        } else if ns.nsid > max {
            return Err(ConfigError::NsidRange { nsid: ns.nsid, max });
        } else if used(ns.nsid) {
            return Err(ConfigError::NamespaceExists {
                nqn: ns.subsystem_nqn.clone(),
                nsid: ns.nsid,
            });
        }
        if let Some(other) = self.namespaces.values().find(|o| {
            o.pool == ns.pool && o.rados_namespace == ns.rados_namespace && o.image == ns.image
        }) {
            return Err(ConfigError::ImageInUse(
                image_spec(&ns),
                other.subsystem_nqn.clone(),
                other.nsid,
            ));
        }
        (ns.nguid, ns.uuid) = self.new_identity(&ns.uuid)?;
        let groups = self.groups();
        if ns.ana_group == 0 {
            let mut counts = BTreeMap::new();
            for n in self.namespaces.values() {
                *counts.entry(n.ana_group).or_insert(0usize) += 1;
            }
            ns.ana_group = ana::pick_group(&groups, &counts).unwrap_or(1);
        } else if !groups.contains(&ns.ana_group) {
            return Err(ConfigError::NoAnaGroup(ns.ana_group));
        }
        Ok(ns)
    }

    /// The identity of a namespace being added: `uuid` as a client names it (any form
    /// `uuid` parses: hyphenated, 32 hex digits, braced or URN; not nil) or, empty, a random
    /// (version 4) one; the NGUID is the UUID's 16 bytes. Refused when another namespace of
    /// the group has that UUID or NGUID.
    fn new_identity(&self, uuid: &str) -> Result<(String, String), ConfigError> {
        let uuid = if uuid.is_empty() {
            uuid::Uuid::new_v4()
        } else {
            let parsed = uuid::Uuid::parse_str(uuid).map_err(|_| ConfigError::Invalid {
                what: "namespace UUID",
                value: uuid.to_string(),
                why: "not a UUID (e.g. 3f2504e0-4f89-41d3-9a0c-0305e82c3301)",
            })?;
            if parsed.is_nil() {
                return Err(ConfigError::Invalid {
                    what: "namespace UUID",
                    value: uuid.to_string(),
                    why: "the nil UUID means \"none\" to hosts",
                });
            }
            parsed
        };
        let (nguid, uuid) = (uuid.simple().to_string(), uuid.hyphenated().to_string());
        if let Some(other) = self
            .namespaces
            .values()
            .find(|o| o.uuid == uuid || o.nguid == nguid)
        {
            return Err(ConfigError::IdentityInUse {
                uuid,
                nqn: other.subsystem_nqn.clone(),
                nsid: other.nsid,
            });
        }
        Ok((nguid, uuid))
    }

    pub fn del_namespace(&mut self, nqn: &str, nsid: u32) -> Result<(), ConfigError> {
        self.subsystem(nqn)?;
        self.namespaces
            .remove(&(nqn.to_string(), nsid))
            .map(|_| ())
            .ok_or(ConfigError::NoNamespace {
                nqn: nqn.into(),
                nsid,
            })
    }

    /// Changes a namespace's QoS limits by `change` (absent limits stay, 0 clears one);
    /// returns the limits now in force. Refused limits change nothing.
    pub fn set_qos(
        &mut self,
        nqn: &str,
        nsid: u32,
        change: &crate::proto::QosLimits,
    ) -> Result<QosLimits, ConfigError> {
        self.subsystem(nqn)?;
        let ns =
            self.namespaces
                .get_mut(&(nqn.to_string(), nsid))
                .ok_or(ConfigError::NoNamespace {
                    nqn: nqn.into(),
                    nsid,
                })?;
        let limits = ns.qos.changed_by(change);
        limits.check()?;
        ns.qos = limits;
        Ok(limits)
    }

    /// Makes a namespace visible to every allowed host (`auto_visible`) or only to the
    /// hosts on its list (none at first): ceph-nvmeof's `namespace_change_visibility`.
    /// Turning a namespace with a host list visible to all drops the list, which needs
    /// `force` ([`ConfigError::NamespaceHasHosts`] otherwise). Returns whether it changed.
    pub fn set_namespace_visibility(
        &mut self,
        nqn: &str,
        nsid: u32,
        auto_visible: bool,
        force: bool,
    ) -> Result<bool, ConfigError> {
        let ns = self.namespace_mut(nqn, nsid)?;
        if auto_visible && !ns.hosts.is_empty() && !force {
            return Err(ConfigError::NamespaceHasHosts {
                nqn: nqn.into(),
                nsid,
                count: ns.hosts.len(),
            });
        }
        let changed = ns.no_auto_visible == auto_visible;
        ns.no_auto_visible = !auto_visible;
        if auto_visible {
            ns.hosts.clear();
        }
        Ok(changed)
    }

    /// Sets whether a namespace's image goes to the RBD trash when the namespace is deleted
    /// with it. Returns whether it changed.
    pub fn set_trash_image(
        &mut self,
        nqn: &str,
        nsid: u32,
        trash: bool,
    ) -> Result<bool, ConfigError> {
        let ns = self.namespace_mut(nqn, nsid)?;
        let changed = ns.trash_image != trash;
        ns.trash_image = trash;
        Ok(changed)
    }

    /// Turns a namespace's auto-resize on (`frozen` None: it follows its image again) or off
    /// (`frozen`: the size it keeps, the image's size now as the caller read it). Turning it
    /// off while already off keeps the size frozen before: what hosts see does not move.
    /// Returns whether it changed.
    pub fn set_auto_resize(
        &mut self,
        nqn: &str,
        nsid: u32,
        frozen: Option<u64>,
    ) -> Result<bool, ConfigError> {
        let ns = self.namespace_mut(nqn, nsid)?;
        let next = match (ns.frozen_size, frozen) {
            (Some(kept), Some(_)) => Some(kept),
            (_, next) => next,
        };
        if next == Some(0) {
            return Err(ConfigError::Invalid {
                what: "frozen namespace size",
                value: "0".into(),
                why: "a namespace keeps a size of at least one block",
            });
        }
        let changed = ns.frozen_size != next;
        ns.frozen_size = next;
        Ok(changed)
    }

    /// An explicit resize of a namespace whose auto-resize is off: its frozen size becomes
    /// `size` (the caller grew its image to at least that first). Refused for a namespace
    /// that follows its image (nothing frozen to change) and for a shrink. Returns the size
    /// frozen before.
    pub fn resize_frozen(&mut self, nqn: &str, nsid: u32, size: u64) -> Result<u64, ConfigError> {
        let ns = self.namespace_mut(nqn, nsid)?;
        let old = ns.check_frozen_resize(size)?;
        ns.frozen_size = Some(size);
        Ok(old)
    }

    /// Sets (a key) or removes (empty) subsystem `nqn`'s DH-HMAC-CHAP key, checked with the
    /// gateway's parser and stored in canonical text. As in ceph-nvmeof, a key is refused
    /// while a host of the subsystem has no key of its own (it could never be asked for the
    /// subsystem's). Returns whether it changed.
    pub fn set_subsystem_key(&mut self, nqn: &str, key: &str) -> Result<bool, ConfigError> {
        self.subsystem(nqn)?;
        let key = if key.is_empty() {
            None
        } else {
            let parsed = nvme_auth::DhchapSecret::parse(key).map_err(|e| ConfigError::BadKey {
                field: "dhchap_key",
                why: e.to_string(),
            })?;
            if let Some((host, _)) = self
                .host_entries_of(nqn)
                .find(|(_, auth)| auth.dhchap_key.is_none())
            {
                return Err(ConfigError::HostWithoutKey {
                    nqn: nqn.into(),
                    host: host.into(),
                });
            }
            Some(parsed.to_representation().to_string())
        };
        let entry = self
            .subsystems
            .get_mut(nqn)
            .ok_or_else(|| ConfigError::NoSubsystem(nqn.to_string()))?;
        let changed = entry.dhchap_key != key;
        entry.dhchap_key = key;
        Ok(changed)
    }

    /// The keys a gateway enforces for a host of `nqn` stored with `auth`: a host that
    /// authenticates but has no controller key of its own gets the subsystem's key as its
    /// controller key (ceph-nvmeof's "subsystem implicit" controller key).
    pub fn auth_in_force(&self, nqn: &str, auth: &HostAuth) -> HostAuth {
        let mut auth = auth.clone();
        if auth.dhchap_key.is_some() && auth.dhchap_ctrl_key.is_none() {
            auth.dhchap_ctrl_key = self.subsystems.get(nqn).and_then(|s| s.dhchap_key.clone());
        }
        auth
    }

    /// Sets the group's log level (one of [`LOG_LEVELS`]; None: each process its own).
    /// Returns whether it changed.
    pub fn set_log_level(&mut self, level: Option<&str>) -> Result<bool, ConfigError> {
        if let Some(l) = level {
            if !LOG_LEVELS.contains(&l) {
                return Err(ConfigError::Invalid {
                    what: "log level",
                    value: l.into(),
                    why: "not one of trace, debug, info, warn, error",
                });
            }
        }
        let level = level.map(str::to_string);
        let changed = self.settings.log_level != level;
        self.settings.log_level = level;
        Ok(changed)
    }

    fn namespace_mut(&mut self, nqn: &str, nsid: u32) -> Result<&mut NamespaceEntry, ConfigError> {
        self.subsystem(nqn)?;
        self.namespaces
            .get_mut(&(nqn.to_string(), nsid))
            .ok_or(ConfigError::NoNamespace {
                nqn: nqn.into(),
                nsid,
            })
    }

    /// Moves a namespace to another ANA group (another gateway's optimized path).
    pub fn move_namespace(&mut self, nqn: &str, nsid: u32, group: u32) -> Result<(), ConfigError> {
        self.subsystem(nqn)?;
        if !self.groups().contains(&group) {
            return Err(ConfigError::NoAnaGroup(group));
        }
        let ns =
            self.namespaces
                .get_mut(&(nqn.to_string(), nsid))
                .ok_or(ConfigError::NoNamespace {
                    nqn: nqn.into(),
                    nsid,
                })?;
        if ns.ana_group != group && ns.moving_from == 0 {
            ns.moving_from = ns.ana_group;
        }
        ns.ana_group = group;
        if ns.moving_from == group {
            // Moved back before the first move finished: nothing to drain.
            ns.moving_from = 0;
        }
        Ok(())
    }

    /// Ends a namespace move: every gateway serves it in its new group.
    pub fn finish_move(&mut self, nqn: &str, nsid: u32) -> Result<(), ConfigError> {
        if let Some(ns) = self.namespaces.get_mut(&(nqn.to_string(), nsid)) {
            ns.moving_from = 0;
        }
        Ok(())
    }

    /// Ends a namespace move away from group `from`; nothing if the namespace is gone or no
    /// longer leaves `from` (moved back, or ended and moved again since).
    pub fn finish_move_from(&mut self, nqn: &str, nsid: u32, from: u32) -> Result<(), ConfigError> {
        if let Some(ns) = self.namespaces.get_mut(&(nqn.to_string(), nsid)) {
            if ns.moving_from == from {
                ns.moving_from = 0;
            }
        }
        Ok(())
    }

    /// Adds a listener; its address is stored in canonical text (`::1` for `[0:0::1]`), so
    /// one address written two ways is one listener, here and on the gateways that compare
    /// the pushed listeners with their own.
    pub fn add_listener(&mut self, mut l: ListenerEntry) -> Result<(), ConfigError> {
        self.subsystem(&l.subsystem_nqn)?;
        check_name("gateway", &l.gateway)?;
        if l.transport != "tcp" && l.transport != "rdma" {
            return Err(ConfigError::Invalid {
                what: "transport",
                value: l.transport.clone(),
                why: "must be tcp or rdma",
            });
        }
        l.address = canonical_address(&l.address).ok_or_else(|| ConfigError::Invalid {
            what: "address",
            value: l.address.clone(),
            why: "not a numeric IPv4/IPv6 address",
        })?;
        if l.port == 0 {
            return Err(ConfigError::Invalid {
                what: "port",
                value: "0".into(),
                why: "must be 1..=65535",
            });
        }
        if l.secure && l.transport != "tcp" {
            return Err(ConfigError::Invalid {
                what: "secure",
                value: l.transport.clone(),
                why: "TLS secure channels are for NVMe/TCP listeners only",
            });
        }
        // `secure` is not part of the omap key: one entry per key, whatever its flag.
        if self.listeners.iter().any(|o| same_listener(o, &l)) {
            return Err(ConfigError::ListenerExists(listener_key(&l)));
        }
        // A gateway's socket is either TLS or plain for every subsystem it serves.
        if let Some(other) = self.listeners.iter().find(|o| {
            o.gateway == l.gateway
                && o.transport == l.transport
                && o.address == l.address
                && o.port == l.port
                && o.secure != l.secure
        }) {
            return Err(ConfigError::SecureMismatch {
                listener: listener_key(&l),
                other: other.subsystem_nqn.clone(),
                secure: other.secure,
            });
        }
        self.listeners.insert(l);
        Ok(())
    }

    /// Deletes a listener whatever its `secure` flag (the request's is not compared).
    pub fn del_listener(&mut self, l: &ListenerEntry) -> Result<(), ConfigError> {
        self.subsystem(&l.subsystem_nqn)?;
        let mut key = l.clone();
        if let Some(address) = canonical_address(&l.address) {
            key.address = address;
        }
        // As typed too: a listener stored before addresses were made canonical.
        let found = self
            .listeners
            .iter()
            .find(|o| same_listener(o, &key) || same_listener(o, l))
            .cloned();
        match found {
            Some(stored) => {
                self.listeners.remove(&stored);
                Ok(())
            }
            None => Err(ConfigError::NoListener(listener_key(l))),
        }
    }

    /// Allows `host` on subsystem `nqn`, without keys.
    pub fn add_host(&mut self, nqn: &str, host: &str) -> Result<(), ConfigError> {
        self.add_host_with_keys(nqn, host, "", "").map(|_| ())
    }

    /// Allows `host` on subsystem `nqn` with DH-HMAC-CHAP keys (empty: none; see
    /// [`HostAuth::parse`]). Returns the keys as stored.
    pub fn add_host_with_keys(
        &mut self,
        nqn: &str,
        host: &str,
        dhchap_key: &str,
        dhchap_ctrl_key: &str,
    ) -> Result<HostAuth, ConfigError> {
        let keys = HostKeyText {
            dhchap_key: dhchap_key.into(),
            dhchap_ctrl_key: dhchap_ctrl_key.into(),
            ..HostKeyText::default()
        };
        self.add_host_with_key_text(nqn, host, &keys)
    }

    /// Allows `host` on subsystem `nqn` with its keys as an admin gives them (DH-HMAC-CHAP
    /// keys and TLS PSK, [`HostKeyText::parse`]); the subsystem and the host NQN are checked
    /// first. Returns the keys as stored.
    pub fn add_host_with_key_text(
        &mut self,
        nqn: &str,
        host: &str,
        keys: &HostKeyText,
    ) -> Result<HostAuth, ConfigError> {
        self.subsystem(nqn)?;
        check_nqn("host NQN", host)?;
        let auth = keys.parse()?;
        self.add_host_with_auth(nqn, host, auth)
    }

    /// Allows `host` on subsystem `nqn` with `auth` (already checked). Returns it as stored.
    pub fn add_host_with_auth(
        &mut self,
        nqn: &str,
        host: &str,
        auth: HostAuth,
    ) -> Result<HostAuth, ConfigError> {
        self.subsystem(nqn)?;
        check_nqn("host NQN", host)?;
        match self.hosts.entry((nqn.into(), host.into())) {
            std::collections::btree_map::Entry::Occupied(_) => Err(ConfigError::HostExists {
                nqn: nqn.into(),
                host: host.into(),
            }),
            std::collections::btree_map::Entry::Vacant(v) => Ok(v.insert(auth).clone()),
        }
    }

    /// Sets, replaces or (both empty) clears the DH-HMAC-CHAP keys of a host already allowed
    /// on `nqn`; the host and its TLS PSK stay (the ceph-nvmeof API's change_host_key, which
    /// knows no PSKs). Returns the keys as stored and whether they changed.
    pub fn change_host_keys(
        &mut self,
        nqn: &str,
        host: &str,
        dhchap_key: &str,
        dhchap_ctrl_key: &str,
    ) -> Result<(HostAuth, bool), ConfigError> {
        let mut auth = HostAuth::parse(dhchap_key, dhchap_ctrl_key)?;
        if let Some(stored) = self.hosts.get(&(nqn.to_string(), host.to_string())) {
            auth.psk = stored.psk.clone();
            auth.psk_derivation = stored.psk_derivation.clone();
        }
        self.change_host_auth(nqn, host, auth)
    }

    /// Replaces all of a host's keys (DH-HMAC-CHAP and TLS PSK) with `auth` (already
    /// checked): `HostChangeKey`. Returns the keys as stored and whether they changed.
    pub fn change_host_auth(
        &mut self,
        nqn: &str,
        host: &str,
        auth: HostAuth,
    ) -> Result<(HostAuth, bool), ConfigError> {
        self.subsystem(nqn)?;
        let stored = self
            .hosts
            .get_mut(&(nqn.to_string(), host.to_string()))
            .ok_or_else(|| ConfigError::NoHost {
                nqn: nqn.into(),
                host: host.into(),
            })?;
        let changed = *stored != auth;
        *stored = auth.clone();
        Ok((auth, changed))
    }

    pub fn del_host(&mut self, nqn: &str, host: &str) -> Result<(), ConfigError> {
        self.subsystem(nqn)?;
        if self
            .hosts
            .remove(&(nqn.to_string(), host.to_string()))
            .is_none()
        {
            return Err(ConfigError::NoHost {
                nqn: nqn.into(),
                host: host.into(),
            });
        }
        Ok(())
    }

    /// Opens `nqn` to any host, or closes it to the listed hosts only. Refused when it
    /// already is so ([`ConfigError::HostExists`] / [`ConfigError::NoHost`] for host `*`,
    /// how ceph-nvmeof's API names "any host").
    pub fn set_allow_any_host(&mut self, nqn: &str, allow: bool) -> Result<(), ConfigError> {
        let entry = self
            .subsystems
            .get_mut(nqn)
            .ok_or_else(|| ConfigError::NoSubsystem(nqn.to_string()))?;
        match (entry.allow_any_host, allow) {
            (true, true) => Err(ConfigError::HostExists {
                nqn: nqn.into(),
                host: "*".into(),
            }),
            (false, false) => Err(ConfigError::NoHost {
                nqn: nqn.into(),
                host: "*".into(),
            }),
            _ => {
                entry.allow_any_host = allow;
                Ok(())
            }
        }
    }

    /// The hosts allowed on `nqn`.
    pub fn hosts_of(&self, nqn: &str) -> Vec<String> {
        self.host_entries_of(nqn)
            .map(|(h, _)| h.to_string())
            .collect()
    }

    /// The hosts allowed on `nqn`, with their keys, in NQN order.
    pub fn host_entries_of<'a>(
        &'a self,
        nqn: &'a str,
    ) -> impl Iterator<Item = (&'a str, &'a HostAuth)> + 'a {
        self.hosts
            .range((nqn.to_string(), String::new())..)
            .take_while(move |((n, _), _)| n == nqn)
            .map(|((_, h), auth)| (h.as_str(), auth))
    }
}

pub fn image_spec(ns: &NamespaceEntry) -> String {
    if ns.rados_namespace.is_empty() {
        format!("{}/{}", ns.pool, ns.image)
    } else {
        format!("{}/{}/{}", ns.pool, ns.rados_namespace, ns.image)
    }
}

/// A numeric IP address in canonical text (IPv6 compressed, no brackets: "[0:0::1]" ->
/// "::1"); `None` when `text` is not one.
fn canonical_address(text: &str) -> Option<String> {
    let bare = text
        .strip_prefix('[')
        .and_then(|t| t.strip_suffix(']'))
        .unwrap_or(text);
    bare.parse::<std::net::IpAddr>()
        .ok()
        .map(|ip| ip.to_string())
}

/// Whether two listeners have the same omap key (everything but `secure`).
fn same_listener(a: &ListenerEntry, b: &ListenerEntry) -> bool {
    a.subsystem_nqn == b.subsystem_nqn
        && a.gateway == b.gateway
        && a.transport == b.transport
        && a.address == b.address
        && a.port == b.port
}

fn listener_key(l: &ListenerEntry) -> String {
    format!(
        "listener/{}/{}/{}/{}/{}",
        key_part(&l.subsystem_nqn),
        key_part(&l.gateway),
        key_part(&l.transport),
        key_part(&l.address),
        l.port
    )
}

/// One component of an omap key: `%` and `/` escaped, so components never run together.
fn key_part(s: &str) -> String {
    s.replace('%', "%25").replace('/', "%2F")
}

/// The inverse of [`key_part`]. `%2F` is undone first: in an escaped string every `%` starts
/// `%25` or `%2F`, so a `%2F` there is always an escaped `/`.
fn unescape_key_part(s: &str) -> String {
    s.replace("%2F", "/").replace("%25", "%")
}

fn subsystem_key(nqn: &str) -> String {
    format!("subsystem/{}", key_part(nqn))
}

fn namespace_key(n: &NamespaceEntry) -> String {
    format!("namespace/{}/{:010}", key_part(&n.subsystem_nqn), n.nsid)
}

fn host_key(nqn: &str, host: &str) -> String {
    format!("host/{}/{}", key_part(nqn), key_part(host))
}

/// Adds to `set`/`remove` the keys of `new`'s entries that differ from `old`'s (`key` names
/// an entry's omap key, `value` encodes it): one walk of both (sorted) maps side by side, no
/// lookups.
fn diff_section<K: Ord, V: PartialEq>(
    old: &BTreeMap<K, V>,
    new: &BTreeMap<K, V>,
    key: impl Fn(&K, &V) -> String,
    value: impl Fn(&K, &V) -> Vec<u8>,
    set: &mut Vec<(String, Vec<u8>)>,
    remove: &mut Vec<String>,
) {
    let (mut o, mut n) = (old.iter().peekable(), new.iter().peekable());
    loop {
        match (o.peek(), n.peek()) {
            (None, None) => return,
            (Some((ok, ov)), None) => {
                remove.push(key(ok, ov));
                o.next();
            }
            (None, Some((nk, nv))) => {
                set.push((key(nk, nv), value(nk, nv)));
                n.next();
            }
            (Some((ok, ov)), Some((nk, nv))) => match ok.cmp(nk) {
                std::cmp::Ordering::Less => {
                    remove.push(key(ok, ov));
                    o.next();
                }
                std::cmp::Ordering::Greater => {
                    set.push((key(nk, nv), value(nk, nv)));
                    n.next();
                }
                std::cmp::Ordering::Equal => {
                    if ov != nv {
                        set.push((key(nk, nv), value(nk, nv)));
                    }
                    o.next();
                    n.next();
                }
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ana::{Event, Timing};

    const NQN: &str = "nqn.2016-06.io.test:disks";

    fn with_groups(n: u32) -> GroupState {
        let mut map = GroupMap::new(Timing::default());
        for g in 1..=n {
            map.handle(Event::Beacon {
                gateway: format!("gw{g}"),
                ana_group: g,
                incarnation: 1,
                addrs: vec![],
                group_addrs: None,
                applied_epoch: 0,
                cluster: crate::ana::ClusterReach::Unknown,
                now_ms: 0,
            })
            .expect("beacon");
        }
        GroupState {
            map: Some(map),
            ..GroupState::default()
        }
    }

    fn ns(image: &str) -> NamespaceEntry {
        NamespaceEntry {
            subsystem_nqn: NQN.into(),
            nsid: 0,
            pool: "rbd".into(),
            rados_namespace: String::new(),
            image: image.into(),
            block_size: 0,
            ana_group: 0,
            moving_from: 0,
            no_auto_visible: false,
            hosts: BTreeSet::new(),
            qos: Default::default(),
            nguid: String::new(),
            uuid: String::new(),
            trash_image: false,
            frozen_size: None,
        }
    }

    #[test]
    fn a_move_remembers_the_group_it_leaves_until_it_is_finished() {
        let mut st = with_groups(3);
        st.add_subsystem(NQN, "", true, 0).expect("subsystem");
        let mut n = ns("img");
        n.nsid = 1;
        n.ana_group = 1;
        n.block_size = 512;
        st.add_namespace(n).expect("namespace");
        let key = (NQN.to_string(), 1);
        st.move_namespace(NQN, 1, 2).expect("move");
        assert_eq!(st.namespaces[&key].ana_group, 2);
        assert_eq!(st.namespaces[&key].moving_from, 1);
        // Moved on before the first move finished: it still leaves group 1.
        st.move_namespace(NQN, 1, 3).expect("move again");
        assert_eq!(st.namespaces[&key].moving_from, 1);
        // Back to where it was: nothing to drain.
        st.move_namespace(NQN, 1, 1).expect("move back");
        assert_eq!(st.namespaces[&key].moving_from, 0);
        st.move_namespace(NQN, 1, 2).expect("move");
        st.finish_move(NQN, 1).expect("finish");
        assert_eq!(st.namespaces[&key].moving_from, 0);
        assert_eq!(st.namespaces[&key].ana_group, 2);
        // A late end of an earlier move (from group 1) leaves a newer one (from 2) alone.
        st.move_namespace(NQN, 1, 3).expect("move");
        st.finish_move_from(NQN, 1, 1).expect("stale end");
        assert_eq!(st.namespaces[&key].moving_from, 2);
        st.finish_move_from(NQN, 1, 2).expect("end");
        assert_eq!(st.namespaces[&key].moving_from, 0);
        assert_eq!(st.namespaces[&key].ana_group, 3);
    }

    /// Subsystem and host NQNs as Linux nvmet takes them: `testnqn` in, a name too long,
    /// with a space or a control character out, each error naming the field.
    #[test]
    fn nqns_are_checked_as_linux_nvmet_takes_them() {
        let mut st = GroupState::default();
        st.add_subsystem("testnqn", "", false, 0)
            .expect("a name outside the NVMe formats is taken");
        st.add_host("testnqn", "testhost")
            .expect("so is such a host NQN");
        let too_long = "n".repeat(NQN_MAX_LEN + 1);
        for bad in [too_long.as_str(), "test nqn", "test\u{7}nqn", ""] {
            let e = st.clone().add_subsystem(bad, "", false, 0).expect_err(bad);
            assert!(e.to_string().starts_with("invalid subsystem NQN"), "{e}");
            let e = st.clone().add_host("testnqn", bad).expect_err(bad);
            assert!(e.to_string().starts_with("invalid host NQN"), "{e}");
        }
        let longest = "n".repeat(NQN_MAX_LEN);
        st.add_subsystem(&longest, "", false, 0)
            .expect("223 bytes are enough");
    }

    #[test]
    fn namespaces_get_free_nsids_and_spread_over_groups() {
        let mut st = with_groups(3);
        st.add_subsystem(NQN, "", false, 0).expect("subsystem");
        let placed: Vec<(u32, u32)> = (0..6)
            .map(|i| {
                let n = st.add_namespace(ns(&format!("img{i}"))).expect("ns");
                (n.nsid, n.ana_group)
            })
            .collect();
        assert_eq!(placed, vec![(1, 1), (2, 2), (3, 3), (4, 1), (5, 2), (6, 3)]);
        st.del_namespace(NQN, 2).expect("del");
        let n = st.add_namespace(ns("img9")).expect("ns");
        assert_eq!((n.nsid, n.ana_group), (2, 2));
        st.move_namespace(NQN, 2, 3).expect("move");
        assert_eq!(st.namespaces[&(NQN.to_string(), 2)].ana_group, 3);
    }

    #[test]
    fn bad_requests_are_refused_and_change_nothing() {
        let mut st = with_groups(2);
        st.add_subsystem(NQN, "", false, 0).expect("subsystem");
        let mut a = ns("a");
        a.nsid = 5;
        st.add_namespace(a.clone()).expect("ns");
        let before = st.clone();
        let cases: Vec<(ConfigError, Result<(), ConfigError>)> = vec![
            (
                ConfigError::SubsystemExists(NQN.into()),
                st.clone().add_subsystem(NQN, "", false, 0),
            ),
            (
                ConfigError::NamespaceExists {
                    nqn: NQN.into(),
                    nsid: 5,
                },
                st.clone()
                    .add_namespace(NamespaceEntry {
                        image: "b".into(),
                        ..a.clone()
                    })
                    .map(|_| ()),
            ),
            (
                ConfigError::ImageInUse("rbd/a".into(), NQN.into(), 5),
                st.clone().add_namespace(ns("a")).map(|_| ()),
            ),
            (
                ConfigError::NoSubsystem("nqn.2016-06.io.test:other".into()),
                st.clone()
                    .add_namespace(NamespaceEntry {
                        subsystem_nqn: "nqn.2016-06.io.test:other".into(),
                        ..ns("c")
                    })
                    .map(|_| ()),
            ),
            (
                ConfigError::NoAnaGroup(7),
                st.clone()
                    .add_namespace(NamespaceEntry {
                        ana_group: 7,
                        ..ns("c")
                    })
                    .map(|_| ()),
            ),
            (
                ConfigError::NsidRange {
                    nsid: 2000,
                    max: 1024,
                },
                st.clone()
                    .add_namespace(NamespaceEntry {
                        nsid: 2000,
                        ..ns("c")
                    })
                    .map(|_| ()),
            ),
            (ConfigError::BlockSize(1000), {
                st.clone()
                    .add_namespace(NamespaceEntry {
                        block_size: 1000,
                        ..ns("c")
                    })
                    .map(|_| ())
            }),
            (
                ConfigError::SubsystemNotEmpty {
                    nqn: NQN.into(),
                    count: 1,
                },
                st.clone().del_subsystem(NQN, false),
            ),
            (
                ConfigError::NoNamespace {
                    nqn: NQN.into(),
                    nsid: 9,
                },
                st.clone().del_namespace(NQN, 9),
            ),
        ];
        for (want, got) in cases {
            assert_eq!(got, Err(want));
        }
        assert!(matches!(
            st.clone().add_subsystem("bo gus", "", false, 0),
            Err(ConfigError::InvalidNqn { .. })
        ));
        assert!(matches!(
            st.clone().add_host(NQN, "nqn.bad host"),
            Err(ConfigError::InvalidNqn { .. })
        ));
        assert_eq!(st, before);
        st.del_subsystem(NQN, true).expect("force");
        assert!(st.namespaces.is_empty());
    }

    #[test]
    fn listener_addresses_are_stored_canonical() {
        let mut st = with_groups(2);
        st.add_subsystem(NQN, "SN1", true, 0).expect("subsystem");
        let listener = |address: &str| ListenerEntry {
            subsystem_nqn: NQN.into(),
            gateway: "gw1".into(),
            transport: "tcp".into(),
            address: address.into(),
            port: 4420,
            secure: false,
        };
        st.add_listener(listener("[0:0::1]"))
            .expect("bracketed IPv6");
        assert_eq!(
            st.listeners
                .iter()
                .map(|l| l.address.as_str())
                .collect::<Vec<_>>(),
            ["::1"]
        );
        assert!(matches!(
            st.add_listener(listener("::1")),
            Err(ConfigError::ListenerExists(_))
        ));
        for bad in ["[127.0.0.1", "host.example", "fe80::1%2", ""] {
            assert!(
                matches!(
                    st.add_listener(listener(bad)),
                    Err(ConfigError::Invalid { .. })
                ),
                "{bad:?} refused"
            );
        }
        st.del_listener(&listener("[::1]"))
            .expect("deleted by another spelling");
        assert!(st.listeners.is_empty());
        // A listener stored as typed (before canonical addresses) is still deleted.
        st.listeners.insert(listener("0:0::1"));
        st.del_listener(&listener("0:0::1")).expect("legacy entry");
        assert!(st.listeners.is_empty());
    }

    #[test]
    fn omap_round_trip_and_diff() {
        let mut st = with_groups(2);
        st.version = 7;
        st.add_subsystem(NQN, "SN1", true, 0).expect("subsystem");
        st.add_namespace(ns("a")).expect("ns");
        st.add_listener(ListenerEntry {
            subsystem_nqn: NQN.into(),
            gateway: "gw1".into(),
            transport: "tcp".into(),
            address: "127.0.0.1".into(),
            port: 4420,
            secure: false,
        })
        .expect("listener");
        st.add_host(
            NQN,
            "nqn.2014-08.org.nvmexpress:uuid:0f0f0f0f-0000-0000-0000-0000000000e4",
        )
        .expect("host");
        let mut omap = st.to_omap();
        omap.insert("version".into(), b"7".to_vec());
        let back = GroupState::from_omap(&omap).expect("decode");
        // (Beacon times are not stored.)
        assert_eq!(back.to_omap(), st.to_omap());
        assert_eq!(back.version, 7);
        let mut next = st.clone();
        next.add_namespace(ns("b")).expect("ns");
        next.del_host(
            NQN,
            "nqn.2014-08.org.nvmexpress:uuid:0f0f0f0f-0000-0000-0000-0000000000e4",
        )
        .expect("host");
        let (set, remove) = next.diff(&st);
        assert_eq!(set.len(), 1);
        assert!(set[0].0.starts_with("namespace/"));
        assert_eq!(remove.len(), 1);
        assert!(remove[0].starts_with("host/"));
        // NQNs with '/' (allowed by the spec) neither break decoding nor collide.
        let mut slashes = GroupState::default();
        let (a, b) = ("nqn.2016-06.io.test:x/y", "nqn.2016-06.io.test:x");
        slashes.add_subsystem(a, "", false, 0).expect("a");
        slashes.add_subsystem(b, "", false, 0).expect("b");
        slashes
            .add_host(a, "nqn.2016-06.io.test:h")
            .expect("host a");
        slashes
            .add_host(b, "nqn.2016-06.io.test:y/nqn.2016-06.io.test:h")
            .expect("host b");
        let back = GroupState::from_omap(&slashes.to_omap()).expect("decode");
        assert_eq!(back.hosts, slashes.hosts);
        assert_eq!(back.hosts.len(), 2);
        let mut bad = Omap::new();
        bad.insert("subsystem/x".into(), b"{".to_vec());
        assert!(matches!(
            GroupState::from_omap(&bad),
            Err(ConfigError::Corrupt { .. })
        ));
    }

    /// The diff, written over the old encoding, gives the new encoding (changed, added and
    /// removed entries at the start, middle and end of each section), and `apply` rebuilds the
    /// new state from the old one.
    #[test]
    fn a_diff_written_over_the_old_state_gives_the_new() {
        let mut old = with_groups(2);
        old.add_subsystem(NQN, "", true, 0).expect("subsystem");
        old.add_subsystem("nqn.2016-06.io.test:b", "", true, 0)
            .expect("subsystem");
        for i in 1..=9 {
            let mut n = ns(&format!("img{i}"));
            n.nsid = i * 2;
            old.add_namespace(n).expect("ns");
        }
        old.add_host(NQN, "nqn.2016-06.io.test:h1").expect("host");
        let mut new = old.clone();
        new.del_namespace(NQN, 2).expect("first");
        new.del_namespace(NQN, 10).expect("middle");
        new.del_namespace(NQN, 18).expect("last");
        new.move_namespace(NQN, 4, 2).expect("changed");
        for nsid in [1, 11, 30] {
            let mut n = ns(&format!("new{nsid}"));
            n.nsid = nsid;
            new.add_namespace(n).expect("added");
        }
        new.del_subsystem("nqn.2016-06.io.test:b", true)
            .expect("subsystem");
        new.del_host(NQN, "nqn.2016-06.io.test:h1").expect("host");
        new.add_host(NQN, "nqn.2016-06.io.test:h2").expect("host");
        let (set, remove) = new.diff(&old);
        let mut omap = old.to_omap();
        for k in &remove {
            assert!(omap.remove(k).is_some(), "removes a missing key {k}");
        }
        for (k, v) in set {
            omap.insert(k, v);
        }
        assert_eq!(omap, new.to_omap());
        let (set, remove) = new.diff(&old);
        let mut rebuilt = old.clone();
        rebuilt.apply(&set, &remove).expect("apply");
        assert_eq!(rebuilt.to_omap(), new.to_omap());
        assert_eq!(new.diff(&new), (vec![], vec![]));
    }

    /// A valid key (`DHHC-1:XX:<base64>:`), different for each `byte`.
    fn key(byte: u8, transform: Option<nvme_auth::HashFunction>) -> String {
        nvme_auth::DhchapSecret::from_bytes(&[byte; 32], transform)
            .expect("32 bytes")
            .to_representation()
            .to_string()
    }

    /// `key` with one base64 character changed: well formed, but its CRC does not match.
    fn mistyped(key: &str) -> String {
        let mut b = key.as_bytes().to_vec();
        b[14] = if b[14] == b'A' { b'B' } else { b'A' };
        String::from_utf8(b).expect("ASCII")
    }

    const H1: &str = "nqn.2014-08.org.nvmexpress:uuid:0f0f0f0f-0000-0000-0000-0000000000e1";

    #[test]
    fn host_keys_are_checked_stored_changed_and_cleared() {
        let mut st = with_groups(1);
        st.add_subsystem(NQN, "", false, 0).expect("subsystem");
        let (k1, k2, c1) = (
            key(0x11, Some(nvme_auth::HashFunction::Sha256)),
            key(0x22, None),
            key(0x33, None),
        );
        let hk = (NQN.to_string(), H1.to_string());
        // Given with spaces around it (a file's newline): stored canonical.
        let auth = st
            .add_host_with_keys(NQN, H1, &format!(" {k1}\n"), "")
            .expect("host with a key");
        assert_eq!(auth.mode(), "host");
        assert_eq!(st.hosts[&hk].dhchap_key.as_deref(), Some(k1.as_str()));
        assert_eq!(st.hosts[&hk].dhchap_ctrl_key, None);
        assert!(matches!(
            st.add_host_with_keys(NQN, H1, &k2, ""),
            Err(ConfigError::HostExists { .. })
        ));

        // Replaced, with a controller key: bidirectional.
        let (auth, changed) = st.change_host_keys(NQN, H1, &k2, &c1).expect("change");
        assert!(changed);
        assert_eq!(auth.mode(), "bidirectional");
        assert_eq!(st.hosts[&hk].dhchap_key.as_deref(), Some(k2.as_str()));
        assert_eq!(st.hosts[&hk].dhchap_ctrl_key.as_deref(), Some(c1.as_str()));
        let (_, changed) = st.change_host_keys(NQN, H1, &k2, &c1).expect("again");
        assert!(!changed, "the same keys again change nothing");

        // Refusals: the field and why, never the key; the state stays as it was.
        let before = st.clone();
        let bad = mistyped(&k1);
        let cases = [
            (
                bad.as_str(),
                "",
                "invalid dhchap_key: the key's CRC-32 does not match",
            ),
            (
                k1.as_str(),
                bad.as_str(),
                "invalid dhchap_ctrl_key: the key's CRC-32",
            ),
            (
                "",
                c1.as_str(),
                "invalid dhchap_ctrl_key: needs a dhchap_key",
            ),
            (
                "DHHC-1:00:AAAA:",
                "",
                "invalid dhchap_key: the key decodes to 3 bytes",
            ),
            (
                "DHHC-1:07:AAAA:",
                "",
                "invalid dhchap_key: hash indicator \"07\"",
            ),
            (
                "secret",
                "",
                "invalid dhchap_key: does not start with DHHC-1:",
            ),
        ];
        for (host_key, ctrl_key, want) in cases {
            for result in [
                st.clone()
                    .change_host_keys(NQN, H1, host_key, ctrl_key)
                    .map(|_| ()),
                st.clone()
                    .add_host_with_keys(NQN, "nqn.2016-06.io.test:new", host_key, ctrl_key)
                    .map(|_| ()),
            ] {
                let e = result.expect_err(want).to_string();
                assert!(e.starts_with(want), "{e:?} does not start with {want:?}");
                for k in [&k1, &k2, &c1, &bad] {
                    assert!(!e.contains(&k[10..50]), "the message {e:?} shows a key");
                }
            }
        }
        assert!(matches!(
            st.clone()
                .change_host_keys(NQN, "nqn.2016-06.io.test:nobody", &k1, ""),
            Err(ConfigError::NoHost { .. })
        ));
        assert_eq!(st, before);

        // Cleared: the host stays, without keys.
        let (auth, changed) = st.change_host_keys(NQN, H1, "", "").expect("clear");
        assert!(changed);
        assert_eq!(auth, HostAuth::default());
        assert_eq!(st.hosts_of(NQN), vec![H1.to_string()]);

        // Debug (what a log line would print) never shows a key.
        st.change_host_keys(NQN, H1, &k1, &c1).expect("set");
        let debug = format!("{st:?}");
        assert!(debug.contains("HostAuth(bidirectional)"), "{debug}");
        assert!(!debug.contains(&k1[10..50]) && !debug.contains(&c1[10..50]));
    }

    /// A state written before host keys existed (`[nqn, host]` values) loads as hosts
    /// without keys and encodes to the same bytes; a host with keys round-trips.
    /// A PSK is stored canonical, survives the omap, stays through a DH-HMAC-CHAP-only key
    /// change (the ceph-nvmeof API's) and goes with a change of all keys (`HostChangeKey`).
    #[test]
    fn host_psks_are_stored_kept_and_replaced() {
        let mut st = with_groups(1);
        st.add_subsystem(NQN, "", false, 0).expect("subsystem");
        let psk = nvme_auth::tls_psk::ConfiguredPsk::from_bytes(&[0x5a; 32], None)
            .expect("32 bytes")
            .to_interchange()
            .to_string();
        let auth = HostAuth::default()
            .with_psk(&format!(" {psk}\n"), "libnvme-compat")
            .expect("a PSK");
        st.add_host_with_auth(NQN, H1, auth).expect("host");
        let hk = (NQN.to_string(), H1.to_string());
        assert_eq!(st.hosts[&hk].psk.as_deref(), Some(psk.as_str()));
        assert_eq!(
            st.hosts[&hk].psk_derivation.as_deref(),
            Some("libnvme-compat")
        );
        assert!(!format!("{:?}", st.hosts[&hk]).contains(&psk[16..40]));
        let back = GroupState::from_omap(&st.to_omap()).expect("decodes");
        assert_eq!(back.hosts[&hk], st.hosts[&hk]);

        let k = key(0x44, None);
        let (auth, changed) = st.change_host_keys(NQN, H1, &k, "").expect("keys");
        assert!(changed);
        assert_eq!(
            (auth.mode(), auth.psk.as_deref()),
            ("host", Some(psk.as_str()))
        );
        let (auth, changed) = st
            .change_host_auth(NQN, H1, HostAuth::parse(&k, "").expect("key"))
            .expect("all keys");
        assert!(changed);
        assert_eq!((auth.psk, auth.psk_derivation), (None, None));
    }

    #[test]
    fn old_host_entries_load_unchanged() {
        let mut st = with_groups(1);
        st.add_subsystem(NQN, "", false, 0).expect("subsystem");
        let mut omap = st.to_omap();
        let old_key = format!("host/{}/{}", key_part(NQN), key_part(H1));
        let old_value = format!("[\"{NQN}\",\"{H1}\"]").into_bytes();
        omap.insert(old_key.clone(), old_value.clone());
        omap.insert("version".into(), b"3".to_vec());
        let mut back = GroupState::from_omap(&omap).expect("old state");
        assert_eq!(back.hosts_of(NQN), vec![H1.to_string()]);
        assert_eq!(
            back.hosts[&(NQN.to_string(), H1.to_string())],
            HostAuth::default()
        );
        assert_eq!(back.to_omap()[&old_key], old_value, "re-encoded as before");

        let k = key(0x44, Some(nvme_auth::HashFunction::Sha512));
        back.change_host_keys(NQN, H1, &k, "").expect("keys");
        let encoded = back.to_omap();
        let value: serde_json::Value = serde_json::from_slice(&encoded[&old_key]).expect("JSON");
        assert_eq!(value, serde_json::json!([NQN, H1, { "dhchap_key": k }]));
        let again = GroupState::from_omap(&encoded).expect("decode");
        assert_eq!(again.hosts, back.hosts);

        // A host value that is neither form is refused without quoting it.
        let mut bad = Omap::new();
        bad.insert(
            old_key,
            format!("[\"{NQN}\",\"{H1}\",\"{k}\"]").into_bytes(),
        );
        let e = GroupState::from_omap(&bad)
            .expect_err("corrupt")
            .to_string();
        assert!(e.contains("not [nqn, host]"), "{e}");
        assert!(!e.contains(&k[10..50]), "{e}");
    }

    /// Changing or clearing a host's keys writes that host's entry alone; `apply` of the
    /// delta (another replica) gives the same keys.
    #[test]
    fn a_key_change_writes_only_that_host() {
        let mut old = with_groups(1);
        old.add_subsystem(NQN, "", false, 0).expect("subsystem");
        for i in 0..5 {
            old.add_host(NQN, &format!("nqn.2016-06.io.test:h{i}"))
                .expect("host");
        }
        let h2 = "nqn.2016-06.io.test:h2";
        let k = key(0x55, None);
        let c = key(0x66, None);
        let mut steps = vec![];
        let mut cur = old.clone();
        for (host_key, ctrl_key) in [(k.as_str(), ""), (k.as_str(), c.as_str()), ("", "")] {
            let mut next = cur.clone();
            next.change_host_keys(NQN, h2, host_key, ctrl_key)
                .expect("change");
            steps.push((cur.clone(), next.clone()));
            cur = next;
        }
        for (before, after) in steps {
            let (set, remove) = after.diff(&before);
            assert_eq!(remove, Vec::<String>::new());
            assert_eq!(set.len(), 1, "one entry written");
            assert_eq!(set[0].0, host_key(NQN, h2));
            let mut omap = before.to_omap();
            omap.extend(set.iter().cloned());
            assert_eq!(omap, after.to_omap());
            let mut rebuilt = before.clone();
            rebuilt.apply(&set, &remove).expect("apply");
            assert_eq!(rebuilt.hosts, after.hosts);
        }
        // Cleared: written as a host that never had keys.
        assert_eq!(cur.to_omap(), old.to_omap());
    }

    fn identity(st: &GroupState, nqn: &str, nsid: u32) -> (String, String) {
        let n = &st.namespaces[&(nqn.to_string(), nsid)];
        (n.nguid.clone(), n.uuid.clone())
    }

    #[test]
    fn an_image_added_under_a_freed_nsid_gets_another_identity() {
        let mut st = with_groups(1);
        st.add_subsystem(NQN, "", false, 0).expect("subsystem");
        let mut a = ns("a");
        a.nsid = 1;
        st.add_namespace(a.clone()).expect("a");
        let first = identity(&st, NQN, 1);
        assert_eq!(
            first.0,
            first.1.replace('-', ""),
            "the NGUID is the UUID's bytes"
        );
        st.del_namespace(NQN, 1).expect("del");
        let mut b = ns("b");
        b.nsid = 1;
        st.add_namespace(b).expect("b");
        let second = identity(&st, NQN, 1);
        assert_ne!(second.0, first.0, "NGUID reused for another image");
        assert_ne!(second.1, first.1, "UUID reused for another image");
        // Even the same image again is a new namespace: hosts must not take it for the
        // one they had.
        st.del_namespace(NQN, 1).expect("del");
        st.add_namespace(a).expect("a again");
        let third = identity(&st, NQN, 1);
        assert!(third != first && third != second);
    }

    #[test]
    fn identities_are_kept_through_encoding_and_deltas() {
        let mut st = with_groups(1);
        st.add_subsystem(NQN, "", false, 0).expect("subsystem");
        for image in ["a", "b", "c"] {
            st.add_namespace(ns(image)).expect("ns");
        }
        let decoded = GroupState::from_omap(&st.to_omap()).expect("decode");
        assert_eq!(decoded.namespaces, st.namespaces);
        let before = st.clone();
        st.set_qos(
            NQN,
            2,
            &crate::proto::QosLimits {
                rw_ios_per_second: Some(1000),
                ..Default::default()
            },
        )
        .expect("qos");
        let (set, remove) = st.diff(&before);
        let mut replica = before.clone();
        replica.apply(&set, &remove).expect("apply");
        assert_eq!(replica.namespaces, st.namespaces);
        assert_eq!(identity(&replica, NQN, 2), identity(&before, NQN, 2));
    }

    /// A `namespace/...` value as the code before stored identities wrote it.
    fn entry_without_identity(nsid: u32, image: &str) -> Vec<u8> {
        format!(
            r#"{{"subsystem_nqn":"{NQN}","nsid":{nsid},"pool":"rbd","rados_namespace":"","image":"{image}","block_size":512,"ana_group":1,"moving_from":0}}"#
        )
        .into_bytes()
    }

    #[test]
    fn namespaces_stored_before_identities_keep_the_one_their_hosts_see() {
        let mut omap = with_groups(1).to_omap();
        omap.insert(
            subsystem_key(NQN),
            format!(r#"{{"nqn":"{NQN}","serial":"","allow_any_host":true,"max_namespaces":1024}}"#)
                .into_bytes(),
        );
        omap.insert(
            format!("namespace/{}/{:010}", key_part(NQN), 3),
            entry_without_identity(3, "old"),
        );
        let mut st = GroupState::from_omap(&omap).expect("decode");
        // What gateways before this change derived for NSID 3 of NQN (gateway/src/config/
        // build.rs then: UUIDv5 of "nguid:<nqn>/<nsid>" and of "<nqn>/<nsid>" in the
        // product's namespace); the same values from Python's uuid.uuid5.
        let legacy = (
            "f9ab23d8f6775c289a2d37790308ea38".to_string(),
            "befda5ed-1ec7-5c54-ba45-8cfd6ae812bf".to_string(),
        );
        assert_eq!(legacy_ids(NQN, 3), legacy, "the old derivation changed");
        assert_eq!(identity(&st, NQN, 3), legacy);
        // Written back (a change to the entry), it keeps that identity, now stored.
        let again = GroupState::from_omap(&st.to_omap()).expect("decode");
        assert_eq!(identity(&again, NQN, 3), legacy);
        // Deleted, the NSID freed and another image added: a new identity.
        st.del_namespace(NQN, 3).expect("del");
        let mut new = ns("new");
        new.nsid = 3;
        st.add_namespace(new).expect("new");
        assert_ne!(identity(&st, NQN, 3).0, legacy.0);
        assert_ne!(identity(&st, NQN, 3).1, legacy.1);
    }

    #[test]
    fn a_named_uuid_is_kept_and_refused_when_another_namespace_has_it() {
        let mut st = with_groups(1);
        st.add_subsystem(NQN, "", false, 0).expect("subsystem");
        st.add_subsystem("nqn.2016-06.io.test:other", "", false, 0)
            .expect("subsystem");
        let mut a = ns("a");
        a.uuid = "3F2504E0-4F89-41D3-9A0C-0305E82C3301".into();
        let added = st.add_namespace(a).expect("a");
        assert_eq!(added.uuid, "3f2504e0-4f89-41d3-9a0c-0305e82c3301");
        assert_eq!(added.nguid, "3f2504e04f8941d39a0c0305e82c3301");
        let before = st.clone();
        let mut b = ns("b");
        b.subsystem_nqn = "nqn.2016-06.io.test:other".into();
        b.uuid = "3f2504e04f8941d39a0c0305e82c3301".into();
        assert_eq!(
            st.add_namespace(b.clone()),
            Err(ConfigError::IdentityInUse {
                uuid: "3f2504e0-4f89-41d3-9a0c-0305e82c3301".into(),
                nqn: NQN.into(),
                nsid: 1,
            })
        );
        for bad in [
            "00000000-0000-0000-0000-000000000000",
            "not-a-uuid",
            "3f2504e0",
        ] {
            b.uuid = bad.into();
            let e = st.add_namespace(b.clone()).expect_err(bad);
            assert!(
                matches!(
                    e,
                    ConfigError::Invalid {
                        what: "namespace UUID",
                        ..
                    }
                ),
                "{e}"
            );
        }
        assert_eq!(st, before, "a refused namespace changes nothing");
    }

    #[test]
    fn a_stored_identity_that_is_not_one_is_corrupt() {
        let mut st = with_groups(1);
        st.add_subsystem(NQN, "", false, 0).expect("subsystem");
        st.add_namespace(ns("a")).expect("a");
        let mut omap = st.to_omap();
        let key = format!("namespace/{}/{:010}", key_part(NQN), 1);
        let text = String::from_utf8(omap[&key].clone()).expect("utf8");
        let uuid = identity(&st, NQN, 1).1;
        omap.insert(key, text.replace(&uuid, &uuid.to_uppercase()).into_bytes());
        let e = GroupState::from_omap(&omap).expect_err("upper-case UUID");
        assert!(matches!(e, ConfigError::Corrupt { .. }), "{e}");
    }

    #[test]
    fn auto_resize_off_keeps_the_first_frozen_size_until_turned_on() {
        let mut st = with_groups(1);
        st.add_subsystem(NQN, "", false, 0).expect("subsystem");
        let n = st.add_namespace(ns("img")).expect("ns");
        assert_eq!(
            n.frozen_size, None,
            "a namespace follows its image by default"
        );
        assert!(st.set_auto_resize(NQN, n.nsid, Some(1 << 30)).expect("off"));
        assert_eq!(
            st.namespaces[&(NQN.to_string(), n.nsid)].frozen_size,
            Some(1 << 30)
        );
        // Off again with the image grown meanwhile: the size hosts see does not move.
        assert!(!st
            .set_auto_resize(NQN, n.nsid, Some(2 << 30))
            .expect("off again"));
        assert_eq!(
            st.namespaces[&(NQN.to_string(), n.nsid)].frozen_size,
            Some(1 << 30)
        );
        assert!(st.set_auto_resize(NQN, n.nsid, None).expect("on"));
        assert_eq!(st.namespaces[&(NQN.to_string(), n.nsid)].frozen_size, None);
        assert!(!st.set_auto_resize(NQN, n.nsid, None).expect("on again"));
        let e = st
            .set_auto_resize(NQN, n.nsid, Some(0))
            .expect_err("size 0");
        assert!(matches!(e, ConfigError::Invalid { .. }), "{e}");
        assert_eq!(st.namespaces[&(NQN.to_string(), n.nsid)].frozen_size, None);
    }

    #[test]
    fn auto_resize_of_an_unknown_namespace_is_refused_with_the_state_unchanged() {
        let mut st = with_groups(1);
        st.add_subsystem(NQN, "", false, 0).expect("subsystem");
        st.add_namespace(ns("img")).expect("ns");
        let before = st.clone();
        let e = st
            .set_auto_resize(NQN, 9, Some(1 << 20))
            .expect_err("no NSID 9");
        assert!(matches!(e, ConfigError::NoNamespace { nsid: 9, .. }), "{e}");
        let e = st
            .set_auto_resize("nqn.2016-06.io.spdk:none", 1, None)
            .expect_err("no subsystem");
        assert!(
            matches!(
                e,
                ConfigError::NoSubsystem(_) | ConfigError::NoNamespace { .. }
            ),
            "{e}"
        );
        let e = st.resize_frozen(NQN, 9, 1 << 20).expect_err("no NSID 9");
        assert!(matches!(e, ConfigError::NoNamespace { nsid: 9, .. }), "{e}");
        assert_eq!(st, before);
    }

    #[test]
    fn a_frozen_namespace_is_resized_only_up_and_only_while_frozen() {
        let mut st = with_groups(1);
        st.add_subsystem(NQN, "", false, 0).expect("subsystem");
        let n = st.add_namespace(ns("img")).expect("ns");
        let e = st
            .resize_frozen(NQN, n.nsid, 1 << 30)
            .expect_err("auto-resize on: nothing frozen");
        assert!(e.to_string().contains("auto-resize is on"), "{e}");
        st.set_auto_resize(NQN, n.nsid, Some(1 << 30)).expect("off");
        assert_eq!(
            st.resize_frozen(NQN, n.nsid, 3 << 30).expect("grow"),
            1 << 30
        );
        assert_eq!(
            st.namespaces[&(NQN.to_string(), n.nsid)].frozen_size,
            Some(3 << 30)
        );
        let e = st.resize_frozen(NQN, n.nsid, 2 << 30).expect_err("shrink");
        assert!(e.to_string().contains("never shrunk"), "{e}");
        assert_eq!(
            st.namespaces[&(NQN.to_string(), n.nsid)].frozen_size,
            Some(3 << 30)
        );
        assert_eq!(
            st.resize_frozen(NQN, n.nsid, 3 << 30).expect("same"),
            3 << 30
        );
    }

    #[test]
    fn a_frozen_size_is_stored_only_when_set_and_older_entries_load() {
        let mut entry = ns("img");
        entry.nsid = 1;
        let plain = serde_json::to_string(&entry).expect("encode");
        assert!(!plain.contains("frozen_size"), "{plain}");
        // An entry written before the field existed (none in it) follows its image.
        let old: NamespaceEntry = serde_json::from_str(&plain).expect("decode");
        assert_eq!(old.frozen_size, None);
        entry.frozen_size = Some(5 << 20);
        let frozen = serde_json::to_string(&entry).expect("encode");
        assert!(frozen.contains("\"frozen_size\":5242880"), "{frozen}");
        let back: NamespaceEntry = serde_json::from_str(&frozen).expect("decode");
        assert_eq!(back, entry);
    }
}
