//! ceph-nvmeof's management API (service `Gateway`, `proto/ceph_nvmeof_gateway.proto`) on
//! the control plane's port, so ceph-csi's NVMe-oF driver, ceph-nvmeof's CLI and the Ceph
//! dashboard drive the group unchanged.
//!
//! Every call maps onto this control plane's model through the same [`GroupState`] changes
//! the Admin service makes (its checks, its refusals); only the answer differs: an errno in
//! the reply's `status` and a text in `error_message`, as those clients expect, never a gRPC
//! error status. The mapping, and what is not supported with the errno a client then gets,
//! is in docs/ceph-nvmeof-api.md.
//!

use std::sync::Arc;

use tonic::{Request, Response, Status};

use crate::ceph_proto as pb;
use crate::server::ControlPlane;
use crate::state::{self, ConfigError, GroupState, ListenerEntry, NamespaceEntry};
use crate::store::{ImageError, StoreError};

/// The NVMe/TCP port a listener gets when the request names none (IANA's NVMe/TCP port, and
/// ceph-nvmeof's default).
const DEFAULT_TRSVCID: u32 = 4420;
const MIB: u64 = 1024 * 1024;

/// The service to add to the control plane's gRPC server.
pub fn service(cp: Arc<ControlPlane>) -> pb::gateway_server::GatewayServer<CephGatewayService> {
    pb::gateway_server::GatewayServer::new(CephGatewayService(cp))
}

/// `Gateway` on a replica.
pub struct CephGatewayService(pub Arc<ControlPlane>);

/// A refusal as the API answers it: an errno (Linux values) and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub errno: i32,
    pub message: String,
}

impl Refusal {
    fn new(errno: i32, message: impl Into<String>) -> Refusal {
        Refusal {
            errno,
            message: message.into(),
        }
    }

    /// A request option this gateway does not implement.
    fn unsupported(what: &str) -> Refusal {
        Refusal::new(
            libc::EOPNOTSUPP,
            format!("{what} is not supported by this gateway yet"),
        )
    }
}

/// The errno ceph-nvmeof's clients expect for each refusal of the model: ENOENT for a
/// missing subsystem, host or listener, ENODEV for a missing namespace (ceph-csi tells the
/// two apart on namespace_delete), EEXIST for anything already there.
impl From<ConfigError> for Refusal {
    fn from(e: ConfigError) -> Refusal {
        let errno = match &e {
            ConfigError::NoSubsystem(_)
            | ConfigError::NoHost { .. }
            | ConfigError::NoListener(_)
            | ConfigError::NoNamespaceHost { .. } => libc::ENOENT,
            ConfigError::NoNamespace { .. } | ConfigError::NoAnaGroup(_) => libc::ENODEV,
            ConfigError::SubsystemExists(_)
            | ConfigError::NamespaceExists { .. }
            | ConfigError::ListenerExists(_)
            | ConfigError::HostExists { .. }
            | ConfigError::NamespaceHostExists { .. }
            | ConfigError::ImageInUse(..)
            | ConfigError::IdentityInUse { .. } => libc::EEXIST,
            ConfigError::SubsystemNotEmpty { .. } | ConfigError::NamespaceHasHosts { .. } => {
                libc::EBUSY
            }
            ConfigError::NoFreeNsid { .. } | ConfigError::TooManyNamespaceHosts { .. } => {
                libc::ENOSPC
            }
            // ceph-nvmeof answers EINVAL for a host list on an auto-visible namespace.
            ConfigError::NamespaceAutoVisible { .. } => libc::EINVAL,
            ConfigError::NsidRange { .. } => libc::ERANGE,
            ConfigError::Corrupt { .. } => libc::EIO,
            ConfigError::InvalidNqn { .. }
            | ConfigError::BlockSize(_)
            | ConfigError::Empty { .. }
            | ConfigError::Invalid { .. }
            | ConfigError::BadKey { .. }
            | ConfigError::SecureMismatch { .. }
            | ConfigError::HostWithoutKey { .. }
            | ConfigError::Qos(_) => libc::EINVAL,
        };
        Refusal::new(errno, e.to_string())
    }
}

impl From<StoreError> for Refusal {
    fn from(e: StoreError) -> Refusal {
        match e {
            StoreError::Config(c) => c.into(),
            StoreError::Contended(_) => Refusal::new(libc::EAGAIN, e.to_string()),
            StoreError::Image(i) => {
                let errno = match &i {
                    ImageError::Exists(_) => libc::EEXIST,
                    ImageError::NotFound(_) | ImageError::NoPool(_) => libc::ENOENT,
                    ImageError::NoSpace(..) => libc::ENOSPC,
                    ImageError::Busy(_) => libc::EBUSY,
                    ImageError::Other(..) => libc::EIO,
                };
                Refusal::new(errno, i.to_string())
            }
            other => Refusal::new(libc::EIO, other.to_string()),
        }
    }
}

type Outcome<T> = Result<T, Refusal>;

fn req_status(outcome: Outcome<String>) -> pb::ReqStatus {
    match outcome {
        Ok(_) => pb::ReqStatus {
            status: 0,
            error_message: String::new(),
        },
        Err(r) => pb::ReqStatus {
            status: r.errno,
            error_message: r.message,
        },
    }
}

/// Logs the outcome of a change: done at info, refused at warn (with the errno).
fn logged<T>(call: &'static str, outcome: Outcome<T>) -> Outcome<T> {
    if let Err(r) = &outcome {
        tracing::warn!(call, errno = r.errno, "ceph-nvmeof API: {}", r.message);
    }
    outcome
}

/// A change's answer as the API sends it: its status, the refusal logged.
// The type tonic's generated trait methods return; the Err is never built here.
#[allow(clippy::result_large_err)]
fn status_reply(call: &'static str, outcome: Outcome<String>) -> Reply<pb::ReqStatus> {
    Ok(Response::new(req_status(logged(call, outcome))))
}

fn flag(o: Option<bool>) -> bool {
    o.unwrap_or(false)
}

fn subsystem_exists(st: &GroupState, nqn: &str) -> Outcome<()> {
    if st.subsystems.contains_key(nqn) {
        Ok(())
    } else {
        Err(ConfigError::NoSubsystem(nqn.to_string()).into())
    }
}

fn namespace_of(st: &GroupState, nqn: &str, nsid: u32) -> Outcome<NamespaceEntry> {
    subsystem_exists(st, nqn)?;
    st.namespaces
        .get(&(nqn.to_string(), nsid))
        .cloned()
        .ok_or_else(|| {
            ConfigError::NoNamespace {
                nqn: nqn.to_string(),
                nsid,
            }
            .into()
        })
}

// ------------------------------------------------------------------ QoS, visibility, images

/// `namespace_set_qos_limits` on an existing namespace: the Admin service's NamespaceSetQos
/// (an absent limit stays, 0 clears one; the MB/s fields are ceph-nvmeof's `mbytes`).
async fn set_qos_limits(cp: &Arc<ControlPlane>, r: &pb::NamespaceSetQosReq) -> Outcome<String> {
    let change = crate::proto::QosLimits {
        rw_ios_per_second: r.rw_ios_per_second,
        rw_megabytes_per_second: r.rw_mbytes_per_second,
        r_megabytes_per_second: r.r_mbytes_per_second,
        w_megabytes_per_second: r.w_mbytes_per_second,
    };
    let (nqn, nsid) = (r.subsystem_nqn.clone(), r.nsid);
    let (limits, _) = cp
        .try_update(move |st| st.set_qos(&nqn, nsid, &change))
        .await?;
    tracing::info!(nqn = %r.subsystem_nqn, nsid, qos = %limits, "namespace QoS limits set (ceph-nvmeof API)");
    Ok(format!(
        "namespace {nsid} of {}: QoS limits {limits}",
        r.subsystem_nqn
    ))
}

/// `namespace_add_host` on an existing namespace added with `no_auto_visible`.
async fn add_namespace_host(
    cp: &Arc<ControlPlane>,
    r: &pb::NamespaceAddHostReq,
) -> Outcome<String> {
    let (nqn, nsid, host) = (r.subsystem_nqn.clone(), r.nsid, r.host_nqn.clone());
    cp.try_update(move |st| st.add_namespace_host(&nqn, nsid, &host))
        .await?;
    tracing::info!(nqn = %r.subsystem_nqn, nsid, host = %r.host_nqn, "namespace made visible to a host (ceph-nvmeof API)");
    Ok(format!(
        "namespace {nsid} of {} visible to host {}",
        r.subsystem_nqn, r.host_nqn
    ))
}

/// `namespace_delete_host` on an existing namespace added with `no_auto_visible`.
async fn delete_namespace_host(
    cp: &Arc<ControlPlane>,
    r: &pb::NamespaceDeleteHostReq,
) -> Outcome<String> {
    let (nqn, nsid, host) = (r.subsystem_nqn.clone(), r.nsid, r.host_nqn.clone());
    cp.try_update(move |st| st.del_namespace_host(&nqn, nsid, &host))
        .await?;
    tracing::info!(nqn = %r.subsystem_nqn, nsid, host = %r.host_nqn, "namespace hidden from a host (ceph-nvmeof API)");
    Ok(format!(
        "namespace {nsid} of {} hidden from host {}",
        r.subsystem_nqn, r.host_nqn
    ))
}

/// `namespace_add` with `create_image`: creates the RBD image of `size` bytes (a non-zero
/// multiple of the block size) before the namespace is added.
async fn create_image(cp: &Arc<ControlPlane>, entry: &NamespaceEntry, size: u64) -> Outcome<()> {
    let block = u64::from(entry.block_size);
    if size == 0 || block == 0 || !size.is_multiple_of(block) {
        return Err(Refusal::new(
            libc::EINVAL,
            format!(
                "create_image needs a size that is a non-zero multiple of the block size \
                 {block} (got {size})"
            ),
        ));
    }
    let backend = cp.backend().clone();
    let e = entry.clone();
    tokio::task::spawn_blocking(move || {
        backend.create_image(&e.pool, &e.rados_namespace, &e.image, size)
    })
    .await
    .map_err(|e| Refusal::new(libc::EIO, format!("task failed: {e}")))??;
    tracing::info!(image = %state::image_spec(entry), size, "image created for a namespace (ceph-nvmeof API)");
    Ok(())
}

/// `namespace_add` with `no_auto_visible`: the namespace starts visible to no host.
fn no_auto_visible(entry: &mut NamespaceEntry) -> Outcome<()> {
    entry.no_auto_visible = true;
    Ok(())
}

// ------------------------------------------------------------------ subsystems

/// `create_subsystem`. Every subsystem here is served by every gateway of the group with ANA
/// (`enable_ha` is what it always is), and NQNs are never suffixed with a group name
/// (`no_group_append` is what it always is). A new subsystem admits no host until
/// `add_host`. `secure_listeners` is accepted and changes nothing, as in ceph-nvmeof without
/// a `network_mask`: there it makes the listeners that `network_mask` creates on each
/// gateway secure (ceph-nvmeof PR #1681), and `network_mask` is refused here; it does not
/// make the subsystem require TLS (ceph-nvmeof's API has no such setting; `nvmeofctl
/// subsystem add --require-tls` / `subsystem set` has).
async fn create_subsystem(cp: &Arc<ControlPlane>, r: pb::CreateSubsystemReq) -> Outcome<String> {
    if !r.network_mask.is_empty() {
        return Err(Refusal::unsupported(
            "network_mask (listeners on every gateway in a network; use create_listener)",
        ));
    }
    if flag(r.key_encrypted) {
        return Err(Refusal::unsupported("key_encrypted"));
    }
    let nqn = r.subsystem_nqn.clone();
    let max = r.max_namespaces.unwrap_or(0);
    match r.dhchap_key.filter(|k| !k.is_empty()) {
        None => {
            cp.add_subsystem(&r.subsystem_nqn, &r.serial_number, false, max, false)
                .await?;
        }
        // The subsystem and its key in one state change: a bad key creates nothing.
        Some(key) => {
            let serial = r.serial_number.clone();
            let n = nqn.clone();
            cp.try_update(move |st| {
                st.add_subsystem(&n, &serial, false, max)?;
                st.set_subsystem_key(&n, &key)
            })
            .await?;
        }
    }
    tracing::info!(nqn = %nqn, secure_listeners = flag(r.secure_listeners), "subsystem added (ceph-nvmeof API)");
    Ok(nqn)
}

async fn delete_subsystem(cp: &Arc<ControlPlane>, r: pb::DeleteSubsystemReq) -> Outcome<String> {
    let nqn = r.subsystem_nqn.clone();
    let force = flag(r.force);
    cp.try_update(move |st| st.del_subsystem(&r.subsystem_nqn, force))
        .await?;
    tracing::info!(nqn = %nqn, force, "subsystem deleted (ceph-nvmeof API)");
    Ok(nqn)
}

fn list_subsystems(cp: &Arc<ControlPlane>, r: &pb::ListSubsystemsReq) -> pb::SubsystemsInfoCli {
    let st = cp.snapshot();
    // The controller IDs the group hands out: every gateway's range.
    let ranges: Vec<(u32, u32)> = cp
        .gateway_infos()
        .iter()
        .map(|g| (g.cntlid_min, g.cntlid_max))
        .filter(|(lo, hi)| *lo > 0 && hi >= lo)
        .collect();
    let min_cntlid = ranges.iter().map(|r| r.0).min().unwrap_or(0);
    let max_cntlid = ranges.iter().map(|r| r.1).max().unwrap_or(0);
    let subsystems = st
        .subsystems
        .values()
        .filter(|s| {
            r.subsystem_nqn
                .as_deref()
                .is_none_or(|n| n.is_empty() || n == s.nqn)
        })
        .filter(|s| {
            r.serial_number
                .as_deref()
                .is_none_or(|n| n.is_empty() || n == s.serial)
        })
        .map(|s| pb::SubsystemCli {
            nqn: s.nqn.clone(),
            enable_ha: true,
            serial_number: s.serial.clone(),
            model_number: String::new(),
            min_cntlid,
            max_cntlid,
            namespace_count: st.namespaces.keys().filter(|(n, _)| *n == s.nqn).count() as u32,
            subtype: "NVMe".into(),
            max_namespaces: s.max_namespaces,
            has_dhchap_key: Some(s.dhchap_key.is_some()),
            allow_any_host: Some(s.allow_any_host),
            created_without_key: Some(true),
            network_mask: Vec::new(),
        })
        .collect();
    pb::SubsystemsInfoCli {
        status: 0,
        error_message: String::new(),
        subsystems,
    }
}

// ------------------------------------------------------------------ listeners

/// The listener a create/delete request names: TCP (the API has no transport), `host_name`
/// the gateway, the port 4420 when not given; the address must be of the family named.
/// `secure`: TLS (create_listener's `secure`; a delete finds the listener whatever its flag).
fn listener_entry(
    nqn: &str,
    host_name: &str,
    traddr: &str,
    adrfam: Option<i32>,
    trsvcid: Option<u32>,
    secure: bool,
) -> Outcome<ListenerEntry> {
    let family = match adrfam.map(pb::AddressFamily::try_from) {
        None => pb::AddressFamily::Ipv4,
        Some(Ok(f)) => f,
        Some(Err(_)) => return Err(Refusal::new(libc::EINVAL, "unknown address family")),
    };
    let bare = traddr
        .strip_prefix('[')
        .and_then(|t| t.strip_suffix(']'))
        .unwrap_or(traddr);
    match (family, bare.parse::<std::net::IpAddr>()) {
        (pb::AddressFamily::Ipv4, Ok(std::net::IpAddr::V6(_)))
        | (pb::AddressFamily::Ipv6, Ok(std::net::IpAddr::V4(_))) => {
            return Err(Refusal::new(
                libc::EINVAL,
                format!("address {traddr} is not of family {}", family.as_str_name()),
            ))
        }
        _ => {} // a bad address is refused by the state's check
    }
    let port = trsvcid.unwrap_or(DEFAULT_TRSVCID);
    let port = u16::try_from(port)
        .map_err(|_| Refusal::new(libc::EINVAL, format!("port {port} out of range")))?;
    Ok(ListenerEntry {
        subsystem_nqn: nqn.to_string(),
        gateway: host_name.to_string(),
        transport: "tcp".into(),
        address: traddr.to_string(),
        port,
        secure,
    })
}

/// `create_listener`: a listener belongs to the gateway named `host_name`. One that is not
/// (yet) in the group is stored all the same and served once it joins: answered EREMOTE,
/// as ceph-nvmeof answers a listener it keeps for another gateway. `secure`: hosts must
/// complete a TLS handshake with their PSK first (`nvmeofctl listener add --secure`).
async fn create_listener(cp: &Arc<ControlPlane>, r: pb::CreateListenerReq) -> Outcome<String> {
    let secure = flag(r.secure);
    let l = listener_entry(&r.nqn, &r.host_name, &r.traddr, r.adrfam, r.trsvcid, secure)?;
    let gateway = l.gateway.clone();
    let text = format!("{}:{} on {}", l.address, l.port, l.gateway);
    cp.add_listener(l).await?;
    tracing::info!(nqn = %r.nqn, listener = %text, secure, "listener added (ceph-nvmeof API)");
    let known = cp.gateway_infos().iter().any(|g| g.name == gateway);
    if !known {
        return Err(Refusal::new(
            libc::EREMOTE,
            format!(
                "listener {text} stored for gateway {gateway}, which is not in the group yet: \
                 it listens once that gateway joins"
            ),
        ));
    }
    Ok(text)
}

async fn delete_listener(cp: &Arc<ControlPlane>, r: pb::DeleteListenerReq) -> Outcome<String> {
    let l = listener_entry(&r.nqn, &r.host_name, &r.traddr, r.adrfam, r.trsvcid, false)?;
    let text = format!("{}:{} on {}", l.address, l.port, l.gateway);
    cp.try_update(move |st| st.del_listener(&l)).await?;
    tracing::info!(nqn = %r.nqn, listener = %text, "listener deleted (ceph-nvmeof API)");
    Ok(text)
}

fn list_listeners(cp: &Arc<ControlPlane>, r: &pb::ListListenersReq) -> Outcome<pb::ListenersInfo> {
    let st = cp.snapshot();
    subsystem_exists(&st, &r.subsystem)?;
    let available: Vec<String> = cp
        .gateway_infos()
        .into_iter()
        .filter(|g| g.availability == "available")
        .map(|g| g.name)
        .collect();
    let listeners = st
        .listeners
        .iter()
        .filter(|l| l.subsystem_nqn == r.subsystem)
        .map(|l| pb::ListenerInfo {
            host_name: l.gateway.clone(),
            trtype: l.transport.to_ascii_uppercase(),
            adrfam: if l.address.contains(':') {
                pb::AddressFamily::Ipv6 as i32
            } else {
                pb::AddressFamily::Ipv4 as i32
            },
            traddr: l.address.clone(),
            trsvcid: u32::from(l.port),
            secure: Some(l.secure),
            active: Some(available.contains(&l.gateway)),
            manual: Some(true),
        })
        .collect();
    Ok(pb::ListenersInfo {
        status: 0,
        error_message: String::new(),
        listeners,
    })
}

// ------------------------------------------------------------------ namespaces

/// `namespace_add`: the image must exist (unless `create_image`), once in the whole group.
async fn namespace_add(cp: &Arc<ControlPlane>, r: pb::NamespaceAddReq) -> Outcome<u32> {
    let unsupported = [
        (flag(r.read_only), "read_only namespaces"),
        (
            r.rbd_data_pool_name
                .as_deref()
                .is_some_and(|p| !p.is_empty()),
            "rbd_data_pool_name",
        ),
        (
            r.location.as_deref().is_some_and(|l| !l.is_empty()),
            "location",
        ),
        (
            !r.encryption_entries.is_empty() || r.encryption_algorithm.unwrap_or(0) != 0,
            "image encryption",
        ),
    ];
    if let Some((_, what)) = unsupported.iter().find(|(set, _)| *set) {
        return Err(Refusal::unsupported(what));
    }
    let ana_group = match r.anagrpid {
        None => 0,
        Some(g) => u32::try_from(g).map_err(|_| {
            Refusal::new(
                libc::EINVAL,
                format!("load balancing group {g} is negative"),
            )
        })?,
    };
    let mut entry = NamespaceEntry {
        subsystem_nqn: r.subsystem_nqn.clone(),
        nsid: r.nsid.unwrap_or(0),
        pool: r.rbd_pool_name.clone(),
        rados_namespace: r.rados_namespace_name.clone().unwrap_or_default(),
        image: r.rbd_image_name.clone(),
        block_size: r.block_size,
        ana_group,
        moving_from: 0,
        no_auto_visible: false,
        hosts: Default::default(),
        qos: Default::default(),
        nguid: String::new(),
        // Empty: a random one. The checks below keep the one they choose.
        uuid: r.uuid.clone().unwrap_or_default(),
        trash_image: false,
        frozen_size: None,
    };
    if flag(r.no_auto_visible) {
        no_auto_visible(&mut entry)?;
    }
    set_trash_on_add(&mut entry, flag(r.trash_image), flag(r.create_image));
    // The same checks as the Admin service's NamespaceAdd, first on the cached state (no
    // cluster round trip for a bad request). The NSID and identity they choose are kept: the
    // UUID a client names, or the random one chosen here, is the one added.
    let checked = cp.snapshot().check_namespace(entry.clone())?;
    if flag(r.create_image) {
        create_image(cp, &checked, r.size.unwrap_or(0)).await?;
    } else {
        let backend = cp.backend().clone();
        let e = checked.clone();
        let exists = tokio::task::spawn_blocking(move || {
            backend.image_exists(&e.pool, &e.rados_namespace, &e.image)
        })
        .await
        .map_err(|e| Refusal::new(libc::EIO, format!("task failed: {e}")))??;
        if !exists {
            return Err(Refusal::new(
                libc::ENOENT,
                format!("image {} not found", state::image_spec(&checked)),
            ));
        }
    }
    let mut checked = checked;
    if flag(r.disable_auto_resize) {
        // Auto-resize off from the start: the namespace keeps the image's size at add time.
        checked.frozen_size = Some(cp.image_size_of(&checked).await?);
    }
    let (added, _) = cp
        .add_namespace_with_image(checked, flag(r.create_image))
        .await?;
    tracing::info!(nqn = %added.subsystem_nqn, nsid = added.nsid, ana_group = added.ana_group, image = %state::image_spec(&added), "namespace added (ceph-nvmeof API)");
    Ok(added.nsid)
}

async fn namespace_delete(cp: &Arc<ControlPlane>, r: pb::NamespaceDeleteReq) -> Outcome<String> {
    let (nqn, nsid) = (r.subsystem_nqn.clone(), r.nsid);
    let entry = namespace_of(&cp.snapshot(), &nqn, nsid)?;
    if entry.trash_image && !flag(r.i_am_sure) {
        return Err(trash_needs_confirmation(&entry));
    }
    cp.try_update(move |st| st.del_namespace(&r.subsystem_nqn, r.nsid))
        .await?;
    tracing::info!(nqn = %nqn, nsid, "namespace deleted (ceph-nvmeof API)");
    if entry.trash_image {
        let spec = trash_image(cp, &entry).await.map_err(|e| {
            Refusal::new(
                e.errno,
                format!(
                    "namespace {nsid} deleted from {nqn}, but its image was not moved to the \
                     RBD trash: {}",
                    e.message
                ),
            )
        })?;
        return Ok(format!(
            "namespace {nsid} deleted from {nqn}, image {spec} moved to the RBD trash"
        ));
    }
    Ok(format!("namespace {nsid} deleted from {nqn}"))
}

fn namespace_cli(n: &NamespaceEntry) -> pb::NamespaceCli {
    pb::NamespaceCli {
        nsid: n.nsid,
        bdev_name: state::image_spec(n),
        rbd_image_name: n.image.clone(),
        rbd_pool_name: n.pool.clone(),
        load_balancing_group: n.ana_group,
        block_size: n.block_size,
        // Not known to the control plane (the image's size lives in RBD).
        rbd_image_size: 0,
        uuid: n.uuid.clone(),
        rw_ios_per_second: n.qos.rw_ios_per_second,
        rw_mbytes_per_second: n.qos.rw_megabytes_per_second,
        r_mbytes_per_second: n.qos.r_megabytes_per_second,
        w_mbytes_per_second: n.qos.w_megabytes_per_second,
        auto_visible: !n.no_auto_visible,
        hosts: n.hosts.iter().cloned().collect(),
        ns_subsystem_nqn: Some(n.subsystem_nqn.clone()),
        trash_image: Some(n.trash_image),
        disable_auto_resize: Some(n.frozen_size.is_some()),
        read_only: Some(false),
        cluster_name: None,
        configured_load_balancing_group: Some(n.ana_group),
        image_was_shrunk: Some(false),
        rbd_data_pool_name: None,
        location: None,
        rados_namespace_name: (!n.rados_namespace.is_empty()).then(|| n.rados_namespace.clone()),
    }
}

/// `list_namespaces`: `uuid` is the UUID every gateway reports in the namespace's
/// identification descriptors (stored with it: [`NamespaceEntry::uuid`]).
fn list_namespaces(
    cp: &Arc<ControlPlane>,
    r: &pb::ListNamespacesReq,
) -> Outcome<pb::NamespacesInfo> {
    let st = cp.snapshot();
    if !r.subsystem.is_empty() {
        subsystem_exists(&st, &r.subsystem)?;
    }
    let namespaces = st
        .namespaces
        .values()
        .filter(|n| r.subsystem.is_empty() || n.subsystem_nqn == r.subsystem)
        .filter(|n| r.nsid.is_none_or(|id| id == 0 || id == n.nsid))
        .map(namespace_cli)
        .filter(|n| {
            r.uuid
                .as_deref()
                .is_none_or(|u| u.is_empty() || u.eq_ignore_ascii_case(&n.uuid))
        })
        .collect();
    Ok(pb::NamespacesInfo {
        status: 0,
        error_message: String::new(),
        subsystem_nqn: r.subsystem.clone(),
        namespaces,
    })
}

/// `namespace_resize` (`new_size` in MiB): grows the image; gateways tell hosts. A resize to
/// the image's size is no change (0), a shrink is refused (EINVAL). With auto-resize off the
/// namespace's frozen size is what is resized (and the image grown to it when smaller).
async fn namespace_resize(cp: &Arc<ControlPlane>, r: pb::NamespaceResizeReq) -> Outcome<String> {
    let ns = namespace_of(&cp.snapshot(), &r.subsystem_nqn, r.nsid)?;
    let size = r
        .new_size
        .checked_mul(MIB)
        .filter(|s| *s > 0)
        .ok_or_else(|| Refusal::new(libc::EINVAL, format!("size {} MiB", r.new_size)))?;
    if ns.frozen_size.is_some() {
        // Auto-resize off: the size hosts see is the frozen one; it becomes this one (the
        // image grown to it when smaller).
        let (old, _) = cp.resize_frozen_namespace(&ns, size).await?;
        if old == size {
            return Ok("unchanged".into());
        }
        tracing::info!(nqn = %ns.subsystem_nqn, nsid = ns.nsid, image = %state::image_spec(&ns), old, new = size, "frozen namespace resized (ceph-nvmeof API)");
        return Ok(format!(
            "resized from {old} to {size} bytes (auto-resize off)"
        ));
    }
    let backend = cp.backend().clone();
    let n = ns.clone();
    let grown = tokio::task::spawn_blocking(move || {
        backend.grow_image(&n.pool, &n.rados_namespace, &n.image, size)
    })
    .await
    .map_err(|e| Refusal::new(libc::EIO, format!("task failed: {e}")))?;
    match grown {
        Ok(old) => {
            tracing::info!(nqn = %ns.subsystem_nqn, nsid = ns.nsid, image = %state::image_spec(&ns), old, new = size, "namespace grown (ceph-nvmeof API)");
            Ok(format!("grown from {old} to {size} bytes"))
        }
        Err(StoreError::Config(ConfigError::Invalid { why, .. }))
            if why == crate::store::SIZE_UNCHANGED =>
        {
            Ok("unchanged".into())
        }
        Err(e) => Err(e.into()),
    }
}

// ------------------------------------------------------------------ hosts

/// A refusal of host keys, with the API's name for the controller key (`dhchap_ctrlr_key`;
/// the model calls it `dhchap_ctrl_key`).
fn host_key_refusal(e: StoreError) -> Refusal {
    match e {
        StoreError::Config(ConfigError::BadKey {
            field: "dhchap_ctrl_key",
            why,
        }) => Refusal::new(libc::EINVAL, format!("invalid dhchap_ctrlr_key: {why}")),
        other => other.into(),
    }
}

/// How the API names "any host".
const ANY_HOST: &str = "*";

/// `add_host`: the host with its DH-HMAC-CHAP keys and TLS PSK (checked and stored as the
/// Admin service's HostAdd does, through the same [`ControlPlane::add_host`]), or `*` to open
/// the subsystem to any host. The PSK's derivation is the default (RFC 8446's layout, what
/// SPDK and current libnvme use); `nvmeofctl host change-key --psk-derivation` sets another.
async fn add_host(cp: &Arc<ControlPlane>, r: pb::AddHostReq) -> Outcome<String> {
    let set = |k: &Option<String>| k.as_deref().is_some_and(|k| !k.is_empty());
    if flag(r.psk_encrypted) || flag(r.key_encrypted) || flag(r.ctrlr_key_encrypted) {
        return Err(Refusal::unsupported(
            "encrypted keys (psk_encrypted, key_encrypted, ctrlr_key_encrypted; give the keys \
             in clear text as nvme gen-dhchap-key and nvme gen-tls-key print them)",
        ));
    }
    let (nqn, host) = (r.subsystem_nqn.clone(), r.host_nqn.clone());
    if host == ANY_HOST {
        if set(&r.dhchap_key) || set(&r.dhchap_ctrlr_key) || set(&r.psk) {
            return Err(Refusal::new(
                libc::EINVAL,
                "keys cannot be given for any host (*)",
            ));
        }
        cp.try_update(move |st| st.set_allow_any_host(&r.subsystem_nqn, true))
            .await?;
        tracing::info!(nqn = %nqn, "subsystem open to any host (ceph-nvmeof API)");
        return Ok(format!("{nqn} open to any host"));
    }
    let keys = state::HostKeyText {
        dhchap_key: r.dhchap_key.unwrap_or_default(),
        dhchap_ctrl_key: r.dhchap_ctrlr_key.unwrap_or_default(),
        psk: r.psk.unwrap_or_default(),
        psk_derivation: String::new(),
    };
    let (auth, _) = cp
        .add_host(&nqn, &host, keys)
        .await
        .map_err(host_key_refusal)?;
    tracing::info!(nqn = %nqn, host = %host, auth = auth.mode(), tls_psk = auth.psk.is_some(), "host allowed (ceph-nvmeof API)");
    Ok(format!("host {host} allowed on {nqn}"))
}

/// `remove_host`: the host is removed and the gateways close its controllers. When it
/// still had connections (the gateways' last beacons) the answer is EBUSY, as ceph-nvmeof
/// answers, unless `force`; `keep_connections` cannot be honoured (a removed host's
/// controllers are always closed) and is refused while it has any.
async fn remove_host(cp: &Arc<ControlPlane>, r: pb::RemoveHostReq) -> Outcome<String> {
    let (nqn, host) = (r.subsystem_nqn.clone(), r.host_nqn.clone());
    if host == ANY_HOST {
        cp.try_update(move |st| st.set_allow_any_host(&r.subsystem_nqn, false))
            .await?;
        tracing::info!(nqn = %nqn, "subsystem closed to hosts not listed (ceph-nvmeof API)");
        return Ok(format!("{nqn} closed to hosts not listed"));
    }
    let open = cp
        .connections_of(&nqn)
        .iter()
        .filter(|c| c.host_nqn == host)
        .count();
    if open > 0 && flag(r.keep_connections) {
        return Err(Refusal::new(
            libc::EOPNOTSUPP,
            format!(
                "host {host} has {open} connection(s) to {nqn}: keep_connections is not \
                 supported (the gateways close a removed host's controllers)"
            ),
        ));
    }
    let (n, h) = (nqn.clone(), host.clone());
    cp.try_update(move |st| st.del_host(&n, &h)).await?;
    tracing::info!(nqn = %nqn, host = %host, open, "host removed (ceph-nvmeof API)");
    if open > 0 && !flag(r.force) {
        return Err(Refusal::new(
            libc::EBUSY,
            format!(
                "host {host} removed from {nqn}; it had {open} open connection(s), which the \
                 gateways close"
            ),
        ));
    }
    Ok(format!("host {host} removed from {nqn}"))
}

async fn change_host_key(cp: &Arc<ControlPlane>, r: pb::ChangeHostKeyReq) -> Outcome<String> {
    let (nqn, host) = (r.subsystem_nqn.clone(), r.host_nqn.clone());
    let ((auth, changed), _) = cp
        .try_update(move |st| {
            st.change_host_keys(
                &r.subsystem_nqn,
                &r.host_nqn,
                r.dhchap_key.as_deref().unwrap_or(""),
                r.dhchap_ctrlr_key.as_deref().unwrap_or(""),
            )
        })
        .await
        .map_err(host_key_refusal)?;
    tracing::info!(nqn = %nqn, host = %host, auth = auth.mode(), changed, "host keys set (ceph-nvmeof API)");
    Ok(format!("keys of host {host} on {nqn} set"))
}

/// A host as the API lists it; `subsystem_key`: the subsystem has a DH-HMAC-CHAP key, which
/// is the controller key of a host with a key of its own but no controller key.
fn host_info(auth: &state::HostAuth, nqn: &str, subsystem_key: bool) -> pb::Host {
    pb::Host {
        nqn: nqn.to_string(),
        use_psk: Some(auth.psk.is_some()),
        use_dhchap: Some(auth.dhchap_key.is_some()),
        disconnected_due_to_keepalive_timeout: None,
        dhchap_controller_origin: Some(if auth.dhchap_ctrl_key.is_some() {
            pb::DhchapControllerKeyOrigin::HostSpecific as i32
        } else if auth.dhchap_key.is_some() && subsystem_key {
            pb::DhchapControllerKeyOrigin::SubsystemImplicit as i32
        } else {
            pb::DhchapControllerKeyOrigin::NoKey as i32
        }),
    }
}

fn list_hosts(cp: &Arc<ControlPlane>, r: &pb::ListHostsReq) -> Outcome<pb::HostsInfo> {
    let st = cp.snapshot();
    subsystem_exists(&st, &r.subsystem)?;
    Ok(pb::HostsInfo {
        status: 0,
        error_message: String::new(),
        allow_any_host: st.subsystems[&r.subsystem].allow_any_host,
        subsystem_nqn: r.subsystem.clone(),
        hosts: st
            .host_entries_of(&r.subsystem)
            .map(|(h, auth)| host_info(auth, h, st.subsystems[&r.subsystem].dhchap_key.is_some()))
            .collect(),
    })
}

/// `list_connections`: every connected controller the gateways reported in their last
/// beacons (`traddr`/`trsvcid`: that gateway's listener for the subsystem, where it has
/// one), then every allowed host without one (`connected` false).
fn list_connections(
    cp: &Arc<ControlPlane>,
    r: &pb::ListConnectionsReq,
) -> Outcome<pb::ConnectionsInfo> {
    let st = cp.snapshot();
    subsystem_exists(&st, &r.subsystem)?;
    let nqn = r.subsystem.as_str();
    let auth_of = |host: &str| st.hosts.get(&(nqn.to_string(), host.to_string())).cloned();
    let mut connections: Vec<pb::Connection> = cp
        .connections_of(nqn)
        .into_iter()
        .map(|c| {
            let listener = st
                .listeners
                .iter()
                .find(|l| l.subsystem_nqn == nqn && l.gateway == c.gateway);
            let auth = auth_of(&c.host_nqn).unwrap_or_default();
            pb::Connection {
                nqn: c.host_nqn.clone(),
                traddr: listener.map(|l| l.address.clone()).unwrap_or_default(),
                trsvcid: listener.map(|l| u32::from(l.port)).unwrap_or(0),
                trtype: listener
                    .map(|l| l.transport.to_ascii_uppercase())
                    .unwrap_or_default(),
                adrfam: if listener.is_some_and(|l| l.address.contains(':')) {
                    pb::AddressFamily::Ipv6 as i32
                } else {
                    pb::AddressFamily::Ipv4 as i32
                },
                connected: true,
                // The admin queue and the I/O queues granted.
                qpairs_count: i32::try_from(c.io_queues)
                    .unwrap_or(i32::MAX)
                    .saturating_add(1),
                controller_id: i32::try_from(c.cntlid).unwrap_or(0),
                // Over TLS, as the gateway reported it; a secure channel here is always
                // made with the host's PSK.
                secure: Some(c.secure),
                use_psk: Some(c.secure),
                use_dhchap: Some(auth.dhchap_key.is_some()),
                subsystem: Some(nqn.to_string()),
                disconnected_due_to_keepalive_timeout: None,
                dhchap_controller_origin: None,
                host_deleted: Some(
                    !st.hosts
                        .contains_key(&(nqn.to_string(), c.host_nqn.clone())),
                ),
            }
        })
        .collect();
    let connected: std::collections::BTreeSet<String> =
        connections.iter().map(|c| c.nqn.clone()).collect();
    for (host, auth) in st.host_entries_of(nqn) {
        if !connected.contains(host) {
            connections.push(pb::Connection {
                nqn: host.to_string(),
                connected: false,
                use_psk: Some(auth.psk.is_some()),
                use_dhchap: Some(auth.dhchap_key.is_some()),
                subsystem: Some(nqn.to_string()),
                ..Default::default()
            });
        }
    }
    Ok(pb::ConnectionsInfo {
        status: 0,
        error_message: String::new(),
        subsystem_nqn: nqn.to_string(),
        connections,
    })
}

// ------------------------------------------------------------------ gateway

/// `get_gateway_info`: the answering control-plane replica (it is no gateway itself: no
/// SPDK, no load-balancing group of its own), with this model's limits.
fn gateway_info(cp: &Arc<ControlPlane>, r: &pb::GetGatewayInfoReq) -> pb::GatewayInfo {
    let id = cp.id().to_string();
    let (addr, port) = match id.rsplit_once(':') {
        Some((a, p)) if p.parse::<u16>().is_ok() => (
            a.trim_start_matches('[').trim_end_matches(']').to_string(),
            p.to_string(),
        ),
        _ => (id.clone(), String::new()),
    };
    let hostname = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_default();
    pb::GatewayInfo {
        cli_version: r.cli_version.clone().unwrap_or_default(),
        // ceph-nvmeof's CLI refuses a gateway whose version is not X.Y.Z >= 1.1.0: the
        // version answered is the API level implemented; this project's own is in the
        // message (and in the logs).
        version: CEPH_NVMEOF_API_LEVEL.to_string(),
        name: id,
        group: String::new(),
        addr,
        port,
        bool_status: true,
        status: 0,
        error_message: own_version(),
        spdk_version: None,
        load_balancing_group: 0,
        hostname,
        max_subsystems: None,
        max_namespaces: None,
        max_hosts_per_subsystem: None,
        max_namespaces_per_subsystem: Some(state::DEFAULT_MAX_NAMESPACES),
        max_hosts: None,
        // The replica answers only once it has loaded the group state.
        gateway_initialization_over: Some(true),
        io_stats_enabled: Some(true),
    }
}

/// The clock the I/O statistics' `ticks` and latencies count in: nanoseconds.
const TICK_RATE: u64 = 1_000_000_000;

/// `ticks`: the time of the answer in [`TICK_RATE`] units. Wall-clock time since the Unix
/// epoch, so two answers (from one replica or two) give the interval a client divides by.
fn ticks_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// `namespace_get_io_stats`: the namespace's counters summed over every gateway that served
/// it, from their beacons (`crate::io_stats`: they never go down across failovers, moves
/// and gateway restarts). Ticks are nanoseconds (`tick_rate` 10^9). Refusals as
/// ceph-nvmeof's: no NSID or no subsystem NQN EINVAL, an unknown subsystem ENOENT, an
/// unknown NSID ENODEV.
fn namespace_io_stats(
    cp: &Arc<ControlPlane>,
    r: &pb::NamespaceGetIoStatsReq,
) -> Outcome<pb::NamespaceIoStatsInfo> {
    if r.nsid == 0 {
        return Err(Refusal::new(
            libc::EINVAL,
            "Failure getting IO stats for namespace, missing ID",
        ));
    }
    if r.subsystem_nqn.is_empty() {
        return Err(Refusal::new(
            libc::EINVAL,
            format!(
                "Failure getting IO stats for namespace {}, missing subsystem NQN",
                r.nsid
            ),
        ));
    }
    let (n, t, _) = cp.namespace_io_stats(&r.subsystem_nqn, r.nsid)?;
    let ns = namespace_cli(&n);
    let failed = [
        ("read", t.read.failed),
        ("write", t.write.failed),
        ("unmap", t.unmap.failed),
    ];
    Ok(pb::NamespaceIoStatsInfo {
        status: 0,
        error_message: String::new(),
        subsystem_nqn: r.subsystem_nqn.clone(),
        nsid: r.nsid,
        uuid: Some(ns.uuid),
        bdev_name: ns.bdev_name,
        tick_rate: TICK_RATE,
        ticks: ticks_now(),
        bytes_read: t.read.bytes,
        num_read_ops: t.read.ops,
        bytes_written: t.write.bytes,
        num_write_ops: t.write.ops,
        bytes_unmapped: t.unmap.bytes,
        num_unmap_ops: t.unmap.ops,
        read_latency_ticks: t.read.latency_ns,
        max_read_latency_ticks: t.read.max_latency_ns,
        min_read_latency_ticks: t.read.min_latency_ns,
        write_latency_ticks: t.write.latency_ns,
        max_write_latency_ticks: t.write.max_latency_ns,
        min_write_latency_ticks: t.write.min_latency_ns,
        unmap_latency_ticks: t.unmap.latency_ns,
        max_unmap_latency_ticks: t.unmap.max_latency_ns,
        min_unmap_latency_ticks: t.unmap.min_latency_ns,
        // No Copy command is offered (ONCS), so none is ever counted.
        copy_latency_ticks: 0,
        max_copy_latency_ticks: 0,
        min_copy_latency_ticks: 0,
        // Failed ops per kind (SPDK keys its errors by status; the gateway counts failures
        // per kind of op).
        io_error: failed
            .into_iter()
            .filter(|(_, v)| *v > 0)
            .map(|(name, v)| pb::NamespaceIoError {
                name: name.to_string(),
                value: u32::try_from(v).unwrap_or(u32::MAX),
            })
            .collect(),
    })
}

/// `get_gateway_stats`: SPDK's poll groups (its reactor threads) have no counterpart here,
/// so each gateway of the group is one "poll group", named after it: queues connected since
/// this replica heard from it (restarts summed) and now (its last beacon's controllers), ops
/// at its devices and completed, the transports of its listeners.
fn gateway_stats(cp: &Arc<ControlPlane>) -> pb::GatewayStatsInfo {
    let st = cp.snapshot();
    let totals = cp.gateway_io_totals();
    let current = cp.queues_by_gateway();
    let mut names: std::collections::BTreeSet<String> =
        cp.gateway_infos().into_iter().map(|g| g.name).collect();
    names.extend(totals.keys().cloned());
    let clamp = |v: u64| u32::try_from(v).unwrap_or(u32::MAX);
    let poll_groups = names
        .into_iter()
        .map(|gw| {
            let t = totals.get(&gw).copied().unwrap_or_default();
            let (admin_now, io_now) = current.get(&gw).copied().unwrap_or((0, 0));
            let transports: std::collections::BTreeSet<String> = st
                .listeners
                .iter()
                .filter(|l| l.gateway == gw)
                .map(|l| l.transport.to_ascii_uppercase())
                .collect();
            pb::PollGroupInfo {
                name: gw,
                admin_qpairs: clamp(t.admin_queues.max(admin_now)),
                io_qpairs: clamp(t.io_queues.max(io_now)),
                current_admin_qpairs: clamp(admin_now),
                current_io_qpairs: clamp(io_now),
                pending_bdev_io: t.in_flight,
                completed_nvme_io: t.completed,
                transports: transports
                    .into_iter()
                    .map(|trtype| pb::PollGroupTransportInfo { trtype })
                    .collect(),
            }
        })
        .collect();
    pb::GatewayStatsInfo {
        status: 0,
        error_message: String::new(),
        tick_rate: TICK_RATE,
        poll_groups,
    }
}

// ------------------------------------------------------------------ the rest of the CLI's and dashboard's calls

/// The ceph-nvmeof release whose management API this implements, answered as
/// `get_gateway_info`'s `version`: its CLI and dashboard check it (X.Y.Z, at least 1.1.0).
/// The calls of that release's CLI (and `namespace_set_auto_resize` of later ones) are
/// answered; docs/ceph-nvmeof-api.md lists each.
pub const CEPH_NVMEOF_API_LEVEL: &str = "1.5.4";

/// This project's own version, as `get_gateway_info` gives it in `error_message`.
fn own_version() -> String {
    format!(
        "ceph-nvmeof-rs {} (nvmeof-control), answering ceph-nvmeof API {CEPH_NVMEOF_API_LEVEL}",
        env!("CARGO_PKG_VERSION")
    )
}

/// What an SPDK-internal call answers: there is no SPDK here.
fn no_spdk(call: &str) -> Refusal {
    Refusal::new(
        libc::EOPNOTSUPP,
        format!(
            "{call} is not supported: this gateway has no SPDK (its NVMe-oF target is its \
             own); its log level is get_gateway_log_level / set_gateway_log_level"
        ),
    )
}

/// `namespace_add`'s `trash_image`: as in ceph-nvmeof, only an image the gateway creates
/// (`create_image`) is trashed with its namespace; for an existing image the flag is
/// dropped (logged), and `namespace_set_rbd_trash_image` sets it explicitly.
fn set_trash_on_add(entry: &mut NamespaceEntry, trash: bool, created: bool) {
    if trash && !created {
        tracing::warn!(image = %state::image_spec(entry), "trash_image ignored: the image was not created with the namespace (set it with namespace_set_rbd_trash_image)");
    }
    entry.trash_image = trash && created;
}

/// How many times, and how long apart, the image of a deleted namespace is tried for the
/// trash while the gateways still have it open (they close it once they applied the
/// deletion; librbd refuses to trash an image with watchers).
const TRASH_TRIES: u32 = 60;
const TRASH_RETRY: std::time::Duration = std::time::Duration::from_millis(250);

/// Moves a deleted namespace's image to the RBD trash; returns its spec.
async fn trash_image(cp: &Arc<ControlPlane>, entry: &NamespaceEntry) -> Outcome<String> {
    let spec = state::image_spec(entry);
    for attempt in 1..=TRASH_TRIES {
        let backend = cp.backend().clone();
        let e = entry.clone();
        let moved = tokio::task::spawn_blocking(move || {
            backend.trash_image(&e.pool, &e.rados_namespace, &e.image)
        })
        .await
        .map_err(|e| Refusal::new(libc::EIO, format!("task failed: {e}")))?;
        match moved {
            Ok(()) => {
                tracing::info!(image = %spec, "image moved to the RBD trash with its namespace (ceph-nvmeof API)");
                return Ok(spec);
            }
            Err(StoreError::Image(ImageError::Busy(_))) if attempt < TRASH_TRIES => {
                tokio::time::sleep(TRASH_RETRY).await;
            }
            Err(e) => return Err(e.into()),
        }
    }
    Err(Refusal::new(
        libc::EBUSY,
        format!("image {spec} still open"),
    ))
}

fn trash_needs_confirmation(n: &NamespaceEntry) -> Refusal {
    Refusal::new(
        libc::EINVAL,
        format!(
            "namespace {} of {} moves its image {} to the RBD trash when deleted: confirm \
             with i_am_sure (the CLI's --i-am-sure), or clear the flag with \
             namespace_set_rbd_trash_image",
            n.nsid,
            n.subsystem_nqn,
            state::image_spec(n)
        ),
    )
}

/// `list_namespaces`' `rbd_image_size`: each image's size as RBD has it now (the
/// control plane asks the cluster). An image that cannot be read (missing, its pool
/// unreachable) shows 0, logged.
async fn with_image_sizes(
    cp: &Arc<ControlPlane>,
    mut info: pb::NamespacesInfo,
) -> pb::NamespacesInfo {
    let st = cp.snapshot();
    let images: Vec<(String, String, String)> = info
        .namespaces
        .iter()
        .map(|n| {
            let nqn = n.ns_subsystem_nqn.clone().unwrap_or_default();
            st.namespaces
                .get(&(nqn, n.nsid))
                .map(|e| (e.pool.clone(), e.rados_namespace.clone(), e.image.clone()))
                .unwrap_or_default()
        })
        .collect();
    let backend = cp.backend().clone();
    let sizes = tokio::task::spawn_blocking(move || {
        images
            .iter()
            .map(|(pool, ns, image)| {
                if image.is_empty() {
                    return 0;
                }
                backend.image_size(pool, ns, image).unwrap_or_else(|e| {
                    tracing::warn!(image = %crate::store::image_spec(pool, ns, image), "reading an image's size: {e}");
                    0
                })
            })
            .collect::<Vec<u64>>()
    })
    .await
    .unwrap_or_default();
    for (n, size) in info.namespaces.iter_mut().zip(sizes) {
        n.rbd_image_size = size;
    }
    info
}

/// `change_subsystem_key`: sets (or, empty, removes) the subsystem's DH-HMAC-CHAP key, the
/// controller key its hosts with a key of their own but none for the controller get
/// (bidirectional authentication); pushed to the gateways with the hosts' keys.
async fn change_subsystem_key(
    cp: &Arc<ControlPlane>,
    r: pb::ChangeSubsystemKeyReq,
) -> Outcome<String> {
    let nqn = r.subsystem_nqn.clone();
    let key = r.dhchap_key.unwrap_or_default();
    let set = !key.is_empty();
    cp.set_subsystem_key(&r.subsystem_nqn, key).await?;
    Ok(format!(
        "{nqn}: DH-HMAC-CHAP key {}",
        if set { "set" } else { "removed" }
    ))
}

/// `namespace_change_load_balancing_group`: the namespace moves to that ANA group, drained
/// as `nvmeofctl namespace move` drains it. `auto_lb_logic` changes nothing (the group
/// never rebalances namespaces by itself).
async fn change_load_balancing_group(
    cp: &Arc<ControlPlane>,
    r: pb::NamespaceChangeLoadBalancingGroupReq,
) -> Outcome<String> {
    let group = u32::try_from(r.anagrpid).map_err(|_| {
        Refusal::new(
            libc::EINVAL,
            format!("load balancing group {} is negative", r.anagrpid),
        )
    })?;
    namespace_of(&cp.snapshot(), &r.subsystem_nqn, r.nsid)?;
    let (_, drained) = cp.move_namespace(&r.subsystem_nqn, r.nsid, group).await?;
    tracing::info!(nqn = %r.subsystem_nqn, nsid = r.nsid, ana_group = group, "namespace moved (ceph-nvmeof API){drained}");
    Ok(format!(
        "namespace {} of {} moved to load balancing group {group}{drained}",
        r.nsid, r.subsystem_nqn
    ))
}

/// `namespace_change_visibility`: visible to every allowed host, or only to the hosts
/// `namespace_add_host` names; connected hosts see the change at once. Dropping a host
/// list needs `force` (EBUSY otherwise).
async fn change_visibility(
    cp: &Arc<ControlPlane>,
    r: pb::NamespaceChangeVisibilityReq,
) -> Outcome<String> {
    let (nqn, nsid, auto) = (r.subsystem_nqn.clone(), r.nsid, r.auto_visible);
    let force = flag(r.force);
    cp.set_namespace(&nqn, nsid, Some(auto), None, None, force)
        .await?;
    Ok(format!(
        "namespace {nsid} of {} visible to {}",
        r.subsystem_nqn,
        if auto {
            "every allowed host"
        } else {
            "the hosts on its list"
        }
    ))
}

/// `namespace_set_rbd_trash_image`: whether the image goes to the RBD trash when the
/// namespace is deleted (then only with `i_am_sure`).
async fn set_rbd_trash_image(
    cp: &Arc<ControlPlane>,
    r: pb::NamespaceSetRbdTrashImageReq,
) -> Outcome<String> {
    let (nqn, nsid, trash) = (r.subsystem_nqn.clone(), r.nsid, r.trash_image);
    cp.set_namespace(&nqn, nsid, None, Some(trash), None, false)
        .await?;
    Ok(format!(
        "namespace {nsid} of {}: trash_image {trash}",
        r.subsystem_nqn
    ))
}

/// `namespace_set_auto_resize`: true, the namespace follows its image's growth (librbd
/// tells every gateway, it tells hosts); false, it keeps the size it has now, stored in the
/// group state so every gateway reports it, and only `namespace_resize` changes it.
async fn set_auto_resize(
    cp: &Arc<ControlPlane>,
    r: pb::NamespaceSetAutoResizeReq,
) -> Outcome<String> {
    namespace_of(&cp.snapshot(), &r.subsystem_nqn, r.nsid)?;
    let (notes, _) = cp
        .set_namespace(
            &r.subsystem_nqn,
            r.nsid,
            None,
            None,
            Some(r.auto_resize),
            false,
        )
        .await?;
    Ok(format!(
        "namespace {} of {}: {}",
        r.nsid,
        r.subsystem_nqn,
        notes.join(", ")
    ))
}

/// `get_subsystems`: every subsystem with its listeners, hosts and namespaces (ceph-nvmeof
/// answers SPDK's listing; the reply has no status).
fn get_subsystems(cp: &Arc<ControlPlane>) -> pb::SubsystemsInfo {
    let st = cp.snapshot();
    let ranges: Vec<(u32, u32)> = cp
        .gateway_infos()
        .iter()
        .map(|g| (g.cntlid_min, g.cntlid_max))
        .filter(|(lo, hi)| *lo > 0 && hi >= lo)
        .collect();
    let subsystems = st
        .subsystems
        .values()
        .map(|s| pb::Subsystem {
            nqn: s.nqn.clone(),
            subtype: "NVMe".into(),
            listen_addresses: st
                .listeners
                .iter()
                .filter(|l| l.subsystem_nqn == s.nqn)
                .map(|l| pb::ListenAddress {
                    trtype: l.transport.to_ascii_uppercase(),
                    adrfam: if l.address.contains(':') {
                        "IPv6"
                    } else {
                        "IPv4"
                    }
                    .into(),
                    traddr: l.address.clone(),
                    trsvcid: l.port.to_string(),
                    transport: Some(l.transport.to_ascii_uppercase()),
                    secure: Some(l.secure),
                })
                .collect(),
            hosts: st
                .host_entries_of(&s.nqn)
                .map(|(h, auth)| host_info(auth, h, s.dhchap_key.is_some()))
                .collect(),
            allow_any_host: s.allow_any_host,
            serial_number: Some(s.serial.clone()),
            model_number: None,
            max_namespaces: Some(s.max_namespaces),
            min_cntlid: ranges.iter().map(|r| r.0).min(),
            max_cntlid: ranges.iter().map(|r| r.1).max(),
            namespaces: st
                .namespaces
                .values()
                .filter(|n| n.subsystem_nqn == s.nqn)
                .map(|n| {
                    let cli = namespace_cli(n);
                    pb::Namespace {
                        nsid: n.nsid,
                        name: cli.bdev_name.clone(),
                        bdev_name: Some(cli.bdev_name),
                        nguid: Some(n.nguid.clone()),
                        uuid: Some(cli.uuid),
                        anagrpid: Some(n.ana_group),
                        nonce: None,
                        auto_visible: Some(cli.auto_visible),
                        hosts: cli.hosts,
                    }
                })
                .collect(),
            has_dhchap_key: Some(s.dhchap_key.is_some()),
        })
        .collect();
    pb::SubsystemsInfo { subsystems }
}

/// The API's name for a log level ([`state::LOG_LEVELS`]): Python logging's, which has no
/// trace (debug) and calls warn `warning`.
fn gw_log_level(level: &str) -> pb::GwLogLevel {
    match level {
        "trace" | "debug" => pb::GwLogLevel::Debug,
        "info" => pb::GwLogLevel::Info,
        "warn" => pb::GwLogLevel::Warning,
        _ => pb::GwLogLevel::Error,
    }
}

/// `get_gateway_log_level`: the group's level (every gateway and replica runs at it), or,
/// while none is set, the answering replica's own.
fn get_log_level(cp: &Arc<ControlPlane>) -> pb::GatewayLogLevelInfo {
    let level = cp
        .snapshot()
        .settings
        .log_level
        .clone()
        .unwrap_or_else(crate::log_level::current);
    pb::GatewayLogLevelInfo {
        status: 0,
        error_message: String::new(),
        log_level: gw_log_level(&level) as i32,
    }
}

/// `set_gateway_log_level`: the group's level, live on every gateway and control-plane
/// replica (`nvmeofctl log-level set`). `critical` is `error` here (tracing has no level
/// above it); `notset` is refused.
async fn set_log_level(cp: &Arc<ControlPlane>, r: &pb::SetGatewayLogLevelReq) -> Outcome<String> {
    let level =
        match pb::GwLogLevel::try_from(r.log_level) {
            Err(_) => {
                return Err(Refusal::new(
                    libc::ENOKEY,
                    format!("Unknown log level {}", r.log_level),
                ))
            }
            Ok(pb::GwLogLevel::Notset) => return Err(Refusal::new(
                libc::EINVAL,
                "log level notset is not supported: give debug, info, warning, error or critical",
            )),
            Ok(pb::GwLogLevel::Debug) => "debug",
            Ok(pb::GwLogLevel::Info) => "info",
            Ok(pb::GwLogLevel::Warning) => "warn",
            Ok(pb::GwLogLevel::Error | pb::GwLogLevel::Critical) => "error",
        };
    cp.set_log_level(Some(level.to_string())).await?;
    tracing::info!(level, "group log level set (ceph-nvmeof API)");
    Ok(format!("log level {level}"))
}

/// `show_gateway_listeners_info`: each listener of the subsystem with the ANA state of
/// every load-balancing (ANA) group on that listener's gateway, as the group map has it
/// (1 optimized, 2 non-optimized, 3 inaccessible; 15, ANA change, while a group moves).
fn listeners_info(
    cp: &Arc<ControlPlane>,
    r: &pb::ShowGatewayListenersInfoReq,
) -> Outcome<pb::GatewayListenersInfo> {
    let st = cp.snapshot();
    subsystem_exists(&st, &r.subsystem_nqn)?;
    let listed = list_listeners(
        cp,
        &pb::ListListenersReq {
            subsystem: r.subsystem_nqn.clone(),
        },
    )?;
    let gw_listeners = listed
        .listeners
        .into_iter()
        .map(|l| pb::GatewayListenerInfo {
            lb_states: st
                .map
                .as_ref()
                .map(|m| m.ana_states(&l.host_name))
                .unwrap_or_default()
                .into_iter()
                .map(|(grp_id, state)| pb::AnaGroupState {
                    grp_id,
                    state: i32::from(state.code()),
                })
                .collect(),
            listener: Some(l),
        })
        .collect();
    Ok(pb::GatewayListenersInfo {
        status: 0,
        error_message: String::new(),
        gw_listeners,
    })
}

// ------------------------------------------------------------------ the service

/// A listing's reply, or its refusal in the reply's status fields.
macro_rules! listing {
    ($outcome:expr, $ty:ident) => {
        match $outcome {
            Ok(reply) => reply,
            Err(r) => pb::$ty {
                status: r.errno,
                error_message: r.message,
                ..Default::default()
            },
        }
    };
}

type Reply<T> = Result<Response<T>, Status>;

#[tonic::async_trait]
impl pb::gateway_server::Gateway for CephGatewayService {
    async fn namespace_add(&self, r: Request<pb::NamespaceAddReq>) -> Reply<pb::NsidStatus> {
        let outcome = logged(
            "namespace_add",
            namespace_add(&self.0, r.into_inner()).await,
        );
        Ok(Response::new(match outcome {
            Ok(nsid) => pb::NsidStatus {
                status: 0,
                error_message: String::new(),
                nsid,
            },
            Err(r) => pb::NsidStatus {
                status: r.errno,
                error_message: r.message,
                nsid: 0,
            },
        }))
    }

    async fn create_subsystem(
        &self,
        r: Request<pb::CreateSubsystemReq>,
    ) -> Reply<pb::SubsysStatus> {
        let r = r.into_inner();
        let nqn = r.subsystem_nqn.clone();
        let outcome = logged("create_subsystem", create_subsystem(&self.0, r).await);
        Ok(Response::new(match outcome {
            Ok(_) => pb::SubsysStatus {
                status: 0,
                error_message: String::new(),
                nqn,
            },
            Err(r) => pb::SubsysStatus {
                status: r.errno,
                error_message: r.message,
                nqn,
            },
        }))
    }

    async fn delete_subsystem(&self, r: Request<pb::DeleteSubsystemReq>) -> Reply<pb::ReqStatus> {
        let outcome = delete_subsystem(&self.0, r.into_inner()).await;
        status_reply("delete_subsystem", outcome)
    }

    async fn list_namespaces(
        &self,
        r: Request<pb::ListNamespacesReq>,
    ) -> Reply<pb::NamespacesInfo> {
        let listed = match list_namespaces(&self.0, r.get_ref()) {
            Ok(info) => Ok(with_image_sizes(&self.0, info).await),
            Err(e) => Err(e),
        };
        Ok(Response::new(listing!(listed, NamespacesInfo)))
    }

    async fn namespace_resize(&self, r: Request<pb::NamespaceResizeReq>) -> Reply<pb::ReqStatus> {
        let outcome = namespace_resize(&self.0, r.into_inner()).await;
        status_reply("namespace_resize", outcome)
    }

    async fn namespace_get_io_stats(
        &self,
        r: Request<pb::NamespaceGetIoStatsReq>,
    ) -> Reply<pb::NamespaceIoStatsInfo> {
        let r = r.get_ref();
        let outcome = logged("namespace_get_io_stats", namespace_io_stats(&self.0, r));
        Ok(Response::new(match outcome {
            Ok(info) => info,
            Err(refusal) => pb::NamespaceIoStatsInfo {
                status: refusal.errno,
                error_message: refusal.message,
                subsystem_nqn: r.subsystem_nqn.clone(),
                nsid: r.nsid,
                ..Default::default()
            },
        }))
    }

    async fn namespace_set_qos_limits(
        &self,
        r: Request<pb::NamespaceSetQosReq>,
    ) -> Reply<pb::ReqStatus> {
        let r = r.into_inner();
        let outcome = match namespace_of(&self.0.snapshot(), &r.subsystem_nqn, r.nsid) {
            Ok(_) => set_qos_limits(&self.0, &r).await,
            Err(e) => Err(e),
        };
        status_reply("namespace_set_qos_limits", outcome)
    }

    async fn namespace_delete(&self, r: Request<pb::NamespaceDeleteReq>) -> Reply<pb::ReqStatus> {
        let outcome = namespace_delete(&self.0, r.into_inner()).await;
        status_reply("namespace_delete", outcome)
    }

    async fn namespace_add_host(
        &self,
        r: Request<pb::NamespaceAddHostReq>,
    ) -> Reply<pb::ReqStatus> {
        let r = r.into_inner();
        let outcome = match namespace_of(&self.0.snapshot(), &r.subsystem_nqn, r.nsid) {
            Ok(_) => add_namespace_host(&self.0, &r).await,
            Err(e) => Err(e),
        };
        status_reply("namespace_add_host", outcome)
    }

    async fn namespace_delete_host(
        &self,
        r: Request<pb::NamespaceDeleteHostReq>,
    ) -> Reply<pb::ReqStatus> {
        let r = r.into_inner();
        let outcome = match namespace_of(&self.0.snapshot(), &r.subsystem_nqn, r.nsid) {
            Ok(_) => delete_namespace_host(&self.0, &r).await,
            Err(e) => Err(e),
        };
        status_reply("namespace_delete_host", outcome)
    }

    async fn add_host(&self, r: Request<pb::AddHostReq>) -> Reply<pb::ReqStatus> {
        let outcome = add_host(&self.0, r.into_inner()).await;
        Ok(Response::new(req_status(logged("add_host", outcome))))
    }

    async fn remove_host(&self, r: Request<pb::RemoveHostReq>) -> Reply<pb::ReqStatus> {
        let outcome = remove_host(&self.0, r.into_inner()).await;
        Ok(Response::new(req_status(logged("remove_host", outcome))))
    }

    async fn change_host_key(&self, r: Request<pb::ChangeHostKeyReq>) -> Reply<pb::ReqStatus> {
        let outcome = change_host_key(&self.0, r.into_inner()).await;
        status_reply("change_host_key", outcome)
    }

    async fn list_hosts(&self, r: Request<pb::ListHostsReq>) -> Reply<pb::HostsInfo> {
        Ok(Response::new(listing!(
            list_hosts(&self.0, r.get_ref()),
            HostsInfo
        )))
    }

    async fn list_connections(
        &self,
        r: Request<pb::ListConnectionsReq>,
    ) -> Reply<pb::ConnectionsInfo> {
        Ok(Response::new(listing!(
            list_connections(&self.0, r.get_ref()),
            ConnectionsInfo
        )))
    }

    async fn create_listener(&self, r: Request<pb::CreateListenerReq>) -> Reply<pb::ReqStatus> {
        let outcome = create_listener(&self.0, r.into_inner()).await;
        status_reply("create_listener", outcome)
    }

    async fn delete_listener(&self, r: Request<pb::DeleteListenerReq>) -> Reply<pb::ReqStatus> {
        let outcome = delete_listener(&self.0, r.into_inner()).await;
        status_reply("delete_listener", outcome)
    }

    async fn list_listeners(&self, r: Request<pb::ListListenersReq>) -> Reply<pb::ListenersInfo> {
        Ok(Response::new(listing!(
            list_listeners(&self.0, r.get_ref()),
            ListenersInfo
        )))
    }

    async fn list_subsystems(
        &self,
        r: Request<pb::ListSubsystemsReq>,
    ) -> Reply<pb::SubsystemsInfoCli> {
        Ok(Response::new(list_subsystems(&self.0, r.get_ref())))
    }

    async fn get_gateway_info(&self, r: Request<pb::GetGatewayInfoReq>) -> Reply<pb::GatewayInfo> {
        Ok(Response::new(gateway_info(&self.0, r.get_ref())))
    }

    async fn change_subsystem_key(
        &self,
        r: Request<pb::ChangeSubsystemKeyReq>,
    ) -> Reply<pb::ReqStatus> {
        let outcome = change_subsystem_key(&self.0, r.into_inner()).await;
        status_reply("change_subsystem_key", outcome)
    }

    async fn namespace_change_load_balancing_group(
        &self,
        r: Request<pb::NamespaceChangeLoadBalancingGroupReq>,
    ) -> Reply<pb::ReqStatus> {
        let outcome = change_load_balancing_group(&self.0, r.into_inner()).await;
        status_reply("namespace_change_load_balancing_group", outcome)
    }

    async fn namespace_change_visibility(
        &self,
        r: Request<pb::NamespaceChangeVisibilityReq>,
    ) -> Reply<pb::ReqStatus> {
        let outcome = change_visibility(&self.0, r.into_inner()).await;
        status_reply("namespace_change_visibility", outcome)
    }

    async fn namespace_set_rbd_trash_image(
        &self,
        r: Request<pb::NamespaceSetRbdTrashImageReq>,
    ) -> Reply<pb::ReqStatus> {
        let outcome = set_rbd_trash_image(&self.0, r.into_inner()).await;
        status_reply("namespace_set_rbd_trash_image", outcome)
    }

    async fn namespace_set_auto_resize(
        &self,
        r: Request<pb::NamespaceSetAutoResizeReq>,
    ) -> Reply<pb::ReqStatus> {
        let outcome = set_auto_resize(&self.0, r.into_inner()).await;
        status_reply("namespace_set_auto_resize", outcome)
    }

    async fn get_subsystems(&self, _: Request<pb::GetSubsystemsReq>) -> Reply<pb::SubsystemsInfo> {
        Ok(Response::new(get_subsystems(&self.0)))
    }

    async fn set_ana_state(&self, _: Request<pb::AnaInfo>) -> Reply<pb::ReqStatus> {
        Ok(Response::new(req_status(logged(
            "set_ana_state",
            Err(Refusal::new(
                libc::EOPNOTSUPP,
                "set_ana_state is not supported: ANA states are decided by the control \
                 plane's leader (failover, failback), not set by a client; move a namespace \
                 with namespace_change_load_balancing_group",
            )),
        ))))
    }

    async fn get_spdk_nvmf_log_flags_and_level(
        &self,
        _: Request<pb::GetSpdkNvmfLogFlagsAndLevelReq>,
    ) -> Reply<pb::SpdkNvmfLogFlagsAndLevelInfo> {
        let r = no_spdk("get_spdk_nvmf_log_flags_and_level");
        Ok(Response::new(pb::SpdkNvmfLogFlagsAndLevelInfo {
            status: r.errno,
            error_message: r.message,
            ..Default::default()
        }))
    }

    async fn disable_spdk_nvmf_logs(
        &self,
        _: Request<pb::DisableSpdkNvmfLogsReq>,
    ) -> Reply<pb::ReqStatus> {
        Ok(Response::new(req_status(Err(no_spdk(
            "disable_spdk_nvmf_logs",
        )))))
    }

    async fn set_spdk_nvmf_logs(&self, _: Request<pb::SetSpdkNvmfLogsReq>) -> Reply<pb::ReqStatus> {
        Ok(Response::new(req_status(Err(no_spdk(
            "set_spdk_nvmf_logs",
        )))))
    }

    async fn get_gateway_log_level(
        &self,
        _: Request<pb::GetGatewayLogLevelReq>,
    ) -> Reply<pb::GatewayLogLevelInfo> {
        Ok(Response::new(get_log_level(&self.0)))
    }

    async fn set_gateway_log_level(
        &self,
        r: Request<pb::SetGatewayLogLevelReq>,
    ) -> Reply<pb::ReqStatus> {
        let outcome = set_log_level(&self.0, r.get_ref()).await;
        status_reply("set_gateway_log_level", outcome)
    }

    async fn show_gateway_listeners_info(
        &self,
        r: Request<pb::ShowGatewayListenersInfoReq>,
    ) -> Reply<pb::GatewayListenersInfo> {
        Ok(Response::new(listing!(
            listeners_info(&self.0, r.get_ref()),
            GatewayListenersInfo
        )))
    }

    async fn get_gateway_stats(
        &self,
        _: Request<pb::GetGatewayStatsReq>,
    ) -> Reply<pb::GatewayStatsInfo> {
        Ok(Response::new(gateway_stats(&self.0)))
    }
}

// ------------------------------------------------------------------ keys stay out of logs

/// Whether an optional key is given, for `Debug`.
fn key_shown(k: &Option<String>) -> &'static str {
    match k.as_deref() {
        None | Some("") => "<none>",
        Some(_) => "<set>",
    }
}

impl std::fmt::Debug for pb::AddHostReq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("add_host_req")
            .field("subsystem_nqn", &self.subsystem_nqn)
            .field("host_nqn", &self.host_nqn)
            .field("psk", &key_shown(&self.psk))
            .field("dhchap_key", &key_shown(&self.dhchap_key))
            .field("dhchap_ctrlr_key", &key_shown(&self.dhchap_ctrlr_key))
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for pb::ChangeHostKeyReq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("change_host_key_req")
            .field("subsystem_nqn", &self.subsystem_nqn)
            .field("host_nqn", &self.host_nqn)
            .field("dhchap_key", &key_shown(&self.dhchap_key))
            .field("dhchap_ctrlr_key", &key_shown(&self.dhchap_ctrlr_key))
            .finish()
    }
}

impl std::fmt::Debug for pb::ChangeSubsystemKeyReq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("change_subsystem_key_req")
            .field("subsystem_nqn", &self.subsystem_nqn)
            .field("dhchap_key", &key_shown(&self.dhchap_key))
            .finish()
    }
}

impl std::fmt::Debug for pb::CreateSubsystemReq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("create_subsystem_req")
            .field("subsystem_nqn", &self.subsystem_nqn)
            .field("serial_number", &self.serial_number)
            .field("max_namespaces", &self.max_namespaces)
            .field("dhchap_key", &key_shown(&self.dhchap_key))
            .finish_non_exhaustive()
    }
}
