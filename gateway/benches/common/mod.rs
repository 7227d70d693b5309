//! Shared by the benchmarks: the null responder, the baseline an NVMe/TCP target is measured
//! against (what the exchange over loopback costs with no target behind it).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};

use nvmeof_gateway::host::cmd as hcmd;
use nvmeof_gateway::tcp::pdu::{
    encode_icresp, DecoderConfig, IcResp, Pdu, PduDecoder, PduEncoder, Role,
};

/// Starts a null responder on a free port of 127.0.0.1 (a thread per connection) and
/// returns its address.
pub fn spawn_null_responder() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind the null responder");
    let addr = listener.local_addr().expect("the null responder's address");
    std::thread::spawn(move || null_responder(listener));
    addr
}

/// The baseline target: answers Connect, reads (C2HData from a static buffer) and writes
/// (in-capsule or by R2T) with the same PDU codec and no protocol core or device.
fn null_responder(listener: TcpListener) {
    for stream in listener.incoming() {
        let Ok(mut stream) = stream else { continue };
        std::thread::spawn(move || {
            stream.set_nodelay(true).ok();
            let zeros = vec![0u8; 1 << 20];
            let mut dec = PduDecoder::new(DecoderConfig::new(Role::Target));
            let mut enc = PduEncoder::new(false, false, 0);
            let mut rx: Vec<u8> = Vec::with_capacity(4 << 20);
            let mut tx: Vec<u8> = Vec::with_capacity(1 << 20);
            let mut chunk = vec![0u8; 256 * 1024];
            loop {
                let n = match stream.read(&mut chunk) {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                };
                rx.extend_from_slice(&chunk[..n]);
                let mut consumed = 0;
                while let Ok(Some((pdu, used))) = dec.decode(&rx[consumed..]) {
                    let respond = |tx: &mut Vec<u8>, enc: &PduEncoder, cid: u16| {
                        let mut cqe = [0u8; 16];
                        cqe[12..14].copy_from_slice(&cid.to_le_bytes());
                        enc.capsule_resp(tx, &cqe);
                    };
                    match pdu {
                        Pdu::IcReq(_) => {
                            encode_icresp(
                                &mut tx,
                                &IcResp {
                                    pfv: 0,
                                    cpda: 0,
                                    hdgst: false,
                                    ddgst: false,
                                    maxh2cdata: 1 << 20,
                                },
                            );
                            enc = PduEncoder::new(false, false, 0);
                        }
                        Pdu::CapsuleCmd(c) => {
                            let cid = c.cid();
                            let len =
                                u32::from_le_bytes([c.sqe[32], c.sqe[33], c.sqe[34], c.sqe[35]]);
                            match c.opcode() {
                                hcmd::io::READ => {
                                    enc.c2h_data(
                                        &mut tx,
                                        cid,
                                        0,
                                        &zeros[..len as usize],
                                        true,
                                        false,
                                    );
                                    respond(&mut tx, &enc, cid);
                                }
                                _ if c.sqe[0] & 1 == 1 && c.data.is_empty() && len > 0 => {
                                    enc.r2t(&mut tx, cid, cid, 0, len)
                                }
                                _ => respond(&mut tx, &enc, cid),
                            }
                        }
                        Pdu::H2CData(d) => {
                            if d.last {
                                respond(&mut tx, &enc, d.cccid);
                            }
                        }
                        _ => return,
                    }
                    consumed += used;
                }
                rx.drain(..consumed);
                if !tx.is_empty() {
                    if stream.write_all(&tx).is_err() {
                        return;
                    }
                    tx.clear();
                }
            }
        });
    }
}
