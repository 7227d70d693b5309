//! A minimal HTTP/1.1 endpoint for Prometheus: `GET /metrics` answers the exposition text,
//! one request per connection.
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

/// Renders the exposition text; called once per scrape, on a runtime thread (it must not
/// block for long).
pub type Render = Arc<dyn Fn() -> String + Send + Sync>;

pub struct MetricsServer {
    listener: TcpListener,
    render: Render,
}

impl MetricsServer {
    /// Listens on `addr`; each scrape answers what `render` returns then. A render that holds
    /// a daemon's state should hold it weakly: a slow client keeps its connection's handle
    /// until the exchange times out.
    pub async fn bind(addr: SocketAddr, render: Render) -> std::io::Result<Self> {
        Ok(MetricsServer {
            listener: TcpListener::bind(addr).await?,
            render,
        })
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
            tokio::spawn(async move {
                match tokio::time::timeout(EXCHANGE_TIMEOUT, exchange(stream, || render())).await {
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
        "/" => Request::Index { head_only },
        _ => Request::NotFound,
    }
}

/// Reads one request head from `stream`, answers it (the body from `metrics` for
/// `/metrics`) and closes.
async fn exchange<S>(mut stream: S, metrics: impl FnOnce() -> String) -> std::io::Result<()>
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
    let (status, extra, body, head_only) = match request {
        Request::Metrics { head_only } => ("200 OK", "", metrics(), head_only),
        Request::Index { head_only } => {
            ("200 OK", "", "metrics at /metrics\n".to_string(), head_only)
        }
        Request::NotFound => (
            "404 Not Found",
            "",
            "not found: try /metrics\n".into(),
            false,
        ),
        Request::MethodNotAllowed => (
            "405 Method Not Allowed",
            "Allow: GET, HEAD\r\n",
            "only GET and HEAD\n".into(),
            false,
        ),
        Request::Bad => ("400 Bad Request", "", "bad request\n".into(), false),
    };
    let mut response = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {CONTENT_TYPE}\r\nContent-Length: {}\r\n{extra}Connection: close\r\n\r\n",
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
        let cases: [(&[u8], Request); 11] = [
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
        let (mut client, server) = tokio::io::duplex(64 * 1024);
        let served = tokio::spawn(exchange(server, || "up 1\n".to_string()));
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

    #[tokio::test]
    async fn a_client_leaving_early_gets_nothing() {
        let (mut client, server) = tokio::io::duplex(1024);
        let served = tokio::spawn(exchange(server, || unreachable!("no request, no render")));
        client.write_all(b"GET /met").await.expect("send");
        client.shutdown().await.expect("half close");
        drop(client);
        served
            .await
            .expect("task")
            .expect("a closed client is not an error");
    }
}
