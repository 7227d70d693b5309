//! NVMe/TCP PDU codec (NVMe/TCP Transport Specification 1.0; field layout as
//! in Linux `include/linux/nvme-tcp.h`).
//!
//! Pure: no I/O, no clock, no allocation except growing the caller's output
//! buffer. Used by both the target (controller) and the host (initiator).
//!
//! Decoding is incremental: [`PduDecoder::decode`] is handed every byte
//! received so far and either asks for more (`Ok(None)`), or returns one PDU
//! whose payload slices borrow from the input together with the number of
//! bytes it occupied. The common header is validated as soon as its 8 bytes
//! are present, so a hostile `plen` is rejected before anything is buffered
//! for it. Errors carry the Fatal Error Status / Fatal Error Information to
//! put in the C2HTermReq / H2CTermReq that should be sent in response.
//!
//! Wire layout reminders (all multi-byte fields little-endian):
//!
//! ```text
//! CH:   0 type | 1 flags | 2 hlen | 3 pdo | 4..8 plen
//! PDU:  [CH + PSH: hlen bytes][HDGST 4?][PAD to pdo][DATA][DDGST 4?]
//! ```

use thiserror::Error;

use super::digest::{self, DIGEST_LEN};

/// Length of the common header (CH).
pub const CH_LEN: usize = 8;
/// Size of a submission queue entry carried in a CapsuleCmd.
pub const SQE_LEN: usize = 64;
/// Size of a completion queue entry carried in a CapsuleResp.
pub const CQE_LEN: usize = 16;

/// ICReq / ICResp header length.
pub const HLEN_IC: u8 = 128;
/// H2CTermReq / C2HTermReq header length.
pub const HLEN_TERM_REQ: u8 = 24;
/// CapsuleCmd header length (CH + 64-byte SQE).
pub const HLEN_CAPSULE_CMD: u8 = 72;
/// CapsuleResp header length (CH + 16-byte CQE).
pub const HLEN_CAPSULE_RESP: u8 = 24;
/// H2CData / C2HData header length.
pub const HLEN_DATA: u8 = 24;
/// R2T header length.
pub const HLEN_R2T: u8 = 24;

/// Maximum amount of error data following a TermReq header.
pub const TERM_REQ_MAX_DATA: usize = 128;
/// Maximum `plen` of a TermReq (header + error data).
pub const TERM_REQ_MAX_PLEN: u32 = HLEN_TERM_REQ as u32 + TERM_REQ_MAX_DATA as u32;

/// PDU format version 1.0 (ICReq/ICResp PFV).
pub const PFV_1_0: u16 = 0;
/// Largest HPDA / CPDA value (0's based dwords: 128-byte alignment).
pub const MAX_PDA: u8 = 31;

/// ICReq/ICResp DGST field: header digest enable.
pub const DGST_HEADER: u8 = 1 << 0;
/// ICReq/ICResp DGST field: data digest enable.
pub const DGST_DATA: u8 = 1 << 1;

/// Common-header flags.
pub mod flags {
    /// A header digest follows the PDU header.
    pub const HDGSTF: u8 = 1 << 0;
    /// A data digest follows the PDU data.
    pub const DDGSTF: u8 = 1 << 1;
    /// H2CData / C2HData: last PDU of the data transfer.
    pub const LAST_PDU: u8 = 1 << 2;
    /// C2HData: command completed successfully, no CapsuleResp follows.
    pub const SUCCESS: u8 = 1 << 3;
}

/// Byte offsets of fields, used as FEI values.
pub mod offsets {
    /// CH.PDU-Type.
    pub const TYPE: u32 = 0;
    /// CH.FLAGS.
    pub const FLAGS: u32 = 1;
    /// CH.HLEN.
    pub const HLEN: u32 = 2;
    /// CH.PDO.
    pub const PDO: u32 = 3;
    /// CH.PLEN.
    pub const PLEN: u32 = 4;
    /// ICReq/ICResp PFV.
    pub const PFV: u32 = 8;
    /// ICReq HPDA / ICResp CPDA.
    pub const PDA: u32 = 10;
    /// ICReq/ICResp DGST.
    pub const DGST: u32 = 11;
    /// ICReq MAXR2T / ICResp MAXH2CDATA.
    pub const IC_MAX: u32 = 12;
    /// H2CData/C2HData/R2T CCCID.
    pub const CCCID: u32 = 8;
    /// H2CData/R2T TTAG.
    pub const TTAG: u32 = 10;
    /// H2CData/C2HData DATAO, R2T R2TO.
    pub const DATAO: u32 = 12;
    /// H2CData/C2HData DATAL, R2T R2TL.
    pub const DATAL: u32 = 16;
}

/// PDU types.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum PduType {
    /// Initialize Connection Request.
    IcReq = 0x00,
    /// Initialize Connection Response.
    IcResp = 0x01,
    /// Host to Controller Terminate Connection Request.
    H2CTermReq = 0x02,
    /// Controller to Host Terminate Connection Request.
    C2HTermReq = 0x03,
    /// Command Capsule.
    CapsuleCmd = 0x04,
    /// Response Capsule.
    CapsuleResp = 0x05,
    /// Host to Controller Data.
    H2CData = 0x06,
    /// Controller to Host Data.
    C2HData = 0x07,
    /// Ready to Transfer.
    R2T = 0x09,
}

impl PduType {
    /// Decode the CH type byte.
    pub fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            0x00 => Self::IcReq,
            0x01 => Self::IcResp,
            0x02 => Self::H2CTermReq,
            0x03 => Self::C2HTermReq,
            0x04 => Self::CapsuleCmd,
            0x05 => Self::CapsuleResp,
            0x06 => Self::H2CData,
            0x07 => Self::C2HData,
            0x09 => Self::R2T,
            _ => return None,
        })
    }

    /// The fixed header length (HLEN) for this type.
    pub fn hlen(self) -> u8 {
        match self {
            Self::IcReq | Self::IcResp => HLEN_IC,
            Self::H2CTermReq | Self::C2HTermReq => HLEN_TERM_REQ,
            Self::CapsuleCmd => HLEN_CAPSULE_CMD,
            Self::CapsuleResp => HLEN_CAPSULE_RESP,
            Self::H2CData | Self::C2HData => HLEN_DATA,
            Self::R2T => HLEN_R2T,
        }
    }

    /// Sent by the host (received by the controller).
    pub fn is_host_to_controller(self) -> bool {
        matches!(
            self,
            Self::IcReq | Self::H2CTermReq | Self::CapsuleCmd | Self::H2CData
        )
    }

    /// Whether PDUs of this type carry header/data digests once negotiated.
    fn digests_apply(self) -> bool {
        !matches!(
            self,
            Self::IcReq | Self::IcResp | Self::H2CTermReq | Self::C2HTermReq
        )
    }

    /// Whether PDUs of this type may carry PDU data at `pdo`.
    fn may_carry_data(self) -> bool {
        matches!(self, Self::CapsuleCmd | Self::H2CData | Self::C2HData)
    }
}

/// Fatal Error Status codes of H2CTermReq / C2HTermReq.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum Fes {
    /// Invalid PDU Header Field (FEI = byte offset of the field).
    InvalidHeaderField = 0x01,
    /// PDU Sequence Error.
    PduSequenceError = 0x02,
    /// Header Digest Error.
    HeaderDigestError = 0x03,
    /// Data Transfer Out of Range (FEI = byte offset of the field).
    DataTransferOutOfRange = 0x04,
    /// Data Transfer Limit Exceeded / R2T Limit Exceeded.
    DataTransferLimitExceeded = 0x05,
    /// Unsupported Parameter (FEI = byte offset of the field).
    UnsupportedParameter = 0x06,
}

impl Fes {
    /// Decode a wire FES value.
    pub fn from_u16(v: u16) -> Option<Self> {
        Some(match v {
            0x01 => Self::InvalidHeaderField,
            0x02 => Self::PduSequenceError,
            0x03 => Self::HeaderDigestError,
            0x04 => Self::DataTransferOutOfRange,
            0x05 => Self::DataTransferLimitExceeded,
            0x06 => Self::UnsupportedParameter,
            _ => return None,
        })
    }
}

/// Errors detected while decoding a PDU.
///
/// All but [`PduError::DataDigest`] are fatal transport errors: the receiver
/// should send a TermReq built from [`PduError::term_req_info`] and close the
/// connection.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum PduError {
    /// PDU type not defined by the transport.
    #[error("unknown PDU type {pdu_type:#04x}")]
    UnknownType {
        /// The type byte received.
        pdu_type: u8,
    },
    /// A PDU type only the other side may receive (e.g. CapsuleResp sent to a target).
    #[error("PDU type {pdu_type:?} not valid in this direction")]
    WrongDirection {
        /// The type received.
        pdu_type: PduType,
    },
    /// HLEN does not match the PDU type.
    #[error("PDU type {pdu_type:?}: hlen {hlen}, expected {expected}")]
    InvalidHlen {
        /// The type received.
        pdu_type: PduType,
        /// HLEN received.
        hlen: u8,
        /// HLEN defined for the type.
        expected: u8,
    },
    /// Flags invalid for the type or inconsistent with the negotiated digests.
    #[error("PDU type {pdu_type:?}: invalid flags {flags:#04x}")]
    InvalidFlags {
        /// The type received.
        pdu_type: PduType,
        /// FLAGS received.
        flags: u8,
    },
    /// PDO inconsistent with HLEN / PLEN / digests / alignment.
    #[error("PDU type {pdu_type:?}: invalid pdo {pdo} (plen {plen})")]
    InvalidPdo {
        /// The type received.
        pdu_type: PduType,
        /// PDO received.
        pdo: u8,
        /// PLEN received.
        plen: u32,
    },
    /// PLEN inconsistent with HLEN / digests / the PDU type.
    #[error("PDU type {pdu_type:?}: invalid plen {plen}")]
    InvalidPlen {
        /// The type received.
        pdu_type: PduType,
        /// PLEN received.
        plen: u32,
    },
    /// PLEN above the configured maximum.
    #[error("PDU type {pdu_type:?}: plen {plen} exceeds maximum {max}")]
    PduTooLarge {
        /// The type received.
        pdu_type: PduType,
        /// PLEN received.
        plen: u32,
        /// Configured maximum.
        max: u32,
    },
    /// DATAL of a data PDU disagrees with the amount of PDU data.
    #[error("data PDU: datal {datal} but {actual} bytes of data")]
    DataLengthMismatch {
        /// DATAL received.
        datal: u32,
        /// Bytes of PDU data actually present.
        actual: u32,
    },
    /// H2CData carries more than MAXH2CDATA bytes.
    #[error("H2CData: datal {datal} exceeds MAXH2CDATA {max}")]
    DataLimitExceeded {
        /// DATAL received.
        datal: u32,
        /// Negotiated MAXH2CDATA.
        max: u32,
    },
    /// A data transfer outside of the command's buffer (detected by the session layer).
    #[error("data transfer out of range (field at offset {offset})")]
    DataOutOfRange {
        /// Byte offset of the offending field (FEI).
        offset: u32,
    },
    /// PDU not allowed in the current connection state (e.g. before/after ICReq).
    #[error("PDU type {pdu_type:?} out of sequence")]
    Sequence {
        /// The type received.
        pdu_type: PduType,
    },
    /// ICReq/ICResp parameter we cannot accept.
    #[error("unsupported parameter at offset {offset} (value {value})")]
    UnsupportedParameter {
        /// Byte offset of the field (FEI).
        offset: u32,
        /// Value received.
        value: u32,
    },
    /// Header digest mismatch.
    #[error("header digest mismatch: received {received:#010x}, computed {computed:#010x}")]
    HeaderDigest {
        /// Digest on the wire.
        received: u32,
        /// Digest computed over the header.
        computed: u32,
    },
    /// Data digest mismatch. Not a fatal transport error per se: the PDU was
    /// framed correctly, `consumed` bytes may be skipped and the command
    /// identified by `cccid` failed (Transient Transport Error).
    #[error("data digest mismatch (cccid {cccid}): received {received:#010x}, computed {computed:#010x}")]
    DataDigest {
        /// Digest on the wire.
        received: u32,
        /// Digest computed over the data.
        computed: u32,
        /// Command the data belonged to.
        cccid: u16,
        /// Length of the whole PDU, to skip it.
        consumed: usize,
    },
}

impl PduError {
    /// FES and FEI for the TermReq to send, or `None` for a data digest
    /// error (which the spec handles at the command level).
    pub fn term_req_info(&self) -> Option<(Fes, u32)> {
        use offsets::*;
        Some(match self {
            Self::UnknownType { .. } | Self::WrongDirection { .. } => {
                (Fes::InvalidHeaderField, TYPE)
            }
            Self::InvalidFlags { .. } => (Fes::InvalidHeaderField, FLAGS),
            Self::InvalidHlen { .. } => (Fes::InvalidHeaderField, HLEN),
            Self::InvalidPdo { .. } => (Fes::InvalidHeaderField, PDO),
            Self::InvalidPlen { .. } | Self::PduTooLarge { .. } => (Fes::InvalidHeaderField, PLEN),
            Self::DataLengthMismatch { .. } => (Fes::InvalidHeaderField, DATAL),
            Self::DataLimitExceeded { .. } => (Fes::DataTransferLimitExceeded, DATAL),
            Self::DataOutOfRange { offset } => (Fes::DataTransferOutOfRange, *offset),
            Self::Sequence { .. } => (Fes::PduSequenceError, 0),
            Self::UnsupportedParameter { offset, .. } => (Fes::UnsupportedParameter, *offset),
            Self::HeaderDigest { .. } => (Fes::HeaderDigestError, 0),
            Self::DataDigest { .. } => return None,
        })
    }

    /// FES of the TermReq to send (see [`PduError::term_req_info`]).
    pub fn fes(&self) -> Option<Fes> {
        self.term_req_info().map(|(f, _)| f)
    }

    /// FEI of the TermReq to send (0 when not applicable).
    pub fn fei(&self) -> u32 {
        self.term_req_info().map_or(0, |(_, i)| i)
    }

    /// Whether the connection must be terminated.
    pub fn is_fatal(&self) -> bool {
        self.term_req_info().is_some()
    }
}

/// The common header, as received.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CommonHeader {
    /// PDU type byte.
    pub pdu_type: u8,
    /// FLAGS.
    pub flags: u8,
    /// HLEN.
    pub hlen: u8,
    /// PDO.
    pub pdo: u8,
    /// PLEN.
    pub plen: u32,
}

impl CommonHeader {
    /// Parse the first 8 bytes of `buf`; `None` if shorter.
    pub fn parse(buf: &[u8]) -> Option<Self> {
        let ch = buf.get(..CH_LEN)?;
        Some(Self {
            pdu_type: ch[0],
            flags: ch[1],
            hlen: ch[2],
            pdo: ch[3],
            plen: u32::from_le_bytes([ch[4], ch[5], ch[6], ch[7]]),
        })
    }
}

/// ICReq fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IcReq {
    /// PDU format version (0 = 1.0).
    pub pfv: u16,
    /// Host PDU data alignment (0's based dwords) for C2H data PDUs.
    pub hpda: u8,
    /// Header digest requested.
    pub hdgst: bool,
    /// Data digest requested.
    pub ddgst: bool,
    /// Maximum outstanding R2Ts per command, 0's based.
    pub maxr2t: u32,
}

impl Default for IcReq {
    fn default() -> Self {
        Self {
            pfv: PFV_1_0,
            hpda: 0,
            hdgst: false,
            ddgst: false,
            maxr2t: 0,
        }
    }
}

/// ICResp fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IcResp {
    /// PDU format version (0 = 1.0).
    pub pfv: u16,
    /// Controller PDU data alignment (0's based dwords) for H2C data PDUs.
    pub cpda: u8,
    /// Header digest enabled.
    pub hdgst: bool,
    /// Data digest enabled.
    pub ddgst: bool,
    /// Maximum H2CData PDU data bytes.
    pub maxh2cdata: u32,
}

/// H2CTermReq / C2HTermReq fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TermReq<'a> {
    /// Fatal error status (raw; see [`Fes::from_u16`]).
    pub fes: u16,
    /// Fatal error information.
    pub fei: u32,
    /// Error data: (part of) the PDU header in error.
    pub data: &'a [u8],
}

/// CapsuleCmd contents.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CapsuleCmd<'a> {
    /// The 64-byte submission queue entry.
    pub sqe: &'a [u8; SQE_LEN],
    /// In-capsule data (empty if none).
    pub data: &'a [u8],
}

impl CapsuleCmd<'_> {
    /// Command identifier (SQE bytes 2..4).
    pub fn cid(&self) -> u16 {
        u16::from_le_bytes([self.sqe[2], self.sqe[3]])
    }

    /// Opcode (SQE byte 0).
    pub fn opcode(&self) -> u8 {
        self.sqe[0]
    }
}

/// CapsuleResp contents.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CapsuleResp<'a> {
    /// The 16-byte completion queue entry.
    pub cqe: &'a [u8; CQE_LEN],
}

impl CapsuleResp<'_> {
    /// Command identifier (CQE bytes 12..14).
    pub fn cid(&self) -> u16 {
        u16::from_le_bytes([self.cqe[12], self.cqe[13]])
    }
}

/// H2CData / C2HData contents.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DataPdu<'a> {
    /// Command capsule CID the data belongs to.
    pub cccid: u16,
    /// Transfer tag (H2CData only; 0 for C2HData).
    pub ttag: u16,
    /// Offset of this data in the command's data buffer.
    pub datao: u32,
    /// Length of this data.
    pub datal: u32,
    /// LAST_PDU flag.
    pub last: bool,
    /// SUCCESS flag (C2HData only).
    pub success: bool,
    /// The data.
    pub data: &'a [u8],
}

/// R2T fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct R2t {
    /// Command capsule CID.
    pub cccid: u16,
    /// Transfer tag chosen by the controller.
    pub ttag: u16,
    /// Requested data offset.
    pub r2to: u32,
    /// Requested data length.
    pub r2tl: u32,
}

/// A decoded PDU borrowing its payload from the receive buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pdu<'a> {
    /// ICReq.
    IcReq(IcReq),
    /// ICResp.
    IcResp(IcResp),
    /// H2CTermReq.
    H2CTermReq(TermReq<'a>),
    /// C2HTermReq.
    C2HTermReq(TermReq<'a>),
    /// CapsuleCmd.
    CapsuleCmd(CapsuleCmd<'a>),
    /// CapsuleResp.
    CapsuleResp(CapsuleResp<'a>),
    /// H2CData.
    H2CData(DataPdu<'a>),
    /// C2HData.
    C2HData(DataPdu<'a>),
    /// R2T.
    R2T(R2t),
}

impl Pdu<'_> {
    /// The PDU's type.
    pub fn pdu_type(&self) -> PduType {
        match self {
            Self::IcReq(_) => PduType::IcReq,
            Self::IcResp(_) => PduType::IcResp,
            Self::H2CTermReq(_) => PduType::H2CTermReq,
            Self::C2HTermReq(_) => PduType::C2HTermReq,
            Self::CapsuleCmd(_) => PduType::CapsuleCmd,
            Self::CapsuleResp(_) => PduType::CapsuleResp,
            Self::H2CData(_) => PduType::H2CData,
            Self::C2HData(_) => PduType::C2HData,
            Self::R2T(_) => PduType::R2T,
        }
    }
}

/// Which end of the connection is decoding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The controller: receives ICReq, H2CTermReq, CapsuleCmd, H2CData.
    Target,
    /// The host: receives ICResp, C2HTermReq, CapsuleResp, C2HData, R2T.
    Host,
}

/// Static decoder configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecoderConfig {
    /// Which side we are.
    pub role: Role,
    /// Largest PLEN accepted (bounds the receive buffer).
    pub max_pdu_len: u32,
    /// Target only: MAXH2CDATA advertised in ICResp; 0 = not checked.
    pub max_h2c_data: u32,
}

impl DecoderConfig {
    /// Defaults for `role`: 1 MiB + 4 KiB maximum PDU, no MAXH2CDATA check.
    pub fn new(role: Role) -> Self {
        Self {
            role,
            max_pdu_len: (1 << 20) + 4096,
            max_h2c_data: 0,
        }
    }
}

/// Incremental, zero-copy PDU decoder holding the negotiated connection
/// parameters.
#[derive(Debug, Clone)]
pub struct PduDecoder {
    cfg: DecoderConfig,
    hdgst: bool,
    ddgst: bool,
    rx_pda: u8,
    ic_done: bool,
}

/// Result of validating a common header.
#[derive(Debug, Clone, Copy)]
struct Layout {
    ty: PduType,
    hlen: usize,
    plen: usize,
    hd: bool,
    /// (data start, data end) when the PDU carries data.
    data: Option<(usize, usize)>,
    dd: bool,
}

#[inline]
fn rd16(b: &[u8], off: usize) -> u16 {
    match b.get(off..off + 2) {
        Some(s) => u16::from_le_bytes([s[0], s[1]]),
        None => 0,
    }
}

#[inline]
fn rd32(b: &[u8], off: usize) -> u32 {
    match b.get(off..off + 4) {
        Some(s) => u32::from_le_bytes([s[0], s[1], s[2], s[3]]),
        None => 0,
    }
}

/// PDU data alignment in bytes for a 0's based dword count.
#[inline]
pub fn pda_bytes(pda: u8) -> usize {
    (pda as usize + 1) * 4
}

impl PduDecoder {
    /// A decoder before the ICReq/ICResp exchange: no digests, 4-byte
    /// data alignment, only ICReq (target) / ICResp (host) accepted first.
    pub fn new(cfg: DecoderConfig) -> Self {
        Self {
            cfg,
            hdgst: false,
            ddgst: false,
            rx_pda: 0,
            ic_done: false,
        }
    }

    /// The configuration.
    pub fn config(&self) -> &DecoderConfig {
        &self.cfg
    }

    /// Change the maximum accepted PLEN.
    pub fn set_max_pdu_len(&mut self, max: u32) {
        self.cfg.max_pdu_len = max;
    }

    /// Change the MAXH2CDATA check (target; 0 disables it).
    pub fn set_max_h2c_data(&mut self, max: u32) {
        self.cfg.max_h2c_data = max;
    }

    /// Set the negotiated digests; applies to every later PDU.
    pub fn set_digests(&mut self, header: bool, data: bool) {
        self.hdgst = header;
        self.ddgst = data;
    }

    /// Header digest currently expected.
    pub fn header_digest(&self) -> bool {
        self.hdgst
    }

    /// Data digest currently expected.
    pub fn data_digest(&self) -> bool {
        self.ddgst
    }

    /// Alignment (0's based dwords) that received data PDUs must honour:
    /// the CPDA we sent (target) or the HPDA we asked for (host).
    pub fn set_rx_pda(&mut self, pda: u8) {
        self.rx_pda = pda.min(MAX_PDA);
    }

    /// Whether the ICReq/ICResp PDU has been decoded.
    pub fn ic_done(&self) -> bool {
        self.ic_done
    }

    /// Mark the connection initialization as done (or not), e.g. for a
    /// decoder created mid-connection.
    pub fn set_ic_done(&mut self, done: bool) {
        self.ic_done = done;
    }

    /// Total number of bytes needed to decode the next PDU given what has
    /// been received: [`CH_LEN`] if the common header is incomplete, else
    /// its PLEN (after validating the common header).
    pub fn needed(&self, buf: &[u8]) -> Result<usize, PduError> {
        match CommonHeader::parse(buf) {
            None => Ok(CH_LEN),
            Some(ch) => Ok(self.layout(&ch)?.plen),
        }
    }

    fn layout(&self, ch: &CommonHeader) -> Result<Layout, PduError> {
        let ty = PduType::from_u8(ch.pdu_type).ok_or(PduError::UnknownType {
            pdu_type: ch.pdu_type,
        })?;
        let ours = match self.cfg.role {
            Role::Target => ty.is_host_to_controller(),
            Role::Host => !ty.is_host_to_controller(),
        };
        if !ours {
            return Err(PduError::WrongDirection { pdu_type: ty });
        }
        if ch.hlen != ty.hlen() {
            return Err(PduError::InvalidHlen {
                pdu_type: ty,
                hlen: ch.hlen,
                expected: ty.hlen(),
            });
        }
        // Sequencing around connection initialization.
        let is_ic = matches!(ty, PduType::IcReq | PduType::IcResp);
        let is_term = matches!(ty, PduType::H2CTermReq | PduType::C2HTermReq);
        if is_ic == self.ic_done && !is_term {
            return Err(PduError::Sequence { pdu_type: ty });
        }

        let plen = ch.plen;
        if plen > self.cfg.max_pdu_len {
            return Err(PduError::PduTooLarge {
                pdu_type: ty,
                plen,
                max: self.cfg.max_pdu_len,
            });
        }
        let plen_us = plen as usize;
        let hlen = ch.hlen as usize;
        let bad_flags = PduError::InvalidFlags {
            pdu_type: ty,
            flags: ch.flags,
        };
        let bad_plen = PduError::InvalidPlen { pdu_type: ty, plen };

        if !ty.digests_apply() {
            if ch.flags & (flags::HDGSTF | flags::DDGSTF) != 0 {
                return Err(bad_flags);
            }
            let ok = if is_term {
                (hlen..=TERM_REQ_MAX_PLEN as usize).contains(&plen_us)
            } else {
                plen_us == hlen
            };
            if !ok {
                return Err(bad_plen);
            }
            let data = is_term.then_some((hlen, plen_us));
            return Ok(Layout {
                ty,
                hlen,
                plen: plen_us,
                hd: false,
                data,
                dd: false,
            });
        }

        let hd = ch.flags & flags::HDGSTF != 0;
        if hd != self.hdgst {
            return Err(bad_flags);
        }
        let hdr_end = hlen + if hd { DIGEST_LEN } else { 0 };
        if plen_us < hdr_end {
            return Err(bad_plen);
        }
        let has_data = plen_us > hdr_end;
        if has_data && !ty.may_carry_data() {
            return Err(bad_plen);
        }
        let dd = ch.flags & flags::DDGSTF != 0;
        if dd != (self.ddgst && has_data) {
            return Err(bad_flags);
        }
        if ty == PduType::C2HData
            && ch.flags & flags::SUCCESS != 0
            && ch.flags & flags::LAST_PDU == 0
        {
            return Err(bad_flags);
        }
        let data = if has_data {
            let pdo = ch.pdo as usize;
            let dd_len = if dd { DIGEST_LEN } else { 0 };
            if pdo < hdr_end
                || !pdo.is_multiple_of(pda_bytes(self.rx_pda))
                || pdo + dd_len >= plen_us
            {
                return Err(PduError::InvalidPdo {
                    pdu_type: ty,
                    pdo: ch.pdo,
                    plen,
                });
            }
            Some((pdo, plen_us - dd_len))
        } else {
            None
        };
        Ok(Layout {
            ty,
            hlen,
            plen: plen_us,
            hd,
            data,
            dd,
        })
    }

    /// Decode the next PDU from `buf` (all bytes received and not yet
    /// consumed). Returns `Ok(None)` if `buf` does not hold a complete PDU
    /// yet (see [`PduDecoder::needed`] for how many bytes are required),
    /// else the PDU and the number of bytes it occupied.
    pub fn decode<'a>(&mut self, buf: &'a [u8]) -> Result<Option<(Pdu<'a>, usize)>, PduError> {
        let Some(ch) = CommonHeader::parse(buf) else {
            return Ok(None);
        };
        let lay = self.layout(&ch)?;
        let Some(pdu_bytes) = buf.get(..lay.plen) else {
            return Ok(None);
        };
        let hdr = pdu_bytes.get(..lay.hlen).unwrap_or_default();

        if lay.hd {
            let received = rd32(pdu_bytes, lay.hlen);
            let computed = digest::header_digest(hdr);
            if received != computed {
                return Err(PduError::HeaderDigest { received, computed });
            }
        }

        let data: &'a [u8] = match lay.data {
            Some((s, e)) => pdu_bytes.get(s..e).unwrap_or_default(),
            None => &[],
        };

        let pdu = match lay.ty {
            PduType::IcReq => {
                let r = IcReq {
                    pfv: rd16(hdr, 8),
                    hpda: hdr.get(10).copied().unwrap_or(0),
                    hdgst: hdr.get(11).copied().unwrap_or(0) & DGST_HEADER != 0,
                    ddgst: hdr.get(11).copied().unwrap_or(0) & DGST_DATA != 0,
                    maxr2t: rd32(hdr, 12),
                };
                check_ic(r.pfv, r.hpda)?;
                Pdu::IcReq(r)
            }
            PduType::IcResp => {
                let r = IcResp {
                    pfv: rd16(hdr, 8),
                    cpda: hdr.get(10).copied().unwrap_or(0),
                    hdgst: hdr.get(11).copied().unwrap_or(0) & DGST_HEADER != 0,
                    ddgst: hdr.get(11).copied().unwrap_or(0) & DGST_DATA != 0,
                    maxh2cdata: rd32(hdr, 12),
                };
                check_ic(r.pfv, r.cpda)?;
                Pdu::IcResp(r)
            }
            PduType::H2CTermReq | PduType::C2HTermReq => {
                let t = TermReq {
                    fes: rd16(hdr, 8),
                    fei: rd32(hdr, 10),
                    data,
                };
                if lay.ty == PduType::H2CTermReq {
                    Pdu::H2CTermReq(t)
                } else {
                    Pdu::C2HTermReq(t)
                }
            }
            PduType::CapsuleCmd => {
                let sqe = hdr
                    .get(CH_LEN..CH_LEN + SQE_LEN)
                    .and_then(|s| <&[u8; SQE_LEN]>::try_from(s).ok())
                    .ok_or(PduError::InvalidHlen {
                        pdu_type: lay.ty,
                        hlen: ch.hlen,
                        expected: HLEN_CAPSULE_CMD,
                    })?;
                Pdu::CapsuleCmd(CapsuleCmd { sqe, data })
            }
            PduType::CapsuleResp => {
                let cqe = hdr
                    .get(CH_LEN..CH_LEN + CQE_LEN)
                    .and_then(|s| <&[u8; CQE_LEN]>::try_from(s).ok())
                    .ok_or(PduError::InvalidHlen {
                        pdu_type: lay.ty,
                        hlen: ch.hlen,
                        expected: HLEN_CAPSULE_RESP,
                    })?;
                Pdu::CapsuleResp(CapsuleResp { cqe })
            }
            PduType::H2CData | PduType::C2HData => {
                let h2c = lay.ty == PduType::H2CData;
                let d = DataPdu {
                    cccid: rd16(hdr, 8),
                    ttag: if h2c { rd16(hdr, 10) } else { 0 },
                    datao: rd32(hdr, 12),
                    datal: rd32(hdr, 16),
                    last: ch.flags & flags::LAST_PDU != 0,
                    success: !h2c && ch.flags & flags::SUCCESS != 0,
                    data,
                };
                if d.datal as usize != data.len() {
                    return Err(PduError::DataLengthMismatch {
                        datal: d.datal,
                        actual: data.len() as u32,
                    });
                }
                if h2c && self.cfg.max_h2c_data != 0 && d.datal > self.cfg.max_h2c_data {
                    return Err(PduError::DataLimitExceeded {
                        datal: d.datal,
                        max: self.cfg.max_h2c_data,
                    });
                }
                if h2c {
                    Pdu::H2CData(d)
                } else {
                    Pdu::C2HData(d)
                }
            }
            PduType::R2T => Pdu::R2T(R2t {
                cccid: rd16(hdr, 8),
                ttag: rd16(hdr, 10),
                r2to: rd32(hdr, 12),
                r2tl: rd32(hdr, 16),
            }),
        };

        if lay.dd {
            let received = rd32(pdu_bytes, lay.plen - DIGEST_LEN);
            let computed = digest::data_digest(data);
            if received != computed {
                let cccid = match &pdu {
                    Pdu::CapsuleCmd(c) => c.cid(),
                    Pdu::H2CData(d) | Pdu::C2HData(d) => d.cccid,
                    _ => 0,
                };
                return Err(PduError::DataDigest {
                    received,
                    computed,
                    cccid,
                    consumed: lay.plen,
                });
            }
        }

        if matches!(pdu, Pdu::IcReq(_) | Pdu::IcResp(_)) {
            self.ic_done = true;
        }
        Ok(Some((pdu, lay.plen)))
    }
}

fn check_ic(pfv: u16, pda: u8) -> Result<(), PduError> {
    if pfv != PFV_1_0 {
        return Err(PduError::UnsupportedParameter {
            offset: offsets::PFV,
            value: pfv as u32,
        });
    }
    if pda > MAX_PDA {
        return Err(PduError::UnsupportedParameter {
            offset: offsets::PDA,
            value: pda as u32,
        });
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Encoding
// ---------------------------------------------------------------------------

#[inline]
fn put_ch(out: &mut Vec<u8>, ty: PduType, flags: u8, pdo: u8, plen: u32) {
    out.extend_from_slice(&[ty as u8, flags, ty.hlen(), pdo]);
    out.extend_from_slice(&plen.to_le_bytes());
}

fn dgst_byte(h: bool, d: bool) -> u8 {
    (if h { DGST_HEADER } else { 0 }) | (if d { DGST_DATA } else { 0 })
}

/// Append an ICReq PDU (128 bytes).
pub fn encode_icreq(out: &mut Vec<u8>, r: &IcReq) {
    out.reserve(HLEN_IC as usize);
    let start = out.len();
    put_ch(out, PduType::IcReq, 0, 0, HLEN_IC as u32);
    out.extend_from_slice(&r.pfv.to_le_bytes());
    out.push(r.hpda);
    out.push(dgst_byte(r.hdgst, r.ddgst));
    out.extend_from_slice(&r.maxr2t.to_le_bytes());
    out.resize(start + HLEN_IC as usize, 0);
}

/// Append an ICResp PDU (128 bytes).
pub fn encode_icresp(out: &mut Vec<u8>, r: &IcResp) {
    out.reserve(HLEN_IC as usize);
    let start = out.len();
    put_ch(out, PduType::IcResp, 0, 0, HLEN_IC as u32);
    out.extend_from_slice(&r.pfv.to_le_bytes());
    out.push(r.cpda);
    out.push(dgst_byte(r.hdgst, r.ddgst));
    out.extend_from_slice(&r.maxh2cdata.to_le_bytes());
    out.resize(start + HLEN_IC as usize, 0);
}

fn encode_term_req(out: &mut Vec<u8>, ty: PduType, fes: u16, fei: u32, data: &[u8]) {
    let data = data.get(..TERM_REQ_MAX_DATA).unwrap_or(data);
    let plen = HLEN_TERM_REQ as usize + data.len();
    out.reserve(plen);
    let start = out.len();
    put_ch(out, ty, 0, 0, plen as u32);
    out.extend_from_slice(&fes.to_le_bytes());
    out.extend_from_slice(&fei.to_le_bytes());
    out.resize(start + HLEN_TERM_REQ as usize, 0);
    out.extend_from_slice(data);
}

/// Append an H2CTermReq. `data` (the offending PDU header) is truncated to
/// [`TERM_REQ_MAX_DATA`] bytes. Never carries digests.
pub fn encode_h2c_term_req(out: &mut Vec<u8>, fes: Fes, fei: u32, data: &[u8]) {
    encode_term_req(out, PduType::H2CTermReq, fes as u16, fei, data)
}

/// Append a C2HTermReq. `data` (the offending PDU header) is truncated to
/// [`TERM_REQ_MAX_DATA`] bytes. Never carries digests.
pub fn encode_c2h_term_req(out: &mut Vec<u8>, fes: Fes, fei: u32, data: &[u8]) {
    encode_term_req(out, PduType::C2HTermReq, fes as u16, fei, data)
}

/// Encoder for the PDUs that follow connection initialization; holds the
/// negotiated digests and the alignment the peer asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PduEncoder {
    hdgst: bool,
    ddgst: bool,
    tx_pda: u8,
}

impl PduEncoder {
    /// `tx_pda` is the peer's alignment requirement for PDUs we send with
    /// data: the CPDA from ICResp (host) or the HPDA from ICReq (target).
    pub fn new(header_digest: bool, data_digest: bool, tx_pda: u8) -> Self {
        Self {
            hdgst: header_digest,
            ddgst: data_digest,
            tx_pda: tx_pda.min(MAX_PDA),
        }
    }

    /// Header digest enabled.
    pub fn header_digest(&self) -> bool {
        self.hdgst
    }

    /// Data digest enabled.
    pub fn data_digest(&self) -> bool {
        self.ddgst
    }

    fn hd_len(&self) -> usize {
        if self.hdgst {
            DIGEST_LEN
        } else {
            0
        }
    }

    fn dd_len(&self) -> usize {
        if self.ddgst {
            DIGEST_LEN
        } else {
            0
        }
    }

    /// PDO used for a data-carrying PDU of type `ty`: header plus header
    /// digest, rounded up to the peer's alignment.
    pub fn data_offset(&self, ty: PduType) -> usize {
        let min = ty.hlen() as usize + self.hd_len();
        min.div_ceil(pda_bytes(self.tx_pda)) * pda_bytes(self.tx_pda)
    }

    /// Total PDU length for a PDU of type `ty` with `data_len` bytes of data.
    pub fn pdu_len(&self, ty: PduType, data_len: usize) -> usize {
        if data_len == 0 {
            ty.hlen() as usize + self.hd_len()
        } else {
            self.data_offset(ty) + data_len + self.dd_len()
        }
    }

    /// Write CH + PSH (from `psh`, following the CH), the header digest and
    /// padding. Returns nothing; the data and data digest follow.
    fn put_header(
        &self,
        out: &mut Vec<u8>,
        ty: PduType,
        extra_flags: u8,
        psh: &[u8],
        data_len: usize,
    ) {
        let plen = self.pdu_len(ty, data_len);
        let mut fl = extra_flags;
        if self.hdgst {
            fl |= flags::HDGSTF;
        }
        let pdo = if data_len > 0 {
            if self.ddgst {
                fl |= flags::DDGSTF;
            }
            self.data_offset(ty)
        } else {
            0
        };
        out.reserve(if data_len > 0 { pdo } else { plen });
        let start = out.len();
        put_ch(out, ty, fl, pdo as u8, plen as u32);
        out.extend_from_slice(psh);
        out.resize(start + ty.hlen() as usize, 0);
        if self.hdgst {
            let d = digest::header_digest(&out[start..]);
            digest::put_digest(out, d);
        }
        if data_len > 0 {
            out.resize(start + pdo, 0);
        }
    }

    /// Append the data digest of `data` if data digests are enabled.
    pub fn put_data_digest(&self, out: &mut Vec<u8>, data: &[u8]) {
        if self.ddgst {
            digest::put_digest(out, digest::data_digest(data));
        }
    }

    /// Append a data digest trailer with a precomputed value (e.g. from
    /// [`digest::DataDigest`]) if data digests are enabled.
    pub fn put_data_digest_value(&self, out: &mut Vec<u8>, value: u32) {
        if self.ddgst {
            digest::put_digest(out, value);
        }
    }

    /// Append a whole CapsuleCmd with optional in-capsule data.
    pub fn capsule_cmd(&self, out: &mut Vec<u8>, sqe: &[u8; SQE_LEN], data: &[u8]) {
        self.put_header(out, PduType::CapsuleCmd, 0, sqe, data.len());
        if !data.is_empty() {
            out.extend_from_slice(data);
            self.put_data_digest(out, data);
        }
    }

    /// Append a CapsuleResp.
    pub fn capsule_resp(&self, out: &mut Vec<u8>, cqe: &[u8; CQE_LEN]) {
        self.put_header(out, PduType::CapsuleResp, 0, cqe, 0);
    }

    /// Append an R2T.
    pub fn r2t(&self, out: &mut Vec<u8>, cccid: u16, ttag: u16, r2to: u32, r2tl: u32) {
        let mut psh = [0u8; 16];
        psh[0..2].copy_from_slice(&cccid.to_le_bytes());
        psh[2..4].copy_from_slice(&ttag.to_le_bytes());
        psh[4..8].copy_from_slice(&r2to.to_le_bytes());
        psh[8..12].copy_from_slice(&r2tl.to_le_bytes());
        self.put_header(out, PduType::R2T, 0, &psh, 0);
    }

    /// Append an H2CData header (with digest and padding) for `datal` bytes
    /// of data that the caller sends next, followed by the data digest
    /// trailer ([`PduEncoder::put_data_digest`]).
    pub fn h2c_data_header(
        &self,
        out: &mut Vec<u8>,
        cccid: u16,
        ttag: u16,
        datao: u32,
        datal: u32,
        last: bool,
    ) {
        let mut psh = [0u8; 16];
        psh[0..2].copy_from_slice(&cccid.to_le_bytes());
        psh[2..4].copy_from_slice(&ttag.to_le_bytes());
        psh[4..8].copy_from_slice(&datao.to_le_bytes());
        psh[8..12].copy_from_slice(&datal.to_le_bytes());
        let fl = if last { flags::LAST_PDU } else { 0 };
        self.put_header(out, PduType::H2CData, fl, &psh, datal as usize);
    }

    /// Append a C2HData header (with digest and padding) for `datal` bytes
    /// of data that the caller sends next, followed by the data digest
    /// trailer. `success` implies `last`.
    pub fn c2h_data_header(
        &self,
        out: &mut Vec<u8>,
        cccid: u16,
        datao: u32,
        datal: u32,
        last: bool,
        success: bool,
    ) {
        let mut psh = [0u8; 16];
        psh[0..2].copy_from_slice(&cccid.to_le_bytes());
        psh[4..8].copy_from_slice(&datao.to_le_bytes());
        psh[8..12].copy_from_slice(&datal.to_le_bytes());
        let mut fl = 0;
        if last || success {
            fl |= flags::LAST_PDU;
        }
        if success {
            fl |= flags::SUCCESS;
        }
        self.put_header(out, PduType::C2HData, fl, &psh, datal as usize);
    }

    /// Append a whole H2CData PDU (header, data, data digest).
    pub fn h2c_data(
        &self,
        out: &mut Vec<u8>,
        cccid: u16,
        ttag: u16,
        datao: u32,
        data: &[u8],
        last: bool,
    ) {
        self.h2c_data_header(out, cccid, ttag, datao, data.len() as u32, last);
        out.extend_from_slice(data);
        if !data.is_empty() {
            self.put_data_digest(out, data);
        }
    }

    /// Append a whole C2HData PDU (header, data, data digest).
    pub fn c2h_data(
        &self,
        out: &mut Vec<u8>,
        cccid: u16,
        datao: u32,
        data: &[u8],
        last: bool,
        success: bool,
    ) {
        self.c2h_data_header(out, cccid, datao, data.len() as u32, last, success);
        out.extend_from_slice(data);
        if !data.is_empty() {
            self.put_data_digest(out, data);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target() -> PduDecoder {
        let mut d = PduDecoder::new(DecoderConfig::new(Role::Target));
        d.set_ic_done(true);
        d
    }

    fn host() -> PduDecoder {
        let mut d = PduDecoder::new(DecoderConfig::new(Role::Host));
        d.set_ic_done(true);
        d
    }

    fn sqe(cid: u16) -> [u8; SQE_LEN] {
        let mut s = [0u8; SQE_LEN];
        s[0] = 0x01;
        s[2..4].copy_from_slice(&cid.to_le_bytes());
        for (i, b) in s.iter_mut().enumerate().skip(4) {
            *b = i as u8;
        }
        s
    }

    fn cqe(cid: u16) -> [u8; CQE_LEN] {
        let mut c = [0u8; CQE_LEN];
        c[0] = 0xaa;
        c[12..14].copy_from_slice(&cid.to_le_bytes());
        c
    }

    /// Decodes `bytes` as exactly one PDU, checking that every strict
    /// prefix asks for more data and that `needed` is consistent.
    fn decode_one<'a>(dec: &mut PduDecoder, bytes: &'a [u8]) -> Result<Pdu<'a>, PduError> {
        for k in 0..bytes.len() {
            let mut d = dec.clone();
            assert_eq!(
                d.decode(&bytes[..k]),
                Ok(None),
                "prefix {k} of {}",
                bytes.len()
            );
            let n = dec.needed(&bytes[..k]).expect("needed on valid prefix");
            assert!(n > k, "needed {n} for prefix {k}");
            assert!(n <= bytes.len());
        }
        assert_eq!(dec.needed(bytes), Ok(bytes.len()));
        let (p, used) = dec.decode(bytes)?.expect("complete pdu");
        assert_eq!(used, bytes.len());
        Ok(p)
    }

    // ---- ICReq / ICResp ---------------------------------------------------

    #[test]
    fn icreq_bytes_and_round_trip() {
        let r = IcReq {
            pfv: 0,
            hpda: 2,
            hdgst: true,
            ddgst: false,
            maxr2t: 7,
        };
        let mut out = Vec::new();
        encode_icreq(&mut out, &r);
        assert_eq!(out.len(), 128);
        assert_eq!(&out[..8], &[0x00, 0x00, 128, 0, 128, 0, 0, 0]);
        assert_eq!(&out[8..16], &[0, 0, 2, 0x01, 7, 0, 0, 0]);
        assert!(out[16..].iter().all(|&b| b == 0));
        let mut dec = PduDecoder::new(DecoderConfig::new(Role::Target));
        assert!(!dec.ic_done());
        assert_eq!(decode_one(&mut dec, &out), Ok(Pdu::IcReq(r)));
        assert!(dec.ic_done());
        // A second ICReq is a sequence error.
        assert_eq!(
            dec.decode(&out),
            Err(PduError::Sequence {
                pdu_type: PduType::IcReq
            })
        );
        assert_eq!(
            dec.decode(&out).unwrap_err().term_req_info(),
            Some((Fes::PduSequenceError, 0))
        );
    }

    #[test]
    fn icresp_bytes_and_round_trip() {
        let r = IcResp {
            pfv: 0,
            cpda: 0,
            hdgst: true,
            ddgst: true,
            maxh2cdata: 0x20000,
        };
        let mut out = Vec::new();
        encode_icresp(&mut out, &r);
        assert_eq!(out.len(), 128);
        assert_eq!(
            &out[..16],
            &[0x01, 0, 128, 0, 128, 0, 0, 0, 0, 0, 0, 0x03, 0, 0, 2, 0]
        );
        let mut dec = PduDecoder::new(DecoderConfig::new(Role::Host));
        assert_eq!(decode_one(&mut dec, &out), Ok(Pdu::IcResp(r)));
    }

    #[test]
    fn commands_before_icreq_are_sequence_errors() {
        let mut out = Vec::new();
        PduEncoder::default().capsule_cmd(&mut out, &sqe(1), &[]);
        let mut dec = PduDecoder::new(DecoderConfig::new(Role::Target));
        assert_eq!(
            dec.decode(&out),
            Err(PduError::Sequence {
                pdu_type: PduType::CapsuleCmd
            })
        );
        // But a TermReq is fine at any time.
        out.clear();
        encode_h2c_term_req(&mut out, Fes::InvalidHeaderField, 2, &[1, 2, 3]);
        assert!(matches!(
            dec.decode(&out),
            Ok(Some((Pdu::H2CTermReq(_), 27)))
        ));
    }

    #[test]
    fn ic_unsupported_parameters() {
        let mut out = Vec::new();
        encode_icreq(
            &mut out,
            &IcReq {
                pfv: 1,
                ..Default::default()
            },
        );
        let mut dec = PduDecoder::new(DecoderConfig::new(Role::Target));
        let e = dec.decode(&out).unwrap_err();
        assert_eq!(e.term_req_info(), Some((Fes::UnsupportedParameter, 8)));
        assert!(!dec.ic_done());
        out.clear();
        encode_icreq(
            &mut out,
            &IcReq {
                hpda: 32,
                ..Default::default()
            },
        );
        let e = dec.decode(&out).unwrap_err();
        assert_eq!(e.term_req_info(), Some((Fes::UnsupportedParameter, 10)));
    }

    #[test]
    fn ic_digest_flags_or_bad_plen_rejected() {
        let mut out = Vec::new();
        encode_icreq(&mut out, &IcReq::default());
        let mut bad = out.clone();
        bad[1] = flags::HDGSTF;
        let mut dec = PduDecoder::new(DecoderConfig::new(Role::Target));
        assert_eq!(
            dec.decode(&bad).unwrap_err().term_req_info(),
            Some((Fes::InvalidHeaderField, 1))
        );
        let mut bad = out.clone();
        bad[4] = 129;
        bad.push(0);
        assert_eq!(
            dec.decode(&bad).unwrap_err().term_req_info(),
            Some((Fes::InvalidHeaderField, 4))
        );
    }

    // ---- TermReq ------------------------------------------------------------

    #[test]
    fn term_req_round_trip_and_truncation() {
        let mut out = Vec::new();
        encode_c2h_term_req(&mut out, Fes::HeaderDigestError, 0x0102_0304, &[0xee; 200]);
        assert_eq!(out.len(), 152);
        assert_eq!(
            &out[..14],
            &[0x03, 0, 24, 0, 152, 0, 0, 0, 0x03, 0, 0x04, 0x03, 0x02, 0x01]
        );
        let mut dec = host();
        let p = decode_one(&mut dec, &out).unwrap();
        assert_eq!(
            p,
            Pdu::C2HTermReq(TermReq {
                fes: 3,
                fei: 0x0102_0304,
                data: &[0xee; 128]
            })
        );
        // Digests are never applied to TermReqs, even when negotiated.
        let mut dec = host();
        dec.set_digests(true, true);
        assert!(decode_one(&mut dec, &out).is_ok());
        // Over 152 bytes is invalid.
        let mut bad = out.clone();
        bad[4] = 153;
        bad.push(0);
        assert_eq!(
            dec.decode(&bad).unwrap_err().term_req_info(),
            Some((Fes::InvalidHeaderField, 4))
        );
    }

    #[test]
    fn h2c_term_req_header_only() {
        let mut out = Vec::new();
        encode_h2c_term_req(&mut out, Fes::PduSequenceError, 0, &[]);
        assert_eq!(out.len(), 24);
        let p = decode_one(&mut target(), &out).unwrap();
        assert_eq!(
            p,
            Pdu::H2CTermReq(TermReq {
                fes: 2,
                fei: 0,
                data: &[]
            })
        );
    }

    // ---- CapsuleCmd ---------------------------------------------------------

    #[test]
    fn capsule_cmd_no_data() {
        for hd in [false, true] {
            let enc = PduEncoder::new(hd, true, 0);
            let mut out = Vec::new();
            let s = sqe(0x1234);
            enc.capsule_cmd(&mut out, &s, &[]);
            let expect_len = 72 + if hd { 4 } else { 0 };
            assert_eq!(out.len(), expect_len);
            assert_eq!(out[0], 0x04);
            assert_eq!(out[1], if hd { flags::HDGSTF } else { 0 });
            assert_eq!(out[2], 72);
            assert_eq!(out[3], 0);
            assert_eq!(&out[4..8], &(expect_len as u32).to_le_bytes());
            assert_eq!(&out[8..72], &s);
            let mut dec = target();
            dec.set_digests(hd, true);
            let p = decode_one(&mut dec, &out).unwrap();
            let Pdu::CapsuleCmd(c) = p else {
                panic!("{p:?}")
            };
            assert_eq!(c.sqe, &s);
            assert_eq!(c.cid(), 0x1234);
            assert_eq!(c.opcode(), 0x01);
            assert!(c.data.is_empty());
        }
    }

    #[test]
    fn capsule_cmd_in_capsule_data_all_digest_combinations() {
        let data: Vec<u8> = (0..4096u32).map(|i| (i % 251) as u8).collect();
        for hd in [false, true] {
            for dd in [false, true] {
                let enc = PduEncoder::new(hd, dd, 0);
                let mut out = Vec::new();
                enc.capsule_cmd(&mut out, &sqe(7), &data);
                let pdo = 72 + if hd { 4 } else { 0 };
                assert_eq!(out[3] as usize, pdo);
                assert_eq!(out.len(), pdo + data.len() + if dd { 4 } else { 0 });
                assert_eq!(out[1] & flags::DDGSTF != 0, dd);
                assert_eq!(&out[pdo..pdo + data.len()], &data[..]);
                let mut dec = target();
                dec.set_digests(hd, dd);
                let (p, used) = dec.decode(&out).unwrap().unwrap();
                assert_eq!(used, out.len());
                let Pdu::CapsuleCmd(c) = p else { panic!() };
                assert_eq!(c.data, &data[..]);
                // Zero copy: the slice points into the input buffer.
                assert_eq!(c.data.as_ptr(), out[pdo..].as_ptr());
            }
        }
    }

    #[test]
    fn capsule_cmd_truncation_every_split() {
        let enc = PduEncoder::new(true, true, 0);
        let mut out = Vec::new();
        enc.capsule_cmd(&mut out, &sqe(9), &[5u8; 100]);
        let mut dec = target();
        dec.set_digests(true, true);
        assert!(matches!(decode_one(&mut dec, &out), Ok(Pdu::CapsuleCmd(_))));
    }

    #[test]
    fn header_digest_error() {
        let enc = PduEncoder::new(true, false, 0);
        let mut out = Vec::new();
        enc.capsule_cmd(&mut out, &sqe(9), &[]);
        out[20] ^= 0x40;
        let mut dec = target();
        dec.set_digests(true, false);
        let e = dec.decode(&out).unwrap_err();
        assert!(matches!(e, PduError::HeaderDigest { .. }));
        assert_eq!(e.term_req_info(), Some((Fes::HeaderDigestError, 0)));
        // Corrupting the digest itself is detected too.
        let mut out2 = Vec::new();
        enc.capsule_cmd(&mut out2, &sqe(9), &[]);
        out2[73] ^= 1;
        assert!(matches!(
            dec.decode(&out2),
            Err(PduError::HeaderDigest { .. })
        ));
    }

    #[test]
    fn data_digest_error_reports_consumed_and_cid() {
        let enc = PduEncoder::new(false, true, 0);
        let mut out = Vec::new();
        enc.capsule_cmd(&mut out, &sqe(0x55), &[1u8; 64]);
        let n = out.len();
        out[100] ^= 0xff;
        let mut dec = target();
        dec.set_digests(false, true);
        let e = dec.decode(&out).unwrap_err();
        let PduError::DataDigest {
            cccid, consumed, ..
        } = e
        else {
            panic!("{e:?}")
        };
        assert_eq!((cccid, consumed), (0x55, n));
        assert!(!e.is_fatal());
        assert_eq!(e.fes(), None);
    }

    #[test]
    fn digest_flags_must_match_negotiation() {
        // Sent with header digest, receiver negotiated none.
        let mut out = Vec::new();
        PduEncoder::new(true, false, 0).capsule_cmd(&mut out, &sqe(1), &[]);
        let e = target().decode(&out).unwrap_err();
        assert_eq!(e.term_req_info(), Some((Fes::InvalidHeaderField, 1)));
        // Sent without, receiver expects header digest.
        out.clear();
        PduEncoder::new(false, false, 0).capsule_cmd(&mut out, &sqe(1), &[]);
        let mut dec = target();
        dec.set_digests(true, false);
        assert!(matches!(
            dec.decode(&out),
            Err(PduError::InvalidFlags { .. })
        ));
        // Data without data digest while negotiated.
        out.clear();
        PduEncoder::new(false, false, 0).capsule_cmd(&mut out, &sqe(1), &[1, 2, 3, 4]);
        let mut dec = target();
        dec.set_digests(false, true);
        assert!(matches!(
            dec.decode(&out),
            Err(PduError::InvalidFlags { .. })
        ));
        // No data but DDGSTF set.
        let mut out = Vec::new();
        PduEncoder::new(false, true, 0).capsule_cmd(&mut out, &sqe(1), &[]);
        out[1] |= flags::DDGSTF;
        let mut dec = target();
        dec.set_digests(false, true);
        assert!(matches!(
            dec.decode(&out),
            Err(PduError::InvalidFlags { .. })
        ));
    }

    // ---- CapsuleResp ----------------------------------------------------------

    #[test]
    fn capsule_resp_round_trip() {
        for hd in [false, true] {
            let enc = PduEncoder::new(hd, true, 3);
            let mut out = Vec::new();
            let c = cqe(0xbeef);
            enc.capsule_resp(&mut out, &c);
            assert_eq!(out.len(), 24 + if hd { 4 } else { 0 });
            assert_eq!(&out[..4], &[0x05, if hd { 1 } else { 0 }, 24, 0]);
            let mut dec = host();
            dec.set_digests(hd, true);
            let p = decode_one(&mut dec, &out).unwrap();
            let Pdu::CapsuleResp(r) = p else { panic!() };
            assert_eq!(r.cqe, &c);
            assert_eq!(r.cid(), 0xbeef);
        }
    }

    #[test]
    fn capsule_resp_with_data_is_invalid() {
        let mut out = Vec::new();
        PduEncoder::default().capsule_resp(&mut out, &cqe(1));
        out[3] = 24;
        out[4] = 28;
        out.extend_from_slice(&[0; 4]);
        assert_eq!(
            host().decode(&out).unwrap_err().term_req_info(),
            Some((Fes::InvalidHeaderField, 4))
        );
    }

    // ---- R2T ------------------------------------------------------------------

    #[test]
    fn r2t_round_trip() {
        for hd in [false, true] {
            let enc = PduEncoder::new(hd, false, 0);
            let mut out = Vec::new();
            enc.r2t(&mut out, 0x11, 0x22, 4096, 8192);
            assert_eq!(out.len(), 24 + if hd { 4 } else { 0 });
            assert_eq!(
                &out[8..20],
                &[0x11, 0, 0x22, 0, 0, 0x10, 0, 0, 0, 0x20, 0, 0]
            );
            let mut dec = host();
            dec.set_digests(hd, false);
            assert_eq!(
                decode_one(&mut dec, &out),
                Ok(Pdu::R2T(R2t {
                    cccid: 0x11,
                    ttag: 0x22,
                    r2to: 4096,
                    r2tl: 8192
                }))
            );
        }
    }

    // ---- H2CData / C2HData ----------------------------------------------------

    #[test]
    fn h2c_data_round_trip_with_padding_and_digests() {
        let data: Vec<u8> = (0..1000u32).map(|i| (i * 13) as u8).collect();
        for pda in [0u8, 1, 3, 7, 31] {
            for hd in [false, true] {
                for dd in [false, true] {
                    let enc = PduEncoder::new(hd, dd, pda);
                    let mut out = Vec::new();
                    enc.h2c_data(&mut out, 3, 9, 512, &data, true);
                    let min: usize = 24 + if hd { 4 } else { 0 };
                    let align = (pda as usize + 1) * 4;
                    let pdo = min.div_ceil(align) * align;
                    assert_eq!(out[3] as usize, pdo, "pda {pda}");
                    assert!(out[min..pdo].iter().all(|&b| b == 0), "pad bytes are zero");
                    assert_eq!(out.len(), pdo + data.len() + if dd { 4 } else { 0 });
                    let mut dec = target();
                    dec.set_digests(hd, dd);
                    dec.set_rx_pda(pda);
                    let (p, used) = dec.decode(&out).unwrap().unwrap();
                    assert_eq!(used, out.len());
                    assert_eq!(
                        p,
                        Pdu::H2CData(DataPdu {
                            cccid: 3,
                            ttag: 9,
                            datao: 512,
                            datal: 1000,
                            last: true,
                            success: false,
                            data: &data
                        })
                    );
                }
            }
        }
    }

    #[test]
    fn misaligned_pdo_rejected() {
        let mut out = Vec::new();
        PduEncoder::new(false, false, 0).h2c_data(&mut out, 1, 1, 0, &[1; 8], true);
        assert_eq!(out[3], 24);
        let mut dec = target();
        dec.set_rx_pda(1); // 8-byte alignment: 24 is fine
        assert!(dec.clone().decode(&out).is_ok());
        dec.set_rx_pda(3); // 16-byte alignment: 24 is not
        assert_eq!(
            dec.decode(&out).unwrap_err().term_req_info(),
            Some((Fes::InvalidHeaderField, 3))
        );
        // PDO inside the header.
        let mut bad = out.clone();
        bad[3] = 20;
        assert!(matches!(
            target().decode(&bad),
            Err(PduError::InvalidPdo { .. })
        ));
        // PDO at/after the end of the PDU.
        let mut bad = out.clone();
        bad[3] = 32;
        assert!(matches!(
            target().decode(&bad),
            Err(PduError::InvalidPdo { .. })
        ));
    }

    #[test]
    fn c2h_data_header_then_payload_writev_style() {
        let enc = PduEncoder::new(true, true, 0);
        let payload = vec![0x5a; 4096];
        let mut hdr = Vec::new();
        enc.c2h_data_header(&mut hdr, 42, 8192, payload.len() as u32, true, true);
        assert_eq!(hdr.len(), 28);
        assert_eq!(
            hdr[1],
            flags::HDGSTF | flags::DDGSTF | flags::LAST_PDU | flags::SUCCESS
        );
        let mut d = digest::DataDigest::new();
        d.update(&payload[..100]);
        d.update(&payload[100..]);
        let mut trailer = Vec::new();
        enc.put_data_digest_value(&mut trailer, d.finish());
        let wire = [hdr.as_slice(), payload.as_slice(), trailer.as_slice()].concat();
        let mut dec = host();
        dec.set_digests(true, true);
        let (p, used) = dec.decode(&wire).unwrap().unwrap();
        assert_eq!(used, wire.len());
        let Pdu::C2HData(c) = p else { panic!() };
        assert_eq!(
            (c.cccid, c.ttag, c.datao, c.datal, c.last, c.success),
            (42, 0, 8192, 4096, true, true)
        );
        assert_eq!(c.data, &payload[..]);
    }

    #[test]
    fn c2h_success_without_last_rejected() {
        let mut out = Vec::new();
        PduEncoder::default().c2h_data(&mut out, 1, 0, &[1; 4], false, false);
        out[1] |= flags::SUCCESS;
        assert!(matches!(
            host().decode(&out),
            Err(PduError::InvalidFlags { .. })
        ));
    }

    #[test]
    fn data_truncation_every_split() {
        let enc = PduEncoder::new(true, true, 1);
        let mut out = Vec::new();
        enc.c2h_data(&mut out, 1, 0, &[7u8; 37], false, false);
        let mut dec = host();
        dec.set_digests(true, true);
        dec.set_rx_pda(1);
        assert!(matches!(decode_one(&mut dec, &out), Ok(Pdu::C2HData(_))));
        let mut out = Vec::new();
        enc.h2c_data(&mut out, 1, 2, 0, &[7u8; 37], false);
        let mut dec = target();
        dec.set_digests(true, true);
        dec.set_rx_pda(1);
        assert!(matches!(decode_one(&mut dec, &out), Ok(Pdu::H2CData(_))));
    }

    #[test]
    fn datal_mismatch_and_limit() {
        let mut out = Vec::new();
        PduEncoder::default().h2c_data(&mut out, 1, 1, 0, &[0; 64], true);
        let mut bad = out.clone();
        bad[16] = 63;
        assert_eq!(
            target().decode(&bad).unwrap_err().term_req_info(),
            Some((Fes::InvalidHeaderField, 16))
        );
        let mut dec = target();
        dec.set_max_h2c_data(32);
        let e = dec.decode(&out).unwrap_err();
        assert_eq!(
            e.term_req_info(),
            Some((Fes::DataTransferLimitExceeded, 16))
        );
    }

    #[test]
    fn data_digest_error_on_h2c() {
        let mut out = Vec::new();
        PduEncoder::new(false, true, 0).h2c_data(&mut out, 77, 1, 0, &[3; 16], true);
        let n = out.len();
        out[n - 1] ^= 1;
        let mut dec = target();
        dec.set_digests(false, true);
        assert!(matches!(
            dec.decode(&out),
            Err(PduError::DataDigest { cccid: 77, consumed, .. }) if consumed == n
        ));
    }

    // ---- Generic header validation ----------------------------------------------

    #[test]
    fn unknown_and_wrong_direction_types() {
        for t in [0x08u8, 0x0a, 0x10, 0xff] {
            let mut b = vec![t, 0, 24, 0, 24, 0, 0, 0];
            b.resize(24, 0);
            let e = target().decode(&b).unwrap_err();
            assert_eq!(e, PduError::UnknownType { pdu_type: t });
            assert_eq!(e.term_req_info(), Some((Fes::InvalidHeaderField, 0)));
            // Detected from the common header alone.
            assert!(target().decode(&b[..8]).is_err());
        }
        let mut out = Vec::new();
        PduEncoder::default().capsule_resp(&mut out, &cqe(1));
        assert_eq!(
            target().decode(&out),
            Err(PduError::WrongDirection {
                pdu_type: PduType::CapsuleResp
            })
        );
        out.clear();
        PduEncoder::default().capsule_cmd(&mut out, &sqe(1), &[]);
        assert!(matches!(
            host().decode(&out),
            Err(PduError::WrongDirection { .. })
        ));
    }

    #[test]
    fn bad_hlen() {
        let mut out = Vec::new();
        PduEncoder::default().capsule_cmd(&mut out, &sqe(1), &[]);
        for h in [0u8, 8, 24, 71, 73, 128, 255] {
            let mut b = out.clone();
            b[2] = h;
            let e = target().decode(&b).unwrap_err();
            assert_eq!(
                e.term_req_info(),
                Some((Fes::InvalidHeaderField, 2)),
                "hlen {h}"
            );
        }
    }

    #[test]
    fn bad_plen() {
        let mut out = Vec::new();
        PduEncoder::default().capsule_cmd(&mut out, &sqe(1), &[]);
        for p in [0u32, 8, 71] {
            let mut b = out.clone();
            b[4..8].copy_from_slice(&p.to_le_bytes());
            let e = target().decode(&b).unwrap_err();
            assert_eq!(
                e.term_req_info(),
                Some((Fes::InvalidHeaderField, 4)),
                "plen {p}"
            );
        }
        // Hostile plen rejected from the first 8 bytes, before buffering.
        let mut b = out[..8].to_vec();
        b[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        b[3] = 72;
        let e = target().decode(&b).unwrap_err();
        assert!(matches!(e, PduError::PduTooLarge { .. }));
        assert_eq!(e.fei(), 4);
        assert!(target().needed(&b).is_err());
        // plen larger than hlen with pdo == 0 for a type carrying data is a bad pdo.
        let mut b = out.clone();
        b[4] = 80;
        b.extend_from_slice(&[0; 8]);
        assert!(matches!(
            target().decode(&b),
            Err(PduError::InvalidPdo { .. })
        ));
    }

    #[test]
    fn max_pdu_len_configurable() {
        let mut out = Vec::new();
        PduEncoder::default().capsule_cmd(&mut out, &sqe(1), &[0; 1000]);
        let mut dec = target();
        dec.set_max_pdu_len(1000);
        assert!(matches!(
            dec.decode(&out),
            Err(PduError::PduTooLarge {
                plen: 1072,
                max: 1000,
                ..
            })
        ));
        dec.set_max_pdu_len(1072);
        assert!(dec.decode(&out).is_ok());
    }

    #[test]
    fn several_pdus_in_one_buffer() {
        let enc = PduEncoder::new(true, true, 0);
        let mut out = Vec::new();
        enc.capsule_resp(&mut out, &cqe(1));
        enc.c2h_data(&mut out, 2, 0, &[9; 10], true, false);
        enc.r2t(&mut out, 3, 4, 0, 512);
        let mut dec = host();
        dec.set_digests(true, true);
        let mut off = 0;
        let mut types = Vec::new();
        while off < out.len() {
            let (p, n) = dec.decode(&out[off..]).unwrap().unwrap();
            types.push(p.pdu_type());
            off += n;
        }
        assert_eq!(off, out.len());
        assert_eq!(
            types,
            [PduType::CapsuleResp, PduType::C2HData, PduType::R2T]
        );
    }

    #[test]
    fn encoders_append_without_clobbering() {
        let mut out = vec![0xde, 0xad];
        PduEncoder::new(true, false, 0).capsule_resp(&mut out, &cqe(1));
        assert_eq!(&out[..2], &[0xde, 0xad]);
        let mut dec = host();
        dec.set_digests(true, false);
        assert!(dec.decode(&out[2..]).unwrap().is_some());
    }

    #[test]
    fn fes_round_trip() {
        for v in 1..=6u16 {
            assert_eq!(Fes::from_u16(v).map(|f| f as u16), Some(v));
        }
        assert_eq!(Fes::from_u16(0), None);
        assert_eq!(Fes::from_u16(7), None);
    }
}
