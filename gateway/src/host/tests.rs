//! Host tests against a tiny in-memory fake controller written here with the
//! PDU codec (independent from the real target in `crate::core`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::cmd::{self, Completion, Sqe};
use super::*;
use crate::tcp::pdu::{
    encode_c2h_term_req, encode_icresp, DecoderConfig, Fes, IcResp, Pdu, PduDecoder, PduEncoder,
    PduError, Role,
};

const BS: u32 = 512;
const SUBNQN: &str = "nqn.2016-06.io.example:fake";

#[derive(Clone, Copy)]
struct FakeOpts {
    cpda: u8,
    maxh2cdata: u32,
    /// Largest C2HData payload per PDU.
    c2h_chunk: usize,
    /// Use the C2HData SUCCESS flag instead of a CapsuleResp for reads.
    c2h_success: bool,
    /// Largest R2T the fake asks for.
    r2t_chunk: u32,
    /// ioccsz reported in Identify Controller.
    ioccsz: u32,
    /// Bug injection: send only the first half of read data.
    short_read: bool,
}

impl Default for FakeOpts {
    fn default() -> Self {
        Self {
            cpda: 0,
            maxh2cdata: 0x20000,
            c2h_chunk: 1 << 20,
            c2h_success: false,
            r2t_chunk: 1 << 20,
            ioccsz: (64 + 8192) / 16,
            short_read: false,
        }
    }
}

#[derive(Default)]
struct FakeState {
    disk: Vec<u8>,
    cc: u32,
    connects: Vec<(u16, u16, String, String)>,
    keep_alives: usize,
}

struct Fake {
    addr: std::net::SocketAddr,
    state: Arc<Mutex<FakeState>>,
}

async fn fake(opts: FakeOpts) -> Fake {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let state = Arc::new(Mutex::new(FakeState {
        disk: vec![0; 1 << 20],
        ..Default::default()
    }));
    let st = state.clone();
    tokio::spawn(async move {
        while let Ok((s, _)) = listener.accept().await {
            tokio::spawn(serve(s, opts, st.clone()));
        }
    });
    Fake { addr, state }
}

fn cqe(cid: u16, sct: u8, sc: u8, dw0: u32) -> [u8; 16] {
    let mut c = [0u8; 16];
    c[0..4].copy_from_slice(&dw0.to_le_bytes());
    c[12..14].copy_from_slice(&cid.to_le_bytes());
    let status: u16 = ((sct as u16) << 8 | sc as u16) << 1;
    c[14..16].copy_from_slice(&status.to_le_bytes());
    c
}

struct WriteInProgress {
    sqe: Sqe,
    buf: Vec<u8>,
    got: usize,
}

struct Conn {
    opts: FakeOpts,
    state: Arc<Mutex<FakeState>>,
    enc: PduEncoder,
    qid: u16,
    writes: HashMap<u16, WriteInProgress>,
    /// Result of a fused compare (FUSE_FIRST) waiting for its write.
    fused_ok: Option<bool>,
    next_ttag: u16,
}

impl Conn {
    fn resp(&self, out: &mut Vec<u8>, c: [u8; 16]) {
        self.enc.capsule_resp(out, &c);
    }

    /// Execute a command whose data (if host to controller) is complete.
    fn exec(&mut self, sqe: &Sqe, data: &[u8], out: &mut Vec<u8>) {
        let cid = sqe.cid();
        let op = sqe.opcode();
        let fuse = sqe.0[1] & 3;
        let mut st = self.state.lock().unwrap();
        let range = |sqe: &Sqe| {
            let slba = sqe.cdw(10) as u64 | (sqe.cdw(11) as u64) << 32;
            let nlb = (sqe.cdw(12) & 0xffff) as usize + 1;
            let s = slba as usize * BS as usize;
            s..s + nlb * BS as usize
        };
        if op == cmd::fabrics::OPCODE {
            match sqe.0[4] {
                cmd::fabrics::CONNECT => {
                    let qid = u16::from_le_bytes([sqe.0[42], sqe.0[43]]);
                    let sqsize = u16::from_le_bytes([sqe.0[44], sqe.0[45]]);
                    let nqn = |b: &[u8]| {
                        String::from_utf8_lossy(
                            &b[..b.iter().position(|&c| c == 0).unwrap_or(b.len())],
                        )
                        .to_string()
                    };
                    if data.len() != 1024 || nqn(&data[256..512]) != SUBNQN {
                        drop(st);
                        return self.resp(out, cqe(cid, 1, 0x82, 0));
                    }
                    st.connects
                        .push((qid, sqsize, nqn(&data[256..512]), nqn(&data[512..768])));
                    self.qid = qid;
                    drop(st);
                    self.resp(out, cqe(cid, 0, 0, 1));
                }
                cmd::fabrics::PROPERTY_GET => {
                    let off = sqe.cdw(11);
                    let v: u64 = match off {
                        cmd::prop::CAP => (1 << 24) | 127,
                        cmd::prop::CC => st.cc as u64,
                        cmd::prop::CSTS => (st.cc & 1) as u64,
                        cmd::prop::VS => 0x0002_0000,
                        _ => 0,
                    };
                    drop(st);
                    let mut c = cqe(cid, 0, 0, v as u32);
                    c[4..8].copy_from_slice(&((v >> 32) as u32).to_le_bytes());
                    self.resp(out, c);
                }
                cmd::fabrics::PROPERTY_SET => {
                    if sqe.cdw(11) == cmd::prop::CC {
                        st.cc = sqe.cdw(12);
                    }
                    drop(st);
                    self.resp(out, cqe(cid, 0, 0, 0));
                }
                _ => {
                    drop(st);
                    self.resp(out, cqe(cid, 0, 1, 0));
                }
            }
            return;
        }
        if self.qid == 0 {
            let reply: Option<Vec<u8>> = match op {
                cmd::admin::IDENTIFY => {
                    let mut d = vec![0u8; 4096];
                    match sqe.0[40] {
                        cmd::cns::CTRL => {
                            d[4..8].copy_from_slice(b"FAKE");
                            d[24..28].copy_from_slice(b"MOCK");
                            d[78..80].copy_from_slice(&1u16.to_le_bytes());
                            d[516..520].copy_from_slice(&1u32.to_le_bytes());
                            d[768..768 + SUBNQN.len()].copy_from_slice(SUBNQN.as_bytes());
                            d[1792..1796].copy_from_slice(&self.opts.ioccsz.to_le_bytes());
                        }
                        cmd::cns::NS => {
                            let n = (st.disk.len() / BS as usize) as u64;
                            d[0..8].copy_from_slice(&n.to_le_bytes());
                            d[8..16].copy_from_slice(&n.to_le_bytes());
                            d[128 + 2] = 9;
                        }
                        cmd::cns::NS_ACTIVE_LIST => d[0..4].copy_from_slice(&1u32.to_le_bytes()),
                        _ => {}
                    }
                    Some(d)
                }
                cmd::admin::GET_LOG_PAGE if sqe.0[40] == cmd::log::DISCOVERY => {
                    let numd = (sqe.cdw(10) >> 16) | ((sqe.cdw(11) & 0xffff) << 16);
                    let len = (numd as usize + 1) * 4;
                    let off = sqe.cdw(12) as usize;
                    let mut page = vec![0u8; 2048];
                    page[0..8].copy_from_slice(&7u64.to_le_bytes());
                    page[8..16].copy_from_slice(&1u64.to_le_bytes());
                    let e = &mut page[1024..];
                    e[0] = 3;
                    e[1] = 1;
                    e[2] = 2;
                    e[32..36].copy_from_slice(b"4420");
                    e[256..256 + SUBNQN.len()].copy_from_slice(SUBNQN.as_bytes());
                    e[512..521].copy_from_slice(b"127.0.0.1");
                    page.resize(off + len.max(page.len()), 0);
                    Some(page[off..off + len].to_vec())
                }
                cmd::admin::KEEP_ALIVE => {
                    st.keep_alives += 1;
                    None
                }
                _ => {
                    drop(st);
                    return self.resp(out, cqe(cid, 0, 1, 0));
                }
            };
            drop(st);
            match reply {
                Some(d) => self.send_read(out, cid, &d),
                None => self.resp(out, cqe(cid, 0, 0, 0)),
            }
            return;
        }
        // I/O queue.
        match op {
            cmd::io::READ => {
                let r = range(sqe);
                let d = st.disk[r].to_vec();
                drop(st);
                self.send_read(out, cid, &d)
            }
            cmd::io::WRITE => {
                if fuse == cmd::sqe_flags::FUSE_SECOND && self.fused_ok.take() != Some(true) {
                    drop(st);
                    return self.resp(out, cqe(cid, 0, 0x09, 0));
                }
                let r = range(sqe);
                st.disk[r].copy_from_slice(data);
                drop(st);
                self.resp(out, cqe(cid, 0, 0, 0))
            }
            cmd::io::COMPARE => {
                let r = range(sqe);
                let same = st.disk[r] == *data;
                drop(st);
                if fuse == cmd::sqe_flags::FUSE_FIRST {
                    self.fused_ok = Some(same);
                }
                if same {
                    self.resp(out, cqe(cid, 0, 0, 0))
                } else {
                    self.resp(out, cqe(cid, 2, 0x85, 0))
                }
            }
            cmd::io::WRITE_ZEROES => {
                let r = range(sqe);
                st.disk[r].fill(0);
                drop(st);
                self.resp(out, cqe(cid, 0, 0, 0))
            }
            cmd::io::DSM => {
                for rg in data.chunks_exact(16) {
                    let nlb = u32::from_le_bytes(rg[4..8].try_into().unwrap()) as usize;
                    let slba = u64::from_le_bytes(rg[8..16].try_into().unwrap()) as usize;
                    st.disk[slba * BS as usize..(slba + nlb) * BS as usize].fill(0);
                }
                drop(st);
                self.resp(out, cqe(cid, 0, 0, 0))
            }
            cmd::io::FLUSH => {
                drop(st);
                self.resp(out, cqe(cid, 0, 0, 0))
            }
            0xc0 => {} // vendor: never answered (timeout test)
            _ => {
                drop(st);
                self.resp(out, cqe(cid, 0, 1, 0))
            }
        }
    }

    fn send_read(&self, out: &mut Vec<u8>, cid: u16, d: &[u8]) {
        let d = if self.opts.short_read {
            &d[..d.len() / 2]
        } else {
            d
        };
        let chunks: Vec<&[u8]> = d.chunks(self.opts.c2h_chunk).collect();
        for (i, c) in chunks.iter().enumerate() {
            let last = i + 1 == chunks.len();
            let off = (i * self.opts.c2h_chunk) as u32;
            self.enc
                .c2h_data(out, cid, off, c, last, last && self.opts.c2h_success);
        }
        if !self.opts.c2h_success {
            self.resp(out, cqe(cid, 0, 0, 0));
        }
    }
}

async fn serve(mut s: TcpStream, opts: FakeOpts, state: Arc<Mutex<FakeState>>) {
    let mut dec = PduDecoder::new(DecoderConfig::new(Role::Target));
    dec.set_max_h2c_data(opts.maxh2cdata);
    let mut conn = Conn {
        opts,
        state,
        enc: PduEncoder::default(),
        qid: 0,
        writes: HashMap::new(),
        fused_ok: None,
        next_ttag: 1,
    };
    let mut buf = Vec::new();
    loop {
        let mut out = Vec::new();
        let mut start = 0;
        let mut fatal = false;
        loop {
            match dec.decode(&buf[start..]) {
                Ok(None) => break,
                Ok(Some((pdu, used))) => {
                    match pdu {
                        Pdu::IcReq(r) => {
                            encode_icresp(
                                &mut out,
                                &IcResp {
                                    pfv: 0,
                                    cpda: opts.cpda,
                                    hdgst: r.hdgst,
                                    ddgst: r.ddgst,
                                    maxh2cdata: opts.maxh2cdata,
                                },
                            );
                            dec.set_digests(r.hdgst, r.ddgst);
                            dec.set_rx_pda(opts.cpda);
                            conn.enc = PduEncoder::new(r.hdgst, r.ddgst, r.hpda);
                        }
                        Pdu::CapsuleCmd(c) => {
                            let sqe = Sqe(*c.sqe);
                            let sgl_type = sqe.0[39];
                            let len = sqe.sgl_len();
                            let host_to_ctrl = matches!(sqe.opcode(), 0x01 | 0x05 | 0x09)
                                || (sqe.opcode() == 0x7f && sqe.0[4] == cmd::fabrics::CONNECT);
                            if sgl_type == cmd::sgl::TRANSPORT_DATA_BLOCK && host_to_ctrl && len > 0
                            {
                                // Ask for the data in R2T-sized pieces.
                                let ttag = conn.next_ttag;
                                conn.next_ttag = conn.next_ttag.wrapping_add(1);
                                let mut off = 0;
                                while off < len {
                                    let n = (len - off).min(opts.r2t_chunk);
                                    conn.enc.r2t(&mut out, sqe.cid(), ttag, off, n);
                                    off += n;
                                }
                                conn.writes.insert(
                                    sqe.cid(),
                                    WriteInProgress {
                                        sqe,
                                        buf: vec![0; len as usize],
                                        got: 0,
                                    },
                                );
                            } else {
                                let data = c.data.to_vec();
                                conn.exec(&sqe, &data, &mut out);
                            }
                        }
                        Pdu::H2CData(d) => {
                            let w = conn
                                .writes
                                .get_mut(&d.cccid)
                                .expect("H2CData for a known write");
                            let o = d.datao as usize;
                            w.buf[o..o + d.data.len()].copy_from_slice(d.data);
                            w.got += d.data.len();
                            if w.got == w.buf.len() {
                                assert!(d.last, "last H2CData carries LAST_PDU");
                                let w = conn.writes.remove(&d.cccid).unwrap();
                                conn.exec(&w.sqe, &w.buf, &mut out);
                            }
                        }
                        Pdu::H2CTermReq(_) => {
                            fatal = true;
                        }
                        other => panic!("fake target got {other:?}"),
                    }
                    start += used;
                }
                Err(e) => {
                    let (fes, fei) = e.term_req_info().unwrap_or((Fes::InvalidHeaderField, 0));
                    let n = (buf.len() - start).min(128);
                    encode_c2h_term_req(&mut out, fes, fei, &buf[start..start + n]);
                    fatal = true;
                    break;
                }
            }
        }
        buf.drain(..start);
        if !out.is_empty() && s.write_all(&out).await.is_err() {
            return;
        }
        if fatal {
            let _ = s.shutdown().await;
            return;
        }
        match s.read_buf(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
    }
}

fn opts() -> HostOptions {
    let mut o = HostOptions::new("nqn.2014-08.org.nvmexpress:uuid:host-test");
    o.timeout = Duration::from_secs(10);
    o
}

async fn admin(f: &Fake, o: HostOptions) -> (HostConnection, u16) {
    let a = HostConnection::connect(f.addr, o).await.unwrap();
    let cntlid = a.connect_admin(SUBNQN, 15_000).await.unwrap();
    (a, cntlid)
}

async fn io_queue(f: &Fake, o: HostOptions, cntlid: u16) -> HostConnection {
    let q = HostConnection::connect(f.addr, o).await.unwrap();
    q.connect_io(SUBNQN, cntlid, 1, 127).await.unwrap();
    q
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[tokio::test]
async fn admin_bringup_identify_properties() {
    let f = fake(FakeOpts::default()).await;
    let (a, cntlid) = admin(&f, opts()).await;
    assert_eq!(cntlid, 1);
    assert_eq!(a.icresp().maxh2cdata, 0x20000);
    a.enable_controller().await.unwrap();
    assert_eq!(a.property_get(cmd::prop::CSTS, false).await.unwrap() & 1, 1);
    assert_eq!(
        a.property_get(cmd::prop::CAP, true).await.unwrap() & 0xffff,
        127
    );
    let c = a.identify_controller().await.unwrap();
    assert_eq!(c.raw.len(), 4096);
    assert_eq!(
        (c.serial().as_str(), c.model().as_str(), c.nn()),
        ("FAKE", "MOCK", 1)
    );
    assert_eq!(c.subnqn(), SUBNQN);
    assert_eq!(c.in_capsule_data_max(), 8192);
    let n = a.identify_namespace(1).await.unwrap();
    assert_eq!((n.nsze(), n.block_size()), (2048, 512));
    assert_eq!(a.active_namespaces(0).await.unwrap(), vec![1]);
    a.keep_alive().await.unwrap();
    let conn = f.state.lock().unwrap().connects[0].clone();
    assert_eq!(
        conn,
        (0, 31, SUBNQN.to_string(), a.options().hostnqn.clone())
    );
}

#[tokio::test]
async fn connect_rejected_is_nvme_error() {
    let f = fake(FakeOpts::default()).await;
    let a = HostConnection::connect(f.addr, opts()).await.unwrap();
    match a.connect_admin("nqn.wrong", 0).await {
        Err(HostError::Nvme(c)) => assert_eq!((c.sct(), c.sc()), (1, 0x82)),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn discovery_log_page() {
    let f = fake(FakeOpts::default()).await;
    let (a, _) = admin(&f, opts()).await;
    let log = a.discovery_log().await.unwrap();
    assert_eq!((log.genctr, log.numrec, log.entries.len()), (7, 1, 1));
    let e = &log.entries[0];
    assert_eq!((e.trtype, e.adrfam, e.subtype), (3, 1, 2));
    assert_eq!(
        (e.trsvcid.as_str(), e.traddr.as_str(), e.subnqn.as_str()),
        ("4420", "127.0.0.1", SUBNQN)
    );
}

async fn io_round_trips(fo: FakeOpts, o: HostOptions) {
    let f = fake(fo).await;
    let (a, cntlid) = admin(&f, o.clone()).await;
    let ctrl = a.identify_controller().await.unwrap();
    let q = io_queue(&f, o, cntlid).await;
    q.set_in_capsule_data_max(ctrl.in_capsule_data_max());
    // In-capsule write (4 KiB) and R2T write (64 KiB), read back.
    let small = pattern(4096, 1);
    q.write(1, 8, small.clone(), BS).await.unwrap();
    assert_eq!(q.read(1, 8, 8, BS).await.unwrap(), small);
    let big = pattern(65536, 2);
    q.write(1, 100, big.clone(), BS).await.unwrap();
    assert_eq!(q.read(1, 100, 128, BS).await.unwrap(), big);
    assert_eq!(
        &f.state.lock().unwrap().disk[100 * 512..100 * 512 + 65536],
        &big[..]
    );
    q.flush(1).await.unwrap();
}

#[tokio::test]
async fn io_plain() {
    io_round_trips(FakeOpts::default(), opts()).await;
}

#[tokio::test]
async fn io_with_digests_padding_and_small_pdus() {
    let fo = FakeOpts {
        cpda: 3,
        maxh2cdata: 4096,
        c2h_chunk: 3000,
        c2h_success: true,
        r2t_chunk: 16384,
        ..Default::default()
    };
    let mut o = opts();
    o.header_digest = true;
    o.data_digest = true;
    o.hpda = 1;
    io_round_trips(fo, o).await;
}

#[tokio::test]
async fn io_header_digest_only_no_in_capsule() {
    let fo = FakeOpts {
        ioccsz: 4,
        ..Default::default()
    };
    let mut o = opts();
    o.header_digest = true;
    io_round_trips(fo, o).await;
}

#[tokio::test]
async fn pipelined_commands() {
    let f = fake(FakeOpts {
        r2t_chunk: 8192,
        ..Default::default()
    })
    .await;
    let (_a, cntlid) = admin(&f, opts()).await;
    let q = io_queue(&f, opts(), cntlid).await;
    // 64 writes in flight at once, half in-capsule, half via R2T.
    let mut inflight = Vec::new();
    for i in 0..64u64 {
        let len = if i % 2 == 0 { 1024 } else { 16384 };
        let sqe = Sqe::rw(cmd::io::WRITE, 1, i * 32, (len / 512) as u32);
        inflight.push(
            q.start(sqe, Xfer::Write(pattern(len, i as u8).into()))
                .await
                .unwrap(),
        );
    }
    let mut cids: Vec<u16> = inflight.iter().map(|f| f.cid()).collect();
    cids.sort_unstable();
    cids.dedup();
    assert_eq!(cids.len(), 64);
    for f in inflight {
        assert!(f.await.unwrap().cqe.is_success());
    }
    // 64 reads in flight, completed out of submission order by join.
    let reads: Vec<_> = (0..64u64)
        .map(|i| {
            let len = if i % 2 == 0 { 1024u32 } else { 16384 };
            q.read(1, i * 32, len / 512, BS)
        })
        .collect();
    let results = futures_join_all(reads).await;
    for (i, r) in results.into_iter().enumerate() {
        let len = if i % 2 == 0 { 1024 } else { 16384 };
        assert_eq!(r.unwrap(), pattern(len, i as u8), "read {i}");
    }
}

/// Minimal join_all (no futures crate dependency): polls every future
/// each time any is woken, so all commands are in flight together.
async fn futures_join_all<F: std::future::Future>(futs: Vec<F>) -> Vec<F::Output> {
    let mut futs: Vec<_> = futs.into_iter().map(|f| Some(Box::pin(f))).collect();
    let mut out: Vec<Option<F::Output>> = futs.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut done = true;
        for (slot, res) in futs.iter_mut().zip(out.iter_mut()) {
            if let Some(f) = slot {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => {
                        *res = Some(v);
                        *slot = None;
                    }
                    std::task::Poll::Pending => done = false,
                }
            }
        }
        if done {
            std::task::Poll::Ready(())
        } else {
            std::task::Poll::Pending
        }
    })
    .await;
    out.into_iter().flatten().collect()
}

#[tokio::test]
async fn compare_write_zeroes_dsm_fused() {
    let f = fake(FakeOpts::default()).await;
    let (_a, cntlid) = admin(&f, opts()).await;
    let q = io_queue(&f, opts(), cntlid).await;
    let a = pattern(1024, 5);
    let b = pattern(1024, 6);
    q.write(1, 0, a.clone(), BS).await.unwrap();
    assert!(q.compare(1, 0, a.clone(), BS).await.unwrap());
    assert!(!q.compare(1, 0, b.clone(), BS).await.unwrap());
    // Fused compare-and-write: succeeds once, then fails (data changed).
    assert!(q
        .compare_and_write(1, 0, a.clone(), b.clone(), BS)
        .await
        .unwrap());
    assert_eq!(q.read(1, 0, 2, BS).await.unwrap(), b);
    assert!(!q
        .compare_and_write(1, 0, a.clone(), a.clone(), BS)
        .await
        .unwrap());
    assert_eq!(q.read(1, 0, 2, BS).await.unwrap(), b);
    q.write_zeroes(1, 0, 1).await.unwrap();
    let r = q.read(1, 0, 2, BS).await.unwrap();
    assert!(r[..512].iter().all(|&x| x == 0));
    assert_eq!(&r[512..], &b[512..]);
    q.dsm_deallocate(1, &[(1, 1)]).await.unwrap();
    assert!(q.read(1, 0, 2, BS).await.unwrap().iter().all(|&x| x == 0));
    assert!(matches!(
        q.write(1, 0, vec![0u8; 100], BS).await,
        Err(HostError::InvalidArgument(_))
    ));
}

#[tokio::test]
async fn raw_commands() {
    let f = fake(FakeOpts::default()).await;
    let (a, _) = admin(&f, opts()).await;
    // Unknown admin opcode: the CQE comes back with Invalid Opcode.
    let mut sqe = Sqe::new(0x55);
    sqe.set_cid(0x4242).set_sgl_transport(0);
    let r = a
        .submit_raw(RawCommand {
            sqe: sqe.0,
            in_capsule: Default::default(),
            r2t_data: Default::default(),
            read_len: 0,
        })
        .await
        .unwrap();
    assert_eq!((r.cqe.cid(), r.cqe.sc(), r.cqe.sct()), (0x4242, 1, 0));
    // A raw identify through submit() gets its data back.
    let r = a
        .submit(Sqe::identify(cmd::cns::CTRL, 0, 0), Xfer::Read(4096))
        .await
        .unwrap();
    assert_eq!(&r.data[4..8], b"FAKE");
    assert_eq!(r.cqe, Completion::success(r.cqe.cid()));
}

#[tokio::test]
async fn garbage_gets_term_req_and_fails_everything() {
    let f = fake(FakeOpts::default()).await;
    let (a, _) = admin(&f, opts()).await;
    // An unknown PDU type: the fake target answers with a C2HTermReq.
    a.send_raw(&[0x0a, 0, 24, 0, 24, 0, 0, 0]).await.unwrap();
    assert!(a.wait_closed(Duration::from_secs(5)).await);
    assert_eq!(a.term_req(), Some((Fes::InvalidHeaderField as u16, 0)));
    assert!(matches!(
        a.keep_alive().await,
        Err(HostError::Terminated { fes: 1, fei: 0 })
    ));
}

#[tokio::test]
async fn timeout_and_late_cid_reservation() {
    let f = fake(FakeOpts::default()).await;
    let (_a, cntlid) = admin(&f, opts()).await;
    let mut o = opts();
    o.timeout = Duration::from_millis(200);
    let q = io_queue(&f, o, cntlid).await;
    let r = q.submit(Sqe::new(0xc0), Xfer::None).await;
    assert!(matches!(r, Err(HostError::Timeout)), "{r:?}");
    // The queue still works.
    q.flush(1).await.unwrap();
}

#[tokio::test]
async fn icresp_validation_and_peer_close() {
    // A "controller" that answers ICReq with a bad MAXH2CDATA.
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        let (mut s, _) = l.accept().await.unwrap();
        let mut b = [0u8; 128];
        s.read_exact(&mut b).await.unwrap();
        let mut out = Vec::new();
        encode_icresp(
            &mut out,
            &IcResp {
                pfv: 0,
                cpda: 0,
                hdgst: false,
                ddgst: false,
                maxh2cdata: 100,
            },
        );
        s.write_all(&out).await.unwrap();
        let (mut s2, _) = l.accept().await.unwrap();
        s2.read_exact(&mut b).await.unwrap();
        drop(s2);
    });
    assert!(matches!(
        HostConnection::connect(addr, opts()).await,
        Err(HostError::Protocol(_))
    ));
    assert!(matches!(
        HostConnection::connect(addr, opts()).await,
        Err(HostError::Closed(_))
    ));
}

#[tokio::test]
async fn bad_pdu_from_controller_gets_h2c_term_req() {
    // A "controller" that sends a CapsuleResp with a wrong HLEN after ICResp.
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let peer = tokio::spawn(async move {
        let (mut s, _) = l.accept().await.unwrap();
        let mut b = [0u8; 128];
        s.read_exact(&mut b).await.unwrap();
        let mut out = Vec::new();
        encode_icresp(
            &mut out,
            &IcResp {
                pfv: 0,
                cpda: 0,
                hdgst: false,
                ddgst: false,
                maxh2cdata: 8192,
            },
        );
        out.extend_from_slice(&[0x05, 0, 23, 0, 24, 0, 0, 0]);
        out.extend_from_slice(&[0; 16]);
        s.write_all(&out).await.unwrap();
        let mut got = Vec::new();
        let _ = s.read_to_end(&mut got).await;
        got
    });
    let c = HostConnection::connect(addr, opts()).await.unwrap();
    assert!(c.wait_closed(Duration::from_secs(5)).await);
    let got = peer.await.unwrap();
    let mut dec = PduDecoder::new(DecoderConfig::new(Role::Target));
    dec.set_ic_done(true);
    let (p, _) = dec.decode(&got).unwrap().unwrap();
    let Pdu::H2CTermReq(t) = p else {
        panic!("{p:?}")
    };
    assert_eq!((t.fes, t.fei), (Fes::InvalidHeaderField as u16, 2));
    assert_eq!(&t.data[..4], &[0x05, 0, 23, 0]);
    let _ = PduError::DataOutOfRange { offset: 0 };
}

#[tokio::test]
async fn background_keep_alive() {
    let f = fake(FakeOpts::default()).await;
    let (a, _) = admin(&f, opts()).await;
    let a = std::sync::Arc::new(a);
    let h = a.spawn_keep_alive(Duration::from_millis(20));
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(f.state.lock().unwrap().keep_alives >= 3);
    drop(a);
    tokio::time::timeout(Duration::from_secs(2), h)
        .await
        .unwrap()
        .unwrap();
}

#[tokio::test]
async fn short_read_is_a_protocol_error() {
    let f = fake(FakeOpts {
        short_read: true,
        ..Default::default()
    })
    .await;
    let (_a, cntlid) = admin(&f, opts()).await;
    let q = io_queue(&f, opts(), cntlid).await;
    match q.read(1, 0, 8, BS).await {
        Err(HostError::Protocol(m)) => assert!(m.contains("2048 of 4096"), "{m}"),
        other => panic!("{other:?}"),
    }
    // A raw command gets the CQE and the partial data instead.
    let mut sqe = Sqe::rw(cmd::io::READ, 1, 0, 8);
    sqe.set_cid(77).set_sgl_transport(4096);
    let r = q
        .submit_raw(RawCommand {
            sqe: sqe.0,
            in_capsule: Default::default(),
            r2t_data: Default::default(),
            read_len: 4096,
        })
        .await
        .unwrap();
    assert!(r.cqe.is_success());
    assert_eq!(r.data.len(), 4096);
}
