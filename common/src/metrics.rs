//! Prometheus scrape endpoint shared by every service: a minimal, bounded
//! HTTP/1.1 server ([`serve`]) for `GET /metrics` and `GET /health`, the text
//! encoder of a `prometheus-client` registry ([`encode`]), and small helpers
//! for tests and the CLI ([`scrape`], [`parse_samples`], [`sample_value`]).
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

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream as StdTcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::time::{Duration, Instant};

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

/// Largest request head (request line and headers, with the blank line)
/// read; a longer one is answered 431.
pub const REQUEST_HEAD_BYTES_MAX: usize = 8 << 10;
/// Time a client gets to send its whole request head.
pub const REQUEST_HEAD_TIMEOUT: Duration = Duration::from_secs(5);
/// Time a client gets to take the whole response.
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
const _: () = assert!(REQUEST_HEAD_BYTES_MAX >= 64);

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

/// Serves scrapes on `listener` until `stop` becomes true (or its sender is
/// dropped), then closes the listener and any open scrape connections.
///
/// `GET /metrics` answers 200 with `render()` as [`METRICS_CONTENT_TYPE`];
/// `GET /health` answers 200 `ok`; any other path 404; methods other than
/// GET and HEAD 405 (HEAD answers like GET without the body). Each connection
/// is its own task, gets [`REQUEST_HEAD_TIMEOUT`] to send a head of at most
/// [`REQUEST_HEAD_BYTES_MAX`] bytes, is answered once and closed. At most
/// [`CONNECTIONS_MAX`] are open at once. Nothing a client sends panics.
pub async fn serve(
    listener: TcpListener,
    render: Arc<dyn Fn() -> String + Send + Sync>,
    mut stop: watch::Receiver<bool>,
) {
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

/// What a request head asked for, or why it cannot be answered.
#[derive(Debug, PartialEq, Eq)]
enum Request<'a> {
    /// A well-formed request: method and path (query string stripped).
    Ok { method: &'a str, path: &'a str },
    /// 400: not a parseable HTTP/1.x request head.
    Bad(&'static str),
}

/// Parses the request line of a complete head. Headers are not interpreted.
fn parse_head(head: &[u8]) -> Request<'_> {
    let Ok(head) = std::str::from_utf8(head) else {
        return Request::Bad("the request head is not UTF-8");
    };
    let line = head.split('\n').next().unwrap_or("").trim_end_matches('\r');
    let mut parts = line.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Request::Bad("the request line is not `METHOD TARGET HTTP/1.x`");
    };
    if method.is_empty() || !method.bytes().all(|b| b.is_ascii_alphabetic()) {
        return Request::Bad("the method is not a token");
    }
    if !version.starts_with("HTTP/1.") {
        return Request::Bad("only HTTP/1.x is served");
    }
    if !target.starts_with('/') {
        return Request::Bad("the request target is not an absolute path");
    }
    let path = target.split(['?', '#']).next().unwrap_or(target);
    Request::Ok { method, path }
}

/// Index just past the blank line ending the head, if the head is complete.
fn head_end(buf: &[u8]) -> Option<usize> {
    let crlf = buf.windows(4).position(|w| w == b"\r\n\r\n").map(|i| i + 4);
    let lf = buf.windows(2).position(|w| w == b"\n\n").map(|i| i + 2);
    match (crlf, lf) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// Why reading a request head stopped without a complete head.
enum HeadError {
    /// The peer closed or the read failed: nobody to answer.
    Closed,
    /// [`REQUEST_HEAD_BYTES_MAX`] bytes arrived without the blank line.
    TooLarge,
}

/// Reads until the blank line ending the head; returns the head's length.
async fn read_head(stream: &mut TcpStream, buf: &mut [u8]) -> Result<usize, HeadError> {
    let mut filled = 0;
    loop {
        if let Some(end) = head_end(&buf[..filled]) {
            return Ok(end);
        }
        if filled == buf.len() {
            return Err(HeadError::TooLarge);
        }
        match stream.read(&mut buf[filled..]).await {
            Ok(0) | Err(_) => return Err(HeadError::Closed),
            Ok(n) => filled += n,
        }
    }
}

/// A response to write: status, content type, body, and whether to send
/// the body (not for HEAD).
struct Response {
    status: u16,
    content_type: &'static str,
    body: String,
    extra_headers: &'static str,
}

impl Response {
    fn plain(status: u16, body: &str) -> Response {
        Response {
            status,
            content_type: PLAIN_CONTENT_TYPE,
            body: format!("{body}\n"),
            extra_headers: "",
        }
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        431 => "Request Header Fields Too Large",
        _ => "Unknown",
    }
}

fn route(request: Request<'_>, render: &(dyn Fn() -> String + Send + Sync)) -> (Response, bool) {
    let (method, path) = match request {
        Request::Ok { method, path } => (method, path),
        Request::Bad(why) => return (Response::plain(400, why), true),
    };
    let with_body = method != "HEAD";
    if method != "GET" && method != "HEAD" {
        let mut r = Response::plain(405, "only GET and HEAD are served");
        r.extra_headers = "Allow: GET, HEAD\r\n";
        return (r, true);
    }
    let response = match path {
        METRICS_PATH => Response {
            status: 200,
            content_type: METRICS_CONTENT_TYPE,
            body: render(),
            extra_headers: "",
        },
        HEALTH_PATH => Response {
            status: 200,
            content_type: PLAIN_CONTENT_TYPE,
            body: HEALTH_BODY.to_owned(),
            extra_headers: "",
        },
        _ => Response::plain(404, "not found: the paths are /metrics and /health"),
    };
    (response, with_body)
}

async fn write_response(stream: &mut TcpStream, response: &Response, with_body: bool) {
    let head = format!(
        "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\n{}Connection: close\r\n\r\n",
        response.status,
        reason(response.status),
        response.content_type,
        response.body.len(),
        response.extra_headers,
    );
    let write = async {
        stream.write_all(head.as_bytes()).await?;
        if with_body {
            stream.write_all(response.body.as_bytes()).await?;
        }
        stream.flush().await
    };
    let _ = tokio::time::timeout(RESPONSE_WRITE_TIMEOUT, write).await;
}

/// Sends FIN, then discards input (bounded in bytes and time) until the peer
/// closes, so that unread input does not turn the close into a reset that
/// could discard the response before the peer reads it.
async fn close_gracefully(stream: &mut TcpStream) {
    let _ = stream.shutdown().await;
    let drain = async {
        let mut buf = [0u8; 4096];
        let mut left = LINGER_DRAIN_BYTES_MAX;
        while left > 0 {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => left = left.saturating_sub(n),
            }
        }
    };
    let _ = tokio::time::timeout(LINGER_TIMEOUT, drain).await;
}

async fn handle_connection(
    mut stream: TcpStream,
    peer: SocketAddr,
    render: Arc<dyn Fn() -> String + Send + Sync>,
    _permit: OwnedSemaphorePermit,
) {
    let mut buf = vec![0u8; REQUEST_HEAD_BYTES_MAX];
    let (response, with_body) =
        match tokio::time::timeout(REQUEST_HEAD_TIMEOUT, read_head(&mut stream, &mut buf)).await {
            Ok(Ok(end)) => route(parse_head(&buf[..end]), render.as_ref()),
            Ok(Err(HeadError::Closed)) => return,
            Ok(Err(HeadError::TooLarge)) => (
                Response::plain(
                    431,
                    &format!("the request head exceeds {REQUEST_HEAD_BYTES_MAX} bytes"),
                ),
                true,
            ),
            Err(_) => {
                debug!(
                    "metrics client {peer} sent no complete request in {REQUEST_HEAD_TIMEOUT:?}"
                );
                (
                    Response::plain(
                        408,
                        &format!("no complete request head within {REQUEST_HEAD_TIMEOUT:?}"),
                    ),
                    true,
                )
            }
        };
    write_response(&mut stream, &response, with_body).await;
    close_gracefully(&mut stream).await;
}

fn invalid(msg: String) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, msg)
}

/// Blocking `GET path` of `addr` (`host:port`); returns the status code and
/// the body. `timeout` bounds connecting and the whole exchange; responses
/// over [`SCRAPE_RESPONSE_BYTES_MAX`] are refused.
pub fn scrape(addr: &str, path: &str, timeout: Duration) -> std::io::Result<(u16, String)> {
    let deadline = Instant::now() + timeout;
    let mut last_err = None;
    let mut stream = None;
    for a in addr.to_socket_addrs()? {
        match StdTcpStream::connect_timeout(&a, timeout) {
            Ok(s) => {
                stream = Some(s);
                break;
            }
            Err(e) => last_err = Some(e),
        }
    }
    let mut stream = match (stream, last_err) {
        (Some(s), _) => s,
        (None, Some(e)) => return Err(e),
        (None, None) => {
            return Err(std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!("{addr} resolves to no address"),
            ))
        }
    };
    let remaining = |deadline: Instant| {
        deadline
            .checked_duration_since(Instant::now())
            .filter(|d| !d.is_zero())
            .ok_or_else(|| {
                std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("scraping {addr}{path} took over {timeout:?}"),
                )
            })
    };
    stream.set_write_timeout(Some(remaining(deadline)?))?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nAccept: {METRICS_CONTENT_TYPE}, text/plain;q=0.5\r\nConnection: close\r\n\r\n"
    )?;
    let mut response = Vec::new();
    let mut chunk = [0u8; 16 << 10];
    loop {
        stream.set_read_timeout(Some(remaining(deadline)?))?;
        let n = match stream.read(&mut chunk) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if n == 0 {
            break;
        }
        if response.len() + n > SCRAPE_RESPONSE_BYTES_MAX {
            return Err(invalid(format!(
                "the response from {addr}{path} exceeds {SCRAPE_RESPONSE_BYTES_MAX} bytes"
            )));
        }
        response.extend_from_slice(&chunk[..n]);
    }
    parse_response(&response)
        .map_err(|why| invalid(format!("bad response from {addr}{path}: {why}")))
}

/// Splits a complete `Connection: close` HTTP/1.x response into status and body.
fn parse_response(response: &[u8]) -> Result<(u16, String), &'static str> {
    let end = head_end(response).ok_or("no complete response head")?;
    let head = std::str::from_utf8(&response[..end]).map_err(|_| "the head is not UTF-8")?;
    let mut lines = head.lines();
    let status_line = lines.next().unwrap_or("");
    let mut parts = status_line.splitn(3, ' ');
    let (Some(version), Some(code)) = (parts.next(), parts.next()) else {
        return Err("no status line");
    };
    if !version.starts_with("HTTP/1.") {
        return Err("not an HTTP/1.x response");
    }
    let status: u16 = code
        .parse()
        .map_err(|_| "the status code is not a number")?;
    let mut body = &response[end..];
    for line in lines {
        if let Some((name, value)) = line.split_once(':') {
            if name.trim().eq_ignore_ascii_case("content-length") {
                let len: usize = value
                    .trim()
                    .parse()
                    .map_err(|_| "the Content-Length is not a number")?;
                if len > body.len() {
                    return Err("the body is shorter than its Content-Length");
                }
                body = &body[..len];
            }
        }
    }
    let body = String::from_utf8(body.to_vec()).map_err(|_| "the body is not UTF-8")?;
    Ok((status, body))
}

/// Parses the samples of a Prometheus or OpenMetrics text exposition: one
/// `(series, value)` per sample line, where `series` is the metric name with
/// its labels exactly as written (`name{a="x",b="y"}` or `name`). Comment
/// lines, timestamps and exemplars are skipped; malformed lines are ignored.
pub fn parse_samples(text: &str) -> Vec<(String, f64)> {
    text.lines().filter_map(parse_sample_line).collect()
}

fn parse_sample_line(line: &str) -> Option<(String, f64)> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let series_end = match (line.find('{'), line.find([' ', '\t'])) {
        (Some(brace), space) if space.is_none_or(|s| brace < s) => {
            // Find the closing brace outside quoted label values.
            let (mut quoted, mut escaped) = (false, false);
            let mut end = None;
            for (i, c) in line[brace..].char_indices() {
                match c {
                    _ if escaped => escaped = false,
                    '\\' if quoted => escaped = true,
                    '"' => quoted = !quoted,
                    '}' if !quoted => {
                        end = Some(brace + i + 1);
                        break;
                    }
                    _ => {}
                }
            }
            end?
        }
        (_, Some(space)) => space,
        (_, None) => return None,
    };
    let (series, rest) = line.split_at(series_end);
    let value = rest.split_whitespace().next()?.parse::<f64>().ok()?;
    Some((series.to_owned(), value))
}

/// Splits `name{a="x",b="y"}` into the name and its labels, unescaping
/// label values (`\\`, `\"`, `\n`). `None` if the labels are malformed.
pub fn parse_series(series: &str) -> Option<(&str, Vec<(String, String)>)> {
    let Some(brace) = series.find('{') else {
        return Some((series, Vec::new()));
    };
    let name = &series[..brace];
    let mut rest = series[brace + 1..].strip_suffix('}')?;
    let mut labels = Vec::new();
    loop {
        rest = rest.trim_start_matches([',', ' ']);
        if rest.is_empty() {
            return Some((name, labels));
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

        let r = raw(s.addr, b"HEAD /health HTTP/1.0\r\n\r\n".to_vec()).await;
        assert!(
            r.starts_with("HTTP/1.1 200 ") && r.ends_with("\r\n\r\n"),
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
            b"\r\n\r\n",
        ] {
            let r = raw(s.addr, bad.to_vec()).await;
            assert!(r.starts_with("HTTP/1.1 400 "), "{bad:?}: {r}");
        }
        // A client that closes mid-head gets nothing and harms nothing.
        assert_eq!(raw(s.addr, b"GET /met".to_vec()).await, "");
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
        assert_eq!(
            parse_response(b"HTTP/1.1 404 Not Found\r\nContent-Length: 3\r\n\r\nabcdef"),
            Ok((404, "abc".into()))
        );
        for bad in [
            &b"HTTP/1.1 200 OK\r\n"[..],
            b"SPDY 200 OK\r\n\r\n",
            b"HTTP/1.1 abc OK\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nabc",
        ] {
            assert!(parse_response(bad).is_err(), "{bad:?}");
        }
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
