//! Structured round trip: builds a PDU from fuzzer-chosen fields, digest
//! settings and alignment, encodes it, and checks that the decoder (set up
//! for the same connection parameters) returns exactly that PDU, that every
//! strict prefix asks for more bytes, and that a single corrupted byte is
//! either caught by a digest, rejected, or lands in ignored bytes — never a
//! panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nvmeof_gateway::tcp::pdu::{
    encode_c2h_term_req, encode_h2c_term_req, encode_icreq, encode_icresp, DataPdu, DecoderConfig,
    Fes, IcReq, IcResp, Pdu, PduDecoder, PduEncoder, PduError, R2t, Role, TermReq,
};

struct Input<'a> {
    b: &'a [u8],
}

impl<'a> Input<'a> {
    fn u8(&mut self) -> u8 {
        match self.b.split_first() {
            Some((&v, rest)) => {
                self.b = rest;
                v
            }
            None => 0,
        }
    }
    fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.u8(), self.u8()])
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.u8(), self.u8(), self.u8(), self.u8()])
    }
    fn array<const N: usize>(&mut self) -> [u8; N] {
        let mut a = [0u8; N];
        for x in a.iter_mut() {
            *x = self.u8();
        }
        a
    }
    fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.b)
    }
}

fuzz_target!(|data: &[u8]| {
    let mut inp = Input { b: data };
    let sel = inp.u8();
    let opt = inp.u8();
    let (hd, dd) = (opt & 1 != 0, opt & 2 != 0);
    let pda = (opt >> 2) & 31;
    let flip = inp.u16();
    let enc = PduEncoder::new(hd, dd, pda);
    let mut out = Vec::new();

    let sqe: [u8; 64];
    let cqe: [u8; 16];
    let payload: Vec<u8>;
    let (role, ic, expected): (Role, bool, Pdu<'_>) = match sel % 9 {
        0 => {
            let r = IcReq {
                pfv: 0,
                hpda: inp.u8() & 31,
                hdgst: inp.u8() & 1 != 0,
                ddgst: inp.u8() & 1 != 0,
                maxr2t: inp.u32(),
            };
            encode_icreq(&mut out, &r);
            (Role::Target, true, Pdu::IcReq(r))
        }
        1 => {
            let r = IcResp {
                pfv: 0,
                cpda: inp.u8() & 31,
                hdgst: inp.u8() & 1 != 0,
                ddgst: inp.u8() & 1 != 0,
                maxh2cdata: inp.u32(),
            };
            encode_icresp(&mut out, &r);
            (Role::Host, true, Pdu::IcResp(r))
        }
        s @ (2 | 3) => {
            let fes = Fes::from_u16(u16::from(inp.u8() % 6 + 1)).unwrap_or(Fes::InvalidHeaderField);
            let fei = inp.u32();
            payload = inp.rest().iter().take(128).copied().collect();
            let t = TermReq {
                fes: fes as u16,
                fei,
                data: &payload,
            };
            if s == 2 {
                encode_h2c_term_req(&mut out, fes, fei, &payload);
                (Role::Target, false, Pdu::H2CTermReq(t))
            } else {
                encode_c2h_term_req(&mut out, fes, fei, &payload);
                (Role::Host, false, Pdu::C2HTermReq(t))
            }
        }
        4 => {
            sqe = inp.array();
            payload = inp.rest().to_vec();
            enc.capsule_cmd(&mut out, &sqe, &payload);
            let c = nvmeof_gateway::tcp::pdu::CapsuleCmd {
                sqe: &sqe,
                data: &payload,
            };
            (Role::Target, false, Pdu::CapsuleCmd(c))
        }
        5 => {
            cqe = inp.array();
            enc.capsule_resp(&mut out, &cqe);
            let r = nvmeof_gateway::tcp::pdu::CapsuleResp { cqe: &cqe };
            (Role::Host, false, Pdu::CapsuleResp(r))
        }
        s @ (6 | 7) => {
            let (cccid, ttag, datao, f) = (inp.u16(), inp.u16(), inp.u32(), inp.u8());
            payload = inp.rest().to_vec();
            let last = f & 1 != 0 || f & 2 != 0;
            let success = s == 7 && f & 2 != 0;
            let d = DataPdu {
                cccid,
                ttag: if s == 6 { ttag } else { 0 },
                datao,
                datal: payload.len() as u32,
                last,
                success,
                data: &payload,
            };
            if s == 6 {
                enc.h2c_data(&mut out, cccid, ttag, datao, &payload, last);
                (Role::Target, false, Pdu::H2CData(d))
            } else {
                enc.c2h_data(&mut out, cccid, datao, &payload, last, success);
                (Role::Host, false, Pdu::C2HData(d))
            }
        }
        _ => {
            let r = R2t {
                cccid: inp.u16(),
                ttag: inp.u16(),
                r2to: inp.u32(),
                r2tl: inp.u32(),
            };
            enc.r2t(&mut out, r.cccid, r.ttag, r.r2to, r.r2tl);
            (Role::Host, false, Pdu::R2T(r))
        }
    };

    let mut cfg = DecoderConfig::new(role);
    cfg.max_pdu_len = u32::MAX;
    let mut dec = PduDecoder::new(cfg);
    dec.set_ic_done(!ic);
    dec.set_digests(hd, dd);
    dec.set_rx_pda(pda);

    for k in [0, 1, 7, 8, out.len() / 2, out.len().saturating_sub(1)] {
        if k < out.len() {
            assert_eq!(dec.clone().decode(&out[..k]), Ok(None), "prefix {k}");
        }
    }
    let (got, used) = dec
        .clone()
        .decode(&out)
        .unwrap_or_else(|e| panic!("{expected:?} encoded as {out:?} failed: {e}"))
        .expect("complete PDU");
    assert_eq!(used, out.len());
    assert_eq!(got, expected);

    // Corrupt one byte and decode again: must not panic; with a digest
    // covering that byte, the corruption must be reported.
    if out.is_empty() {
        return;
    }
    let at = flip as usize % out.len();
    let mut bad = out.clone();
    bad[at] ^= 0xa5;
    let res = dec.clone().decode(&bad);
    let hlen = out[2] as usize;
    let digests_apply = !matches!(
        expected,
        Pdu::IcReq(_) | Pdu::IcResp(_) | Pdu::H2CTermReq(_) | Pdu::C2HTermReq(_)
    );
    if hd && digests_apply && at >= 8 && at < hlen + 4 {
        assert!(
            matches!(res, Err(PduError::HeaderDigest { .. })),
            "header byte {at} corrupted: {res:?}"
        );
    }
    let pdo = out[3] as usize;
    if dd && digests_apply && pdo != 0 && at >= pdo {
        assert!(
            matches!(
                res,
                Err(PduError::DataDigest { .. }) | Err(PduError::DataLengthMismatch { .. })
            ),
            "data byte {at} corrupted: {res:?}"
        );
    }
});
