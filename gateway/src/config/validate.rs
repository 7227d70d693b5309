//! [`Config::validate`]: everything that can be checked before anything starts.

use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::path::Path;

use super::address::{listeners_overlap, metrics_socket_addr};
use super::{
    invalid, parse_size, rbd_spec, CephSection, Config, ConfigError, MAX_TCP_BUSY_POLL_US,
};
use crate::spec::{cntlid, DISCOVERY_NQN};

/// An NQN as Linux nvmet takes it (the control plane's check, so a name `nvmeofctl` takes
/// is taken here too): at most 223 bytes, no whitespace or control characters. A name
/// outside the NVMe formats is warned about by [`Config::warnings`].
fn check_nqn(field: &str, nqn: &str) -> Result<(), ConfigError> {
    control_plane::nqn::check(nqn)
        .map(|_| ())
        .map_err(|e| invalid(field, format!("{nqn:?}: {e}")))
}

/// A namespace's `hosts`: only with `auto_visible = false`, each a valid NQN listed once,
/// at most [`super::MAX_HOSTS_PER_NAMESPACE`]. A host need not be allowed on the subsystem
/// (as with ceph-nvmeof's `namespace add_host`): the list only narrows who of the allowed
/// hosts sees the namespace.
fn check_namespace_hosts(nfield: &str, ns: &super::NamespaceConfig) -> Result<(), ConfigError> {
    if ns.auto_visible && !ns.hosts.is_empty() {
        return Err(invalid(
            format!("{nfield}.hosts"),
            "a host list needs auto_visible = false (with auto_visible every allowed host \
             sees the namespace)",
        ));
    }
    if ns.hosts.len() > super::MAX_HOSTS_PER_NAMESPACE {
        return Err(invalid(
            format!("{nfield}.hosts"),
            format!(
                "{} hosts; at most {} per namespace",
                ns.hosts.len(),
                super::MAX_HOSTS_PER_NAMESPACE
            ),
        ));
    }
    let mut seen = BTreeSet::new();
    for (h, host) in ns.hosts.iter().enumerate() {
        let hfield = format!("{nfield}.hosts[{h}]");
        check_nqn(&hfield, host)?;
        if !seen.insert(host) {
            return Err(invalid(hfield, format!("{host:?} is listed twice")));
        }
    }
    Ok(())
}

impl Config {
    /// What is valid but worth an admin's attention: subsystem and host NQNs outside the
    /// NVMe formats (each naming its field). [`Config::load`] logs them.
    pub fn warnings(&self) -> Vec<String> {
        let mut warnings = Vec::new();
        for (i, s) in self.subsystems.iter().enumerate() {
            let field = format!("subsystem[{i}].nqn");
            warnings.extend(control_plane::nqn::format_warning(&field, &s.nqn));
            for (h, host) in s.hosts.iter().enumerate() {
                let field = format!("subsystem[{i}].hosts[{h}]");
                warnings.extend(control_plane::nqn::format_warning(&field, host.nqn()));
            }
        }
        warnings
    }
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

impl Config {
    /// Checks everything that can be checked without opening devices or sockets.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.gateway.auth_policy()?;
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
            if let Some(ms) = g.stall_window_ms {
                let min = crate::stall::MIN_WINDOW.as_millis() as u64;
                if !(min..=super::MAX_STALL_WINDOW_MS).contains(&ms) {
                    return Err(invalid(
                        "group.stall_window_ms",
                        format!(
                            "{ms} is not {min}..={} (milliseconds commands may wait at the \
                             cluster, the monitors silent, before the gateway reports it cut)",
                            super::MAX_STALL_WINDOW_MS
                        ),
                    ));
                }
            }
            if let Some(ms) = g.leave_timeout_ms {
                if ms == 0 || ms > super::MAX_LEAVE_TIMEOUT_MS {
                    return Err(invalid(
                        "group.leave_timeout_ms",
                        format!(
                            "{ms} is not 1..={} (milliseconds a planned leave waits for the \
                             ANA groups to move to a peer)",
                            super::MAX_LEAVE_TIMEOUT_MS
                        ),
                    ));
                }
            }
        }
        // A gateway of a group may start with none: the control plane pushes its listeners
        // (`nvmeofctl listener add -g NAME`), and on Kubernetes the chart cannot know the
        // node's address when it renders the file.
        if self.listeners.is_empty() && self.group.is_none() {
            return Err(invalid(
                "listener",
                "at least one [[listener]] is required (a gateway in a [group] may have none)",
            ));
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
            if l.secure && l.transport != "tcp" {
                return Err(invalid(
                    format!("{field}.secure"),
                    "TLS secure channels are for NVMe/TCP listeners only",
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
        if let Some(text) = &self.gateway.tcp_data_budget {
            let field = "gateway.tcp_data_budget";
            let bytes = parse_size(text)
                .ok_or_else(|| invalid(field, format!("'{text}' is not a size like \"256MiB\"")))?;
            let mdts = crate::core::queue::MAX_DATA_LEN;
            if bytes < u64::from(mdts) || usize::try_from(bytes).is_err() {
                return Err(invalid(
                    field,
                    format!("{text} is less than one command's largest transfer (MDTS, {mdts} bytes) or too large"),
                ));
            }
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
        let mut seen_ids = HashMap::new();
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
            let mut seen_hosts = BTreeSet::new();
            for (h, host) in s.hosts.iter().enumerate() {
                let hfield = format!("{field}.hosts[{h}]");
                check_nqn(&hfield, host.nqn())?;
                if !seen_hosts.insert(host.nqn()) {
                    return Err(invalid(hfield, format!("{:?} is listed twice", host.nqn())));
                }
                host.keys()
                    .map_err(|(key, problem)| invalid(format!("{hfield}.{key}"), problem))?;
                host.tls_psk()
                    .map_err(|(key, problem)| invalid(format!("{hfield}.{key}"), problem))?;
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
                let limits = control_plane::qos::QosLimits {
                    rw_ios_per_second: ns.rw_ios_per_second,
                    rw_megabytes_per_second: ns.rw_megabytes_per_second,
                    r_megabytes_per_second: ns.r_megabytes_per_second,
                    w_megabytes_per_second: ns.w_megabytes_per_second,
                };
                if let Err(e) = limits.check() {
                    return Err(invalid(format!("{nfield}.{}", e.field), e.to_string()));
                }
                for (name, text) in [("uuid", &ns.uuid), ("nguid", &ns.nguid)] {
                    if let Some(t) = text {
                        if uuid::Uuid::try_parse(t).map(|u| u.is_nil()).unwrap_or(true) {
                            return Err(invalid(
                                format!("{nfield}.{name}"),
                                format!(
                                    "{t:?} is not a non-nil {} (e.g. {})",
                                    name.to_uppercase(),
                                    if name == "uuid" {
                                        "3f2504e0-4f89-41d3-9a0c-0305e82c3301"
                                    } else {
                                        "3f2504e04f8941d39a0c0305e82c3301"
                                    }
                                ),
                            ));
                        }
                    }
                }
                // Hosts tell namespaces apart by these: two with one identity would be
                // taken for one (multipath would join them).
                let (nguid, uuid) = super::build::namespace_identity(&s.nqn, ns);
                for (name, id) in [("uuid", uuid), ("nguid", nguid)] {
                    if let Some(other) = seen_ids.insert((name, id), nfield.clone()) {
                        return Err(invalid(
                            format!("{nfield}.{name}"),
                            format!("the same {} as {other}", name.to_uppercase()),
                        ));
                    }
                }
                check_namespace_hosts(&nfield, ns)?;
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
}
