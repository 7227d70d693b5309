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
//!
//! After the table (or alone, with `--qd1-only`), 4K random reads at QD1 through the gateway
//! against two busy-polling targets, with the host on CPU 0 and the targets on CPU 1: the
//! null responder and an SPDK-like RAM target (docs/performance.md, "Busy polling by
//! default"). On this 2-core VM, many short rounds (`--seconds 1 --rounds 15`) gave steadier
//! medians than a few long ones. `--share-cpu` puts the host on the targets' CPU instead (a
//! polling target that never yields starves it there: compare gateway builds, not ratios).
//!
//! `--polling-off-vs-default` compares two gateways, one with busy polling off and one with
//! the default, alternating over `--rounds`: 4K QD1 and QD32 reads and QD32 writes; with
//! `--queues N` first 4K reads at QD1 on N queues at once (a host thread each), as a host
//! whose threads each keep one command in flight, all on the gateway's one worker.
//!
//! `--qos` measures per-namespace QoS instead (docs/performance.md, "QoS limits"): 4K QD32
//! on a namespace without limits against one whose every limit is far above what it can
//! reach (the throttle's check runs, it never waits), alternating over `--rounds` (default
//! 3); then the rate a namespace limited to 1K, 10K and 100K IOPS and to 200 MB/s achieves,
//! against its limit.
//!
//! `--visibility` measures per-host namespace visibility (docs/performance.md, "Per-host
//! visibility"): two subsystems of 1000 namespaces each, every namespace of one visible to
//! all hosts, every namespace of the other to 64 hosts (the bench's among them): Identify
//! (active namespace list, Identify Namespace) one at a time on the admin queue, and 4K QD1
//! and QD32 reads of the same NSID, alternating over `--rounds`. The core alone (no socket)
//! is the `visibility_core` bench.
//!
//! `--tls` measures secure channels (docs/performance.md, "TLS"): 4K randread QD1 and QD32
//! on a plain listener, through a host-side plain relay (the copy the TLS client adds, without
//! TLS), and over TLS 1.3 with a PSK to a secure listener (an OpenSSL client relaying the
//! host's bytes, as tests/tls.rs does), alternating over `--rounds`; IOPS and gateway CPU per
//! I/O as ratios to the plain run. The gateway serves TLS with kernel TLS where the kernel
//! has the `tls` module, else through its user-space relay: the line before the table says
//! which (from its metrics).

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::Duration;

mod common;

use common::Polling;
use control_plane::test_support::free_port;
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
    queue_of(addr, SUBNQN, cntlid, qid)
}

fn queue_of(addr: SocketAddr, subnqn: &str, cntlid: u16, qid: u16) -> LeanQueue {
    LeanQueue::connect(addr, subnqn, HOSTNQN, cntlid, qid).expect("connect an I/O queue")
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

/// CPU seconds a process's live threads have run, to the nanosecond: the sum of the first
/// field of /proc/PID/task/*/schedstat. /proc/PID/stat counts in ticks of 10 ms, too coarse
/// for a process that should spend under 1% of a CPU over a few seconds. A thread that
/// exits between two readings takes its time with it; the gateways these benches start
/// keep their threads (one runtime worker, no group, no authentication).
fn cpu_seconds(pid: u32) -> f64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0.0;
    };
    let ns: u64 = tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum();
    ns as f64 / 1e9
}

/// The default run's subsystem: one 1 GiB in-memory namespace.
fn default_subsystem() -> String {
    format!(
        r#"
[[subsystem]]
nqn = "{SUBNQN}"
allow_any_host = true

[[subsystem.namespace]]
nsid = 1
backend = "memory"
size = "1GiB"
"#
    )
}

/// Starts the gateway (one worker thread, a TCP listener on `port`) with `subsystems`
/// (`[[subsystem]]` tables of its configuration file) and `gateway` (more lines of its
/// `[gateway]` table).
fn start_gateway(port: u16, binary: &str, gateway: &str, subsystems: &str) -> Child {
    start_gateway_with_metrics(port, None, binary, gateway, subsystems)
}

/// [`start_gateway`] with `/metrics` on 127.0.0.1:`metrics_port` (`None`: none).
fn start_gateway_with_metrics(
    port: u16,
    metrics_port: Option<u16>,
    binary: &str,
    gateway: &str,
    subsystems: &str,
) -> Child {
    let metrics = metrics_port
        .map(|p| format!("metrics_listen = \"127.0.0.1:{p}\"\n"))
        .unwrap_or_default();
    let dir = std::env::temp_dir().join(format!("nvmeof-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let config = dir.join("gateway.toml");
    std::fs::write(
        &config,
        format!(
            r#"
[gateway]
worker_threads = 1
{metrics}{gateway}

[[listener]]
transport = "tcp"
address = "127.0.0.1"
port = {port}
{subsystems}"#
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
    for _ in 0..400 {
        if TcpStream::connect(("127.0.0.1", port)).is_ok() {
            // Read at the start (and on SIGHUP, which the bench never sends): nothing of the
            // run is left in $TMPDIR.
            let _ = std::fs::remove_dir_all(&dir);
            return child;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
    panic!("gateway did not start listening on port {port}");
}

/// Admin queue through the host library: Connect, enable, ask for I/O queues.
fn admin_connect(addr: SocketAddr, subnqn: &str) -> (tokio::runtime::Runtime, HostConnection, u16) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let (admin, cntlid) = rt.block_on(async {
        let admin = HostConnection::connect(addr, HostOptions::new(HOSTNQN))
            .await
            .expect("admin connection");
        let cntlid = admin.connect_admin(subnqn, 0).await.expect("admin connect");
        admin.enable_controller().await.expect("enable");
        (admin, cntlid)
    });
    (rt, admin, cntlid)
}

fn prefill(addr: SocketAddr, subnqn: &str, cntlid: u16, region: &Region) {
    // Write the whole namespace once so reads touch allocated memory, as on a used image.
    let mut q = queue_of(addr, subnqn, cntlid, 2);
    let fill = Workload {
        name: "prefill",
        write: true,
        random: false,
        io_bytes: 1 << 20,
        queue_depth: 4,
    };
    let ios_needed = region.bytes / (1 << 20);
    // One run must write it all: each run starts again at LBA 0, so runs of 50 ms that only
    // added up to the size wrote what one such run writes over and over, and most random
    // reads then met never-written chunks (the in-memory device zero-fills those: a memset per read in
    // a callgrind profile of the gateway).
    let mut run_for = Duration::from_millis(250);
    while q.run(&fill, region, run_for).expect("prefill").ios < ios_needed {
        run_for *= 2;
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let value = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
    };
    let seconds = value("--seconds")
        .and_then(|s| s.parse::<f64>().ok())
        .unwrap_or(4.0);
    // `cargo test --benches` runs benches with --bench absent: keep that quick.
    let duration = if args.iter().any(|a| a == "--bench") {
        Duration::from_secs_f64(seconds)
    } else {
        Duration::from_millis(200)
    };
    let rounds = value("--rounds")
        .and_then(|s| s.parse::<usize>().ok())
        .unwrap_or(3)
        .max(1);
    let binary =
        value("--gateway-bin").map_or(env!("CARGO_BIN_EXE_nvmeof-gateway"), String::as_str);
    let mut gateway_lines = String::new();
    if let Some(us) = value("--busy-poll-us") {
        let us: u32 = us.parse().expect("--busy-poll-us: microseconds");
        gateway_lines += &format!("tcp_busy_poll_us = {us}\n");
    }
    if args.iter().any(|a| a == "--busy-poll-always") {
        gateway_lines += "tcp_busy_poll_adaptive = false\n";
    }
    if args.iter().any(|a| a == "--qos") {
        qos_bench(binary, &gateway_lines, duration, rounds);
    } else if args.iter().any(|a| a == "--polling-off-vs-default") {
        let queues = value("--queues").map_or(1, |v| v.parse().expect("--queues N"));
        polling_off_vs_default(binary, duration, rounds, queues);
    } else if args.iter().any(|a| a == "--visibility") {
        visibility_bench(binary, &gateway_lines, duration, rounds);
    } else if args.iter().any(|a| a == "--tls") {
        tls_bench(binary, duration, rounds);
    } else {
        let table = !args.iter().any(|a| a == "--qd1-only");
        let share_cpu = args.iter().any(|a| a == "--share-cpu");
        default_bench(binary, &gateway_lines, duration, rounds, table, share_cpu);
    }
}

fn default_bench(
    binary: &str,
    gateway_lines: &str,
    duration: Duration,
    rounds: usize,
    table: bool,
    share_cpu: bool,
) {
    let port = free_port();
    let metrics_port = free_port();
    let mut gateway = start_gateway_with_metrics(
        port,
        Some(metrics_port),
        binary,
        gateway_lines,
        &default_subsystem(),
    );
    let gw_addr: SocketAddr = ([127, 0, 0, 1], port).into();
    let metrics: SocketAddr = ([127, 0, 0, 1], metrics_port).into();
    let (_rt, _admin, cntlid) = admin_connect(gw_addr, SUBNQN);
    prefill(gw_addr, SUBNQN, cntlid, &REGION);

    let null_addr = common::spawn_null_responder();

    let polling = match gateway_lines.trim() {
        "" => "busy polling as by default".to_string(),
        lines => lines.replace('\n', ", "),
    };
    println!(
        "NVMe/TCP loopback, in-memory namespace, gateway on 1 worker thread ({polling}), \
         {:.1} s per run",
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
    for w in WORKLOADS.iter().filter(|_| table) {
        // Not a fixed queue ID: the prefill's queue (ID 2) may still be closing.
        let mut q = queue(gw_addr, cntlid, next_qid());
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
    qd1_against_polling(
        &gateway, gw_addr, metrics, cntlid, duration, rounds, share_cpu,
    );
    idle_cpu(&gateway, gw_addr, cntlid, duration);
    let _ = gateway.kill();
    let _ = gateway.wait();
}

/// Two gateways, one with busy polling off (`a`, `tcp_busy_poll_us = 0`) and one as by
/// default (`b`), compared at QD1 and QD32 in alternating rounds: what polling by default
/// changes, on the same machine state (docs/performance.md, "Busy polling by default").
fn polling_off_vs_default(binary: &str, duration: Duration, rounds: usize, queues: u16) {
    let start = |lines: &str| {
        let port = free_port();
        let gateway = start_gateway(port, binary, lines, &default_subsystem());
        let addr: SocketAddr = ([127, 0, 0, 1], port).into();
        let admin = admin_connect(addr, SUBNQN);
        prefill(addr, SUBNQN, admin.2, &REGION);
        (gateway, addr, admin)
    };
    let (mut off, off_addr, off_admin) = start("tcp_busy_poll_us = 0\n");
    let (mut on, on_addr, on_admin) = start("");
    println!(
        "Busy polling off (a) against the default (b), NVMe/TCP loopback, in-memory \
         namespace, gateway on 1 worker thread, {:.1} s per run, {rounds} rounds",
        duration.as_secs_f64()
    );
    compare_header("a", "b");
    let qd1 = &WORKLOADS[0];
    let write = Workload {
        name: "4K randwrite QD32",
        write: true,
        ..QD32_READ
    };
    if queues > 1 {
        let name = format!("{} x{queues}", qd1.name);
        compare_runs(
            &name,
            rounds,
            || measure_queues(&off, off_addr, off_admin.2, qd1, duration, queues),
            || measure_queues(&on, on_addr, on_admin.2, qd1, duration, queues),
        );
    }
    for w in [qd1, &QD32_READ, &write] {
        compare_runs(
            w.name,
            rounds,
            || measure(&off, off_addr, SUBNQN, off_admin.2, w, &REGION, duration),
            || measure(&on, on_addr, SUBNQN, on_admin.2, w, &REGION, duration),
        );
    }
    for gateway in [&mut off, &mut on] {
        let _ = gateway.kill();
        let _ = gateway.wait();
    }
}

/// 4K random reads at QD1 through the gateway against two targets that busy-poll their
/// socket (the SPDK way: the target never sleeps, so a command never waits for it to wake):
/// the null responder, which sends a static buffer, and the same responder with a RAM disk
/// as large as the gateway's namespace, which copies each read from it at the command's LBA
/// (SPDK's malloc bdev does that copy; the gateway's in-memory namespace does too, and from
/// memory that a random read finds cold, unlike the null responder's buffer). The three run
/// in turn over `rounds`, the order rotating each round. Prints each one's IOPS, the
/// gateway's CPU per I/O, and its ratio to each polling target (median, min-max).
fn qd1_against_polling(
    gateway: &Child,
    gw_addr: SocketAddr,
    metrics: SocketAddr,
    cntlid: u16,
    duration: Duration,
    rounds: usize,
    share_cpu: bool,
) {
    // Host and targets on CPUs of their own, as SPDK's perf and nvmf_tgt are run (each with
    // its core mask), and as they are in use (the host is another machine). Unpinned, the
    // scheduler put the host's thread on the polling target's CPU in some runs and not in
    // others, and the same target's IOPS moved by up to 1.7x between runs.
    let pinned = Pinning::apply(gateway.id(), share_cpu);
    let null_addr = common::spawn_polling_null_responder();
    let ram_addr =
        common::spawn_polling_ram_responder(NS_BYTES as usize, u64::from(REGION.block_size));
    pinned.host_thread();
    let w = &WORKLOADS[0];
    assert_eq!(
        (w.queue_depth, w.write),
        (1, false),
        "the QD1 read workload"
    );
    println!(
        "QD1 against polling targets (each spins a CPU at 100% on a non-blocking socket): \
         the null responder (static buffer) and a RAM target (copies each read from a 1 GiB \
         RAM disk, as a malloc bdev does), {rounds} rounds, {}",
        pinned.describe()
    );
    let (mut null, mut ram, mut gw) = (Vec::new(), Vec::new(), Vec::new());
    let run_polling = |addr: SocketAddr| {
        let mut q = queue(addr, 1, 1);
        q.run(w, &REGION, duration)
            .expect("polling responder run")
            .iops()
    };
    // One gateway queue for every round: a new queue's first two epochs measure both
    // modes (one of 128 reads sleeping), which short rounds would count again each time.
    // The responders' connections cannot stay open between their rounds: an idle one
    // spins on the targets' CPU.
    let mut gw_queue = queue_of(gw_addr, SUBNQN, cntlid, next_qid());
    let counters_before = Polling::counters(metrics);
    for round in 0..rounds {
        // The order rotates, so none always runs right after another.
        for turn in 0..3 {
            match (round + turn) % 3 {
                0 => null.push(run_polling(null_addr)),
                1 => ram.push(run_polling(ram_addr)),
                _ => gw.push(measure_on(gateway, &mut gw_queue, w, &REGION, duration)),
            }
        }
    }
    drop(gw_queue);
    let ios: f64 = gw.iter().map(|r| r.ios as f64).sum();
    let polled = counters_before
        .zip(Polling::counters(metrics))
        .map(|(before, after)| Polling::between(before, after, ios as u64));
    let ratio_to = |target: &[f64]| {
        let ratios: Vec<f64> = gw.iter().zip(target).map(|(g, t)| g.iops / t).collect();
        let (lo, hi) = min_max(&ratios);
        format!("{:.3} [{lo:.3}-{hi:.3}]", median(ratios))
    };
    println!(
        "{:<16} {:>9} {:>9} {:>9} {:>8} {:>21} {:>21} {:>9} {:>10}",
        "workload",
        "null IOPS",
        "RAM IOPS",
        "gw IOPS",
        "gw us/IO",
        "gw/null [min-max]",
        "gw/RAM [min-max]",
        "polled/IO",
        "chose poll"
    );
    let (polled_per_io, chose_poll) = match polled {
        Some(p) if p.chose_poll.is_nan() => (format!("{:.2}", p.polled_per_io), "-".into()),
        Some(p) => (
            format!("{:.2}", p.polled_per_io),
            format!("{:.0}%", p.chose_poll * 100.0),
        ),
        None => ("?".into(), "?".into()),
    };
    println!(
        "{:<16} {:>9.0} {:>9.0} {:>9.0} {:>8.2} {:>21} {:>21} {:>9} {:>10}",
        w.name,
        median(null.clone()),
        median(ram.clone()),
        median(gw.iter().map(|r| r.iops).collect()),
        median(gw.iter().map(|r| r.cpu_us_per_io).collect()),
        ratio_to(&null),
        ratio_to(&ram),
        polled_per_io,
        chose_poll
    );
    println!(
        "(polled/IO: commands read while a polling window was open, i.e. without a wake-up; \
         chose poll: share of the adaptive epochs that chose polling)"
    );
    pinned.undo(gateway.id());
}

/// Where the QD1 comparison runs: the bench's thread (the host) on one CPU, the targets (the
/// gateway's threads, the responders' threads) on another, set with util-linux's `taskset`.
/// Without it, or with one CPU, nothing is pinned and the header says so.
struct Pinning {
    cpus: Option<(usize, usize)>,
    all: usize,
}

impl Pinning {
    /// Pins the gateway's threads and, until [`Pinning::host_thread`], the bench's own
    /// thread to the targets' CPU, so the responder threads it spawns start there.
    /// `share_cpu`: the host goes on the targets' CPU too (a host and its gateway on one
    /// busy machine, where a poller that never gives up its CPU starves the host).
    fn apply(gateway: u32, share_cpu: bool) -> Pinning {
        let all = std::thread::available_parallelism().map_or(1, |n| n.get());
        let target = 1;
        let host = if share_cpu { target } else { 0 };
        let ok = all >= 2
            && taskset(&["-a", "-p", "-c", &target.to_string(), &gateway.to_string()])
            && taskset(&[
                "-p",
                "-c",
                &target.to_string(),
                &std::process::id().to_string(),
            ]);
        Pinning {
            cpus: ok.then_some((host, target)),
            all,
        }
    }

    /// Moves the bench's thread (the host side) to its own CPU.
    fn host_thread(&self) {
        if let Some((host, _)) = self.cpus {
            taskset(&[
                "-p",
                "-c",
                &host.to_string(),
                &std::process::id().to_string(),
            ]);
        }
    }

    fn describe(&self) -> String {
        match self.cpus {
            Some((host, target)) if host == target => {
                format!("host and targets all on CPU {target}")
            }
            Some((host, target)) => format!("host on CPU {host}, targets on CPU {target}"),
            None => "not pinned (one CPU, or taskset failed)".into(),
        }
    }

    /// Lets the bench's thread and the gateway run on every CPU again.
    fn undo(&self, gateway: u32) {
        if self.cpus.is_some() {
            let every = format!("0-{}", self.all - 1);
            taskset(&["-p", "-c", &every, &std::process::id().to_string()]);
            taskset(&["-a", "-p", "-c", &every, &gateway.to_string()]);
        }
    }
}

/// Runs `taskset ARGS` quietly; whether it succeeded.
fn taskset(args: &[&str]) -> bool {
    Command::new("taskset")
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// The gateway's CPU while a host is connected and sends nothing: the admin queue and an
/// I/O queue open, after a burst of QD1 reads on that queue (so a busy-poll window followed
/// its last command, as it would after a host's last I/O). Printed as % of one CPU.
fn idle_cpu(gateway: &Child, gw_addr: SocketAddr, cntlid: u16, duration: Duration) {
    let mut q = queue(gw_addr, cntlid, next_qid());
    q.run(&WORKLOADS[0], &REGION, Duration::from_millis(200))
        .expect("QD1 burst");
    // Let the last window and the tasks the burst woke settle before counting.
    std::thread::sleep(Duration::from_millis(100));
    let before = cpu_seconds(gateway.id());
    let begin = std::time::Instant::now();
    std::thread::sleep(duration);
    let cpu = cpu_seconds(gateway.id()) - before;
    let seconds = begin.elapsed().as_secs_f64();
    println!(
        "gateway idle (admin and I/O queue connected, no I/O): {:.3}% of a CPU ({:.2} ms over {:.1} s)",
        cpu / seconds * 100.0,
        cpu * 1e3,
        seconds
    );
    drop(q);
}

/// A queue ID other than the last run's: that one's teardown may not be done yet.
fn next_qid() -> u16 {
    static RUNS: AtomicU16 = AtomicU16::new(0);
    1 + RUNS.fetch_add(1, Ordering::Relaxed) % 4
}

/// One measured run: IOPS and the gateway's CPU microseconds per I/O.
struct Run {
    iops: f64,
    cpu_us_per_io: f64,
    ios: u64,
}

fn measure(
    gateway: &Child,
    addr: SocketAddr,
    subnqn: &str,
    cntlid: u16,
    w: &Workload,
    region: &Region,
    duration: Duration,
) -> Run {
    let mut q = queue_of(addr, subnqn, cntlid, next_qid());
    measure_on(gateway, &mut q, w, region, duration)
}

/// `w` on `queues` I/O queues at once (IDs 1 to `queues`), a host thread each, as a host
/// whose several threads each keep one command in flight: their IOPS summed, the gateway's
/// CPU per I/O over all of them.
fn measure_queues(
    gateway: &Child,
    addr: SocketAddr,
    cntlid: u16,
    w: &Workload,
    duration: Duration,
    queues: u16,
) -> Run {
    let mut connected: Vec<LeanQueue> = (1..=queues)
        .map(|qid| queue_of(addr, SUBNQN, cntlid, qid))
        .collect();
    with_cpu(gateway, || {
        std::thread::scope(|s| {
            let runs: Vec<_> = connected
                .iter_mut()
                .map(|q| s.spawn(move || q.run(w, &REGION, duration).expect("gateway run")))
                .collect();
            runs.into_iter()
                .map(|r| r.join().expect("host thread"))
                .fold((0, 0.0), |(ios, iops), f| (ios + f.ios, iops + f.iops()))
        })
    })
}

/// [`measure`] on a queue already connected.
fn measure_on(
    gateway: &Child,
    q: &mut LeanQueue,
    w: &Workload,
    region: &Region,
    duration: Duration,
) -> Run {
    with_cpu(gateway, || {
        let figures = q.run(w, region, duration).expect("gateway run");
        (figures.ios, figures.iops())
    })
}

/// A run (`run` returns its I/Os and IOPS) with the gateway's CPU per I/O over it.
fn with_cpu(gateway: &Child, run: impl FnOnce() -> (u64, f64)) -> Run {
    let cpu_before = cpu_seconds(gateway.id());
    let (ios, iops) = run();
    let cpu = cpu_seconds(gateway.id()) - cpu_before;
    Run {
        iops,
        cpu_us_per_io: cpu / ios.max(1) as f64 * 1e6,
        ios,
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn min_max(v: &[f64]) -> (f64, f64) {
    v.iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &x| {
            (lo.min(x), hi.max(x))
        })
}

/// Two variants (`a`, the baseline, and `b`) of `w`, alternating over `rounds` (`b` first in
/// odd rounds, so neither always runs right after the other). Prints each one's median IOPS
/// and CPU per I/O, and the median, min and max of the per-round ratios b/a (IOPS; CPU per
/// I/O). Returns the median IOPS of `a`.
#[allow(clippy::too_many_arguments)]
fn compare(
    gateway: &Child,
    addr: SocketAddr,
    cntlid: (u16, u16),
    subnqn: (&str, &str),
    region: (&Region, &Region),
    w: &Workload,
    duration: Duration,
    rounds: usize,
) -> f64 {
    compare_runs(
        w.name,
        rounds,
        || measure(gateway, addr, subnqn.0, cntlid.0, w, region.0, duration),
        || measure(gateway, addr, subnqn.1, cntlid.1, w, region.1, duration),
    )
}

/// [`compare`] for any two runs.
fn compare_runs(
    name: &str,
    rounds: usize,
    mut run_a: impl FnMut() -> Run,
    mut run_b: impl FnMut() -> Run,
) -> f64 {
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        if round % 2 == 0 {
            a.push(run_a());
            b.push(run_b());
        } else {
            b.push(run_b());
            a.push(run_a());
        }
    }
    let iops_ratios: Vec<f64> = a.iter().zip(&b).map(|(a, b)| b.iops / a.iops).collect();
    let cpu_ratios: Vec<f64> = a
        .iter()
        .zip(&b)
        .map(|(a, b)| b.cpu_us_per_io / a.cpu_us_per_io)
        .collect();
    let med = |runs: &[Run], f: fn(&Run) -> f64| median(runs.iter().map(f).collect());
    let (a_iops, b_iops) = (med(&a, |r| r.iops), med(&b, |r| r.iops));
    let (lo, hi) = min_max(&iops_ratios);
    let (cpu_lo, cpu_hi) = min_max(&cpu_ratios);
    println!(
        "{:<18} {:>10.0} {:>8.2} {:>10.0} {:>8.2} {:>6.3} [{:.3}-{:.3}] {:>6.3} [{:.3}-{:.3}]",
        name,
        a_iops,
        med(&a, |r| r.cpu_us_per_io),
        b_iops,
        med(&b, |r| r.cpu_us_per_io),
        median(iops_ratios.clone()),
        lo,
        hi,
        median(cpu_ratios.clone()),
        cpu_lo,
        cpu_hi,
    );
    a_iops
}

/// Identify (`cns`, NSIDs 1 to `VIS_NAMESPACES` in turn for CNS 00h) one at a time on an
/// admin queue for `duration`: commands per second and the gateway's CPU per command.
fn identify_run(
    gateway: &Child,
    rt: &tokio::runtime::Runtime,
    admin: &HostConnection,
    cns: u8,
    duration: Duration,
) -> Run {
    let cpu_before = cpu_seconds(gateway.id());
    let begin = std::time::Instant::now();
    let n = rt.block_on(async {
        let mut n: u64 = 0;
        while begin.elapsed() < duration {
            let nsid = if cns == 0 {
                (n % u64::from(VIS_NAMESPACES)) as u32 + 1
            } else {
                0
            };
            let page = admin.identify(cns, nsid, 0).await.expect("identify");
            // Every namespace is visible: a full active list, a non-zeroed NSZE.
            assert_ne!(page[..4], [0, 0, 0, 0], "CNS {cns:#x}, NSID {nsid}");
            n += 1;
        }
        n
    });
    let seconds = begin.elapsed().as_secs_f64();
    let cpu = cpu_seconds(gateway.id()) - cpu_before;
    Run {
        iops: n as f64 / seconds,
        cpu_us_per_io: cpu / n.max(1) as f64 * 1e6,
        ios: n,
    }
}

fn compare_header(a: &str, b: &str) {
    println!(
        "{:<18} {:>10} {:>8} {:>10} {:>8} {:>21} {:>21}",
        "workload",
        format!("{a} IOPS"),
        "us/IO",
        format!("{b} IOPS"),
        "us/IO",
        "IOPS ratio [min-max]",
        "CPU/IO ratio [min-max]"
    );
}

const QD32_READ: Workload = Workload {
    name: "4K randread QD32",
    write: false,
    random: true,
    io_bytes: 4096,
    queue_depth: 32,
};

/// Namespaces of the QoS run: their NSIDs and limits (config keys).
const QOS_BYTES: u64 = 128 << 20;
const QOS_UNLIMITED: u32 = 1;
const QOS_FAR_ABOVE: u32 = 2;
/// NSID, `rw_ios_per_second`.
const QOS_IOPS_LIMITS: [(u32, u64); 3] = [(3, 1_000), (4, 10_000), (5, 100_000)];
/// NSID, `rw_megabytes_per_second` (MB = 2^20 bytes).
const QOS_MB_LIMIT: (u32, u64) = (6, 200);

fn qos_subsystem() -> String {
    let ns = |nsid: u32, limits: &str| {
        format!(
            "\n[[subsystem.namespace]]\nnsid = {nsid}\nbackend = \"memory\"\nsize = \"{}MiB\"\n{limits}",
            QOS_BYTES >> 20
        )
    };
    let mut text = format!("\n[[subsystem]]\nnqn = \"{SUBNQN}\"\nallow_any_host = true\n");
    text += &ns(QOS_UNLIMITED, "");
    // Every limit at its maximum (control_plane::qos): all four buckets are drawn from.
    text += &ns(
        QOS_FAR_ABOVE,
        "rw_ios_per_second = 100000000\nrw_megabytes_per_second = 1048576\n\
         r_megabytes_per_second = 1048576\nw_megabytes_per_second = 1048576\n",
    );
    for (nsid, iops) in QOS_IOPS_LIMITS {
        text += &ns(nsid, &format!("rw_ios_per_second = {iops}\n"));
    }
    let (nsid, mb) = QOS_MB_LIMIT;
    text += &ns(nsid, &format!("rw_megabytes_per_second = {mb}\n"));
    text
}

fn qos_region(nsid: u32) -> Region {
    Region {
        nsid,
        block_size: 512,
        bytes: QOS_BYTES,
    }
}

fn qos_bench(binary: &str, gateway_lines: &str, duration: Duration, rounds: usize) {
    let port = free_port();
    let mut gateway = start_gateway(port, binary, gateway_lines, &qos_subsystem());
    let addr: SocketAddr = ([127, 0, 0, 1], port).into();
    let (_rt, _admin, cntlid) = admin_connect(addr, SUBNQN);
    let nsids = [QOS_UNLIMITED, QOS_FAR_ABOVE]
        .into_iter()
        .chain(QOS_IOPS_LIMITS.iter().map(|l| l.0))
        .chain([QOS_MB_LIMIT.0]);
    for nsid in nsids {
        prefill(addr, SUBNQN, cntlid, &qos_region(nsid));
    }

    println!(
        "QoS, NVMe/TCP loopback, {} MiB in-memory namespaces, gateway on 1 worker thread, \
         {:.1} s per run, {rounds} rounds",
        QOS_BYTES >> 20,
        duration.as_secs_f64()
    );
    println!(
        "no limit (a) against every limit far above the rate (b: the check runs, never waits)"
    );
    compare_header("a", "b");
    let (a, b) = (qos_region(QOS_UNLIMITED), qos_region(QOS_FAR_ABOVE));
    let unthrottled_iops = compare(
        &gateway,
        addr,
        (cntlid, cntlid),
        (SUBNQN, SUBNQN),
        (&a, &b),
        &QD32_READ,
        duration,
        rounds,
    );
    let write = Workload {
        name: "4K randwrite QD32",
        write: true,
        ..QD32_READ
    };
    compare(
        &gateway,
        addr,
        (cntlid, cntlid),
        (SUBNQN, SUBNQN),
        (&a, &b),
        &write,
        duration,
        rounds,
    );

    println!("accuracy: achieved / limit (one run each; unthrottled: the no-limit namespace)");
    println!(
        "{:<18} {:>14} {:>12} {:>8} {:>14} {:>9}",
        "workload", "limit", "achieved", "us/IO", "unthrottled", "ratio"
    );
    let limited = |nsid: u32, w: &Workload, limit: f64, unit: &str, scale: f64, free: f64| {
        let run = measure(
            &gateway,
            addr,
            SUBNQN,
            cntlid,
            w,
            &qos_region(nsid),
            duration,
        );
        let achieved = run.iops * scale;
        let ratio = if free * scale < limit {
            "n/a: unthrottled is below the limit".to_string()
        } else {
            format!("{:.4}", achieved / limit)
        };
        println!(
            "{:<18} {:>9} {unit} {:>12.1} {:>8.2} {:>14.1} {:>9}",
            w.name,
            limit,
            achieved,
            run.cpu_us_per_io,
            free * scale,
            ratio
        );
    };
    for (nsid, iops) in QOS_IOPS_LIMITS {
        limited(nsid, &QD32_READ, iops as f64, "IOPS", 1.0, unthrottled_iops);
    }
    let seq = Workload {
        name: "128K seqread QD8",
        write: false,
        random: false,
        io_bytes: 128 << 10,
        queue_depth: 8,
    };
    let free = measure(
        &gateway,
        addr,
        SUBNQN,
        cntlid,
        &seq,
        &qos_region(QOS_UNLIMITED),
        duration,
    );
    let (nsid, mb) = QOS_MB_LIMIT;
    let mb_per_io = f64::from(seq.io_bytes) / f64::from(1 << 20);
    limited(nsid, &seq, mb as f64, "MB/s", mb_per_io, free.iops);
    let _ = gateway.kill();
    let _ = gateway.wait();
}

/// Namespaces per subsystem and hosts per restricted namespace in the visibility run.
const VIS_NAMESPACES: u32 = 1000;
const VIS_HOSTS: usize = 64;
const VIS_BYTES: u64 = 16 << 20;
const VIS_NSID: u32 = 500;
const SUBNQN_ALL: &str = "nqn.2016-06.io.ceph-nvmeof-rs:bench-all";
const SUBNQN_ONLY: &str = "nqn.2016-06.io.ceph-nvmeof-rs:bench-only";

/// The `i`th other host (1..64): UUID NQNs spread so that, sorted, 47 come before the
/// bench's host and 16 after it (as in `visibility_core`), not all on one side.
fn other_host(i: usize) -> String {
    format!(
        "nqn.2014-08.org.nvmexpress:uuid:{:08x}-0000-4000-8000-000000000000",
        i * 0x0400_0000
    )
}

/// Two subsystems of `VIS_NAMESPACES` namespaces: every one of the first visible to all
/// hosts, every one of the second to `VIS_HOSTS` hosts, the bench's host among them.
fn visibility_subsystems() -> String {
    let mut hosts: Vec<String> = (1..VIS_HOSTS)
        .map(|i| format!("\"{}\"", other_host(i)))
        .collect();
    hosts.push(format!("\"{HOSTNQN}\""));
    let hosts = hosts.join(", ");
    let mut text = String::new();
    for (nqn, restricted) in [(SUBNQN_ALL, false), (SUBNQN_ONLY, true)] {
        text += &format!("\n[[subsystem]]\nnqn = \"{nqn}\"\nallow_any_host = true\n");
        for nsid in 1..=VIS_NAMESPACES {
            text += &format!(
                "\n[[subsystem.namespace]]\nnsid = {nsid}\nbackend = \"memory\"\nsize = \"{}MiB\"\n",
                VIS_BYTES >> 20
            );
            if restricted {
                text += &format!("auto_visible = false\nhosts = [{hosts}]\n");
            }
        }
    }
    text
}

fn visibility_bench(binary: &str, gateway_lines: &str, duration: Duration, rounds: usize) {
    let port = free_port();
    let mut gateway = start_gateway(port, binary, gateway_lines, &visibility_subsystems());
    let addr: SocketAddr = ([127, 0, 0, 1], port).into();
    let (rt_all, admin_all, cntlid_all) = admin_connect(addr, SUBNQN_ALL);
    let (rt_only, admin_only, cntlid_only) = admin_connect(addr, SUBNQN_ONLY);
    let region = Region {
        nsid: VIS_NSID,
        block_size: 512,
        bytes: VIS_BYTES,
    };
    prefill(addr, SUBNQN_ALL, cntlid_all, &region);
    prefill(addr, SUBNQN_ONLY, cntlid_only, &region);

    println!(
        "Per-host visibility, NVMe/TCP loopback, 2 subsystems x {VIS_NAMESPACES} in-memory \
         namespaces, gateway on 1 worker thread, {:.1} s per run, {rounds} rounds",
        duration.as_secs_f64()
    );
    println!(
        "every namespace auto-visible (a) against every one visible to {VIS_HOSTS} hosts, this \
         one among them (b); Identify at QD1 on the admin queue, reads of NSID {VIS_NSID}"
    );
    compare_header("a", "b");
    for (name, cns) in [("Identify CNS 02h", 0x02), ("Identify CNS 00h", 0x00)] {
        compare_runs(
            name,
            rounds,
            || identify_run(&gateway, &rt_all, &admin_all, cns, duration),
            || identify_run(&gateway, &rt_only, &admin_only, cns, duration),
        );
    }
    let qd1 = Workload {
        name: "4K randread QD1",
        queue_depth: 1,
        ..QD32_READ
    };
    for w in [&qd1, &QD32_READ] {
        compare(
            &gateway,
            addr,
            (cntlid_all, cntlid_only),
            (SUBNQN_ALL, SUBNQN_ONLY),
            (&region, &region),
            w,
            duration,
            rounds,
        );
    }
    let _ = gateway.kill();
    let _ = gateway.wait();
}

// ---- --tls: secure channels -------------------------------------------------------------

/// The bench host's PSK (SHA-256: TLS_AES_128_GCM_SHA256, the suite NVMe/TCP makes
/// mandatory). The `openssl` crate's client PSK callback is TLS 1.2's, which under TLS 1.3
/// makes every PSK a SHA-256 one, so this client cannot measure TLS_AES_256_GCM_SHA384.
fn tls_bench_psk() -> nvmeof_gateway::auth::tls_psk::ConfiguredPsk {
    use nvmeof_gateway::auth::tls_psk::{ConfiguredPsk, PskHash};
    ConfiguredPsk::from_bytes(&[0x5b; 32], Some(PskHash::Sha256)).expect("32 bytes")
}

/// The gateway of a `--tls` run: [`start_gateway`]'s, plus a metrics endpoint (which says
/// whether connections got kernel TLS), a secure listener on `secure`, and for SUBNQN the
/// bench host with its PSK (TLS optional, so the plain listener serves the same namespace).
fn start_tls_gateway(port: u16, secure: u16, metrics: u16, binary: &str) -> Child {
    let subsystems = format!(
        r#"
[[listener]]
transport = "tcp"
address = "127.0.0.1"
port = {secure}
secure = true

[[subsystem]]
nqn = "{SUBNQN}"
hosts = [ {{ nqn = "{HOSTNQN}", psk = "{psk}" }} ]

[[subsystem.namespace]]
nsid = 1
backend = "memory"
size = "1GiB"
"#,
        psk = tls_bench_psk().to_interchange().as_str(),
    );
    let mut child = start_gateway_with_metrics(port, Some(metrics), binary, "", &subsystems);
    // The plain listener answers first; the secure one and the metrics come up beside it.
    for _ in 0..400 {
        if TcpStream::connect(("127.0.0.1", secure)).is_ok()
            && TcpStream::connect(("127.0.0.1", metrics)).is_ok()
        {
            return child;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
    panic!("gateway did not start listening on port {secure}");
}

/// How the host side reaches the gateway in a `--tls` run.
#[derive(Clone, Copy)]
enum Relay {
    /// Bytes copied as they are (what the TLS client costs the host, without TLS).
    Plain,
    /// TLS 1.3 with the PSK.
    Tls,
}

/// A local port whose connections are relayed to `upstream` (TLS or not) on a runtime of
/// its own (one thread, so the host side's cost stays on one core like the gateway's).
fn host_relay(upstream: SocketAddr, mode: Relay) -> SocketAddr {
    use nvmeof_gateway::auth::tls_psk::LabelEncoding;
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind relay");
    let addr = listener.local_addr().expect("relay address");
    let retained = tls_bench_psk().retained(HOSTNQN, LabelEncoding::Rfc8446);
    let identity = retained.identity(0, HOSTNQN, SUBNQN);
    let key = retained
        .tls_psk(&identity, LabelEncoding::Rfc8446)
        .expect("TLS PSK")
        .key()
        .to_vec();
    let identity = identity.to_string();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("relay runtime");
        rt.block_on(async move {
            listener.set_nonblocking(true).expect("nonblocking");
            let listener = tokio::net::TcpListener::from_std(listener).expect("relay listener");
            while let Ok((mut host, _)) = listener.accept().await {
                let _ = host.set_nodelay(true);
                let (identity, key) = (identity.clone(), key.clone());
                tokio::spawn(async move {
                    let Ok(up) = tokio::net::TcpStream::connect(upstream).await else {
                        return;
                    };
                    let _ = up.set_nodelay(true);
                    match mode {
                        Relay::Plain => {
                            let mut up = up;
                            let _ = tokio::io::copy_bidirectional(&mut host, &mut up).await;
                        }
                        Relay::Tls => {
                            let Ok(mut tls) = tls_client(up, identity, key).await else {
                                eprintln!("TLS handshake with the gateway failed");
                                return;
                            };
                            let _ = tokio::io::copy_bidirectional(&mut host, &mut tls).await;
                        }
                    }
                });
            }
        });
    });
    addr
}

async fn tls_client(
    tcp: tokio::net::TcpStream,
    identity: String,
    key: Vec<u8>,
) -> Result<tokio_openssl::SslStream<tokio::net::TcpStream>, String> {
    use openssl::ssl::{Ssl, SslContext, SslMethod, SslVersion};
    let e = |e: openssl::error::ErrorStack| e.to_string();
    let mut ctx = SslContext::builder(SslMethod::tls_client()).map_err(e)?;
    ctx.set_min_proto_version(Some(SslVersion::TLS1_3))
        .map_err(e)?;
    ctx.set_ciphersuites("TLS_AES_128_GCM_SHA256").map_err(e)?;
    ctx.set_psk_client_callback(move |_, _, id_out, key_out| {
        let id = identity.as_bytes();
        id_out[..id.len()].copy_from_slice(id);
        id_out[id.len()] = 0;
        key_out[..key.len()].copy_from_slice(&key);
        Ok(key.len())
    });
    let ssl = Ssl::new(&ctx.build()).map_err(e)?;
    let mut tls = tokio_openssl::SslStream::new(ssl, tcp).map_err(e)?;
    std::pin::Pin::new(&mut tls)
        .connect()
        .await
        .map_err(|e| e.to_string())?;
    Ok(tls)
}

/// A counter of the gateway's metrics endpoint (0 when absent).
fn gateway_metric(metrics: u16, series: &str) -> f64 {
    use std::io::{Read, Write};
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", metrics)) else {
        return 0.0;
    };
    let _ = s.write_all(b"GET /metrics HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n");
    let mut text = String::new();
    let _ = s.read_to_string(&mut text);
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0.0)
}

fn tls_bench(binary: &str, duration: Duration, rounds: usize) {
    let (port, secure, metrics) = (free_port(), free_port(), free_port());
    let mut gateway = start_tls_gateway(port, secure, metrics, binary);
    let gw_addr: SocketAddr = ([127, 0, 0, 1], port).into();
    let (_rt, _admin, cntlid) = admin_connect(gw_addr, SUBNQN);
    prefill(gw_addr, SUBNQN, cntlid, &REGION);
    let plain_relay = host_relay(gw_addr, Relay::Plain);
    let tls_relay = host_relay(([127, 0, 0, 1], secure).into(), Relay::Tls);

    // One TLS queue first, to learn which path the gateway takes.
    drop(queue(tls_relay, cntlid, 1));
    let path = if gateway_metric(metrics, "nvmeof_tls_ktls_connections_total") > 0.0 {
        "kernel TLS"
    } else {
        "the gateway's user-space TLS relay (no kernel TLS here)"
    };
    println!(
        "NVMe/TCP loopback, in-memory namespace, gateway on 1 worker thread, {:.1} s per run, {rounds} rounds",
        duration.as_secs_f64()
    );
    println!("TLS_AES_128_GCM_SHA256 served by {path}; medians, ratios to plain [min-max]");
    println!(
        "{:<18} {:>10} {:>8} {:>10} {:>8} {:>21} {:>21} {:>10} {:>8} {:>21} {:>21}",
        "workload",
        "plain IOPS",
        "us/IO",
        "copy IOPS",
        "us/IO",
        "IOPS ratio",
        "CPU/IO ratio",
        "TLS IOPS",
        "us/IO",
        "IOPS ratio",
        "CPU/IO ratio"
    );
    for w in WORKLOADS.iter().take(2) {
        let run = |addr| measure(&gateway, addr, SUBNQN, cntlid, w, &REGION, duration);
        let (mut plain, mut relayed, mut tls) = (Vec::new(), Vec::new(), Vec::new());
        for round in 0..rounds {
            // Rotate the order so that no variant always runs right after another.
            for k in 0..3 {
                match (round + k) % 3 {
                    0 => plain.push(run(gw_addr)),
                    1 => relayed.push(run(plain_relay)),
                    _ => tls.push(run(tls_relay)),
                }
            }
        }
        let ratio = |b: &[Run], f: fn(&Run) -> f64| -> String {
            let r: Vec<f64> = plain.iter().zip(b).map(|(a, b)| f(b) / f(a)).collect();
            let (lo, hi) = min_max(&r);
            format!("{:.3} [{lo:.3}-{hi:.3}]", median(r.clone()))
        };
        let med = |runs: &[Run], f: fn(&Run) -> f64| median(runs.iter().map(f).collect());
        println!(
            "{:<18} {:>10.0} {:>8.2} {:>10.0} {:>8.2} {:>21} {:>21} {:>10.0} {:>8.2} {:>21} {:>21}",
            w.name,
            med(&plain, |r| r.iops),
            med(&plain, |r| r.cpu_us_per_io),
            med(&relayed, |r| r.iops),
            med(&relayed, |r| r.cpu_us_per_io),
            ratio(&relayed, |r| r.iops),
            ratio(&relayed, |r| r.cpu_us_per_io),
            med(&tls, |r| r.iops),
            med(&tls, |r| r.cpu_us_per_io),
            ratio(&tls, |r| r.iops),
            ratio(&tls, |r| r.cpu_us_per_io),
        );
    }
    println!(
        "gateway: {} kernel-TLS connections, {} relayed",
        gateway_metric(metrics, "nvmeof_tls_ktls_connections_total"),
        gateway_metric(metrics, "nvmeof_tls_relay_connections_total"),
    );
    let _ = gateway.kill();
    let _ = gateway.wait();
}
