//! NVMe/TCP secure channels on a gateway process: a secure listener takes TLS 1.3 with the
//! hosts' PSKs only, and its queues carry I/O; wrong keys, a plaintext ICReq, a TLS 1.2
//! offer and a truncated ClientHello are refused, each closing only its own connection; a
//! subsystem requiring TLS refuses plain Connects, and a Connect over TLS must be the PSK
//! identity's; the discovery log says which listener requires TLS; a group gateway does the
//! same with the settings the control plane pushes. The client side is OpenSSL (a TLS PSK
//! client relaying the Rust host's bytes), as the Linux host's tlshd (GnuTLS) is a different
//! implementation of the same handshake. The real Linux host (nvme-cli --tls with tlshd) is
//! tests/vm/e2e-tls.sh's.

mod common;

use std::pin::Pin;
use std::time::Duration;

use common::gateway_process::GatewayProcess;
use common::host::{try_connect, try_connect_admin, Attach};
use common::{free_port, http_exchange, loopback, metric_value, pattern, scratch_dir};
use nvmeof_gateway::auth::tls_psk::{ConfiguredPsk, LabelEncoding, PskHash};
use nvmeof_gateway::auth::{DhchapSecret, HashFunction};
use nvmeof_gateway::host::HostError;
use nvmeof_gateway::spec::DISCOVERY_NQN;
use openssl::ssl::{Ssl, SslContext, SslMethod, SslVersion};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};

const SUBNQN: &str = "nqn.2016-06.io.ceph-nvmeof-rs:tls";
const OPEN_SUBNQN: &str = "nqn.2016-06.io.ceph-nvmeof-rs:tls-optional";
const KEYED: &str = "nqn.2014-08.org.nvmexpress:uuid:c0000000-0000-0000-0000-00000000000c";
const COMPAT: &str = "nqn.2014-08.org.nvmexpress:uuid:d0000000-0000-0000-0000-00000000000d";
const PLAIN: &str = "nqn.2014-08.org.nvmexpress:uuid:e0000000-0000-0000-0000-00000000000e";
/// A host with a PSK and a DH-HMAC-CHAP key: TLS, then in-band authentication on each queue.
const BOTH: &str = "nqn.2014-08.org.nvmexpress:uuid:f0000000-0000-0000-0000-00000000000f";
/// A host with a SHA-384 PSK: TLS_AES_256_GCM_SHA384.
const WIDE: &str = "nqn.2014-08.org.nvmexpress:uuid:a0000000-0000-0000-0000-00000000000a";
/// Set to `required` where the kernel has TLS (tests/vm/ktls-check.sh): every secure
/// connection must then be served by kernel TLS, none by the relay.
const KTLS_ENV: &str = "NVMEOF_TEST_KTLS";

fn dhchap_key() -> DhchapSecret {
    DhchapSecret::from_bytes(&[0x44; 32], Some(HashFunction::Sha256)).expect("32 bytes")
}

fn psk(byte: u8) -> ConfiguredPsk {
    ConfiguredPsk::from_bytes(&[byte; 32], Some(PskHash::Sha256)).expect("32 bytes")
}

fn psk384(byte: u8) -> ConfiguredPsk {
    ConfiguredPsk::from_bytes(&[byte; 48], Some(PskHash::Sha384)).expect("48 bytes")
}

/// A gateway with a secure listener and a plain one; SUBNQN requires TLS (KEYED and COMPAT
/// have PSKs), OPEN_SUBNQN does not.
/// `name`: the scratch directory's, one per test (tests of one binary run at once);
/// `gateway`: more `[gateway]` settings.
async fn spawn(name: &str, gateway: &str) -> (GatewayProcess, u16, u16, u16) {
    let dir = scratch_dir(&format!("nvmeof-{name}-{}", std::process::id()));
    let (secure, plain, metrics) = (free_port(), free_port(), free_port());
    let config = format!(
        r#"
        [gateway]
        metrics_listen = "127.0.0.1:{metrics}"
        {gateway}

        [[listener]]
        transport = "tcp"
        address = "127.0.0.1"
        port = {secure}
        secure = true

        [[listener]]
        transport = "tcp"
        address = "127.0.0.1"
        port = {plain}

        [[subsystem]]
        nqn = "{SUBNQN}"
        require_tls = true
        hosts = [
            {{ nqn = "{KEYED}", psk = "{}" }},
            {{ nqn = "{COMPAT}", psk = "{}", psk_derivation = "libnvme-compat" }},
            {{ nqn = "{BOTH}", psk = "{}", dhchap_key = "{}" }},
            {{ nqn = "{WIDE}", psk = "{}" }},
            "{PLAIN}",
        ]

        [[subsystem.namespace]]
        nsid = 1
        backend = "memory"
        size = "16MiB"

        [[subsystem]]
        nqn = "{OPEN_SUBNQN}"
        hosts = [ {{ nqn = "{KEYED}", psk = "{}" }}, "{PLAIN}" ]

        [[subsystem.namespace]]
        nsid = 1
        backend = "memory"
        size = "16MiB"
        "#,
        psk(0x31).to_interchange().as_str(),
        psk(0x32).to_interchange().as_str(),
        psk(0x34).to_interchange().as_str(),
        dhchap_key().to_representation().as_str(),
        psk384(0x35).to_interchange().as_str(),
        psk(0x31).to_interchange().as_str(),
    );
    let gateway = GatewayProcess::spawn(&dir, "tls", plain, &config);
    gateway.wait_for_metrics(metrics).await;
    gateway.wait_for_listener().await;
    (gateway, secure, plain, metrics)
}

/// What a TLS client offers.
#[derive(Clone)]
struct Offer {
    identity: String,
    key: Vec<u8>,
    max_version: SslVersion,
    /// The one TLS 1.3 suite offered. (The `openssl` crate's client PSK callback, which
    /// this client uses so it can also offer TLS 1.2, is TLS 1.2's: under TLS 1.3 it makes
    /// every PSK a SHA-256 one; a SHA-384 PSK goes through [`tls_proxy_psk`].)
    suite: &'static str,
}

/// The identity (version `version`) and TLS PSK a host derives from `key`.
fn offer(key: &ConfiguredPsk, host: &str, sub: &str, version: u8, enc: LabelEncoding) -> Offer {
    let retained = key.retained(host, enc);
    let identity = retained.identity(version, host, sub);
    let tls = retained.tls_psk(&identity, enc).expect("derivable");
    Offer {
        identity: identity.to_string(),
        key: tls.key().to_vec(),
        max_version: SslVersion::TLS1_3,
        suite: tls.hash().cipher_suite(),
    }
}

/// A local port whose connections are relayed to the gateway's `secure` port over TLS
/// with `offer`: the Rust host connects there in clear.
async fn tls_proxy(secure: u16, offer: Offer) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let port = listener.local_addr().expect("addr").port();
    tokio::spawn(async move {
        while let Ok((mut plain, _)) = listener.accept().await {
            let offer = offer.clone();
            tokio::spawn(async move {
                let Ok(mut tls) = tls_connect(secure, &offer).await else {
                    return;
                };
                let _ = tokio::io::copy_bidirectional(&mut plain, &mut tls).await;
            });
        }
    });
    port
}

/// [`tls_proxy`] with the gateway's own TLS 1.3 PSK client, which offers a PSK of either
/// hash with its suite (TLS_AES_256_GCM_SHA384 for SHA-384).
async fn tls_proxy_psk(secure: u16, key: &ConfiguredPsk, host: &str, sub: &str) -> u16 {
    let retained = key.retained(host, LabelEncoding::Rfc8446);
    let identity = retained.identity(1, host, sub);
    let tls_psk = retained
        .tls_psk(&identity, LabelEncoding::Rfc8446)
        .expect("derivable");
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let port = listener.local_addr().expect("addr").port();
    tokio::spawn(async move {
        while let Ok((mut plain, _)) = listener.accept().await {
            let (identity, tls_psk) = (identity.clone(), tls_psk.clone());
            tokio::spawn(async move {
                let Ok(tcp) = TcpStream::connect(loopback(secure)).await else {
                    return;
                };
                let Ok(mut tls) =
                    nvmeof_gateway::tcp::tls::connect_with_psk(tcp, &identity, tls_psk).await
                else {
                    return;
                };
                let _ = tokio::io::copy_bidirectional(&mut plain, &mut tls).await;
            });
        }
    });
    port
}

async fn tls_connect(
    secure: u16,
    offer: &Offer,
) -> Result<tokio_openssl::SslStream<TcpStream>, String> {
    let mut ctx = SslContext::builder(SslMethod::tls_client()).map_err(|e| e.to_string())?;
    ctx.set_max_proto_version(Some(offer.max_version))
        .map_err(|e| e.to_string())?;
    ctx.set_ciphersuites(offer.suite)
        .map_err(|e| e.to_string())?;
    let (identity, key) = (offer.identity.clone(), offer.key.clone());
    ctx.set_psk_client_callback(move |_, _, id_out, key_out| {
        let id = identity.as_bytes();
        id_out[..id.len()].copy_from_slice(id);
        id_out[id.len()] = 0;
        key_out[..key.len()].copy_from_slice(&key);
        Ok(key.len())
    });
    let ssl = Ssl::new(&ctx.build()).map_err(|e| e.to_string())?;
    let tcp = TcpStream::connect(loopback(secure))
        .await
        .map_err(|e| e.to_string())?;
    let mut tls = tokio_openssl::SslStream::new(ssl, tcp).map_err(|e| e.to_string())?;
    Pin::new(&mut tls)
        .connect()
        .await
        .map_err(|e| e.to_string())?;
    Ok(tls)
}

fn attach(host: &str, sub: &str) -> Attach {
    let mut a = Attach::new(host, sub);
    a.command_timeout = Duration::from_secs(10);
    a
}

async fn round_trip(port: u16, a: &Attach, seed: u8) -> Result<(), HostError> {
    let host = try_connect(loopback(port), a).await?;
    let data = pattern(8192, seed);
    host.io.write(1, 8, data.clone(), 512).await?;
    assert_eq!(host.io.read(1, 8, 16, 512).await?, data);
    Ok(())
}

fn refusals(metrics: u16, reason: &str) -> f64 {
    let answer = http_exchange(
        loopback(metrics),
        b"GET /metrics HTTP/1.1\r\nHost: gw\r\n\r\n",
    );
    metric_value(
        &answer,
        &format!("nvmeof_connect_refusals_total{{reason=\"{reason}\"}}"),
    )
    .unwrap_or(0.0)
}

#[tokio::test]
async fn secure_listener_serves_hosts_with_their_psk_and_refuses_the_rest() {
    let (mut gateway, secure, plain, metrics) = spawn("tls", "").await;

    // Identity versions 0 and 1, and a host whose nvme-cli derives the libnvme-compat way.
    for (host, key, version, enc, seed) in [
        (KEYED, psk(0x31), 0, LabelEncoding::Rfc8446, 1),
        (KEYED, psk(0x31), 1, LabelEncoding::Rfc8446, 2),
        (COMPAT, psk(0x32), 0, LabelEncoding::LibnvmeCompat, 3),
    ] {
        let proxy = tls_proxy(secure, offer(&key, host, SUBNQN, version, enc)).await;
        round_trip(proxy, &attach(host, SUBNQN), seed)
            .await
            .unwrap_or_else(|e| panic!("{host} v{version} {enc:?}: {e}"));
    }

    // TLS and DH-HMAC-CHAP on one connection: the handshake, then each queue authenticates;
    // without the DH-HMAC-CHAP secret the TLS connection alone does not get in.
    let both_proxy = tls_proxy(
        secure,
        offer(&psk(0x34), BOTH, SUBNQN, 0, LabelEncoding::Rfc8446),
    )
    .await;
    let mut both = attach(BOTH, SUBNQN);
    round_trip(both_proxy, &both, 4)
        .await
        .expect_err("TLS without the DH-HMAC-CHAP secret");
    both.dhchap_secret = Some(dhchap_key());
    round_trip(both_proxy, &both, 5)
        .await
        .expect("TLS and DH-HMAC-CHAP");
    assert_eq!(
        gateway.log_text().matches("queue authenticated").count(),
        2,
        "admin and I/O queue authenticated over TLS"
    );

    // Handshakes that fail: a wrong key, the compat host's key derived the other way, an
    // identity for another subsystem, a TLS 1.2 offer.
    let mut twelve = offer(&psk(0x31), KEYED, SUBNQN, 0, LabelEncoding::Rfc8446);
    twelve.max_version = SslVersion::TLS1_2;
    for (what, bad) in [
        (
            "wrong key",
            offer(&psk(0x33), KEYED, SUBNQN, 0, LabelEncoding::Rfc8446),
        ),
        (
            "other derivation",
            offer(&psk(0x32), COMPAT, SUBNQN, 0, LabelEncoding::Rfc8446),
        ),
        (
            "no PSK in that subsystem",
            offer(&psk(0x31), PLAIN, SUBNQN, 0, LabelEncoding::Rfc8446),
        ),
        ("TLS 1.2", twelve),
    ] {
        assert!(
            tls_connect(secure, &bad).await.is_err(),
            "{what}: the handshake must fail"
        );
    }

    // Plaintext NVMe/TCP on the secure listener: the ICReq is no ClientHello.
    let refused = try_connect_admin(loopback(secure), &attach(KEYED, SUBNQN)).await;
    assert!(refused.is_err(), "plain ICReq on a secure listener");

    // A truncated ClientHello (a record header promising more than comes), then EOF.
    let mut raw = TcpStream::connect(loopback(secure)).await.expect("tcp");
    raw.write_all(&[
        0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xfc, 0x03, 0x03,
    ])
    .await
    .expect("write");
    drop(raw);

    // The subsystem requires TLS: a plain Connect is refused, even for a keyed host.
    for host in [KEYED, PLAIN] {
        let e = round_trip(plain, &attach(host, SUBNQN), 9)
            .await
            .expect_err("TLS required");
        assert!(matches!(e, HostError::Nvme(_)), "{host}: {e}");
    }
    assert_eq!(refusals(metrics, "tls_required"), 2.0);

    // Over TLS with KEYED's key, a Connect as PLAIN (or to another subsystem) is refused.
    let keyed_proxy = tls_proxy(
        secure,
        offer(&psk(0x31), KEYED, SUBNQN, 0, LabelEncoding::Rfc8446),
    )
    .await;
    for (host, sub) in [(PLAIN, SUBNQN), (KEYED, OPEN_SUBNQN)] {
        round_trip(keyed_proxy, &attach(host, sub), 10)
            .await
            .expect_err("another identity than the handshake's");
    }
    assert_eq!(refusals(metrics, "tls_identity_mismatch"), 2.0);

    // A subsystem that does not require TLS serves both ways.
    round_trip(plain, &attach(PLAIN, OPEN_SUBNQN), 11)
        .await
        .expect("plain connect, TLS optional");
    let open_proxy = tls_proxy(
        secure,
        offer(&psk(0x31), KEYED, OPEN_SUBNQN, 0, LabelEncoding::Rfc8446),
    )
    .await;
    round_trip(open_proxy, &attach(KEYED, OPEN_SUBNQN), 12)
        .await
        .expect("TLS connect, TLS optional");

    // After all that, the first host still gets in.
    round_trip(keyed_proxy, &attach(KEYED, SUBNQN), 13)
        .await
        .expect("the gateway keeps serving");

    // The discovery log, read through the plain listener: each subsystem only where the
    // host can connect to it, with TLS 1.3 required on the secure listener and not
    // specified elsewhere (TREQ bits 1:0, TSAS byte 0 = SECTYPE), as Linux's nvme discover
    // reads them. KEYED (a PSK in both): SUBNQN, which requires TLS, on the secure listener
    // only; OPEN_SUBNQN on both. PLAIN (no PSK): SUBNQN nowhere, OPEN_SUBNQN on the plain
    // listener only.
    for (host, want) in [
        (
            KEYED,
            vec![
                (OPEN_SUBNQN, plain, (0, 0)),
                (OPEN_SUBNQN, secure, (1, 2)),
                (SUBNQN, secure, (1, 2)),
            ],
        ),
        (PLAIN, vec![(OPEN_SUBNQN, plain, (0, 0))]),
    ] {
        let (discovery, _) = try_connect_admin(loopback(plain), &attach(host, DISCOVERY_NQN))
            .await
            .expect("discovery");
        let log = discovery.discovery_log().await.expect("log");
        let mut got: Vec<(&str, u16, (u8, u8))> = log
            .entries
            .iter()
            .filter(|e| e.subnqn != DISCOVERY_NQN)
            .map(|e| {
                let sub = if e.subnqn == SUBNQN {
                    SUBNQN
                } else {
                    OPEN_SUBNQN
                };
                assert!(
                    e.subnqn == SUBNQN || e.subnqn == OPEN_SUBNQN,
                    "{}",
                    e.subnqn
                );
                let port: u16 = e.trsvcid.parse().expect("port");
                (sub, port, (e.treq & 0x3, e.tsas[0]))
            })
            .collect();
        got.sort();
        let mut want = want;
        want.sort();
        assert_eq!(got, want, "discovery log of {host}");
    }

    let answer = http_exchange(
        loopback(metrics),
        b"GET /metrics HTTP/1.1\r\nHost: gw\r\n\r\n",
    );
    assert!(
        metric_value(&answer, "nvmeof_tls_handshake_failures_total").unwrap_or(0.0) >= 6.0,
        "4 bad offers, the plain ICReq, the truncated hello"
    );
    let log = gateway.log_text();
    for secret in [
        psk(0x31).to_interchange().to_string(),
        psk(0x32).to_interchange().to_string(),
    ] {
        assert!(!log.contains(&secret), "a key in the log");
    }
    assert!(gateway.terminate().success());
}

/// A group gateway (name gw1, ANA group 1, its file without subsystems, one plain listener)
/// of a control plane in memory; the Admin client of that control plane, the plain port, a
/// free port for a secure listener and the metrics port. `name`: the scratch directory's.
async fn spawn_group_gateway(
    name: &str,
) -> (
    GatewayProcess,
    control_plane::proto::admin_client::AdminClient<tonic::transport::Channel>,
    u16,
    u16,
    u16,
) {
    use control_plane::proto::admin_client::AdminClient;
    use control_plane::store::Store;
    use control_plane::test_support;

    let backend = test_support::memory_backend_with_images(Vec::<String>::new());
    let cp = test_support::start_replica(Store::new(backend), "test", Default::default()).await;
    test_support::wait_for_lease(&cp, Duration::from_secs(10)).await;
    let cp_addr = test_support::serve_plain(cp).await;
    let admin = AdminClient::new(test_support::plain_channel(&cp_addr).await);

    let dir = scratch_dir(&format!("nvmeof-{name}-{}", std::process::id()));
    let (plain, secure, metrics) = (free_port(), free_port(), free_port());
    let config = format!(
        r#"
[gateway]
name = "gw1"
metrics_listen = "127.0.0.1:{metrics}"
[group]
control_plane = ["{cp_addr}"]
ana_group = 1
beacon_interval_ms = 200
[[listener]]
transport = "tcp"
address = "127.0.0.1"
port = {plain}
"#
    );
    let gateway = GatewayProcess::spawn(&dir, "gw1", plain, &config);
    gateway.wait_for_metrics(metrics).await;
    (gateway, admin, plain, secure, metrics)
}

/// The same settings from a control plane (in memory) instead of the file: a group gateway
/// whose file has no subsystem binds the secure listener `nvmeofctl listener add --secure`
/// gives it as a TLS one, lets in the host with the PSK the control plane pushed, and
/// refuses a plain Connect to the subsystem that requires TLS. The listener deleted and added
/// again without `secure` is bound again as a plain one (a plain ICReq now reaches Connect).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_gateway_serves_tls_as_the_control_plane_sets_it() {
    use common::poll_until;
    use control_plane::proto;

    let (gateway, mut admin, plain, secure, metrics) = spawn_group_gateway("group-tls").await;

    admin
        .subsystem_add(proto::SubsystemAddRequest {
            nqn: SUBNQN.into(),
            require_tls: true,
            ..Default::default()
        })
        .await
        .expect("subsystem");
    let listener = |secure_flag: bool| proto::Listener {
        subsystem_nqn: SUBNQN.into(),
        gateway: "gw1".into(),
        transport: "tcp".into(),
        address: "127.0.0.1".into(),
        port: u32::from(secure),
        secure: secure_flag,
    };
    admin
        .listener_add(listener(true))
        .await
        .expect("secure listener");
    let key = psk(0x51);
    admin
        .host_add(proto::Host {
            subsystem_nqn: SUBNQN.into(),
            host_nqn: KEYED.into(),
            psk: Some(proto::TlsPsk {
                key: key.to_interchange().to_string(),
                derivation: String::new(),
            }),
            ..Default::default()
        })
        .await
        .expect("host with a PSK");

    // Once the assignment is applied and the listener bound: TLS with the pushed key.
    let proxy = tls_proxy(
        secure,
        offer(&key, KEYED, SUBNQN, 0, LabelEncoding::Rfc8446),
    )
    .await;
    poll_until(
        Duration::from_secs(20),
        Duration::from_millis(200),
        async || {
            try_connect_admin(loopback(proxy), &attach(KEYED, SUBNQN))
                .await
                .map(|_| ())
                .map_err(|e| format!("Connect over TLS: {e}"))
        },
    )
    .await;
    assert!(
        tls_connect(
            secure,
            &offer(&psk(0x52), KEYED, SUBNQN, 0, LabelEncoding::Rfc8446)
        )
        .await
        .is_err(),
        "a wrong key must fail the handshake"
    );
    // require_tls pushed: the plain listener reaches Connect, which is refused.
    let e = try_connect_admin(loopback(plain), &attach(KEYED, SUBNQN))
        .await
        .expect_err("TLS required");
    assert!(matches!(e, HostError::Nvme(_)), "{e}");
    assert_eq!(refusals(metrics, "tls_required"), 1.0);

    // The listener plain again: bound again as plain, a plain ICReq gets to Connect.
    admin
        .listener_del(listener(false))
        .await
        .expect("listener deleted");
    admin
        .listener_add(listener(false))
        .await
        .expect("plain listener");
    poll_until(
        Duration::from_secs(20),
        Duration::from_millis(200),
        async || {
            let _ = try_connect_admin(loopback(secure), &attach(KEYED, SUBNQN)).await;
            if refusals(metrics, "tls_required") >= 2.0 {
                Ok(())
            } else {
                Err("the listener still takes TLS only".to_string())
            }
        },
    )
    .await;
    assert!(
        !gateway.log_text().contains(key.to_interchange().as_str()),
        "the PSK in the log"
    );
}

/// `nvmeofctl subsystem set --require-tls true` on a subsystem with hosts connected: the
/// gateway reports which controllers came over TLS (the control plane's connection list
/// says so), and once it applies the change it closes the controller that connected in clear
/// while the one over TLS stays; the plain host's reconnect is refused (`tls_required`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requiring_tls_later_closes_the_plain_controllers_only() {
    use common::poll_until;
    use control_plane::proto;

    let (gateway, mut admin, plain, secure, metrics) = spawn_group_gateway("group-tls-set").await;

    admin
        .subsystem_add(proto::SubsystemAddRequest {
            nqn: SUBNQN.into(),
            ..Default::default()
        })
        .await
        .expect("subsystem");
    admin
        .listener_add(proto::Listener {
            subsystem_nqn: SUBNQN.into(),
            gateway: "gw1".into(),
            transport: "tcp".into(),
            address: "127.0.0.1".into(),
            port: u32::from(secure),
            secure: true,
        })
        .await
        .expect("secure listener");
    let key = psk(0x61);
    admin
        .host_add(proto::Host {
            subsystem_nqn: SUBNQN.into(),
            host_nqn: KEYED.into(),
            psk: Some(proto::TlsPsk {
                key: key.to_interchange().to_string(),
                derivation: String::new(),
            }),
            ..Default::default()
        })
        .await
        .expect("host with a PSK");
    admin
        .host_add(proto::Host {
            subsystem_nqn: SUBNQN.into(),
            host_nqn: PLAIN.into(),
            ..Default::default()
        })
        .await
        .expect("plain host");

    // KEYED over TLS, PLAIN in clear.
    let proxy = tls_proxy(
        secure,
        offer(&key, KEYED, SUBNQN, 0, LabelEncoding::Rfc8446),
    )
    .await;
    let (over_tls, _) = poll_until(
        Duration::from_secs(20),
        Duration::from_millis(200),
        async || {
            try_connect_admin(loopback(proxy), &attach(KEYED, SUBNQN))
                .await
                .map_err(|e| format!("Connect over TLS: {e}"))
        },
    )
    .await;
    let (in_clear, _) = try_connect_admin(loopback(plain), &attach(PLAIN, SUBNQN))
        .await
        .expect("plain Connect while TLS is not required");

    // The beacons say which came over TLS.
    poll_until(
        Duration::from_secs(10),
        Duration::from_millis(200),
        async || {
            let list = admin
                .clone()
                .connection_list(proto::ConnectionListRequest {
                    subsystem_nqn: SUBNQN.into(),
                })
                .await
                .map_err(|e| e.to_string())?
                .into_inner();
            let mut seen: Vec<(String, bool)> = list
                .connections
                .iter()
                .map(|c| (c.host_nqn.clone(), c.secure))
                .collect();
            seen.sort();
            let want = vec![(KEYED.to_string(), true), (PLAIN.to_string(), false)];
            if seen == want {
                Ok(())
            } else {
                Err(format!("connections {seen:?}"))
            }
        },
    )
    .await;

    let reply = admin
        .subsystem_set(proto::SubsystemSetRequest {
            nqn: SUBNQN.into(),
            require_tls: Some(true),
        })
        .await
        .expect("require TLS")
        .into_inner();
    assert!(reply.message.contains(PLAIN), "{}", reply.message);
    assert!(!reply.message.contains(KEYED), "{}", reply.message);

    // The plain controller is closed: its commands fail from then on.
    poll_until(
        Duration::from_secs(10),
        Duration::from_millis(200),
        async || match in_clear.keep_alive().await {
            Err(_) => Ok(()),
            Ok(()) => Err("the plain controller still answers".to_string()),
        },
    )
    .await;
    over_tls
        .keep_alive()
        .await
        .expect("the controller over TLS stays");
    let e = try_connect_admin(loopback(plain), &attach(PLAIN, SUBNQN))
        .await
        .expect_err("a plain reconnect");
    assert!(matches!(e, HostError::Nvme(_)), "{e}");
    assert_eq!(refusals(metrics, "tls_required"), 1.0);
    assert!(
        gateway
            .log_text()
            .contains("TLS requirement changed in the control plane"),
        "the change is logged"
    );
}

fn metric(metrics: u16, series: &str) -> f64 {
    let answer = http_exchange(
        loopback(metrics),
        b"GET /metrics HTTP/1.1\r\nHost: gw\r\n\r\n",
    );
    metric_value(&answer, series).unwrap_or(0.0)
}

/// Writes and reads back, byte for byte, I/O of many sizes: 512 B to 1 MiB (MDTS), so
/// records of every size up to TLS's 16 KiB and transfers of many records go both ways.
async fn bulk_round_trip(port: u16, a: &Attach, seed: u8) -> Result<(), HostError> {
    let host = try_connect(loopback(port), a).await?;
    let mut lba = 0u64;
    for (i, len) in [512usize, 4096, 16384, 16896, 65536, 131072, 1 << 20]
        .into_iter()
        .enumerate()
    {
        let data = pattern(len, seed.wrapping_add(i as u8));
        let blocks = (len / 512) as u32;
        host.io.write(1, lba, data.clone(), 512).await?;
        let back = host.io.read(1, lba, blocks, 512).await?;
        assert!(back == data, "{len} bytes at LBA {lba}: read back differs");
        lba += u64::from(blocks);
    }
    // Queue depth above one: eight 4 KiB reads in flight at once, each checked.
    let region = pattern(8 * 4096, seed ^ 0x5a);
    host.io.write(1, lba, region.clone(), 512).await?;
    let reads = (0..8u64).map(|i| host.io.read(1, lba + i * 8, 8, 512));
    for (i, r) in join_all(reads).await.into_iter().enumerate() {
        assert!(r? == region[i * 4096..][..4096], "read {i} at QD8 differs");
    }
    Ok(())
}

/// Polls all of `futures` together (the host pipelines what is submitted before any
/// completes), in order of their results.
async fn join_all<F: std::future::Future>(futures: impl Iterator<Item = F>) -> Vec<F::Output> {
    let mut pinned: Vec<_> = futures.map(Box::pin).collect();
    let mut done: Vec<Option<F::Output>> = (0..pinned.len()).map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (f, d) in pinned.iter_mut().zip(done.iter_mut()) {
            if d.is_none() {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => *d = Some(v),
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(())
        }
    })
    .await;
    done.into_iter().flatten().collect()
}

/// The data path after the handshake: kernel TLS where the kernel has it, else the relay;
/// with either, TLS_AES_128_GCM_SHA256 (identity versions 0 and 1) and TLS_AES_256_GCM_SHA384
/// carry writes and reads of every size byte for byte (busy polling on), the host's
/// close_notify (which kernel TLS reads as a non-data record: EIO) ends its connection
/// cleanly, and every secure connection is counted on exactly one of the two paths. With
/// NVMEOF_TEST_KTLS=required (tests/vm/ktls-check.sh, a kernel with the tls module) every
/// one must be kernel TLS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secure_queues_carry_data_by_kernel_tls_or_the_relay() {
    let (mut gateway, secure, _plain, metrics) = spawn(
        "tls-data",
        // Busy polling always on: under kernel TLS its peeks and non-blocking reads go
        // through the kernel's TLS receive path too.
        "tcp_busy_poll_us = 200\ntcp_busy_poll_adaptive = false",
    )
    .await;
    let required = std::env::var(KTLS_ENV).is_ok_and(|v| v == "required");
    for (version, seed) in [(0, 21), (1, 22)] {
        let offered = offer(&psk(0x31), KEYED, SUBNQN, version, LabelEncoding::Rfc8446);
        let suite = offered.suite;
        let proxy = tls_proxy(secure, offered).await;
        bulk_round_trip(proxy, &attach(KEYED, SUBNQN), seed)
            .await
            .unwrap_or_else(|e| panic!("identity v{version} over {suite}: {e}"));
    }
    let wide = tls_proxy_psk(secure, &psk384(0x35), WIDE, SUBNQN).await;
    bulk_round_trip(wide, &attach(WIDE, SUBNQN), 24)
        .await
        .unwrap_or_else(|e| panic!("TLS_AES_256_GCM_SHA384: {e}"));
    // Both controllers' hosts have left (the proxy sent close_notify for each queue): every queue
    // closes, and the gateway still serves.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while metric(metrics, "nvmeof_tcp_connections") > 0.0 {
        assert!(
            std::time::Instant::now() < deadline,
            "secure queues still open after their hosts left"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let proxy = tls_proxy(
        secure,
        offer(&psk(0x31), KEYED, SUBNQN, 0, LabelEncoding::Rfc8446),
    )
    .await;
    round_trip(proxy, &attach(KEYED, SUBNQN), 23)
        .await
        .expect("the gateway keeps serving");

    let handshakes = metric(metrics, "nvmeof_tls_handshakes_total");
    let ktls = metric(metrics, "nvmeof_tls_ktls_connections_total");
    let relay = metric(metrics, "nvmeof_tls_relay_connections_total");
    assert_eq!(handshakes, 8.0, "admin and I/O queue of four controllers");
    assert_eq!(ktls + relay, handshakes, "each connection on one path");
    assert_eq!(metric(metrics, "nvmeof_tls_ktls_aborted_total"), 0.0);
    let log = gateway.log_text();
    if required {
        assert_eq!((ktls, relay), (handshakes, 0.0), "{KTLS_ENV}=required");
        assert_eq!(log.matches("use kernel TLS").count(), 1, "said once");
        assert!(
            metric(metrics, "nvmeof_tcp_busy_poll_reads_total") > 0.0,
            "busy polling read from kernel TLS sockets"
        );
    } else {
        eprintln!("kernel TLS: {ktls} connections, relay: {relay}");
    }
    if relay > 0.0 {
        assert_eq!(log.matches("kernel TLS not used").count(), 1, "said once");
    }
    assert!(gateway.terminate().success());
}
