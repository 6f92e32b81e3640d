//! The accept loop: HTTP/1 connections with a header read timeout, at most
//! `max_connections` open at once, and a graceful end.
//!
//! axum's own `serve` sets no timer, so a client that sends half a request line keeps its
//! connection forever; here hyper's header read timeout closes it (the same timer closes
//! idle keep-alive connections). Past the connection limit a new connection is answered
//! `503` and closed at once, so the server's memory and file descriptors stay bounded.

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};

/// Default: a client has this long to send a request's headers (and an idle keep-alive
/// connection is closed after it).
pub const DEFAULT_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);
/// Default: the most connections open at once.
pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;
/// Connections refused at once are answered concurrently up to this many; past it they
/// are closed without an answer.
const MAX_REFUSALS_IN_FLIGHT: usize = 64;

/// Limits on connections, applied by [`serve_with_limits`].
#[derive(Debug, Clone, Copy)]
pub struct ConnectionLimits {
    pub header_read_timeout: Duration,
    pub max_connections: usize,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        Self {
            header_read_timeout: DEFAULT_HEADER_READ_TIMEOUT,
            max_connections: DEFAULT_MAX_CONNECTIONS,
        }
    }
}

/// The whole answer to a connection over the limit.
fn refusal() -> Vec<u8> {
    let body = serde_json::json!({"error": {
        "message": "too many open connections; try again later",
        "type": "server_error",
        "param": null,
        "code": "too_many_connections",
    }})
    .to_string();
    format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\nretry-after: 1\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Answers a connection over the limit with a 503 and closes it (bounded in time).
async fn refuse(stream: TcpStream) {
    let answer = refusal();
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        let mut rest = &answer[..];
        while !rest.is_empty() {
            stream.writable().await?;
            match stream.try_write(rest) {
                Ok(n) => rest = &rest[n..],
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
        }
        // Read what the client sent until it closes, so closing here does not reset the
        // connection before the client has read the answer.
        let mut sink = [0u8; 1024];
        loop {
            stream.readable().await?;
            match stream.try_read(&mut sink) {
                Ok(0) => return Ok(()),
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
        }
    })
    .await;
}

/// Serves `router` on `listener` with `limits` until `shutdown` resolves, then lets open
/// connections finish their responses.
pub async fn serve_with_limits(
    listener: TcpListener,
    router: Router,
    limits: ConnectionLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let max = limits.max_connections.clamp(1, Semaphore::MAX_PERMITS);
    let permits = Arc::new(Semaphore::new(max));
    let refusals = Arc::new(Semaphore::new(MAX_REFUSALS_IN_FLIGHT));
    let (close_tx, close_rx) = watch::channel(false);
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(error) => {
                    // Out of file descriptors and the like: wait rather than spin.
                    tracing::warn!(%error, "accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            if let Ok(refusal) = refusals.clone().try_acquire_owned() {
                tokio::spawn(async move {
                    refuse(stream).await;
                    drop(refusal);
                });
            }
            continue;
        };
        let service = TowerToHyperService::new(router.clone());
        let mut close_rx = close_rx.clone();
        let header_read_timeout = limits.header_read_timeout;
        tokio::spawn(async move {
            let mut builder = http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(header_read_timeout);
            let conn = builder.serve_connection(TokioIo::new(stream), service);
            let mut conn = std::pin::pin!(conn);
            tokio::select! {
                result = conn.as_mut() => {
                    if let Err(error) = result {
                        tracing::debug!(%error, "connection ended with an error");
                    }
                }
                _ = close_rx.changed() => {
                    conn.as_mut().graceful_shutdown();
                    let _ = conn.await;
                }
            }
            drop(permit);
        });
    }
    drop(listener);
    let _ = close_tx.send(true);
    // Every connection holds a permit until it ends.
    let _ = permits.acquire_many(max as u32).await;
    Ok(())
}
