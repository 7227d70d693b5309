//! Constants from the NVMe Base / NVMe-oF specifications, named and valued as in Linux's
//! `include/linux/nvme.h` so each can be checked against that file.

/// Well-known discovery subsystem NQN (`NVME_DISC_SUBSYS_NAME`).
pub const DISCOVERY_NQN: &str = "nqn.2014-08.org.nvmexpress.discovery";
/// Length of an NQN field in commands and log pages (`NVMF_NQN_FIELD_LEN`).
pub const NQN_FIELD_LEN: usize = 256;
/// Longest valid NQN (`NVMF_NQN_SIZE`).
pub const NQN_MAX_LEN: usize = 223;
pub const NSID_ALL: u32 = 0xffff_ffff;
pub const IDENTIFY_DATA_SIZE: usize = 4096;

/// Controller IDs (`NVME_CNTLID_*`).
pub mod cntlid {
    pub const MIN: u16 = 1;
    pub const MAX: u16 = 0xffef;
    /// Static model: the host lets the target pick any controller.
    pub const STATIC_ANY: u16 = 0xfffe;
    pub const DYNAMIC: u16 = 0xffff;
}

/// Admin command opcodes (`enum nvme_admin_opcode`).
pub mod admin_opcode {
    pub const DELETE_SQ: u8 = 0x00;
    pub const CREATE_SQ: u8 = 0x01;
    pub const GET_LOG_PAGE: u8 = 0x02;
    pub const DELETE_CQ: u8 = 0x04;
    pub const CREATE_CQ: u8 = 0x05;
    pub const IDENTIFY: u8 = 0x06;
    pub const ABORT: u8 = 0x08;
    pub const SET_FEATURES: u8 = 0x09;
    pub const GET_FEATURES: u8 = 0x0a;
    pub const ASYNC_EVENT: u8 = 0x0c;
    pub const KEEP_ALIVE: u8 = 0x18;
}

/// NVM command set I/O opcodes (`enum nvme_opcode`).
pub mod io_opcode {
    pub const FLUSH: u8 = 0x00;
    pub const WRITE: u8 = 0x01;
    pub const READ: u8 = 0x02;
    pub const COMPARE: u8 = 0x05;
    pub const WRITE_ZEROES: u8 = 0x08;
    pub const DSM: u8 = 0x09;
    pub const RESV_REGISTER: u8 = 0x0d;
    pub const RESV_REPORT: u8 = 0x0e;
    pub const RESV_ACQUIRE: u8 = 0x11;
    pub const RESV_RELEASE: u8 = 0x15;
}

/// Reservations (NVMe Base 2.0 section 8.19): command fields, types, notices
/// (`enum nvme_pr_type`, `NVME_PR_*` in Linux's `include/linux/nvme.h`).
pub mod pr {
    /// CDW10 bits 2:0 of Register, Acquire and Release: the action.
    pub const ACTION_MASK: u32 = 0x7;
    /// Reservation Register actions (RREGA).
    pub const REGISTER_ACT_REG: u32 = 0;
    pub const REGISTER_ACT_UNREG: u32 = 1;
    pub const REGISTER_ACT_REPLACE: u32 = 2;
    /// Reservation Acquire actions (RACQA).
    pub const ACQUIRE_ACT_ACQUIRE: u32 = 0;
    pub const ACQUIRE_ACT_PREEMPT: u32 = 1;
    pub const ACQUIRE_ACT_PREEMPT_AND_ABORT: u32 = 2;
    /// Reservation Release actions (RRELA).
    pub const RELEASE_ACT_RELEASE: u32 = 0;
    pub const RELEASE_ACT_CLEAR: u32 = 1;
    /// CDW10 bit 3: ignore the current key (IEKEY).
    pub const IGNORE_KEY: u32 = 1 << 3;
    /// CDW10 bits 15:8 of Acquire and Release: the reservation type (RTYPE).
    pub const RTYPE_SHIFT: u32 = 8;
    /// Reservation types.
    pub const WRITE_EXCLUSIVE: u8 = 1;
    pub const EXCLUSIVE_ACCESS: u8 = 2;
    pub const WRITE_EXCLUSIVE_REG_ONLY: u8 = 3;
    pub const EXCLUSIVE_ACCESS_REG_ONLY: u8 = 4;
    pub const WRITE_EXCLUSIVE_ALL_REGS: u8 = 5;
    pub const EXCLUSIVE_ACCESS_ALL_REGS: u8 = 6;
    /// Reservation Report CDW11 bit 0: the extended data structure (128-bit host IDs).
    pub const EXTENDED_DATA_STRUCT: u32 = 1 << 0;
    /// Identify Namespace RESCAP (`enum nvme_pr_capabilities`): bit n for type n (1..=6),
    /// bit 0 persist through power loss, bit 7 IEKEY as NVMe 1.3 defines it.
    pub const RESCAP_PTPL: u8 = 1 << 0;
    pub const RESCAP_IEKEY_VER_1_3_DEF: u8 = 1 << 7;
    /// Reservation Notification log entry types (`NVME_PR_LOG_*`).
    pub const LOG_EMPTY: u8 = 0;
    pub const LOG_REGISTRATION_PREEMPTED: u8 = 1;
    pub const LOG_RESERVATION_RELEASED: u8 = 2;
    pub const LOG_RESERVATION_PREEMPTED: u8 = 3;
    /// Reservation Notification Mask feature bits (a set bit suppresses that notice).
    pub const NOTIFY_MASK_REG_PREEMPTED: u32 = 1 << 1;
    pub const NOTIFY_MASK_RESV_RELEASED: u32 = 1 << 2;
    pub const NOTIFY_MASK_RESV_PREEMPTED: u32 = 1 << 3;
}

/// The fabrics opcode and its command types (`nvmf_capsule_command`).
pub mod fabrics {
    pub const OPCODE: u8 = 0x7f;
    pub const PROPERTY_SET: u8 = 0x00;
    pub const CONNECT: u8 = 0x01;
    pub const PROPERTY_GET: u8 = 0x04;
    pub const AUTH_SEND: u8 = 0x05;
    pub const AUTH_RECEIVE: u8 = 0x06;
    /// Disconnect (NVMe Base 2.0, fabrics command type 08h).
    pub const DISCONNECT: u8 = 0x08;
    /// Connect CATTR bit 2: the host asks to disable SQ flow control
    /// (`NVME_CONNECT_DISABLE_SQFLOW`).
    pub const CONNECT_DISABLE_SQFLOW: u8 = 1 << 2;
    /// SQHD of a Connect response that accepts disabling SQ flow control (Linux nvmet's
    /// `nvmet_install_queue`): later completions carry no SQ head.
    pub const SQHD_FLOW_CONTROL_DISABLED: u16 = 0xffff;
    /// Connect response dword 0 bit 17: the queue must authenticate before other commands
    /// (`NVME_CONNECT_AUTHREQ_ATR`).
    pub const CONNECT_AUTHREQ_ATR: u32 = 1 << 17;
    /// Connect response dword 0 bit 18: secure channel concatenation required
    /// (`NVME_CONNECT_AUTHREQ_ASCR`; never set here: Linux 6.12 hosts refuse to connect).
    pub const CONNECT_AUTHREQ_ASCR: u32 = 1 << 18;
}

/// In-band authentication's constants (they live with the DH-HMAC-CHAP code).
pub use nvme_auth::ids as auth;

/// Command dword 0 FUSE field (`NVME_CMD_FUSE_*`).
pub mod fuse {
    pub const MASK: u8 = 0x3;
    pub const FIRST: u8 = 1 << 0;
    pub const SECOND: u8 = 1 << 1;
}

/// Property (controller register) offsets (`NVME_REG_*`).
pub mod reg {
    pub const CAP: u32 = 0x0000;
    pub const VS: u32 = 0x0008;
    pub const CC: u32 = 0x0014;
    pub const CSTS: u32 = 0x001c;
    pub const NSSR: u32 = 0x0020;
    pub const CRTO: u32 = 0x0068;
}

/// CC register bits (`NVME_CC_*`).
pub mod cc {
    pub const ENABLE: u32 = 1 << 0;
    pub const CSS_SHIFT: u32 = 4;
    pub const CSS_MASK: u32 = 7 << CSS_SHIFT;
    pub const CSS_NVM: u32 = 0;
    pub const MPS_SHIFT: u32 = 7;
    pub const MPS_MASK: u32 = 0xf << MPS_SHIFT;
    pub const AMS_SHIFT: u32 = 11;
    pub const AMS_MASK: u32 = 7 << AMS_SHIFT;
    pub const SHN_SHIFT: u32 = 14;
    pub const SHN_MASK: u32 = 3 << SHN_SHIFT;
    /// `NVME_CC_SHN_ABRUPT` (`NVME_CC_SHN_NORMAL` is 1 << 14).
    pub const SHN_ABRUPT: u32 = 2 << SHN_SHIFT;
    pub const IOSQES_SHIFT: u32 = 16;
    pub const IOSQES_MASK: u32 = 0xf << IOSQES_SHIFT;
    pub const IOCQES_SHIFT: u32 = 20;
    pub const IOCQES_MASK: u32 = 0xf << IOCQES_SHIFT;
    /// Submission/completion entry sizes as powers of two (`NVME_NVM_IOSQES`, `IOCQES`).
    pub const NVM_IOSQES: u32 = 6;
    pub const NVM_IOCQES: u32 = 4;
}

/// CSTS register bits (`NVME_CSTS_*`).
pub mod csts {
    pub const RDY: u32 = 1 << 0;
    pub const CFS: u32 = 1 << 1;
    pub const SHST_OCCUR: u32 = 1 << 2;
    pub const SHST_CMPLT: u32 = 2 << 2;
    pub const SHST_MASK: u32 = 3 << 2;
}

/// Identify CNS values (`NVME_ID_CNS_*`).
pub mod cns {
    pub const NS: u8 = 0x00;
    pub const CTRL: u8 = 0x01;
    pub const NS_ACTIVE_LIST: u8 = 0x02;
    pub const NS_DESC_LIST: u8 = 0x03;
    pub const CS_NS: u8 = 0x05;
    pub const CS_CTRL: u8 = 0x06;
    pub const NS_ACTIVE_LIST_CS: u8 = 0x07;
    pub const NS_CS_INDEP: u8 = 0x08;
}

/// Command set identifiers (`NVME_CSI_*`).
pub const CSI_NVM: u8 = 0;

/// Namespace identification descriptor types (`NVME_NIDT_*`).
pub mod nidt {
    pub const EUI64: u8 = 0x01;
    pub const NGUID: u8 = 0x02;
    pub const UUID: u8 = 0x03;
    pub const CSI: u8 = 0x04;
}

/// Log page identifiers (`NVME_LOG_*`).
pub mod log {
    pub const SUPPORTED: u8 = 0x00;
    pub const ERROR: u8 = 0x01;
    pub const SMART: u8 = 0x02;
    pub const FW_SLOT: u8 = 0x03;
    pub const CHANGED_NS: u8 = 0x04;
    pub const CMD_EFFECTS: u8 = 0x05;
    pub const ANA: u8 = 0x0c;
    pub const DISC: u8 = 0x70;
    /// Reservation Notification (`NVME_LOG_RESERVATION`).
    pub const RESERVATION: u8 = 0x80;
    /// ANA log specific field: return groups only (`NVME_ANA_LOG_RGO`).
    pub const ANA_LSP_RGO: u8 = 1 << 0;
    /// Supported log pages entry: LSUPP (`NVME_LIDS_LSUPP`).
    pub const LIDS_LSUPP: u32 = 1 << 0;
    /// Most namespaces listed in the Changed Namespace List (`NVME_MAX_CHANGED_NAMESPACES`).
    pub const MAX_CHANGED_NAMESPACES: usize = 1024;
}

/// Commands Supported and Effects bits (`NVME_CMD_EFFECTS_*`).
pub mod effects {
    pub const CSUPP: u32 = 1 << 0;
    pub const LBCC: u32 = 1 << 1;
    pub const NCC: u32 = 1 << 2;
    pub const NIC: u32 = 1 << 3;
    pub const CCC: u32 = 1 << 4;
}

/// Feature identifiers (`NVME_FEAT_*`).
pub mod feat {
    pub const ARBITRATION: u8 = 0x01;
    pub const POWER_MGMT: u8 = 0x02;
    pub const TEMP_THRESH: u8 = 0x04;
    pub const ERR_RECOVERY: u8 = 0x05;
    pub const VOLATILE_WC: u8 = 0x06;
    pub const NUM_QUEUES: u8 = 0x07;
    pub const IRQ_COALESCE: u8 = 0x08;
    pub const IRQ_CONFIG: u8 = 0x09;
    pub const WRITE_ATOMIC: u8 = 0x0a;
    pub const ASYNC_EVENT: u8 = 0x0b;
    pub const KATO: u8 = 0x0f;
    pub const HOST_ID: u8 = 0x81;
    /// Reservation Notification Mask (`NVME_FEAT_RESV_MASK`).
    pub const RESV_MASK: u8 = 0x82;
    /// Reservation Persistence (`NVME_FEAT_RESV_PERSIST`).
    pub const RESV_PERSIST: u8 = 0x83;
}

/// Asynchronous event types, infos and enable bits (`NVME_AER_*`, `NVME_AEN_*`).
pub mod aer {
    pub const TYPE_NOTICE: u8 = 2;
    /// I/O command specific status (`NVME_AER_CSS`), whose info 0 is "reservation log page
    /// available" (`NVME_AEN_RESV_LOG_PAGE_AVALIABLE`).
    pub const TYPE_CSS: u8 = 6;
    pub const CSS_RESV_LOG_PAGE_AVAILABLE: u8 = 0x00;
    pub const NOTICE_NS_CHANGED: u8 = 0x00;
    pub const NOTICE_ANA: u8 = 0x03;
    pub const NOTICE_DISC_CHANGED: u8 = 0xf0;
    pub const CFG_NS_ATTR: u32 = 1 << 8;
    pub const CFG_ANA_CHANGE: u32 = 1 << 11;
    pub const CFG_DISC_CHANGE: u32 = 1 << 31;
}

/// ANA states (`enum nvme_ana_state`).
pub mod ana {
    pub const OPTIMIZED: u8 = 0x01;
    pub const NON_OPTIMIZED: u8 = 0x02;
    pub const INACCESSIBLE: u8 = 0x03;
    pub const PERSISTENT_LOSS: u8 = 0x04;
    pub const CHANGE: u8 = 0x0f;
}

/// Identify Controller bit fields (`NVME_CTRL_*`).
pub mod ctrl {
    pub const CMIC_MULTI_PORT: u8 = 1 << 0;
    pub const CMIC_MULTI_CTRL: u8 = 1 << 1;
    pub const CMIC_ANA: u8 = 1 << 3;
    pub const ONCS_COMPARE: u16 = 1 << 0;
    pub const ONCS_DSM: u16 = 1 << 2;
    pub const ONCS_WRITE_ZEROES: u16 = 1 << 3;
    pub const ONCS_RESERVATIONS: u16 = 1 << 5;
    pub const VWC_PRESENT: u8 = 1 << 0;
    /// VWC bits 2:1 = 10b: the Flush command does not support NSID FFFFFFFFh.
    pub const VWC_NO_BROADCAST_FLUSH: u8 = 0b10 << 1;
    pub const FUSES_COMPARE_AND_WRITE: u16 = 1 << 0;
    pub const LPA_CMD_EFFECTS_LOG: u8 = 1 << 1;
    /// LPA bit 5: Supported Log Pages and Feature Identifiers Supported pages.
    pub const LPA_SUPPORTED_LOG_PAGES: u8 = 1 << 5;
    pub const CTRATT_128_ID: u32 = 1 << 0;
    pub const SGLS_SUPPORTED: u32 = 1 << 0;
    pub const SGLS_KEYED: u32 = 1 << 2;
    /// SGL address may specify an offset: needed for in-capsule data (`NVME_CTRL_SGLS_SAOS`).
    pub const SGLS_SAOS: u32 = 1 << 20;
    /// CNTRLTYPE values (`enum nvme_ctrl_type`).
    pub const TYPE_IO: u8 = 1;
    pub const TYPE_DISCOVERY: u8 = 2;
    /// OFCS bit 0: Disconnect command supported.
    pub const OFCS_DISCONNECT: u16 = 1 << 0;
    /// ANACAP bits: reporting optimized, non-optimized, inaccessible, persistent loss,
    /// change states; bit 6: ANAGRPID does not change while the namespace is attached.
    pub const ANACAP_OPTIMIZED: u8 = 1 << 0;
    pub const ANACAP_NON_OPTIMIZED: u8 = 1 << 1;
    pub const ANACAP_INACCESSIBLE: u8 = 1 << 2;
    pub const ANACAP_PERSISTENT_LOSS: u8 = 1 << 3;
    pub const ANACAP_CHANGE: u8 = 1 << 4;
}

/// Identify Namespace bit fields (`NVME_NS_*`).
pub mod ns {
    pub const FEAT_THIN: u8 = 1 << 0;
    pub const NMIC_SHARED: u8 = 1 << 0;
    pub const ATTR_RO: u8 = 1 << 0;
    /// DLFEAT bits 2:0 = 001b: deallocated blocks read as zeroes.
    pub const DLFEAT_READ_ZEROES: u8 = 0b001;
    /// DLFEAT bit 3: the Deallocate bit of Write Zeroes is supported.
    pub const DLFEAT_WRITE_ZEROES_DEAC: u8 = 1 << 3;
}

/// I/O command fields.
pub mod rw {
    /// Force Unit Access, CDW12 bit 30 (`NVME_RW_FUA` in the upper 16-bit control half).
    pub const CDW12_FUA: u32 = 1 << 30;
    /// Dataset Management attribute: deallocate (`NVME_DSMGMT_AD`).
    pub const DSM_AD: u32 = 1 << 2;
    /// Bytes per DSM range (`struct nvme_dsm_range`).
    pub const DSM_RANGE_LEN: usize = 16;
    pub const DSM_MAX_RANGES: usize = 256;
}

/// SGL descriptor types and subtypes (`NVME_SGL_FMT_*`, `NVME_*_DESC`).
pub mod sgl {
    pub const FMT_ADDRESS: u8 = 0x00;
    pub const FMT_OFFSET: u8 = 0x01;
    pub const FMT_TRANSPORT_A: u8 = 0x0a;
    pub const FMT_INVALIDATE: u8 = 0x0f;
    pub const DATA_DESC: u8 = 0x00;
    pub const KEYED_DATA_DESC: u8 = 0x04;
    pub const TRANSPORT_DATA_DESC: u8 = 0x05;
}

/// Discovery log page constants.
pub mod disc {
    pub const HEADER_LEN: usize = 1024;
    pub const ENTRY_LEN: usize = 1024;
    /// SUBTYPE (`enum nvme_subsys_type`).
    pub const SUBTYPE_REFERRAL: u8 = 1;
    pub const SUBTYPE_NVME: u8 = 2;
    pub const SUBTYPE_CURRENT_DISCOVERY: u8 = 3;
    /// TRTYPE (`NVMF_TRTYPE_*`).
    pub const TRTYPE_RDMA: u8 = 1;
    pub const TRTYPE_TCP: u8 = 3;
    /// ADRFAM (`NVMF_ADDR_FAMILY_*`).
    pub const ADRFAM_IP4: u8 = 1;
    pub const ADRFAM_IP6: u8 = 2;
    /// TREQ bits 1:0, secure channel: not specified (`NVMF_TREQ_NOT_SPECIFIED`). Not
    /// "not required" (`NVMF_TREQ_NOT_REQUIRED` = 2): that says TLS is on offer, and
    /// libnvme's `connect-all` then asked the kernel for TLS and failed against a target
    /// without it (linux-nvme/libnvme issue 612). Linux nvmet reports "not specified" too.
    pub const TREQ_SECURE_CHANNEL_NOT_SPECIFIED: u8 = 0;
    /// TREQ bit 2: the controller can disable SQ flow control (`NVMF_TREQ_DISABLE_SQFLOW`);
    /// `nvme connect-all` then connects with `disable_sqflow`. Linux nvmet sets it by default.
    pub const TREQ_DISABLE_SQFLOW: u8 = 1 << 2;
    /// TREQ bits 1:0, secure channel required (`NVMF_TREQ_REQUIRED`): a secure listener,
    /// which takes TLS connections only. Linux's `nvme discover` prints "required" and
    /// `connect-all` then connects with TLS.
    pub const TREQ_SECURE_CHANNEL_REQUIRED: u8 = 1;
    /// TSAS for TCP: no security (`NVMF_TCP_SECTYPE_NONE`).
    pub const TCP_SECTYPE_NONE: u8 = 0;
    /// TSAS for TCP: TLS 1.3 (`NVMF_TCP_SECTYPE_TLS13`, NVMe/TCP 3.6.1.1).
    pub const TCP_SECTYPE_TLS13: u8 = 2;
    /// RDMA TSAS values (`NVMF_RDMA_*`).
    pub const RDMA_QPTYPE_CONNECTED: u8 = 1;
    pub const RDMA_PRTYPE_NOT_SPECIFIED: u8 = 1;
    pub const RDMA_CMS_RDMA_CM: u8 = 1;
}

/// Status codes: (SCT << 8) | SC, as in Linux's `NVME_SC_*`.
pub mod sc {
    pub const SUCCESS: u16 = 0x0;
    pub const INVALID_OPCODE: u16 = 0x1;
    pub const INVALID_FIELD: u16 = 0x2;
    pub const CMDID_CONFLICT: u16 = 0x3;
    pub const DATA_XFER_ERROR: u16 = 0x4;
    pub const INTERNAL: u16 = 0x6;
    pub const ABORT_REQ: u16 = 0x7;
    pub const ABORT_QUEUE: u16 = 0x8;
    pub const FUSED_FAIL: u16 = 0x9;
    pub const FUSED_MISSING: u16 = 0xa;
    pub const INVALID_NS: u16 = 0xb;
    pub const CMD_SEQ_ERROR: u16 = 0xc;
    pub const SGL_INVALID_DATA: u16 = 0xf;
    pub const SGL_INVALID_TYPE: u16 = 0x11;
    pub const SGL_INVALID_OFFSET: u16 = 0x16;
    pub const LBA_RANGE: u16 = 0x80;
    pub const QID_INVALID: u16 = 0x101;
    pub const QUEUE_SIZE: u16 = 0x102;
    pub const ASYNC_LIMIT: u16 = 0x105;
    pub const INVALID_LOG_PAGE: u16 = 0x109;
    pub const FEATURE_NOT_SAVEABLE: u16 = 0x10d;
    pub const READ_ONLY: u16 = 0x182;
    pub const CONNECT_FORMAT: u16 = 0x180;
    pub const CONNECT_CTRL_BUSY: u16 = 0x181;
    pub const CONNECT_INVALID_PARAM: u16 = 0x182;
    pub const CONNECT_INVALID_HOST: u16 = 0x184;
    /// A reservation refuses the command, or the key does not match
    /// (`NVME_SC_RESERVATION_CONFLICT`).
    pub const RESERVATION_CONFLICT: u16 = 0x83;
    /// Reservation Report without the extended data structure, where host IDs are 128-bit
    /// (`NVME_SC_HOST_ID_INCONSIST`).
    pub const HOST_ID_INCONSIST: u16 = 0x18;
    /// A command other than Authentication Send / Receive on a queue that has not
    /// authenticated (`NVME_SC_AUTH_REQUIRED`).
    pub const AUTH_REQUIRED: u16 = 0x191;
    pub const WRITE_FAULT: u16 = 0x280;
    pub const READ_ERROR: u16 = 0x281;
    pub const COMPARE_FAILED: u16 = 0x285;
    pub const ANA_PERSISTENT_LOSS: u16 = 0x301;
    pub const ANA_INACCESSIBLE: u16 = 0x302;
    pub const ANA_TRANSITION: u16 = 0x303;
    /// Do Not Retry (`NVME_STATUS_DNR`).
    pub const DNR: u16 = 0x4000;
}

/// `NVME_VS(major, minor, tertiary)`.
pub const fn version(major: u32, minor: u32, tertiary: u32) -> u32 {
    (major << 16) | (minor << 8) | tertiary
}
