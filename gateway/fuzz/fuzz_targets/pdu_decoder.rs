//! Feeds arbitrary bytes to the NVMe/TCP PDU decoder.
//!
//! The first input byte selects the decoder configuration (role, whether
//! the ICReq/ICResp exchange is done, negotiated digests, data alignment,
//! size limits); the rest is decoded as a stream of PDUs. Checks that the
//! decoder never panics, never claims to consume more than it was given,
//! that `needed` agrees with `decode`, that payload slices lie inside the
//! input, and that re-encoding a decoded PDU yields a decodable PDU with the
//! same contents.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nvmeof_gateway::tcp::pdu::{
    encode_c2h_term_req, encode_h2c_term_req, encode_icreq, encode_icresp, DecoderConfig, Fes, Pdu,
    PduDecoder, PduEncoder, PduError, Role,
};

fn decoder(cfg: u8) -> PduDecoder {
    let role = if cfg & 0x01 == 0 {
        Role::Target
    } else {
        Role::Host
    };
    let mut c = DecoderConfig::new(role);
    if cfg & 0x40 != 0 {
        c.max_pdu_len = 256;
    }
    if cfg & 0x80 != 0 {
        c.max_h2c_data = 64;
    }
    let mut d = PduDecoder::new(c);
    d.set_ic_done(cfg & 0x02 != 0);
    d.set_digests(cfg & 0x04 != 0, cfg & 0x08 != 0);
    // 0, 1, 3 or 31 dwords.
    d.set_rx_pda([0, 1, 3, 31][((cfg >> 4) & 3) as usize]);
    d
}

fn within(outer: &[u8], inner: &[u8]) -> bool {
    let o = outer.as_ptr() as usize;
    let i = inner.as_ptr() as usize;
    inner.is_empty() || (i >= o && i + inner.len() <= o + outer.len())
}

/// Re-encode `pdu` with the decoder's parameters and decode it again.
fn round_trip(dec: &PduDecoder, pdu: &Pdu<'_>) {
    let enc = PduEncoder::new(dec.header_digest(), dec.data_digest(), 0);
    let mut out = Vec::new();
    match pdu {
        Pdu::IcReq(r) => encode_icreq(&mut out, r),
        Pdu::IcResp(r) => encode_icresp(&mut out, r),
        Pdu::H2CTermReq(t) | Pdu::C2HTermReq(t) => {
            let Some(fes) = Fes::from_u16(t.fes) else {
                return;
            };
            if matches!(pdu, Pdu::H2CTermReq(_)) {
                encode_h2c_term_req(&mut out, fes, t.fei, t.data);
            } else {
                encode_c2h_term_req(&mut out, fes, t.fei, t.data);
            }
        }
        Pdu::CapsuleCmd(c) => enc.capsule_cmd(&mut out, c.sqe, c.data),
        Pdu::CapsuleResp(r) => enc.capsule_resp(&mut out, r.cqe),
        Pdu::H2CData(d) => enc.h2c_data(&mut out, d.cccid, d.ttag, d.datao, d.data, d.last),
        Pdu::C2HData(d) => enc.c2h_data(&mut out, d.cccid, d.datao, d.data, d.last, d.success),
        Pdu::R2T(r) => enc.r2t(&mut out, r.cccid, r.ttag, r.r2to, r.r2tl),
    }
    // Same connection state, minimal alignment: the re-encoding is never
    // larger than the original, so the size limits still hold.
    let mut again = dec.clone();
    again.set_rx_pda(0);
    match again.decode(&out) {
        Ok(Some((p2, used))) => {
            assert_eq!(used, out.len());
            assert_eq!(&p2, pdu);
        }
        other => panic!("re-encoded {pdu:?} did not decode: {other:?}"),
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&cfg, stream)) = data.split_first() else {
        return;
    };
    let mut dec = decoder(cfg);
    let mut off = 0usize;
    // Bounded: every iteration consumes at least one byte or stops.
    while off <= stream.len() {
        let buf = &stream[off..];
        let needed = dec.needed(buf);
        let before = dec.clone();
        match dec.decode(buf) {
            Ok(None) => {
                match needed {
                    Ok(n) => assert!(n > buf.len(), "needed {n} but have {}", buf.len()),
                    Err(e) => panic!("needed() failed ({e}) where decode() wants more"),
                }
                break;
            }
            Ok(Some((pdu, used))) => {
                assert!(used > 0 && used <= buf.len());
                assert_eq!(needed, Ok(used));
                let payload: &[u8] = match &pdu {
                    Pdu::H2CTermReq(t) | Pdu::C2HTermReq(t) => t.data,
                    Pdu::CapsuleCmd(c) => {
                        assert!(within(&buf[..used], c.sqe));
                        c.data
                    }
                    Pdu::CapsuleResp(r) => r.cqe,
                    Pdu::H2CData(d) | Pdu::C2HData(d) => {
                        assert_eq!(d.datal as usize, d.data.len());
                        d.data
                    }
                    _ => &[],
                };
                assert!(within(&buf[..used], payload));
                round_trip(&before, &pdu);
                off += used;
            }
            Err(PduError::DataDigest { consumed, .. }) => {
                assert!(consumed > 0 && consumed <= buf.len());
                off += consumed;
            }
            Err(e) => {
                assert!(e.is_fatal());
                let _ = (e.term_req_info(), e.to_string());
                break;
            }
        }
    }
});
