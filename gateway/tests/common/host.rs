//! The Rust NVMe/TCP host (`nvmeof_gateway::host`) attached to a gateway's subsystem, and
//! the waits on what it reads there: ANA states, active namespaces, discovery log entries.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use nvmeof_gateway::auth::DhchapSecret;
use nvmeof_gateway::host::cmd::DiscoveryEntry;
use nvmeof_gateway::host::{HostConnection, HostError, HostOptions};
use nvmeof_gateway::spec::{log, DISCOVERY_NQN};

use super::{loopback, poll_until};

/// How a host attaches to a subsystem.
#[derive(Debug, Clone)]
pub struct Attach {
    pub host_nqn: String,
    pub subsystem_nqn: String,
    /// Per-command timeout (RBD I/O through a failing-over group may take long).
    pub command_timeout: Duration,
    /// Keep Alive Timeout given at Connect.
    pub keep_alive_ms: u32,
    /// SQSIZE of the I/O queue (0's based).
    pub io_sqsize: u16,
    /// The host's DH-HMAC-CHAP secret, and the controller's when the host asks the
    /// gateway to prove itself (`nvme connect --dhchap-secret`, `--dhchap-ctrl-secret`).
    pub dhchap_secret: Option<DhchapSecret>,
    pub dhchap_ctrl_secret: Option<DhchapSecret>,
}

impl Attach {
    /// Defaults: 60 s commands, 120 s keep-alive, one I/O queue of 32 entries.
    pub fn new(host_nqn: &str, subsystem_nqn: &str) -> Attach {
        Attach {
            host_nqn: host_nqn.into(),
            subsystem_nqn: subsystem_nqn.into(),
            command_timeout: Duration::from_secs(60),
            keep_alive_ms: 120_000,
            io_sqsize: 31,
            dhchap_secret: None,
            dhchap_ctrl_secret: None,
        }
    }

    pub fn options(&self) -> HostOptions {
        let mut o = HostOptions::new(self.host_nqn.as_str());
        o.timeout = self.command_timeout;
        o.dhchap_secret = self.dhchap_secret.clone();
        o.dhchap_ctrl_secret = self.dhchap_ctrl_secret.clone();
        o
    }
}

/// A host's controller on a subsystem: its admin queue and one I/O queue (QID 1).
pub struct HostQueues {
    pub admin: HostConnection,
    pub io: HostConnection,
}

/// Connects an admin queue to the subsystem and enables the controller (one attempt);
/// returns the queue and the controller ID.
pub async fn try_connect_admin(
    addr: SocketAddr,
    attach: &Attach,
) -> Result<(HostConnection, u16), HostError> {
    let admin = HostConnection::connect(addr, attach.options()).await?;
    let cntlid = admin
        .connect_admin(&attach.subsystem_nqn, attach.keep_alive_ms)
        .await?;
    admin.enable_controller().await?;
    Ok((admin, cntlid))
}

/// Connects the admin queue and one I/O queue (sending in-capsule data up to what the
/// controller announces), one attempt.
pub async fn try_connect(addr: SocketAddr, attach: &Attach) -> Result<HostQueues, HostError> {
    let (admin, cntlid) = try_connect_admin(addr, attach).await?;
    let ctrl = admin.identify_controller().await?;
    let io = HostConnection::connect(addr, attach.options()).await?;
    io.set_in_capsule_data_max(ctrl.in_capsule_data_max());
    io.connect_io(&attach.subsystem_nqn, cntlid, 1, attach.io_sqsize)
        .await?;
    Ok(HostQueues { admin, io })
}

/// [`try_connect`] to 127.0.0.1:`port`, retried every 200 ms (a gateway process starting,
/// a subsystem not configured yet) for up to `within`.
pub async fn connect_within(port: u16, attach: &Attach, within: Duration) -> HostQueues {
    let addr = loopback(port);
    poll_until(within, Duration::from_millis(200), async || {
        try_connect(addr, attach)
            .await
            .map_err(|e| format!("cannot connect to {} on {addr}: {e}", attach.subsystem_nqn))
    })
    .await
}

/// ANA group → state, from the ANA log page (0Ch).
pub async fn ana_states(admin: &HostConnection) -> BTreeMap<u32, u8> {
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

/// Waits until the ANA log page reports every (group, state) of `want`; panics after `within`.
pub async fn wait_for_ana_states(admin: &HostConnection, want: &[(u32, u8)], within: Duration) {
    poll_until(within, Duration::from_millis(100), async || {
        let got = ana_states(admin).await;
        if want.iter().all(|(g, s)| got.get(g) == Some(s)) {
            Ok(())
        } else {
            Err(format!("ANA states {got:?}, expected {want:?}"))
        }
    })
    .await
}

/// Waits up to 20 s until the active namespace list is `want`.
pub async fn wait_for_namespaces(admin: &HostConnection, want: &[u32]) {
    poll_until(
        Duration::from_secs(20),
        Duration::from_millis(100),
        async || {
            let got = admin.active_namespaces(0).await.expect("namespace list");
            if got == want {
                Ok(())
            } else {
                Err(format!("active namespaces {got:?}, expected {want:?}"))
            }
        },
    )
    .await
}

/// The discovery log `host_nqn` reads from the gateway on 127.0.0.1:`port`.
pub async fn discovery_entries(port: u16, host_nqn: &str) -> Vec<DiscoveryEntry> {
    let d = HostConnection::connect(loopback(port), HostOptions::new(host_nqn))
        .await
        .expect("discovery connection");
    d.connect_admin(DISCOVERY_NQN, 30_000)
        .await
        .expect("discovery connect");
    d.enable_controller().await.expect("enable");
    d.discovery_log().await.expect("discovery log").entries
}
