//! Live reload of a standalone gateway's configuration (SIGHUP), with the gateway process and
//! the Rust host: a subsystem and a namespace are added, a host is added and another removed
//! (only its controllers close), a host's DH-HMAC-CHAP key changes (its connection stays, the
//! next authentication takes the new key), and bad files change nothing (the log says why,
//! the process keeps serving). A host connected to a subsystem the reloads do not touch keeps
//! its connection and its data through all of it. The real Linux host is in
//! tests/vm/e2e-auth.sh.

mod common;

use std::path::PathBuf;
use std::time::Duration;

use common::gateway_process::GatewayProcess;
use common::host::{try_connect, wait_for_namespaces, Attach, HostQueues};
use common::{free_port, loopback, pattern, poll_until, scrape, scratch_dir};
use nvmeof_gateway::auth::{DhchapSecret, HashFunction};
use nvmeof_gateway::host::HostError;

const UNTOUCHED: &str = "nqn.2016-06.io.ceph-nvmeof-rs:reload-untouched";
const AUTH: &str = "nqn.2016-06.io.ceph-nvmeof-rs:reload-auth";
const ADDED: &str = "nqn.2016-06.io.ceph-nvmeof-rs:reload-added";
const HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:c0000000-0000-0000-0000-00000000000c";
const KEYED: &str = "nqn.2014-08.org.nvmexpress:uuid:a0000000-0000-0000-0000-00000000000a";
const PLAIN: &str = "nqn.2014-08.org.nvmexpress:uuid:b0000000-0000-0000-0000-00000000000b";
const LATE: &str = "nqn.2014-08.org.nvmexpress:uuid:d0000000-0000-0000-0000-00000000000d";

fn key(byte: u8) -> DhchapSecret {
    DhchapSecret::from_bytes(&[byte; 32], Some(HashFunction::Sha256)).expect("32 bytes")
}

/// What the test's configuration files vary.
#[derive(Clone)]
struct Layout {
    /// The key of KEYED on AUTH.
    keyed_key: u8,
    /// PLAIN allowed on AUTH.
    plain: bool,
    /// LATE allowed on AUTH.
    late: bool,
    /// Namespace 2 of UNTOUCHED's neighbour AUTH.
    auth_ns2: bool,
    /// The subsystem ADDED.
    added: bool,
    /// `[gateway] name`.
    name: &'static str,
}

fn config(port: u16, metrics_port: u16, l: &Layout) -> String {
    let mut hosts = vec![format!(
        "{{ nqn = \"{KEYED}\", dhchap_key = \"{}\" }}",
        key(l.keyed_key).to_representation().as_str()
    )];
    if l.plain {
        hosts.push(format!("\"{PLAIN}\""));
    }
    if l.late {
        hosts.push(format!("\"{LATE}\""));
    }
    let mut text = format!(
        r#"
[gateway]
name = "{name}"
metrics_listen = "127.0.0.1:{metrics_port}"

[[listener]]
transport = "tcp"
address = "127.0.0.1"
port = {port}

[[subsystem]]
nqn = "{UNTOUCHED}"
allow_any_host = true

[[subsystem.namespace]]
nsid = 1
backend = "memory"
size = "16MiB"

[[subsystem]]
nqn = "{AUTH}"
hosts = [{hosts}]

[[subsystem.namespace]]
nsid = 1
backend = "memory"
size = "16MiB"
"#,
        name = l.name,
        hosts = hosts.join(", "),
    );
    if l.auth_ns2 {
        text.push_str(
            r#"
[[subsystem.namespace]]
nsid = 2
backend = "memory"
size = "8MiB"
"#,
        );
    }
    if l.added {
        text.push_str(&format!(
            r#"
[[subsystem]]
nqn = "{ADDED}"
allow_any_host = true

[[subsystem.namespace]]
nsid = 1
backend = "memory"
size = "16MiB"
"#
        ));
    }
    text
}

struct Gateway {
    process: GatewayProcess,
    path: PathBuf,
    port: u16,
    metrics_port: u16,
}

impl Gateway {
    async fn start(name: &str, layout: &Layout) -> Gateway {
        let dir = scratch_dir(&format!("nvmeof-reload-{}-{name}", std::process::id()));
        let (port, metrics_port) = (free_port(), free_port());
        let process =
            GatewayProcess::spawn(&dir, "gateway", port, &config(port, metrics_port, layout));
        process.wait_for_metrics(metrics_port).await;
        process.wait_for_listener().await;
        Gateway {
            process,
            path: dir.join("gateway.toml"),
            port,
            metrics_port,
        }
    }

    fn outcomes(&self) -> Vec<String> {
        self.process
            .log_text()
            .lines()
            .filter(|l| {
                l.contains("configuration reloaded") || l.contains("configuration reload refused")
            })
            .map(str::to_owned)
            .collect()
    }

    /// Writes `text` as the configuration file (whole, by a rename), sends SIGHUP and
    /// returns the reload's outcome line.
    async fn reload_text(&self, text: &str) -> String {
        let before = self.outcomes().len();
        let tmp = self.path.with_extension("toml.new");
        std::fs::write(&tmp, text).expect("write the new configuration");
        std::fs::rename(&tmp, &self.path).expect("replace the configuration");
        self.process.signal("-HUP");
        poll_until(
            Duration::from_secs(20),
            Duration::from_millis(50),
            async || match self.outcomes().get(before) {
                Some(line) => Ok(line.clone()),
                None => Err(format!(
                    "no reload outcome logged after SIGHUP:\n{}",
                    self.process.log_text()
                )),
            },
        )
        .await
    }

    async fn reload(&self, layout: &Layout) -> String {
        self.reload_text(&config(self.port, self.metrics_port, layout))
            .await
    }

    fn reloads(&self, result: &str) -> f64 {
        scrape(
            self.metrics_port,
            &format!("nvmeof_config_reloads_total{{result=\"{result}\"}}"),
        )
        .unwrap_or(-1.0)
    }
}

fn attach(host: &str, subnqn: &str, secret: Option<DhchapSecret>) -> Attach {
    let mut a = Attach::new(host, subnqn);
    a.command_timeout = Duration::from_secs(10);
    a.dhchap_secret = secret;
    a
}

/// Where a host writes the data of `seed` in namespace 1 (hosts of one subsystem share it).
fn lba_of(seed: u8) -> u64 {
    u64::from(seed) * 8
}

/// Reads back what `seed` wrote in namespace 1, then writes it again: the connection works
/// and kept its data.
async fn still_works(q: &HostQueues, seed: u8, what: &str) {
    let data = pattern(4096, seed);
    match q.io.read(1, lba_of(seed), 8, 512).await {
        Ok(got) => assert!(got == data, "{what}: read back other data"),
        Err(e) => panic!("{what}: read: {e}"),
    }
    q.io.write(1, lba_of(seed), data, 512)
        .await
        .unwrap_or_else(|e| panic!("{what}: write: {e}"));
}

async fn write_seed(q: &HostQueues, seed: u8) {
    q.io.write(1, lba_of(seed), pattern(4096, seed), 512)
        .await
        .expect("write");
}

#[tokio::test]
async fn sighup_applies_the_file_and_keeps_untouched_connections() {
    let first = Layout {
        keyed_key: 0x11,
        plain: true,
        late: false,
        auth_ns2: false,
        added: false,
        name: "reload",
    };
    let gw = Gateway::start("main", &first).await;
    let addr = loopback(gw.port);

    // Connected before any reload: to the untouched subsystem, and to AUTH.
    let untouched = try_connect(addr, &attach(HOST, UNTOUCHED, None))
        .await
        .expect("connect to the untouched subsystem");
    write_seed(&untouched, 7).await;
    let keyed = try_connect(addr, &attach(KEYED, AUTH, Some(key(0x11))))
        .await
        .expect("KEYED with its key");
    write_seed(&keyed, 8).await;
    let plain = try_connect(addr, &attach(PLAIN, AUTH, None))
        .await
        .expect("PLAIN");
    write_seed(&plain, 9).await;
    assert!(
        try_connect(addr, &attach(HOST, ADDED, None)).await.is_err(),
        "ADDED is not served before the reload"
    );

    // 1. A subsystem and a namespace added.
    let second = Layout {
        added: true,
        auth_ns2: true,
        ..first.clone()
    };
    let line = gw.reload(&second).await;
    assert!(line.contains("configuration reloaded"), "{line}");
    let added = try_connect(addr, &attach(HOST, ADDED, None))
        .await
        .expect("the added subsystem serves");
    write_seed(&added, 1).await;
    wait_for_namespaces(&keyed.admin, &[1, 2]).await;
    still_works(&keyed, 8, "KEYED on AUTH after a namespace was added").await;
    still_works(&untouched, 7, "the untouched subsystem after step 1").await;

    // 2. PLAIN removed, LATE added, KEYED's key changed.
    assert!(
        try_connect(addr, &attach(LATE, AUTH, None)).await.is_err(),
        "LATE is not allowed yet"
    );
    let third = Layout {
        keyed_key: 0x33,
        plain: false,
        late: true,
        ..second.clone()
    };
    let line = gw.reload(&third).await;
    assert!(line.contains("configuration reloaded"), "{line}");
    let log = gw.process.log_text();
    assert!(
        log.contains("DH-HMAC-CHAP keys changed in the configuration file"),
        "the key change is logged:\n{log}"
    );
    assert!(
        !log.contains(&key(0x33).to_representation().as_str()[10..30]),
        "no key in the log"
    );
    // PLAIN's controller is closed, only it.
    let plain_io = plain.io.read(1, lba_of(9), 8, 512).await;
    assert!(
        plain_io.is_err(),
        "PLAIN's I/O after its removal: {plain_io:?}"
    );
    assert!(
        try_connect(addr, &attach(PLAIN, AUTH, None)).await.is_err(),
        "PLAIN is refused after its removal"
    );
    still_works(
        &keyed,
        8,
        "KEYED keeps its connection through its key change",
    )
    .await;
    let late = try_connect(addr, &attach(LATE, AUTH, None))
        .await
        .expect("LATE allowed after the reload");
    drop(late);
    match try_connect(addr, &attach(KEYED, AUTH, Some(key(0x11)))).await {
        Err(HostError::Authentication(_)) => {}
        other => panic!(
            "KEYED with its old key: expected an authentication failure, got {:?}",
            other.map(|_| ())
        ),
    }
    try_connect(addr, &attach(KEYED, AUTH, Some(key(0x33))))
        .await
        .expect("KEYED with its new key");
    still_works(&added, 1, "the added subsystem after step 2").await;
    still_works(&untouched, 7, "the untouched subsystem after step 2").await;
    assert_eq!(gw.reloads("applied"), 2.0);

    // 3. Bad files change nothing: not TOML, an invalid value, a setting that cannot change
    // live (with a change that could: not applied either).
    let line = gw.reload_text("[[subsystem]\nnqn = ").await;
    assert!(line.contains("configuration reload refused"), "{line}");
    assert!(line.contains("gateway.toml"), "names the file: {line}");
    let mut bad = config(gw.port, gw.metrics_port, &third);
    bad.push_str("\n[[subsystem]]\nnqn = \"nqn.2016-06.io.ceph-nvmeof-rs:bad\"\nallow_any_host = true\nhosts = [\"nqn.2014-08.org.nvmexpress:uuid:e0000000-0000-0000-0000-00000000000e\"]\n");
    let line = gw.reload_text(&bad).await;
    assert!(
        line.contains("configuration reload refused") && line.contains("allow_any_host"),
        "{line}"
    );
    let renamed = Layout {
        name: "another-name",
        plain: true,
        ..third.clone()
    };
    let line = gw.reload(&renamed).await;
    assert!(
        line.contains("configuration reload refused")
            && line.contains("cannot change without a restart: gateway.name"),
        "{line}"
    );
    assert!(
        try_connect(addr, &attach(PLAIN, AUTH, None)).await.is_err(),
        "the refused file's host was not allowed"
    );
    assert_eq!(gw.reloads("refused"), 3.0);
    assert_eq!(gw.reloads("applied"), 2.0);

    // 4. The same file as in force: nothing to do.
    let line = gw.reload(&third).await;
    assert!(line.contains("nothing changed"), "{line}");
    assert_eq!(gw.reloads("unchanged"), 1.0);
    let stamp = scrape(
        gw.metrics_port,
        "nvmeof_config_last_reload_success_timestamp_seconds",
    )
    .expect("timestamp");
    assert!(stamp > 1.7e9, "last success timestamp {stamp}");

    still_works(&untouched, 7, "the untouched subsystem after the bad files").await;
    still_works(&keyed, 8, "KEYED after the bad files").await;
    let untouched_again = try_connect(addr, &attach(HOST, UNTOUCHED, None))
        .await
        .expect("new connections still accepted");
    drop(untouched_again);
}

/// `[ceph]` with an empty cluster configuration (no monitor): an RBD image cannot open.
fn no_cluster(dir: &std::path::Path) -> String {
    let conf = dir.join("empty-ceph.conf");
    std::fs::write(&conf, "").expect("write an empty ceph.conf");
    format!("\n[ceph]\nconf = \"{}\"\n", conf.display())
}

#[tokio::test]
async fn a_namespace_that_does_not_open_refuses_the_whole_reload() {
    let first = Layout {
        keyed_key: 0x11,
        plain: true,
        late: false,
        auth_ns2: false,
        added: false,
        name: "reload",
    };
    let dir = scratch_dir(&format!("nvmeof-reload-{}-open", std::process::id()));
    let (port, metrics_port) = (free_port(), free_port());
    let no_cluster = no_cluster(&dir);
    let start = config(port, metrics_port, &first) + &no_cluster;
    let process = GatewayProcess::spawn(&dir, "gateway", port, &start);
    process.wait_for_metrics(metrics_port).await;
    process.wait_for_listener().await;
    let gw = Gateway {
        process,
        path: dir.join("gateway.toml"),
        port,
        metrics_port,
    };
    let untouched = try_connect(loopback(port), &attach(HOST, UNTOUCHED, None))
        .await
        .expect("connect");
    write_seed(&untouched, 3).await;
    // ADDED with a memory namespace and one whose RBD image cannot be opened: nothing at all
    // is added, and the log names the namespace's field.
    let added = Layout {
        added: true,
        ..first.clone()
    };
    let text = config(port, metrics_port, &added)
        + "\n[[subsystem.namespace]]\nnsid = 2\nbackend = \"rbd\"\npool = \"rbd\"\nimage = \"missing\"\n"
        + &no_cluster;
    let line = gw.reload_text(&text).await;
    assert!(
        line.contains("configuration reload refused")
            && line.contains("subsystem[2].namespace[1]")
            && line.contains("cannot be opened"),
        "{line}"
    );
    assert!(
        try_connect(loopback(port), &attach(HOST, ADDED, None))
            .await
            .is_err(),
        "nothing added"
    );
    // Without [ceph]: a setting that cannot change live.
    let line = gw.reload(&first).await;
    assert!(
        line.contains("configuration reload refused")
            && line.contains("cannot change without a restart: ceph.conf"),
        "{line}"
    );
    assert_eq!(gw.reloads("refused"), 2.0);
    still_works(
        &untouched,
        3,
        "the untouched subsystem through the refusals",
    )
    .await;
    // The gateway's own files go with it; this one is the test's.
    drop(gw);
    let _ = std::fs::remove_file(dir.join("empty-ceph.conf"));
    let _ = std::fs::remove_dir(&dir);
}
