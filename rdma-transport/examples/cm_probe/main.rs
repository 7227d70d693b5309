//! `cm_probe`: sends hand-made NVMe/RDMA connect requests and capsules to a target, for the
//! bad-input steps of `tests/vm/e2e-rdma.sh` (the library itself knows nothing of NVMe; this
//! tool does, minimally).
//!
//! ```text
//! cm_probe ADDR PORT HEX_PRIVATE_DATA      prints "rejected status=N" (NVMe/RDMA status from
//!                                          the reject's private data) or "established"
//! cm_probe ADDR PORT --bogus-rkey          admin queue, then a Fabrics Connect whose keyed SGL
//!                                          has a key the host never registered: the target's
//!                                          RDMA READ fails; prints "disconnected" when the
//!                                          target drops the queue pair
//! cm_probe ADDR PORT --no-ird           a valid admin request offering no responder resources
//!                                          (the target could never RDMA READ): "rejected status=7"
//! cm_probe ADDR PORT --beyond-mdts         admin queue, then a command with a 2 MiB keyed SGL
//!                                          (MDTS is 1 MiB): prints "status=0xNNNN" of the CQE
//! cm_probe ADDR PORT --fused-cw SUBNQN HOSTNQN HOSTID
//!                                          fused Compare-and-Write on namespace 1 (`fused`):
//!                                          prints each check and "fused ok"
//! ```

mod fused;

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use rdma_transport::{
    BufferPool, CmEventKind, CmId, CompletionChannel, CompletionQueue, EventChannel, Lent,
    PoolConfig, ProtectionDomain, QpCaps, VerbsRegistrar, WcOpcode,
};

fn hex(s: &str) -> Result<Vec<u8>, String> {
    if !s.len().is_multiple_of(2) {
        return Err("odd hex length".into());
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).map_err(|e| e.to_string()))
        .collect()
}

/// `struct nvme_rdma_cm_req` for an admin queue: recfmt 0, qid 0, hrqsize 32, hsqsize 31.
fn admin_request() -> Vec<u8> {
    let mut b = vec![0u8; 32];
    b[4..6].copy_from_slice(&32u16.to_le_bytes());
    b[6..8].copy_from_slice(&31u16.to_le_bytes());
    b[8..10].copy_from_slice(&0xffffu16.to_le_bytes());
    b
}

/// A Fabrics Connect SQE with a keyed SGL data block (type 4, subtype 0).
fn connect_sqe(len: u32, key: u32) -> [u8; 64] {
    let mut s = [0u8; 64];
    s[0] = 0x7f; // fabrics
    s[2..4].copy_from_slice(&7u16.to_le_bytes()); // CID
    s[4] = 0x01; // Connect
    s[24..32].copy_from_slice(&0x1000u64.to_le_bytes());
    s[32..35].copy_from_slice(&len.to_le_bytes()[..3]);
    s[35..39].copy_from_slice(&key.to_le_bytes());
    s[39] = 0x40;
    s[44..46].copy_from_slice(&31u16.to_le_bytes()); // SQSIZE
    s
}

fn run() -> Result<String, String> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() == 7 && args[3] == "--fused-cw" {
        let ip = args[1].parse().map_err(|e| format!("address: {e}"))?;
        let port: u16 = args[2].parse().map_err(|e| format!("port: {e}"))?;
        return fused::run(SocketAddr::new(ip, port), &[&args[4], &args[5], &args[6]]);
    }
    if args.len() != 4 {
        return Err(
            "usage: cm_probe ADDR PORT (HEX_PRIVATE_DATA | --bogus-rkey | --beyond-mdts | --fused-cw SUBNQN HOSTNQN HOSTID)".into(),
        );
    }
    let ip = args[1].parse().map_err(|e| format!("address: {e}"))?;
    let port: u16 = args[2].parse().map_err(|e| format!("port: {e}"))?;
    let dst = SocketAddr::new(ip, port);
    let ch = EventChannel::new().map_err(|e| e.to_string())?;
    let mut id = CmId::resolve(&ch, dst, 2000).map_err(|e| e.to_string())?;
    let ctx = id.context().ok_or("no device for the address")?;
    let pd = ProtectionDomain::new(ctx).map_err(|e| e.to_string())?;
    let cch = CompletionChannel::new(ctx).map_err(|e| e.to_string())?;
    let cq = CompletionQueue::new(ctx, 64, &cch).map_err(|e| e.to_string())?;
    id.create_qp(
        &pd,
        &cq,
        QpCaps {
            max_send_wr: 16,
            max_recv_wr: 16,
            max_inline_data: 64,
        },
    )
    .map_err(|e| e.to_string())?;
    let pool = BufferPool::new(
        &PoolConfig {
            classes: vec![(4096, 4)],
            cache_bytes: 0,
        },
        Box::new(VerbsRegistrar { pd: pd.clone() }),
    )
    .map_err(|e| e.to_string())?;
    let no_ird = args[3] == "--no-ird";
    let io = args[3].starts_with("--") && !no_ird;
    let private = if args[3].starts_with("--") {
        admin_request()
    } else {
        hex(&args[3])?
    };
    if io {
        let (buf, lkey) = pool.take(64).ok_or("no buffer")?;
        let qp = id.qp().ok_or("no qp")?;
        qp.post_recv(1, Lent { buf, lkey })
            .map_err(|(e, _)| e.to_string())?;
    }
    // The target RDMA READs from us: offer responder resources (none with --no-ird).
    let ird = if no_ird { 0 } else { 16 };
    id.connect(&private, ird, 0).map_err(|e| e.to_string())?;
    let ev = ch
        .wait_event(5000)
        .map_err(|e| e.to_string())?
        .ok_or("no answer")?;
    match ev.kind {
        CmEventKind::Rejected => {
            let p = &ev.params.private_data;
            return Ok(if p.len() >= 4 {
                format!("rejected status={}", u16::from_le_bytes([p[2], p[3]]))
            } else {
                format!("rejected without private data (reason {})", ev.status)
            });
        }
        CmEventKind::Established => {}
        other => return Err(format!("unexpected event {other:?} status {}", ev.status)),
    }
    if !io {
        return Ok("established".into());
    }
    let sqe = match args[3].as_str() {
        "--bogus-rkey" => connect_sqe(1024, 0xdead_beef),
        "--beyond-mdts" => connect_sqe(2 << 20, 0x1234),
        o => return Err(format!("unknown mode {o}")),
    };
    let qp = id.qp().ok_or("no qp")?;
    qp.post_write_send(2, None, &sqe, None)
        .map_err(|(e, _)| e.to_string())?;
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut wcs = Vec::new();
    while Instant::now() < deadline {
        if let Some(ev) = ch.next_event().map_err(|e| e.to_string())? {
            if ev.kind == CmEventKind::Disconnected {
                let _ = id.disconnect();
                return Ok("disconnected".into());
            }
        }
        wcs.clear();
        cq.poll(&mut wcs, 16).map_err(|e| e.to_string())?;
        for wc in &wcs {
            let qp = id.qp().ok_or("no qp")?;
            let reaped = qp.reap(wc);
            if !wc.is_ok() {
                continue; // flushed after the target dropped the connection
            }
            if wc.opcode == WcOpcode::Recv {
                if let Some((_, Some(buf))) = reaped {
                    if buf.len() >= 16 {
                        let status = u16::from_le_bytes([buf[14], buf[15]]) >> 1;
                        let _ = id.disconnect();
                        return Ok(format!("status={status:#06x}"));
                    }
                }
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Err("no answer within 10 s".into())
}

fn main() -> ExitCode {
    match run() {
        Ok(s) => {
            println!("{s}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            println!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
