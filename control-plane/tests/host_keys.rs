//! Hosts' DH-HMAC-CHAP keys in the control plane, with the in-process state backend: given
//! with `HostAdd`, changed and cleared with `HostChangeKey`, pushed to the gateways in their
//! assignment (`Subsystem.host_entries`; `hosts` keeps only the hosts without keys) and never
//! shown by a list, a refusal, `nvmeofctl` or the `nvmeof-control` log.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use control_plane::ana::Timing;
use control_plane::proto::admin_client::AdminClient;
use control_plane::proto::gateway_control_client::GatewayControlClient;
use control_plane::proto::{self, Assignment};
use control_plane::server::Options;
use control_plane::store::Store;
use control_plane::test_support::{self, plain_channel};
use nvme_auth::{DhchapSecret, HashFunction};
use tonic::Code;

mod common;

const NQN: &str = "nqn.2016-06.io.test:keys";
const PLAIN: &str = "nqn.2014-08.org.nvmexpress:uuid:0f0f0f0f-0000-0000-0000-0000000000c1";
const KEYED: &str = "nqn.2014-08.org.nvmexpress:uuid:0f0f0f0f-0000-0000-0000-0000000000c2";

/// A valid key, different for each `byte`.
fn key(byte: u8, transform: Option<HashFunction>) -> String {
    DhchapSecret::from_bytes(&[byte; 32], transform)
        .expect("32 bytes")
        .to_representation()
        .to_string()
}

/// The part of a key that would show if any of it were printed (its base64).
fn secret_part(key: &str) -> &str {
    &key[10..key.len() - 1]
}

/// Panics if `text` shows any of `keys`.
fn assert_no_key(text: &str, keys: &[&str], what: &str) {
    for k in keys {
        assert!(
            !text.contains(secret_part(k)),
            "{what} shows a key:\n{text}"
        );
    }
}

fn host(nqn: &str, host: &str, dhchap_key: &str, dhchap_ctrl_key: &str) -> proto::Host {
    proto::Host {
        subsystem_nqn: nqn.into(),
        host_nqn: host.into(),
        dhchap_key: dhchap_key.into(),
        dhchap_ctrl_key: dhchap_ctrl_key.into(),
        auth: String::new(),
    }
}

/// The next assignment on `stream` whose subsystem `NQN` satisfies `want`, within 5 s.
async fn next_assignment(
    stream: &mut tonic::Streaming<Assignment>,
    want: impl Fn(&proto::Subsystem) -> bool,
) -> proto::Subsystem {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let a = tokio::time::timeout(left, stream.message())
            .await
            .expect("the assignment in time")
            .expect("stream")
            .expect("an assignment");
        if let Some(s) = a.subsystems.iter().find(|s| s.nqn == NQN) {
            if want(s) {
                return s.clone();
            }
        }
    }
}

fn entry<'a>(s: &'a proto::Subsystem, host_nqn: &str) -> &'a proto::Host {
    s.host_entries
        .iter()
        .find(|h| h.host_nqn == host_nqn)
        .unwrap_or_else(|| panic!("{host_nqn} not in {s:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_reach_the_gateways_and_no_list() {
    let backend = test_support::memory_backend_with_images(Vec::new());
    let options = Options {
        timing: Timing {
            grace_ms: 120_000,
            failback_delay_ms: 0,
        },
        lease: Duration::from_secs(3),
        tick: Duration::from_millis(50),
    };
    let cp = test_support::start_replica(Store::new(backend), "test", options).await;
    let addr = test_support::serve_plain(cp.clone()).await;
    test_support::wait_for_lease(&cp, Duration::from_secs(5)).await;
    let mut a = AdminClient::new(plain_channel(&addr).await);
    let mut g = GatewayControlClient::new(plain_channel(&addr).await);
    g.send_beacon(proto::Beacon {
        gateway: "gw1".into(),
        ana_group: 1,
        incarnation: 1,
        ..Default::default()
    })
    .await
    .expect("beacon");
    let mut stream = g
        .join(proto::JoinRequest {
            gateway: "gw1".into(),
            incarnation: 1,
            presence_only: false,
        })
        .await
        .expect("join")
        .into_inner();
    a.subsystem_add(proto::SubsystemAddRequest {
        nqn: NQN.into(),
        ..Default::default()
    })
    .await
    .expect("subsystem");
    let (k1, c1, k2) = (
        key(0x11, Some(HashFunction::Sha256)),
        key(0x22, None),
        key(0x33, Some(HashFunction::Sha384)),
    );
    let keys = [k1.as_str(), c1.as_str(), k2.as_str()];
    a.host_add(host(NQN, PLAIN, "", "")).await.expect("plain");
    let added = a
        .host_add(host(NQN, KEYED, &k1, &c1))
        .await
        .expect("keyed")
        .into_inner();
    assert!(
        added.message.ends_with("(DH-HMAC-CHAP: bidirectional)"),
        "{}",
        added.message
    );

    // Pushed with its keys; `hosts` (what an older gateway reads) leaves it out.
    let s = next_assignment(&mut stream, |s| s.host_entries.len() == 2).await;
    assert_eq!(s.hosts, vec![PLAIN.to_string()]);
    let k = entry(&s, KEYED);
    assert_eq!(
        (k.dhchap_key.as_str(), k.dhchap_ctrl_key.as_str()),
        (k1.as_str(), c1.as_str())
    );
    assert_eq!(k.auth, "bidirectional");
    assert_eq!(entry(&s, PLAIN).auth, "none");
    assert!(entry(&s, PLAIN).dhchap_key.is_empty());
    assert_no_key(&format!("{s:?}"), &keys, "an assignment's Debug");

    // Lists say which hosts authenticate, never with what.
    let list = a
        .host_list(proto::HostListRequest {
            subsystem_nqn: NQN.into(),
        })
        .await
        .expect("host list")
        .into_inner();
    let listed: Vec<(&str, &str, &str, &str)> = list
        .hosts
        .iter()
        .map(|h| {
            (
                h.host_nqn.as_str(),
                h.auth.as_str(),
                h.dhchap_key.as_str(),
                h.dhchap_ctrl_key.as_str(),
            )
        })
        .collect();
    assert_eq!(
        listed,
        vec![(PLAIN, "none", "", ""), (KEYED, "bidirectional", "", "")]
    );
    let subsystems = a
        .subsystem_list(proto::Empty {})
        .await
        .expect("subsystem list")
        .into_inner();
    assert_eq!(subsystems.subsystems[0].host_entries.len(), 2);
    assert_no_key(&format!("{subsystems:?}"), &keys, "subsystem list");
    assert_no_key(
        &serde_json::to_string(&subsystems).expect("json"),
        &keys,
        "subsystem list JSON",
    );
    assert!(subsystems.subsystems[0]
        .host_entries
        .iter()
        .all(|h| h.dhchap_key.is_empty() && h.dhchap_ctrl_key.is_empty()));

    // Replaced: the host stays, the gateways get the new key.
    let version = list.version;
    let changed = a
        .host_change_key(host(NQN, KEYED, &k2, ""))
        .await
        .expect("change")
        .into_inner();
    assert!(
        changed.message.contains("changed (DH-HMAC-CHAP: host)"),
        "{}",
        changed.message
    );
    assert!(changed.version > version);
    let s = next_assignment(&mut stream, |s| entry(s, KEYED).dhchap_key == k2).await;
    assert_eq!(entry(&s, KEYED).dhchap_ctrl_key, "");
    assert_eq!(entry(&s, KEYED).auth, "host");

    // Refused with the field and why, never the key; nothing changes.
    let mut bad = k1.clone().into_bytes();
    bad[14] = if bad[14] == b'A' { b'B' } else { b'A' };
    let bad = String::from_utf8(bad).expect("ASCII");
    let refusals = [
        (
            host(NQN, KEYED, &bad, ""),
            Code::InvalidArgument,
            "invalid dhchap_key: the key's CRC-32",
        ),
        (
            host(NQN, KEYED, &k1, &bad),
            Code::InvalidArgument,
            "invalid dhchap_ctrl_key: the key's CRC-32",
        ),
        (
            host(NQN, KEYED, "", &c1),
            Code::InvalidArgument,
            "invalid dhchap_ctrl_key: needs a dhchap_key",
        ),
        (
            host(NQN, "nqn.2016-06.io.test:nobody", &k1, ""),
            Code::NotFound,
            "host nqn.2016-06.io.test:nobody not allowed",
        ),
        (
            host("nqn.2016-06.io.test:none", KEYED, &k1, ""),
            Code::NotFound,
            "subsystem nqn.2016-06.io.test:none not found",
        ),
    ];
    for (request, code, message) in refusals {
        let s = a.host_change_key(request).await.expect_err(message);
        assert_eq!(s.code(), code, "{}", s.message());
        assert!(s.message().starts_with(message), "{}", s.message());
        assert_no_key(s.message(), &[&k1, &c1, &bad], "a refusal");
    }
    let s = a
        .host_add(host(NQN, "nqn.2016-06.io.test:other", &bad, ""))
        .await
        .expect_err("bad key at add");
    assert_eq!(s.code(), Code::InvalidArgument);
    assert_no_key(s.message(), &[&bad], "a refusal");
    let now = a
        .host_list(proto::HostListRequest::default())
        .await
        .expect("list")
        .into_inner();
    assert_eq!(now.version, changed.version, "a refusal changed the state");
    assert_eq!(now.hosts.len(), 2);

    // Cleared: back in `hosts`, without keys.
    let cleared = a
        .host_change_key(host(NQN, KEYED, "", ""))
        .await
        .expect("clear")
        .into_inner();
    assert!(cleared.message.contains("cleared"), "{}", cleared.message);
    let s = next_assignment(&mut stream, |s| s.hosts.len() == 2).await;
    assert_eq!(entry(&s, KEYED).auth, "none");
    assert!(entry(&s, KEYED).dhchap_key.is_empty());
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

struct Daemon(std::process::Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `nvmeofctl --server ADDR ARGS` with `stdin` as its standard input.
fn ctl_stdin(addr: &str, args: &[&str], stdin: &str) -> (i32, String, String) {
    use std::io::Write;
    let mut child = common::nvmeofctl(&["--server", addr])
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run nvmeofctl");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(stdin.as_bytes())
        .expect("write stdin");
    let out = child.wait_with_output().expect("nvmeofctl output");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn write(dir: &Path, name: &str, text: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write a key file");
    path.to_string_lossy().into_owned()
}

/// The real binaries: `nvmeofctl host add` / `host change-key` with keys from files, standard
/// input or the command line; `host list` as a table and JSON; exit codes 0/1/2; and the
/// `nvmeof-control` log (debug level) with no key in it.
#[test]
fn nvmeofctl_takes_keys_from_files_and_never_prints_them() {
    let dir = std::env::temp_dir().join(format!("cp-host-keys-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let log = dir.join("nvmeof-control.log");
    let server = format!("127.0.0.1:{}", free_port());
    let _daemon = Daemon(
        Command::new(env!("CARGO_BIN_EXE_nvmeof-control"))
            .args([
                "--store",
                "memory",
                "--listen",
                &server,
                "--lease-ms",
                "600",
            ])
            .env("RUST_LOG", "debug")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log file"))
            .spawn()
            .expect("start nvmeof-control"),
    );
    let ctl = |args: &[&str]| common::ctl(&server, args);
    let started = Instant::now();
    loop {
        let (rc, _, err) = ctl(&["subsystem", "add", "--nqn", NQN]);
        if rc == 0 {
            break;
        }
        assert!(
            rc == 3 && started.elapsed() < Duration::from_secs(20),
            "subsystem add: exit {rc}: {err}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let (k1, c1, k2) = (
        key(0x44, Some(HashFunction::Sha512)),
        key(0x55, None),
        key(0x66, None),
    );
    let mut bad = k2.clone().into_bytes();
    bad[14] = if bad[14] == b'A' { b'B' } else { b'A' };
    let bad = String::from_utf8(bad).expect("ASCII");
    let keys = [k1.as_str(), c1.as_str(), k2.as_str(), bad.as_str()];
    // Files as `nvme gen-dhchap-key > FILE` writes them (with a newline).
    let k1_file = write(&dir, "host.key", &format!("{k1}\n"));
    let c1_file = write(&dir, "ctrl.key", &format!("{c1}\n"));
    let empty_file = write(&dir, "empty.key", "\n");
    let mut outputs = String::new();
    let mut run = |args: &[&str], stdin: Option<&str>| {
        let (rc, out, err) = match stdin {
            Some(text) => ctl_stdin(&server, args, text),
            None => ctl(args),
        };
        outputs.push_str(&out);
        outputs.push_str(&err);
        (rc, out, err)
    };

    let (rc, out, err) = run(
        &[
            "host",
            "add",
            "-n",
            NQN,
            "--host",
            KEYED,
            "--dhchap-key-file",
            &k1_file,
            "--dhchap-ctrl-key-file",
            &c1_file,
        ],
        None,
    );
    assert_eq!(rc, 0, "{err}");
    assert!(out.contains("(DH-HMAC-CHAP: bidirectional)"), "{out}");
    let (rc, _, err) = run(&["host", "add", "-n", NQN, "--host", PLAIN], None);
    assert_eq!(rc, 0, "{err}");

    let (rc, out, _) = run(&["host", "list", "-n", NQN], None);
    assert_eq!(rc, 0);
    let rows: Vec<Vec<&str>> = out
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(
        rows,
        vec![
            vec!["SUBSYSTEM", "HOST", "AUTH"],
            vec![NQN, PLAIN, "none"],
            vec![NQN, KEYED, "bidirectional"],
        ]
    );
    let (rc, out, _) = run(&["-o", "json", "host", "list"], None);
    assert_eq!(rc, 0);
    let v: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!(
        v["hosts"][1],
        serde_json::json!({"subsystem_nqn": NQN, "host_nqn": KEYED, "auth": "bidirectional"}),
        "{out}"
    );

    // change-key from standard input, then on the command line; none: cleared.
    let (rc, out, err) = run(
        &[
            "host",
            "change-key",
            "-n",
            NQN,
            "--host",
            KEYED,
            "--dhchap-key-file",
            "-",
        ],
        Some(&format!("{k2}\n")),
    );
    assert_eq!(rc, 0, "{err}");
    assert!(out.contains("changed (DH-HMAC-CHAP: host)"), "{out}");
    let (rc, out, _) = run(&["host", "list"], None);
    assert_eq!(rc, 0);
    assert!(
        out.lines()
            .any(|l| l.contains(KEYED) && l.ends_with(" host")),
        "{out}"
    );
    let (rc, out, err) = run(
        &[
            "host",
            "change-key",
            "-n",
            NQN,
            "--host",
            PLAIN,
            "--dhchap-key",
            &k1,
        ],
        None,
    );
    assert_eq!(rc, 0, "{err}");
    assert!(out.contains("changed (DH-HMAC-CHAP: host)"), "{out}");
    let (rc, out, err) = run(&["host", "change-key", "-n", NQN, "--host", PLAIN], None);
    assert_eq!(rc, 0, "{err}");
    assert!(out.contains("cleared"), "{out}");

    // Refused by the control plane: exit 1 with the field and why.
    let (rc, _, err) = run(
        &[
            "host",
            "change-key",
            "-n",
            NQN,
            "--host",
            KEYED,
            "--dhchap-key",
            &bad,
        ],
        None,
    );
    assert_eq!(rc, 1, "{err}");
    assert!(
        err.contains("invalid dhchap_key: the key's CRC-32 does not match"),
        "{err}"
    );
    let (rc, _, err) = run(
        &[
            "host",
            "add",
            "-n",
            NQN,
            "--host",
            "nqn.2016-06.io.test:h3",
            "--dhchap-ctrl-key-file",
            &c1_file,
        ],
        None,
    );
    assert_eq!(rc, 1, "{err}");
    assert!(
        err.contains("invalid dhchap_ctrl_key: needs a dhchap_key"),
        "{err}"
    );
    let (rc, _, err) = run(
        &[
            "host",
            "change-key",
            "-n",
            NQN,
            "--host",
            "nqn.2016-06.io.test:nobody",
            "--dhchap-key",
            &k1,
        ],
        None,
    );
    assert_eq!(rc, 1, "{err}");
    assert!(err.contains("not allowed"), "{err}");

    // Bad usage: exit 2, nothing sent.
    let usage: [&[&str]; 5] = [
        &[
            "host",
            "add",
            "-n",
            NQN,
            "--host",
            "nqn.2016-06.io.test:h4",
            "--dhchap-key",
            "",
        ],
        &[
            "host",
            "add",
            "-n",
            NQN,
            "--host",
            "nqn.2016-06.io.test:h4",
            "--dhchap-key-file",
            &empty_file,
        ],
        &[
            "host",
            "add",
            "-n",
            NQN,
            "--host",
            "nqn.2016-06.io.test:h4",
            "--dhchap-key-file",
            "/nonexistent/key",
        ],
        &[
            "host",
            "add",
            "-n",
            NQN,
            "--host",
            "nqn.2016-06.io.test:h4",
            "--dhchap-key",
            &k1,
            "--dhchap-key-file",
            &k1_file,
        ],
        &[
            "host",
            "change-key",
            "-n",
            NQN,
            "--host",
            KEYED,
            "--dhchap-key-file",
            "-",
            "--dhchap-ctrl-key-file",
            "-",
        ],
    ];
    for args in usage {
        let (rc, _, err) = run(args, Some(""));
        assert_eq!(rc, 2, "{args:?}: {err}");
    }
    let (rc, out, _) = run(&["host", "list"], None);
    assert_eq!(rc, 0);
    assert_eq!(out.lines().count(), 3, "only the two hosts: {out}");

    // Nothing printed a key (the command lines above carried some), and neither did the
    // control plane's log.
    assert_no_key(&outputs, &keys, "nvmeofctl's output");
    let text = std::fs::read_to_string(&log).expect("read the log");
    assert!(
        text.contains("host keys set"),
        "the log covers the changes:\n{text}"
    );
    assert_no_key(&text, &keys, "the nvmeof-control log");
    let _ = std::fs::remove_dir_all(&dir);
}
