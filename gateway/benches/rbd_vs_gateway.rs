//! RBD through the gateway vs direct librbd, side by side on the same cluster and image.
//!
//! Direct: fio's rbd engine (librbd in the fio process). Gateway: `nvmeof-gateway` serving the
//! image as an RBD namespace, driven over NVMe/TCP on 127.0.0.1 by the pipelined Rust host
//! ([`LeanQueue`], one I/O queue). Both at the same queue depths, 4K random read and write at
//! QD1 and QD16, alternating direct and gateway per workload so that drift on a shared machine
//! hits both. Prints IOPS, p50/p99 latency (submission to completion), the IOPS ratio
//! gateway/direct, the latency the gateway adds (mean and p50) and the gateway's CPU per I/O.
//!
//!     cargo bench -p nvmeof-gateway --bench rbd_vs_gateway [-- --seconds 10 --size-mib 256]
//!
//! The cluster: the one named by `$CEPH_CONF` (client.admin, keyring from the conf or
//! `$CEPH_KEYRING`) when set; otherwise a throwaway micro Ceph (`scripts/micro-ceph.sh`,
//! memstore, or `--store bluestore`) that is stopped at the end. The image (`rbd/bench-<pid>`)
//! is created, written once in full (so reads hit allocated objects, as on a used image) and
//! removed at the end. librbd's cache is off on both sides (the gateway's default; for fio
//! through a derived ceph.conf), so both measure the cluster round trip.
//!
//! Other options: `--gateway-threads N` (default: one runtime worker per CPU),
//! `--ramp SECONDS` (default 1, not measured). In `cargo test --benches` (no `--bench`
//! argument) it only says it was skipped: it needs Ceph and fio.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

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
            .unwrap_or(10.0),
        ramp: value("--ramp").and_then(|s| s.parse().ok()).unwrap_or(1.0),
        size_mib: value("--size-mib")
            .and_then(|s| s.parse().ok())
            .unwrap_or(256),
        store: value("--store").unwrap_or_else(|| "memstore".into()),
        gateway_threads: value("--gateway-threads").and_then(|s| s.parse().ok()),
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

    fn create(conf: &Path, size_mib: u64) -> Image {
        let spec = format!("{POOL}/bench-{}", std::process::id());
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

/// The gateway process; SIGTERM (then SIGKILL) when dropped, so it closes the image.
struct Gateway {
    child: Child,
    addr: SocketAddr,
}

impl Gateway {
    fn start(
        work: &Path,
        conf: &Path,
        keyring: Option<&str>,
        image: &str,
        threads: Option<usize>,
    ) -> Gateway {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free port");
        let config = work.join("gateway.toml");
        let mut text = String::new();
        if let Some(n) = threads {
            text.push_str(&format!("[gateway]\nworker_threads = {n}\n\n"));
        }
        text.push_str(&format!(
            r#"[[listener]]
transport = "tcp"
address = "127.0.0.1"
port = {port}

[[subsystem]]
nqn = "{SUBNQN}"
allow_any_host = true

[[subsystem.namespace]]
nsid = 1
backend = "rbd"
pool = "{POOL}"
image = "{image}"

[ceph]
conf = "{}"
"#,
            conf.display()
        ));
        if let Some(k) = keyring {
            text.push_str(&format!("keyring = \"{k}\"\n"));
        }
        std::fs::write(&config, text).expect("write the gateway config");
        let mut child = Command::new(env!("CARGO_BIN_EXE_nvmeof-gateway"))
            .arg("--config")
            .arg(&config)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .spawn()
            .expect("start nvmeof-gateway");
        for _ in 0..600 {
            if TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return Gateway {
                    child,
                    addr: ([127, 0, 0, 1], port).into(),
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

/// User + system CPU seconds of a process, from /proc/PID/stat (clock ticks of 1/100 s).
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after_comm = stat.rsplit_once(')').map(|(_, rest)| rest).unwrap_or("");
    let fields: Vec<&str> = after_comm.split_whitespace().collect();
    let ticks: u64 = [11, 12]
        .iter()
        .filter_map(|&i| fields.get(i)?.parse::<u64>().ok())
        .sum();
    ticks as f64 / 100.0
}

/// One side's result for one workload.
struct Side {
    iops: f64,
    mean_us: f64,
    p50_us: f64,
    p99_us: f64,
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

/// Direct librbd: fio's rbd engine on the same image, one job at `w.queue_depth`.
fn direct(conf: &Path, image: &str, w: &Workload, ramp: f64, seconds: f64, out_dir: &Path) -> Side {
    let out = out_dir.join(format!("fio-{}.json", w.name.replace(' ', "-")));
    run(Command::new("fio")
        .env("CEPH_CONF", conf)
        .arg("--name=direct")
        .arg("--ioengine=rbd")
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
        .arg(format!("--output={}", out.display())));
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
    Side {
        iops: dir.get("iops").and_then(json::Value::num).unwrap_or(0.0),
        mean_us: lat.get("mean").and_then(json::Value::num).unwrap_or(0.0) / 1000.0,
        p50_us: pct("50.000000"),
        p99_us: pct("99.000000"),
    }
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
    // Both sides without librbd's cache: a ceph.conf that includes the cluster's and adds it.
    let conf = work.join("ceph.conf");
    let mut text = std::fs::read_to_string(&cluster.conf).expect("read ceph.conf");
    text.push_str("\n[client]\nrbd_cache = false\n");
    std::fs::write(&conf, text).expect("write the bench ceph.conf");
    if let Some(k) = &cluster.keyring {
        std::env::set_var("CEPH_KEYRING", k);
    }

    let image = Image::create(&conf, args.size_mib);
    let gateway = Gateway::start(
        &work,
        &conf,
        cluster.keyring.as_deref(),
        image.name(),
        args.gateway_threads,
    );

    // Admin queue through the host library; the I/O queues are LeanQueues.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let (_admin, cntlid) = rt.block_on(async {
        let admin = HostConnection::connect(gateway.addr, HostOptions::new(HOSTNQN))
            .await
            .expect("admin connection");
        let cntlid = admin.connect_admin(SUBNQN, 0).await.expect("admin connect");
        admin.enable_controller().await.expect("enable");
        (admin, cntlid)
    });
    let region = Region {
        nsid: 1,
        block_size: 512,
        bytes: args.size_mib << 20,
    };
    let ramp = Duration::from_secs_f64(args.ramp);
    let duration = Duration::from_secs_f64(args.seconds);

    let mut rows = Vec::new();
    for (i, w) in WORKLOADS.iter().enumerate() {
        eprintln!("{}: direct librbd (fio --ioengine=rbd)", w.name);
        let d = direct(&conf, image.name(), w, args.ramp, args.seconds, &work);
        eprintln!("{}: gateway", w.name);
        let mut q = LeanQueue::connect(gateway.addr, SUBNQN, HOSTNQN, cntlid, i as u16 + 1)
            .expect("connect an I/O queue");
        if !ramp.is_zero() {
            q.run(w, &region, ramp).expect("gateway ramp");
        }
        let cpu0 = cpu_seconds(gateway.child.id());
        let mut f = q.run(w, &region, duration).expect("gateway run");
        let cpu = cpu_seconds(gateway.child.id()) - cpu0;
        drop(q);
        let g = Side {
            iops: f.iops(),
            mean_us: f.mean_us(),
            p50_us: f.percentile_us(0.50),
            p99_us: f.percentile_us(0.99),
        };
        rows.push((w, d, g, cpu / f.ios.max(1) as f64 * 1e6));
    }

    println!(
        "RBD {} ({} MiB, written once), {}, librbd cache off on both sides",
        image.spec, args.size_mib, cluster.description
    );
    println!(
        "direct = fio --ioengine=rbd (1 job); gateway = nvmeof-gateway ({} worker threads) over NVMe/TCP on 127.0.0.1, pipelined Rust host, 1 queue; {:.0} s per run after {:.0} s ramp; latency = submission to completion",
        args.gateway_threads
            .map_or_else(|| "default".to_string(), |n| n.to_string()),
        args.seconds,
        args.ramp
    );
    println!(
        "{:<18} | {:>9} {:>8} {:>8} | {:>9} {:>8} {:>8} | {:>6} | {:>15} {:>12} | {:>8}",
        "workload",
        "direct",
        "p50 us",
        "p99 us",
        "gateway",
        "p50 us",
        "p99 us",
        "ratio",
        "added mean us",
        "added p50 us",
        "gw us/IO"
    );
    for (w, d, g, gw_cpu) in &rows {
        println!(
            "{:<18} | {:>9.0} {:>8.1} {:>8.1} | {:>9.0} {:>8.1} {:>8.1} | {:>6.2} | {:>7.1} ({:>+5.1}%) {:>12.1} | {:>8.2}",
            w.name,
            d.iops,
            d.p50_us,
            d.p99_us,
            g.iops,
            g.p50_us,
            g.p99_us,
            g.iops / d.iops.max(1.0),
            g.mean_us - d.mean_us,
            (g.mean_us / d.mean_us.max(1e-9) - 1.0) * 100.0,
            g.p50_us - d.p50_us,
            gw_cpu,
        );
    }
    drop(gateway);
    drop(image);
    drop(cluster);
    let _ = std::fs::remove_dir_all(&work);
}
