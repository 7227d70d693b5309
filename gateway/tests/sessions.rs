//! Controller and connection lifetimes over real sockets: keep-alive expiry, many queues
//! at once, PDU alignment the host asks for, and a clean shutdown.

mod common;

use std::sync::Arc;
use std::time::Duration;

use nvmeof_gateway::host::cmd;
use nvmeof_gateway::host::{HostConnection, HostOptions, Sqe, Xfer};

const SUBNQN: &str = "nqn.2016-06.io.test:sessions";

fn opts(host: &str) -> HostOptions {
    let mut o = HostOptions::new(format!("nqn.2014-08.org.nvmexpress:uuid:{host}"));
    o.timeout = Duration::from_secs(10);
    o
}

async fn admin(addr: std::net::SocketAddr, o: &HostOptions, kato_ms: u32) -> (HostConnection, u16) {
    let admin = HostConnection::connect(addr, o.clone())
        .await
        .expect("admin connection");
    let cntlid = admin
        .connect_admin(SUBNQN, kato_ms)
        .await
        .expect("admin connect");
    admin.enable_controller().await.expect("enable");
    (admin, cntlid)
}

async fn io_queue(
    addr: std::net::SocketAddr,
    o: &HostOptions,
    cntlid: u16,
    qid: u16,
) -> HostConnection {
    let io = HostConnection::connect(addr, o.clone())
        .await
        .expect("I/O connection");
    io.connect_io(SUBNQN, cntlid, qid, 127)
        .await
        .expect("I/O connect");
    io
}

#[tokio::test]
async fn keep_alive_expiry_ends_that_controller_only() {
    let gw = common::start_gateway(SUBNQN, "8MiB").await;
    let timeouts_before = common::transport_counter("nvmeof_keep_alive_timeouts_total");
    let silent = opts("silent");
    let chatty = opts("chatty");
    let (silent_admin, silent_id) = admin(gw.addr, &silent, 500).await;
    let silent_io = io_queue(gw.addr, &silent, silent_id, 1).await;
    let (chatty_admin, chatty_id) = admin(gw.addr, &chatty, 500).await;
    let chatty_admin = Arc::new(chatty_admin);
    let _beat = chatty_admin.spawn_keep_alive(Duration::from_millis(150));

    // The silent host sends nothing for several KATO periods.
    assert!(
        silent_admin.wait_closed(Duration::from_secs(5)).await,
        "admin queue of the silent controller closed after KATO"
    );
    assert!(
        silent_io.wait_closed(Duration::from_secs(5)).await,
        "its I/O queue closed too"
    );
    let timeouts = common::transport_counter("nvmeof_keep_alive_timeouts_total") - timeouts_before;
    assert!(timeouts >= 1.0, "the keep-alive timeout is counted");

    // The other controller is untouched and still serves I/O.
    let chatty_io = io_queue(gw.addr, &chatty, chatty_id, 1).await;
    chatty_io
        .write(1, 0, vec![0x5a; 4096], 512)
        .await
        .expect("write");
    assert_eq!(
        chatty_io.read(1, 0, 8, 512).await.expect("read"),
        vec![0x5a; 4096]
    );
    assert!(!chatty_admin.is_closed());

    // The silent host can come back as a new controller.
    let (_again, again_id) = admin(gw.addr, &silent, 0).await;
    assert_ne!(again_id, chatty_id);
}

#[tokio::test]
async fn many_queues_and_connections_at_once() {
    let gw = common::start_gateway(SUBNQN, "64MiB").await;
    let o = opts("many");
    let (_admin, cntlid) = admin(gw.addr, &o, 0).await;
    let mut tasks = Vec::new();
    for qid in 1..=8u16 {
        let io = io_queue(gw.addr, &o, cntlid, qid).await;
        tasks.push(tokio::spawn(async move {
            // Each queue owns a 1 MiB region and keeps 16 commands in flight.
            let base = u64::from(qid) * 2048;
            for batch in 0..4u64 {
                let mut inflight = Vec::new();
                for i in batch * 16..(batch + 1) * 16 {
                    let data = vec![(qid as u8) ^ (i as u8); 8192];
                    let sqe = Sqe::rw(cmd::io::WRITE, 1, base + i * 16, 16);
                    inflight.push(
                        io.start(sqe, Xfer::Write(data.into()))
                            .await
                            .expect("submit"),
                    );
                }
                for f in inflight {
                    assert!(f.wait().await.expect("write").cqe.is_success());
                }
            }
            for i in 0..64u64 {
                let back = io.read(1, base + i * 16, 16, 512).await.expect("read");
                assert!(
                    back.iter().all(|&b| b == (qid as u8) ^ (i as u8)),
                    "queue {qid} block {i}"
                );
            }
            io
        }));
    }
    let mut queues = Vec::new();
    for t in tasks {
        queues.push(t.await.expect("queue task"));
    }
    // A duplicate QID is refused while the first is connected.
    let dup = HostConnection::connect(gw.addr, o.clone())
        .await
        .expect("connection");
    assert!(dup.connect_io(SUBNQN, cntlid, 1, 127).await.is_err());
    // Once a queue goes, its QID can be connected again (fast reconnect, as ESXi does).
    drop(queues.remove(0));
    let again = HostConnection::connect(gw.addr, o.clone())
        .await
        .expect("connection");
    let mut reconnected = false;
    for _ in 0..50 {
        if again.connect_io(SUBNQN, cntlid, 1, 127).await.is_ok() {
            reconnected = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(reconnected, "QID 1 reusable after its connection closed");
}

#[tokio::test]
async fn host_pdu_alignment_and_digests_are_honoured() {
    let gw = common::start_gateway(SUBNQN, "8MiB").await;
    for (hpda, digests) in [(3u8, false), (7, true), (31, true)] {
        let mut o = opts("aligned");
        o.hpda = hpda;
        o.header_digest = digests;
        o.data_digest = digests;
        let (_admin, cntlid) = admin(gw.addr, &o, 0).await;
        let io = io_queue(gw.addr, &o, cntlid, 1).await;
        let data: Vec<u8> = (0..65536u32)
            .map(|i| (i * 7 + u32::from(hpda)) as u8)
            .collect();
        io.write(1, 64, data.clone(), 512).await.expect("write");
        assert_eq!(
            io.read(1, 64, 128, 512).await.expect("read"),
            data,
            "HPDA {hpda}"
        );
    }
}

#[tokio::test]
async fn shutdown_closes_connections_and_stops_the_listener() {
    let gw = common::start_gateway(SUBNQN, "8MiB").await;
    let o = opts("shutdown");
    let (admin_conn, cntlid) = admin(gw.addr, &o, 0).await;
    let io = io_queue(gw.addr, &o, cntlid, 1).await;
    gw.shutdown.send(true).expect("signal shutdown");
    tokio::time::timeout(Duration::from_secs(5), gw.server)
        .await
        .expect("server stops within 5 s")
        .expect("server task");
    assert!(admin_conn.wait_closed(Duration::from_secs(5)).await);
    assert!(io.wait_closed(Duration::from_secs(5)).await);
    assert!(
        HostConnection::connect(gw.addr, o).await.is_err(),
        "listener closed"
    );
}

#[tokio::test]
async fn shutdown_lets_commands_at_the_device_finish_first() {
    let target = common::target_with_device(
        SUBNQN,
        Arc::new(common::DelayedDevice::new(
            rbd_backend::MemoryDevice::new("slow", 1 << 20),
            Duration::from_millis(300),
        )),
    );
    let server =
        nvmeof_gateway::tcp::server::TcpServer::bind("127.0.0.1:0".parse().unwrap(), target)
            .await
            .unwrap();
    let addr = server.local_addr().unwrap();
    let (shutdown, rx) = tokio::sync::watch::channel(false);
    let serving = tokio::spawn(server.serve(rx));

    let o = opts("drain");
    let (_admin, cntlid) = admin(addr, &o, 0).await;
    let io = io_queue(addr, &o, cntlid, 1).await;
    let write = io
        .start(
            Sqe::rw(cmd::io::WRITE, 1, 0, 8),
            Xfer::Write(vec![0x77; 4096].into()),
        )
        .await
        .expect("submit");
    tokio::time::sleep(Duration::from_millis(50)).await;
    shutdown.send(true).expect("signal shutdown");
    let done = write
        .wait()
        .await
        .expect("the write completes before the queue closes");
    assert!(done.cqe.is_success());
    assert!(io.wait_closed(Duration::from_secs(5)).await);
    tokio::time::timeout(Duration::from_secs(5), serving)
        .await
        .expect("server stops")
        .expect("server task");
}
