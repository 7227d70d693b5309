//! Submission queue entry builders, completion parsing and the few NVMe /
//! NVMe-oF constants the initiator needs (values from the NVMe base and
//! fabrics specifications, as laid out in Linux `include/linux/nvme.h`).
//!
//! Kept local to the host side on purpose: the initiator is a test and
//! benchmark tool and must not share encoding bugs with the target.

/// Size of an SQE.
pub const SQE_LEN: usize = 64;
/// Size of a CQE.
pub const CQE_LEN: usize = 16;
/// Size of Identify data.
pub const IDENTIFY_LEN: usize = 4096;
/// Size of the Connect command data.
pub const CONNECT_DATA_LEN: usize = 1024;
/// NQN fields are 256 bytes.
pub const NQN_FIELD_LEN: usize = 256;
/// Well-known discovery subsystem NQN.
pub const DISCOVERY_NQN: &str = "nqn.2014-08.org.nvmexpress.discovery";
/// Connect: let the controller allocate the controller ID.
pub const CNTLID_DYNAMIC: u16 = 0xffff;
/// Command capsule size of the NVMe/TCP admin queue (8 KiB).
pub const TCP_ADMIN_CCSZ: usize = 8192;

/// Admin opcodes.
pub mod admin {
    /// Get Log Page.
    pub const GET_LOG_PAGE: u8 = 0x02;
    /// Identify.
    pub const IDENTIFY: u8 = 0x06;
    /// Set Features.
    pub const SET_FEATURES: u8 = 0x09;
    /// Get Features.
    pub const GET_FEATURES: u8 = 0x0a;
    /// Asynchronous Event Request.
    pub const ASYNC_EVENT: u8 = 0x0c;
    /// Keep Alive.
    pub const KEEP_ALIVE: u8 = 0x18;
}

/// NVM command set I/O opcodes.
pub mod io {
    /// Flush.
    pub const FLUSH: u8 = 0x00;
    /// Write.
    pub const WRITE: u8 = 0x01;
    /// Read.
    pub const READ: u8 = 0x02;
    /// Compare.
    pub const COMPARE: u8 = 0x05;
    /// Write Zeroes.
    pub const WRITE_ZEROES: u8 = 0x08;
    /// Dataset Management.
    pub const DSM: u8 = 0x09;
}

/// Fabrics command opcode and command types (FCTYPE).
pub mod fabrics {
    /// Fabrics command opcode.
    pub const OPCODE: u8 = 0x7f;
    /// Property Set.
    pub const PROPERTY_SET: u8 = 0x00;
    /// Connect.
    pub const CONNECT: u8 = 0x01;
    /// Property Get.
    pub const PROPERTY_GET: u8 = 0x04;
    /// Authentication Send.
    pub const AUTH_SEND: u8 = 0x05;
    /// Authentication Receive.
    pub const AUTH_RECEIVE: u8 = 0x06;
    /// Connect CATTR bit 2, disable SQ flow control (`NVME_CONNECT_DISABLE_SQFLOW`).
    pub const CONNECT_DISABLE_SQFLOW: u8 = 1 << 2;
    /// Connect response dword 0 bit 17: authenticate this queue (`NVME_CONNECT_AUTHREQ_ATR`).
    pub const CONNECT_AUTHREQ_ATR: u32 = 1 << 17;
    /// SECP of DH-HMAC-CHAP Authentication Send/Receive, and its SPSP0/SPSP1.
    pub const AUTH_SECP_DHCHAP: u8 = 0xe9;
    pub const AUTH_SPSP: u8 = 0x01;
}

/// SQHD of a Connect response granting that SQ flow control be disabled.
pub const SQHD_FLOW_CONTROL_DISABLED: u16 = 0xffff;

/// Controller property offsets.
pub mod prop {
    /// Controller Capabilities (8 bytes).
    pub const CAP: u32 = 0x00;
    /// Version.
    pub const VS: u32 = 0x08;
    /// Controller Configuration.
    pub const CC: u32 = 0x14;
    /// Controller Status.
    pub const CSTS: u32 = 0x1c;
}

/// CC / CSTS bits.
pub mod cc {
    /// CC.EN.
    pub const EN: u32 = 1 << 0;
    /// CC.SHN = normal shutdown.
    pub const SHN_NORMAL: u32 = 1 << 14;
    /// CC.IOSQES = 6 (64-byte SQEs).
    pub const IOSQES_64: u32 = 6 << 16;
    /// CC.IOCQES = 4 (16-byte CQEs).
    pub const IOCQES_16: u32 = 4 << 20;
    /// CSTS.RDY.
    pub const CSTS_RDY: u32 = 1 << 0;
    /// CSTS.CFS.
    pub const CSTS_CFS: u32 = 1 << 1;
    /// CSTS.SHST mask.
    pub const CSTS_SHST_MASK: u32 = 3 << 2;
    /// CSTS.SHST = shutdown processing complete.
    pub const CSTS_SHST_CMPLT: u32 = 2 << 2;
}

/// Identify CNS values.
pub mod cns {
    /// Identify Namespace.
    pub const NS: u8 = 0x00;
    /// Identify Controller.
    pub const CTRL: u8 = 0x01;
    /// Active Namespace ID list.
    pub const NS_ACTIVE_LIST: u8 = 0x02;
    /// Namespace Identification Descriptor list.
    pub const NS_DESC_LIST: u8 = 0x03;
}

/// Log page identifiers.
pub mod log {
    /// Error Information.
    pub const ERROR: u8 = 0x01;
    /// SMART / Health Information.
    pub const SMART: u8 = 0x02;
    /// Changed Namespace List.
    pub const CHANGED_NS: u8 = 0x04;
    /// Discovery.
    pub const DISCOVERY: u8 = 0x70;
}

/// SQE flags byte (CDW0 bits 15:8).
pub mod sqe_flags {
    /// FUSE: first command of a fused operation.
    pub const FUSE_FIRST: u8 = 1 << 0;
    /// FUSE: second command of a fused operation.
    pub const FUSE_SECOND: u8 = 1 << 1;
    /// PSDT: SGLs are used for the data transfer.
    pub const PSDT_SGL: u8 = 1 << 6;
}

/// SGL descriptor identifier bytes (type << 4 | subtype).
pub mod sgl {
    /// Data Block descriptor, subtype Offset: in-capsule data.
    pub const DATA_BLOCK_OFFSET: u8 = 0x01; // type 0x0, subtype 0x1
    /// Transport SGL Data Block descriptor, transport-specific subtype 0xA:
    /// data moved with R2T/H2CData or C2HData.
    pub const TRANSPORT_DATA_BLOCK: u8 = 0x5 << 4 | 0xA;
}

/// DSM attribute: deallocate.
pub const DSM_ATTR_DEALLOCATE: u32 = 1 << 2;

/// Builder over a 64-byte SQE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sqe(pub [u8; SQE_LEN]);

impl Default for Sqe {
    fn default() -> Self {
        Self([0; SQE_LEN])
    }
}

impl Sqe {
    /// A zeroed SQE with `opcode`; the SGL flag is set (NVMe/TCP always uses SGLs).
    pub fn new(opcode: u8) -> Self {
        let mut s = Self::default();
        s.0[0] = opcode;
        s.0[1] = sqe_flags::PSDT_SGL;
        s
    }

    /// A Fabrics command of type `fctype`.
    pub fn fabrics(fctype: u8) -> Self {
        let mut s = Self::new(fabrics::OPCODE);
        s.0[4] = fctype;
        s
    }

    /// Opcode.
    pub fn opcode(&self) -> u8 {
        self.0[0]
    }

    /// Set the flags byte (FUSE / PSDT).
    pub fn set_flags(&mut self, flags: u8) -> &mut Self {
        self.0[1] = flags;
        self
    }

    /// Command identifier.
    pub fn cid(&self) -> u16 {
        u16::from_le_bytes([self.0[2], self.0[3]])
    }

    /// Set the command identifier.
    pub fn set_cid(&mut self, cid: u16) -> &mut Self {
        self.0[2..4].copy_from_slice(&cid.to_le_bytes());
        self
    }

    /// Set NSID.
    pub fn set_nsid(&mut self, nsid: u32) -> &mut Self {
        self.0[4..8].copy_from_slice(&nsid.to_le_bytes());
        self
    }

    /// Set command dword `n` (0..16).
    pub fn set_cdw(&mut self, n: usize, v: u32) -> &mut Self {
        if let Some(d) = self.0.get_mut(n * 4..n * 4 + 4) {
            d.copy_from_slice(&v.to_le_bytes());
        }
        self
    }

    /// Command dword `n`.
    pub fn cdw(&self, n: usize) -> u32 {
        match self.0.get(n * 4..n * 4 + 4) {
            Some(d) => u32::from_le_bytes([d[0], d[1], d[2], d[3]]),
            None => 0,
        }
    }

    /// Set the SGL1 descriptor (bytes 24..40).
    pub fn set_sgl(&mut self, addr: u64, len: u32, id: u8) -> &mut Self {
        self.0[24..32].copy_from_slice(&addr.to_le_bytes());
        self.0[32..36].copy_from_slice(&len.to_le_bytes());
        self.0[36..39].fill(0);
        self.0[39] = id;
        self
    }

    /// SGL1 for `len` bytes of in-capsule data at offset 0.
    pub fn set_sgl_in_capsule(&mut self, len: u32) -> &mut Self {
        self.set_sgl(0, len, sgl::DATA_BLOCK_OFFSET)
    }

    /// SGL1 for `len` bytes transferred by R2T/H2CData or C2HData (0 for none).
    pub fn set_sgl_transport(&mut self, len: u32) -> &mut Self {
        self.set_sgl(0, len, sgl::TRANSPORT_DATA_BLOCK)
    }

    /// SGL1 length field.
    pub fn sgl_len(&self) -> u32 {
        u32::from_le_bytes([self.0[32], self.0[33], self.0[34], self.0[35]])
    }

    /// Set SLBA (CDW10-11) and the 0's based number of blocks (CDW12 bits 15:0)
    /// from a 1-based `nlb`.
    pub fn set_lba_range(&mut self, slba: u64, nlb: u32) -> &mut Self {
        self.0[40..48].copy_from_slice(&slba.to_le_bytes());
        let nlb0 = nlb.saturating_sub(1) as u16;
        self.0[48..50].copy_from_slice(&nlb0.to_le_bytes());
        self
    }

    /// Connect command (data: [`connect_data`]).
    pub fn connect(qid: u16, sqsize: u16, kato_ms: u32) -> Self {
        let mut s = Self::fabrics(fabrics::CONNECT);
        // RECFMT 0 at 40..42.
        s.0[42..44].copy_from_slice(&qid.to_le_bytes());
        s.0[44..46].copy_from_slice(&sqsize.to_le_bytes());
        s.0[48..52].copy_from_slice(&kato_ms.to_le_bytes());
        s
    }

    /// Sets Connect's CATTR bit that asks to disable SQ flow control.
    pub fn disable_sq_flow_control(mut self) -> Self {
        self.0[46] |= fabrics::CONNECT_DISABLE_SQFLOW;
        self
    }

    /// Authentication Send (DH-HMAC-CHAP) of a `len`-byte message.
    pub fn auth_send(len: u32) -> Self {
        Self::auth(fabrics::AUTH_SEND, len)
    }

    /// Authentication Receive (DH-HMAC-CHAP) into a `len`-byte buffer.
    pub fn auth_receive(len: u32) -> Self {
        Self::auth(fabrics::AUTH_RECEIVE, len)
    }

    fn auth(fctype: u8, len: u32) -> Self {
        let mut s = Self::fabrics(fctype);
        s.0[41] = fabrics::AUTH_SPSP; // SPSP0
        s.0[42] = fabrics::AUTH_SPSP; // SPSP1
        s.0[43] = fabrics::AUTH_SECP_DHCHAP;
        s.0[44..48].copy_from_slice(&len.to_le_bytes()); // TL / AL
        s
    }

    /// Property Get of a 4 or 8 byte property.
    pub fn property_get(offset: u32, eight_bytes: bool) -> Self {
        let mut s = Self::fabrics(fabrics::PROPERTY_GET);
        s.0[40] = u8::from(eight_bytes);
        s.0[44..48].copy_from_slice(&offset.to_le_bytes());
        s
    }

    /// Property Set of a 4 or 8 byte property.
    pub fn property_set(offset: u32, value: u64, eight_bytes: bool) -> Self {
        let mut s = Self::fabrics(fabrics::PROPERTY_SET);
        s.0[40] = u8::from(eight_bytes);
        s.0[44..48].copy_from_slice(&offset.to_le_bytes());
        s.0[48..56].copy_from_slice(&value.to_le_bytes());
        s
    }

    /// Identify with `cns` for `nsid` / controller `cntid`.
    pub fn identify(cns: u8, nsid: u32, cntid: u16) -> Self {
        let mut s = Self::new(admin::IDENTIFY);
        s.set_nsid(nsid);
        s.0[40] = cns;
        s.0[42..44].copy_from_slice(&cntid.to_le_bytes());
        s
    }

    /// Get Log Page of `len` bytes (multiple of 4) at byte `offset`.
    pub fn get_log_page(lid: u8, nsid: u32, len: u32, offset: u64) -> Self {
        let mut s = Self::new(admin::GET_LOG_PAGE);
        s.set_nsid(nsid);
        let numd = (len / 4).saturating_sub(1);
        s.0[40] = lid;
        s.0[42..44].copy_from_slice(&(numd as u16).to_le_bytes());
        s.0[44..46].copy_from_slice(&((numd >> 16) as u16).to_le_bytes());
        s.0[48..56].copy_from_slice(&offset.to_le_bytes());
        s
    }

    /// Keep Alive.
    pub fn keep_alive() -> Self {
        Self::new(admin::KEEP_ALIVE)
    }

    /// Read / Write / Compare of `nlb` blocks at `slba`.
    pub fn rw(opcode: u8, nsid: u32, slba: u64, nlb: u32) -> Self {
        let mut s = Self::new(opcode);
        s.set_nsid(nsid).set_lba_range(slba, nlb);
        s
    }

    /// Flush.
    pub fn flush(nsid: u32) -> Self {
        let mut s = Self::new(io::FLUSH);
        s.set_nsid(nsid);
        s
    }

    /// Write Zeroes of `nlb` blocks at `slba`.
    pub fn write_zeroes(nsid: u32, slba: u64, nlb: u32) -> Self {
        Self::rw(io::WRITE_ZEROES, nsid, slba, nlb)
    }

    /// Dataset Management with `nr` ranges (1-based) and attributes.
    pub fn dsm(nsid: u32, nr: u32, attributes: u32) -> Self {
        let mut s = Self::new(io::DSM);
        s.set_nsid(nsid)
            .set_cdw(10, nr.saturating_sub(1))
            .set_cdw(11, attributes);
        s
    }
}

/// Connect command data: hostid, cntlid, subnqn, hostnqn (NQNs truncated
/// to 255 bytes so they stay NUL terminated).
pub fn connect_data(hostid: &[u8; 16], cntlid: u16, subnqn: &str, hostnqn: &str) -> Vec<u8> {
    let mut d = vec![0u8; CONNECT_DATA_LEN];
    d[0..16].copy_from_slice(hostid);
    d[16..18].copy_from_slice(&cntlid.to_le_bytes());
    let put = |d: &mut [u8], s: &str| {
        let b = s.as_bytes();
        let n = b.len().min(NQN_FIELD_LEN - 1);
        d[..n].copy_from_slice(&b[..n]);
    };
    put(&mut d[256..512], subnqn);
    put(&mut d[512..768], hostnqn);
    d
}

/// DSM range list for `(slba, nlb)` pairs, 16 bytes per range
/// (context attributes, length in blocks, starting LBA).
pub fn dsm_ranges(ranges: &[(u64, u32)]) -> Vec<u8> {
    let mut d = Vec::with_capacity(ranges.len() * 16);
    for &(slba, nlb) in ranges {
        d.extend_from_slice(&0u32.to_le_bytes());
        d.extend_from_slice(&nlb.to_le_bytes());
        d.extend_from_slice(&slba.to_le_bytes());
    }
    d
}

/// A 16-byte completion queue entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Completion(pub [u8; CQE_LEN]);

impl Completion {
    /// A successful completion for `cid` (as implied by C2HData SUCCESS).
    pub fn success(cid: u16) -> Self {
        let mut c = [0u8; CQE_LEN];
        c[12..14].copy_from_slice(&cid.to_le_bytes());
        Self(c)
    }

    /// Dword 0 (command specific result).
    pub fn dw0(&self) -> u32 {
        u32::from_le_bytes([self.0[0], self.0[1], self.0[2], self.0[3]])
    }

    /// Dword 1.
    pub fn dw1(&self) -> u32 {
        u32::from_le_bytes([self.0[4], self.0[5], self.0[6], self.0[7]])
    }

    /// Dwords 0-1 as a 64-bit result (Property Get of 8 bytes).
    pub fn result64(&self) -> u64 {
        u64::from(self.dw0()) | (u64::from(self.dw1()) << 32)
    }

    /// SQ head pointer.
    pub fn sqhd(&self) -> u16 {
        u16::from_le_bytes([self.0[8], self.0[9]])
    }

    /// SQ identifier.
    pub fn sqid(&self) -> u16 {
        u16::from_le_bytes([self.0[10], self.0[11]])
    }

    /// Command identifier.
    pub fn cid(&self) -> u16 {
        u16::from_le_bytes([self.0[12], self.0[13]])
    }

    /// The status field without the phase tag: bits 7:0 SC, 10:8 SCT,
    /// 12:11 CRD, 13 More, 14 DNR.
    pub fn status(&self) -> u16 {
        u16::from_le_bytes([self.0[14], self.0[15]]) >> 1
    }

    /// Status code.
    pub fn sc(&self) -> u8 {
        (self.status() & 0xff) as u8
    }

    /// Status code type.
    pub fn sct(&self) -> u8 {
        ((self.status() >> 8) & 0x7) as u8
    }

    /// Do Not Retry.
    pub fn dnr(&self) -> bool {
        self.status() & (1 << 14) != 0
    }

    /// SCT and SC both zero.
    pub fn is_success(&self) -> bool {
        self.sc() == 0 && self.sct() == 0
    }
}

fn ascii_field(b: &[u8]) -> String {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..end]).trim_end().to_string()
}

fn le16(b: &[u8], off: usize) -> u16 {
    b.get(off..off + 2)
        .map_or(0, |s| u16::from_le_bytes([s[0], s[1]]))
}

fn le32(b: &[u8], off: usize) -> u32 {
    b.get(off..off + 4)
        .map_or(0, |s| u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
}

fn le64(b: &[u8], off: usize) -> u64 {
    u64::from(le32(b, off)) | (u64::from(le32(b, off + 4)) << 32)
}

/// Identify Controller data with a few fields parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdentifyController {
    /// The raw 4096 bytes.
    pub raw: Vec<u8>,
}

impl IdentifyController {
    /// Wrap raw Identify Controller data.
    pub fn new(raw: Vec<u8>) -> Self {
        Self { raw }
    }
    /// PCI vendor ID.
    pub fn vid(&self) -> u16 {
        le16(&self.raw, 0)
    }
    /// Serial number.
    pub fn serial(&self) -> String {
        ascii_field(self.raw.get(4..24).unwrap_or_default())
    }
    /// Model number.
    pub fn model(&self) -> String {
        ascii_field(self.raw.get(24..64).unwrap_or_default())
    }
    /// Firmware revision.
    pub fn firmware(&self) -> String {
        ascii_field(self.raw.get(64..72).unwrap_or_default())
    }
    /// Maximum data transfer size (power of two in units of CAP.MPSMIN; 0 = no limit).
    pub fn mdts(&self) -> u8 {
        self.raw.get(77).copied().unwrap_or(0)
    }
    /// Controller ID.
    pub fn cntlid(&self) -> u16 {
        le16(&self.raw, 78)
    }
    /// Version.
    pub fn ver(&self) -> u32 {
        le32(&self.raw, 80)
    }
    /// Keep alive granularity (100 ms units).
    pub fn kas(&self) -> u16 {
        le16(&self.raw, 320)
    }
    /// Maximum outstanding commands.
    pub fn maxcmd(&self) -> u16 {
        le16(&self.raw, 514)
    }
    /// Number of namespaces.
    pub fn nn(&self) -> u32 {
        le32(&self.raw, 516)
    }
    /// Optional NVM command support.
    pub fn oncs(&self) -> u16 {
        le16(&self.raw, 520)
    }
    /// Fused operation support.
    pub fn fuses(&self) -> u16 {
        le16(&self.raw, 522)
    }
    /// Volatile write cache.
    pub fn vwc(&self) -> u8 {
        self.raw.get(525).copied().unwrap_or(0)
    }
    /// SGL support.
    pub fn sgls(&self) -> u32 {
        le32(&self.raw, 536)
    }
    /// Subsystem NQN.
    pub fn subnqn(&self) -> String {
        ascii_field(self.raw.get(768..1024).unwrap_or_default())
    }
    /// I/O queue command capsule supported size (16-byte units).
    pub fn ioccsz(&self) -> u32 {
        le32(&self.raw, 1792)
    }
    /// I/O queue response capsule supported size (16-byte units).
    pub fn iorcsz(&self) -> u32 {
        le32(&self.raw, 1796)
    }
    /// In-capsule data offset (16-byte units).
    pub fn icdoff(&self) -> u16 {
        le16(&self.raw, 1800)
    }
    /// Maximum in-capsule data on I/O queues, from IOCCSZ.
    pub fn in_capsule_data_max(&self) -> usize {
        (self.ioccsz() as usize * 16).saturating_sub(SQE_LEN)
    }
}

/// Identify Namespace data with a few fields parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdentifyNamespace {
    /// The raw 4096 bytes.
    pub raw: Vec<u8>,
}

impl IdentifyNamespace {
    /// Wrap raw Identify Namespace data.
    pub fn new(raw: Vec<u8>) -> Self {
        Self { raw }
    }
    /// Namespace size in blocks.
    pub fn nsze(&self) -> u64 {
        le64(&self.raw, 0)
    }
    /// Namespace capacity in blocks.
    pub fn ncap(&self) -> u64 {
        le64(&self.raw, 8)
    }
    /// Namespace utilization in blocks.
    pub fn nuse(&self) -> u64 {
        le64(&self.raw, 16)
    }
    /// Namespace features.
    pub fn nsfeat(&self) -> u8 {
        self.raw.get(24).copied().unwrap_or(0)
    }
    /// Number of LBA formats (0's based).
    pub fn nlbaf(&self) -> u8 {
        self.raw.get(25).copied().unwrap_or(0)
    }
    /// Formatted LBA size.
    pub fn flbas(&self) -> u8 {
        self.raw.get(26).copied().unwrap_or(0)
    }
    /// LBA data size (bytes) of the current format.
    pub fn block_size(&self) -> u32 {
        let idx = (self.flbas() & 0x0f) as usize;
        let lbads = self.raw.get(128 + idx * 4 + 2).copied().unwrap_or(0);
        if (9..32).contains(&lbads) {
            1u32 << lbads
        } else {
            0
        }
    }
    /// NGUID.
    pub fn nguid(&self) -> [u8; 16] {
        let mut g = [0u8; 16];
        if let Some(s) = self.raw.get(104..120) {
            g.copy_from_slice(s);
        }
        g
    }
    /// EUI64.
    pub fn eui64(&self) -> [u8; 8] {
        let mut g = [0u8; 8];
        if let Some(s) = self.raw.get(120..128) {
            g.copy_from_slice(s);
        }
        g
    }
}

/// One Discovery Log Page entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiscoveryEntry {
    /// Transport type (3 = TCP).
    pub trtype: u8,
    /// Address family (1 = IPv4, 2 = IPv6).
    pub adrfam: u8,
    /// Subsystem type (1 = referral/discovery, 2 = NVM, 3 = current discovery).
    pub subtype: u8,
    /// Transport requirements.
    pub treq: u8,
    /// Port ID.
    pub portid: u16,
    /// Controller ID.
    pub cntlid: u16,
    /// Admin max SQ size.
    pub asqsz: u16,
    /// Transport service identifier (port).
    pub trsvcid: String,
    /// Subsystem NQN.
    pub subnqn: String,
    /// Transport address.
    pub traddr: String,
    /// Transport specific address subtype (raw).
    pub tsas: Vec<u8>,
}

/// Discovery Log Page.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiscoveryLog {
    /// Generation counter.
    pub genctr: u64,
    /// Number of records reported in the header.
    pub numrec: u64,
    /// Record format.
    pub recfmt: u16,
    /// The entries present in the data read.
    pub entries: Vec<DiscoveryEntry>,
}

/// Size of the discovery log header and of each entry.
pub const DISCOVERY_RECORD_LEN: usize = 1024;

impl DiscoveryLog {
    /// Parse a discovery log page (header plus as many whole entries as present).
    pub fn parse(b: &[u8]) -> Self {
        let numrec = le64(b, 8);
        let mut entries = Vec::new();
        let mut off = DISCOVERY_RECORD_LEN;
        while (entries.len() as u64) < numrec {
            let Some(e) = b.get(off..off + DISCOVERY_RECORD_LEN) else {
                break;
            };
            entries.push(DiscoveryEntry {
                trtype: e[0],
                adrfam: e[1],
                subtype: e[2],
                treq: e[3],
                portid: le16(e, 4),
                cntlid: le16(e, 6),
                asqsz: le16(e, 8),
                trsvcid: ascii_field(&e[32..64]),
                subnqn: ascii_field(&e[256..512]),
                traddr: ascii_field(&e[512..768]),
                tsas: e[768..1024].to_vec(),
            });
            off += DISCOVERY_RECORD_LEN;
        }
        Self {
            genctr: le64(b, 0),
            numrec,
            recfmt: le16(b, 16),
            entries,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connect_sqe_layout() {
        let mut s = Sqe::connect(0, 31, 30_000);
        s.set_cid(0x1234).set_sgl_in_capsule(1024);
        let b = s.0;
        assert_eq!(b[0], 0x7f);
        assert_eq!(b[1], 0x40);
        assert_eq!(&b[2..4], &[0x34, 0x12]);
        assert_eq!(b[4], 0x01);
        assert_eq!(
            &b[24..40],
            &[0, 0, 0, 0, 0, 0, 0, 0, 0, 4, 0, 0, 0, 0, 0, 0x01]
        );
        assert_eq!(&b[40..46], &[0, 0, 0, 0, 31, 0]);
        assert_eq!(&b[48..52], &30_000u32.to_le_bytes());
        let d = connect_data(&[7; 16], CNTLID_DYNAMIC, "nqn.sub", "nqn.host");
        assert_eq!(d.len(), 1024);
        assert_eq!(&d[16..18], &[0xff, 0xff]);
        assert_eq!(&d[256..263], b"nqn.sub");
        assert_eq!(d[263], 0);
        assert_eq!(&d[512..520], b"nqn.host");
    }

    #[test]
    fn transport_sgl_and_rw() {
        let mut s = Sqe::rw(io::READ, 1, 0x1_0000_0002, 8);
        s.set_sgl_transport(4096);
        assert_eq!(s.0[39], 0x5a);
        assert_eq!(s.sgl_len(), 4096);
        assert_eq!(s.cdw(10), 2);
        assert_eq!(s.cdw(11), 1);
        assert_eq!(s.cdw(12), 7);
        assert_eq!(s.cdw(1), 1);
    }

    #[test]
    fn property_and_log_page() {
        let s = Sqe::property_set(prop::CC, 0x46_0001, false);
        assert_eq!(
            (s.0[4], s.0[40], s.cdw(11), s.cdw(12)),
            (0x00, 0, 0x14, 0x46_0001)
        );
        let s = Sqe::property_get(prop::CAP, true);
        assert_eq!((s.0[4], s.0[40], s.cdw(11)), (0x04, 1, 0));
        let s = Sqe::get_log_page(log::DISCOVERY, 0, 4096, 1024);
        assert_eq!(s.0[40], 0x70);
        assert_eq!(s.cdw(10) >> 16, 1023);
        assert_eq!(s.cdw(12), 1024);
    }

    #[test]
    fn completion_status() {
        let mut c = Completion::success(9);
        assert!(c.is_success());
        assert_eq!(c.cid(), 9);
        // SCT 1, SC 0x82, DNR: status field = (0x4000 | 0x100 | 0x82) << 1.
        c.0[14..16].copy_from_slice(&(((1u16 << 14) | 0x100 | 0x82) << 1).to_le_bytes());
        assert_eq!(
            (c.sct(), c.sc(), c.dnr(), c.is_success()),
            (1, 0x82, true, false)
        );
    }

    #[test]
    fn identify_parsing() {
        let mut raw = vec![0u8; 4096];
        raw[4..8].copy_from_slice(b"SN01");
        raw[78..80].copy_from_slice(&5u16.to_le_bytes());
        raw[516..520].copy_from_slice(&3u32.to_le_bytes());
        raw[1792..1796].copy_from_slice(&516u32.to_le_bytes());
        let c = IdentifyController::new(raw);
        assert_eq!(c.serial(), "SN01");
        assert_eq!(c.cntlid(), 5);
        assert_eq!(c.nn(), 3);
        assert_eq!(c.in_capsule_data_max(), 8192);
        let mut raw = vec![0u8; 4096];
        raw[0..8].copy_from_slice(&1000u64.to_le_bytes());
        raw[26] = 1;
        raw[128 + 4 + 2] = 12;
        let n = IdentifyNamespace::new(raw);
        assert_eq!((n.nsze(), n.block_size()), (1000, 4096));
    }
}
