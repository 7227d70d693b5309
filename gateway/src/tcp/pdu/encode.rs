//! PDU encoding: appends PDUs to the caller's output buffer.

use super::*;
use crate::tcp::digest::{self, DIGEST_LEN};

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
