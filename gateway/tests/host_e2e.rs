//! The Rust initiator (`nvmeof_gateway::host`) against the real gateway over
//! loopback TCP: connect, bring-up, identify, discovery, and the NVM I/O
//! commands, with and without digests.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use nvmeof_gateway::host::cmd::{self, DISCOVERY_NQN};
use nvmeof_gateway::host::pipelined::{LeanQueue, Region, Workload};
use nvmeof_gateway::host::{HostConnection, HostError, HostOptions, Sqe, Xfer};
use tokio::sync::watch;

const SUBNQN: &str = "nqn.2016-06.io.test:host-e2e";
const HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:0f0f0f0f-0000-0000-0000-0000000000e2";
const SIZE: u64 = 16 << 20;

async fn start() -> (SocketAddr, watch::Sender<bool>) {
    let gw = common::start_gateway(SUBNQN, "16MiB").await;
    (gw.addr, gw.shutdown)
}

fn opts(hdgst: bool, ddgst: bool) -> HostOptions {
    let mut o = HostOptions::new(HOSTNQN);
    o.header_digest = hdgst;
    o.data_digest = ddgst;
    o.timeout = Duration::from_secs(10);
    o
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(29).wrapping_add(seed) ^ (i >> 9) as u8)
        .collect()
}

/// Admin bring-up; returns the admin connection, cntlid, block size and
/// the in-capsule limit for I/O queues.
async fn bring_up(addr: SocketAddr, o: &HostOptions) -> (HostConnection, u16, u32, usize) {
    let admin = HostConnection::connect(addr, o.clone()).await.unwrap();
    let cntlid = admin.connect_admin(SUBNQN, 30_000).await.unwrap();
    admin.enable_controller().await.unwrap();
    let ctrl = admin.identify_controller().await.unwrap();
    assert_eq!(ctrl.subnqn(), SUBNQN);
    assert_eq!(ctrl.cntlid(), cntlid);
    assert!(ctrl.nn() >= 1);
    assert!(ctrl.ioccsz() >= 4, "IOCCSZ {}", ctrl.ioccsz());
    let ns = admin.identify_namespace(1).await.unwrap();
    let bs = ns.block_size();
    assert!(bs >= 512, "block size {bs}");
    assert_eq!(ns.nsze() * bs as u64, SIZE);
    assert!(admin.active_namespaces(0).await.unwrap().contains(&1));
    admin.keep_alive().await.unwrap();
    (admin, cntlid, bs, ctrl.in_capsule_data_max())
}

async fn io_suite(hdgst: bool, ddgst: bool) {
    let (addr, _stop) = start().await;
    let o = opts(hdgst, ddgst);
    let (admin, cntlid, bs, icd) = bring_up(addr, &o).await;
    let q = HostConnection::connect(addr, o.clone()).await.unwrap();
    q.set_in_capsule_data_max(icd);
    q.connect_io(SUBNQN, cntlid, 1, 63).await.unwrap();
    assert_eq!(q.icresp().hdgst, hdgst);
    assert_eq!(q.icresp().ddgst, ddgst);

    // Small (in-capsule if the controller allows it) and large (R2T) writes.
    let small = pattern(bs as usize, 1);
    q.write(1, 3, small.clone(), bs).await.unwrap();
    assert_eq!(q.read(1, 3, 1, bs).await.unwrap(), small);
    let big = pattern(256 * 1024, 2);
    let nlb = (big.len() / bs as usize) as u32;
    q.write(1, 64, big.clone(), bs).await.unwrap();
    assert_eq!(q.read(1, 64, nlb, bs).await.unwrap(), big);
    // Forced R2T for a small write too.
    let r = q
        .submit_ok(
            Sqe::rw(cmd::io::WRITE, 1, 5, 1),
            Xfer::WriteR2t(pattern(bs as usize, 9).into()),
        )
        .await
        .unwrap();
    assert!(r.cqe.is_success());
    assert_eq!(q.read(1, 5, 1, bs).await.unwrap(), pattern(bs as usize, 9));

    // Pipelined: 32 writes, then 32 reads, all outstanding together.
    let mut inflight = Vec::new();
    for i in 0..32u64 {
        let data = pattern(8 * bs as usize, i as u8);
        inflight.push(
            q.start(
                Sqe::rw(cmd::io::WRITE, 1, 1024 + i * 8, 8),
                Xfer::Write(data.into()),
            )
            .await
            .unwrap(),
        );
    }
    for f in inflight {
        assert!(f.await.unwrap().cqe.is_success());
    }
    let mut inflight = Vec::new();
    for i in 0..32u64 {
        inflight.push(
            q.start(
                Sqe::rw(cmd::io::READ, 1, 1024 + i * 8, 8),
                Xfer::Read(8 * bs),
            )
            .await
            .unwrap(),
        );
    }
    for (i, f) in inflight.into_iter().enumerate() {
        let r = f.await.unwrap();
        assert!(r.cqe.is_success());
        assert_eq!(r.data, pattern(8 * bs as usize, i as u8), "read {i}");
    }

    // Compare, fused compare-and-write, write zeroes, deallocate, flush.
    assert!(q.compare(1, 3, small.clone(), bs).await.unwrap());
    assert!(!q.compare(1, 3, pattern(bs as usize, 7), bs).await.unwrap());
    let new = pattern(bs as usize, 8);
    assert!(q
        .compare_and_write(1, 3, small.clone(), new.clone(), bs)
        .await
        .unwrap());
    assert_eq!(q.read(1, 3, 1, bs).await.unwrap(), new);
    assert!(!q
        .compare_and_write(1, 3, small.clone(), small.clone(), bs)
        .await
        .unwrap());
    assert_eq!(q.read(1, 3, 1, bs).await.unwrap(), new);
    q.write_zeroes(1, 64, 4).await.unwrap();
    let r = q.read(1, 64, 8, bs).await.unwrap();
    assert!(r[..4 * bs as usize].iter().all(|&b| b == 0));
    assert_eq!(
        &r[4 * bs as usize..],
        &big[4 * bs as usize..8 * bs as usize]
    );
    q.dsm_deallocate(1, &[(68, 4)]).await.unwrap();
    q.flush(1).await.unwrap();

    // Out of range read: LBA Out of Range (SCT 0, SC 0x80).
    let end = SIZE / bs as u64;
    match q.read(1, end, 1, bs).await {
        Err(HostError::Nvme(c)) => assert_eq!((c.sct(), c.sc()), (0, 0x80)),
        other => panic!("read past the end: {other:?}"),
    }

    admin.shutdown_controller().await.unwrap();
}

#[tokio::test]
async fn io_without_digests() {
    io_suite(false, false).await;
}

#[tokio::test]
async fn io_with_header_and_data_digests() {
    io_suite(true, true).await;
}

/// With SQ flow control disabled at Connect (what `nvme connect-all` asks for when the
/// discovery log offers it), a successful read completes by its C2HData's SUCCESS flag
/// and no CapsuleResp follows: a stray one would be a completion for an unknown CID, which
/// the host treats as a protocol error and closes. Writes and failed reads still get a
/// CapsuleResp. With flow control on, every command gets one.
async fn reads_complete_with_their_data(disable_sq_flow_control: bool, data_digest: bool) {
    let (addr, _stop) = start().await;
    let mut o = opts(false, data_digest);
    o.disable_sq_flow_control = disable_sq_flow_control;
    let (_admin, cntlid, bs, icd) = bring_up(addr, &o).await;
    let q = HostConnection::connect(addr, o).await.unwrap();
    q.set_in_capsule_data_max(icd);
    q.connect_io(SUBNQN, cntlid, 1, 63).await.unwrap();
    assert_eq!(q.sq_flow_control_disabled(), disable_sq_flow_control);

    let data = pattern(4 * bs as usize, 5);
    let write = q
        .submit_ok(
            Sqe::rw(cmd::io::WRITE, 1, 8, 4),
            Xfer::Write(data.clone().into()),
        )
        .await
        .unwrap();
    assert!(!write.completed_by_data);
    for _ in 0..3 {
        let read = q
            .submit_ok(
                Sqe::rw(cmd::io::READ, 1, 8, 4),
                Xfer::Read(data.len() as u32),
            )
            .await
            .unwrap();
        assert_eq!(read.data, data);
        assert_eq!(read.completed_by_data, disable_sq_flow_control);
        if !disable_sq_flow_control {
            assert_eq!(read.cqe.sqid(), 1, "a CapsuleResp names the queue");
        }
    }
    let beyond = q
        .submit(
            Sqe::rw(cmd::io::READ, 1, SIZE / bs as u64, 1),
            Xfer::Read(bs),
        )
        .await
        .unwrap();
    assert!(!beyond.cqe.is_success());
    assert!(!beyond.completed_by_data, "an error needs its CapsuleResp");
    q.flush(1).await.unwrap();
    assert!(!q.is_closed(), "{:?}", q.close_reason());
}

#[tokio::test]
async fn reads_complete_by_capsule_resp_with_sq_flow_control() {
    reads_complete_with_their_data(false, false).await;
}

#[tokio::test]
async fn reads_complete_by_c2h_data_success_without_sq_flow_control() {
    reads_complete_with_their_data(true, false).await;
    reads_complete_with_their_data(true, true).await;
}

/// The benchmark's blocking host completes reads by C2HData SUCCESS when it connects
/// without SQ flow control, and by CapsuleResp otherwise (its read timeout turns a missed
/// completion into an error rather than a hang).
#[tokio::test]
async fn the_lean_queue_completes_reads_either_way() {
    let (addr, _stop) = start().await;
    let (_admin, cntlid, bs, _) = bring_up(addr, &opts(false, false)).await;
    for (qid, sq_flow_control_off) in [(1u16, false), (2, true)] {
        let figures = tokio::task::spawn_blocking(move || {
            let mut q =
                LeanQueue::connect_with(addr, SUBNQN, HOSTNQN, cntlid, qid, sq_flow_control_off)?;
            let reads = Workload {
                name: "4K randread QD4",
                write: false,
                random: true,
                io_bytes: 4096,
                queue_depth: 4,
            };
            let region = Region {
                nsid: 1,
                block_size: bs,
                bytes: SIZE,
            };
            q.run(&reads, &region, Duration::from_millis(100))
        })
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("sq_flow_control_off {sq_flow_control_off}: {e}"));
        assert!(figures.ios > 0);
    }
}

#[tokio::test]
async fn discovery() {
    let (addr, _stop) = start().await;
    let d = HostConnection::connect(addr, opts(false, false))
        .await
        .unwrap();
    d.connect_admin(DISCOVERY_NQN, 0).await.unwrap();
    // Like `nvme discover`: the log page needs an enabled controller.
    assert!(matches!(d.discovery_log().await, Err(HostError::Nvme(_))));
    d.enable_controller().await.unwrap();
    let log = d.discovery_log().await.unwrap();
    assert!(log.numrec >= 1);
    assert!(
        log.entries
            .iter()
            .any(|e| e.subnqn == SUBNQN && e.trtype == 3),
        "{log:?}"
    );
}

#[tokio::test]
async fn unknown_subsystem_is_refused() {
    let (addr, _stop) = start().await;
    let a = HostConnection::connect(addr, opts(false, false))
        .await
        .unwrap();
    match a.connect_admin("nqn.2016-06.io.test:nope", 0).await {
        Err(HostError::Nvme(c)) => assert_eq!(c.sct(), 1, "{c:?}"),
        other => panic!("{other:?}"),
    }
}
