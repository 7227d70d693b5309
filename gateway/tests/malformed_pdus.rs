//! Bad input on the wire: the gateway answers with C2HTermReq (or closes) for that
//! connection only, and keeps serving the others.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use nvmeof_gateway::tcp::digest;
use nvmeof_gateway::tcp::pdu::{
    encode_icreq, DecoderConfig, Fes, IcReq, PduDecoder, PduEncoder, Role,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::watch;

const SUBNQN: &str = "nqn.2016-06.io.test:malformed";
const HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:0f0f0f0f-0000-0000-0000-000000000001";

async fn start() -> (SocketAddr, watch::Sender<bool>) {
    let gw = common::start_gateway(SUBNQN, "16MiB").await;
    (gw.addr, gw.shutdown)
}

/// Reads PDUs until `want` of them arrived or the peer closed; returns them as owned
/// (type, raw bytes) pairs plus whether the connection was closed.
async fn read_pdus(stream: &mut TcpStream, hdgst: bool, want: usize) -> (Vec<(u8, Vec<u8>)>, bool) {
    let mut decoder = PduDecoder::new(DecoderConfig::new(Role::Host));
    decoder.set_ic_done(true);
    decoder.set_digests(hdgst, false);
    let mut buf = Vec::new();
    let mut pdus = Vec::new();
    let mut closed = false;
    while pdus.len() < want {
        let mut chunk = [0u8; 4096];
        match tokio::time::timeout(Duration::from_secs(5), stream.read(&mut chunk)).await {
            Ok(Ok(0)) | Ok(Err(_)) => {
                closed = true;
                break;
            }
            Ok(Ok(n)) => buf.extend_from_slice(&chunk[..n]),
            Err(_) => panic!("no answer from the gateway within 5 s"),
        }
        while let Ok(Some((_, used))) = decoder.decode(&buf) {
            pdus.push((buf[0], buf[..used].to_vec()));
            buf.drain(..used);
        }
    }
    (pdus, closed)
}

async fn expect_closed(stream: &mut TcpStream) {
    let mut rest = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut rest)).await;
    assert!(
        read.is_ok(),
        "gateway kept the connection open after a fatal error"
    );
}

/// Sends ICReq (optionally with header digests) and returns the stream after ICResp.
async fn initialized(addr: SocketAddr, hdgst: bool) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let mut out = Vec::new();
    encode_icreq(
        &mut out,
        &IcReq {
            hdgst,
            ..IcReq::default()
        },
    );
    s.write_all(&out).await.unwrap();
    let mut icresp = [0u8; 128];
    s.read_exact(&mut icresp).await.unwrap();
    assert_eq!(icresp[0], 0x01, "ICResp");
    s
}

fn term_req(pdu: &(u8, Vec<u8>)) -> (u16, u32) {
    assert_eq!(
        pdu.0, 0x03,
        "expected C2HTermReq, got PDU type {:#x}",
        pdu.0
    );
    let raw = &pdu.1;
    (
        u16::from_le_bytes([raw[8], raw[9]]),
        u32::from_le_bytes(raw[10..14].try_into().unwrap()),
    )
}

fn connect_sqe(in_capsule: bool) -> [u8; 64] {
    let mut sqe = [0u8; 64];
    sqe[0] = 0x7f;
    sqe[2..4].copy_from_slice(&1u16.to_le_bytes());
    sqe[4] = 0x01;
    sqe[32..36].copy_from_slice(&1024u32.to_le_bytes());
    sqe[39] = if in_capsule { 0x01 } else { 0x5a };
    sqe[44..46].copy_from_slice(&31u16.to_le_bytes());
    sqe
}

fn connect_data() -> Vec<u8> {
    let mut d = vec![0u8; 1024];
    d[16..18].copy_from_slice(&0xffffu16.to_le_bytes());
    d[256..256 + SUBNQN.len()].copy_from_slice(SUBNQN.as_bytes());
    d[512..512 + HOSTNQN.len()].copy_from_slice(HOSTNQN.as_bytes());
    d
}

/// A connection that does everything right: Connect, then a CapsuleResp with success.
async fn healthy_connect(addr: SocketAddr) {
    let mut s = initialized(addr, false).await;
    let mut out = Vec::new();
    PduEncoder::new(false, false, 0).capsule_cmd(&mut out, &connect_sqe(true), &connect_data());
    s.write_all(&out).await.unwrap();
    let (pdus, _) = read_pdus(&mut s, false, 1).await;
    assert_eq!(pdus[0].0, 0x05, "CapsuleResp");
    let status = u16::from_le_bytes([pdus[0].1[22], pdus[0].1[23]]) >> 1;
    assert_eq!(status, 0, "connect succeeded");
}

#[tokio::test]
async fn each_malformed_pdu_gets_a_term_req_and_others_keep_working() {
    let (addr, _shutdown) = start().await;
    let fatal_before = common::transport_counter("nvmeof_tcp_fatal_pdu_errors_total");
    // A bystander connected before the attacks, used after them.
    let mut bystander = initialized(addr, false).await;

    // 1. A command capsule before ICReq: PDU sequence error.
    let mut s = TcpStream::connect(addr).await.unwrap();
    let mut out = Vec::new();
    PduEncoder::new(false, false, 0).capsule_cmd(&mut out, &connect_sqe(true), &connect_data());
    s.write_all(&out).await.unwrap();
    let (pdus, _) = read_pdus(&mut s, false, 1).await;
    assert_eq!(term_req(&pdus[0]).0, Fes::PduSequenceError as u16);
    expect_closed(&mut s).await;

    // 2. Unknown PDU type: invalid header field, FEI = offset of the type byte.
    let mut s = initialized(addr, false).await;
    s.write_all(&[0x42, 0, 8, 0, 8, 0, 0, 0]).await.unwrap();
    let (pdus, _) = read_pdus(&mut s, false, 1).await;
    assert_eq!(term_req(&pdus[0]), (Fes::InvalidHeaderField as u16, 0));
    expect_closed(&mut s).await;

    // 3. Bad HLEN for a capsule: FEI = 2.
    let mut s = initialized(addr, false).await;
    let mut bad = vec![0x04, 0, 50, 0];
    bad.extend_from_slice(&72u32.to_le_bytes());
    bad.resize(72, 0);
    s.write_all(&bad).await.unwrap();
    let (pdus, _) = read_pdus(&mut s, false, 1).await;
    assert_eq!(term_req(&pdus[0]), (Fes::InvalidHeaderField as u16, 2));
    expect_closed(&mut s).await;

    // 4. A PLEN far beyond anything we accept: FEI = 4, and no attempt to buffer it.
    let mut s = initialized(addr, false).await;
    let mut huge = vec![0x04, 0, 72, 72];
    huge.extend_from_slice(&(1u32 << 30).to_le_bytes());
    s.write_all(&huge).await.unwrap();
    let (pdus, _) = read_pdus(&mut s, false, 1).await;
    assert_eq!(term_req(&pdus[0]), (Fes::InvalidHeaderField as u16, 4));
    expect_closed(&mut s).await;

    // 5. Header digest mismatch.
    let mut s = initialized(addr, true).await;
    let mut out = Vec::new();
    PduEncoder::new(true, false, 0).capsule_cmd(&mut out, &connect_sqe(false), &[]);
    let digest_at = 72;
    out[digest_at] ^= 0xff;
    s.write_all(&out).await.unwrap();
    let (pdus, _) = read_pdus(&mut s, true, 1).await;
    assert_eq!(term_req(&pdus[0]).0, Fes::HeaderDigestError as u16);
    expect_closed(&mut s).await;
    // The digest we corrupted was a real CRC32C of the header.
    assert_eq!(
        out[digest_at] ^ 0xff,
        digest::header_digest(&out[..72]).to_le_bytes()[0]
    );

    // 6. Data beyond the R2T: Connect asks for its data by R2T, the host sends too much.
    let mut s = initialized(addr, false).await;
    let enc = PduEncoder::new(false, false, 0);
    let mut out = Vec::new();
    enc.capsule_cmd(&mut out, &connect_sqe(false), &[]);
    s.write_all(&out).await.unwrap();
    let (pdus, _) = read_pdus(&mut s, false, 1).await;
    assert_eq!(pdus[0].0, 0x09, "R2T");
    let r2t = &pdus[0].1;
    let ttag = u16::from_le_bytes([r2t[10], r2t[11]]);
    assert_eq!(
        u32::from_le_bytes(r2t[16..20].try_into().unwrap()),
        1024,
        "R2TL"
    );
    let mut out = Vec::new();
    enc.h2c_data(&mut out, 1, ttag, 512, &[0u8; 1024], true);
    s.write_all(&out).await.unwrap();
    let (pdus, _) = read_pdus(&mut s, false, 1).await;
    assert_eq!(term_req(&pdus[0]).0, Fes::DataTransferOutOfRange as u16);
    expect_closed(&mut s).await;

    // 7. H2CData for a command that asked for nothing.
    let mut s = initialized(addr, false).await;
    let mut out = Vec::new();
    enc.h2c_data(&mut out, 77, 0, 0, &[0u8; 64], true);
    s.write_all(&out).await.unwrap();
    let (pdus, _) = read_pdus(&mut s, false, 1).await;
    assert_eq!(term_req(&pdus[0]).0, Fes::DataTransferOutOfRange as u16);
    expect_closed(&mut s).await;

    // 8. Garbage then EOF mid-header: the connection just closes.
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(&[0x00, 0x00, 0x80]).await.unwrap();
    s.shutdown().await.unwrap();
    expect_closed(&mut s).await;

    // The bystander and new connections still work.
    let mut out = Vec::new();
    PduEncoder::new(false, false, 0).capsule_cmd(&mut out, &connect_sqe(true), &connect_data());
    bystander.write_all(&out).await.unwrap();
    let (pdus, _) = read_pdus(&mut bystander, false, 1).await;
    assert_eq!(pdus[0].0, 0x05, "bystander's Connect answered");
    healthy_connect(addr).await;
    // cases 1-7 ended with a C2HTermReq; the metrics count them (other tests of this binary
    // may add their own meanwhile)
    let fatal = common::transport_counter("nvmeof_tcp_fatal_pdu_errors_total") - fatal_before;
    assert!(fatal >= 7.0, "{fatal} fatal PDU errors counted, 7 sent");
}

/// A host that keeps sending commands beyond its queue size without their data would make
/// the gateway hold a buffer per command (one per CID, 1 MiB each at MDTS). Up to twice the
/// queue size is tolerated (as Linux nvmet does); the next command fails the connection with
/// a PDU sequence error.
#[tokio::test]
async fn a_host_beyond_twice_its_queue_size_is_disconnected() {
    let (addr, _shutdown) = start().await;
    let mut s = initialized(addr, false).await;
    let enc = PduEncoder::new(false, false, 0);
    // The admin queue, 4 entries (SQSIZE 3, 0's based).
    let mut connect = connect_sqe(true);
    connect[44..46].copy_from_slice(&3u16.to_le_bytes());
    let mut out = Vec::new();
    enc.capsule_cmd(&mut out, &connect, &connect_data());
    s.write_all(&out).await.unwrap();
    let (pdus, _) = read_pdus(&mut s, false, 1).await;
    assert_eq!(pdus[0].0, 0x05, "CapsuleResp to Connect");
    // Set Features with 1 MiB to come by R2T, which the host never sends.
    let command = |cid: u16| {
        let mut sqe = [0u8; 64];
        sqe[0] = 0x09;
        sqe[2..4].copy_from_slice(&cid.to_le_bytes());
        sqe[32..36].copy_from_slice(&(1u32 << 20).to_le_bytes());
        sqe[39] = 0x5a; // transport SGL data block: data by R2T
        sqe
    };
    let mut out = Vec::new();
    for cid in 10..18 {
        enc.capsule_cmd(&mut out, &command(cid), &[]);
    }
    s.write_all(&out).await.unwrap();
    let (pdus, closed) = read_pdus(&mut s, false, 8).await;
    assert!(!closed, "8 commands (twice 4 entries) are tolerated");
    assert!(pdus.iter().all(|p| p.0 == 0x09), "8 R2Ts");
    let mut out = Vec::new();
    enc.capsule_cmd(&mut out, &command(18), &[]);
    s.write_all(&out).await.unwrap();
    let (pdus, _) = read_pdus(&mut s, false, 1).await;
    assert_eq!(term_req(&pdus[0]).0, Fes::PduSequenceError as u16);
    expect_closed(&mut s).await;
    healthy_connect(addr).await;
}

#[tokio::test]
async fn a_valid_pdu_decodes_the_same_after_every_split() {
    // The gateway reassembles PDUs that arrive a byte at a time.
    let (addr, _shutdown) = start().await;
    let mut s = TcpStream::connect(addr).await.unwrap();
    let mut out = Vec::new();
    encode_icreq(&mut out, &IcReq::default());
    PduEncoder::new(false, false, 0).capsule_cmd(&mut out, &connect_sqe(true), &connect_data());
    for byte in out {
        s.write_all(&[byte]).await.unwrap();
    }
    let mut icresp = [0u8; 128];
    s.read_exact(&mut icresp).await.unwrap();
    let (pdus, _) = read_pdus(&mut s, false, 1).await;
    assert_eq!(pdus[0].0, 0x05, "CapsuleResp after byte-by-byte delivery");
}
