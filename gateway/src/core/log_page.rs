//! Log pages, built whole; Get Log Page slices the requested window out of them.

use std::net::IpAddr;

use super::command::Status;
use super::controller::Controller;
use super::subsystem::Subsystem;
use super::supported;
use super::target::{ListenerInfo, Target, TransportType};
use super::wire::{put_str, put_u16, put_u32, put_u64};
use crate::spec::{admin_opcode, disc, effects, log, sc, NQN_FIELD_LEN, NSID_ALL};

const ERROR_LOG_ENTRY_LEN: usize = 64;
const SMART_LOG_LEN: usize = 512;
const FW_SLOT_LOG_LEN: usize = 512;
const EFFECTS_LOG_LEN: usize = 4096;
const CHANGED_NS_LOG_LEN: usize = 4096;
const ANA_HEADER_LEN: usize = 16;
const ANA_DESCRIPTOR_LEN: usize = 32;

/// Builds log page `lid` for `ctrl`. `retain_event` is the RAE bit: without it, reading a
/// page that carries an event (Changed Namespace List) also clears its content.
/// `nsid` is the command's NSID (the SMART page's namespace).
pub fn build(
    ctrl: &Controller,
    lid: u8,
    lsp: u8,
    retain_event: bool,
    nsid: u32,
) -> Result<Vec<u8>, Status> {
    let discovery = ctrl.is_discovery();
    let offered = supported::log_pages(&ctrl.target, discovery);
    if !offered.contains(&lid) {
        return Err(Status::error(sc::INVALID_LOG_PAGE));
    }
    Ok(match lid {
        log::SUPPORTED => supported_log_pages(&offered),
        log::ERROR => vec![0; ERROR_LOG_ENTRY_LEN],
        log::SMART => {
            // One page for the whole controller (LPA bit 0 clear), asked for by NSID 0h or
            // FFFFFFFFh, or by an active NSID; an inactive one (hidden from this host
            // included) is Invalid Namespace or Format, as Linux nvmet answers.
            if nsid != 0 && nsid != NSID_ALL && !ctrl.is_discovery() {
                ctrl.subsystem
                    .namespace_for_host(nsid, &ctrl.hostnqn)
                    .ok_or(Status::error(sc::INVALID_NS))?;
            }
            smart()
        }
        log::FW_SLOT => firmware_slots(ctrl),
        log::CHANGED_NS => changed_namespaces(ctrl, !retain_event),
        log::CMD_EFFECTS => command_effects(ctrl),
        log::ANA => ana(ctrl, lsp & log::ANA_LSP_RGO != 0),
        log::DISC => discovery_log(ctrl),
        log::RESERVATION => ctrl.reservation_log_page(retain_event),
        _ => return Err(Status::error(sc::INVALID_LOG_PAGE)),
    })
}

fn supported_log_pages(offered: &[u8]) -> Vec<u8> {
    let mut page = vec![0; 1024];
    for &lid in offered {
        put_u32(&mut page, usize::from(lid) * 4, log::LIDS_LSUPP);
    }
    page
}

fn smart() -> Vec<u8> {
    let mut page = vec![0; SMART_LOG_LEN];
    // Composite temperature 25 °C; spare fully available with a 10% threshold.
    put_u16(&mut page, 1, 298);
    page[3] = 100;
    page[4] = 10;
    page
}

fn firmware_slots(ctrl: &Controller) -> Vec<u8> {
    let mut page = vec![0; FW_SLOT_LOG_LEN];
    page[0] = 1; // AFI: slot 1 active
    let fw = &ctrl.target.identity.firmware;
    page[8..16].fill(b' ');
    put_str(&mut page, 8, 8, fw);
    page
}

fn command_effects(ctrl: &Controller) -> Vec<u8> {
    let mut page = vec![0; EFFECTS_LOG_LEN];
    for op in [
        admin_opcode::GET_LOG_PAGE,
        admin_opcode::IDENTIFY,
        admin_opcode::ABORT,
        admin_opcode::SET_FEATURES,
        admin_opcode::GET_FEATURES,
        admin_opcode::ASYNC_EVENT,
        admin_opcode::KEEP_ALIVE,
    ] {
        put_u32(&mut page, usize::from(op) * 4, effects::CSUPP);
    }
    // The I/O commands offered, as ONCS announces them.
    let io = 1024;
    for cmd in supported::io_commands(&ctrl.target) {
        put_u32(&mut page, io + usize::from(cmd.opcode) * 4, cmd.effects);
    }
    page
}

fn changed_namespaces(ctrl: &Controller, clear: bool) -> Vec<u8> {
    let mut page = vec![0; CHANGED_NS_LOG_LEN];
    let (list, overflow) = ctrl.changed_namespaces(clear);
    if overflow {
        put_u32(&mut page, 0, 0xffff_ffff);
    } else {
        for (i, nsid) in list
            .into_iter()
            .take(log::MAX_CHANGED_NAMESPACES)
            .enumerate()
        {
            put_u32(&mut page, i * 4, nsid);
        }
    }
    page
}

/// ANA log: a header, then one descriptor per group with its namespaces (unless only the
/// groups were asked for: RGO). The namespaces are those attached to this controller, as
/// the NVMe base specification has it: the ones hidden from its host are left out.
fn ana(ctrl: &Controller, groups_only: bool) -> Vec<u8> {
    let subsystem = &ctrl.subsystem;
    let mut namespaces = subsystem.namespaces();
    namespaces.retain(|ns| subsystem.is_visible_to(ns.nsid, &ctrl.hostnqn));
    let groups = subsystem.ana_groups();
    let change_count = subsystem.ana_change_count();
    let mut page = vec![0; ANA_HEADER_LEN];
    put_u64(&mut page, 0, change_count);
    put_u16(&mut page, 8, groups.len() as u16);
    for (group, state) in groups {
        let members: Vec<u32> = if groups_only {
            Vec::new()
        } else {
            namespaces
                .iter()
                .filter(|ns| ns.ana_group == group)
                .map(|ns| ns.nsid)
                .collect()
        };
        let at = page.len();
        page.resize(at + ANA_DESCRIPTOR_LEN + members.len() * 4, 0);
        put_u32(&mut page, at, group);
        put_u32(&mut page, at + 4, members.len() as u32);
        put_u64(&mut page, at + 8, change_count);
        page[at + 16] = state;
        for (i, nsid) in members.iter().enumerate() {
            put_u32(&mut page, at + ANA_DESCRIPTOR_LEN + i * 4, *nsid);
        }
    }
    page
}

/// The address a discovery entry gives for `listener`, with its ADRFAM. A wildcard listener
/// (0.0.0.0, ::) cannot be dialled, so the address the host reached this controller at is
/// listed instead when it came over the same transport (as Linux nvmet does); otherwise the
/// listener's own address. Addresses are listed in canonical text, as `nvme connect -a`
/// takes them: no brackets, no port, IPv6 compressed ("::1", not "0:0::1"), and an
/// IPv4-mapped address as the IPv4 address it is. Where nvmet lists a dual-stack [::]
/// port reached over IPv4 as ADRFAM IPv6 "::ffff:a.b.c.d", this lists IPv4 "a.b.c.d": the
/// address the host dialled, and one a host without IPv6 can dial too.
fn advertised_address(
    listener: &ListenerInfo,
    local: Option<(TransportType, IpAddr)>,
) -> (u8, String) {
    let configured = listener
        .address
        .trim_start_matches('[')
        .trim_end_matches(']')
        .parse::<IpAddr>()
        .ok();
    let ip = match (configured, local) {
        (Some(ip), Some((transport, dialled)))
            if ip.is_unspecified() && transport == listener.transport =>
        {
            Some(dialled)
        }
        (ip, _) => ip,
    };
    match ip.map(|ip| ip.to_canonical()) {
        Some(ip @ IpAddr::V4(_)) => (disc::ADRFAM_IP4, ip.to_string()),
        Some(ip @ IpAddr::V6(_)) => (disc::ADRFAM_IP6, ip.to_string()),
        // Not numeric (neither the file nor the control plane accepts that): as given.
        None if listener.address.contains(':') => (disc::ADRFAM_IP6, listener.address.clone()),
        None => (disc::ADRFAM_IP4, listener.address.clone()),
    }
}

/// A listener that takes TLS connections only: an NVMe/TCP listener the configuration or
/// the control plane marks secure (RDMA has no secure channel here).
fn is_secure_listener(target: &Target, listener: &ListenerInfo) -> bool {
    listener.transport == TransportType::Tcp
        && target
            .secure_listeners
            .is_secure(&listener.address, listener.port)
}

/// Whether `hostnqn` can connect to `subsystem` (None: the discovery subsystem) through
/// `listener`, which is what decides if the discovery log offers that pair. Linux nvmet
/// offers a subsystem only on the ports it is linked to; here every subsystem is on every
/// listener, so the pairs a Connect would refuse are left out instead, or `nvme
/// connect-all` tries them and prints an error for a path that was never usable:
/// - a subsystem that requires TLS, on a plain (or RDMA) listener: refused `tls_required`;
/// - any subsystem on a secure listener for a host without a PSK there: the handshake
///   finds no key ([`super::tls::tls_psk_for`]); for the discovery subsystem, a host with
///   no PSK in any subsystem, the same rule as the handshake's.
fn offered(
    target: &Target,
    subsystem: Option<&Subsystem>,
    listener: &ListenerInfo,
    hostnqn: &str,
) -> bool {
    let secure = is_secure_listener(target, listener);
    match subsystem {
        Some(s) if secure => s.tls.psk(hostnqn).is_some(),
        Some(s) => !s.tls.required(),
        None if secure => target
            .subsystems()
            .iter()
            .any(|s| s.tls.psk(hostnqn).is_some()),
        None => true,
    }
}

fn discovery_entry(
    page: &mut Vec<u8>,
    target: &Target,
    listener: &ListenerInfo,
    local: Option<(TransportType, IpAddr)>,
    subtype: u8,
    subnqn: &str,
) {
    let (adrfam, address) = advertised_address(listener, local);
    let at = page.len();
    page.resize(at + disc::ENTRY_LEN, 0);
    let entry = &mut page[at..];
    entry[0] = match listener.transport {
        TransportType::Tcp => disc::TRTYPE_TCP,
        TransportType::Rdma => disc::TRTYPE_RDMA,
    };
    entry[1] = adrfam;
    entry[2] = subtype;
    let secure = is_secure_listener(target, listener);
    let secure_channel = if secure {
        disc::TREQ_SECURE_CHANNEL_REQUIRED
    } else {
        disc::TREQ_SECURE_CHANNEL_NOT_SPECIFIED
    };
    entry[3] = secure_channel | disc::TREQ_DISABLE_SQFLOW;
    put_u16(entry, 4, listener.port_id);
    put_u16(entry, 6, crate::spec::cntlid::DYNAMIC);
    put_u16(entry, 8, 32); // ASQSZ: admin queue depth the host should use
    put_str(entry, 32, 32, &listener.port.to_string());
    put_str(entry, 256, NQN_FIELD_LEN, subnqn);
    put_str(entry, 512, 256, &address);
    match listener.transport {
        TransportType::Tcp if secure => entry[768] = disc::TCP_SECTYPE_TLS13,
        TransportType::Tcp => entry[768] = disc::TCP_SECTYPE_NONE,
        TransportType::Rdma => {
            entry[768] = disc::RDMA_QPTYPE_CONNECTED;
            entry[769] = disc::RDMA_PRTYPE_NOT_SPECIFIED;
            entry[770] = disc::RDMA_CMS_RDMA_CM;
        }
    }
}

/// Discovery log: every subsystem this host may connect to, on each listener it can connect
/// to it through, plus the discovery subsystem itself on each listener the host can reach it
/// on ([`offered`]). Every gateway of a group lists the group's listeners, so this holds for
/// the paths it names on other gateways too.
fn discovery_log(ctrl: &Controller) -> Vec<u8> {
    discovery_page(&ctrl.target, &ctrl.hostnqn, ctrl.local_address)
}

/// The discovery log page `hostnqn` gets from a discovery controller it reached at `local`
/// (the transport and address it dialled, for wildcard listeners).
pub fn discovery_page(
    target: &Target,
    hostnqn: &str,
    local: Option<(TransportType, IpAddr)>,
) -> Vec<u8> {
    let listeners = target.listeners();
    let mut page = vec![0; disc::HEADER_LEN];
    for listener in &listeners {
        if !offered(target, None, listener, hostnqn) {
            continue;
        }
        discovery_entry(
            &mut page,
            target,
            listener,
            local,
            disc::SUBTYPE_CURRENT_DISCOVERY,
            crate::spec::DISCOVERY_NQN,
        );
    }
    for subsystem in target.subsystems() {
        if !subsystem.allows_host(hostnqn) {
            continue;
        }
        for listener in &listeners {
            if !offered(target, Some(&subsystem), listener, hostnqn) {
                continue;
            }
            discovery_entry(
                &mut page,
                target,
                listener,
                local,
                disc::SUBTYPE_NVME,
                subsystem.nqn(),
            );
        }
    }
    let records = ((page.len() - disc::HEADER_LEN) / disc::ENTRY_LEN) as u64;
    put_u64(&mut page, 0, target.discovery_generation());
    put_u64(&mut page, 8, records);
    put_u16(&mut page, 16, 0); // RECFMT
    page
}
