//! Submission and completion queue entries, as bytes on the wire.

use crate::spec::{fabrics, fuse, sc, sgl};

pub const SQE_LEN: usize = 64;
pub const CQE_LEN: usize = 16;

/// A 64-byte submission queue entry. Accessors decode fields on demand, so holding a command
/// costs one copy of 64 bytes and no parsing of fields the handler never reads.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Command {
    raw: [u8; SQE_LEN],
}

impl std::fmt::Debug for Command {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Command")
            .field("opcode", &format_args!("{:#04x}", self.opcode()))
            .field("cid", &self.cid())
            .field("nsid", &self.nsid())
            .finish_non_exhaustive()
    }
}

/// The data pointer of a fabrics command: always an SGL descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SglDescriptor {
    pub address: u64,
    /// Bytes described: 32 bits, except 24 bits for a keyed data block (RDMA).
    pub length: u32,
    /// The remote key of a keyed data block (bytes 11..15 of the descriptor), else 0.
    pub key: u32,
    /// Upper nibble of the identifier byte (`NVME_*_DESC`).
    pub desc_type: u8,
    /// Lower nibble of the identifier byte (`NVME_SGL_FMT_*`).
    pub subtype: u8,
}

impl SglDescriptor {
    /// Data carried inside the command capsule (offset subtype of a data block descriptor).
    pub fn is_in_capsule(&self) -> bool {
        self.desc_type == sgl::DATA_DESC && self.subtype == sgl::FMT_OFFSET
    }
}

impl Command {
    pub fn from_bytes(raw: &[u8; SQE_LEN]) -> Self {
        Self { raw: *raw }
    }

    pub fn as_bytes(&self) -> &[u8; SQE_LEN] {
        &self.raw
    }

    fn u16_at(&self, at: usize) -> u16 {
        u16::from_le_bytes([self.raw[at], self.raw[at + 1]])
    }

    fn u32_at(&self, at: usize) -> u32 {
        u32::from_le_bytes([
            self.raw[at],
            self.raw[at + 1],
            self.raw[at + 2],
            self.raw[at + 3],
        ])
    }

    pub fn opcode(&self) -> u8 {
        self.raw[0]
    }

    pub fn fuse(&self) -> u8 {
        self.raw[1] & fuse::MASK
    }

    pub fn cid(&self) -> u16 {
        self.u16_at(2)
    }

    pub fn nsid(&self) -> u32 {
        self.u32_at(4)
    }

    /// Fabrics command type (byte 4 of a fabrics command, where the NSID would be).
    pub fn fctype(&self) -> u8 {
        self.raw[4]
    }

    pub fn is_fabrics(&self) -> bool {
        self.opcode() == fabrics::OPCODE
    }

    /// Authentication Send or Receive, whose key exchange may take milliseconds of CPU.
    pub fn is_authentication(&self) -> bool {
        self.is_fabrics() && matches!(self.fctype(), fabrics::AUTH_SEND | fabrics::AUTH_RECEIVE)
    }

    /// Command dword `n` (0..=15).
    pub fn cdw(&self, n: usize) -> u32 {
        self.u32_at(n * 4)
    }

    pub fn sgl(&self) -> SglDescriptor {
        let id = self.raw[39];
        let desc_type = id >> 4;
        let (length, key) = if desc_type == sgl::KEYED_DATA_DESC {
            (
                u32::from_le_bytes([self.raw[32], self.raw[33], self.raw[34], 0]),
                self.u32_at(35),
            )
        } else {
            (self.u32_at(32), 0)
        };
        SglDescriptor {
            address: u64::from_le_bytes(self.raw[24..32].try_into().unwrap_or([0; 8])),
            length,
            key,
            desc_type,
            subtype: id & 0xf,
        }
    }

    /// True when the command moves data from host to controller: bit 0 of the opcode, or of
    /// the fabrics command type (`nvme_is_write` in Linux).
    pub fn is_host_to_controller(&self) -> bool {
        if self.is_fabrics() {
            self.fctype() & 1 == 1
        } else {
            self.opcode() & 1 == 1
        }
    }

    /// Bytes of data the command transfers, as the SGL says.
    pub fn data_len(&self) -> u32 {
        self.sgl().length
    }
}

/// A completion status: `(SCT << 8) | SC` plus the DNR and MORE bits, as Linux's `NVME_SC_*`
/// values. On the wire it sits shifted left by one above the phase tag.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Status(u16);

impl std::fmt::Debug for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Status(sct={:#x}, sc={:#04x}{})",
            self.sct(),
            self.sc(),
            if self.dnr() { ", dnr" } else { "" }
        )
    }
}

impl Status {
    pub const SUCCESS: Status = Status(sc::SUCCESS);

    /// An error the host should not retry on this path.
    pub const fn error(code: u16) -> Self {
        Status(code | sc::DNR)
    }

    /// An error the host may retry (path errors, so multipath fails over).
    pub const fn retryable(code: u16) -> Self {
        Status(code)
    }

    pub const fn from_raw(raw: u16) -> Self {
        Status(raw)
    }

    pub fn raw(self) -> u16 {
        self.0
    }

    pub fn is_success(self) -> bool {
        self.0 & 0x7ff == 0
    }

    /// SCT and SC without the DNR/MORE/CRD bits.
    pub fn code(self) -> u16 {
        self.0 & 0x7ff
    }

    pub fn sct(self) -> u8 {
        ((self.0 >> 8) & 7) as u8
    }

    pub fn sc(self) -> u8 {
        (self.0 & 0xff) as u8
    }

    pub fn dnr(self) -> bool {
        self.0 & sc::DNR != 0
    }
}

/// A 16-byte completion queue entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    /// Command specific result: dword 0 and dword 1.
    pub result: u64,
    pub sq_head: u16,
    pub sq_id: u16,
    pub cid: u16,
    pub status: Status,
}

impl Completion {
    pub fn new(cid: u16, status: Status) -> Self {
        Self {
            result: 0,
            sq_head: 0,
            sq_id: 0,
            cid,
            status,
        }
    }

    pub fn with_result(mut self, result: u64) -> Self {
        self.result = result;
        self
    }

    pub fn to_bytes(&self) -> [u8; CQE_LEN] {
        let mut out = [0u8; CQE_LEN];
        out[0..8].copy_from_slice(&self.result.to_le_bytes());
        out[8..10].copy_from_slice(&self.sq_head.to_le_bytes());
        out[10..12].copy_from_slice(&self.sq_id.to_le_bytes());
        out[12..14].copy_from_slice(&self.cid.to_le_bytes());
        // Bit 0 is the phase tag, meaningless on fabrics: status sits above it.
        out[14..16].copy_from_slice(&(self.status.raw() << 1).to_le_bytes());
        out
    }

    pub fn from_bytes(raw: &[u8; CQE_LEN]) -> Self {
        let u16_at = |at: usize| u16::from_le_bytes([raw[at], raw[at + 1]]);
        Self {
            result: u64::from_le_bytes(raw[0..8].try_into().unwrap_or([0; 8])),
            sq_head: u16_at(8),
            sq_id: u16_at(10),
            cid: u16_at(12),
            status: Status::from_raw(u16_at(14) >> 1),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn completion_round_trips_and_places_status_above_the_phase_bit() {
        let c = Completion {
            result: 0x1122_3344_5566_7788,
            sq_head: 3,
            sq_id: 2,
            cid: 0xbeef,
            status: Status::error(sc::INVALID_FIELD),
        };
        let bytes = c.to_bytes();
        assert_eq!(&bytes[12..14], &[0xef, 0xbe]);
        // INVALID_FIELD (0x2) | DNR (0x4000), shifted left by one.
        assert_eq!(u16::from_le_bytes([bytes[14], bytes[15]]), 0x8004);
        assert_eq!(Completion::from_bytes(&bytes), c);
    }

    #[test]
    fn command_fields_decode_from_their_offsets() {
        let mut raw = [0u8; SQE_LEN];
        raw[0] = 0x02;
        raw[1] = 0x01;
        raw[2..4].copy_from_slice(&7u16.to_le_bytes());
        raw[4..8].copy_from_slice(&1u32.to_le_bytes());
        raw[24..32].copy_from_slice(&0x1000u64.to_le_bytes());
        raw[32..36].copy_from_slice(&4096u32.to_le_bytes());
        raw[39] = 0x5a;
        raw[40..44].copy_from_slice(&99u32.to_le_bytes());
        let cmd = Command::from_bytes(&raw);
        assert_eq!(cmd.opcode(), 0x02);
        assert_eq!(cmd.fuse(), fuse::FIRST);
        assert_eq!(cmd.cid(), 7);
        assert_eq!(cmd.nsid(), 1);
        assert_eq!(cmd.cdw(10), 99);
        let sgl = cmd.sgl();
        assert_eq!(
            (sgl.address, sgl.length, sgl.desc_type, sgl.subtype),
            (0x1000, 4096, 5, 0xa)
        );
        assert!(!cmd.is_host_to_controller(), "read moves data to the host");
    }
}
