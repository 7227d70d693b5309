//! `/healthz` and `/readyz` of `nvmeof-control` processes (what Kubernetes' probes ask):
//! - with its state in memory it is live and ready once it serves;
//! - with its keyring file missing (a Secret not mounted yet) it does not exit: it is live,
//!   not ready with the reason, logs that reason once, and keeps retrying;
//! - (`--features ceph-tests`, against the micro Ceph) it becomes ready once the keyring
//!   file appears, as Kubernetes updates a Secret volume in place, and serves gRPC.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use control_plane::test_support::{free_port, http_get};

/// A replica process, killed when dropped; its stderr in `log`.
struct Replica {
    child: Child,
    addr: String,
    metrics: String,
    log: PathBuf,
}

impl Drop for Replica {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Replica {
    fn start(dir: &Path, name: &str, args: &[&str]) -> Replica {
        let addr = format!("127.0.0.1:{}", free_port());
        let metrics = format!("127.0.0.1:{}", free_port());
        let log = dir.join(format!("{name}.log"));
        let child = Command::new(env!("CARGO_BIN_EXE_nvmeof-control"))
            .args([
                "--listen",
                &addr,
                "--metrics-listen",
                &metrics,
                "--id",
                name,
            ])
            .args(args)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log file"))
            .spawn()
            .expect("start nvmeof-control");
        Replica {
            child,
            addr,
            metrics,
            log,
        }
    }

    fn get(&self, path: &str) -> Option<(u16, String)> {
        http_get(&self.metrics, path)
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until `path` answers `want` (status, body predicate).
    fn until(&self, path: &str, within: Duration, want: impl Fn(u16, &str) -> bool) -> String {
        let started = Instant::now();
        loop {
            let got = self.get(path);
            if let Some((code, body)) = &got {
                if want(*code, body) {
                    return body.clone();
                }
            }
            assert!(
                started.elapsed() < within,
                "{path}: last answer {got:?}; log:\n{}",
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn still_running(&mut self) {
        if let Some(status) = self.child.try_wait().expect("wait") {
            panic!("nvmeof-control exited ({status}):\n{}", self.log_text());
        }
    }
}

fn test_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("cp-health-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("test directory");
    dir
}

#[test]
fn a_replica_with_its_state_in_memory_is_live_and_ready() {
    let dir = test_dir("memory");
    let r = Replica::start(&dir, "r1", &["--store", "memory"]);
    r.until("/readyz", Duration::from_secs(20), |c, b| {
        c == 200 && b == "ready\n"
    });
    assert_eq!(r.get("/healthz"), Some((200, "ok\n".into())));
    assert!(r
        .get("/metrics")
        .is_some_and(|(c, t)| c == 200 && t.contains("nvmeof_control_")));
    let _ = std::fs::remove_dir_all(&dir);
}

/// The reason `/readyz` gives while `keyring` is missing.
fn missing_keyring_reason(keyring: &Path) -> String {
    format!(
        "ceph keyring {}: missing (No such file or directory (os error 2)); is the keyring file mounted?",
        keyring.display()
    )
}

#[test]
fn a_replica_without_its_keyring_stays_up_not_ready_and_says_why() {
    let dir = test_dir("no-keyring");
    // A cluster that is never reached: the missing keyring is found first.
    let conf = dir.join("ceph.conf");
    std::fs::write(&conf, "[global]\nmon_host = 127.0.0.1:1\n").expect("conf");
    let keyring = dir.join("keyring");
    let mut r = Replica::start(
        &dir,
        "r1",
        &[
            "--store",
            "rados",
            "--ceph-conf",
            conf.to_str().expect("path"),
            "--keyring",
            keyring.to_str().expect("path"),
        ],
    );
    let reason = missing_keyring_reason(&keyring);
    // Not ready from the start ("connecting ..." for a moment on a loaded machine), then
    // with the reason.
    let body = r.until("/readyz", Duration::from_secs(20), |c, b| {
        c == 503 && !b.contains("connecting")
    });
    assert_eq!(
        body,
        format!("not ready: cannot open the group state in pool rbd: group state: {reason}\n")
    );
    assert_eq!(r.get("/healthz"), Some((200, "ok\n".into())));
    // Several attempts later (1 s, then 2 s apart) it still runs, and said it once.
    std::thread::sleep(Duration::from_millis(3500));
    r.still_running();
    assert_eq!(r.get("/healthz"), Some((200, "ok\n".into())));
    assert!(r.get("/readyz").is_some_and(|(c, _)| c == 503));
    let log = r.log_text();
    let said: Vec<&str> = log.lines().filter(|l| l.contains(&reason)).collect();
    assert_eq!(said.len(), 1, "the reason logged once:\n{log}");
    assert!(
        said[0].contains("ERROR") && said[0].contains("not ready: "),
        "{}",
        said[0]
    );
    // Nothing serves gRPC meanwhile: clients go to another replica.
    assert!(std::net::TcpStream::connect(&r.addr).is_err());
    let _ = std::fs::remove_dir_all(&dir);
}

/// A cluster that does not answer holds a connect attempt for client_mount_timeout (30 s):
/// the replica says it is connecting, and SIGTERM still ends it at once (within a Kubernetes
/// grace period), not when the attempt gives up.
#[test]
fn a_replica_connecting_to_a_silent_cluster_stops_promptly() {
    let dir = test_dir("silent");
    let conf = dir.join("ceph.conf");
    std::fs::write(&conf, "[global]\nmon_host = 127.0.0.1:1\n").expect("conf");
    let keyring = dir.join("keyring");
    // A well-formed key of no cluster: the attempt gets as far as dialling the monitors.
    std::fs::write(
        &keyring,
        "[client.admin]\n\tkey = AQAAAAAAAAAAABAAQkJCQkJCQkJCQkJCQkJCQg==\n",
    )
    .expect("keyring");
    let mut r = Replica::start(
        &dir,
        "r1",
        &[
            "--store",
            "rados",
            "--ceph-conf",
            conf.to_str().expect("path"),
            "--keyring",
            keyring.to_str().expect("path"),
        ],
    );
    let body = r.until("/readyz", Duration::from_secs(20), |c, _| c == 503);
    assert_eq!(
        body,
        "not ready: connecting to the Ceph cluster for the group state in pool rbd\n"
    );
    std::thread::sleep(Duration::from_secs(1));
    r.still_running();
    let signalled = Instant::now();
    assert!(Command::new("kill")
        .args(["-TERM", &r.child.id().to_string()])
        .status()
        .expect("kill")
        .success());
    let status = r.child.wait().expect("wait");
    let took = signalled.elapsed();
    assert!(status.success(), "{status}:\n{}", r.log_text());
    assert!(
        took < Duration::from_secs(5),
        "SIGTERM took {took:?} while connecting:\n{}",
        r.log_text()
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Against the micro Ceph (`scripts/micro-ceph.sh`'s environment): the keyring appears later,
/// the replica connects by itself and serves.
#[cfg(feature = "ceph-tests")]
#[test]
fn a_replica_becomes_ready_when_its_keyring_appears() {
    use control_plane::proto::admin_client::AdminClient;
    use control_plane::test_support::{ceph_conf, ceph_pool};

    let dir = test_dir("keyring-later");
    let source = std::env::var("CEPH_KEYRING").expect("CEPH_KEYRING (micro-ceph.sh's environment)");
    let keyring = dir.join("keyring");
    let group = format!("health-{}", std::process::id());
    let mut r = Replica::start(
        &dir,
        "r1",
        &[
            "--pool",
            &ceph_pool(),
            "--group",
            &group,
            "--ceph-conf",
            &ceph_conf(),
            "--keyring",
            keyring.to_str().expect("path"),
        ],
    );
    let reason = missing_keyring_reason(&keyring);
    // Its first answers may still say it is connecting: wait for the reason itself.
    let body = r.until("/readyz", Duration::from_secs(20), |c, b| {
        c == 503 && b.contains(&reason)
    });
    assert!(body.contains(&reason), "{body}");
    std::thread::sleep(Duration::from_secs(2));
    r.still_running();
    // The Secret is mounted: the file appears in place.
    std::fs::copy(&source, &keyring).expect("copy the keyring");
    let appeared = Instant::now();
    r.until("/readyz", Duration::from_secs(40), |c, b| {
        c == 200 && b == "ready\n"
    });
    println!(
        "ready {} ms after the keyring appeared",
        appeared.elapsed().as_millis()
    );
    assert!(r.log_text().contains("group state reached"));
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let channel = control_plane::test_support::plain_channel(&r.addr).await;
        AdminClient::new(channel)
            .gateway_list(control_plane::proto::Empty {})
            .await
            .expect("gRPC served once ready");
    });
    let _ = std::fs::remove_dir_all(&dir);
    let _ = Command::new("rados")
        .args(["-p", &ceph_pool(), "rm", &format!("nvmeof.{group}.state")])
        .output();
}
