//! NVMe/TCP secure channels: TLS 1.3 with an external pre-shared key on the connections of
//! a secure listener (NVMe/TCP transport specification 3.6), as the Linux host (kernel
//! 6.7+, the handshake done by ktls-utils' `tlshd`) and Linux nvmet speak it.
//!
//! The handshake comes first, before the ICReq: TLS 1.3 only (a TLS 1.2 offer is refused),
//! the cipher suites TLS_AES_128_GCM_SHA256 and TLS_AES_256_GCM_SHA384, no certificate and
//! so no handshake without a PSK, no session tickets (an NVMe queue is never resumed). The
//! PSK is found from the identity the host offers (`NVMe0R01 <hostnqn> <subnqn>` ...; see
//! `nvme_auth::tls_psk`): the host's configured key in that subsystem, derived for that
//! identity. A handshake that fails (no such host or key, a wrong key, a malformed or
//! truncated ClientHello, plaintext NVMe/TCP, a stall past [`HANDSHAKE_TIMEOUT`]) closes that
//! connection only.
//!
//! After it, where the kernel can, the session keys go to the socket (kernel TLS, see
//! [`super::ktls`]) and the connection is served on it exactly as on a plain listener.
//! Where it cannot (no `tls` module, OpenSSL holding bytes past the handshake), the same
//! [`Connection`] serves the queue over a loopback socket pair, and this task relays between
//! the TLS stream and the pair (decrypting into, and encrypting out of, user-space buffers):
//! the plain path stays untouched and such a TLS queue pays two more copies per I/O. The
//! queue carries the identity's NQNs, and its Connect must name the same host and subsystem
//! (`core::tls`).

use std::net::{Ipv4Addr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use nvme_auth::tls_psk::{PskIdentity, TlsPsk};
use openssl::error::ErrorStack;
use openssl::ex_data::Index;
use openssl::ssl::{
    Ssl, SslContext, SslContextBuilder, SslMethod, SslOptions, SslRef, SslSessionCacheMode,
    SslVersion,
};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio_openssl::SslStream;

use super::busy_poll::BusyPollConfig;
use super::connection::Connection;
use super::ktls::{self, TrafficSecrets};
use super::tls_ffi;
use crate::core::tls::{tls_psk_for, SecureChannel};
use crate::core::{DataBudget, Target};

/// How long a host has to complete the handshake: a peer that opens a connection and says
/// nothing (or dribbles a ClientHello) holds a task and a socket for this long at most.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// The cipher suites NVMe/TCP allows (TP 8011: TLS_AES_128_GCM_SHA256 is mandatory,
/// TLS_AES_256_GCM_SHA384 recommended).
const CIPHER_SUITES: &str = "TLS_AES_128_GCM_SHA256:TLS_AES_256_GCM_SHA384";
/// Relay buffer per direction: a 1 MiB write crosses in few turns.
const RELAY_BUFFER: usize = 256 * 1024;
/// After the queue closes, how long its last bytes (a C2HTermReq) may take to reach the host.
const CLOSE_GRACE: Duration = Duration::from_secs(1);

/// Handshake outcomes since start (exported as metrics).
#[derive(Debug, Default)]
pub struct TlsStats {
    pub handshakes: AtomicU64,
    pub handshake_failures: AtomicU64,
}

static STATS: TlsStats = TlsStats {
    handshakes: AtomicU64::new(0),
    handshake_failures: AtomicU64::new(0),
};

pub fn stats() -> &'static TlsStats {
    &STATS
}

/// Where the PSK lookup finds the target (the context's) and leaves the identity it
/// accepted (the connection's).
struct ExIndexes {
    target: Index<SslContext, Arc<Target>>,
    identity: Index<Ssl, PskIdentity>,
    /// The application traffic secrets the key log gives, for kernel TLS.
    secrets: Index<Ssl, ktls::SecretSlot>,
}

fn ex_indexes() -> Result<&'static ExIndexes, ErrorStack> {
    static INDEXES: OnceLock<ExIndexes> = OnceLock::new();
    if let Some(indexes) = INDEXES.get() {
        return Ok(indexes);
    }
    let indexes = ExIndexes {
        target: SslContext::new_ex_index()?,
        identity: Ssl::new_ex_index()?,
        secrets: Ssl::new_ex_index()?,
    };
    Ok(INDEXES.get_or_init(|| indexes))
}

/// Why a secure connection was not served.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("TLS setup failed: {0}")]
    Setup(#[from] ErrorStack),
    #[error("TLS handshake failed: {0}")]
    Handshake(String),
    #[error("TLS handshake not completed within {HANDSHAKE_TIMEOUT:?}")]
    Timeout,
    #[error("the handshake completed without an NVMe PSK identity")]
    NoIdentity,
    #[error("socket: {0}")]
    Io(#[from] std::io::Error),
}

/// The TLS server side of the secure listeners of one target.
pub struct TlsAcceptor {
    context: SslContext,
}

impl std::fmt::Debug for TlsAcceptor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsAcceptor").finish_non_exhaustive()
    }
}

impl TlsAcceptor {
    /// Hosts' PSKs are looked up in `target` at each handshake, so key changes apply to
    /// the next connection.
    pub fn new(target: Arc<Target>) -> Result<Self, ErrorStack> {
        let indexes = ex_indexes()?;
        let mut builder = SslContextBuilder::new(SslMethod::tls_server())?;
        builder.set_min_proto_version(Some(SslVersion::TLS1_3))?;
        builder.set_max_proto_version(Some(SslVersion::TLS1_3))?;
        builder.set_ciphersuites(CIPHER_SUITES)?;
        builder.set_num_tickets(0)?;
        builder.set_session_cache_mode(SslSessionCacheMode::OFF);
        builder.set_options(SslOptions::NO_TICKET);
        builder.set_ex_data(indexes.target, target);
        tls_ffi::set_psk_finder(&mut builder, find_psk);
        // Kernel TLS starts at record 0: OpenSSL must not read records past the client's
        // Finished (off is OpenSSL's default; said here because kTLS depends on it).
        builder.set_read_ahead(false);
        builder.set_keylog_callback(keylog);
        Ok(Self {
            context: builder.build(),
        })
    }

    /// Runs the server handshake on `stream`; the identity the host was accepted with and
    /// the application traffic secrets (for kernel TLS; drop them when done).
    pub async fn handshake(
        &self,
        stream: TcpStream,
    ) -> Result<(SslStream<TcpStream>, PskIdentity, TrafficSecrets), TlsError> {
        let indexes = ex_indexes()?;
        let mut ssl = Ssl::new(&self.context)?;
        ssl.set_ex_data(indexes.secrets, ktls::SecretSlot::default());
        let mut tls = SslStream::new(ssl, stream)?;
        match tokio::time::timeout(HANDSHAKE_TIMEOUT, Pin::new(&mut tls).accept()).await {
            Err(_) => return Err(TlsError::Timeout),
            Ok(Err(e)) => return Err(TlsError::Handshake(e.to_string())),
            Ok(Ok(())) => {}
        }
        // Out of the SSL at once: what stays in it lives as long as the relay.
        let secrets = tls
            .ssl()
            .ex_data(indexes.secrets)
            .map(ktls::take)
            .unwrap_or_default();
        let identity = tls
            .ssl()
            .ex_data(indexes.identity)
            .cloned()
            .ok_or(TlsError::NoIdentity)?;
        Ok((tls, identity, secrets))
    }
}

/// A TLS 1.3 client offering `identity` with `psk` (either hash: TLS_AES_128_GCM_SHA256
/// or TLS_AES_256_GCM_SHA384), as a Linux host's tlshd does; for tests and benches, which
/// relay the Rust host's bytes through it.
pub async fn connect_with_psk(
    stream: TcpStream,
    identity: &PskIdentity,
    psk: TlsPsk,
) -> Result<SslStream<TcpStream>, TlsError> {
    let mut builder = SslContextBuilder::new(SslMethod::tls_client())?;
    builder.set_min_proto_version(Some(SslVersion::TLS1_3))?;
    builder.set_max_proto_version(Some(SslVersion::TLS1_3))?;
    builder.set_ciphersuites(psk.hash().cipher_suite())?;
    let mut ssl = Ssl::new(&builder.build())?;
    tls_ffi::offer_psk(&mut ssl, identity.to_string().as_bytes(), psk)?;
    let mut tls = SslStream::new(ssl, stream)?;
    match tokio::time::timeout(HANDSHAKE_TIMEOUT, Pin::new(&mut tls).connect()).await {
        Err(_) => Err(TlsError::Timeout),
        Ok(Err(e)) => Err(TlsError::Handshake(e.to_string())),
        Ok(Ok(())) => Ok(tls),
    }
}

/// OpenSSL's key-log callback: the application traffic secrets go to the connection's own
/// slot (nothing else is kept, nothing is written anywhere).
fn keylog(ssl: &SslRef, line: &str) {
    let Ok(indexes) = ex_indexes() else {
        return;
    };
    if let Some(slot) = ssl.ex_data(indexes.secrets) {
        ktls::on_keylog_line(ssl, slot, line);
    }
}

/// The PSK lookup OpenSSL calls with the identity of the ClientHello (see `tls_ffi`). The
/// identity is not secret (it travels in clear); keys never leave this function but into
/// the session.
fn find_psk(ssl: &mut SslRef, identity: &[u8]) -> Option<TlsPsk> {
    let indexes = ex_indexes().ok()?;
    let Ok(parsed) = PskIdentity::parse(identity) else {
        tracing::debug!(
            identity = %String::from_utf8_lossy(identity),
            "TLS: not an NVMe PSK identity"
        );
        return None;
    };
    let target = ssl.ssl_context().ex_data(indexes.target)?.clone();
    let Some(psk) = tls_psk_for(&target, &parsed) else {
        tracing::debug!(identity = %parsed, "TLS: no PSK for this identity");
        return None;
    };
    ssl.set_ex_data(indexes.identity, parsed);
    Some(psk)
}

/// Serves one connection of a secure listener: handshake, then the NVMe/TCP queue on the
/// socket with kernel TLS, or over the relay, until either side closes.
pub async fn serve_secure(
    acceptor: Arc<TlsAcceptor>,
    stream: TcpStream,
    target: Arc<Target>,
    budget: &'static DataBudget,
    busy_poll: Option<BusyPollConfig>,
    shutdown: watch::Receiver<bool>,
) {
    let peer = stream.peer_addr().ok();
    let local = stream.local_addr().ok();
    let _ = stream.set_nodelay(true);
    let (tls, identity, secrets) = match acceptor.handshake(stream).await {
        Ok(done) => done,
        Err(e) => {
            stats().handshake_failures.fetch_add(1, Ordering::Relaxed);
            // Debug: a scanner or a host without the key must not flood the log; the
            // failures are counted.
            tracing::debug!(peer = ?peer, error = %e, "TLS connection refused");
            return;
        }
    };
    stats().handshakes.fetch_add(1, Ordering::Relaxed);
    tracing::debug!(peer = ?peer, identity = %identity, cipher = tls.ssl().current_cipher().map(|c| c.name()).unwrap_or("?"), "TLS handshake done");
    let suite = tls
        .ssl()
        .current_cipher()
        .map_or([0, 0], |c| c.protocol_id());
    let buffered = tls_ffi::has_pending(tls.ssl()) || tls.ssl().pending() > 0;
    let outcome = ktls::install(tls.get_ref(), suite, secrets, buffered);
    ktls::note(&outcome);
    match outcome {
        ktls::Outcome::Kernel(socket) => {
            // The TLS stream goes without a word (no close_notify: the kernel owns the
            // session now); its descriptor closes, the duplicate carries the connection.
            drop(tls);
            let std_stream = std::net::TcpStream::from(socket);
            let stream = match std_stream
                .set_nonblocking(true)
                .and_then(|()| TcpStream::from_std(std_stream))
            {
                Ok(stream) => stream,
                Err(e) => {
                    tracing::warn!(peer = ?peer, error = %e, "TLS connection dropped: its kernel TLS socket could not be registered");
                    return;
                }
            };
            // Exactly what a plain listener runs. A record the kernel does not decrypt as
            // data (an alert such as close_notify, a KeyUpdate) fails the read with EIO,
            // which closes the queue like the host leaving.
            Connection::new(stream, target, budget)
                .with_secure_channel(SecureChannel::from(&identity))
                .with_busy_poll(busy_poll)
                .run(shutdown)
                .await;
            return;
        }
        ktls::Outcome::Abort(_) => return,
        ktls::Outcome::Fallback(_) => {}
    }
    let (queue_end, relay_end) = match loopback_pair().await {
        Ok(pair) => pair,
        Err(e) => {
            tracing::warn!(peer = ?peer, error = %e, "TLS connection dropped: no loopback pair for its relay");
            return;
        }
    };
    let peer_name = peer.map_or_else(|| "unknown".into(), |p| p.to_string());
    let connection =
        Connection::with_addresses(queue_end, peer_name, local.map(|a| a.ip()), target, budget)
            .with_secure_channel(SecureChannel::from(&identity));
    let queue = connection.run(shutdown);
    let relay = relay(tls, relay_end);
    tokio::pin!(queue);
    tokio::pin!(relay);
    tokio::select! {
        _ = &mut queue => {
            // Let the queue's last bytes through, then close the TLS connection.
            let _ = tokio::time::timeout(CLOSE_GRACE, relay).await;
        }
        _ = &mut relay => {
            // The host left (or the TLS stream failed): the queue sees its socket close.
            queue.await;
        }
    }
}

/// Moves bytes both ways until both are done or one fails.
async fn relay(mut tls: SslStream<TcpStream>, mut plain: TcpStream) {
    if let Err(e) =
        tokio::io::copy_bidirectional_with_sizes(&mut tls, &mut plain, RELAY_BUFFER, RELAY_BUFFER)
            .await
    {
        tracing::debug!(error = %e, "TLS relay ended");
    }
}

/// A connected pair of loopback sockets. The accepted end must be the one this function
/// connected (another local process could race to the ephemeral listener and would
/// otherwise speak for the TLS host).
async fn loopback_pair() -> std::io::Result<(TcpStream, TcpStream)> {
    let listener = TcpListener::bind(SocketAddr::from((Ipv4Addr::LOCALHOST, 0))).await?;
    let addr = listener.local_addr()?;
    let (dialled, (accepted, from)) =
        tokio::try_join!(TcpStream::connect(addr), listener.accept())?;
    if dialled.local_addr()? != from {
        return Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            "another socket connected to the relay's listener first",
        ));
    }
    let _ = dialled.set_nodelay(true);
    Ok((accepted, dialled))
}
