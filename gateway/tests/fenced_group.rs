//! One ANA group of a running gateway fenced on a real Ceph cluster: the gateway's librados
//! clients are sharded per ANA group, so blocklisting the client of group 1 (as the control
//! plane's fence does, here by hand with `ceph osd blocklist add`) stops exactly group 1 on
//! that gateway. Its writes fail with a path-related status (ANA Inaccessible, DNR clear: the
//! Linux host retries them on another path), never a silent success or a media error; its ANA
//! log page reports group 1 inaccessible; nothing it refused lands in the image (checked with
//! `rbd export`); and namespace 2 (group 2) keeps working through the same gateway.
//!
//! Needs a cluster, so it is `#[ignore]`d in a plain `cargo test`; run it with
//! `bash rbd-backend/tests/ceph-tests.sh` or by hand:
//!
//! ```sh
//! eval "$(scripts/micro-ceph.sh start)"
//! cargo test -p nvmeof-gateway --test fenced_group -- --ignored --nocapture
//! ```

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nvmeof_gateway::host::{HostConnection, HostError, HostOptions};
use nvmeof_gateway::spec::{ana, log};

const SUBNQN: &str = "nqn.2016-06.io.test:fenced-group";
const HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:0f0f0f0f-0000-0000-0000-0000000000fe";
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

fn run(cmd: &str, args: &[&str]) -> Vec<u8> {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd} {args:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

struct GatewayProcess {
    child: Child,
    log: PathBuf,
}

impl Drop for GatewayProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn connect(port: u16) -> (HostConnection, HostConnection) {
    let addr = format!("127.0.0.1:{port}");
    let started = Instant::now();
    loop {
        let mut o = HostOptions::new(HOSTNQN);
        o.timeout = Duration::from_secs(30);
        let attempt = async {
            let admin = HostConnection::connect(addr.as_str(), o.clone()).await?;
            let cntlid = admin.connect_admin(SUBNQN, 120_000).await?;
            admin.enable_controller().await?;
            let ctrl = admin.identify_controller().await?;
            let io = HostConnection::connect(addr.as_str(), o).await?;
            io.set_in_capsule_data_max(ctrl.in_capsule_data_max());
            io.connect_io(SUBNQN, cntlid, 1, 31).await?;
            Ok::<_, HostError>((admin, io))
        };
        match attempt.await {
            Ok(h) => return h,
            Err(e) => {
                assert!(
                    started.elapsed() < Duration::from_secs(30),
                    "cannot connect to the gateway on {addr}: {e}"
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
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

fn pattern(seed: u8) -> Vec<u8> {
    (0..BLOCK as usize * 8)
        .map(|i| (i as u8).wrapping_mul(29) ^ seed)
        .collect()
}

/// The addresses the gateway logged for its connection(s) of `group`.
fn group_addrs_from_log(log: &str, group: u32) -> Vec<String> {
    log.lines()
        .map(|l| {
            // Strip ANSI colours.
            let mut out = String::new();
            let mut skip = false;
            for c in l.chars() {
                match (skip, c) {
                    (_, '\u{1b}') => skip = true,
                    (true, 'm') => skip = false,
                    (true, _) => {}
                    (false, c) => out.push(c),
                }
            }
            out
        })
        .filter(|l| l.contains("connected to the Ceph cluster"))
        .filter(|l| l.contains(&format!("group={group} ")))
        .filter_map(|l| {
            let rest = &l[l.find("addrs=")? + 6..];
            Some(rest.split_whitespace().next()?.to_string())
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Ceph cluster: bash rbd-backend/tests/ceph-tests.sh"]
async fn fencing_one_ana_group_stops_only_that_group_on_the_gateway() {
    let conf = ceph_conf();
    let tag = format!("{}-{}", std::process::id(), free_port());
    let images = [format!("fenced-{tag}-1"), format!("fenced-{tag}-2")];
    for i in &images {
        run(
            "rbd",
            &["create", "--size", "16M", &format!("{}/{i}", pool())],
        );
    }
    let dir = std::env::temp_dir().join(format!("fenced-group-{tag}"));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let port = free_port();
    let config = format!(
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
"#,
        pool = pool(),
        img1 = images[0],
        img2 = images[1],
    );
    let path = dir.join("gw.toml");
    std::fs::write(&path, config).expect("write config");
    let log = dir.join("gw.log");
    let gw = GatewayProcess {
        child: Command::new(env!("CARGO_BIN_EXE_nvmeof-gateway"))
            .arg("--config")
            .arg(&path)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log file"))
            .spawn()
            .expect("start nvmeof-gateway"),
        log,
    };
    eprintln!("gateway log: {}", gw.log.display());
    let (admin, io) = connect(port).await;
    io.write(1, 0, pattern(1), BLOCK).await.expect("write ns 1");
    io.write(2, 0, pattern(2), BLOCK).await.expect("write ns 2");

    // Each group has its own client.
    let text = std::fs::read_to_string(&gw.log).unwrap_or_default();
    let (g1, g2) = (
        group_addrs_from_log(&text, 1),
        group_addrs_from_log(&text, 2),
    );
    assert_eq!(g1.len(), 1, "group 1 clients {g1:?}\n{text}");
    assert_eq!(g2.len(), 1, "group 2 clients {g2:?}");
    assert_ne!(g1, g2, "both groups on one client");

    // Fence group 1 on this gateway.
    for a in rbd_backend::rados::split_addrs(&g1[0]) {
        run("ceph", &["osd", "blocklist", "add", &a, "600"]);
    }
    let fenced_at = Instant::now();

    // Its writes fail with a path status (retried elsewhere by a multipath host) ...
    let mut expected_1 = pattern(1);
    let err = loop {
        match io.write(1, 0, pattern(3), BLOCK).await {
            Err(e) => break e,
            Ok(()) => {
                // An OSD that has not seen the new osdmap yet may take one more.
                expected_1 = pattern(3);
                assert!(
                    fenced_at.elapsed() < Duration::from_secs(20),
                    "writes through the fenced group keep succeeding"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    eprintln!("write to the fenced group: {err}");
    match &err {
        HostError::Nvme(c) => {
            assert_eq!((c.sct(), c.sc()), (0x3, 0x02), "ANA Inaccessible: {err}");
            assert!(!c.dnr(), "DNR set: the host would not retry elsewhere");
        }
        other => panic!("expected an NVMe status, got {other}"),
    }
    // ... every later one too, reads as well, and the group is reported inaccessible here.
    for _ in 0..5 {
        assert!(io.write(1, 8, pattern(4), BLOCK).await.is_err());
    }
    assert!(io.read(1, 0, 8, BLOCK).await.is_err());
    let states = ana_states(&admin).await;
    assert_eq!(states.get(&1), Some(&ana::INACCESSIBLE), "{states:?}");
    assert_eq!(states.get(&2), Some(&ana::OPTIMIZED), "{states:?}");

    // Group 2 on the same gateway is untouched.
    io.write(2, 8, pattern(5), BLOCK)
        .await
        .expect("write ns 2 after group 1 was fenced");
    assert_eq!(
        io.read(2, 0, 8, BLOCK).await.expect("read ns 2"),
        pattern(2)
    );
    assert_eq!(
        io.read(2, 8, 8, BLOCK).await.expect("read ns 2"),
        pattern(5)
    );

    // What the fenced gateway refused never reached the image.
    drop(io);
    drop(admin);
    let mut gw = gw;
    run("kill", &["-TERM", &gw.child.id().to_string()]);
    let _ = gw.child.wait();
    drop(gw);
    let exported = run(
        "rbd",
        &[
            "export",
            "--no-progress",
            &format!("{}/{}", pool(), images[0]),
            "-",
        ],
    );
    assert_eq!(&exported[..pattern(0).len()], expected_1.as_slice());
    assert!(
        exported[pattern(0).len()..2 * pattern(0).len()]
            .iter()
            .all(|b| *b == 0),
        "a refused write landed"
    );

    for a in rbd_backend::rados::split_addrs(&g1[0]) {
        let _ = Command::new("ceph")
            .args(["osd", "blocklist", "rm", &a])
            .output();
    }
    for i in &images {
        let deadline = Instant::now() + Duration::from_secs(60);
        while Command::new("rbd")
            .args(["rm", "--no-progress", &format!("{}/{i}", pool())])
            .output()
            .map(|o| !o.status.success())
            .unwrap_or(true)
            && Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
    }
    let _ = std::fs::remove_dir_all(dir);
}
