//! In-band authentication (DH-HMAC-CHAP) of a gateway process over NVMe/TCP, with the Rust
//! host: a host with its key attaches and does I/O (each queue authenticated, the gateway
//! proving itself when asked), wrong or missing keys are refused without harming anyone
//! else, digests carry the transaction, and the metrics count the outcomes. The real Linux
//! host is in tests/vm/e2e-auth.sh.

mod common;

use std::time::Duration;

use common::gateway_process::GatewayProcess;
use common::host::{try_connect, Attach};
use common::{free_port, http_exchange, loopback, metric_value, pattern, scratch_dir};
use nvmeof_gateway::auth::{DhchapSecret, HashFunction};
use nvmeof_gateway::host::{HostConnection, HostError};

const SUBNQN: &str = "nqn.2016-06.io.ceph-nvmeof-rs:auth";
const KEYED: &str = "nqn.2014-08.org.nvmexpress:uuid:a0000000-0000-0000-0000-00000000000a";
const PLAIN: &str = "nqn.2014-08.org.nvmexpress:uuid:b0000000-0000-0000-0000-00000000000b";

fn secret(byte: u8, transform: Option<HashFunction>) -> DhchapSecret {
    DhchapSecret::from_bytes(&[byte; 32], transform).expect("32 bytes")
}

fn host_key() -> DhchapSecret {
    secret(0x11, Some(HashFunction::Sha256))
}

fn ctrl_key() -> DhchapSecret {
    secret(0x22, None)
}

/// A gateway whose subsystem allows KEYED (with keys) and PLAIN (without), with
/// `gateway_lines` in `[gateway]`; returns it with its NVMe/TCP and metrics ports.
async fn spawn(name: &str, gateway_lines: &str) -> (GatewayProcess, u16, u16) {
    let dir = scratch_dir(&format!("nvmeof-auth-{}-{name}", std::process::id()));
    let (port, metrics_port) = (free_port(), free_port());
    let config = format!(
        r#"
        [gateway]
        metrics_listen = "127.0.0.1:{metrics_port}"
        {gateway_lines}

        [[listener]]
        transport = "tcp"
        address = "127.0.0.1"
        port = {port}

        [[subsystem]]
        nqn = "{SUBNQN}"
        hosts = [
            {{ nqn = "{KEYED}", dhchap_key = "{}", dhchap_ctrl_key = "{}" }},
            "{PLAIN}",
        ]

        [[subsystem.namespace]]
        nsid = 1
        backend = "memory"
        size = "16MiB"
        "#,
        host_key().to_representation().as_str(),
        ctrl_key().to_representation().as_str(),
    );
    let gateway = GatewayProcess::spawn(&dir, name, port, &config);
    gateway.wait_for_metrics(metrics_port).await;
    gateway.wait_for_listener().await;
    (gateway, port, metrics_port)
}

fn attach(host: &str, secret: Option<DhchapSecret>, ctrl: Option<DhchapSecret>) -> Attach {
    let mut a = Attach::new(host, SUBNQN);
    a.command_timeout = Duration::from_secs(10);
    a.dhchap_secret = secret;
    a.dhchap_ctrl_secret = ctrl;
    a
}

async fn round_trip(port: u16, a: &Attach, seed: u8) -> Result<(), HostError> {
    let host = try_connect(loopback(port), a).await?;
    let data = pattern(8192, seed);
    host.io.write(1, 8, data.clone(), 512).await?;
    assert_eq!(host.io.read(1, 8, 16, 512).await?, data);
    Ok(())
}

fn authenticated_lines(gateway: &GatewayProcess) -> Vec<String> {
    gateway
        .log_text()
        .lines()
        .filter(|l| l.contains("queue authenticated"))
        .map(str::to_owned)
        .collect()
}

fn expect_refused(result: Result<(), HostError>, what: &str) -> String {
    match result {
        Err(HostError::Authentication(why)) => why,
        other => panic!("{what}: expected an authentication failure, got {other:?}"),
    }
}

#[tokio::test]
async fn hosts_authenticate_each_queue_and_wrong_keys_are_refused() {
    let (mut gateway, port, metrics_port) = spawn("main", "").await;

    // The right key, and the gateway proving itself with its key: admin and I/O queue.
    round_trip(port, &attach(KEYED, Some(host_key()), Some(ctrl_key())), 1)
        .await
        .expect("the keyed host with its keys");
    let lines = authenticated_lines(&gateway);
    assert_eq!(lines.len(), 2, "admin and I/O queue: {lines:?}");
    for (line, qid) in lines.iter().zip(["qid=0", "qid=1"]) {
        for field in [
            qid,
            "hash=sha512",
            "dhgroup=ffdhe2048",
            "bidirectional=true",
        ] {
            assert!(line.contains(field), "{field} in {line}");
        }
    }

    // A wrong key, a wrong controller key, no key at all.
    let why = expect_refused(
        round_trip(port, &attach(KEYED, Some(secret(0x12, None)), None), 2).await,
        "wrong host key",
    );
    assert!(why.contains("refused: failed"), "{why}");
    let why = expect_refused(
        round_trip(
            port,
            &attach(KEYED, Some(host_key()), Some(secret(0x23, None))),
            3,
        )
        .await,
        "wrong controller key",
    );
    assert!(why.contains("controller's response is wrong"), "{why}");
    let why = expect_refused(
        round_trip(port, &attach(KEYED, None, None), 4).await,
        "no key",
    );
    assert!(why.contains("no secret"), "{why}");

    // Without the transaction, nothing but Authentication Send/Receive runs.
    let bare = HostConnection::connect(loopback(port), attach(KEYED, None, None).options())
        .await
        .expect("tcp");
    bare.connect_admin(SUBNQN, 0)
        .await
        .expect_err("no secret to answer ATR with");
    let refused = bare
        .enable_controller()
        .await
        .expect_err("not authenticated");
    match refused {
        HostError::Nvme(c) => assert_eq!((c.sct(), c.sc(), c.dnr()), (1, 0x91, true)),
        other => panic!("expected Authentication Required, got {other:?}"),
    }

    // A host without a key is not asked, even with one at hand; the keyed one still works.
    round_trip(port, &attach(PLAIN, Some(host_key()), None), 5)
        .await
        .expect("a host allowed without a key");
    round_trip(port, &attach(KEYED, Some(host_key()), None), 6)
        .await
        .expect("one-way authentication");
    assert_eq!(authenticated_lines(&gateway).len(), 4);

    let answer = http_exchange(
        loopback(metrics_port),
        b"GET /metrics HTTP/1.1\r\nHost: gw\r\n\r\n",
    );
    assert_eq!(
        metric_value(&answer, "nvmeof_auth_successes_total"),
        Some(4.0)
    );
    assert_eq!(
        metric_value(&answer, "nvmeof_auth_failures_total{reason=\"failed\"}"),
        Some(2.0),
        "the wrong host key, and the host that refused the gateway's response"
    );
    assert!(gateway.log_text().contains("authentication failed"));
    assert!(gateway.terminate().success());
}

/// Digests over every PDU of the transaction; the largest group, whose key exchange runs
/// off the runtime's I/O path (one worker thread here, so it would stall it otherwise).
#[tokio::test]
async fn digests_and_the_largest_group_with_one_worker() {
    let (mut gateway, port, _) = spawn(
        "ffdhe8192",
        "worker_threads = 1\ndhchap_dhgroups = [\"ffdhe8192\"]\ndhchap_hashes = [\"sha384\"]",
    )
    .await;
    let mut a = attach(KEYED, Some(host_key()), Some(ctrl_key()));
    a.io_sqsize = 7;
    let mut opts = a.options();
    opts.header_digest = true;
    opts.data_digest = true;
    let admin = HostConnection::connect(loopback(port), opts.clone())
        .await
        .expect("tcp");
    let cntlid = admin
        .connect_admin(SUBNQN, 30_000)
        .await
        .expect("admin authenticated");
    admin.enable_controller().await.expect("enable");
    let io = HostConnection::connect(loopback(port), opts)
        .await
        .expect("tcp");
    io.connect_io(SUBNQN, cntlid, 1, 7)
        .await
        .expect("io authenticated");
    let data = pattern(4096, 9);
    io.write(1, 0, data.clone(), 512).await.expect("write");
    assert_eq!(io.read(1, 0, 8, 512).await.expect("read"), data);
    let lines = authenticated_lines(&gateway);
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert!(lines
        .iter()
        .all(|l| l.contains("dhgroup=ffdhe8192") && l.contains("hash=sha384")));
    assert!(gateway.terminate().success());
}
