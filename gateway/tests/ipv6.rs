//! IPv6 with the Rust initiator (`nvmeof_gateway::host`) over loopback: a gateway listening
//! on [::1] or on the dual-stack wildcard [::], I/O over IPv6, and the discovery log's ADRFAM,
//! TRADDR and TRSVCID for each way a host can reach it. Skipped, with the reason printed,
//! on a machine without IPv6 loopback.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use nvmeof_gateway::config::Config;
use nvmeof_gateway::host::cmd::{DiscoveryEntry, DISCOVERY_NQN};
use nvmeof_gateway::host::{HostConnection, HostOptions};
use nvmeof_gateway::tcp::server::TcpServer;
use tokio::net::TcpListener;
use tokio::sync::watch;

const SUBNQN: &str = "nqn.2016-06.io.test:ipv6";
const HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:0f0f0f0f-0000-0000-0000-000000000006";
/// NVMF_TRTYPE_TCP, NVMF_ADDR_FAMILY_IP4/IP6 and NVME_NQN_NVME (include/linux/nvme.h).
const TRTYPE_TCP: u8 = 3;
const ADRFAM_IP4: u8 = 1;
const ADRFAM_IP6: u8 = 2;
const SUBTYPE_NVME: u8 = 2;

/// Why IPv6 loopback cannot be used here, if it cannot.
fn no_ipv6_loopback() -> Option<String> {
    match std::net::TcpListener::bind("[::1]:0") {
        Ok(_) => None,
        Err(e) => Some(format!("cannot bind [::1]: {e}")),
    }
}

macro_rules! require_ipv6 {
    () => {
        if let Some(reason) = no_ipv6_loopback() {
            eprintln!("SKIPPED: no IPv6 loopback on this machine ({reason})");
            return;
        }
    };
}

/// A gateway whose one listener is `ip` on a free port, configured the way a user writes
/// it ("[::1]:PORT"), so the discovery log carries the configured address and port.
struct Gateway {
    port: u16,
    _shutdown: watch::Sender<bool>,
}

async fn start(ip: IpAddr) -> Gateway {
    let socket = TcpListener::bind(SocketAddr::new(ip, 0))
        .await
        .expect("bind a free port");
    let port = socket.local_addr().expect("local address").port();
    let config = Config::from_toml_str(&format!(
        r#"
        [[listener]]
        transport = "tcp"
        address = "{}"

        [[subsystem]]
        nqn = "{SUBNQN}"
        allow_any_host = true

        [[subsystem.namespace]]
        nsid = 1
        backend = "memory"
        size = "4MiB"
        "#,
        SocketAddr::new(ip, port)
    ))
    .expect("valid configuration");
    let target: Arc<_> = config.build_target().expect("target");
    let (shutdown, rx) = watch::channel(false);
    tokio::spawn(TcpServer::from_listener(socket, target).serve(rx));
    Gateway {
        port,
        _shutdown: shutdown,
    }
}

fn opts() -> HostOptions {
    let mut o = HostOptions::new(HOSTNQN);
    o.timeout = Duration::from_secs(10);
    o
}

/// The discovery log's NVM subsystem entries, read over a connection to `addr`.
async fn discover(addr: SocketAddr) -> Vec<DiscoveryEntry> {
    let d = HostConnection::connect(addr, opts()).await.expect("dial");
    d.connect_admin(DISCOVERY_NQN, 0)
        .await
        .expect("discovery connect");
    d.enable_controller().await.expect("enable");
    let log = d.discovery_log().await.expect("discovery log");
    assert_eq!(log.numrec as usize, log.entries.len(), "{log:?}");
    log.entries
        .into_iter()
        .filter(|e| e.subtype == SUBTYPE_NVME && e.subnqn == SUBNQN)
        .collect()
}

/// Writes and reads back a pattern on an I/O queue over a connection to `addr`.
async fn write_read(addr: SocketAddr, seed: u8) {
    let admin = HostConnection::connect(addr, opts()).await.expect("dial");
    let cntlid = admin.connect_admin(SUBNQN, 30_000).await.expect("connect");
    admin.enable_controller().await.expect("enable");
    let ctrl = admin.identify_controller().await.expect("identify");
    let bs = admin
        .identify_namespace(1)
        .await
        .expect("id-ns")
        .block_size();
    let q = HostConnection::connect(addr, opts())
        .await
        .expect("dial io");
    q.set_in_capsule_data_max(ctrl.in_capsule_data_max());
    q.connect_io(SUBNQN, cntlid, 1, 31)
        .await
        .expect("io connect");
    for (slba, len) in [(0u64, bs as usize), (8, 128 * 1024)] {
        let data: Vec<u8> = (0..len)
            .map(|i| (i as u8).wrapping_mul(31) ^ seed ^ (i >> 9) as u8)
            .collect();
        q.write(1, slba, data.clone(), bs).await.expect("write");
        let back = q
            .read(1, slba, (len / bs as usize) as u32, bs)
            .await
            .expect("read");
        assert!(
            back == data,
            "{len} bytes at LBA {slba} read back differently"
        );
    }
}

#[tokio::test]
async fn io_and_discovery_over_ipv6_loopback() {
    require_ipv6!();
    let gw = start("::1".parse().unwrap()).await;
    let addr: SocketAddr = format!("[::1]:{}", gw.port).parse().unwrap();
    write_read(addr, 1).await;
    let entries = discover(addr).await;
    assert_eq!(entries.len(), 1, "{entries:?}");
    let e = &entries[0];
    assert_eq!(e.trtype, TRTYPE_TCP);
    assert_eq!(e.adrfam, ADRFAM_IP6, "{e:?}");
    assert_eq!(e.traddr, "::1", "no brackets: {e:?}");
    assert_eq!(e.trsvcid, gw.port.to_string());
}

#[tokio::test]
async fn a_wildcard_listener_is_listed_with_the_address_dialled() {
    require_ipv6!();
    let gw = start("::".parse().unwrap()).await;
    let v6: SocketAddr = format!("[::1]:{}", gw.port).parse().unwrap();
    write_read(v6, 2).await;
    let entries = discover(v6).await;
    assert_eq!(entries.len(), 1, "{entries:?}");
    assert_eq!(
        (entries[0].adrfam, entries[0].traddr.as_str()),
        (ADRFAM_IP6, "::1"),
        "[::] dialled at ::1: {entries:?}"
    );
    assert_eq!(entries[0].trsvcid, gw.port.to_string());

    // IPv4 through the same dual-stack socket: the gateway sees ::ffff:127.0.0.1 as its
    // local address and lists the IPv4 address the host dialled.
    let v4: SocketAddr = format!("127.0.0.1:{}", gw.port).parse().unwrap();
    if std::fs::read_to_string("/proc/sys/net/ipv6/bindv6only").is_ok_and(|v| v.trim() == "1") {
        eprintln!("SKIPPED the IPv4-mapped part: net.ipv6.bindv6only=1 ([::] is IPv6 only)");
        return;
    }
    write_read(v4, 3).await;
    let entries = discover(v4).await;
    assert_eq!(entries.len(), 1, "{entries:?}");
    assert_eq!(
        (entries[0].adrfam, entries[0].traddr.as_str()),
        (ADRFAM_IP4, "127.0.0.1"),
        "[::] dialled over IPv4: {entries:?}"
    );
}
