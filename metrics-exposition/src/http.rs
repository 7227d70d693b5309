//! A minimal HTTP/1.1 endpoint for Prometheus and Kubernetes probes: `GET /metrics` answers the
//! exposition text, `GET /healthz` (liveness) and `GET /readyz` (readiness) answer 200 or 503
//! with a one-line reason, one request per connection.
//!
//! Only what a scraper sends is understood; anything else gets a 4xx answer and the
//! connection is closed. Requests are bounded in size and time, and connections in number,
//! so a stuck or hostile client cannot hold the gateway's resources.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};

/// The largest request head read (request line and headers).
const MAX_REQUEST_HEAD: usize = 8192;
/// A client must have sent its request and taken the answer within this time.
const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections served at once; more are closed at once.
const MAX_CONNECTIONS: usize = 32;
/// How long, and for how many bytes, a closing connection still reads what the client sends.
const LINGER: Duration = Duration::from_secs(1);
const LINGER_MAX_BYTES: usize = 1 << 20;
/// The content type of the text exposition format.
const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";
/// The content type of every other answer (health, errors).
const TEXT: &str = "text/plain; charset=utf-8";

/// Renders the exposition text; called once per scrape, on a runtime thread (it must not
/// block for long).
pub type Render = Arc<dyn Fn() -> String + Send + Sync>;

/// A health check, called once per probe on a runtime thread (it must not block): `Ok`, or
/// why not (one line; line breaks are replaced by spaces).
pub type Check = Arc<dyn Fn() -> Result<(), String> + Send + Sync>;

/// What `/healthz` and `/readyz` answer.
#[derive(Clone)]
pub struct HealthChecks {
    /// `/healthz`: the process is making progress (a failure makes Kubernetes restart it).
    pub live: Check,
    /// `/readyz`: the process does its job (a failure takes it out of the endpoints and holds
    /// a rolling update).
    pub ready: Check,
}

impl Default for HealthChecks {
    /// Alive and ready whenever the endpoint answers (a daemon that sets no checks).
    fn default() -> Self {
        HealthChecks {
            live: Arc::new(|| Ok(())),
            ready: Arc::new(|| Ok(())),
        }
    }
}

pub struct MetricsServer {
    listener: TcpListener,
    render: Render,
    health: HealthChecks,
}

impl MetricsServer {
    /// Listens on `addr`; each scrape answers what `render` returns then. A render that holds
    /// a daemon's state should hold it weakly: a slow client keeps its connection's handle
    /// until the exchange times out.
    pub async fn bind(addr: SocketAddr, render: Render) -> std::io::Result<Self> {
        Ok(MetricsServer {
            listener: TcpListener::bind(addr).await?,
            render,
            health: HealthChecks::default(),
        })
    }

    /// Answers `/healthz` and `/readyz` with these checks (default: always 200).
    pub fn with_health(mut self, health: HealthChecks) -> Self {
        self.health = health;
        self
    }

    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Serves scrapes until `shutdown` turns true or its sender goes.
    pub async fn serve(self, mut shutdown: watch::Receiver<bool>) {
        let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
        loop {
            let accepted = tokio::select! {
                _ = shutdown.changed() => return,
                accepted = self.listener.accept() => accepted,
            };
            let (stream, peer) = match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of file descriptors and the like: wait a little rather than spin.
                    tracing::warn!(error = %e, "metrics endpoint: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let Ok(slot) = slots.clone().try_acquire_owned() else {
                tracing::debug!(%peer, "metrics endpoint: too many connections, closing");
                continue;
            };
            let render = self.render.clone();
            let health = self.health.clone();
            tokio::spawn(async move {
                let exchanged = exchange(stream, || render(), &health);
                match tokio::time::timeout(EXCHANGE_TIMEOUT, exchanged).await {
                    Ok(Err(e)) => tracing::debug!(%peer, error = %e, "metrics request failed"),
                    Err(_) => tracing::debug!(%peer, "metrics request timed out"),
                    Ok(Ok(())) => {}
                }
                drop(slot);
            });
        }
    }
}

/// What a request head asks for.
#[derive(Debug, PartialEq, Eq)]
enum Request {
    Metrics { head_only: bool },
    Live { head_only: bool },
    Ready { head_only: bool },
    Index { head_only: bool },
    NotFound,
    MethodNotAllowed,
    Bad,
}

/// Parses the request line of `head` (the bytes up to the blank line). Headers are not
/// needed: one request per connection, no body.
fn parse(head: &[u8]) -> Request {
    let Ok(text) = std::str::from_utf8(head) else {
        return Request::Bad;
    };
    let line = text.lines().next().unwrap_or("");
    let mut parts = line.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Request::Bad;
    };
    if !version.starts_with("HTTP/1.") || !target.starts_with('/') {
        return Request::Bad;
    }
    let head_only = match method {
        "GET" => false,
        "HEAD" => true,
        _ => return Request::MethodNotAllowed,
    };
    // A scraper may add parameters (`?name[]=...`); they are ignored.
    match target.split('?').next().unwrap_or("") {
        "/metrics" => Request::Metrics { head_only },
        "/healthz" => Request::Live { head_only },
        "/readyz" => Request::Ready { head_only },
        "/" => Request::Index { head_only },
        _ => Request::NotFound,
    }
}

/// The answer to a probe: 200 with `ok`, or 503 with `failed` and the check's reason.
fn probe(check: &Check, ok: &str, failed: &str) -> (&'static str, String) {
    match check() {
        Ok(()) => ("200 OK", format!("{ok}\n")),
        Err(reason) => {
            // One line, whatever the check returned: probes log the body.
            let reason = reason.replace(['\r', '\n'], " ");
            ("503 Service Unavailable", format!("{failed}: {reason}\n"))
        }
    }
}

/// Reads one request head from `stream`, answers it (the body from `metrics` for
/// `/metrics`, from `health` for the probes) and closes.
async fn exchange<S>(
    mut stream: S,
    metrics: impl FnOnce() -> String,
    health: &HealthChecks,
) -> std::io::Result<()>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let mut head = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    let request = loop {
        if let Some(end) = find_head_end(&head) {
            break parse(&head[..end]);
        }
        if head.len() >= MAX_REQUEST_HEAD {
            break Request::Bad;
        }
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            // Closed before a whole request: nothing to answer.
            return Ok(());
        }
        head.extend_from_slice(&chunk[..n]);
    };
    let (status, content_type, extra, body, head_only) = match request {
        Request::Metrics { head_only } => ("200 OK", CONTENT_TYPE, "", metrics(), head_only),
        Request::Live { head_only } => {
            let (status, body) = probe(&health.live, "ok", "not alive");
            (status, TEXT, "", body, head_only)
        }
        Request::Ready { head_only } => {
            let (status, body) = probe(&health.ready, "ready", "not ready");
            (status, TEXT, "", body, head_only)
        }
        Request::Index { head_only } => (
            "200 OK",
            TEXT,
            "",
            "metrics at /metrics, liveness at /healthz, readiness at /readyz\n".to_string(),
            head_only,
        ),
        Request::NotFound => (
            "404 Not Found",
            TEXT,
            "",
            "not found: try /metrics, /healthz or /readyz\n".into(),
            false,
        ),
        Request::MethodNotAllowed => (
            "405 Method Not Allowed",
            TEXT,
            "Allow: GET, HEAD\r\n",
            "only GET and HEAD\n".into(),
            false,
        ),
        Request::Bad => ("400 Bad Request", TEXT, "", "bad request\n".into(), false),
    };
    let mut response = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n{extra}Connection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    if !head_only {
        response.extend_from_slice(body.as_bytes());
    }
    stream.write_all(&response).await?;
    stream.shutdown().await?;
    // Closing with unread request bytes would reset the connection, and the client could
    // lose the answer: read what it still sends for a moment, as web servers do.
    let mut discarded = 0;
    let _ = tokio::time::timeout(LINGER, async {
        while discarded < LINGER_MAX_BYTES {
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => break,
                Ok(n) => discarded += n,
            }
        }
    })
    .await;
    Ok(())
}

/// The length of the request head including its terminating blank line, once complete.
fn find_head_end(bytes: &[u8]) -> Option<usize> {
    let crlf = bytes
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|i| i + 4);
    let lf = bytes.windows(2).position(|w| w == b"\n\n").map(|i| i + 2);
    match (crlf, lf) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_lines() {
        let cases: [(&[u8], Request); 14] = [
            (
                b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n",
                Request::Metrics { head_only: false },
            ),
            (
                b"GET /metrics?name[]=up HTTP/1.0\r\n\r\n",
                Request::Metrics { head_only: false },
            ),
            (
                b"HEAD /metrics HTTP/1.1\r\n\r\n",
                Request::Metrics { head_only: true },
            ),
            (
                b"GET / HTTP/1.1\r\n\r\n",
                Request::Index { head_only: false },
            ),
            (
                b"GET /healthz HTTP/1.1\r\n\r\n",
                Request::Live { head_only: false },
            ),
            (
                b"HEAD /readyz HTTP/1.1\r\n\r\n",
                Request::Ready { head_only: true },
            ),
            (b"GET /readyz/x HTTP/1.1\r\n\r\n", Request::NotFound),
            (b"GET /other HTTP/1.1\r\n\r\n", Request::NotFound),
            (b"POST /metrics HTTP/1.1\r\n\r\n", Request::MethodNotAllowed),
            (b"GET /metrics\r\n\r\n", Request::Bad),
            (b"GET metrics HTTP/1.1\r\n\r\n", Request::Bad),
            (b"GET /metrics SMTP\r\n\r\n", Request::Bad),
            (b"GET  /metrics HTTP/1.1\r\n\r\n", Request::Bad),
            (b"GET /\xff HTTP/1.1\r\n\r\n", Request::Bad),
        ];
        for (head, want) in cases {
            assert_eq!(parse(head), want, "{:?}", String::from_utf8_lossy(head));
        }
    }

    async fn answer_to(request: &[u8]) -> String {
        answer_with(request, HealthChecks::default()).await
    }

    async fn answer_with(request: &[u8], health: HealthChecks) -> String {
        let (mut client, server) = tokio::io::duplex(64 * 1024);
        let served =
            tokio::spawn(async move { exchange(server, || "up 1\n".to_string(), &health).await });
        client.write_all(request).await.expect("send");
        let mut answer = String::new();
        client.read_to_string(&mut answer).await.expect("answer");
        drop(client);
        served.await.expect("task").expect("exchange");
        answer
    }

    #[tokio::test]
    async fn answers() {
        let ok = answer_to(b"GET /metrics HTTP/1.1\r\nHost: gw\r\n\r\n").await;
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n"), "{ok}");
        assert!(
            ok.contains(&format!("Content-Type: {CONTENT_TYPE}\r\n")),
            "{ok}"
        );
        assert!(ok.contains("Content-Length: 5\r\n"), "{ok}");
        assert!(ok.ends_with("\r\n\r\nup 1\n"), "{ok}");
        let head = answer_to(b"HEAD /metrics HTTP/1.1\r\n\r\n").await;
        assert!(
            head.contains("Content-Length: 5\r\n") && head.ends_with("\r\n\r\n"),
            "{head}"
        );
        let post = answer_to(b"POST /metrics HTTP/1.1\r\n\r\n").await;
        assert!(post.starts_with("HTTP/1.1 405 ") && post.contains("Allow: GET, HEAD\r\n"));
        let missing = answer_to(b"GET /nope HTTP/1.1\n\n").await;
        assert!(missing.starts_with("HTTP/1.1 404 "), "{missing}");
        let huge = vec![b'a'; MAX_REQUEST_HEAD + 10];
        let bad = answer_to(&huge).await;
        assert!(bad.starts_with("HTTP/1.1 400 "), "{bad}");
    }

    fn failing(reason: &'static str) -> Check {
        Arc::new(move || Err(reason.to_string()))
    }

    #[tokio::test]
    async fn probes_answer_200_or_503_with_one_line() {
        let healthy = HealthChecks {
            live: Arc::new(|| Ok(())),
            ready: Arc::new(|| Ok(())),
        };
        let live = answer_with(b"GET /healthz HTTP/1.1\r\n\r\n", healthy.clone()).await;
        assert!(live.starts_with("HTTP/1.1 200 OK\r\n"), "{live}");
        assert!(
            live.contains(&format!("Content-Type: {TEXT}\r\n")),
            "{live}"
        );
        assert!(live.ends_with("\r\n\r\nok\n"), "{live}");
        let ready = answer_with(b"GET /readyz HTTP/1.1\r\n\r\n", healthy.clone()).await;
        assert!(ready.starts_with("HTTP/1.1 200 OK\r\n"), "{ready}");
        assert!(ready.ends_with("\r\n\r\nready\n"), "{ready}");
        // /metrics is not affected by the checks.
        let sick = HealthChecks {
            live: failing("runtime stalled for 7 s"),
            ready: failing("waiting for the first assignment\nfrom the control plane"),
        };
        let metrics = answer_with(b"GET /metrics HTTP/1.1\r\n\r\n", sick.clone()).await;
        assert!(metrics.starts_with("HTTP/1.1 200 OK\r\n") && metrics.ends_with("up 1\n"));
        let live = answer_with(b"GET /healthz HTTP/1.1\r\n\r\n", sick.clone()).await;
        assert!(
            live.starts_with("HTTP/1.1 503 Service Unavailable\r\n"),
            "{live}"
        );
        assert!(
            live.ends_with("\r\n\r\nnot alive: runtime stalled for 7 s\n"),
            "{live}"
        );
        let ready = answer_with(b"GET /readyz HTTP/1.1\r\n\r\n", sick.clone()).await;
        assert!(
            ready.starts_with("HTTP/1.1 503 Service Unavailable\r\n"),
            "{ready}"
        );
        assert!(
            ready.ends_with(
                "\r\n\r\nnot ready: waiting for the first assignment from the control plane\n"
            ),
            "{ready}"
        );
        // HEAD: the same status and length, no body.
        let head = answer_with(b"HEAD /readyz HTTP/1.1\r\n\r\n", sick).await;
        let want = "not ready: waiting for the first assignment from the control plane\n".len();
        assert!(
            head.starts_with("HTTP/1.1 503 ")
                && head.contains(&format!("Content-Length: {want}\r\n"))
                && head.ends_with("\r\n\r\n"),
            "{head}"
        );
        let head = answer_with(b"HEAD /healthz HTTP/1.1\r\n\r\n", healthy).await;
        assert!(
            head.starts_with("HTTP/1.1 200 ")
                && head.ends_with("Content-Length: 3\r\nConnection: close\r\n\r\n"),
            "{head}"
        );
    }

    /// A server without checks (a daemon that sets none) answers both probes 200.
    #[tokio::test]
    async fn probes_default_to_healthy_over_tcp() {
        let render: Render = Arc::new(|| "up 1\n".to_string());
        let server = MetricsServer::bind("127.0.0.1:0".parse().expect("addr"), render)
            .await
            .expect("bind");
        let addr = server.local_addr().expect("addr");
        let (stop, stopped) = watch::channel(false);
        let task = tokio::spawn(server.serve(stopped));
        for (path, body) in [("/healthz", "ok\n"), ("/readyz", "ready\n")] {
            let mut c = tokio::net::TcpStream::connect(addr).await.expect("connect");
            c.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
                .await
                .expect("send");
            let mut answer = String::new();
            c.read_to_string(&mut answer).await.expect("answer");
            assert!(answer.starts_with("HTTP/1.1 200 OK\r\n"), "{answer}");
            assert!(answer.ends_with(&format!("\r\n\r\n{body}")), "{answer}");
        }
        let _ = stop.send(true);
        task.await.expect("server task");
    }

    #[tokio::test]
    async fn a_client_leaving_early_gets_nothing() {
        let (mut client, server) = tokio::io::duplex(1024);
        let served = tokio::spawn(async move {
            let health = HealthChecks::default();
            exchange(server, || unreachable!("no request, no render"), &health).await
        });
        client.write_all(b"GET /met").await.expect("send");
        client.shutdown().await.expect("half close");
        drop(client);
        served
            .await
            .expect("task")
            .expect("a closed client is not an error");
    }
}
