//! Identify data structures (4096 bytes each), laid out as Linux's `struct nvme_id_ctrl`,
//! `struct nvme_id_ns`, `struct nvme_id_ns_cs_indep` and `struct nvme_ns_id_desc`.

use std::sync::Arc;

use super::controller::{Controller, MAX_OUTSTANDING_AERS};
use super::fabrics::NVME_VERSION;
use super::queue::{MAX_QUEUE_ENTRIES, MDTS_SHIFT};
use super::subsystem::Namespace;
use super::supported;
use super::wire::{put_u16, put_u32, put_u64};
use crate::spec::{aer, ctrl as c, nidt, ns as n, pr, CSI_NVM};

/// Composite temperature thresholds (Kelvin): WCTEMP and CCTEMP must be non-zero.
pub const WARNING_TEMPERATURE_KELVIN: u16 = 343;
pub const CRITICAL_TEMPERATURE_KELVIN: u16 = 373;
/// Keep Alive granularity in 100 ms units (KAS): Linux refuses a fabrics controller with 0.
const KEEP_ALIVE_SUPPORT_100MS: u16 = 10;
/// ANA Transition Time in seconds: the host waits twice this in the change state.
const ANA_TRANSITION_TIME_S: u8 = 10;
/// ANA groups a subsystem may have (ANAGRPMAX and NANAGRPID).
pub const MAX_ANA_GROUPS: u32 = 128;
/// Namespaces per subsystem (NN and MNAN): 0 < MNAN <= NN, or Linux refuses ANA.
pub const MAX_NAMESPACES: u32 = 1024;
/// Discovery controller type: direct discovery controller (`NVME_DCTYPE_DDC`).
const DCTYPE_DDC: u8 = 1;

/// What an Identify command returns.
pub enum IdentifyData {
    Controller,
    Namespace(Arc<Namespace>),
    NamespaceIndependent(Arc<Namespace>),
    ActiveNamespaces {
        after: u32,
    },
    Descriptors(Arc<Namespace>),
    /// An allocated-but-inactive namespace ID.
    Zeroes,
}

/// Writes `what` into `buf` (at least 4096 zeroed bytes).
pub fn fill(what: &IdentifyData, ctrl: &Controller, buf: &mut [u8]) {
    match what {
        IdentifyData::Controller => controller(ctrl, buf),
        IdentifyData::Namespace(ns) => namespace(ns, reservation_capabilities(ctrl), buf),
        IdentifyData::NamespaceIndependent(ns) => {
            namespace_independent(ns, reservation_capabilities(ctrl), buf)
        }
        IdentifyData::ActiveNamespaces { after } => active_namespaces(ctrl, *after, buf),
        IdentifyData::Descriptors(ns) => descriptors(ns, buf),
        IdentifyData::Zeroes => {}
    }
}

/// ASCII field padded with spaces (SN, MN, FR).
fn put_ascii_padded(buf: &mut [u8], at: usize, len: usize, s: &str) {
    let field = &mut buf[at..at + len];
    field.fill(b' ');
    for (dst, src) in field
        .iter_mut()
        .zip(s.bytes().filter(|b| b.is_ascii_graphic() || *b == b' '))
    {
        *dst = src;
    }
}

/// NUL-padded string field (SUBNQN).
fn put_c_string(buf: &mut [u8], at: usize, len: usize, s: &str) {
    let n = s.len().min(len - 1);
    buf[at..at + n].copy_from_slice(&s.as_bytes()[..n]);
}

fn controller(ctrl: &Controller, buf: &mut [u8]) {
    let subsystem = &ctrl.subsystem;
    let discovery = ctrl.is_discovery();
    put_ascii_padded(buf, 4, 20, &subsystem.spec.serial);
    put_ascii_padded(buf, 24, 40, &subsystem.spec.model);
    put_ascii_padded(buf, 64, 8, &ctrl.target.identity.firmware);
    buf[72] = 6; // RAB
    if !discovery {
        buf[76] = c::CMIC_MULTI_PORT | c::CMIC_MULTI_CTRL | c::CMIC_ANA;
    }
    buf[77] = MDTS_SHIFT;
    put_u16(buf, 78, ctrl.cntlid);
    put_u32(buf, 80, NVME_VERSION);
    let oaes = if discovery {
        aer::CFG_DISC_CHANGE
    } else {
        aer::CFG_NS_ATTR | aer::CFG_ANA_CHANGE
    };
    put_u32(buf, 92, oaes);
    put_u32(buf, 96, c::CTRATT_128_ID);
    buf[111] = if discovery {
        c::TYPE_DISCOVERY
    } else {
        c::TYPE_IO
    };
    buf[258] = 3; // ACL: four outstanding Abort commands (0's based)
    buf[259] = (MAX_OUTSTANDING_AERS - 1) as u8; // AERL
    buf[260] = 0b011; // FRMW: slot 1 read-only, one slot
                      // LPA: commands supported and effects, extended data (offsets), supported log pages.
    buf[261] = c::LPA_CMD_EFFECTS_LOG | (1 << 2) | c::LPA_SUPPORTED_LOG_PAGES;
    put_u16(buf, 266, WARNING_TEMPERATURE_KELVIN);
    put_u16(buf, 268, CRITICAL_TEMPERATURE_KELVIN);
    put_u16(buf, 320, KEEP_ALIVE_SUPPORT_100MS);
    if !discovery {
        buf[342] = ANA_TRANSITION_TIME_S;
        buf[343] = c::ANACAP_OPTIMIZED
            | c::ANACAP_NON_OPTIMIZED
            | c::ANACAP_INACCESSIBLE
            | c::ANACAP_PERSISTENT_LOSS
            | c::ANACAP_CHANGE;
        put_u32(buf, 344, MAX_ANA_GROUPS);
        put_u32(buf, 348, MAX_ANA_GROUPS);
    }
    buf[512] = 0x66; // SQES: 64-byte entries
    buf[513] = 0x44; // CQES: 16-byte entries
    put_u16(buf, 514, MAX_QUEUE_ENTRIES as u16); // MAXCMD
    if !discovery {
        put_u32(buf, 516, MAX_NAMESPACES); // NN
        put_u16(buf, 520, supported::oncs(&ctrl.target));
        put_u16(buf, 522, supported::fuses(&ctrl.target));
        buf[525] = c::VWC_PRESENT | c::VWC_NO_BROADCAST_FLUSH;
        put_u32(buf, 540, MAX_NAMESPACES); // MNAN
    }
    let mut sgls = c::SGLS_SUPPORTED;
    if ctrl.transport.keyed_sgls {
        sgls |= c::SGLS_KEYED;
    }
    if ctrl.transport.in_capsule_data_size > 0 {
        sgls |= c::SGLS_SAOS;
    }
    put_u32(buf, 536, sgls);
    put_c_string(buf, 768, 256, subsystem.nqn());
    // Fabrics: capsule sizes in 16-byte units, in-capsule data offset, dynamic model,
    // one SGL descriptor per command, Disconnect supported.
    put_u32(buf, 1792, (64 + ctrl.transport.in_capsule_data_size) / 16);
    put_u32(buf, 1796, 1);
    put_u16(buf, 1800, 0);
    buf[1802] = 0;
    buf[1803] = 1;
    put_u16(buf, 1804, c::OFCS_DISCONNECT);
    if discovery {
        buf[1806] = DCTYPE_DDC;
    }
    // Power state 0: 25 W, nominal latencies (centiwatts, microseconds).
    put_u16(buf, 2048, 2500);
    put_u32(buf, 2052, 16);
    put_u32(buf, 2056, 4);
}

/// RESCAP: every reservation type, IEKEY as NVMe 1.3 defines it, no persistence through
/// power loss; nothing when the gateway offers no reservations.
fn reservation_capabilities(ctrl: &Controller) -> u8 {
    if !ctrl.target.reservations_enabled() {
        return 0;
    }
    let types = (pr::WRITE_EXCLUSIVE..=pr::EXCLUSIVE_ACCESS_ALL_REGS).fold(0, |m, t| m | (1 << t));
    types | pr::RESCAP_IEKEY_VER_1_3_DEF
}

fn namespace(ns: &Namespace, rescap: u8, buf: &mut [u8]) {
    let lbas = ns.size_in_lbas();
    put_u64(buf, 0, lbas); // NSZE
    put_u64(buf, 8, lbas); // NCAP
    put_u64(buf, 16, lbas); // NUSE
    buf[24] = n::FEAT_THIN;
    buf[25] = 0; // NLBAF: one format (0's based)
    buf[26] = 0; // FLBAS: format 0, no metadata
    buf[30] = n::NMIC_SHARED;
    buf[31] = rescap;
    buf[33] = n::DLFEAT_READ_ZEROES | n::DLFEAT_WRITE_ZEROES_DEAC;
    put_u32(buf, 92, ns.ana_group);
    if ns.read_only {
        buf[99] = n::ATTR_RO;
    }
    buf[104..120].copy_from_slice(&ns.nguid);
    // LBA format 0: no metadata, 2^lba_shift bytes, best performance.
    put_u16(buf, 128, 0);
    buf[130] = ns.lba_shift;
    buf[131] = 0;
}

fn namespace_independent(ns: &Namespace, rescap: u8, buf: &mut [u8]) {
    buf[0] = n::FEAT_THIN;
    buf[1] = n::NMIC_SHARED;
    buf[2] = rescap;
    put_u32(buf, 4, ns.ana_group);
    if ns.read_only {
        buf[8] = n::ATTR_RO;
    }
    buf[14] = 1; // NSTAT: namespace ready
}

/// The NSIDs above `after` active for this controller's host (see `core::visibility`).
fn active_namespaces(ctrl: &Controller, after: u32, buf: &mut [u8]) {
    let ids = ctrl
        .subsystem
        .active_nsids_for_host(&ctrl.hostnqn, after, buf.len() / 4);
    for (i, id) in ids.into_iter().enumerate() {
        put_u32(buf, i * 4, id);
    }
}

fn descriptors(ns: &Namespace, buf: &mut [u8]) {
    let mut at = 0;
    let mut put = |kind: u8, id: &[u8]| {
        buf[at] = kind;
        buf[at + 1] = id.len() as u8;
        buf[at + 4..at + 4 + id.len()].copy_from_slice(id);
        at += 4 + id.len();
    };
    put(nidt::NGUID, &ns.nguid);
    put(nidt::UUID, &ns.uuid);
    put(nidt::CSI, &[CSI_NVM]);
}
