//! NVMe/TCP listeners: accept connections and run each on its own task.

use super::busy_poll::BusyPollConfig;
use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;

use super::connection::Connection;
use super::tls::TlsAcceptor;
use crate::core::{DataBudget, Target};

/// A bound NVMe/TCP listener.
pub struct TcpServer {
    listener: TcpListener,
    target: Arc<Target>,
    busy_poll: Option<BusyPollConfig>,
    data_budget: &'static DataBudget,
    /// A secure listener: every connection starts with a TLS handshake.
    tls: Option<Arc<TlsAcceptor>>,
}

impl TcpServer {
    pub async fn bind(addr: SocketAddr, target: Arc<Target>) -> std::io::Result<Self> {
        let listener = TcpListener::bind(addr).await?;
        Ok(Self {
            listener,
            target,
            busy_poll: None,
            data_budget: super::data_budget(),
            tls: None,
        })
    }

    /// Serves on a socket the caller bound (a test that needs the port before it builds the
    /// target's configuration).
    pub fn from_listener(listener: TcpListener, target: Arc<Target>) -> Self {
        Self {
            listener,
            target,
            busy_poll: None,
            data_budget: super::data_budget(),
            tls: None,
        }
    }

    /// Makes this a secure listener: TLS 1.3 with the hosts' PSKs before anything else
    /// (see [`super::tls`]); connections that do not complete the handshake are closed.
    pub fn with_tls(mut self, acceptor: Arc<TlsAcceptor>) -> Self {
        self.tls = Some(acceptor);
        self
    }

    /// Connections poll their socket this long after a command before they sleep
    /// (`[gateway] tcp_busy_poll_us` and `tcp_busy_poll_adaptive`; `None`, as a server is
    /// built: never; the daemon passes what its configuration says, adaptive by default).
    pub fn with_busy_poll(mut self, busy_poll: Option<BusyPollConfig>) -> Self {
        self.busy_poll = busy_poll;
        self
    }

    /// The connections' data buffers count against `budget` instead of the process-wide
    /// [`super::data_budget`] (a test that needs a small one of its own).
    pub fn with_data_budget(mut self, budget: &'static DataBudget) -> Self {
        self.data_budget = budget;
        self
    }

    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Accepts until `shutdown` turns true, then waits for every connection to close.
    pub async fn serve(self, mut shutdown: watch::Receiver<bool>) {
        let addr = self.local_addr().map(|a| a.to_string()).unwrap_or_default();
        tracing::info!(%addr, "NVMe/TCP listener ready");
        let mut connections = JoinSet::new();
        loop {
            tokio::select! {
                _ = shutdown.changed() => break,
                accepted = self.listener.accept() => match accepted {
                    Ok((stream, _)) => match &self.tls {
                        None => {
                            let conn = Connection::new(stream, self.target.clone(), self.data_budget)
                                .with_busy_poll(self.busy_poll);
                            connections.spawn(conn.run(shutdown.clone()));
                        }
                        Some(tls) => {
                            connections.spawn(super::tls::serve_secure(
                                tls.clone(),
                                stream,
                                self.target.clone(),
                                self.data_budget,
                                self.busy_poll,
                                shutdown.clone(),
                            ));
                        }
                    },
                    Err(e) => {
                        // Out of file descriptors and the like: keep serving the others.
                        tracing::warn!(%addr, error = %e, "accept failed");
                        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    }
                },
                Some(_) = connections.join_next(), if !connections.is_empty() => {}
            }
        }
        while connections.join_next().await.is_some() {}
        tracing::info!(%addr, "NVMe/TCP listener stopped");
    }
}
