//! The gateway-wide data budget: with the device stalled (a cluster that does not answer),
//! NVMe/TCP commands beyond the budget wait without a buffer instead of growing the
//! gateway, every queue still gets one command through, and all of them complete once the
//! device answers again.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use common::host::{try_connect, Attach, HostQueues};
use common::{pattern, poll_until};
use nvmeof_gateway::core::DataBudget;
use nvmeof_gateway::host::cmd::{io, Sqe};
use nvmeof_gateway::host::{Inflight, Xfer};
use nvmeof_gateway::tcp::server::TcpServer;
use rbd_backend::{BlockDevice, IoCompletion, IoOp, MemoryDevice};

const SUBNQN: &str = "nqn.2016-06.io.test:budget";
const MIB: usize = 1 << 20;
const BLOCKS_PER_MIB: u32 = (MIB / 512) as u32;
const NS_BYTES: u64 = 64 << 20;

type Parked = (u64, IoOp, Arc<dyn IoCompletion>);

/// A memory device whose ops wait while it is closed, as behind a stalled cluster.
struct GatedDevice {
    inner: MemoryDevice,
    parked: Mutex<Option<Vec<Parked>>>,
}

impl GatedDevice {
    fn closed() -> Arc<Self> {
        Arc::new(Self {
            inner: MemoryDevice::new("gated", NS_BYTES),
            parked: Mutex::new(Some(Vec::new())),
        })
    }

    fn waiting(&self) -> usize {
        self.parked.lock().unwrap().as_ref().map_or(0, Vec::len)
    }

    /// Completes the flushes that wait (they hold no buffer), keeping the rest waiting.
    fn complete_flushes(&self) {
        let flushes = {
            let mut parked = self.parked.lock().unwrap();
            let list = parked.as_mut().expect("closed");
            let (flushes, rest) = std::mem::take(list)
                .into_iter()
                .partition(|(_, op, _)| matches!(op, IoOp::Flush));
            *list = rest;
            flushes
        };
        let flushes: Vec<Parked> = flushes;
        for (tag, op, completion) in flushes {
            self.inner.submit(tag, op, &completion);
        }
    }

    /// Runs what waits and everything after it.
    fn open(&self) {
        let parked = self.parked.lock().unwrap().take().unwrap_or_default();
        for (tag, op, completion) in parked {
            self.inner.submit(tag, op, &completion);
        }
    }
}

impl BlockDevice for GatedDevice {
    fn name(&self) -> &str {
        "gated"
    }

    fn size_bytes(&self) -> u64 {
        self.inner.size_bytes()
    }

    fn submit(&self, tag: u64, op: IoOp, completion: &Arc<dyn IoCompletion>) {
        let mut parked = self.parked.lock().unwrap();
        match parked.as_mut() {
            Some(list) => list.push((tag, op, completion.clone())),
            None => {
                drop(parked);
                self.inner.submit(tag, op, completion);
            }
        }
    }

    fn set_event_sink(&self, sink: Arc<dyn rbd_backend::DeviceEventSink>) {
        self.inner.set_event_sink(sink);
    }
}

/// A gateway serving one gated namespace, its connections' buffers counted against
/// `budget`.
async fn serve(
    device: Arc<GatedDevice>,
    budget: &'static DataBudget,
) -> (std::net::SocketAddr, tokio::sync::watch::Sender<bool>) {
    let target = common::target_with_device(SUBNQN, device);
    let server = TcpServer::bind("127.0.0.1:0".parse().expect("address"), target)
        .await
        .expect("bind")
        .with_data_budget(budget);
    let addr = server.local_addr().expect("address");
    let (shutdown, rx) = tokio::sync::watch::channel(false);
    tokio::spawn(server.serve(rx));
    (addr, shutdown)
}

async fn host(addr: std::net::SocketAddr, n: u8) -> HostQueues {
    let mut attach = Attach::new(
        &format!("nqn.2014-08.org.nvmexpress:uuid:0f0f0f0f-0000-0000-0000-0000000b0d{n:02}"),
        SUBNQN,
    );
    attach.io_sqsize = 63;
    try_connect(addr, &attach).await.expect("connect")
}

/// Starts a 1 MiB read of MiB `slot`.
async fn start_read(host: &HostQueues, slot: u32) -> Inflight {
    let sqe = Sqe::rw(
        io::READ,
        1,
        u64::from(slot * BLOCKS_PER_MIB),
        BLOCKS_PER_MIB,
    );
    host.io
        .start(sqe, Xfer::Read(MIB as u32))
        .await
        .expect("start a read")
}

/// Starts a 1 MiB write of `data` at MiB `slot`.
async fn start_write(host: &HostQueues, slot: u32, data: &Bytes) -> Inflight {
    let sqe = Sqe::rw(
        io::WRITE,
        1,
        u64::from(slot * BLOCKS_PER_MIB),
        BLOCKS_PER_MIB,
    );
    host.io
        .start(sqe, Xfer::Write(data.clone()))
        .await
        .expect("start a write")
}

async fn settles_at(what: &str, within: Duration, mut value: impl FnMut() -> usize, want: usize) {
    poll_until(within, Duration::from_millis(20), async || match value() {
        v if v == want => Ok(()),
        v => Err(format!("{what}: {v}, want {want}")),
    })
    .await;
}

/// Waits until `at_device` ops wait at the device and `waiting` commands for the budget.
async fn settle(device: &GatedDevice, budget: &DataBudget, at_device: usize, waiting: usize) {
    let within = Duration::from_secs(5);
    settles_at("ops at the device", within, || device.waiting(), at_device).await;
    settles_at(
        "commands waiting for the budget",
        within,
        || budget.held().0 as usize,
        waiting,
    )
    .await;
}

#[tokio::test]
async fn commands_beyond_the_budget_wait_without_buffers_and_all_complete() {
    let device = GatedDevice::closed();
    let budget = DataBudget::leaked(4 * MIB);
    let (addr, _shutdown) = serve(device.clone(), budget).await;
    let h = host(addr, 1).await;

    let data: Vec<Bytes> = (0..12u8).map(|i| Bytes::from(pattern(MIB, i))).collect();
    let mut writes = Vec::new();
    for (slot, d) in data.iter().enumerate() {
        writes.push(start_write(&h, slot as u32, d).await);
    }
    // Four fit in the budget and reach the device; the other eight wait, holding nothing.
    settle(&device, budget, 4, 8).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(device.waiting(), 4, "no more reach the device meanwhile");
    let in_use = budget.in_use();
    assert!(
        (4 * MIB..=4 * MIB + 64 * 1024).contains(&in_use),
        "{in_use} bytes held for 4 MiB of writes"
    );

    device.open();
    for w in writes {
        let r = w.wait().await.expect("write");
        assert!(r.cqe.is_success(), "write status {:#x}", r.cqe.status());
    }
    for (slot, d) in data.iter().enumerate() {
        let got =
            h.io.read(1, (slot * MIB / 512) as u64, BLOCKS_PER_MIB, 512)
                .await
                .expect("read back");
        assert!(got == d[..], "MiB {slot} reads back what was written");
    }
    assert_eq!(budget.held(), (0, 8), "8 commands waited, none waits now");
}

#[tokio::test]
async fn reads_wait_for_the_budget_too_and_a_queue_holding_nothing_always_gets_one_through() {
    let device = GatedDevice::closed();
    let budget = DataBudget::leaked(2 * MIB);
    let (addr, _shutdown) = serve(device.clone(), budget).await;
    let a = host(addr, 2).await;
    let mut reads = Vec::new();
    for slot in 0..6u32 {
        reads.push(start_read(&a, slot).await);
    }
    settle(&device, budget, 2, 4).await;

    // Host A holds the whole budget, at a device that does not answer. Host B's queue holds
    // nothing, so its write is let through.
    let b = host(addr, 3).await;
    let data = Bytes::from(pattern(MIB, 0xb));
    let write = start_write(&b, 40, &data).await;
    settles_at(
        "ops at the device",
        Duration::from_secs(5),
        || device.waiting(),
        3,
    )
    .await;
    // ... but only one: its next command waits like A's.
    let second = start_write(&b, 41, &data).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(device.waiting(), 3);

    device.open();
    for r in reads {
        let r = r.wait().await.expect("read");
        assert!(r.cqe.is_success());
        assert_eq!(r.data.len(), MIB);
    }
    for w in [write, second] {
        assert!(w.wait().await.expect("write").cqe.is_success());
    }
    assert_eq!(
        b.io.read(1, (40 * MIB / 512) as u64, BLOCKS_PER_MIB, 512)
            .await
            .expect("read back"),
        data[..]
    );
    assert_eq!(budget.held().0, 0);
}

/// A queue whose last op at the device needed no buffer (a flush) becomes one that holds
/// nothing when it completes, though no buffer was released: its held read must go on then,
/// not wait for a release somewhere else (with the cluster stalled, none may come).
#[tokio::test]
async fn a_held_command_goes_on_when_its_queue_empties_without_a_release() {
    let device = GatedDevice::closed();
    let budget = DataBudget::leaked(2 * MIB);
    let (addr, _shutdown) = serve(device.clone(), budget).await;
    // Host B holds the whole budget at the device.
    let b = host(addr, 4).await;
    let mut b_reads = Vec::new();
    for slot in 0..2u32 {
        b_reads.push(start_read(&b, slot).await);
    }
    settle(&device, budget, 2, 0).await;
    // Host A: a flush at the device, then a read that waits for the budget.
    let a = host(addr, 5).await;
    let flush = a.io.start(Sqe::flush(1), Xfer::None).await.expect("flush");
    settle(&device, budget, 3, 0).await;
    let a_read = start_read(&a, 0).await;
    settle(&device, budget, 3, 1).await;

    device.complete_flushes();
    assert!(flush.wait().await.expect("flush").cqe.is_success());
    // A holds nothing now: its read reaches the device while B still holds the budget.
    settle(&device, budget, 3, 0).await;

    device.open();
    assert!(a_read.wait().await.expect("read").cqe.is_success());
    for r in b_reads {
        assert!(r.wait().await.expect("read").cqe.is_success());
    }
}
