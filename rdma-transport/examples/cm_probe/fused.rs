//! `cm_probe ADDR PORT --fused-cw SUBNQN HOSTNQN HOSTID`: a minimal NVMe/RDMA host that
//! connects an admin and an I/O queue, enables the controller and checks fused
//! Compare-and-Write on namespace 1 (the Linux initiator never issues fused commands).
//! Every command carries its data in the capsule (the gateway accepts 8 KiB; registered memory
//! here is local-access only, so no keyed SGL). Prints one line per check and "fused ok".
//!
//! Values are those of Linux `include/linux/nvme.h` (names in the comments), as the gateway's
//! `spec.rs` has them; this tool repeats them so that it checks the target independently.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdma_transport::{
    BufferPool, CmEventKind, CmId, CompletionChannel, CompletionQueue, EventChannel, Lent,
    PoolConfig, ProtectionDomain, QpCaps, VerbsRegistrar, WcOpcode,
};

/// `nvme_fabrics_command`: opcode `nvme_fabrics_command` (0x7f), fctype connect (0x01),
/// property set (0x00), property get (0x04).
const FABRICS: u8 = 0x7f;
const FCTYPE_CONNECT: u8 = 0x01;
const FCTYPE_PROPERTY_SET: u8 = 0x00;
const FCTYPE_PROPERTY_GET: u8 = 0x04;
/// `nvme_cmd_write`, `nvme_cmd_compare`.
const CMD_WRITE: u8 = 0x01;
const CMD_COMPARE: u8 = 0x05;
/// `NVME_CMD_FUSE_FIRST`, `NVME_CMD_FUSE_SECOND`, `NVME_CMD_SGL_METABUF` (PSDT 01b: SGLs).
const FUSE_FIRST: u8 = 1 << 0;
const FUSE_SECOND: u8 = 1 << 1;
const PSDT_SGL: u8 = 1 << 6;
/// SGL identifier: `NVME_SGL_FMT_DATA_DESC << 4 | NVME_SGL_FMT_OFFSET` (in-capsule data).
const SGL_IN_CAPSULE: u8 = 0x01;
/// `NVME_REG_CC`, `NVME_REG_CSTS`; CC: `NVME_CC_ENABLE`, `NVME_CC_IOSQES` (6 << 16),
/// `NVME_CC_IOCQES` (4 << 20); `NVME_CSTS_RDY`.
const REG_CC: u32 = 0x14;
const REG_CSTS: u32 = 0x1c;
const CC_ENABLE: u64 = 1;
const CC_IOSQES: u64 = 6 << 16;
const CC_IOCQES: u64 = 4 << 20;
const CSTS_RDY: u64 = 1;
/// `NVME_SC_COMPARE_FAILED` (SCT 2h media errors, SC 85h).
const SC_COMPARE_FAILED: u16 = 0x285;
/// Status field bits 10:0 (SCT and SC) of the CQE's status (without the phase bit).
const STATUS_MASK: u16 = 0x7ff;
/// `struct nvmf_connect_data`: 1024 bytes (hostid 16, cntlid 2, 238 reserved, subnqn 256,
/// hostnqn 256, reserved).
const CONNECT_DATA_LEN: usize = 1024;
const SUBNQN_OFFSET: usize = 256;
const HOSTNQN_OFFSET: usize = 512;
const NQN_LEN: usize = 256;
const QUEUE_SIZE: u16 = 32;
const BLOCK: usize = 512;
const LBA: u64 = 8;

struct Queue {
    ch: Arc<EventChannel>,
    id: CmId,
    cq: Arc<CompletionQueue>,
    _cch: Arc<CompletionChannel>,
    pool: BufferPool,
    next_cid: u16,
    done: HashMap<u16, [u8; 16]>,
}

fn sqe(opcode: u8, flags: u8, cid: u16) -> [u8; 64] {
    let mut s = [0u8; 64];
    s[0] = opcode;
    s[1] = flags;
    s[2..4].copy_from_slice(&cid.to_le_bytes());
    s
}

fn in_capsule(s: &mut [u8; 64], len: usize) {
    s[32..36].copy_from_slice(&(len as u32).to_le_bytes());
    s[39] = SGL_IN_CAPSULE;
}

fn status(cqe: &[u8; 16]) -> u16 {
    (u16::from_le_bytes([cqe[14], cqe[15]]) >> 1) & STATUS_MASK
}

impl Queue {
    fn open(dst: SocketAddr, qid: u16, cntlid: u16) -> Result<Self, String> {
        let ch = EventChannel::new().map_err(|e| e.to_string())?;
        let mut id = CmId::resolve(&ch, dst, 2000).map_err(|e| e.to_string())?;
        let ctx = id.context().ok_or("no device for the address")?;
        let pd = ProtectionDomain::new(ctx).map_err(|e| e.to_string())?;
        let cch = CompletionChannel::new(ctx).map_err(|e| e.to_string())?;
        let cq = CompletionQueue::new(ctx, 128, &cch).map_err(|e| e.to_string())?;
        id.create_qp(
            &pd,
            &cq,
            QpCaps {
                max_send_wr: 2 * u32::from(QUEUE_SIZE),
                max_recv_wr: u32::from(QUEUE_SIZE),
                max_inline_data: 64,
            },
        )
        .map_err(|e| e.to_string())?;
        let pool = BufferPool::new(
            &PoolConfig {
                classes: vec![(64, usize::from(QUEUE_SIZE)), (64 + CONNECT_DATA_LEN, 8)],
                cache_bytes: 0,
            },
            Box::new(VerbsRegistrar { pd: pd.clone() }),
        )
        .map_err(|e| e.to_string())?;
        for i in 0..u64::from(QUEUE_SIZE) {
            let (buf, lkey) = pool.take(64).ok_or("no receive buffer")?;
            id.qp()
                .ok_or("no qp")?
                .post_recv(i, Lent { buf, lkey })
                .map_err(|(e, _)| e.to_string())?;
        }
        // struct nvme_rdma_cm_req: recfmt 0, qid, hrqsize, hsqsize (0's based), cntlid.
        let mut private = vec![0u8; 32];
        private[2..4].copy_from_slice(&qid.to_le_bytes());
        private[4..6].copy_from_slice(&QUEUE_SIZE.to_le_bytes());
        private[6..8].copy_from_slice(&(QUEUE_SIZE - 1).to_le_bytes());
        private[8..10].copy_from_slice(&cntlid.to_le_bytes());
        id.connect(&private, 16, 0).map_err(|e| e.to_string())?;
        match ch.wait_event(5000).map_err(|e| e.to_string())? {
            Some(ev) if ev.kind == CmEventKind::Established => {}
            Some(ev) => return Err(format!("queue {qid}: {:?} status {}", ev.kind, ev.status)),
            None => return Err(format!("queue {qid}: no answer")),
        }
        Ok(Self {
            ch,
            id,
            cq,
            _cch: cch,
            pool,
            next_cid: 1,
            done: HashMap::new(),
        })
    }

    fn cid(&mut self) -> u16 {
        self.next_cid = self.next_cid.wrapping_add(1).max(1);
        self.next_cid
    }

    /// Sends a capsule: the SQE and its in-capsule data.
    fn send(&mut self, sqe: &[u8; 64], data: &[u8]) -> Result<(), String> {
        let (mut buf, lkey) = self.pool.take(64 + data.len()).ok_or("no send buffer")?;
        buf[..64].copy_from_slice(sqe);
        buf[64..].copy_from_slice(data);
        let qp = self.id.qp().ok_or("no qp")?;
        qp.post_send(
            u64::from(u16::from_le_bytes([sqe[2], sqe[3]])),
            Lent { buf, lkey },
        )
        .map_err(|(e, _)| e.to_string())
    }

    /// Waits for the completion of `cid` (others are kept for later).
    fn wait(&mut self, cid: u16) -> Result<[u8; 16], String> {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut wcs = Vec::new();
        while Instant::now() < deadline {
            if let Some(c) = self.done.remove(&cid) {
                return Ok(c);
            }
            if let Some(ev) = self.ch.next_event().map_err(|e| e.to_string())? {
                if ev.kind == CmEventKind::Disconnected {
                    return Err("the target disconnected".into());
                }
            }
            wcs.clear();
            self.cq.poll(&mut wcs, 16).map_err(|e| e.to_string())?;
            for wc in &wcs {
                let qp = self.id.qp().ok_or("no qp")?;
                let reaped = qp.reap(wc);
                if !wc.is_ok() {
                    return Err(format!("work completion error: {}", wc.status_str()));
                }
                match (wc.opcode, reaped) {
                    (WcOpcode::Recv, Some((tag, Some(buf)))) => {
                        let mut cqe = [0u8; 16];
                        cqe.copy_from_slice(&buf[..16]);
                        self.done
                            .insert(u16::from_le_bytes([cqe[12], cqe[13]]), cqe);
                        let lkey = self.pool.lkey(&buf).ok_or("receive buffer key")?;
                        qp.post_recv(tag, Lent { buf, lkey })
                            .map_err(|(e, _)| e.to_string())?;
                    }
                    (_, Some((_, Some(buf)))) => {
                        let _ = self.pool.give_back(buf);
                    }
                    _ => {}
                }
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        Err(format!("no completion for command {cid} within 10 s"))
    }

    fn command(&mut self, mut s: [u8; 64], data: &[u8]) -> Result<[u8; 16], String> {
        let cid = self.cid();
        s[2..4].copy_from_slice(&cid.to_le_bytes());
        if !data.is_empty() {
            in_capsule(&mut s, data.len());
        }
        self.send(&s, data)?;
        self.wait(cid)
    }
}

fn hostid(s: &str) -> Result<[u8; 16], String> {
    let hex: String = s.chars().filter(|c| *c != '-').collect();
    let v = super::hex(&hex)?;
    v.try_into()
        .map_err(|_| "host ID: 16 bytes expected".to_string())
}

fn connect(q: &mut Queue, qid: u16, cntlid: u16, ids: &[&str; 3]) -> Result<u16, String> {
    let mut s = sqe(FABRICS, PSDT_SGL, 0);
    s[4] = FCTYPE_CONNECT;
    s[42..44].copy_from_slice(&qid.to_le_bytes());
    s[44..46].copy_from_slice(&(QUEUE_SIZE - 1).to_le_bytes());
    let mut d = vec![0u8; CONNECT_DATA_LEN];
    d[..16].copy_from_slice(&hostid(ids[2])?);
    d[16..18].copy_from_slice(&cntlid.to_le_bytes());
    for (off, nqn) in [(SUBNQN_OFFSET, ids[0]), (HOSTNQN_OFFSET, ids[1])] {
        let b = nqn.as_bytes();
        let n = b.len().min(NQN_LEN - 1);
        d[off..off + n].copy_from_slice(&b[..n]);
    }
    let c = q.command(s, &d)?;
    if status(&c) != 0 {
        return Err(format!("Connect qid {qid}: status {:#x}", status(&c)));
    }
    Ok(u16::from_le_bytes([c[0], c[1]]))
}

fn property(q: &mut Queue, set: Option<u64>, offset: u32) -> Result<u64, String> {
    let mut s = sqe(FABRICS, PSDT_SGL, 0);
    s[4] = if set.is_some() {
        FCTYPE_PROPERTY_SET
    } else {
        FCTYPE_PROPERTY_GET
    };
    s[44..48].copy_from_slice(&offset.to_le_bytes());
    if let Some(v) = set {
        s[48..56].copy_from_slice(&v.to_le_bytes());
    }
    let c = q.command(s, &[])?;
    if status(&c) != 0 {
        return Err(format!("property {offset:#x}: status {:#x}", status(&c)));
    }
    Ok(u64::from_le_bytes([
        c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7],
    ]))
}

fn io_sqe(opcode: u8, flags: u8) -> [u8; 64] {
    let mut s = sqe(opcode, flags | PSDT_SGL, 0);
    s[4..8].copy_from_slice(&1u32.to_le_bytes()); // NSID 1
    s[40..48].copy_from_slice(&LBA.to_le_bytes()); // SLBA; NLB 0 = one block
    s
}

/// Posts a fused Compare (of `expect`) + Write (of `new`) and returns both statuses.
fn fused(q: &mut Queue, expect: &[u8], new: &[u8]) -> Result<(u16, u16), String> {
    let (c1, c2) = (q.cid(), q.cid());
    let mut first = io_sqe(CMD_COMPARE, FUSE_FIRST);
    first[2..4].copy_from_slice(&c1.to_le_bytes());
    in_capsule(&mut first, expect.len());
    let mut second = io_sqe(CMD_WRITE, FUSE_SECOND);
    second[2..4].copy_from_slice(&c2.to_le_bytes());
    in_capsule(&mut second, new.len());
    q.send(&first, expect)?;
    q.send(&second, new)?;
    Ok((status(&q.wait(c1)?), status(&q.wait(c2)?)))
}

fn compare(q: &mut Queue, data: &[u8]) -> Result<u16, String> {
    Ok(status(&q.command(io_sqe(CMD_COMPARE, 0), data)?))
}

pub fn run(dst: SocketAddr, ids: &[&str; 3]) -> Result<String, String> {
    let mut admin = Queue::open(dst, 0, 0xffff)?;
    let cntlid = connect(&mut admin, 0, 0xffff, ids)?;
    property(&mut admin, Some(CC_ENABLE | CC_IOSQES | CC_IOCQES), REG_CC)?;
    let deadline = Instant::now() + Duration::from_secs(5);
    while property(&mut admin, None, REG_CSTS)? & CSTS_RDY == 0 {
        if Instant::now() > deadline {
            return Err("CSTS.RDY not set within 5 s".into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut io = Queue::open(dst, 1, cntlid)?;
    connect(&mut io, 1, cntlid, ids)?;
    println!("controller {cntlid}: admin and I/O queue connected over RDMA");
    let a = vec![0xa5u8; BLOCK];
    let b = vec![0x5bu8; BLOCK];
    let c = vec![0xc3u8; BLOCK];
    let check = |what: &str, ok: bool, got: String| -> Result<(), String> {
        println!("{what}: {got}");
        if ok {
            Ok(())
        } else {
            Err(format!("{what}: unexpected {got}"))
        }
    };
    let w = status(&io.command(io_sqe(CMD_WRITE, 0), &a)?);
    check("write A", w == 0, format!("status {w:#x}"))?;
    let (s1, s2) = fused(&mut io, &a, &b)?;
    check(
        "fused compare A + write B (block holds A)",
        s1 == 0 && s2 == 0,
        format!("status {s1:#x} / {s2:#x}"),
    )?;
    let s = compare(&mut io, &b)?;
    check(
        "compare B (the write was applied)",
        s == 0,
        format!("status {s:#x}"),
    )?;
    let (s1, s2) = fused(&mut io, &a, &c)?;
    check(
        "fused compare A + write C (block holds B)",
        s1 == SC_COMPARE_FAILED && s2 != 0,
        format!("status {s1:#x} / {s2:#x}"),
    )?;
    let s = compare(&mut io, &b)?;
    check(
        "compare B (the failed pair wrote nothing)",
        s == 0,
        format!("status {s:#x}"),
    )?;
    let s = compare(&mut io, &c)?;
    check(
        "compare C",
        s == SC_COMPARE_FAILED,
        format!("status {s:#x}"),
    )?;
    let _ = io.id.disconnect();
    let _ = admin.id.disconnect();
    Ok("fused ok".into())
}
