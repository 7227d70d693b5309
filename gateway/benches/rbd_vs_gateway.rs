//! RBD through the gateway vs direct librbd, side by side on the same cluster and image.
//!
//! Direct: fio's rbd engine (librbd in the fio process). Gateway: `nvmeof-gateway` serving the
//! image as an RBD namespace, driven over NVMe/TCP on 127.0.0.1 by the pipelined Rust host
//! ([`LeanQueue`], one I/O queue). Both at the same queue depths, 4K random read and write at
//! QD1 and QD16, alternating direct and gateway runs (`--repeat`, default 3) so that drift on
//! a shared machine hits both. Prints the medians of IOPS, p50/p99 latency (submission to
//! completion) and CPU per I/O of the process running librbd (fio, or the gateway), the IOPS
//! ratio gateway/direct and the latency the gateway adds (mean and p50).
//!
//!     cargo bench -p nvmeof-gateway --bench rbd_vs_gateway [-- --seconds 5 --repeat 3 --size-mib 256]
//!
//! The cluster: the one named by `$CEPH_CONF` (client.admin, keyring from the conf or
//! `$CEPH_KEYRING`) when set; otherwise a throwaway micro Ceph (`scripts/micro-ceph.sh`,
//! memstore, or `--store bluestore`) that is stopped at the end. The image (`rbd/bench-<pid>`)
//! is created, written once in full (so reads hit allocated objects, as on a used image) and
//! removed at the end. Both sides run librbd with the same options: the gateway's defaults
//! (`rbd_backend::rbd::GATEWAY_DEFAULT_ARGS`: no cache, inline dispatch, no Objecter
//! throttle), for fio through a derived ceph.conf, so the ratio is what the gateway adds
//! (`--fio-librbd-defaults`: fio on librbd's stock settings, cache still off).
//!
//! `--scaling` adds a second section on its own images (`--images 1,2,4,8,16,32`, each
//! `--scaling-size-mib 32`, written once): the gateway's memory (RSS) and threads idle
//! without a cluster connection, with one image, and with the largest count of images on one
//! cluster connection and on one connection per image, from which it prints the memory and
//! threads per open image and per idle cluster connection; then for every count N, 4K random
//! reads at `--scaling-qd 4` per image on all N images at once, direct (fio, one job per
//! image) and through the gateway (N namespaces, N host threads with one queue each).
//!
//! Other options: `--gateway-threads N` (default: one runtime worker per CPU),
//! `--gateway [LABEL=]PATH[@THREADS][,poll=US|,alwayspoll=US][,sqflow=off]` (repeatable:
//! compare gateway binaries, thread counts or busy polling, `[gateway] tcp_busy_poll_us`
//! (`poll=0`: off; without `poll=`, the gateway's default, adaptive polling),
//! adaptive or with `tcp_busy_poll_adaptive = false`; `sqflow=off`: the host connects with
//! SQ flow control disabled, as `nvme connect-all` does, so reads complete without a
//! CapsuleResp)
//! in one run; each round runs direct and every gateway, in an order that rotates by one per
//! round; `built` as PATH is the binary cargo built),
//! `--fio-busy-poll` (fio's rbd engine polls for completions, `busy_poll=1`: the direct side
//! for a gateway with `,poll=US`), `--client-option KEY=VALUE` (repeatable: a librados/librbd
//! option both sides get in their `[client]` section, e.g. `librados_thread_count=1`),
//! `--ramp SECONDS` (default 1, not measured), `--only TEXT` (the workloads whose name
//! contains TEXT ending at a word's end, e.g. `--only QD1` is not QD16). In `cargo test --benches` (no `--bench`
//! argument) it only says it was skipped: it needs Ceph and fio.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod common;

use common::Polling;
use nvmeof_gateway::host::pipelined::{LeanQueue, Region, Workload};
use nvmeof_gateway::host::{HostConnection, HostOptions};

const SUBNQN: &str = "nqn.2016-06.io.ceph-nvmeof-rs:rbd-bench";
const HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:bench-0000-0000-0000-0000000000e5";
const POOL: &str = "rbd";

const WORKLOADS: &[Workload] = &[
    Workload {
        name: "4K randread QD1",
        write: false,
        random: true,
        io_bytes: 4096,
        queue_depth: 1,
    },
    Workload {
        name: "4K randread QD16",
        write: false,
        random: true,
        io_bytes: 4096,
        queue_depth: 16,
    },
    Workload {
        name: "4K randwrite QD1",
        write: true,
        random: true,
        io_bytes: 4096,
        queue_depth: 1,
    },
    Workload {
        name: "4K randwrite QD16",
        write: true,
        random: true,
        io_bytes: 4096,
        queue_depth: 16,
    },
];

struct Args {
    seconds: f64,
    ramp: f64,
    size_mib: u64,
    store: String,
    gateway_threads: Option<usize>,
    variants: Vec<Variant>,
    only: Option<String>,
    /// Image counts of the scaling and memory section (empty: not run).
    scaling: Vec<usize>,
    scaling_qd: usize,
    scaling_size_mib: u64,
    repeat: usize,
    /// fio on librbd's stock settings (cache still off) instead of the gateway's defaults.
    fio_librbd_defaults: bool,
    /// fio's rbd engine polls for completions (`busy_poll=1`) instead of waiting: the direct
    /// side of a comparison with a busy-polling gateway.
    fio_busy_poll: bool,
    /// `--client-option KEY=VALUE`: librbd/librados options added to the `[client]` section
    /// both sides read, e.g. `librados_thread_count=1`.
    client_options: Vec<(String, String)>,
}

fn parse_args() -> Option<Args> {
    let args: Vec<String> = std::env::args().collect();
    if !args.iter().any(|a| a == "--bench") {
        return None;
    }
    let value = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    Some(Args {
        seconds: value("--seconds")
            .and_then(|s| s.parse().ok())
            .unwrap_or(5.0),
        ramp: value("--ramp").and_then(|s| s.parse().ok()).unwrap_or(1.0),
        size_mib: value("--size-mib")
            .and_then(|s| s.parse().ok())
            .unwrap_or(256),
        store: value("--store").unwrap_or_else(|| "memstore".into()),
        gateway_threads: value("--gateway-threads").and_then(|s| s.parse().ok()),
        variants: args
            .windows(2)
            .filter(|pair| pair[0] == "--gateway")
            .enumerate()
            .map(|(i, pair)| Variant::parse(&pair[1], i))
            .collect(),
        only: value("--only"),
        scaling: if args.iter().any(|a| a == "--scaling") {
            value("--images")
                .unwrap_or_else(|| "1,2,4,8,16,32".into())
                .split(',')
                .filter_map(|n| n.trim().parse().ok())
                .filter(|&n| (1..=64).contains(&n))
                .collect()
        } else {
            Vec::new()
        },
        scaling_qd: value("--scaling-qd")
            .and_then(|s| s.parse().ok())
            .unwrap_or(4)
            .max(1),
        scaling_size_mib: value("--scaling-size-mib")
            .and_then(|s| s.parse().ok())
            .unwrap_or(32),
        repeat: value("--repeat")
            .and_then(|s| s.parse().ok())
            .unwrap_or(3)
            .max(1),
        fio_librbd_defaults: args.iter().any(|a| a == "--fio-librbd-defaults"),
        fio_busy_poll: args.iter().any(|a| a == "--fio-busy-poll"),
        client_options: args
            .windows(2)
            .filter(|pair| pair[0] == "--client-option")
            .map(|pair| match pair[1].split_once('=') {
                Some((key, value)) => (key.trim().to_string(), value.trim().to_string()),
                None => panic!("--client-option {}: expected KEY=VALUE", pair[1]),
            })
            .collect(),
    })
}

/// Runs a command, panics with its output if it fails; returns stdout.
fn run(cmd: &mut Command) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The cluster under test; a micro Ceph started here is stopped when dropped.
struct Cluster {
    conf: PathBuf,
    keyring: Option<String>,
    micro_dir: Option<PathBuf>,
    description: String,
}

impl Cluster {
    fn micro_ceph_script() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/micro-ceph.sh")
    }

    fn get(work: &Path, store: &str) -> Cluster {
        if let Ok(conf) = std::env::var("CEPH_CONF") {
            if Path::new(&conf).is_file() {
                return Cluster {
                    conf: conf.clone().into(),
                    keyring: std::env::var("CEPH_KEYRING").ok(),
                    micro_dir: None,
                    description: format!("the cluster of $CEPH_CONF ({conf})"),
                };
            }
        }
        let dir = work.join("ceph");
        eprintln!("starting a micro Ceph ({store}) in {}", dir.display());
        let env = run(Command::new("bash")
            .arg(Self::micro_ceph_script())
            .args(["start", "--store", store, "--image", "", "--dir"])
            .arg(&dir)
            .stderr(Stdio::inherit()));
        let get = |key: &str| {
            env.lines()
                .find_map(|l| l.strip_prefix(&format!("export {key}=")))
                .map(str::to_owned)
        };
        Cluster {
            conf: get("CEPH_CONF")
                .expect("micro-ceph printed CEPH_CONF")
                .into(),
            keyring: get("CEPH_KEYRING"),
            micro_dir: Some(dir),
            description: format!("micro Ceph, 1 mon + 1 OSD ({store}), pool size 1"),
        }
    }
}

impl Cluster {
    /// The micro Ceph's daemons (mon, OSD), from its `pids` file; none for `$CEPH_CONF`.
    fn daemon_pids(&self) -> Vec<u32> {
        let Some(dir) = &self.micro_dir else {
            return Vec::new();
        };
        std::fs::read_to_string(dir.join("pids"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.split_whitespace().next()?.parse().ok())
            .collect()
    }
}

impl Cluster {
    /// The micro Ceph OSD's admin socket; none for `$CEPH_CONF`.
    fn osd_admin_socket(&self) -> Option<PathBuf> {
        let socket = self.micro_dir.as_ref()?.join("run/ceph-osd.0.asok");
        socket.exists().then_some(socket)
    }
}

/// Client ops the OSD has executed so far (`osd.op` of its perf counters). A 4K random read
/// or write of the bench's image, written once beforehand, is one OSD op.
fn osd_ops(admin_socket: &Path) -> Option<f64> {
    let out = Command::new("ceph")
        .arg("--admin-daemon")
        .arg(admin_socket)
        .args(["perf", "dump"])
        .stderr(Stdio::null())
        .output()
        .ok()?;
    let doc = json::parse(std::str::from_utf8(&out.stdout).ok()?).ok()?;
    doc.get("osd")?.get("op")?.num()
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if let Some(dir) = &self.micro_dir {
            let _ = Command::new("bash")
                .arg(Self::micro_ceph_script())
                .arg("stop")
                .arg(dir)
                .status();
        }
    }
}

/// The benchmark's image, removed when dropped. `conf` is the derived ceph.conf.
struct Image {
    spec: String,
    conf: PathBuf,
}

impl Image {
    fn rbd(conf: &Path) -> Command {
        let mut c = Command::new("rbd");
        c.env("CEPH_CONF", conf);
        c
    }

    /// Creates `rbd/bench-<pid><suffix>` and writes it once in full.
    fn create(conf: &Path, size_mib: u64, suffix: &str) -> Image {
        let spec = format!("{POOL}/bench-{}{suffix}", std::process::id());
        run(Self::rbd(conf).args(["create", "--size", &format!("{size_mib}M"), &spec]));
        let image = Image {
            spec,
            conf: conf.to_owned(),
        };
        let t0 = Instant::now();
        run(Self::rbd(conf).args([
            "bench",
            "--io-type",
            "write",
            "--io-pattern",
            "seq",
            "--io-size",
            "4M",
            "--io-threads",
            "4",
            "--io-total",
            &format!("{size_mib}M"),
            &image.spec,
        ]));
        eprintln!(
            "created and wrote {} ({size_mib} MiB) in {:.1} s",
            image.spec,
            t0.elapsed().as_secs_f64()
        );
        image
    }

    fn name(&self) -> &str {
        self.spec.split_once('/').map_or(&self.spec, |(_, n)| n)
    }
}

impl Drop for Image {
    fn drop(&mut self) {
        let _ = Self::rbd(&self.conf)
            .args(["rm", "--no-progress", &self.spec])
            .output();
    }
}

/// One gateway under test: which binary, how many runtime workers, and its label.
#[derive(Clone, Debug)]
struct Variant {
    label: String,
    binary: PathBuf,
    threads: Option<usize>,
    /// `[gateway] tcp_busy_poll_us`.
    busy_poll_us: Option<u32>,
    /// `[gateway] tcp_busy_poll_adaptive = false` (unset: the gateway's default, adaptive).
    always_poll: bool,
    /// The host's queues connect with SQ flow control disabled, as `nvme connect-all`
    /// does: reads then complete by their C2HData's SUCCESS flag.
    sq_flow_control_off: bool,
}

impl Variant {
    fn built(threads: Option<usize>) -> Variant {
        Variant {
            label: "gateway".into(),
            binary: env!("CARGO_BIN_EXE_nvmeof-gateway").into(),
            threads,
            busy_poll_us: None,
            always_poll: false,
            sq_flow_control_off: false,
        }
    }

    /// `[LABEL=]PATH[@THREADS][,poll=US|,alwayspoll=US][,sqflow=off]`; PATH `built` is the
    /// binary cargo built; US sets `[gateway] tcp_busy_poll_us`, `alwayspoll` also
    /// `tcp_busy_poll_adaptive = false`; `sqflow=off` connects the host's queues with SQ
    /// flow control disabled.
    fn parse(spec: &str, index: usize) -> Variant {
        let (label, rest) = match spec.split_once('=') {
            Some((l, r)) if !l.contains(',') => (l.to_string(), r),
            _ => (format!("gw{}", index + 1), spec),
        };
        let mut parts = rest.split(',');
        let target = parts.next().unwrap_or_default();
        let (path, threads) = match target.rsplit_once('@') {
            Some((p, t)) => (
                p,
                Some(
                    t.parse()
                        .unwrap_or_else(|_| panic!("--gateway {spec}: bad thread count")),
                ),
            ),
            None => (target, None),
        };
        let binary = if path == "built" {
            env!("CARGO_BIN_EXE_nvmeof-gateway").into()
        } else {
            PathBuf::from(path)
        };
        let mut variant = Variant {
            label,
            binary,
            threads,
            busy_poll_us: None,
            always_poll: false,
            sq_flow_control_off: false,
        };
        for option in parts {
            let microseconds = |us: &str| {
                us.parse()
                    .unwrap_or_else(|_| panic!("--gateway {spec}: bad poll microseconds"))
            };
            match option.split_once('=') {
                Some(("poll", us)) => variant.busy_poll_us = Some(microseconds(us)),
                Some(("alwayspoll", us)) => {
                    variant.busy_poll_us = Some(microseconds(us));
                    variant.always_poll = true;
                }
                Some(("sqflow", "off")) => variant.sq_flow_control_off = true,
                _ => panic!("--gateway {spec}: unknown option {option}"),
            }
        }
        variant
    }
}

/// The gateway process; SIGTERM (then SIGKILL) when dropped, so it closes the image.
struct Gateway {
    child: Child,
    addr: SocketAddr,
    /// `/metrics` of a busy-polling variant (all but `poll=0`), for what its queues chose.
    metrics: Option<SocketAddr>,
}

impl Gateway {
    /// A gateway serving `images` as namespaces 1..=N of one subsystem (none: one 1 MiB
    /// in-memory namespace, so the process has no cluster connection), its images spread
    /// over `connections` cluster connections (default: the gateway's).
    fn start(
        work: &Path,
        conf: &Path,
        keyring: Option<&str>,
        images: &[&str],
        connections: Option<usize>,
        variant: &Variant,
    ) -> Gateway {
        let free_port = || {
            TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .map(|a| a.port())
                .expect("a free port")
        };
        let port = free_port();
        // Every variant but one with polling off polls (adaptive polling is the default).
        let metrics: Option<SocketAddr> =
            (variant.busy_poll_us != Some(0)).then(|| ([127, 0, 0, 1], free_port()).into());
        let config = work.join(format!("gateway-{}-{port}.toml", variant.label));
        let mut text = String::new();
        text.push_str("[gateway]\n");
        if let Some(n) = variant.threads {
            text.push_str(&format!("worker_threads = {n}\n"));
        }
        if let Some(us) = variant.busy_poll_us {
            text.push_str(&format!("tcp_busy_poll_us = {us}\n"));
        }
        if variant.always_poll {
            text.push_str("tcp_busy_poll_adaptive = false\n");
        }
        if let Some(addr) = metrics {
            text.push_str(&format!("metrics_listen = \"{addr}\"\n"));
        }
        text.push('\n');
        text.push_str(&format!(
            r#"[[listener]]
transport = "tcp"
address = "127.0.0.1"
port = {port}

[[subsystem]]
nqn = "{SUBNQN}"
allow_any_host = true
"#
        ));
        if images.is_empty() {
            text.push_str(
                "\n[[subsystem.namespace]]\nnsid = 1\nbackend = \"memory\"\nsize = \"1MiB\"\n",
            );
        }
        for (i, image) in images.iter().enumerate() {
            text.push_str(&format!(
                "\n[[subsystem.namespace]]\nnsid = {}\nbackend = \"rbd\"\npool = \"{POOL}\"\nimage = \"{image}\"\n",
                i + 1
            ));
        }
        text.push_str(&format!("\n[ceph]\nconf = \"{}\"\n", conf.display()));
        if let Some(n) = connections {
            text.push_str(&format!("connections = {n}\n"));
        }
        if let Some(k) = keyring {
            text.push_str(&format!("keyring = \"{k}\"\n"));
        }
        std::fs::write(&config, text).expect("write the gateway config");
        let mut child = Command::new(&variant.binary)
            .arg("--config")
            .arg(&config)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", variant.binary.display()));
        for _ in 0..600 {
            if TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return Gateway {
                    child,
                    addr: ([127, 0, 0, 1], port).into(),
                    metrics,
                };
            }
            if let Ok(Some(status)) = child.try_wait() {
                panic!("nvmeof-gateway exited during startup: {status}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.kill();
        let _ = child.wait();
        panic!("the gateway did not listen on port {port} within 30 s");
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(self.child.id().to_string())
            .status();
        for _ in 0..150 {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// CPUs this process may run on (the cores the cluster, fio, the gateway and the host share).
fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// How this machine's CPUs idle, which decides what a thread wake-up costs: in a VM whose
/// idle vCPUs halt at once (the `haltpoll` cpuidle driver with `guest_halt_poll_ns` 0) every
/// wake-up of an idle vCPU is a VM exit, and the QD1 figures of both sides are mostly that.
fn cpu_idle_description() -> String {
    let read = |path: &str| {
        std::fs::read_to_string(path)
            .map(|s| s.trim().to_string())
            .unwrap_or_else(|_| "-".into())
    };
    let driver = read("/sys/devices/system/cpu/cpuidle/current_driver");
    let mut text = format!("CPU idle: cpuidle driver {driver}");
    if driver == "haltpoll" {
        let poll_ns = read("/sys/module/haltpoll/parameters/guest_halt_poll_ns");
        text.push_str(&format!(
            ", guest_halt_poll_ns {poll_ns} (an idle vCPU polls that long before it halts)"
        ));
    }
    text
}

/// User + system CPU seconds of a process, from /proc/PID/stat (clock ticks of 1/100 s).
fn cpu_seconds(pid: u32) -> f64 {
    cpu_seconds_of(&format!("/proc/{pid}/stat"))
}

/// CPU seconds of the calling thread (the benchmark's host).
fn this_thread_cpu_seconds() -> f64 {
    cpu_seconds_of("/proc/thread-self/stat")
}

/// CPU seconds of the cluster's daemons (none known: 0).
fn cluster_cpu_seconds(pids: &[u32]) -> f64 {
    pids.iter().map(|&p| cpu_seconds(p)).sum()
}

/// User + system CPU seconds from a /proc `stat` file.
fn cpu_seconds_of(path: &str) -> f64 {
    let stat = std::fs::read_to_string(path).unwrap_or_default();
    let after_comm = stat.rsplit_once(')').map(|(_, rest)| rest).unwrap_or("");
    let fields: Vec<&str> = after_comm.split_whitespace().collect();
    let ticks: u64 = [11, 12]
        .iter()
        .filter_map(|&i| fields.get(i)?.parse::<u64>().ok())
        .sum();
    ticks as f64 / 100.0
}

/// One side's result for one workload.
#[derive(Clone, Copy)]
struct Side {
    iops: f64,
    mean_us: f64,
    p50_us: f64,
    p99_us: f64,
    /// CPU time (user + system) of the process doing librbd (fio, or the gateway) per I/O.
    cpu_us_per_io: f64,
    /// Context switches of the process's threads per I/O (fio: incl. its start and ramp).
    switches_per_io: f64,
    /// CPU of the cluster's daemons per I/O (micro Ceph only; fio: incl. its start and ramp).
    cluster_us_per_io: f64,
    /// CPU of the benchmark's host thread per I/O (gateway runs; 0 for fio).
    host_us_per_io: f64,
    /// What a busy-polling gateway's queue did (from its counters; `None`: not polling).
    polling: Option<Polling>,
}

/// Median of `v` (0 when empty).
fn median(v: Vec<f64>) -> f64 {
    quartiles(v)[1]
}

/// First quartile, median and third quartile of `v` (linear interpolation between the
/// sorted values; all 0 when empty). The spread of the per-round ratios says how far a
/// median on this shared machine can be trusted.
fn quartiles(mut v: Vec<f64>) -> [f64; 3] {
    v.sort_by(f64::total_cmp);
    let at = |q: f64| {
        if v.is_empty() {
            return 0.0;
        }
        let pos = q * (v.len() - 1) as f64;
        let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
        v[lo] + (v[hi] - v[lo]) * (pos - lo as f64)
    };
    [at(0.25), at(0.5), at(0.75)]
}

impl Side {
    /// Field by field median of several runs.
    fn median(runs: &[Side]) -> Side {
        let med = |f: fn(&Side) -> f64| median(runs.iter().map(f).collect());
        Side {
            iops: med(|s| s.iops),
            mean_us: med(|s| s.mean_us),
            p50_us: med(|s| s.p50_us),
            p99_us: med(|s| s.p99_us),
            cpu_us_per_io: med(|s| s.cpu_us_per_io),
            switches_per_io: med(|s| s.switches_per_io),
            cluster_us_per_io: med(|s| s.cluster_us_per_io),
            host_us_per_io: med(|s| s.host_us_per_io),
            polling: {
                let polled: Vec<Polling> = runs.iter().filter_map(|s| s.polling).collect();
                // NaN (no epoch ended) stays NaN rather than becoming median's 0 of none.
                let med = |f: fn(&Polling) -> f64| {
                    let known: Vec<f64> = polled.iter().map(f).filter(|v| !v.is_nan()).collect();
                    if known.is_empty() {
                        f64::NAN
                    } else {
                        median(known)
                    }
                };
                (!polled.is_empty()).then(|| Polling {
                    polled_per_io: med(|p| p.polled_per_io),
                    chose_poll: med(|p| p.chose_poll),
                })
            },
        }
    }
}

/// A minimal JSON reader, enough for fio's `--output-format=json`.
mod json {
    use std::collections::BTreeMap;

    #[derive(Debug)]
    pub enum Value {
        Null,
        /// true or false (fio's booleans are not needed here)
        Bool,
        Num(f64),
        Str(String),
        Arr(Vec<Value>),
        Obj(BTreeMap<String, Value>),
    }

    impl Value {
        pub fn get(&self, key: &str) -> Option<&Value> {
            match self {
                Value::Obj(m) => m.get(key),
                _ => None,
            }
        }
        pub fn idx(&self, i: usize) -> Option<&Value> {
            match self {
                Value::Arr(a) => a.get(i),
                _ => None,
            }
        }
        pub fn num(&self) -> Option<f64> {
            match self {
                Value::Num(n) => Some(*n),
                _ => None,
            }
        }
    }

    pub fn parse(s: &str) -> Result<Value, String> {
        let b = s.as_bytes();
        let mut i = 0;
        let v = value(b, &mut i)?;
        Ok(v)
    }

    fn ws(b: &[u8], i: &mut usize) {
        while *i < b.len() && b[*i].is_ascii_whitespace() {
            *i += 1;
        }
    }

    fn value(b: &[u8], i: &mut usize) -> Result<Value, String> {
        ws(b, i);
        match b.get(*i) {
            Some(b'{') => {
                *i += 1;
                let mut m = BTreeMap::new();
                loop {
                    ws(b, i);
                    if b.get(*i) == Some(&b'}') {
                        *i += 1;
                        return Ok(Value::Obj(m));
                    }
                    let Value::Str(k) = value(b, i)? else {
                        return Err(format!("object key expected at {i}"));
                    };
                    ws(b, i);
                    if b.get(*i) != Some(&b':') {
                        return Err(format!("':' expected at {i}"));
                    }
                    *i += 1;
                    let v = value(b, i)?;
                    m.insert(k, v);
                    ws(b, i);
                    if b.get(*i) == Some(&b',') {
                        *i += 1;
                    }
                }
            }
            Some(b'[') => {
                *i += 1;
                let mut a = Vec::new();
                loop {
                    ws(b, i);
                    if b.get(*i) == Some(&b']') {
                        *i += 1;
                        return Ok(Value::Arr(a));
                    }
                    a.push(value(b, i)?);
                    ws(b, i);
                    if b.get(*i) == Some(&b',') {
                        *i += 1;
                    }
                }
            }
            Some(b'"') => {
                *i += 1;
                let mut out = Vec::new();
                while let Some(&c) = b.get(*i) {
                    *i += 1;
                    match c {
                        b'"' => return Ok(Value::Str(String::from_utf8_lossy(&out).into())),
                        b'\\' => {
                            let e = *b.get(*i).ok_or("unterminated escape")?;
                            *i += 1;
                            match e {
                                b'n' => out.push(b'\n'),
                                b't' => out.push(b'\t'),
                                b'u' => {
                                    *i += 4; // not needed for fio's output
                                    out.push(b'?');
                                }
                                other => out.push(other),
                            }
                        }
                        _ => out.push(c),
                    }
                }
                Err("unterminated string".into())
            }
            Some(b't') if b[*i..].starts_with(b"true") => {
                *i += 4;
                Ok(Value::Bool)
            }
            Some(b'f') if b[*i..].starts_with(b"false") => {
                *i += 5;
                Ok(Value::Bool)
            }
            Some(b'n') if b[*i..].starts_with(b"null") => {
                *i += 4;
                Ok(Value::Null)
            }
            Some(_) => {
                let start = *i;
                while *i < b.len()
                    && matches!(b[*i], b'-' | b'+' | b'.' | b'e' | b'E' | b'0'..=b'9')
                {
                    *i += 1;
                }
                std::str::from_utf8(&b[start..*i])
                    .ok()
                    .and_then(|s| s.parse().ok())
                    .map(Value::Num)
                    .ok_or_else(|| format!("bad value at {start}"))
            }
            None => Err("unexpected end".into()),
        }
    }
}

/// Direct librbd: fio's rbd engine on the same image, one job at `w.queue_depth`, polling
/// for completions when `busy_poll`.
fn direct(
    conf: &Path,
    image: &str,
    w: &Workload,
    (ramp, seconds): (f64, f64),
    out_dir: &Path,
    (cluster, osd_socket): (&[u32], Option<&Path>),
    busy_poll: bool,
) -> Side {
    let out = out_dir.join(format!("fio-{}.json", w.name.replace(' ', "-")));
    let osd_ops0 = osd_socket.and_then(osd_ops);
    let cluster_cpu0 = cluster_cpu_seconds(cluster);
    let mut child = Command::new("fio")
        .env("CEPH_CONF", conf)
        .arg("--name=direct")
        .arg("--ioengine=rbd")
        // An engine option: only after the engine.
        .arg(format!("--busy_poll={}", u8::from(busy_poll)))
        .arg("--clientname=admin")
        .arg(format!("--pool={POOL}"))
        .arg(format!("--rbdname={image}"))
        .arg(format!(
            "--rw={}",
            if w.write { "randwrite" } else { "randread" }
        ))
        .arg(format!("--bs={}", w.io_bytes))
        .arg(format!("--iodepth={}", w.queue_depth))
        .arg("--numjobs=1")
        .arg("--time_based")
        .arg(format!("--ramp_time={ramp}"))
        .arg(format!("--runtime={seconds}"))
        .arg("--lat_percentiles=1")
        .arg("--percentile_list=50:99")
        .arg("--output-format=json")
        .arg(format!("--output={}", out.display()))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .expect("start fio");
    // fio's own usr_cpu/sys_cpu count its job thread only, not librbd's threads: read the whole
    // process's CPU time from /proc once it has exited (a zombie until reaped).
    let pid = child.id();
    let mut cpu_s = 0.0;
    // Context switches per thread vanish when a thread exits: keep the last sample taken
    // while librbd's threads were alive (the last 20 ms or so are missed). Sampling reads
    // every thread's status file, on the same cores fio runs on: every 20 ms throughout, it
    // took 0.025-0.028 CPU-s/s, about 1.5% of what a saturated direct run uses.
    // So sample sparsely until the run is about to end (fio's clock starts after it has
    // opened the image, so `ramp + seconds` from the spawn is a little early), then closely.
    const SPARSE: Duration = Duration::from_millis(250);
    let started = Instant::now();
    let ends_at = Duration::from_secs_f64(ramp + seconds);
    let mut switches = 0;
    while let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        cpu_s = cpu_seconds(pid);
        if stat
            .rsplit_once(") ")
            .is_some_and(|(_, r)| r.starts_with('Z'))
        {
            break;
        }
        switches = switches.max(context_switches(pid));
        let near_end = started.elapsed() + SPARSE >= ends_at;
        std::thread::sleep(if near_end {
            Duration::from_millis(20)
        } else {
            SPARSE
        });
    }
    let status = child.wait().expect("wait for fio");
    let cluster_cpu = cluster_cpu_seconds(cluster) - cluster_cpu0;
    assert!(
        status.success(),
        "fio failed ({status}); output in {}",
        out.display()
    );
    let text = std::fs::read_to_string(&out).expect("fio's JSON output");
    // fio may print notes before the JSON document
    let doc = json::parse(&text[text.find('{').unwrap_or(0)..])
        .unwrap_or_else(|e| panic!("cannot parse {}: {e}", out.display()));
    let job = doc
        .get("jobs")
        .and_then(|j| j.idx(0))
        .expect("fio JSON: jobs[0]");
    let dir = job
        .get(if w.write { "write" } else { "read" })
        .expect("fio JSON: read/write");
    let lat = dir.get("lat_ns").expect("fio JSON: lat_ns");
    let pct = |p: &str| {
        lat.get("percentile")
            .and_then(|m| m.get(p))
            .and_then(json::Value::num)
            .unwrap_or(0.0)
            / 1000.0
    };
    let num = |v: &json::Value, k: &str| v.get(k).and_then(json::Value::num).unwrap_or(0.0);
    // The process's CPU covers its start, the ramp and its end: count the I/Os over its whole
    // life by the OSD's op counter where the bench can read it (its image open and close add
    // a few ops in tens of thousands). Otherwise count the ramp's I/Os at the measured rate,
    // which was off by -8% to +10% per run (fio's rate in the ramp is not the measured one).
    let estimated = num(dir, "iops") * (ramp + seconds);
    let ios = match (osd_ops0, osd_socket.and_then(osd_ops)) {
        (Some(before), Some(after)) if after > before => after - before,
        _ => estimated,
    };
    Side {
        iops: num(dir, "iops"),
        mean_us: num(lat, "mean") / 1000.0,
        p50_us: pct("50.000000"),
        p99_us: pct("99.000000"),
        cpu_us_per_io: cpu_s / ios.max(1.0) * 1e6,
        switches_per_io: switches as f64 / ios.max(1.0),
        cluster_us_per_io: cluster_cpu / ios.max(1.0) * 1e6,
        host_us_per_io: 0.0,
        polling: None,
    }
}

/// One gateway run: a fresh I/O queue, the ramp, then the measured run, with the gateway's,
/// the cluster's and the host thread's CPU over the measured part.
fn gateway_run(
    (gateway, variant): (&Gateway, &Variant),
    cntlid: u16,
    queue_id: u16,
    w: &Workload,
    region: &Region,
    (ramp, duration): (Duration, Duration),
    daemons: &[u32],
) -> Side {
    let mut q = LeanQueue::connect_with(
        gateway.addr,
        SUBNQN,
        HOSTNQN,
        cntlid,
        queue_id,
        variant.sq_flow_control_off,
    )
    .expect("connect an I/O queue");
    if !ramp.is_zero() {
        q.run(w, region, ramp).expect("gateway ramp");
    }
    let counters0 = gateway.metrics.and_then(Polling::counters);
    let cpu0 = cpu_seconds(gateway.child.id());
    let switches0 = context_switches(gateway.child.id());
    let (cluster0, host0) = (cluster_cpu_seconds(daemons), this_thread_cpu_seconds());
    let mut f = q.run(w, region, duration).expect("gateway run");
    let cpu = cpu_seconds(gateway.child.id()) - cpu0;
    let cluster_cpu = cluster_cpu_seconds(daemons) - cluster0;
    let host_cpu = this_thread_cpu_seconds() - host0;
    let switches = context_switches(gateway.child.id()).saturating_sub(switches0);
    let counters = gateway.metrics.and_then(Polling::counters);
    drop(q);
    Side {
        iops: f.iops(),
        mean_us: f.mean_us(),
        p50_us: f.percentile_us(0.50),
        p99_us: f.percentile_us(0.99),
        cpu_us_per_io: cpu / f.ios.max(1) as f64 * 1e6,
        switches_per_io: switches as f64 / f.ios.max(1) as f64,
        cluster_us_per_io: cluster_cpu / f.ios.max(1) as f64 * 1e6,
        host_us_per_io: host_cpu / f.ios.max(1) as f64 * 1e6,
        polling: counters0
            .zip(counters)
            .map(|(before, after)| Polling::between(before, after, f.ios)),
    }
}

/// Resident memory (KiB) and thread count of a process, from /proc/PID/status.
fn memory_and_threads(pid: u32) -> (f64, f64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (field("VmRSS:"), field("Threads:"))
}

/// Context switches (voluntary and not) of all of a process's threads: the wake-ups it costs.
fn context_switches(pid: u32) -> u64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("status")).ok())
        .flat_map(|status| {
            status
                .lines()
                .filter(|l| l.contains("ctxt_switches:"))
                .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
                .collect::<Vec<_>>()
        })
        .sum()
}

/// Direct librbd on several images at once: fio, one job per image at `w.queue_depth`
/// (fio runs each job as its own process with its own cluster connection). Total IOPS.
fn direct_multi(
    conf: &Path,
    images: &[&str],
    w: &Workload,
    ramp: f64,
    seconds: f64,
    out_dir: &Path,
) -> f64 {
    let out = out_dir.join(format!("fio-multi-{}.json", images.len()));
    let mut cmd = Command::new("fio");
    cmd.env("CEPH_CONF", conf)
        .arg("--ioengine=rbd")
        .arg("--clientname=admin")
        .arg(format!("--pool={POOL}"))
        .arg(format!(
            "--rw={}",
            if w.write { "randwrite" } else { "randread" }
        ))
        .arg(format!("--bs={}", w.io_bytes))
        .arg(format!("--iodepth={}", w.queue_depth))
        .arg("--time_based")
        .arg(format!("--ramp_time={ramp}"))
        .arg(format!("--runtime={seconds}"))
        .arg("--group_reporting")
        .arg("--output-format=json")
        .arg(format!("--output={}", out.display()));
    for (i, image) in images.iter().enumerate() {
        cmd.arg(format!("--name=image{i}"))
            .arg(format!("--rbdname={image}"));
    }
    run(cmd.stdin(Stdio::null()));
    let text = std::fs::read_to_string(&out).expect("fio's JSON output");
    let doc = json::parse(&text[text.find('{').unwrap_or(0)..])
        .unwrap_or_else(|e| panic!("cannot parse {}: {e}", out.display()));
    doc.get("jobs")
        .and_then(|j| j.idx(0))
        .and_then(|j| j.get(if w.write { "write" } else { "read" }))
        .and_then(|d| d.get("iops"))
        .and_then(json::Value::num)
        .expect("fio JSON: jobs[0].read.iops")
}

/// Connects the admin queue of `gateway`'s controller; returns it and the controller ID.
fn admin_connect(rt: &tokio::runtime::Runtime, gateway: &Gateway) -> (HostConnection, u16) {
    rt.block_on(async {
        let admin = HostConnection::connect(gateway.addr, HostOptions::new(HOSTNQN))
            .await
            .expect("admin connection");
        let cntlid = admin.connect_admin(SUBNQN, 0).await.expect("admin connect");
        admin.enable_controller().await.expect("enable");
        (admin, cntlid)
    })
}

/// The `--scaling` section: memory per open image and per idle cluster connection, and IOPS
/// over 1 to N images. See the module docs.
fn scaling(
    args: &Args,
    work: &Path,
    conf: &Path,
    keyring: Option<&str>,
    variants: &[Variant],
    rt: &tokio::runtime::Runtime,
) {
    let variant = &variants[0];
    let Some(&max) = args.scaling.iter().max() else {
        return;
    };
    let t0 = Instant::now();
    let images: Vec<Image> = (0..max)
        .map(|i| Image::create(conf, args.scaling_size_mib, &format!("-s{i}")))
        .collect();
    let names: Vec<&str> = images.iter().map(Image::name).collect();
    eprintln!(
        "scaling: {max} images of {} MiB written in {:.1} s",
        args.scaling_size_mib,
        t0.elapsed().as_secs_f64()
    );
    // Idle memory: started, images open, no I/O; a second to settle.
    let idle = |images: &[&str], connections: Option<usize>| {
        let g = Gateway::start(work, conf, keyring, images, connections, variant);
        std::thread::sleep(Duration::from_secs(1));
        memory_and_threads(g.child.id())
    };
    let none = idle(&[], None);
    let one = idle(&names[..1], Some(1));
    let many_on_one = idle(&names, Some(1));
    let many_on_many = idle(&names, Some(max.min(64)));
    let per = |a: (f64, f64), b: (f64, f64), n: usize| {
        let n = n.saturating_sub(1).max(1) as f64;
        ((b.0 - a.0) / n, (b.1 - a.1) / n)
    };
    let per_image = per(one, many_on_one, max);
    let per_connection = per(many_on_one, many_on_many, max);

    let w = Workload {
        name: "4K randread",
        write: false,
        random: true,
        io_bytes: 4096,
        queue_depth: args.scaling_qd,
    };
    let ramp = Duration::from_secs_f64(args.ramp);
    let duration = Duration::from_secs_f64(args.seconds);
    let mut rows = Vec::new();
    for &n in &args.scaling {
        eprintln!("scaling: {n} images, direct then every gateway");
        let direct = direct_multi(conf, &names[..n], &w, args.ramp, args.seconds, work);
        eprintln!("    direct {direct:.0} IOPS");
        for variant in variants {
            let (iops, rss, threads) = scaling_gateway_run(
                work,
                conf,
                keyring,
                (&names[..n], args.scaling_size_mib << 20),
                variant,
                rt,
                &w,
                (ramp, duration),
            );
            eprintln!("    {} {iops:.0} IOPS", variant.label);
            rows.push((n, &variant.label, direct, iops, rss, threads));
        }
    }

    println!();
    println!(
        "gateway memory ({}), idle, RSS and threads: no cluster connection {:.1} MiB / {:.0}; 1 image on 1 connection {:.1} MiB / {:.0}; {max} images on 1 connection {:.1} MiB / {:.0}; {max} images on {} connections {:.1} MiB / {:.0}",
        variant.label,
        none.0 / 1024.0,
        none.1,
        one.0 / 1024.0,
        one.1,
        many_on_one.0 / 1024.0,
        many_on_one.1,
        max.min(64),
        many_on_many.0 / 1024.0,
        many_on_many.1,
    );
    println!(
        "  per open image (idle): {:.0} KiB, {:.1} threads; per idle cluster connection: {:.0} KiB, {:.1} threads",
        per_image.0, per_image.1, per_connection.0, per_connection.1
    );
    println!(
        "IOPS over 1 to {max} images: 4K random read, QD{} per image, {:.0} s after {:.0} s ramp, one run each; direct = fio, one job (process, cluster connection) per image; gateway = one namespace and one host queue (thread) per image, default cluster connections; every gateway variant against the same direct run",
        args.scaling_qd, args.seconds, args.ramp
    );
    println!(
        "{:>7} {:<8} | {:>10} | {:>10} {:>6} | {:>17} {:>8}",
        "images", "gateway", "direct", "IOPS", "ratio", "gateway RSS MiB", "threads"
    );
    for (n, label, direct, iops, rss, threads) in rows {
        println!(
            "{n:>7} {label:<8} | {direct:>10.0} | {iops:>10.0} {:>6.2} | {:>17.1} {threads:>8.0}",
            iops / direct.max(1.0),
            rss / 1024.0
        );
    }
}

/// One gateway `variant` serving `images` (each `image_bytes`) as namespaces 1..=N, driven
/// by N host threads with one queue each at `w`; its total IOPS, then its RSS (KiB) and
/// threads.
#[allow(clippy::too_many_arguments)]
fn scaling_gateway_run(
    work: &Path,
    conf: &Path,
    keyring: Option<&str>,
    (images, image_bytes): (&[&str], u64),
    variant: &Variant,
    rt: &tokio::runtime::Runtime,
    w: &Workload,
    (ramp, duration): (Duration, Duration),
) -> (f64, f64, f64) {
    let gateway = Gateway::start(work, conf, keyring, images, None, variant);
    let (_admin, cntlid) = admin_connect(rt, &gateway);
    let queues: Vec<LeanQueue> = (1..=images.len() as u16)
        .map(|qid| {
            LeanQueue::connect_with(
                gateway.addr,
                SUBNQN,
                HOSTNQN,
                cntlid,
                qid,
                variant.sq_flow_control_off,
            )
            .expect("connect an I/O queue")
        })
        .collect();
    let iops: f64 = std::thread::scope(|scope| {
        let runs: Vec<_> = queues
            .into_iter()
            .enumerate()
            .map(|(k, mut q)| {
                let region = Region {
                    nsid: k as u32 + 1,
                    block_size: 512,
                    bytes: image_bytes,
                };
                scope.spawn(move || {
                    if !ramp.is_zero() {
                        q.run(w, &region, ramp).expect("gateway ramp");
                    }
                    q.run(w, &region, duration).expect("gateway run").iops()
                })
            })
            .collect();
        runs.into_iter()
            .map(|r| r.join().expect("host thread"))
            .sum()
    });
    let (rss, threads) = memory_and_threads(gateway.child.id());
    (iops, rss, threads)
}

fn main() {
    let Some(args) = parse_args() else {
        println!("rbd_vs_gateway: skipped (needs fio and Ceph; run it with cargo bench)");
        return;
    };
    let work = std::env::temp_dir().join(format!("nvmeof-rbd-bench-{}", std::process::id()));
    std::fs::create_dir_all(&work).expect("work dir");
    let fio_rbd = Command::new("fio")
        .arg("--enghelp=rbd")
        .output()
        .map(|o| o.status.success() && !o.stdout.is_empty())
        .unwrap_or(false);
    assert!(
        fio_rbd,
        "fio with the rbd engine is needed (Debian: apt-get install fio)"
    );

    let cluster = Cluster::get(&work, &args.store);
    // Both sides with the same librbd options: fio gets the gateway's defaults (no cache,
    // inline dispatch, no Objecter throttle) through a ceph.conf that adds them to the
    // cluster's, so the ratio measures what the gateway adds, not a librbd setting. With
    // `--fio-librbd-defaults` fio runs on librbd's stock settings except the cache.
    let conf = work.join("ceph.conf");
    let mut text = std::fs::read_to_string(&cluster.conf).expect("read ceph.conf");
    text.push_str("\n[client]\nrbd_cache = false\n");
    let gateway_defaults = rbd_backend::rbd::GATEWAY_DEFAULT_ARGS
        .iter()
        .filter(|_| !args.fio_librbd_defaults)
        .filter_map(|arg| arg.trim_start_matches("--").split_once('='));
    let given = args
        .client_options
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()));
    for (key, value) in gateway_defaults.chain(given) {
        text.push_str(&format!("{key} = {value}\n"));
    }
    std::fs::write(&conf, text).expect("write the bench ceph.conf");
    if let Some(k) = &cluster.keyring {
        std::env::set_var("CEPH_KEYRING", k);
    }

    let image = Image::create(&conf, args.size_mib, "");
    let daemons = cluster.daemon_pids();
    let osd_socket = cluster.osd_admin_socket();
    let variants = if args.variants.is_empty() {
        vec![Variant::built(args.gateway_threads)]
    } else {
        args.variants.clone()
    };

    // Admin queue through the host library; the I/O queues are LeanQueues.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    // Every gateway runs for the whole benchmark (an idle one costs a few threads' wake-ups).
    let gateways: Vec<(Gateway, HostConnection, u16)> = variants
        .iter()
        .map(|v| {
            let gateway = Gateway::start(
                &work,
                &conf,
                cluster.keyring.as_deref(),
                &[image.name()],
                None,
                v,
            );
            let (admin, cntlid) = admin_connect(&rt, &gateway);
            (gateway, admin, cntlid)
        })
        .collect();
    let region = Region {
        nsid: 1,
        block_size: 512,
        bytes: args.size_mib << 20,
    };
    let ramp = Duration::from_secs_f64(args.ramp);
    let duration = Duration::from_secs_f64(args.seconds);

    // The NVMe/TCP exchange alone, for reference: the same host against a target that answers
    // at once.
    let null_addr = common::spawn_null_responder();
    let mut rows = Vec::new();
    for (i, w) in WORKLOADS.iter().enumerate() {
        if args
            .only
            .as_ref()
            .is_some_and(|o| !format!("{} ", w.name).contains(&format!("{o} ")))
        {
            continue;
        }
        let mut ds = Vec::new();
        let mut gs: Vec<Vec<Side>> = vec![Vec::new(); gateways.len()];
        let mut null_means = Vec::new();
        for r in 0..args.repeat {
            // The order of the sides (direct, then every gateway) rotates by one per round, so
            // that over a whole number of rotations every side runs in every position equally
            // often. A run inherits what the run before it left behind (after a write run
            // BlueStore still flushes deferred writes and compacts; the null-responder run and
            // fio's own start leave the cluster idle), so a fixed order would hand one side the
            // drained cluster every time. (Rotating the gateways alone while alternating direct
            // would, with two gateways, keep one of them always right next to direct.)
            let sides = gateways.len() + 1; // 0 = direct, 1.. = the gateways
            let order: Vec<usize> = (0..sides).map(|k| (k + r) % sides).collect();
            let names: Vec<&str> = order
                .iter()
                .map(|&s| match s {
                    0 => "direct librbd (fio --ioengine=rbd)",
                    s => variants[s - 1].label.as_str(),
                })
                .collect();
            eprintln!(
                "{} run {}/{}: {}",
                w.name,
                r + 1,
                args.repeat,
                names.join(", then ")
            );
            let mut direct_run = None;
            let mut round: Vec<(usize, Side)> = Vec::new();
            for s in order {
                if s == 0 {
                    direct_run = Some(direct(
                        &conf,
                        image.name(),
                        w,
                        (args.ramp, args.seconds),
                        &work,
                        (&daemons, osd_socket.as_deref()),
                        args.fio_busy_poll,
                    ));
                    continue;
                }
                let g = s - 1;
                let (gateway, _, cntlid) = &gateways[g];
                let queue_id = i as u16 + 1;
                let side = gateway_run(
                    (gateway, &variants[g]),
                    *cntlid,
                    queue_id,
                    w,
                    &region,
                    (ramp, duration),
                    &daemons,
                );
                round.push((g, side));
            }
            let d = direct_run.expect("every round runs direct");
            ds.push(d);
            for (g, side) in round {
                eprintln!(
                    "    direct {:.0} IOPS p50 {:.1} us, {} {:.0} IOPS p50 {:.1} us: ratio {:.2}",
                    d.iops,
                    d.p50_us,
                    variants[g].label,
                    side.iops,
                    side.p50_us,
                    side.iops / d.iops.max(1.0)
                );
                gs[g].push(side);
            }
            let mut q = LeanQueue::connect(null_addr, SUBNQN, HOSTNQN, 1, 1)
                .expect("connect to the null responder");
            if !ramp.is_zero() {
                q.run(w, &region, ramp).expect("null responder ramp");
            }
            let f = q.run(w, &region, duration).expect("null responder run");
            null_means.push(f.mean_us());
        }
        for (g, runs) in gs.iter().enumerate() {
            // Paired figures (gateway vs the direct run of the same round) are robust to drift.
            let pairs = |f: fn(&Side, &Side) -> f64| -> Vec<f64> {
                ds.iter().zip(runs).map(|(d, g)| f(d, g)).collect()
            };
            let paired = |f: fn(&Side, &Side) -> f64| median(pairs(f));
            let [ratio_q1, ratio, ratio_q3] = quartiles(pairs(|d, g| g.iops / d.iops.max(1.0)));
            let added_mean = paired(|d, g| g.mean_us - d.mean_us);
            let added_mean_pct = paired(|d, g| (g.mean_us / d.mean_us.max(1e-9) - 1.0) * 100.0);
            let added_p50 = paired(|d, g| g.p50_us - d.p50_us);
            let beyond: Vec<f64> = ds
                .iter()
                .zip(runs)
                .zip(&null_means)
                .map(|((d, g), null)| g.mean_us - d.mean_us - null)
                .collect();
            let beyond_pct = median(
                ds.iter()
                    .zip(&beyond)
                    .map(|(d, b)| b / d.mean_us.max(1e-9) * 100.0)
                    .collect(),
            );
            let exchange = [median(null_means.clone()), median(beyond), beyond_pct];
            rows.push((
                w,
                &variants[g].label,
                Side::median(&ds),
                Side::median(runs),
                [
                    ratio,
                    ratio_q1,
                    ratio_q3,
                    added_mean,
                    added_mean_pct,
                    added_p50,
                ],
                exchange,
            ));
        }
    }

    println!(
        "RBD {} ({} MiB, written once), {}, librbd cache off on both sides, {}",
        image.spec,
        args.size_mib,
        cluster.description,
        if args.fio_librbd_defaults {
            "fio on librbd's other defaults (--fio-librbd-defaults)"
        } else {
            "fio with the gateway's librbd options"
        }
    );
    if args.fio_busy_poll {
        println!("fio polls for completions (--fio-busy-poll: its rbd engine's busy_poll=1)");
    }
    for (key, value) in &args.client_options {
        println!("both sides: {key} = {value} (--client-option)");
    }
    println!("direct = fio --ioengine=rbd (1 job); gateway = nvmeof-gateway over NVMe/TCP on 127.0.0.1, pipelined Rust host, 1 queue");
    println!("{}", cpu_idle_description());
    for v in &variants {
        println!(
            "  {}: {} ({} worker threads){}",
            v.label,
            v.binary.display(),
            v.threads
                .map_or_else(|| "default".to_string(), |n| n.to_string()),
            if v.sq_flow_control_off {
                "; the host connects with SQ flow control disabled (sqflow=off)"
            } else {
                ""
            }
        );
    }
    println!(
        "medians of {} rounds of {:.0} s runs (after {:.0} s ramp), the order of direct and the gateways rotating by one per round; ratio and added latency: medians of the per-round pairs (gateway vs that round's direct run), the ratio with the quartiles of the per-round ratios; latency = submission to completion; us/IO = CPU (user + system) of the process running librbd (fio incl. its start and ramp, or the gateway) per I/O (fio's I/Os counted {}); cs/IO = context switches of that process's threads per I/O (its wake-ups; fio incl. start and ramp)",
        args.repeat,
        args.seconds,
        args.ramp,
        if osd_socket.is_some() {
            "by the OSD's op counter over its whole run"
        } else {
            "as its measured rate times ramp + run"
        }
    );
    println!(
        "{:<18} {:<8} | {:>9} {:>8} {:>8} {:>6} {:>5} | {:>9} {:>8} {:>8} {:>6} {:>5} | {:>16} | {:>16} {:>12}",
        "workload",
        "gateway",
        "direct",
        "p50 us",
        "p99 us",
        "us/IO",
        "cs/IO",
        "IOPS",
        "p50 us",
        "p99 us",
        "us/IO",
        "cs/IO",
        "ratio (q1-q3)",
        "added mean us",
        "added p50 us",
    );
    for (w, label, d, g, [ratio, ratio_q1, ratio_q3, added_mean, added_mean_pct, added_p50], _) in
        &rows
    {
        println!(
            "{:<18} {:<8} | {:>9.0} {:>8.1} {:>8.1} {:>6.1} {:>5.1} | {:>9.0} {:>8.1} {:>8.1} {:>6.1} {:>5.1} | {:>4.2} ({:.2}-{:.2}) | {:>7.1} ({:>+6.1}%) {:>12.1}",
            w.name,
            label,
            d.iops,
            d.p50_us,
            d.p99_us,
            d.cpu_us_per_io,
            d.switches_per_io,
            g.iops,
            g.p50_us,
            g.p99_us,
            g.cpu_us_per_io,
            g.switches_per_io,
            ratio,
            ratio_q1,
            ratio_q3,
            added_mean,
            added_mean_pct,
            added_p50,
        );
    }
    println!();
    println!("CPU per I/O in us (user + system), medians: direct = fio process + cluster daemons; gateway = gateway process + benchmark host thread + cluster daemons (cluster: micro Ceph's mon and OSD, '-' for an external cluster); 'w/o host': the same ratio without the host thread, which in a deployment runs on another machine (fio's own engine cost stays in); 'cores busy': CPU-seconds per second of the measured processes, direct / gateway (of {} cores here; '-' for an external cluster); 'ceiling': direct total / (direct total + host), the best IOPS ratio a gateway spending no more CPU per I/O than fio could reach while the cores are saturated, since the host thread's CPU comes out of the same cores (fio's start and ramp make it a little generous)", cores());
    println!(
        "{:<18} {:<8} | {:>7} {:>8} {:>7} | {:>8} {:>7} {:>8} {:>7} | {:>11} {:>8} | {:>11} {:>7}",
        "workload",
        "gateway",
        "fio",
        "cluster",
        "total",
        "gateway",
        "host",
        "cluster",
        "total",
        "total ratio",
        "w/o host",
        "cores busy",
        "ceiling"
    );
    let known = !daemons.is_empty();
    // Columns that need the cluster's CPU: '-' for an external cluster.
    let if_known = |text: String| if known { text } else { "-".to_string() };
    for (w, label, d, g, _, _) in &rows {
        let direct_total = d.cpu_us_per_io + d.cluster_us_per_io;
        let gateway_total = g.cpu_us_per_io + g.host_us_per_io + g.cluster_us_per_io;
        println!(
            "{:<18} {:<8} | {:>7.1} {:>8} {:>7.1} | {:>8.1} {:>7.1} {:>8} {:>7.1} | {:>11.2} {:>8.2} | {:>11} {:>7}",
            w.name,
            label,
            d.cpu_us_per_io,
            if_known(format!("{:.1}", d.cluster_us_per_io)),
            direct_total,
            g.cpu_us_per_io,
            g.host_us_per_io,
            if_known(format!("{:.1}", g.cluster_us_per_io)),
            gateway_total,
            gateway_total / direct_total.max(1e-9),
            (gateway_total - g.host_us_per_io) / direct_total.max(1e-9),
            if_known(format!(
                "{:.2}/{:.2}",
                direct_total * d.iops / 1e6,
                gateway_total * g.iops / 1e6
            )),
            if_known(format!(
                "{:.2}",
                direct_total / (direct_total + g.host_us_per_io).max(1e-9)
            )),
        );
    }
    println!();
    println!("The NVMe/TCP exchange alone: mean latency of the same host at the same queue depth against a null responder (a thread of this process answering from a static buffer: no protocol core, no device), one run per round; 'beyond' = the gateway's added mean latency minus that exchange, in us and in % of direct's mean latency (medians of the per-round figures). At QD1 the exchange is the least any NVMe/TCP target adds on this machine.");
    println!(
        "{:<18} {:<8} | {:>16} {:>16} {:>18}",
        "workload", "gateway", "exchange mean us", "added mean us", "beyond us (%)"
    );
    for (w, label, _, _, figures, [exchange, beyond, beyond_pct]) in &rows {
        println!(
            "{:<18} {:<8} | {:>16.1} {:>16.1} {:>9.1} ({:>+6.1}%)",
            w.name, label, exchange, figures[3], beyond, beyond_pct,
        );
    }
    if rows.iter().any(|(_, _, _, g, _, _)| g.polling.is_some()) {
        println!();
        println!("Busy polling, from the gateway's counters over each run (medians): reads per I/O the queue made while a polling window was open, i.e. without a wake-up (~1 at QD1 when it always polls; 0 at QD16, where it never polls), and the share of adaptive epochs that ended choosing to poll");
        println!(
            "{:<18} {:<8} | {:>14} {:>11}",
            "workload", "gateway", "polled per IO", "chose poll"
        );
        for (w, label, _, g, _, _) in &rows {
            if let Some(p) = g.polling {
                println!(
                    "{:<18} {:<8} | {:>14.2} {:>11}",
                    w.name,
                    label,
                    p.polled_per_io,
                    if p.chose_poll.is_nan() {
                        "-".to_string()
                    } else {
                        format!("{:.0}%", p.chose_poll * 100.0)
                    }
                );
            }
        }
    }
    drop(gateways);
    scaling(
        &args,
        &work,
        &conf,
        cluster.keyring.as_deref(),
        &variants,
        &rt,
    );
    drop(image);
    drop(cluster);
    let _ = std::fs::remove_dir_all(&work);
}
