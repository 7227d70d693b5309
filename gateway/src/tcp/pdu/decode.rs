//! PDU decoding.
//!
//! Decoding is incremental: [`PduDecoder::decode`] is handed every byte
//! received so far and either asks for more (`Ok(None)`), or returns one PDU
//! whose payload slices borrow from the input together with the number of
//! bytes it occupied. The common header is validated as soon as its 8 bytes
//! are present, so a hostile `plen` is rejected before anything is buffered
//! for it. Errors carry the Fatal Error Status / Fatal Error Information to
//! put in the C2HTermReq / H2CTermReq that should be sent in response.

use super::*;
use crate::tcp::digest::{self, DIGEST_LEN};

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
