//! NVMe/TCP loopback benchmark: the gateway (a separate process, in-memory namespace, one
//! runtime worker thread = one gateway core) driven over 127.0.0.1 by a pipelined Rust
//! host. Prints IOPS, MiB/s, latency percentiles and gateway CPU time per I/O, and, as the
//! baseline measured in the same run, the same workloads against a null responder (the PDU
//! codec answering from a static buffer, no protocol core, no device) on one thread: the
//! ratio shows what the gateway costs on top of loopback TCP and the host.
//!
//!     cargo bench -p nvmeof-gateway --bench tcp_loopback [-- --seconds 5]
//!
//! `--gateway-bin PATH` runs another build of `nvmeof-gateway` (to compare two builds on the
//! same machine state).

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

mod common;

use nvmeof_gateway::host::pipelined::{LeanQueue, Region, Workload};
use nvmeof_gateway::host::{HostConnection, HostOptions};

const SUBNQN: &str = "nqn.2016-06.io.ceph-nvmeof-rs:bench";
const HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:bench-0000-0000-0000-000000000001";
const NS_BYTES: u64 = 1 << 30;
const REGION: Region = Region {
    nsid: 1,
    block_size: 512,
    bytes: NS_BYTES,
};

/// An I/O queue of the benchmark's controller (or of the null responder).
fn queue(addr: SocketAddr, cntlid: u16, qid: u16) -> LeanQueue {
    LeanQueue::connect(addr, SUBNQN, HOSTNQN, cntlid, qid).expect("connect an I/O queue")
}

const WORKLOADS: &[Workload] = &[
    Workload {
        name: "4K randread QD1",
        write: false,
        random: true,
        io_bytes: 4096,
        queue_depth: 1,
    },
    Workload {
        name: "4K randread QD32",
        write: false,
        random: true,
        io_bytes: 4096,
        queue_depth: 32,
    },
    Workload {
        name: "4K randwrite QD1",
        write: true,
        random: true,
        io_bytes: 4096,
        queue_depth: 1,
    },
    Workload {
        name: "4K randwrite QD32",
        write: true,
        random: true,
        io_bytes: 4096,
        queue_depth: 32,
    },
    Workload {
        name: "128K seqread QD8",
        write: false,
        random: false,
        io_bytes: 131072,
        queue_depth: 8,
    },
    Workload {
        name: "128K seqwrite QD8",
        write: true,
        random: false,
        io_bytes: 131072,
        queue_depth: 8,
    },
    // One large write at a time: between two of them the queue has nothing in flight, which
    // must not make it give back (and fault in again) the buffers a 1 MiB PDU needs.
    Workload {
        name: "1M seqwrite QD1",
        write: true,
        random: false,
        io_bytes: 1 << 20,
        queue_depth: 1,
    },
];

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// User + system CPU seconds of a process, from /proc/PID/stat (clock ticks of 1/100 s).
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after_comm = stat.rsplit_once(')').map(|(_, rest)| rest).unwrap_or("");
    let fields: Vec<&str> = after_comm.split_whitespace().collect();
    // After "pid (comm)": state is field 0, utime field 11, stime field 12.
    let ticks: u64 = [11, 12]
        .iter()
        .filter_map(|&i| fields.get(i)?.parse::<u64>().ok())
        .sum();
    ticks as f64 / 100.0
}

fn start_gateway(port: u16, binary: &str) -> Child {
    let dir = std::env::temp_dir().join(format!("nvmeof-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let config = dir.join("gateway.toml");
    std::fs::write(
        &config,
        format!(
            r#"
[gateway]
worker_threads = 1

[[listener]]
transport = "tcp"
address = "127.0.0.1"
port = {port}

[[subsystem]]
nqn = "{SUBNQN}"
allow_any_host = true

[[subsystem.namespace]]
nsid = 1
backend = "memory"
size = "1GiB"
"#
        ),
    )
    .expect("write config");
    let mut child = Command::new(binary)
        .arg("--config")
        .arg(&config)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("start {binary}: {e}"));
    for _ in 0..100 {
        if TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return child;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
    panic!("gateway did not start listening on port {port}");
}

/// Admin queue through the host library: Connect, enable, ask for I/O queues.
fn admin_connect(addr: SocketAddr) -> (tokio::runtime::Runtime, HostConnection, u16) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let (admin, cntlid) = rt.block_on(async {
        let admin = HostConnection::connect(addr, HostOptions::new(HOSTNQN))
            .await
            .expect("admin connection");
        let cntlid = admin.connect_admin(SUBNQN, 0).await.expect("admin connect");
        admin.enable_controller().await.expect("enable");
        (admin, cntlid)
    });
    (rt, admin, cntlid)
}

fn prefill(addr: SocketAddr, cntlid: u16) {
    // Write the whole namespace once so reads touch allocated memory, as on a used image.
    let mut q = queue(addr, cntlid, 2);
    let fill = Workload {
        name: "prefill",
        write: true,
        random: false,
        io_bytes: 1 << 20,
        queue_depth: 4,
    };
    let ios_needed = NS_BYTES / (1 << 20);
    let seconds_guess = Duration::from_millis(50);
    let mut written = 0;
    while written < ios_needed {
        written += q.run(&fill, &REGION, seconds_guess).expect("prefill").ios;
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let seconds = args
        .iter()
        .position(|a| a == "--seconds")
        .and_then(|i| args.get(i + 1))
        .and_then(|s| s.parse::<f64>().ok())
        .unwrap_or(4.0);
    // `cargo test --benches` runs benches with --bench absent: keep that quick.
    let duration = if args.iter().any(|a| a == "--bench") {
        Duration::from_secs_f64(seconds)
    } else {
        Duration::from_millis(200)
    };

    let port = free_port();
    let binary = args
        .iter()
        .position(|a| a == "--gateway-bin")
        .and_then(|i| args.get(i + 1))
        .map_or(env!("CARGO_BIN_EXE_nvmeof-gateway"), String::as_str);
    let mut gateway = start_gateway(port, binary);
    let gw_addr: SocketAddr = ([127, 0, 0, 1], port).into();
    let (_rt, _admin, cntlid) = admin_connect(gw_addr);
    prefill(gw_addr, cntlid);

    let null_addr = common::spawn_null_responder();

    println!(
        "NVMe/TCP loopback, in-memory namespace, gateway on 1 worker thread, {:.1} s per run",
        duration.as_secs_f64()
    );
    println!(
        "{:<20} {:>10} {:>9} {:>8} {:>8} {:>9} {:>11} {:>12} {:>7}",
        "workload",
        "IOPS",
        "MiB/s",
        "p50 us",
        "p99 us",
        "p99.9 us",
        "gw us/IO",
        "null IOPS",
        "ratio"
    );
    for (i, w) in WORKLOADS.iter().enumerate() {
        let mut q = queue(gw_addr, cntlid, 1 + (i as u16 % 2) * 2 + 1);
        let cpu_before = cpu_seconds(gateway.id());
        let mut figures = q.run(w, &REGION, duration).expect("gateway run");
        let cpu = cpu_seconds(gateway.id()) - cpu_before;
        drop(q);
        let mut null_q = queue(null_addr, 1, 1);
        let null = null_q
            .run(w, &REGION, duration)
            .expect("null responder run");
        drop(null_q);
        let iops = figures.iops();
        println!(
            "{:<20} {:>10.0} {:>9.1} {:>8.1} {:>8.1} {:>9.1} {:>11.2} {:>12.0} {:>7.2}",
            w.name,
            iops,
            iops * f64::from(w.io_bytes) / f64::from(1 << 20),
            figures.percentile_us(0.50),
            figures.percentile_us(0.99),
            figures.percentile_us(0.999),
            cpu / figures.ios.max(1) as f64 * 1e6,
            null.iops(),
            iops / null.iops().max(1.0),
        );
    }
    let _ = gateway.kill();
    let _ = gateway.wait();
}
