//! Hosts' DH-HMAC-CHAP keys and TLS PSKs in the control plane, with the in-process state
//! backend: given with `HostAdd`, changed and cleared with `HostChangeKey`, pushed to the
//! gateways in their assignment (`Subsystem.host_entries`; `hosts` keeps only the hosts
//! without keys) and never shown by a list, a refusal, `nvmeofctl` or the `nvmeof-control`
//! log. With the PSKs, the rest of the TLS settings: `require_tls` and secure listeners.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use control_plane::ana::Timing;
use control_plane::proto::admin_client::AdminClient;
use control_plane::proto::gateway_control_client::GatewayControlClient;
use control_plane::proto::{self, Assignment};
use control_plane::server::Options;
use control_plane::store::Store;
use control_plane::test_support::{self, free_port, plain_channel};
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
        psk: None,
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

/// A valid TLS PSK (`NVMeTLSkey-1:01:...:`), different for each `byte`.
fn psk(byte: u8) -> String {
    nvme_auth::tls_psk::ConfiguredPsk::from_bytes(
        &[byte; 32],
        Some(nvme_auth::tls_psk::PskHash::Sha256),
    )
    .expect("32 bytes")
    .to_interchange()
    .to_string()
}

/// The part of a PSK that would show if any of it were printed (its base64).
fn psk_secret_part(key: &str) -> &str {
    &key[16..key.len() - 1]
}

fn assert_no_psk(text: &str, keys: &[&str], what: &str) {
    for k in keys {
        assert!(
            !text.contains(psk_secret_part(k)),
            "{what} shows a PSK:\n{text}"
        );
    }
}

fn psk_host(nqn: &str, host: &str, key: &str, derivation: &str) -> proto::Host {
    proto::Host {
        subsystem_nqn: nqn.into(),
        host_nqn: host.into(),
        psk: Some(proto::TlsPsk {
            key: key.into(),
            derivation: derivation.into(),
        }),
        ..Default::default()
    }
}

/// An in-process control plane and gateway gw1's assignment stream (gw1 has beaconed).
async fn control_plane_with_gw1() -> (
    AdminClient<tonic::transport::Channel>,
    tonic::Streaming<Assignment>,
    GatewayControlClient<tonic::transport::Channel>,
) {
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
    let a = AdminClient::new(plain_channel(&addr).await);
    let mut g = GatewayControlClient::new(plain_channel(&addr).await);
    g.send_beacon(proto::Beacon {
        gateway: "gw1".into(),
        ana_group: 1,
        incarnation: 1,
        ..Default::default()
    })
    .await
    .expect("beacon");
    let stream = g
        .join(proto::JoinRequest {
            gateway: "gw1".into(),
            incarnation: 1,
            presence_only: false,
        })
        .await
        .expect("join")
        .into_inner();
    (a, stream, g)
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

/// TLS settings as the gateways' files have them: a subsystem requiring TLS, a secure
/// listener, hosts' PSKs (each with its derivation) pushed in the assignment, shown by lists
/// only as "there is one"; bad input (a malformed PSK, an unknown derivation, a derivation
/// without a PSK, a secure RDMA listener, one port both secure and plain) refused with the
/// reason and the state unchanged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_settings_reach_the_gateways_and_psks_no_list() {
    let (mut a, mut stream, _) = control_plane_with_gw1().await;
    let added = a
        .subsystem_add(proto::SubsystemAddRequest {
            nqn: NQN.into(),
            require_tls: true,
            ..Default::default()
        })
        .await
        .expect("subsystem")
        .into_inner();
    assert!(
        added.message.contains("must connect over TLS"),
        "{}",
        added.message
    );
    const OTHER: &str = "nqn.2016-06.io.test:other";
    a.subsystem_add(proto::SubsystemAddRequest {
        nqn: OTHER.into(),
        ..Default::default()
    })
    .await
    .expect("other subsystem");
    let listener = |nqn: &str, transport: &str, port: u32, secure: bool| proto::Listener {
        subsystem_nqn: nqn.into(),
        gateway: "gw1".into(),
        transport: transport.into(),
        address: "10.0.0.1".into(),
        port,
        secure,
    };
    a.listener_add(listener(NQN, "tcp", 4420, true))
        .await
        .expect("secure listener");
    a.listener_add(listener(OTHER, "tcp", 4421, false))
        .await
        .expect("plain listener");
    let (p1, p2) = (psk(0x71), psk(0x72));
    let added = a
        .host_add(psk_host(NQN, KEYED, &p1, ""))
        .await
        .expect("host with a PSK")
        .into_inner();
    assert!(
        added.message.ends_with("with a TLS PSK"),
        "{}",
        added.message
    );
    a.host_add(host(NQN, PLAIN, "", "")).await.expect("plain");

    // Pushed: require_tls, the secure listener, KEYED's key (in canonical text).
    let s = next_assignment(&mut stream, |s| s.host_entries.len() == 2).await;
    assert!(s.require_tls);
    let pushed = entry(&s, KEYED).psk.clone().expect("KEYED's PSK pushed");
    assert_eq!(
        (pushed.key.as_str(), pushed.derivation.as_str()),
        (p1.as_str(), "rfc8446")
    );
    assert_eq!(entry(&s, PLAIN).psk, None);
    // `hosts` (what a gateway that knows no keys reads) leaves a host with a PSK out.
    assert_eq!(s.hosts, vec![PLAIN.to_string()]);
    assert_no_psk(&format!("{s:?}"), &[&p1], "an assignment's Debug");
    let lists = a
        .listener_list(proto::ListenerListRequest::default())
        .await
        .expect("listeners")
        .into_inner();
    let secure: Vec<(u32, bool)> = lists.listeners.iter().map(|l| (l.port, l.secure)).collect();
    assert_eq!(secure, vec![(4420, true), (4421, false)]);

    // Lists: whether there is one and its derivation, never the key.
    let list = a
        .host_list(proto::HostListRequest {
            subsystem_nqn: NQN.into(),
        })
        .await
        .expect("host list")
        .into_inner();
    let listed: Vec<(&str, Option<(&str, &str)>)> = list
        .hosts
        .iter()
        .map(|h| {
            (
                h.host_nqn.as_str(),
                h.psk
                    .as_ref()
                    .map(|p| (p.key.as_str(), p.derivation.as_str())),
            )
        })
        .collect();
    assert_eq!(listed, vec![(PLAIN, None), (KEYED, Some(("", "rfc8446")))]);
    let subsystems = a
        .subsystem_list(proto::Empty {})
        .await
        .expect("subsystem list")
        .into_inner();
    let tls: Vec<(&str, bool)> = subsystems
        .subsystems
        .iter()
        .map(|s| (s.nqn.as_str(), s.require_tls))
        .collect();
    assert_eq!(tls, vec![(NQN, true), (OTHER, false)]);
    for text in [
        format!("{subsystems:?}{list:?}"),
        serde_json::to_string(&subsystems).expect("json"),
        serde_json::to_string(&list).expect("json"),
    ] {
        assert_no_psk(&text, &[&p1], "a list");
    }

    // Changed to another key and derivation; then the DH-HMAC-CHAP keys alone: the PSK goes
    // (a change gives all the host's keys).
    let changed = a
        .host_change_key(psk_host(NQN, KEYED, &p2, "libnvme-compat"))
        .await
        .expect("change")
        .into_inner();
    assert!(
        changed.message.contains("TLS PSK set"),
        "{}",
        changed.message
    );
    let s = next_assignment(&mut stream, |s| {
        entry(s, KEYED).psk.as_ref().is_some_and(|p| p.key == p2)
    })
    .await;
    assert_eq!(
        entry(&s, KEYED).psk.as_ref().map(|p| p.derivation.as_str()),
        Some("libnvme-compat")
    );
    let version = changed.version;

    // Refused with the field and why, never the key; nothing changes.
    let mut bad = p1.clone().into_bytes();
    bad[20] = if bad[20] == b'A' { b'B' } else { b'A' };
    let bad = String::from_utf8(bad).expect("ASCII");
    let host_refusals = [
        (
            psk_host(NQN, KEYED, &bad, ""),
            "invalid psk: the key's CRC-32",
        ),
        (
            psk_host(NQN, KEYED, "NVMeTLSkey-1:01:short:", ""),
            "invalid psk:",
        ),
        (
            psk_host(NQN, KEYED, &p1, "rfc9999"),
            "invalid psk_derivation: \"rfc9999\" is not one of",
        ),
        (
            psk_host(NQN, KEYED, "", "rfc8446"),
            "invalid psk_derivation: needs a psk",
        ),
    ];
    for (request, message) in host_refusals {
        let mut add = request.clone();
        add.host_nqn = "nqn.2016-06.io.test:new".into();
        for s in [
            a.host_change_key(request).await.expect_err(message),
            a.host_add(add).await.expect_err(message),
        ] {
            assert_eq!(s.code(), Code::InvalidArgument, "{}", s.message());
            assert!(s.message().starts_with(message), "{}", s.message());
            assert_no_psk(s.message(), &[&p1, &p2, &bad], "a refusal");
        }
    }
    let listener_refusals = [
        (
            listener(NQN, "rdma", 4422, true),
            Code::InvalidArgument,
            "invalid secure \"rdma\": TLS secure channels are for NVMe/TCP listeners only",
        ),
        (
            listener(OTHER, "tcp", 4420, false),
            Code::InvalidArgument,
            "listener listener/nqn.2016-06.io.test:other/gw1/tcp/10.0.0.1/4420: the same gateway, \
             address and port is already secure for subsystem nqn.2016-06.io.test:keys",
        ),
        (
            listener(NQN, "tcp", 4421, true),
            Code::InvalidArgument,
            "listener listener/nqn.2016-06.io.test:keys/gw1/tcp/10.0.0.1/4421: the same gateway, \
             address and port is already plain (not secure) for subsystem nqn.2016-06.io.test:other",
        ),
        (
            // The same listener but for its flag: one entry per listener.
            listener(NQN, "tcp", 4420, false),
            Code::AlreadyExists,
            "listener listener/nqn.2016-06.io.test:keys/gw1/tcp/10.0.0.1/4420 already exists",
        ),
    ];
    for (request, code, message) in listener_refusals {
        let s = a.listener_add(request).await.expect_err(message);
        assert_eq!(s.code(), code, "{}", s.message());
        assert!(s.message().starts_with(message), "{}", s.message());
    }
    let now = a
        .host_list(proto::HostListRequest::default())
        .await
        .expect("list")
        .into_inner();
    assert_eq!(now.version, version, "a refusal changed the state");

    // A listener is deleted whatever the request says of its flag.
    a.listener_del(listener(NQN, "tcp", 4420, false))
        .await
        .expect("secure listener deleted");
    a.listener_add(listener(OTHER, "tcp", 4420, false))
        .await
        .expect("the port is free for a plain listener");

    // Cleared: a host without keys again (back in `hosts`).
    a.host_change_key(host(NQN, KEYED, "", ""))
        .await
        .expect("clear");
    let s = next_assignment(&mut stream, |s| s.hosts.len() == 2).await;
    assert_eq!(entry(&s, KEYED).psk, None);
}

/// `SubsystemSet` changes `require_tls` of an existing subsystem: pushed to the gateways, the
/// reply names the hosts the gateways' last beacons had connected without TLS (those the
/// gateways close), unchanged when set again; refused without a setting, for an unknown
/// subsystem, state unchanged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn require_tls_is_changed_live_and_names_the_plain_hosts() {
    let (mut a, mut stream, mut g) = control_plane_with_gw1().await;
    a.subsystem_add(proto::SubsystemAddRequest {
        nqn: NQN.into(),
        ..Default::default()
    })
    .await
    .expect("subsystem");
    let s = next_assignment(&mut stream, |_| true).await;
    assert!(!s.require_tls);
    // gw1 reports KEYED connected over TLS and PLAIN without.
    let conn = |host: &str, cntlid: u32, secure: bool| proto::Connection {
        gateway: String::new(),
        subsystem_nqn: NQN.into(),
        host_nqn: host.into(),
        cntlid,
        io_queues: 1,
        secure,
    };
    g.send_beacon(proto::Beacon {
        gateway: "gw1".into(),
        ana_group: 1,
        incarnation: 1,
        connections: vec![conn(KEYED, 1, true), conn(PLAIN, 2, false)],
        ..Default::default()
    })
    .await
    .expect("beacon");
    let set = |nqn: &str, require_tls: Option<bool>| proto::SubsystemSetRequest {
        nqn: nqn.into(),
        require_tls,
    };

    let on = a
        .subsystem_set(set(NQN, Some(true)))
        .await
        .expect("set")
        .into_inner();
    assert_eq!(
        on.message,
        format!(
            "subsystem {NQN}: TLS required; the gateways close the connections of 1 host(s) \
             connected without TLS ({PLAIN}); they must reconnect through a secure listener"
        )
    );
    let s = next_assignment(&mut stream, |s| s.require_tls).await;
    assert!(s.require_tls);
    let again = a
        .subsystem_set(set(NQN, Some(true)))
        .await
        .expect("set again")
        .into_inner();
    assert!(again.message.contains("unchanged"), "{}", again.message);
    assert_eq!(
        again.version, on.version,
        "setting it again wrote the state"
    );

    // Refused, nothing changed.
    for (request, code, says) in [
        (set(NQN, None), Code::InvalidArgument, "give a setting"),
        (
            set("nqn.2016-06.io.test:unknown", Some(false)),
            Code::NotFound,
            "not found",
        ),
    ] {
        let s = a.subsystem_set(request).await.expect_err(says);
        assert_eq!(s.code(), code, "{}", s.message());
        assert!(s.message().contains(says), "{}", s.message());
    }
    let list = a
        .subsystem_list(proto::Empty {})
        .await
        .expect("list")
        .into_inner();
    assert_eq!(list.version, on.version, "a refusal changed the state");
    assert!(list.subsystems[0].require_tls);

    let off = a
        .subsystem_set(set(NQN, Some(false)))
        .await
        .expect("off")
        .into_inner();
    assert!(
        off.message.contains("no longer required"),
        "{}",
        off.message
    );
    let s = next_assignment(&mut stream, |s| !s.require_tls).await;
    assert!(!s.require_tls);
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
    let p1 = psk(0x77);
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
            vec!["SUBSYSTEM", "HOST", "AUTH", "TLS", "PSK"],
            vec![NQN, PLAIN, "none", "no"],
            vec![NQN, KEYED, "bidirectional", "no"],
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
            .any(|l| l.split_whitespace().collect::<Vec<_>>() == [NQN, KEYED, "host", "no"]),
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

    // A TLS PSK from a file (as `nvme gen-tls-key` prints it), with its derivation: listed as
    // that derivation, never the key; an unknown derivation is refused (exit 1).
    let p1_file = write(&dir, "tls.psk", &format!("{p1}\n"));
    let (rc, out, err) = run(
        &[
            "host",
            "add",
            "-n",
            NQN,
            "--host",
            "nqn.2016-06.io.test:tls",
            "--psk-file",
            &p1_file,
            "--psk-derivation",
            "libnvme-compat",
        ],
        None,
    );
    assert_eq!(rc, 0, "{err}");
    assert!(out.contains("with a TLS PSK"), "{out}");
    let (rc, out, _) = run(&["host", "list"], None);
    assert_eq!(rc, 0);
    assert!(
        out.lines().any(|l| l.split_whitespace().collect::<Vec<_>>()
            == [NQN, "nqn.2016-06.io.test:tls", "none", "libnvme-compat"]),
        "{out}"
    );
    let (rc, out, _) = run(&["-o", "json", "host", "list"], None);
    assert_eq!(rc, 0);
    let v: serde_json::Value = serde_json::from_str(&out).expect("json");
    let listed = v["hosts"]
        .as_array()
        .and_then(|h| {
            h.iter()
                .find(|h| h["host_nqn"] == "nqn.2016-06.io.test:tls")
        })
        .expect("the host listed");
    assert_eq!(
        listed["psk"],
        serde_json::json!({"derivation": "libnvme-compat"}),
        "{out}"
    );
    let (rc, _, err) = run(
        &[
            "host",
            "change-key",
            "-n",
            NQN,
            "--host",
            "nqn.2016-06.io.test:tls",
            "--psk",
            &p1,
            "--psk-derivation",
            "rfc9999",
        ],
        None,
    );
    assert_eq!(rc, 1, "{err}");
    assert!(
        err.contains("invalid psk_derivation: \"rfc9999\" is not one of rfc8446, libnvme-compat"),
        "{err}"
    );
    let (rc, _, err) = run(
        &[
            "host",
            "del",
            "-n",
            NQN,
            "--host",
            "nqn.2016-06.io.test:tls",
        ],
        None,
    );
    assert_eq!(rc, 0, "{err}");

    // Bad usage: exit 2, nothing sent.
    let usage: [&[&str]; 6] = [
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
        &[
            "host",
            "change-key",
            "-n",
            NQN,
            "--host",
            KEYED,
            "--dhchap-key-file",
            "-",
            "--psk-file",
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
    assert_no_psk(&outputs, &[&p1], "nvmeofctl's output");
    let text = std::fs::read_to_string(&log).expect("read the log");
    assert!(
        text.contains("host keys set"),
        "the log covers the changes:\n{text}"
    );
    assert_no_key(&text, &keys, "the nvmeof-control log");
    assert_no_psk(&text, &[&p1], "the nvmeof-control log");
    let _ = std::fs::remove_dir_all(&dir);
}
