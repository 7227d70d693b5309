//! Mutual TLS for the control plane's gRPC (admins' `nvmeofctl`, gateways' agents and
//! `nvmeof-control` replicas), with rustls through tonic.
//!
//! One CA signs every party: the server presents its certificate and accepts only clients
//! whose certificate chains to the CA (client authentication is mandatory, not optional);
//! clients verify the server against the same CA. Without TLS files nothing changes: plain
//! HTTP/2, as before.
//!
//! The files are PEM: a certificate chain, its PKCS#8/PKCS#1/SEC1 private key, and the CA
//! certificate(s). They are read once at start; a restart picks up renewed certificates.

use std::error::Error as StdError;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity, ServerTlsConfig};

use crate::proto;
use crate::server::{AdminService, ControlPlane, GatewayService};

/// Why TLS could not be set up (bad options or unreadable files; never a peer's fault).
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{option}: cannot read {path}: {source}")]
    Read {
        option: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{0}")]
    Incomplete(String),
    #[error("{address}: {reason}")]
    Address { address: String, reason: String },
    #[error("TLS configuration refused: {0}")]
    Config(String),
}

/// The PEM files given on a command line, in the environment or in a configuration file.
/// The option names in errors are those of the command-line flags.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsFiles {
    /// CA certificate(s): the server verifies clients against it, clients the server.
    pub ca: Option<PathBuf>,
    /// This party's certificate (chain).
    pub cert: Option<PathBuf>,
    /// This party's private key.
    pub key: Option<PathBuf>,
}

impl TlsFiles {
    /// No file given: plain gRPC.
    pub fn is_empty(&self) -> bool {
        self.ca.is_none() && self.cert.is_none() && self.key.is_none()
    }
}

fn read(option: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        option,
        path: path.to_path_buf(),
        source,
    })
}

/// The server side: None without files (plain gRPC); with files, all three are needed
/// (the certificate and key the server presents, and the CA that clients' certificates must
/// chain to). The PEM contents are checked when the server is built ([`serve`]).
pub fn server_tls_config(files: &TlsFiles) -> Result<Option<ServerTlsConfig>, TlsError> {
    if files.is_empty() {
        return Ok(None);
    }
    let (Some(ca), Some(cert), Some(key)) = (&files.ca, &files.cert, &files.key) else {
        return Err(TlsError::Incomplete(
            "mTLS needs --tls-cert, --tls-key and --tls-ca together (the server's \
             certificate and key, and the CA that signs the clients' certificates)"
                .into(),
        ));
    };
    let identity = Identity::from_pem(read("--tls-cert", cert)?, read("--tls-key", key)?);
    let ca = Certificate::from_pem(read("--tls-ca", ca)?);
    let config = ServerTlsConfig::new()
        .identity(identity)
        .client_ca_root(ca)
        .client_auth_optional(false);
    // Parse the PEM now (tonic does it when the server is built): a bad file is reported
    // before the replica joins the group, not once it already holds the lease.
    tonic::transport::Server::builder()
        .tls_config(config.clone())
        .map_err(|e| TlsError::Config(chain(&e)))?;
    Ok(Some(config))
}

/// The client side: None without files; with files the CA is needed (to verify the server),
/// and the certificate and key go together (a server with mTLS refuses a client without
/// them). `server_name`: the name to verify in the server's certificate when it is not the
/// host part of the address (e.g. the certificate names `control.example` but the address
/// is an IP).
pub fn client_tls_config(
    files: &TlsFiles,
    server_name: Option<&str>,
) -> Result<Option<ClientTlsConfig>, TlsError> {
    if files.is_empty() {
        return Ok(None);
    }
    let Some(ca) = &files.ca else {
        return Err(TlsError::Incomplete(
            "--tls-ca is needed with --tls-cert/--tls-key (the CA that signed the control \
             plane's certificate)"
                .into(),
        ));
    };
    let mut config =
        ClientTlsConfig::new().ca_certificate(Certificate::from_pem(read("--tls-ca", ca)?));
    match (&files.cert, &files.key) {
        (Some(cert), Some(key)) => {
            config = config.identity(Identity::from_pem(
                read("--tls-cert", cert)?,
                read("--tls-key", key)?,
            ));
        }
        (None, None) => {}
        _ => {
            return Err(TlsError::Incomplete(
                "--tls-cert and --tls-key go together".into(),
            ))
        }
    }
    if let Some(name) = server_name {
        config = config.domain_name(name);
    }
    Ok(Some(config))
}

/// An endpoint for one control-plane address (`host:port`, `[v6]:port`, or a URL): `http://`
/// without TLS, `https://` with it. A scheme that contradicts the TLS setting is refused
/// rather than silently sending the request in the clear. Callers add their timeouts and
/// `connect()` or `connect_lazy()`.
pub fn client_endpoint(address: &str, tls: Option<&ClientTlsConfig>) -> Result<Endpoint, TlsError> {
    let bad = |reason: String| TlsError::Address {
        address: address.to_string(),
        reason,
    };
    let url = match (address.split_once("://"), tls) {
        (None, None) => format!("http://{address}"),
        (None, Some(_)) => format!("https://{address}"),
        (Some(("http", _)), None) | (Some(("https", _)), Some(_)) => address.to_string(),
        (Some(("http", _)), Some(_)) => {
            return Err(bad(
                "http:// with TLS options; use https:// or the bare host:port".into(),
            ))
        }
        (Some(("https", _)), None) => {
            return Err(bad(
                "https:// needs --tls-ca (and --tls-cert/--tls-key)".into()
            ))
        }
        (Some((scheme, _)), _) => return Err(bad(format!("unknown scheme {scheme}://"))),
    };
    let endpoint = Endpoint::from_shared(url).map_err(|e| bad(e.to_string()))?;
    match tls {
        Some(config) => endpoint
            .tls_config(config.clone())
            .map_err(|e| TlsError::Config(chain(&e))),
        None => Ok(endpoint),
    }
}

/// Serves the admin, gateway and ceph-nvmeof API services on `listener`, with mTLS when `tls` is Some (the
/// same services as [`crate::server::serve`], which is what runs without TLS). A client
/// whose handshake fails (no certificate, one not signed by the CA) is dropped before any
/// request is read; the server goes on serving the others.
pub async fn serve(
    cp: Arc<ControlPlane>,
    listener: tokio::net::TcpListener,
    tls: Option<ServerTlsConfig>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), tonic::transport::Error> {
    let Some(tls) = tls else {
        return crate::server::serve(cp, listener, shutdown).await;
    };
    tonic::transport::Server::builder()
        .tls_config(tls)?
        .add_service(proto::admin_server::AdminServer::new(AdminService(
            cp.clone(),
        )))
        .add_service(proto::gateway_control_server::GatewayControlServer::new(
            GatewayService(cp.clone()),
        ))
        .add_service(crate::ceph_api::service(cp))
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::TcpListenerStream::new(listener),
            shutdown,
        )
        .await
}

/// An error and its causes, `outer: inner: innermost` (tonic's transport errors say only
/// "transport error" themselves).
pub fn chain(error: &(dyn StdError + 'static)) -> String {
    let mut text = error.to_string();
    let mut current = error.source();
    while let Some(e) = current {
        let cause = e.to_string();
        if !text.ends_with(&cause) {
            text.push_str(": ");
            text.push_str(&cause);
        }
        current = e.source();
    }
    text
}

/// A TLS failure in an error's source chain, described for a person (the handshake was
/// refused: no certificate, an unknown CA, an expired or misnamed certificate), or None
/// when the error is not about TLS.
pub fn tls_failure(error: &(dyn StdError + 'static)) -> Option<String> {
    let mut current: Option<&(dyn StdError + 'static)> = Some(error);
    while let Some(e) = current {
        let text = e.to_string();
        let lower = text.to_ascii_lowercase();
        if lower.contains("certificate")
            || lower.contains("fatal alert")
            || lower.contains("handshake")
            || lower.contains("tls")
        {
            return Some(text);
        }
        current = e.source();
    }
    None
}
