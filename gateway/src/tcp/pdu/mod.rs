//! NVMe/TCP PDU codec (NVMe/TCP Transport Specification 1.0; field layout as
//! in Linux `include/linux/nvme-tcp.h`).
//!
//! Pure: no I/O, no clock, no allocation except growing the caller's output
//! buffer. Used by both the target (controller) and the host (initiator).
//! This file holds the wire constants, the PDU types and the errors; decoding
//! is in `decode.rs`, encoding in `encode.rs`.
//!
//! Wire layout reminders (all multi-byte fields little-endian):
//!
//! ```text
//! CH:   0 type | 1 flags | 2 hlen | 3 pdo | 4..8 plen
//! PDU:  [CH + PSH: hlen bytes][HDGST 4?][PAD to pdo][DATA][DDGST 4?]
//! ```

use thiserror::Error;

mod decode;
mod encode;
#[cfg(test)]
mod tests;

pub use decode::{pda_bytes, DecoderConfig, PduDecoder, Role};
pub use encode::{
    encode_c2h_term_req, encode_h2c_term_req, encode_icreq, encode_icresp, PduEncoder,
};

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
