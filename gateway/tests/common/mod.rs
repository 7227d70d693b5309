//! Shared by the integration tests: an in-process gateway on an ephemeral loopback port.

#![allow(dead_code)]

use std::net::SocketAddr;

use nvmeof_gateway::config::Config;
use nvmeof_gateway::tcp::server::TcpServer;
use tokio::sync::watch;

/// A running gateway; dropping `shutdown` (or sending `true`) stops it.
pub struct TestGateway {
    pub addr: SocketAddr,
    pub shutdown: watch::Sender<bool>,
    pub server: tokio::task::JoinHandle<()>,
}

/// Starts a gateway serving `subnqn` with one in-memory namespace of `size` to any host.
pub async fn start_gateway(subnqn: &str, size: &str) -> TestGateway {
    let config = Config::from_toml_str(&format!(
        r#"
        [[listener]]
        transport = "tcp"
        address = "127.0.0.1"
        port = 4420

        [[subsystem]]
        nqn = "{subnqn}"
        allow_any_host = true

        [[subsystem.namespace]]
        nsid = 1
        backend = "memory"
        size = "{size}"
        "#
    ))
    .expect("valid test configuration");
    let target = config.build_target().expect("target");
    let server = TcpServer::bind("127.0.0.1:0".parse().expect("address"), target)
        .await
        .expect("bind an ephemeral port");
    let addr = server.local_addr().expect("local address");
    let (shutdown, rx) = watch::channel(false);
    let server = tokio::spawn(server.serve(rx));
    TestGateway {
        addr,
        shutdown,
        server,
    }
}
