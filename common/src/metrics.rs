//! Prometheus scrape endpoint shared by every service: an HTTP/1.1 server on
//! hyper ([`serve`]) for `GET /metrics` and `GET /health`, the text encoder
//! of a `prometheus-client` registry ([`encode`]), and small helpers for
//! tests and the CLI ([`scrape`], [`parse_samples`], [`sample_value`]).
//!
//! The body of `/metrics` is whatever the caller's `render` returns; with
//! [`encode`] that is the OpenMetrics text format (`# EOF` terminated, counters
//! suffixed `_total`), served as [`METRICS_CONTENT_TYPE`]. Prometheus picks its
//! parser from the response's content type, so a plain Prometheus scraper
//! accepts it whatever `Accept` header it sent.
//!
//! Every request is answered once and the connection closed
//! (`Connection: close`): scrapes are rare, so keep-alive buys nothing and
//! would only hold connections open.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::{BodyExt, Empty, Full, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::header::{HeaderValue, ACCEPT, ALLOW, CONTENT_TYPE, HOST};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use log::{debug, warn};
use prometheus_client::registry::Registry;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;

/// Content type of `/metrics`: what `prometheus-client`'s text encoder
/// produces (OpenMetrics 1.0.0 text).
pub const METRICS_CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
/// Content type of `/health` and of error bodies.
pub const PLAIN_CONTENT_TYPE: &str = "text/plain; charset=utf-8";
/// Path of the scrape endpoint.
pub const METRICS_PATH: &str = "/metrics";
/// Path of the liveness endpoint; its body is [`HEALTH_BODY`].
pub const HEALTH_PATH: &str = "/health";
/// Body of a `/health` reply.
pub const HEALTH_BODY: &str = "ok";

/// Largest request head (request line and headers) read; a longer one is
/// answered 431. hyper's read buffer, which holds the head, is this size
/// (hyper's smallest).
pub const REQUEST_HEAD_BYTES_MAX: usize = 8 << 10;
/// Time a client gets to send its whole request head; then the connection
/// is closed.
pub const REQUEST_HEAD_TIMEOUT: Duration = Duration::from_secs(5);
/// Time a client gets to take the whole response: a connection is closed
/// [`REQUEST_HEAD_TIMEOUT`] + this after it was accepted, served or not.
pub const RESPONSE_WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// Open scrape connections at most; further ones are closed at once.
pub const CONNECTIONS_MAX: usize = 64;
/// Pause after a failed `accept` (typically EMFILE) instead of spinning.
pub const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);
/// Unread input a closing connection discards at most, so that the peer
/// gets the response rather than a reset.
pub const LINGER_DRAIN_BYTES_MAX: usize = 64 << 10;
/// Time a closing connection waits for the peer to close at most.
pub const LINGER_TIMEOUT: Duration = Duration::from_millis(500);
/// Largest response [`scrape`] reads.
pub const SCRAPE_RESPONSE_BYTES_MAX: usize = 64 << 20;

const _: () = assert!(CONNECTIONS_MAX >= 1);
// hyper refuses a read buffer under 8 KiB.
const _: () = assert!(REQUEST_HEAD_BYTES_MAX >= 8 << 10);

/// Renders the registry in the OpenMetrics text format, `# EOF` included.
///
/// Encoding into a `String` fails only if a custom metric's encoder fails;
/// then the error is logged and the text so far returned (without `# EOF`,
/// so a scraper rejects it rather than reading a partial exposition as whole).
pub fn encode(registry: &Registry) -> String {
    let mut out = String::new();
    if let Err(e) = prometheus_client::encoding::text::encode(&mut out, registry) {
        warn!("encoding the metrics registry failed: {e}; the exposition is incomplete");
    }
    out
}

/// Binds a scrape listener on `addr` (port 0: any free port).
pub async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr).await
}

/// What `render` returns: the `/metrics` body.
type Render = Arc<dyn Fn() -> String + Send + Sync>;

/// Serves scrapes on `listener` until `stop` becomes true (or its sender is
/// dropped), then closes the listener and any open scrape connections.
///
/// `GET /metrics` answers 200 with `render()` as [`METRICS_CONTENT_TYPE`];
/// `GET /health` answers 200 `ok`; any other path 404; methods other than
/// GET and HEAD 405 (HEAD answers like GET without the body); a request
/// hyper cannot parse 400, a head over [`REQUEST_HEAD_BYTES_MAX`] bytes 431.
/// Each connection is its own task, gets [`REQUEST_HEAD_TIMEOUT`] to send its
/// head, is answered once and closed. At most [`CONNECTIONS_MAX`] are open at
/// once. Nothing a client sends panics.
pub async fn serve(listener: TcpListener, render: Render, mut stop: watch::Receiver<bool>) {
    let local = listener
        .local_addr()
        .map_or_else(|_| "?".to_owned(), |a| a.to_string());
    let limit = Arc::new(Semaphore::new(CONNECTIONS_MAX));
    let mut tasks = JoinSet::new();
    let mut refusing = false;
    loop {
        if *stop.borrow_and_update() {
            break;
        }
        tokio::select! {
            changed = stop.changed() => {
                if changed.is_err() {
                    break;
                }
            }
            Some(done) = tasks.join_next(), if !tasks.is_empty() => {
                if let Err(e) = done {
                    if e.is_panic() {
                        warn!("a metrics connection task on {local} panicked: {e}");
                    }
                }
            }
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => match Arc::clone(&limit).try_acquire_owned() {
                    Ok(permit) => {
                        refusing = false;
                        tasks.spawn(handle_connection(stream, peer, Arc::clone(&render), permit));
                    }
                    Err(_) => {
                        if !refusing {
                            warn!(
                                "metrics endpoint {local}: {CONNECTIONS_MAX} connections open \
                                 (the bound); closing new connections until one ends"
                            );
                            refusing = true;
                        }
                        drop(stream);
                    }
                },
                Err(e) => {
                    warn!("accept on metrics endpoint {local} failed: {e}; retrying in {ACCEPT_BACKOFF:?}");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                }
            },
        }
    }
    drop(listener);
    tasks.shutdown().await;
    debug!("metrics endpoint {local} stopped");
}

fn reply(status: StatusCode, content_type: &'static str, body: String) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    r
}

/// Answers one request. hyper leaves out the body of a HEAD reply.
fn route(request: &Request<Incoming>, render: &Render) -> Response<Full<Bytes>> {
    if request.method() != Method::GET && request.method() != Method::HEAD {
        let mut r = reply(
            StatusCode::METHOD_NOT_ALLOWED,
            PLAIN_CONTENT_TYPE,
            "only GET and HEAD are served\n".into(),
        );
        r.headers_mut()
            .insert(ALLOW, HeaderValue::from_static("GET, HEAD"));
        return r;
    }
    match request.uri().path() {
        METRICS_PATH => reply(StatusCode::OK, METRICS_CONTENT_TYPE, render()),
        HEALTH_PATH => reply(StatusCode::OK, PLAIN_CONTENT_TYPE, HEALTH_BODY.into()),
        // A target that is not an absolute path (`GET metrics`) has none.
        p if !p.starts_with('/') => reply(
            StatusCode::BAD_REQUEST,
            PLAIN_CONTENT_TYPE,
            "the request target is not an absolute path\n".into(),
        ),
        _ => reply(
            StatusCode::NOT_FOUND,
            PLAIN_CONTENT_TYPE,
            "not found: the paths are /metrics and /health\n".into(),
        ),
    }
}

async fn handle_connection(
    mut stream: TcpStream,
    peer: SocketAddr,
    render: Render,
    _permit: OwnedSemaphorePermit,
) {
    let service = hyper::service::service_fn(|request| {
        std::future::ready(Ok::<_, Infallible>(route(&request, &render)))
    });
    // hyper borrows the stream, so that it can be drained after the reply.
    let connection = hyper::server::conn::http1::Builder::new()
        .keep_alive(false)
        // A client may send its request and shut down its side at once.
        .half_close(true)
        .title_case_headers(true)
        .max_buf_size(REQUEST_HEAD_BYTES_MAX)
        .timer(TokioTimer::new())
        .header_read_timeout(REQUEST_HEAD_TIMEOUT)
        .serve_connection(TokioIo::new(&mut stream), service);
    match tokio::time::timeout(REQUEST_HEAD_TIMEOUT + RESPONSE_WRITE_TIMEOUT, connection).await {
        Ok(Ok(())) => {}
        // hyper closes a slow client silently; tell it why.
        Ok(Err(e)) if e.is_timeout() => {
            debug!("metrics client {peer} sent no complete request in {REQUEST_HEAD_TIMEOUT:?}");
            let _ = tokio::time::timeout(
                RESPONSE_WRITE_TIMEOUT,
                stream.write_all(b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"),
            )
            .await;
        }
        Ok(Err(e)) => debug!("metrics client {peer}: {e}"),
        Err(_) => debug!("metrics client {peer} was not served within the connection's deadline"),
    }
    close_gracefully(&mut stream).await;
}

/// Sends FIN, then discards input (bounded in bytes and time) until the peer
/// closes, so that unread input (a head over the bound, a POST body) does not
/// turn the close into a reset that could discard the response before the
/// peer reads it.
async fn close_gracefully(stream: &mut TcpStream) {
    let _ = stream.shutdown().await;
    let mut drain = stream.take(LINGER_DRAIN_BYTES_MAX as u64);
    let _ = tokio::time::timeout(
        LINGER_TIMEOUT,
        tokio::io::copy(&mut drain, &mut tokio::io::sink()),
    )
    .await;
}

/// Blocking `GET path` of `addr` (`host:port`); returns the status code and
/// the body. `timeout` bounds connecting and the whole exchange; responses
/// over [`SCRAPE_RESPONSE_BYTES_MAX`] are refused. Runs its own small tokio
/// runtime (on a scoped thread when called from inside one).
pub fn scrape(addr: &str, path: &str, timeout: Duration) -> std::io::Result<(u16, String)> {
    if tokio::runtime::Handle::try_current().is_ok() {
        return std::thread::scope(|s| {
            s.spawn(|| scrape(addr, path, timeout))
                .join()
                .unwrap_or_else(|_| Err(std::io::Error::other("the scrape thread panicked")))
        });
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let bad = |why: String| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("bad response from {addr}{path}: {why}"),
        )
    };
    let exchange = async {
        let stream = TcpStream::connect(addr).await?;
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| bad(e.to_string()))?;
        tokio::spawn(connection);
        let request = Request::get(path)
            .header(HOST, addr)
            .header(ACCEPT, format!("{METRICS_CONTENT_TYPE}, text/plain;q=0.5"))
            .body(Empty::<Bytes>::new())
            .map_err(|e| {
                std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!("cannot request {addr}{path}: {e}"),
                )
            })?;
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| bad(e.to_string()))?;
        let status = response.status().as_u16();
        let body = Limited::new(response.into_body(), SCRAPE_RESPONSE_BYTES_MAX)
            .collect()
            .await
            .map_err(|e| match e.downcast::<http_body_util::LengthLimitError>() {
                Ok(_) => bad(format!(
                    "the body exceeds {SCRAPE_RESPONSE_BYTES_MAX} bytes"
                )),
                Err(e) => bad(e.to_string()),
            })?
            .to_bytes();
        let body =
            String::from_utf8(body.into()).map_err(|_| bad("the body is not UTF-8".into()))?;
        Ok((status, body))
    };
    runtime
        .block_on(async { tokio::time::timeout(timeout, exchange).await })
        .unwrap_or_else(|_| {
            Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("scraping {addr}{path} took over {timeout:?}"),
            ))
        })
}

/// Parses the samples of a Prometheus or OpenMetrics text exposition: one
/// `(series, value)` per sample line, where `series` is the metric name with
/// its labels exactly as written (`name{a="x",b="y"}` or `name`). Comment
/// lines, timestamps and exemplars are skipped; malformed lines are ignored.
///
/// Hand-written because no maintained crate parses this leniently and
/// correctly: `prometheus-parse` splits label values at commas and braces
/// and regroups histograms out of order, `openmetrics-parser` (LGPL) rejects a
/// whole exposition for one bad line.
pub fn parse_samples(text: &str) -> Vec<(String, f64)> {
    text.lines().filter_map(parse_sample_line).collect()
}

fn parse_sample_line(line: &str) -> Option<(String, f64)> {
    let line = line.trim();
    let name_end = line.find(|c: char| c == '{' || c.is_whitespace())?;
    if name_end == 0 || line.starts_with('#') {
        return None;
    }
    let series_end = match parse_labels(&line[name_end..]) {
        Some((_, len)) => name_end + len,
        None if line[name_end..].starts_with('{') => return None,
        None => name_end,
    };
    let value = line[series_end..].split_whitespace().next()?.parse().ok()?;
    Some((line[..series_end].to_owned(), value))
}

/// Parses the label set `s` starts with (`{a="x",b="y"}`), unescaping the
/// values (`\\`, `\"`, `\n`); returns the labels and the set's length in
/// bytes. `None` if `s` starts with no well-formed set.
fn parse_labels(s: &str) -> Option<(Vec<(String, String)>, usize)> {
    let mut rest = s.strip_prefix('{')?;
    let mut labels = Vec::new();
    loop {
        rest = rest.trim_start_matches([',', ' ']);
        if let Some(after) = rest.strip_prefix('}') {
            return Some((labels, s.len() - after.len()));
        }
        let (label, after) = rest.split_once('=')?;
        let mut chars = after.strip_prefix('"')?.char_indices();
        let mut value = String::new();
        let end = loop {
            match chars.next()? {
                (_, '\\') => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    c => value.push(c),
                },
                (i, '"') => break i,
                (_, c) => value.push(c),
            }
        };
        labels.push((label.trim().to_owned(), value));
        rest = &after[1 + end + 1..];
    }
}

/// Splits `name{a="x",b="y"}` into the name and its labels, unescaping
/// label values (`\\`, `\"`, `\n`). `None` if the labels are malformed.
pub fn parse_series(series: &str) -> Option<(&str, Vec<(String, String)>)> {
    let Some(brace) = series.find('{') else {
        return Some((series, Vec::new()));
    };
    let (labels, len) = parse_labels(&series[brace..])?;
    (brace + len == series.len()).then_some((&series[..brace], labels))
}

/// The value of the sample named `name` whose labels are exactly `labels`
/// (in any order) in the exposition `text`, if there is one.
pub fn sample_value(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    parse_samples(text).into_iter().find_map(|(series, value)| {
        let (n, mut have) = parse_series(&series)?;
        if n != name || have.len() != labels.len() {
            return None;
        }
        have.sort();
        let mut want: Vec<(String, String)> = labels
            .iter()
            .map(|&(k, v)| (k.to_owned(), v.to_owned()))
            .collect();
        want.sort();
        (have == want).then_some(value)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::metrics::counter::Counter;
    use prometheus_client::metrics::gauge::Gauge;
    use std::time::Instant;

    const T: Duration = Duration::from_secs(5);

    struct Running {
        addr: SocketAddr,
        stop: watch::Sender<bool>,
        server: tokio::task::JoinHandle<()>,
    }

    async fn start(render: Arc<dyn Fn() -> String + Send + Sync>) -> Running {
        let listener = bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, rx) = watch::channel(false);
        let server = tokio::spawn(serve(listener, render, rx));
        Running { addr, stop, server }
    }

    async fn get(addr: SocketAddr, path: &'static str) -> std::io::Result<(u16, String)> {
        tokio::task::spawn_blocking(move || scrape(&addr.to_string(), path, T))
            .await
            .unwrap()
    }

    /// Sends `bytes` raw and returns everything the server sends back.
    async fn raw(addr: SocketAddr, bytes: Vec<u8>) -> String {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(&bytes).await.unwrap();
        // Half-close: the request is complete.
        s.shutdown().await.unwrap();
        let mut out = Vec::new();
        let _ = tokio::time::timeout(T, s.read_to_end(&mut out)).await;
        String::from_utf8_lossy(&out).into_owned()
    }

    fn registry() -> (Registry, Counter, Gauge) {
        let mut r = Registry::default();
        let c = Counter::default();
        let g = Gauge::default();
        r.register("test_requests", "Requests served", c.clone());
        r.register("test_open", "Open things", g.clone());
        (r, c, g)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn metrics_health_404_405() {
        let (reg, c, g) = registry();
        c.inc_by(3);
        g.set(-2);
        let reg = Arc::new(reg);
        let s = start(Arc::new(move || encode(&reg))).await;

        let (code, body) = get(s.addr, "/metrics").await.unwrap();
        assert_eq!(code, 200, "{body}");
        assert!(body.ends_with("# EOF\n"), "{body}");
        assert_eq!(sample_value(&body, "test_requests_total", &[]), Some(3.0));
        assert_eq!(sample_value(&body, "test_open", &[]), Some(-2.0));

        c.inc();
        let (_, body) = get(s.addr, "/metrics?x=1").await.unwrap();
        assert_eq!(sample_value(&body, "test_requests_total", &[]), Some(4.0));

        assert_eq!(get(s.addr, "/health").await.unwrap(), (200, "ok".into()));
        assert_eq!(get(s.addr, "/nope").await.unwrap().0, 404);
        // Called on a runtime's thread, scrape runs on a thread of its own.
        assert_eq!(scrape(&s.addr.to_string(), "/health", T).unwrap().0, 200);

        let r = raw(s.addr, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n".to_vec()).await;
        assert!(r.starts_with("HTTP/1.1 200 OK\r\n"), "{r}");
        assert!(
            r.contains(&format!("Content-Type: {METRICS_CONTENT_TYPE}\r\n")),
            "{r}"
        );
        assert!(r.contains("Connection: close\r\n"), "{r}");

        let r = raw(
            s.addr,
            b"POST /metrics HTTP/1.1\r\nContent-Length: 2\r\n\r\nhi".to_vec(),
        )
        .await;
        assert!(r.starts_with("HTTP/1.1 405 "), "{r}");
        assert!(r.contains("Allow: GET, HEAD\r\n"), "{r}");

        // HEAD: the head alone. An HTTP/1.0 client gets an HTTP/1.0 reply.
        let r = raw(s.addr, b"HEAD /health HTTP/1.0\r\n\r\n".to_vec()).await;
        assert!(
            r.starts_with("HTTP/1.0 200 ") && r.ends_with("\r\n\r\n"),
            "{r}"
        );

        s.stop.send(true).unwrap();
        tokio::time::timeout(T, s.server).await.unwrap().unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn bad_heads_answer_400_or_431_and_never_panic() {
        let s = start(Arc::new(|| "x 1\n".to_owned())).await;
        let mut big = b"GET /metrics HTTP/1.1\r\nX: ".to_vec();
        big.resize(REQUEST_HEAD_BYTES_MAX + 1024, b'a');
        let r = raw(s.addr, big).await;
        assert!(r.starts_with("HTTP/1.1 431 "), "{r}");

        for bad in [
            &b"garbage\r\n\r\n"[..],
            b"GET metrics HTTP/1.1\r\n\r\n",
            b"GET /metrics SPDY/3\r\n\r\n",
            b"GET /metrics HTTP/1.1 extra\r\n\r\n",
            b"\xff\xfe /metrics HTTP/1.1\r\n\r\n",
            b"G\0T /metrics HTTP/1.1\r\n\r\n",
        ] {
            let r = raw(s.addr, bad.to_vec()).await;
            assert!(r.starts_with("HTTP/1.1 400 "), "{bad:?}: {r}");
        }
        let r = raw(s.addr, b"GET metrics HTTP/1.1\r\n\r\n".to_vec()).await;
        assert!(
            r.ends_with("the request target is not an absolute path\n"),
            "{r}"
        );
        // A client that closes mid-head gets nothing and harms nothing; so
        // does one that sends only empty lines, which RFC 9112 (2.2) has a
        // server skip before the request line.
        assert_eq!(raw(s.addr, b"GET /met".to_vec()).await, "");
        assert_eq!(raw(s.addr, b"\r\n\r\n".to_vec()).await, "");
        assert_eq!(get(s.addr, "/health").await.unwrap().0, 200);
        s.stop.send(true).unwrap();
        tokio::time::timeout(T, s.server).await.unwrap().unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_slow_client_blocks_nobody_and_times_out() {
        let s = start(Arc::new(|| "x 1\n".to_owned())).await;
        let mut slow = TcpStream::connect(s.addr).await.unwrap();
        slow.write_all(b"GET /metr").await.unwrap();
        let started = Instant::now();
        assert_eq!(get(s.addr, "/health").await.unwrap().0, 200);
        assert!(started.elapsed() < Duration::from_secs(2));
        let mut out = Vec::new();
        let wait = REQUEST_HEAD_TIMEOUT + Duration::from_secs(3);
        tokio::time::timeout(wait, slow.read_to_end(&mut out))
            .await
            .expect("the slow client is closed after the head timeout")
            .unwrap();
        let out = String::from_utf8_lossy(&out);
        assert!(out.starts_with("HTTP/1.1 408 "), "{out}");
        s.stop.send(true).unwrap();
        tokio::time::timeout(T, s.server).await.unwrap().unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn connections_beyond_the_bound_are_closed() {
        let s = start(Arc::new(|| "x 1\n".to_owned())).await;
        let mut idle = Vec::new();
        for _ in 0..CONNECTIONS_MAX {
            idle.push(TcpStream::connect(s.addr).await.unwrap());
        }
        // Wait until the server has accepted them all: the next is refused.
        let deadline = Instant::now() + T;
        loop {
            let mut extra = TcpStream::connect(s.addr).await.unwrap();
            let mut b = [0u8; 1];
            let r = tokio::time::timeout(Duration::from_millis(300), extra.read(&mut b)).await;
            if matches!(r, Ok(Ok(0)) | Ok(Err(_))) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the extra connection was never closed"
            );
        }
        drop(idle);
        let deadline = Instant::now() + T;
        while get(s.addr, "/health").await.map(|r| r.0).ok() != Some(200) {
            assert!(Instant::now() < deadline, "the server never recovered");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        s.stop.send(true).unwrap();
        tokio::time::timeout(T, s.server).await.unwrap().unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn stop_ends_the_server_and_closes_connections() {
        let s = start(Arc::new(|| "x 1\n".to_owned())).await;
        let mut open = TcpStream::connect(s.addr).await.unwrap();
        assert_eq!(get(s.addr, "/health").await.unwrap().0, 200);
        s.stop.send(true).unwrap();
        tokio::time::timeout(T, s.server).await.unwrap().unwrap();
        let mut out = Vec::new();
        let r = tokio::time::timeout(T, open.read_to_end(&mut out))
            .await
            .unwrap();
        assert!(r.is_err() || out.is_empty(), "{r:?} {out:?}");
        assert!(get(s.addr, "/health").await.is_err());

        // Dropping the sender also stops it; a stop sent before start too.
        let s = start(Arc::new(String::new)).await;
        drop(s.stop);
        tokio::time::timeout(T, s.server).await.unwrap().unwrap();
        let listener = bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let (_tx, rx) = watch::channel(true);
        tokio::time::timeout(T, serve(listener, Arc::new(String::new), rx))
            .await
            .unwrap();
    }

    #[test]
    fn scrape_reports_errors() {
        // A port with nothing listening: bind then drop.
        let addr = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        assert!(scrape(&addr.to_string(), "/metrics", T).is_err());
        assert!(scrape("not an address", "/metrics", T).is_err());
        // A server that answers `response` to one connection.
        let answer = |response: &'static [u8]| {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = l.local_addr().unwrap().to_string();
            let server = std::thread::spawn(move || {
                use std::io::{Read, Write};
                let (mut c, _) = l.accept().unwrap();
                let mut head = [0u8; 1024];
                let _ = c.read(&mut head);
                let _ = c.write_all(response);
            });
            let r = scrape(&addr, "/metrics", T);
            server.join().unwrap();
            r
        };
        assert_eq!(
            answer(b"HTTP/1.1 404 Not Found\r\nContent-Length: 3\r\n\r\nabcdef").unwrap(),
            (404, "abc".into())
        );
        for bad in [
            &b"HTTP/1.1 200 OK\r\n"[..],
            b"SPDY 200 OK\r\n\r\n",
            b"HTTP/1.1 abc OK\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nabc",
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n\xff\xfe",
        ] {
            let e = answer(bad).unwrap_err();
            assert!(e.to_string().contains("/metrics"), "{bad:?}: {e}");
        }
        // A server that never answers: the timeout, named.
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let e = scrape(&addr, "/metrics", Duration::from_millis(300)).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::TimedOut, "{e}");
        assert!(e.to_string().contains("took over"), "{e}");
    }

    #[test]
    fn samples_parse_with_labels_exemplars_and_specials() {
        let text = "# HELP a_total Things.\n\
                    # TYPE a counter\n\
                    a_total{op=\"read\",status=\"ok\"} 5\n\
                    a_total{status=\"err\",op=\"x, }y\\\"z\"} 2 1700000000\n\
                    b 1.5e3 # {trace_id=\"1\"} 2.0\n\
                    c{} +Inf\n\
                    d NaN\n\
                    malformed\n\
                    e{unterminated=\"x} 1\n\
                    \n\
                    # EOF\n";
        let s = parse_samples(text);
        assert_eq!(s.len(), 5, "{s:?}");
        assert_eq!(s[0], ("a_total{op=\"read\",status=\"ok\"}".into(), 5.0));
        assert_eq!(s[2], ("b".into(), 1500.0));
        assert_eq!(s[3].1, f64::INFINITY);
        assert!(s[4].1.is_nan());
        assert_eq!(
            sample_value(text, "a_total", &[("status", "ok"), ("op", "read")]),
            Some(5.0)
        );
        assert_eq!(
            sample_value(text, "a_total", &[("op", "x, }y\"z"), ("status", "err")]),
            Some(2.0)
        );
        assert_eq!(sample_value(text, "a_total", &[("op", "read")]), None);
        assert_eq!(sample_value(text, "c", &[]), Some(f64::INFINITY));
        assert_eq!(sample_value(text, "nope", &[]), None);
        assert_eq!(parse_series("x{a=\"1\"").map(|s| s.0), None);
        assert_eq!(parse_series("x{a=1}"), None);
    }
}
