//! `nvmeofctl`'s output, to the byte: every subcommand's table and JSON against an in-process
//! control plane (in-memory state), compared with `cli_output.golden`. The times in the output
//! (a beacon's age, how long add-many took) and the state versions are masked; everything else is compared as is.

use std::time::Duration;

use control_plane::ana::Timing;
use control_plane::proto::{self, gateway_control_client::GatewayControlClient};
use control_plane::server::Options;
use control_plane::store::Store;
use control_plane::test_support;

mod common;

const NQN: &str = "nqn.2016-06.io.test:output";
const GOLDEN: &str = include_str!("cli_output.golden");

async fn start() -> String {
    let images = [
        "rbd/img1",
        "rbd/ns1/img2",
        "rbd/img3",
        "rbd/img4",
        "rbd/img5",
    ]
    .map(String::from);
    let backend = test_support::memory_backend_with_images(images);
    // A long grace: no gateway is declared dead while the test runs on a busy machine.
    let options = Options {
        timing: Timing {
            grace_ms: 120_000,
            failback_delay_ms: 0,
        },
        ..Options::default()
    };
    let cp = test_support::start_replica(Store::new(backend), "test", options).await;
    test_support::wait_for_lease(&cp, Duration::from_secs(10)).await;
    test_support::serve_plain(cp).await
}

async fn beacon(addr: &str, gw: &str, group: u32) {
    GatewayControlClient::new(test_support::plain_channel(addr).await)
        .send_beacon(proto::Beacon {
            gateway: gw.into(),
            ana_group: group,
            incarnation: 1,
            client_addrs: vec![format!("10.0.0.{group}:0/1")],
            applied_version: 0,
            connections: vec![proto::Connection {
                gateway: String::new(),
                subsystem_nqn: NQN.into(),
                host_nqn: host(group),
                cntlid: group * 2040 - 2039,
                io_queues: 2,
                // One host over TLS, one in clear: the TLS column shows both.
                secure: group == 1,
            }],
            cluster: 0,
            osds_unanswered: vec![],
            osd_probe: None,
        })
        .await
        .expect("beacon");
}

fn host(i: u32) -> String {
    format!("nqn.2014-08.org.nvmexpress:uuid:0f0f0f0f-0000-0000-0000-00000000000{i}")
}

/// Replaces what depends on time: `<digits> ms ago` (and the padding after it, which depends
/// on the digits' width), `"last_beacon_ms_ago": <digits>`, add-many's `in <seconds> s`, and
/// state versions.
fn mask_times(text: &str) -> String {
    text.lines()
        .map(|line| {
            let mut line = line.to_string();
            if let Some(at) = line.find(" ms ago") {
                let digits = line[..at]
                    .trim_end_matches(|c: char| c.is_ascii_digit())
                    .len();
                let rest = line[at + " ms ago".len()..].trim_start().to_string();
                line = format!("{}<N> ms ago {rest}", &line[..digits])
                    .trim_end()
                    .to_string();
            }
            if let Some(at) = line.find("\"last_beacon_ms_ago\": ") {
                let start = at + "\"last_beacon_ms_ago\": ".len();
                let end = line[start..]
                    .find(|c: char| !c.is_ascii_digit())
                    .map_or(line.len(), |e| start + e);
                line.replace_range(start..end, "<N>");
            }
            // How many writes the leader makes on its own (lease, ANA groups) depends on timing.
            for key in ["(state version ", "\"version\": "] {
                if let Some(at) = line.find(key) {
                    let start = at + key.len();
                    let end = line[start..]
                        .find(|c: char| !c.is_ascii_digit())
                        .map_or(line.len(), |e| start + e);
                    line.replace_range(start..end, "<V>");
                }
            }
            if let (Some(at), Some(end)) = (line.find(" in "), line.find(" s (state version")) {
                if at < end {
                    line.replace_range(at + " in ".len()..end, "<T>");
                }
            }
            line
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The UUID img1 is added with (`namespace add --uuid`): shown as is.
const NAMED_UUID: &str = "5b3e8d2a-6f1c-4e7a-9d0b-1c2e3f4a5b6c";

/// Replaces each random (version 4) namespace identity in `text`, as a UUID or as the NGUID
/// of the same bytes, with `<IDn>`, n in order of first appearance over the whole transcript
/// (`seen`), so the golden shows which NGUID and UUID belong together; the named UUID and
/// the hosts' NQN UUIDs (not version 4) stay.
fn mask_random_ids(text: &str, seen: &mut Vec<String>) -> String {
    let mut out = String::with_capacity(text.len());
    let mut token = String::new();
    let mut flush = |token: &mut String, out: &mut String| {
        let random = uuid::Uuid::try_parse(token)
            .ok()
            .filter(|u| u.get_version_num() == 4 && u.hyphenated().to_string() != NAMED_UUID)
            .map(|u| u.simple().to_string());
        match random {
            Some(id) if token.len() == 32 || token.len() == 36 => {
                let n = match seen.iter().position(|s| *s == id) {
                    Some(i) => i + 1,
                    None => {
                        seen.push(id);
                        seen.len()
                    }
                };
                out.push_str(&format!("<ID{n}>"));
            }
            _ => out.push_str(token),
        }
        token.clear();
    };
    for c in text.chars() {
        if c.is_ascii_hexdigit() || c == '-' {
            token.push(c);
        } else {
            flush(&mut token, &mut out);
            out.push(c);
        }
    }
    flush(&mut token, &mut out);
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_subcommand_prints_the_same_tables_and_json() {
    let addr = start().await;
    let many = std::env::temp_dir().join(format!("cli-output-{}.txt", std::process::id()));
    std::fs::write(&many, "img3 5\nimg4\n").expect("add-many file");
    let many = many.to_string_lossy().into_owned();
    // DH-HMAC-CHAP keys and a TLS PSK: given on the command line here, masked in the
    // transcript's command lines (KEY1, KEY2; KEY3 the PSK); no output may show them.
    let mut keys: Vec<String> = [0x11u8, 0x22]
        .iter()
        .map(|&b| {
            nvme_auth::DhchapSecret::from_bytes(&[b; 32], None)
                .expect("32 bytes")
                .to_representation()
                .to_string()
        })
        .collect();
    keys.push(
        nvme_auth::tls_psk::ConfiguredPsk::from_bytes(&[0x33; 32], None)
            .expect("32 bytes")
            .to_interchange()
            .to_string(),
    );
    let mut transcript = String::new();
    let mut ids_seen = Vec::new();
    let mut ctl = |args: &[&str]| {
        let out = common::nvmeofctl(&["--server", &addr])
            .args(args)
            .output()
            .expect("run nvmeofctl");
        let mut args = args.join(" ").replace(&many, "FILE");
        for (i, k) in keys.iter().enumerate() {
            args = args.replace(k.as_str(), &format!("KEY{}", i + 1));
        }
        transcript.push_str(&format!(
            "$ nvmeofctl {args}\n{}\n[stderr] {}[exit {}]\n",
            mask_random_ids(
                &mask_times(&String::from_utf8_lossy(&out.stdout)),
                &mut ids_seen
            ),
            String::from_utf8_lossy(&out.stderr),
            out.status.code().unwrap_or(-1)
        ));
    };
    for output in ["table", "json"] {
        ctl(&["-o", output, "gateway", "list"]);
        ctl(&["-o", output, "connection", "list"]);
        ctl(&["-o", output, "ana", "show"]);
    }
    beacon(&addr, "gw1", 1).await;
    beacon(&addr, "gw2", 2).await;
    // After the beacons: the state's version no longer depends on when the lease was taken.
    for output in ["table", "json"] {
        ctl(&["-o", output, "subsystem", "list"]);
        ctl(&["-o", output, "namespace", "list"]);
        ctl(&["-o", output, "listener", "list"]);
        ctl(&["-o", output, "host", "list"]);
    }
    ctl(&["subsystem", "add", "--nqn", NQN, "--serial", "SN1"]);
    #[rustfmt::skip]
    ctl(&["-o", "json", "subsystem", "add", "--nqn", &format!("{NQN}-2"), "--allow-any-host", "--max-namespaces", "8"]);
    ctl(&[
        "namespace",
        "add",
        "-n",
        NQN,
        "--image",
        "img1",
        "--uuid",
        NAMED_UUID,
    ]);
    #[rustfmt::skip]
    ctl(&["-o", "json", "namespace", "add", "-n", NQN, "--rados-namespace", "ns1", "--image", "img2", "--ana-group", "1"]);
    ctl(&["namespace", "add-many", "-n", NQN, "--file", &many]);
    ctl(&[
        "namespace",
        "move",
        "-n",
        NQN,
        "--nsid",
        "1",
        "--ana-group",
        "2",
    ]);
    ctl(&[
        "namespace",
        "resize",
        "-n",
        NQN,
        "--nsid",
        "2",
        "--size",
        "2GiB",
    ]);
    #[rustfmt::skip]
    ctl(&["listener", "add", "-n", NQN, "-g", "gw1", "-a", "10.0.0.1"]);
    #[rustfmt::skip]
    ctl(&["-o", "json", "listener", "add", "-n", NQN, "-g", "gw2", "-a", "10.0.0.2", "-p", "4421"]);
    ctl(&["host", "add", "-n", NQN, "--host", &host(1)]);
    ctl(&["host", "add", "-n", NQN, "--host", &host(2)]);
    #[rustfmt::skip]
    ctl(&["host", "add", "-n", NQN, "--host", &host(3), "--dhchap-key", &keys[0], "--dhchap-ctrl-key", &keys[1]]);
    #[rustfmt::skip]
    ctl(&["host", "change-key", "-n", NQN, "--host", &host(2), "--dhchap-key", &keys[1]]);
    // TLS: a subsystem that requires it, a secure listener, a host with a PSK.
    ctl(&[
        "subsystem",
        "add",
        "--nqn",
        &format!("{NQN}-3"),
        "--require-tls",
    ]);
    #[rustfmt::skip]
    ctl(&["listener", "add", "-n", NQN, "-g", "gw1", "-a", "10.0.0.3", "--secure"]);
    #[rustfmt::skip]
    ctl(&["host", "add", "-n", NQN, "--host", &host(4), "--psk", &keys[2], "--psk-derivation", "libnvme-compat"]);
    // Requiring TLS later: the reply names the host connected without it (host 2, on gw2);
    // then off again on the other subsystem; no setting is bad usage.
    #[rustfmt::skip]
    ctl(&["subsystem", "set", "--nqn", NQN, "--require-tls", "true"]);
    #[rustfmt::skip]
    ctl(&["-o", "json", "subsystem", "set", "--nqn", &format!("{NQN}-3"), "--require-tls", "false"]);
    ctl(&["subsystem", "set", "--nqn", NQN]);
    // Per-host visibility: a namespace for host 1 and a host not allowed yet; the refusals.
    ctl(&[
        "namespace",
        "add",
        "-n",
        NQN,
        "--image",
        "img5",
        "--no-auto-visible",
    ]);
    ctl(&[
        "namespace",
        "add-host",
        "-n",
        NQN,
        "--nsid",
        "4",
        "--host",
        &host(1),
    ]);
    ctl(&[
        "-o",
        "json",
        "namespace",
        "add-host",
        "-n",
        NQN,
        "--nsid",
        "4",
        "--host",
        &host(9),
    ]);
    ctl(&[
        "namespace",
        "add-host",
        "-n",
        NQN,
        "--nsid",
        "4",
        "--host",
        &host(1),
    ]);
    ctl(&[
        "namespace",
        "add-host",
        "-n",
        NQN,
        "--nsid",
        "1",
        "--host",
        &host(1),
    ]);
    ctl(&[
        "namespace",
        "add-host",
        "-n",
        NQN,
        "--nsid",
        "9",
        "--host",
        &host(1),
    ]);
    ctl(&[
        "namespace",
        "del-host",
        "-n",
        NQN,
        "--nsid",
        "4",
        "--host",
        &host(8),
    ]);
    // Namespace settings: the image of namespace 3 goes to the trash with it; nothing to set;
    // back to every host with a host list needs --force.
    ctl(&[
        "namespace",
        "set",
        "-n",
        NQN,
        "--nsid",
        "3",
        "--trash-image",
        "true",
    ]);
    ctl(&["namespace", "set", "-n", NQN, "--nsid", "3"]);
    // Auto-resize off: the listings show the size kept (the image's, 1 GiB here).
    #[rustfmt::skip]
    ctl(&["namespace", "set", "-n", NQN, "--nsid", "3", "--auto-resize", "false"]);
    ctl(&[
        "namespace",
        "set",
        "-n",
        NQN,
        "--nsid",
        "4",
        "--auto-visible",
        "true",
    ]);
    // The subsystem key is refused while a host has none; the log level.
    ctl(&[
        "subsystem",
        "change-key",
        "--nqn",
        NQN,
        "--dhchap-key",
        &keys[0],
    ]);
    ctl(&["subsystem", "change-key", "--nqn", NQN]);
    ctl(&["log-level", "set", "warn"]);
    ctl(&["log-level", "get"]);
    ctl(&["-o", "json", "log-level", "reset"]);
    for output in ["table", "json"] {
        ctl(&["-o", output, "subsystem", "list"]);
        ctl(&["-o", output, "namespace", "list"]);
        ctl(&[
            "-o",
            output,
            "namespace",
            "list",
            "-n",
            "nqn.2016-06.io.test:none",
        ]);
        ctl(&["-o", output, "listener", "list", "-n", NQN]);
        ctl(&["-o", output, "host", "list"]);
        ctl(&["-o", output, "gateway", "list"]);
        ctl(&["-o", output, "gateway", "info", "--name", "gw2"]);
        ctl(&["-o", output, "connection", "list"]);
        ctl(&["-o", output, "ana", "show"]);
    }
    ctl(&["listener", "del", "-n", NQN, "-g", "gw1", "-a", "10.0.0.1"]);
    ctl(&["host", "del", "-n", NQN, "--host", &host(2)]);
    ctl(&[
        "namespace",
        "del-host",
        "-n",
        NQN,
        "--nsid",
        "4",
        "--host",
        &host(9),
    ]);
    ctl(&["namespace", "list", "-n", NQN]);
    ctl(&["namespace", "del", "-n", NQN, "--nsid", "2"]);
    ctl(&["-o", "json", "subsystem", "del", "--nqn", NQN, "--force"]);
    ctl(&["subsystem", "del", "--nqn", &format!("{NQN}-2")]);
    ctl(&["subsystem", "list"]);
    let _ = std::fs::remove_file(&many);
    for k in &keys {
        assert!(!transcript.contains(k.as_str()), "a key was printed");
    }
    if transcript != GOLDEN {
        let actual = std::env::temp_dir().join("cli_output.actual");
        std::fs::write(&actual, &transcript).expect("write the actual output");
        panic!(
            "nvmeofctl's output differs from tests/cli_output.golden (actual: {})",
            actual.display()
        );
    }
}
