//! Fenced failover of a gateway group on a real Ceph cluster: two `nvmeof-gateway` processes
//! and an in-process control plane (state in RADOS), driven by the Rust NVMe/TCP host.
//!
//! gw1 owns ANA group 1 (namespace 1), gw2 owns group 2 (namespace 2). gw1 is frozen
//! (SIGSTOP: alive but silent, the case fencing exists for); the control plane declares it dead,
//! blocklists its librados clients, and only then is group 1 optimized on gw2 (read from
//! gw2's ANA log page). gw2 then writes namespace 1; gw1, thawed, cannot write any more and
//! the data stays as gw2 left it.
//!
//! Needs a cluster, so it is `#[ignore]`d in a plain `cargo test`; run it with
//! `bash rbd-backend/tests/ceph-tests.sh` or by hand:
//!
//! ```sh
//! eval "$(scripts/micro-ceph.sh start)"
//! cargo test -p nvmeof-gateway --test failover -- --ignored --nocapture
//! ```

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use control_plane::ana::{Availability, Timing};
use control_plane::server::{self, ControlPlane, Options};
use control_plane::store::{RadosBackend, Store};
use nvmeof_gateway::host::{HostConnection, HostOptions};
use nvmeof_gateway::spec::{ana, log};
use rbd_backend::rados::Client;
use rbd_backend::rbd::CephSettings;

const SUBNQN: &str = "nqn.2016-06.io.test:failover";
const HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:0f0f0f0f-0000-0000-0000-0000000000f0";
const BLOCK: u32 = 512;

fn ceph_conf() -> String {
    let conf = std::env::var("CEPH_CONF").unwrap_or_default();
    assert!(
        !conf.is_empty() && std::path::Path::new(&conf).is_file(),
        "this test needs a Ceph cluster: CEPH_CONF ({conf:?}) must name its ceph.conf.\n\
         Start one with: eval \"$(scripts/micro-ceph.sh start)\"  (or run rbd-backend/tests/ceph-tests.sh)"
    );
    conf
}

fn pool() -> String {
    std::env::var("MICRO_CEPH_POOL").unwrap_or_else(|_| "rbd".into())
}

fn settings() -> CephSettings {
    CephSettings {
        conf: Some(PathBuf::from(ceph_conf())),
        keyring: std::env::var("CEPH_KEYRING").ok().map(PathBuf::from),
        max_connections: 1,
        ..CephSettings::default()
    }
}

fn run(cmd: &str, args: &[&str]) -> String {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd} {args:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// A gateway process, killed when dropped.
struct GatewayProcess {
    child: Child,
    port: u16,
    log: PathBuf,
}

impl GatewayProcess {
    fn signal(&self, sig: &str) {
        run("kill", &[sig, &self.child.id().to_string()]);
    }
}

impl Drop for GatewayProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[allow(clippy::too_many_arguments)]
fn spawn_gateway(
    dir: &std::path::Path,
    name: &str,
    group: u32,
    cntlid: (u16, u16),
    cp: &str,
    images: &[String; 2],
) -> GatewayProcess {
    let port = free_port();
    let config = format!(
        r#"
[gateway]
name = "{name}"
cntlid_min = {lo}
cntlid_max = {hi}
worker_threads = 1

[group]
control_plane = ["{cp}"]
ana_group = {group}
beacon_interval_ms = 250

[[listener]]
transport = "tcp"
address = "127.0.0.1"
port = {port}

[[subsystem]]
nqn = "{SUBNQN}"
allow_any_host = true

[[subsystem.namespace]]
nsid = 1
backend = "rbd"
pool = "{pool}"
image = "{img1}"
ana_group = 1

[[subsystem.namespace]]
nsid = 2
backend = "rbd"
pool = "{pool}"
image = "{img2}"
ana_group = 2

[ceph]
conf = "{conf}"
connections = 1
"#,
        lo = cntlid.0,
        hi = cntlid.1,
        pool = pool(),
        img1 = images[0],
        img2 = images[1],
        conf = ceph_conf(),
    );
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, config).expect("write config");
    let log = dir.join(format!("{name}.log"));
    let child = Command::new(env!("CARGO_BIN_EXE_nvmeof-gateway"))
        .arg("--config")
        .arg(&path)
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).expect("log file"))
        .spawn()
        .expect("start nvmeof-gateway");
    GatewayProcess { child, port, log }
}

struct Host {
    admin: HostConnection,
    io: HostConnection,
}

async fn connect(port: u16, within: Duration) -> Host {
    let addr = format!("127.0.0.1:{port}");
    let started = Instant::now();
    loop {
        let mut o = HostOptions::new(HOSTNQN);
        o.timeout = Duration::from_secs(60);
        let attempt = async {
            let admin = HostConnection::connect(addr.as_str(), o.clone()).await?;
            let cntlid = admin.connect_admin(SUBNQN, 120_000).await?;
            admin.enable_controller().await?;
            let ctrl = admin.identify_controller().await?;
            let io = HostConnection::connect(addr.as_str(), o).await?;
            io.set_in_capsule_data_max(ctrl.in_capsule_data_max());
            io.connect_io(SUBNQN, cntlid, 1, 31).await?;
            Ok::<_, nvmeof_gateway::host::HostError>(Host { admin, io })
        };
        match attempt.await {
            Ok(h) => return h,
            Err(e) if started.elapsed() < within => {
                let _ = e;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("cannot connect to the gateway on {addr}: {e}"),
        }
    }
}

/// ANA group → state, from the ANA log page (0Ch).
async fn ana_states(admin: &HostConnection) -> BTreeMap<u32, u8> {
    let page = admin
        .get_log_page(log::ANA, 0, 4096, 0)
        .await
        .expect("ANA log page");
    let mut out = BTreeMap::new();
    let groups = u16::from_le_bytes([page[8], page[9]]);
    let mut off = 16usize;
    for _ in 0..groups {
        let d = &page[off..];
        let id = u32::from_le_bytes([d[0], d[1], d[2], d[3]]);
        let nnsid = u32::from_le_bytes([d[4], d[5], d[6], d[7]]) as usize;
        out.insert(id, d[16]);
        off += 32 + 4 * nnsid;
    }
    out
}

async fn wait_for_states(admin: &HostConnection, want: &[(u32, u8)], within: Duration) {
    let started = Instant::now();
    loop {
        let got = ana_states(admin).await;
        if want.iter().all(|(g, s)| got.get(g) == Some(s)) {
            return;
        }
        assert!(
            started.elapsed() < within,
            "ANA states {got:?}, expected {want:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn pattern(seed: u8) -> Vec<u8> {
    (0..BLOCK as usize * 8)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

/// `group`'s client addresses (of one gateway's per-group report) are all in the blocklist,
/// and none of its other groups' addresses is.
fn assert_group_fenced_alone(groups: &BTreeMap<u32, Vec<String>>, group: u32, blocklist: &str) {
    let listed = |addr: &str| {
        let bare = |a: &str| {
            a.trim_start_matches("v1:")
                .trim_start_matches("v2:")
                .to_string()
        };
        rbd_backend::rados::split_addrs(addr).iter().all(|one| {
            blocklist
                .split_whitespace()
                .any(|token| bare(token) == bare(one))
        })
    };
    let fenced = groups.get(&group).cloned().unwrap_or_default();
    assert!(
        !fenced.is_empty(),
        "no client reported for group {group}: {groups:?}"
    );
    for a in &fenced {
        assert!(
            listed(a),
            "{a} (group {group}) not in the blocklist:\n{blocklist}"
        );
    }
    for (g, addrs) in groups {
        if *g == group {
            continue;
        }
        for a in addrs {
            assert!(
                !listed(a),
                "{a} of group {g} was blocklisted with group {group}:\n{blocklist}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Ceph cluster: bash rbd-backend/tests/ceph-tests.sh"]
async fn a_frozen_gateway_is_fenced_before_its_group_moves() {
    ceph_conf();
    let tag = format!("{}-{}", std::process::id(), free_port());
    let images = [format!("failover-{tag}-1"), format!("failover-{tag}-2")];
    for i in &images {
        run(
            "rbd",
            &["create", "--size", "64M", &format!("{}/{i}", pool())],
        );
    }
    let dir = std::env::temp_dir().join(format!("failover-{tag}"));
    std::fs::create_dir_all(&dir).expect("temp dir");

    // The control plane, state in RADOS.
    let group = format!("failover-{tag}");
    let (s, p, g) = (settings(), pool(), group.clone());
    let backend = tokio::task::spawn_blocking(move || RadosBackend::connect(&s, &p, &g))
        .await
        .expect("join")
        .expect("state object");
    let oid = backend.oid().to_string();
    let cp = ControlPlane::start(
        Store::new(Arc::new(backend)),
        "test-replica".into(),
        Options {
            timing: Timing {
                grace_ms: 1500,
                failback_delay_ms: 500,
            },
            lease: Duration::from_secs(3),
            tick: Duration::from_millis(100),
        },
    )
    .await
    .expect("control plane");
    tokio::spawn(cp.clone().run());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let cp_addr = listener.local_addr().expect("addr").to_string();
    tokio::spawn(server::serve(
        cp.clone(),
        listener,
        std::future::pending::<()>(),
    ));

    let gw1 = spawn_gateway(&dir, "gw1", 1, (1, 2040), &cp_addr, &images);
    let gw2 = spawn_gateway(&dir, "gw2", 2, (2041, 4080), &cp_addr, &images);
    eprintln!("gateway logs: {} {}", gw1.log.display(), gw2.log.display());
    let h1 = connect(gw1.port, Duration::from_secs(30)).await;
    let h2 = connect(gw2.port, Duration::from_secs(30)).await;
    let steady = Duration::from_secs(20);
    wait_for_states(
        &h1.admin,
        &[(1, ana::OPTIMIZED), (2, ana::INACCESSIBLE)],
        steady,
    )
    .await;
    wait_for_states(
        &h2.admin,
        &[(1, ana::INACCESSIBLE), (2, ana::OPTIMIZED)],
        steady,
    )
    .await;
    eprintln!("steady: gw1 optimized for group 1, gw2 for group 2");

    // Namespace 1 through its optimized path; through gw2 it is an inaccessible path.
    h1.io
        .write(1, 0, pattern(1), BLOCK)
        .await
        .expect("write via gw1");
    assert!(
        h2.io.write(1, 0, pattern(9), BLOCK).await.is_err(),
        "gw2 wrote namespace 1 while group 1 is inaccessible there"
    );

    // Freeze gw1: alive, silent.
    let mut gw1_addrs = cp
        .state()
        .map
        .and_then(|m| m.gateways.get("gw1").map(|g| g.addrs.clone()))
        .unwrap_or_default();
    assert!(!gw1_addrs.is_empty(), "gw1 reported no client addresses");
    let frozen = Instant::now();
    gw1.signal("-STOP");
    wait_for_states(&h2.admin, &[(1, ana::OPTIMIZED)], Duration::from_secs(30)).await;
    let failover = frozen.elapsed();
    eprintln!(
        "failover: group 1 optimized on gw2 {} ms after gw1 froze (grace 1500 ms)",
        failover.as_millis()
    );
    let st = cp.state();
    let map = st.map.expect("group map");
    assert_eq!(map.gateways["gw1"].availability, Availability::Fenced);
    assert_eq!(map.groups[&1].holder, "gw2");
    // The blocklist holds gw1's clients for group 1, and only those: its connections are
    // sharded per ANA group, so its group-2 clients were left alone.
    let blocklist = run("ceph", &["osd", "blocklist", "ls"]);
    let gw1_groups = map.gateways["gw1"]
        .group_addrs
        .clone()
        .expect("gw1 reports its clients per ANA group");
    assert_group_fenced_alone(&gw1_groups, 1, &blocklist);
    // gw2 now serves namespace 1.
    let started = Instant::now();
    h2.io
        .write(1, 0, pattern(2), BLOCK)
        .await
        .expect("write via gw2");
    let frozen_to_first_write = frozen.elapsed();
    eprintln!(
        "first write through gw2 after the failover: {} ms",
        started.elapsed().as_millis()
    );
    assert_eq!(
        h2.io.read(1, 0, 8, BLOCK).await.expect("read via gw2"),
        pattern(2)
    );

    // gw1 comes back without restarting: it is fenced and cannot write.
    gw1.signal("-CONT");
    drop(h1);
    let h1 = connect(gw1.port, Duration::from_secs(10)).await;
    let r = h1.io.write(1, 0, pattern(3), BLOCK).await;
    assert!(r.is_err(), "the fenced gateway wrote");
    eprintln!(
        "fenced gw1's write: {}",
        r.err().map(|e| e.to_string()).unwrap_or_default()
    );
    // It is told, and says so in its log.
    let started = Instant::now();
    while !std::fs::read_to_string(&gw1.log)
        .unwrap_or_default()
        .contains("this gateway was fenced")
    {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "gw1 never logged that it was fenced"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Without restarting, it drops its fenced clients; once it reports none of the fenced
    // addresses the control plane lets it serve again, and group 1 fails back to it (drained
    // on gw2, gw2's group-1 clients fenced), served through fresh clients.
    let thawed = Instant::now();
    wait_for_states(&h1.admin, &[(1, ana::OPTIMIZED)], Duration::from_secs(30)).await;
    wait_for_states(
        &h2.admin,
        &[(1, ana::INACCESSIBLE)],
        Duration::from_secs(10),
    )
    .await;
    eprintln!(
        "fenced gw1, not restarted, optimized for group 1 again {} ms after it was thawed",
        thawed.elapsed().as_millis()
    );
    let st = cp.state().map.expect("map");
    assert_eq!(st.gateways["gw1"].availability, Availability::Available);
    assert_eq!(
        st.gateways["gw1"].incarnation,
        map.gateways["gw1"].incarnation
    );
    let log = std::fs::read_to_string(&gw1.log).unwrap_or_default();
    assert!(
        log.contains("ANA group given fresh cluster clients"),
        "gw1 served group 1 again without fresh clients"
    );
    assert_eq!(
        h1.io.read(1, 0, 8, BLOCK).await.expect("read via gw1"),
        pattern(2),
        "the fenced gateway's refused write landed"
    );
    h1.io
        .write(1, 0, pattern(6), BLOCK)
        .await
        .expect("write via gw1 on fresh clients");
    assert_eq!(
        h1.io.read(1, 0, 8, BLOCK).await.expect("read via gw1"),
        pattern(6)
    );
    // The fresh clients are not the fenced ones.
    let now_addrs = st.gateways["gw1"]
        .group_addrs
        .clone()
        .unwrap_or_default()
        .remove(&1)
        .unwrap_or_default();
    for a in gw1_groups.get(&1).cloned().unwrap_or_default() {
        assert!(
            !now_addrs.contains(&a),
            "gw1 reports its fenced client {a} again"
        );
    }

    // Failback: gw1 restarts (new process, new clients); group 1 drains on gw2 and becomes
    // optimized on gw1 again.
    drop(h1);
    drop(gw1);
    let restarted = Instant::now();
    let gw1 = spawn_gateway(&dir, "gw1", 1, (1, 2040), &cp_addr, &images);
    let h1 = connect(gw1.port, Duration::from_secs(30)).await;
    wait_for_states(
        &h1.admin,
        &[(1, ana::OPTIMIZED), (2, ana::INACCESSIBLE)],
        Duration::from_secs(30),
    )
    .await;
    wait_for_states(
        &h2.admin,
        &[(1, ana::INACCESSIBLE), (2, ana::OPTIMIZED)],
        Duration::from_secs(10),
    )
    .await;
    eprintln!(
        "failback: group 1 optimized on the restarted gw1 {} ms after it started",
        restarted.elapsed().as_millis()
    );
    let map = cp.state().map.expect("map");
    assert_eq!(map.gateways["gw1"].availability, Availability::Available);
    // The failback fenced gw2's clients for group 1 only: gw2 still serves its own group 2
    // through the same process.
    let gw2_groups = map.gateways["gw2"]
        .group_addrs
        .clone()
        .expect("gw2 reports its clients per ANA group");
    let blocklist = run("ceph", &["osd", "blocklist", "ls"]);
    assert_group_fenced_alone(&gw2_groups, 1, &blocklist);
    gw1_addrs.extend(gw2_groups.get(&1).cloned().unwrap_or_default());
    h2.io
        .write(2, 0, pattern(5), BLOCK)
        .await
        .expect("gw2 writes its own group after its group-1 clients were fenced");
    assert_eq!(
        h2.io.read(2, 0, 8, BLOCK).await.expect("read via gw2"),
        pattern(5)
    );
    h1.io
        .write(1, 0, pattern(4), BLOCK)
        .await
        .expect("write via gw1 after failback");
    assert_eq!(
        h1.io.read(1, 0, 8, BLOCK).await.expect("read via gw1"),
        pattern(4)
    );

    // More rounds, measured only: freeze the owner, time until a write through the survivor
    // succeeds (the host retries every 20 ms on path errors), restart the owner, fail back.
    let runs: usize = std::env::var("FAILOVER_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5);
    let mut pauses = vec![frozen_to_first_write];
    let (mut gw1, mut h1) = (gw1, h1);
    let mut fenced_addrs = Vec::new();
    for round in 1..runs {
        let addrs: Vec<String> = cp
            .state()
            .map
            .map(|m| m.gateways.values().flat_map(|g| g.addrs.clone()).collect())
            .unwrap_or_default();
        fenced_addrs.extend(addrs);
        let frozen = Instant::now();
        gw1.signal("-STOP");
        loop {
            match tokio::time::timeout(
                Duration::from_secs(5),
                h2.io.write(1, 0, pattern(10 + round as u8), BLOCK),
            )
            .await
            {
                Ok(Ok(())) => break,
                _ => {
                    assert!(frozen.elapsed() < Duration::from_secs(30), "no failover");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        }
        pauses.push(frozen.elapsed());
        drop(h1);
        drop(gw1);
        gw1 = spawn_gateway(&dir, "gw1", 1, (1, 2040), &cp_addr, &images);
        h1 = connect(gw1.port, Duration::from_secs(30)).await;
        wait_for_states(&h1.admin, &[(1, ana::OPTIMIZED)], Duration::from_secs(30)).await;
        h1.io
            .write(1, 0, pattern(20 + round as u8), BLOCK)
            .await
            .expect("write after failback");
    }
    let mut ms: Vec<u128> = pauses.iter().map(|d| d.as_millis()).collect();
    ms.sort_unstable();
    eprintln!(
        "write pause (owner frozen -> first write through the survivor) over {} runs: median {} ms, max {} ms, all {:?}",
        ms.len(),
        ms[ms.len() / 2],
        ms[ms.len() - 1],
        ms
    );
    gw1_addrs.extend(fenced_addrs);
    // gw2 had group 1 taken away (and its clients for it fenced) at every failback: each later
    // failover gave it fresh clients and reopened the image before it turned optimized.
    if runs > 1 {
        let log = std::fs::read_to_string(&gw2.log).unwrap_or_default();
        assert!(
            log.contains("ANA group given fresh cluster clients"),
            "gw2 served group 1 again without fresh clients"
        );
    }

    // Planned shutdown (SIGTERM) of the owner: it asks the control plane to move group 1
    // (drain, fence, optimized on gw2) before it closes its connections, and exits 0.
    gw1_addrs.extend(
        cp.state()
            .map
            .and_then(|m| m.gateways.get("gw1").map(|g| g.addrs.clone()))
            .unwrap_or_default(),
    );
    let stopping = Instant::now();
    gw1.signal("-TERM");
    wait_for_states(&h2.admin, &[(1, ana::OPTIMIZED)], Duration::from_secs(15)).await;
    let moved = stopping.elapsed();
    h2.io
        .write(1, 0, pattern(30), BLOCK)
        .await
        .expect("write via gw2 after the planned move");
    let exited = loop {
        if let Some(status) = gw1.child.try_wait().expect("wait") {
            break status;
        }
        assert!(
            stopping.elapsed() < Duration::from_secs(20),
            "gw1 did not exit after SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(exited.success(), "gw1 exited with {exited}");
    eprintln!(
        "planned move (SIGTERM): group 1 optimized on gw2 {} ms after the signal, gw1 exited after {} ms",
        moved.as_millis(),
        stopping.elapsed().as_millis()
    );
    let log = std::fs::read_to_string(&gw1.log).unwrap_or_default();
    assert!(
        log.contains("groups moved away"),
        "gw1 did not wait for the move"
    );

    // Clean up: processes, blocklist entries, images, state object.
    drop(h1);
    drop(h2);
    drop(gw1);
    drop(gw2);
    let (s, p) = (settings(), pool());
    let logs = dir.clone();
    tokio::task::spawn_blocking(move || {
        if let Ok(c) = Client::connect(&s) {
            for a in &gw1_addrs {
                let _ = c.blocklist_rm(a);
            }
            if let Ok(pl) = c.pool(&p, None) {
                let _ = pl.remove(&oid);
            }
        }
    })
    .await
    .expect("cleanup");
    for i in &images {
        let _ = Command::new("rbd")
            .args(["rm", "--no-progress", &format!("{}/{i}", pool())])
            .output();
    }
    let _ = std::fs::remove_dir_all(logs);
}
