//! Tests of the PDU codec: round trips of every PDU type, and the malformed PDUs the decoder
//! must refuse.

use super::*;
use crate::tcp::digest;

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
