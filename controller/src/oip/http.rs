//! The Open Inference Protocol over HTTP/REST (KServe v2, as Triton serves
//! it), on axum and hyper's HTTP/1.1.
//!
//! | method, path | answer |
//! |---|---|
//! | GET `/v2/health/live`, `/v2/health/ready` | `{"live": true}`, `{"ready": true}`; not ready: 503 |
//! | GET `/v2` | server metadata |
//! | GET `/v2/models/{m}[/versions/{v}]` | model metadata |
//! | GET `/v2/models/{m}[/versions/{v}]/ready` | `{"name", "ready": true}`; not ready: 503 |
//! | POST `/v2/models/{m}[/versions/{v}]/infer` | inference: JSON tensors and the binary tensor data extension |
//! | POST `/v2/repository/index` | the catalog's models |
//!
//! Every error is `{"error": "<code>: <what was wrong>"}` with the status of
//! [`OipError::http_status`]. Bounded: bodies ([`Frontend::BODY_BYTES_MAX`],
//! a larger one gets 413 naming the limit), connections
//! ([`Frontend::CONNECTIONS_MAX`], one over it gets 503 and is closed), the
//! time to send a request's headers. With an api key every request needs
//! `authorization: Bearer <key>` (401 without).

use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use http_body_util::BodyExt;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use serde_json::{json, Map, Value};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinSet;

use super::{Datatype, Frontend, InferRequest, InferResponse, OipError, Tensor};

/// The binary tensor data extension's header: the JSON part's length.
pub const INFERENCE_HEADER: &str = "inference-header-content-length";
/// Time a client has to send a request's headers (a stalled client holds
/// a connection slot no longer than this).
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);
/// How long shutdown lets requests in progress finish (within the
/// controller's own 5 s for all of its tasks).
const SHUTDOWN_GRACE: Duration = Duration::from_secs(4);
/// An over-size body is read and dropped (up to this many bytes, within
/// [`DRAIN_TIMEOUT`]) before the 413 goes out, so that a client that
/// writes its whole body before it reads gets the answer rather than a
/// reset connection.
const DRAIN_BYTES_MAX: u64 = 1 << 30;
const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// The routes, on `frontend`.
pub fn router(frontend: Frontend) -> Router {
    let model = Router::new()
        .route("/", get(model_metadata))
        .route("/ready", get(model_ready))
        .route("/infer", post(infer));
    Router::new()
        .route("/v2", get(server_metadata))
        .route("/v2/health/live", get(live))
        .route("/v2/health/ready", get(ready))
        .route("/v2/repository/index", post(repository_index))
        .route(
            "/v2/repository/models/{model}/{action}",
            post(repository_load),
        )
        .nest("/v2/models/{model}", model.clone())
        .nest("/v2/models/{model}/versions/{version}", model)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(frontend.clone(), authorize))
        .with_state(frontend)
}

/// Serves HTTP/1.1 on `listener` until `stop`, then lets requests in
/// progress finish (up to a grace period) and closes every connection.
pub async fn serve(listener: TcpListener, frontend: Frontend, stop: watch::Receiver<bool>) {
    serve_bounded(listener, frontend, stop, Frontend::CONNECTIONS_MAX).await
}

/// [`serve`] with at most `connections_max` connections open.
async fn serve_bounded(
    listener: TcpListener,
    frontend: Frontend,
    mut stop: watch::Receiver<bool>,
    connections_max: usize,
) {
    let app = router(frontend);
    let limit = Arc::new(Semaphore::new(connections_max));
    let graceful = GracefulShutdown::new();
    let mut conns = JoinSet::new();
    let mut refusing = false;
    loop {
        while conns.try_join_next().is_some() {}
        let accepted = tokio::select! {
            _ = stop.wait_for(|s| *s) => break,
            accepted = listener.accept() => accepted,
        };
        let (mut stream, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                log::warn!("inference (HTTP) accept failed: {e}; retrying in 50 ms");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(permit) = limit.clone().try_acquire_owned() else {
            if !refusing {
                log::warn!(
                    "inference (HTTP): refusing {peer}: {connections_max} connections open (the limit)"
                );
                refusing = true;
            }
            // Answered in the background, briefly, so accepting goes on.
            conns.spawn(async move {
                let refusal = refuse(&mut stream, connections_max);
                let _ = tokio::time::timeout(Duration::from_secs(1), refusal).await;
            });
            continue;
        };
        refusing = false;
        let _ = stream.set_nodelay(true);
        let conn = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(HEADER_READ_TIMEOUT)
            .serve_connection(TokioIo::new(stream), TowerToHyperService::new(app.clone()));
        let conn = graceful.watch(conn);
        conns.spawn(async move {
            if let Err(e) = conn.await {
                log::debug!("inference (HTTP) connection from {peer}: {e}");
            }
            drop(permit);
        });
    }
    drop(listener);
    if tokio::time::timeout(SHUTDOWN_GRACE, graceful.shutdown())
        .await
        .is_err()
    {
        log::warn!("inference (HTTP): requests did not finish within {SHUTDOWN_GRACE:?}; closing");
    }
    conns.shutdown().await;
}

/// The answer to a connection over the limit.
async fn refuse(stream: &mut tokio::net::TcpStream, connections_max: usize) {
    let body = json!({"error": format!(
        "unavailable: the server has {connections_max} connections open (the limit); retry later"
    )})
    .to_string();
    let head = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    let _ = stream.write_all(head.as_bytes()).await;
    let _ = stream.write_all(body.as_bytes()).await;
    let _ = stream.shutdown().await;
}

/// `{"error": message}` with the error's status.
fn error(e: OipError) -> Response {
    let status = StatusCode::from_u16(e.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (status, json_body(&json!({"error": e.message}))).into_response()
}

fn json_body(v: &Value) -> ([(header::HeaderName, HeaderValue); 1], String) {
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        v.to_string(),
    )
}

fn ok_json(v: Value) -> Response {
    (StatusCode::OK, json_body(&v)).into_response()
}

async fn authorize(State(fe): State<Frontend>, req: Request, next: Next) -> Response {
    let h = req.headers().get(header::AUTHORIZATION);
    let value = match h.map(|v| v.to_str()) {
        None => None,
        Some(Ok(v)) => Some(v),
        Some(Err(_)) => {
            return error(OipError::unauthenticated(
                "the authorization header is not visible ASCII",
            ))
        }
    };
    match fe.authorize(value) {
        Ok(()) => next.run(req).await,
        Err(e) => error(e),
    }
}

async fn not_found(method: Method, uri: Uri) -> Response {
    error(OipError {
        kind: super::ErrorKind::NotFound,
        message: format!(
            "not_found: no endpoint {method} {}; the server speaks the Open Inference Protocol v2 \
             (/v2, /v2/health/live, /v2/models/<model>/infer, ...)",
            uri.path()
        ),
    })
}

async fn method_not_allowed(method: Method, uri: Uri) -> Response {
    let mut r = error(OipError::bad_request(format!(
        "{} does not take {method}",
        uri.path()
    )));
    *r.status_mut() = StatusCode::METHOD_NOT_ALLOWED;
    r
}

async fn live(State(fe): State<Frontend>) -> Response {
    ok_json(json!({"live": fe.live()}))
}

async fn ready(State(fe): State<Frontend>) -> Response {
    match fe.ready_reason() {
        None => ok_json(json!({"ready": true})),
        Some(why) => error(OipError::code(
            distmind_common::proto::ErrorCode::Unavailable,
            format!("not ready: {why}"),
        )),
    }
}

async fn server_metadata(State(fe): State<Frontend>) -> Response {
    let m = fe.server_metadata();
    ok_json(json!({"name": m.name, "version": m.version, "extensions": m.extensions}))
}

/// `{model}` alone or with `{version}`.
#[derive(serde::Deserialize)]
struct ModelPath {
    model: String,
    version: Option<String>,
}

async fn model_metadata(State(fe): State<Frontend>, Path(p): Path<ModelPath>) -> Response {
    match fe.model_metadata(&p.model, p.version.as_deref()) {
        Ok(m) => {
            let tensors = |ts: &[super::TensorMeta]| -> Vec<Value> {
                ts.iter()
                    .map(|t| json!({"name": t.name, "datatype": t.datatype.as_str(), "shape": t.shape}))
                    .collect()
            };
            ok_json(json!({
                "name": m.name,
                "versions": m.versions,
                "platform": m.platform,
                "inputs": tensors(&m.inputs),
                "outputs": tensors(&m.outputs),
            }))
        }
        Err(e) => error(e),
    }
}

async fn model_ready(State(fe): State<Frontend>, Path(p): Path<ModelPath>) -> Response {
    match fe.model_ready(&p.model, p.version.as_deref()) {
        Ok(true) => ok_json(json!({"name": p.model, "ready": true})),
        Ok(false) => error(OipError::code(
            distmind_common::proto::ErrorCode::Unavailable,
            format!(
                "model {} is not ready: {}",
                p.model,
                fe.ready_reason()
                    .unwrap_or_else(|| "it just became ready".into())
            ),
        )),
        Err(e) => error(e),
    }
}

async fn repository_index(State(fe): State<Frontend>, headers: HeaderMap, body: Body) -> Response {
    let body = match read_body(&headers, body).await {
        Ok(b) => b,
        Err(e) => return error(e),
    };
    // tritonclient sends an empty body; `{"ready": true}` lists the ready only.
    let ready_only = if body.iter().all(u8::is_ascii_whitespace) {
        false
    } else {
        match serde_json::from_slice::<Value>(&body) {
            Ok(Value::Object(o)) => match o.get("ready") {
                None => false,
                Some(Value::Bool(b)) => *b,
                Some(other) => {
                    return error(OipError::bad_request(format!(
                        "repository index: \"ready\" must be true or false, got {other}"
                    )))
                }
            },
            Ok(other) => {
                return error(OipError::bad_request(format!(
                    "repository index: the body must be a JSON object like {{\"ready\": true}}, got {other}"
                )))
            }
            Err(e) => {
                return error(OipError::bad_request(format!(
                    "repository index: the body is not JSON: {e}"
                )))
            }
        }
    };
    let models: Vec<Value> = fe
        .repository_index(ready_only)
        .into_iter()
        .map(|m| {
            let mut o = Map::new();
            o.insert("name".into(), m.name.into());
            if let Some(v) = m.version {
                o.insert("version".into(), v.into());
            }
            o.insert("state".into(), m.state.into());
            if !m.reason.is_empty() {
                o.insert("reason".into(), m.reason.into());
            }
            Value::Object(o)
        })
        .collect();
    ok_json(Value::Array(models))
}

async fn repository_load(Path((model, action)): Path<(String, String)>) -> Response {
    error(OipError::code(
        distmind_common::proto::ErrorCode::Unsupported,
        format!(
            "repository {action} of {model}: models are added with `distmind deploy` and removed \
             from the catalog, not loaded over the protocol"
        ),
    ))
}

/// Reads a whole body, at most [`Frontend::BODY_BYTES_MAX`] bytes.
async fn read_body(headers: &HeaderMap, body: Body) -> Result<Bytes, OipError> {
    let max = Frontend::BODY_BYTES_MAX;
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if let Some(n) = declared.filter(|&n| n > max as u64) {
        drain(body).await;
        return Err(OipError::too_large(
            "request body",
            Some(usize::try_from(n).unwrap_or(usize::MAX)),
            max,
        ));
    }
    let mut body = body;
    let mut out = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame =
            frame.map_err(|e| OipError::bad_request(format!("cannot read the body: {e}")))?;
        if let Ok(data) = frame.into_data() {
            if out.len() + data.len() > max {
                drain(body).await;
                return Err(OipError::too_large("request body", None, max));
            }
            out.extend_from_slice(&data);
        }
    }
    Ok(Bytes::from(out))
}

/// Reads and drops the rest of `body`, bounded in bytes and time.
async fn drain(mut body: Body) {
    let _ = tokio::time::timeout(DRAIN_TIMEOUT, async {
        let mut seen = 0u64;
        while let Some(Ok(frame)) = body.frame().await {
            if let Ok(d) = frame.into_data() {
                seen += d.len() as u64;
                if seen > DRAIN_BYTES_MAX {
                    return;
                }
            }
        }
    })
    .await;
}

async fn infer(
    State(fe): State<Frontend>,
    Path(p): Path<ModelPath>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let body = match read_body(&headers, body).await {
        Ok(b) => b,
        Err(e) => return error(e),
    };
    let parsed = match parse_infer(p.model, p.version, &headers, &body) {
        Ok(r) => r,
        Err(e) => return error(e),
    };
    match fe.infer(parsed.request).await {
        Ok(resp) => infer_response(resp, &parsed.binary),
        Err(e) => error(e),
    }
}

/// A parsed infer body: the request, and which outputs go back binary.
#[derive(Debug)]
struct ParsedInfer {
    request: InferRequest,
    /// Output name -> binary; `default` for outputs not named.
    binary: BinaryOutputs,
}

#[derive(Debug)]
struct BinaryOutputs {
    default: bool,
    named: Vec<(String, bool)>,
}

impl BinaryOutputs {
    fn get(&self, name: &str) -> bool {
        self.named
            .iter()
            .find(|(n, _)| n == name)
            .map_or(self.default, |&(_, b)| b)
    }
}

/// The JSON part and the binary part of an infer body.
fn split_body<'a>(headers: &HeaderMap, body: &'a [u8]) -> Result<(&'a [u8], &'a [u8]), OipError> {
    let Some(v) = headers.get(INFERENCE_HEADER) else {
        return Ok((body, &[]));
    };
    let n = v
        .to_str()
        .ok()
        .and_then(|s| s.trim().parse::<usize>().ok())
        .ok_or_else(|| {
            OipError::bad_request(format!(
                "header {INFERENCE_HEADER}: {v:?} is not a byte count"
            ))
        })?;
    if n > body.len() {
        return Err(OipError::bad_request(format!(
            "header {INFERENCE_HEADER} says the JSON part is {n} bytes; the body has {}",
            body.len()
        )));
    }
    Ok(body.split_at(n))
}

fn parse_infer(
    model: String,
    version: Option<String>,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<ParsedInfer, OipError> {
    let (json_part, mut blobs) = split_body(headers, body)?;
    let v: Value = serde_json::from_slice(json_part)
        .map_err(|e| OipError::bad_request(format!("the infer request is not JSON: {e}")))?;
    let Value::Object(o) = v else {
        return Err(OipError::bad_request(
            "the infer request must be a JSON object with \"inputs\"",
        ));
    };
    let id = match o.get("id") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(other) => {
            return Err(OipError::bad_request(format!(
                "\"id\" must be a string, got {other}"
            )))
        }
    };
    let params = parameters(o.get("parameters"), "the request")?;
    let slo_ms = match params.get("slo_ms") {
        None => None,
        Some(v) => Some(positive_ms(v)?),
    };
    let priority = match params.get("priority") {
        None => 0,
        Some(v) => v
            .as_u64()
            .and_then(|p| u32::try_from(p).ok())
            .ok_or_else(|| {
                OipError::bad_request(format!(
                    "parameter \"priority\" must be a whole number 0..={} (0 = default, 1 = highest), got {v}",
                    u32::MAX
                ))
            })?,
    };
    let binary_default = match params.get("binary_data_output") {
        None => false,
        Some(Value::Bool(b)) => *b,
        Some(other) => {
            return Err(OipError::bad_request(format!(
                "parameter \"binary_data_output\" must be true or false, got {other}"
            )))
        }
    };
    let Some(Value::Array(inputs_json)) = o.get("inputs") else {
        return Err(OipError::bad_request(
            "the infer request needs \"inputs\": an array of {\"name\", \"shape\", \"datatype\", \"data\"}",
        ));
    };
    let mut inputs = Vec::with_capacity(inputs_json.len());
    for (i, t) in inputs_json.iter().enumerate() {
        inputs.push(parse_input(i, t, &mut blobs)?);
    }
    if !blobs.is_empty() {
        return Err(OipError::bad_request(format!(
            "{} bytes of binary data follow the inputs' binary_data_size",
            blobs.len()
        )));
    }
    let mut named = Vec::new();
    let outputs = match o.get("outputs") {
        None | Some(Value::Null) => None,
        Some(Value::Array(outs)) => {
            let mut names = Vec::with_capacity(outs.len());
            for (i, out) in outs.iter().enumerate() {
                let name = out.get("name").and_then(Value::as_str).ok_or_else(|| {
                    OipError::bad_request(format!("outputs[{i}] needs a \"name\""))
                })?;
                let p = parameters(out.get("parameters"), &format!("output {name}"))?;
                match p.get("binary_data") {
                    None => {}
                    Some(Value::Bool(b)) => named.push((name.to_string(), *b)),
                    Some(other) => {
                        return Err(OipError::bad_request(format!(
                            "output {name}: parameter \"binary_data\" must be true or false, got {other}"
                        )))
                    }
                }
                names.push(name.to_string());
            }
            Some(names)
        }
        Some(other) => {
            return Err(OipError::bad_request(format!(
                "\"outputs\" must be an array of {{\"name\"}}, got {other}"
            )))
        }
    };
    Ok(ParsedInfer {
        request: InferRequest {
            model,
            version,
            id,
            slo_ms,
            priority,
            inputs,
            outputs,
        },
        binary: BinaryOutputs {
            default: binary_default,
            named,
        },
    })
}

/// A `parameters` object (absent: empty).
fn parameters(v: Option<&Value>, whose: &str) -> Result<Map<String, Value>, OipError> {
    match v {
        None | Some(Value::Null) => Ok(Map::new()),
        Some(Value::Object(o)) => Ok(o.clone()),
        Some(other) => Err(OipError::bad_request(format!(
            "{whose}: \"parameters\" must be an object, got {other}"
        ))),
    }
}

/// `slo_ms`: a positive number of milliseconds (rounded up to whole ms).
fn positive_ms(v: &Value) -> Result<u64, OipError> {
    v.as_f64()
        .filter(|ms| ms.is_finite() && *ms > 0.0 && *ms < 1e12)
        .map(|ms| ms.ceil() as u64)
        .ok_or_else(|| {
            OipError::bad_request(format!(
                "parameter \"slo_ms\" must be a positive number of milliseconds, got {v}"
            ))
        })
}

fn parse_input(i: usize, t: &Value, blobs: &mut &[u8]) -> Result<Tensor, OipError> {
    let name = t
        .get("name")
        .and_then(Value::as_str)
        .ok_or_else(|| OipError::bad_request(format!("inputs[{i}] needs a \"name\" string")))?
        .to_string();
    let datatype = match t.get("datatype").and_then(Value::as_str) {
        Some(d) => Datatype::parse(d)?,
        None => {
            return Err(OipError::bad_request(format!(
                "input {name} needs a \"datatype\" string (FP32, INT64, ...)"
            )))
        }
    };
    let shape: Vec<i64> = match t.get("shape") {
        Some(Value::Array(dims)) => dims
            .iter()
            .map(|d| d.as_i64())
            .collect::<Option<_>>()
            .ok_or_else(|| {
                OipError::bad_request(format!(
                    "input {name}: \"shape\" must be an array of whole numbers"
                ))
            })?,
        _ => {
            return Err(OipError::bad_request(format!(
                "input {name} needs a \"shape\" array"
            )))
        }
    };
    let params = parameters(t.get("parameters"), &format!("input {name}"))?;
    let data = match params.get("binary_data_size") {
        Some(size) => {
            let n = size
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .ok_or_else(|| {
                    OipError::bad_request(format!(
                        "input {name}: \"binary_data_size\" must be a byte count, got {size}"
                    ))
                })?;
            if n > blobs.len() {
                return Err(OipError::bad_request(format!(
                    "input {name}: binary_data_size {n}, but {} bytes of binary data remain \
                     (is the {INFERENCE_HEADER} header set?)",
                    blobs.len()
                )));
            }
            let (mine, rest) = blobs.split_at(n);
            *blobs = rest;
            mine.to_vec()
        }
        None => {
            let data = t.get("data").ok_or_else(|| {
                OipError::bad_request(format!(
                    "input {name} has neither \"data\" nor parameters.binary_data_size"
                ))
            })?;
            json_to_raw(&name, datatype, &shape, data)?
        }
    };
    let t = Tensor {
        name,
        datatype,
        shape,
        data,
    };
    t.check_size()?;
    Ok(t)
}

/// JSON `data` (flat or nested, row-major) as raw little-endian bytes.
fn json_to_raw(name: &str, dt: Datatype, shape: &[i64], data: &Value) -> Result<Vec<u8>, OipError> {
    let n = super::element_count(name, shape)?;
    let mut flat = Vec::with_capacity(n.min(1 << 20));
    flatten(data, &mut flat, n)?;
    if flat.len() != n {
        return Err(OipError::bad_request(format!(
            "input {name}: shape {shape:?} holds {n} elements, \"data\" has {}",
            flat.len()
        )));
    }
    let bad = |v: &Value| OipError::bad_request(format!("input {name}: {v} is not a {dt} value"));
    let mut out = Vec::with_capacity(n * dt.element_bytes().unwrap_or(8));
    for v in flat {
        match dt {
            Datatype::Bool => out.push(v.as_bool().ok_or_else(|| bad(v))? as u8),
            Datatype::U8 => out.push(int::<u8>(v).ok_or_else(|| bad(v))?),
            Datatype::I8 => out.extend(int::<i8>(v).ok_or_else(|| bad(v))?.to_le_bytes()),
            Datatype::U16 => out.extend(int::<u16>(v).ok_or_else(|| bad(v))?.to_le_bytes()),
            Datatype::I16 => out.extend(int::<i16>(v).ok_or_else(|| bad(v))?.to_le_bytes()),
            Datatype::U32 => out.extend(int::<u32>(v).ok_or_else(|| bad(v))?.to_le_bytes()),
            Datatype::I32 => out.extend(int::<i32>(v).ok_or_else(|| bad(v))?.to_le_bytes()),
            Datatype::U64 => out.extend(v.as_u64().ok_or_else(|| bad(v))?.to_le_bytes()),
            Datatype::I64 => out.extend(v.as_i64().ok_or_else(|| bad(v))?.to_le_bytes()),
            Datatype::F32 => out.extend((v.as_f64().ok_or_else(|| bad(v))? as f32).to_le_bytes()),
            Datatype::F64 => out.extend(v.as_f64().ok_or_else(|| bad(v))?.to_le_bytes()),
            Datatype::Bf16 => {
                let x = v.as_f64().ok_or_else(|| bad(v))? as f32;
                out.extend(((x.to_bits() >> 16) as u16).to_le_bytes());
            }
            Datatype::F16 => {
                return Err(OipError::bad_request(format!(
                    "input {name}: FP16 data is taken as binary only (the binary tensor data extension)"
                )))
            }
            Datatype::Bytes => {
                let s = v.as_str().ok_or_else(|| bad(v))?;
                out.extend((s.len() as u32).to_le_bytes());
                out.extend(s.as_bytes());
            }
        }
    }
    Ok(out)
}

fn int<T: TryFrom<i64>>(v: &Value) -> Option<T> {
    v.as_i64().and_then(|x| T::try_from(x).ok())
}

/// Nested arrays in row-major order; stops past `max` elements.
fn flatten<'a>(v: &'a Value, out: &mut Vec<&'a Value>, max: usize) -> Result<(), OipError> {
    match v {
        Value::Array(items) => {
            for x in items {
                flatten(x, out, max)?;
                if out.len() > max {
                    return Ok(());
                }
            }
        }
        scalar => out.push(scalar),
    }
    Ok(())
}

/// Raw little-endian elements as JSON values.
fn raw_to_json(t: &Tensor) -> Result<Vec<Value>, OipError> {
    fn each<const N: usize>(d: &[u8], f: impl Fn([u8; N]) -> Value) -> Vec<Value> {
        d.chunks_exact(N)
            .map(|c| f(c.try_into().expect("N bytes")))
            .collect()
    }
    let d = &t.data;
    Ok(match t.datatype {
        Datatype::Bool => d.iter().map(|&b| Value::Bool(b != 0)).collect(),
        Datatype::U8 => d.iter().map(|&b| json!(b)).collect(),
        Datatype::I8 => each::<1>(d, |b| json!(i8::from_le_bytes(b))),
        Datatype::U16 => each::<2>(d, |b| json!(u16::from_le_bytes(b))),
        Datatype::I16 => each::<2>(d, |b| json!(i16::from_le_bytes(b))),
        Datatype::U32 => each::<4>(d, |b| json!(u32::from_le_bytes(b))),
        Datatype::I32 => each::<4>(d, |b| json!(i32::from_le_bytes(b))),
        Datatype::U64 => each::<8>(d, |b| json!(u64::from_le_bytes(b))),
        Datatype::I64 => each::<8>(d, |b| json!(i64::from_le_bytes(b))),
        Datatype::F32 => each::<4>(d, |b| json!(f32::from_le_bytes(b))),
        Datatype::F64 => each::<8>(d, |b| json!(f64::from_le_bytes(b))),
        Datatype::Bf16 => each::<2>(d, |b| {
            json!(f32::from_bits((u16::from_le_bytes(b) as u32) << 16))
        }),
        Datatype::F16 | Datatype::Bytes => {
            return Err(OipError::code(
                distmind_common::proto::ErrorCode::Unsupported,
                format!(
                "output {}: {} is returned as binary only; ask for it with parameters.binary_data",
                t.name, t.datatype
            ),
            ))
        }
    })
}

fn infer_response(resp: InferResponse, binary: &BinaryOutputs) -> Response {
    let mut outputs = Vec::with_capacity(resp.outputs.len());
    let mut blobs: Vec<&[u8]> = Vec::new();
    for t in &resp.outputs {
        let mut o = Map::new();
        o.insert("name".into(), t.name.clone().into());
        o.insert("datatype".into(), t.datatype.as_str().into());
        o.insert("shape".into(), json!(t.shape));
        if binary.get(&t.name) {
            o.insert(
                "parameters".into(),
                json!({"binary_data_size": t.data.len()}),
            );
            blobs.push(&t.data);
        } else {
            match raw_to_json(t) {
                Ok(data) => {
                    o.insert("data".into(), Value::Array(data));
                }
                Err(e) => return error(e),
            }
        }
        outputs.push(Value::Object(o));
    }
    let mut head = Map::new();
    head.insert("model_name".into(), resp.model.into());
    if let Some(v) = resp.version {
        head.insert("model_version".into(), v.into());
    }
    if !resp.id.is_empty() {
        head.insert("id".into(), resp.id.into());
    }
    head.insert("outputs".into(), Value::Array(outputs));
    let head = Value::Object(head).to_string();
    if blobs.is_empty() {
        return (StatusCode::OK, json_body_str(head)).into_response();
    }
    let mut body = Vec::with_capacity(head.len() + blobs.iter().map(|b| b.len()).sum::<usize>());
    body.extend_from_slice(head.as_bytes());
    for b in blobs {
        body.extend_from_slice(b);
    }
    (
        StatusCode::OK,
        [
            (
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/octet-stream"),
            ),
            (
                header::HeaderName::from_static(INFERENCE_HEADER),
                HeaderValue::from(head.len()),
            ),
        ],
        body,
    )
        .into_response()
}

fn json_body_str(s: String) -> ([(header::HeaderName, HeaderValue); 1], String) {
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        s,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    use distmind_common::handshake::ClusterKey;
    use tokio::io::AsyncReadExt;

    use crate::dispatch::metrics::DispatchMetrics;
    use crate::dispatch::net::DispatchNet;
    use crate::dispatch::{DispatchConfig, Dispatcher};
    use crate::policy::distmind::DistMindConfig;
    use crate::policy::PolicyKind;
    use crate::state::ControllerState;

    /// One request on a fresh connection, answered with `connection: close`.
    async fn get(addr: std::net::SocketAddr, path: &str, token: Option<&str>) -> String {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let auth = token.map_or(String::new(), |t| format!("authorization: Bearer {t}\r\n"));
        let req = format!("GET {path} HTTP/1.1\r\nhost: x\r\n{auth}connection: close\r\n\r\n");
        s.write_all(req.as_bytes()).await.unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        out
    }

    #[tokio::test]
    async fn a_real_server_bounds_connections_checks_tokens_and_stops() {
        let (stop_tx, stop) = watch::channel(false);
        let mut tasks = JoinSet::new();
        let state = Arc::new(Mutex::new(ControllerState::new(Duration::from_secs(1))));
        let config = DispatchConfig::new(PolicyKind::Slo, DistMindConfig::inference_only(1));
        let net = DispatchNet::start(
            Dispatcher::new(config).unwrap(),
            state.clone(),
            ClusterKey::from_secret(b"oip-http-unit-test-key"),
            Arc::new(DispatchMetrics::new()),
            &mut tasks,
            stop.clone(),
        );
        let fe = Frontend::new(net.handle(), state, Some("sesame".into()));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tasks.spawn(serve_bounded(listener, fe, stop.clone(), 2));

        let live = get(addr, "/v2/health/live", Some("sesame")).await;
        assert!(
            live.starts_with("HTTP/1.1 200") && live.ends_with(r#"{"live":true}"#),
            "{live}"
        );
        let r = get(addr, "/v2", None).await;
        assert!(
            r.starts_with("HTTP/1.1 401") && r.contains("unauthenticated"),
            "{r}"
        );
        let r = get(addr, "/v2/health/ready", Some("sesame")).await;
        assert!(
            r.starts_with("HTTP/1.1 503") && r.contains("no GPU server is up"),
            "{r}"
        );
        let r = get(addr, "/v2/models/m", Some("sesame")).await;
        assert!(
            r.starts_with("HTTP/1.1 404") && r.contains("unknown model 'm'"),
            "{r}"
        );

        // Two idle keep-alive connections fill the bound; a third is refused
        // with a protocol error, and served again once one closes.
        let held_a = tokio::net::TcpStream::connect(addr).await.unwrap();
        let _held_b = tokio::net::TcpStream::connect(addr).await.unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        let refused = loop {
            let r = get(addr, "/v2/health/live", Some("sesame")).await;
            if r.starts_with("HTTP/1.1 503") {
                break r;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "a third connection is served: {r}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        assert!(
            refused.contains("2 connections open (the limit)"),
            "{refused}"
        );
        drop(held_a);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let r = get(addr, "/v2/health/live", Some("sesame")).await;
            if r.starts_with("HTTP/1.1 200") {
                break;
            }
            assert!(tokio::time::Instant::now() < deadline, "still refused: {r}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }

        // Stopping ends the server (idle connections included) at once.
        stop_tx.send(true).unwrap();
        let all = async { while tasks.join_next().await.is_some() {} };
        tokio::time::timeout(Duration::from_secs(3), all)
            .await
            .expect("the server and the dispatcher stop within the grace period");
    }

    fn headers(json_len: Option<usize>) -> HeaderMap {
        let mut h = HeaderMap::new();
        if let Some(n) = json_len {
            h.insert(INFERENCE_HEADER, HeaderValue::from(n));
        }
        h
    }

    fn parse(body: &[u8], json_len: Option<usize>) -> Result<ParsedInfer, OipError> {
        parse_infer("m".into(), None, &headers(json_len), body)
    }

    #[test]
    fn json_tensors_nested_or_flat_become_raw_bytes() {
        let body = br#"{"id": "r1", "inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 2],
            "data": [[1.5, 2], [3, -4]]}], "parameters": {"slo_ms": 12.5, "priority": 1}}"#;
        let p = parse(body, None).unwrap();
        let r = &p.request;
        assert_eq!((r.id.as_str(), r.slo_ms, r.priority), ("r1", Some(13), 1));
        let want: Vec<u8> = [1.5f32, 2.0, 3.0, -4.0]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        assert_eq!(r.inputs[0].data, want);
        assert_eq!(r.outputs, None);
        assert!(!p.binary.get("anything"));
        assert_eq!(
            raw_to_json(&r.inputs[0]).unwrap(),
            vec![json!(1.5), json!(2.0), json!(3.0), json!(-4.0)]
        );
    }

    #[test]
    fn binary_inputs_come_from_after_the_json_part() {
        let json = br#"{"inputs": [{"name": "ids", "datatype": "INT64", "shape": [1, 2],
            "parameters": {"binary_data_size": 16}}],
            "outputs": [{"name": "a", "parameters": {"binary_data": true}}, {"name": "b"}]}"#;
        let mut body = json.to_vec();
        body.extend(7i64.to_le_bytes());
        body.extend((-1i64).to_le_bytes());
        let p = parse(&body, Some(json.len())).unwrap();
        let t = &p.request.inputs[0];
        assert_eq!((t.datatype, t.shape.clone()), (Datatype::I64, vec![1, 2]));
        assert_eq!(raw_to_json(t).unwrap(), vec![json!(7), json!(-1)]);
        assert_eq!(p.request.outputs, Some(vec!["a".into(), "b".into()]));
        assert!(p.binary.get("a") && !p.binary.get("b"));
        // Without the header there is no binary part.
        let e = parse(&body, None).unwrap_err();
        assert!(e.message.contains("not JSON"), "{e}");
        let e = parse(json, Some(json.len())).unwrap_err();
        assert!(
            e.message.contains("binary_data_size 16") && e.message.contains(INFERENCE_HEADER),
            "{e}"
        );
        body.push(0);
        let e = parse(&body, Some(json.len())).unwrap_err();
        assert!(e.message.contains("1 bytes of binary data follow"), "{e}");
        let e = parse(json, Some(json.len() + 1)).unwrap_err();
        assert!(e.message.contains("the body has"), "{e}");
    }

    #[test]
    fn every_datatype_converts_from_json() {
        let raw = |dt, data: Value| json_to_raw("x", dt, &[2], &data);
        assert_eq!(
            raw(Datatype::Bool, json!([true, false])).unwrap(),
            vec![1, 0]
        );
        assert_eq!(raw(Datatype::I8, json!([-1, 2])).unwrap(), vec![255, 2]);
        assert_eq!(
            raw(Datatype::U16, json!([1, 256])).unwrap(),
            vec![1, 0, 0, 1]
        );
        assert_eq!(
            raw(Datatype::Bf16, json!([1.0, -2.0])).unwrap(),
            vec![0x80, 0x3f, 0x00, 0xc0]
        );
        assert_eq!(
            raw(Datatype::Bytes, json!(["ab", ""])).unwrap(),
            vec![2, 0, 0, 0, b'a', b'b', 0, 0, 0, 0]
        );
        let e = raw(Datatype::U8, json!([1, 256])).unwrap_err();
        assert!(e.message.contains("256 is not a UINT8 value"), "{e}");
        let e = raw(Datatype::F32, json!([1.0])).unwrap_err();
        assert!(
            e.message.contains("holds 2 elements, \"data\" has 1"),
            "{e}"
        );
        let e = raw(Datatype::F16, json!([1.0, 2.0])).unwrap_err();
        assert!(e.message.contains("binary only"), "{e}");
    }

    #[test]
    fn malformed_requests_are_named() {
        let cases: [(&[u8], &str); 7] = [
            (b"[]", "must be a JSON object"),
            (b"{}", "needs \"inputs\""),
            (
                br#"{"inputs": [{"datatype": "FP32"}]}"#,
                "inputs[0] needs a \"name\"",
            ),
            (
                br#"{"inputs": [{"name": "x", "datatype": "F32", "shape": [1], "data": [1]}]}"#,
                "unknown datatype \"F32\"",
            ),
            (
                br#"{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1]}]}"#,
                "neither \"data\"",
            ),
            (
                br#"{"inputs": [], "parameters": {"priority": -1}}"#,
                "\"priority\" must be a whole number",
            ),
            (
                br#"{"inputs": [], "parameters": {"slo_ms": 0}}"#,
                "\"slo_ms\" must be a positive number",
            ),
        ];
        for (body, words) in cases {
            let e = parse(body, None)
                .err()
                .unwrap_or_else(|| panic!("{} parsed", String::from_utf8_lossy(body)));
            assert_eq!(e.http_status(), 400);
            assert!(
                e.message.starts_with("bad_request: ") && e.message.contains(words),
                "{e}"
            );
        }
    }
}
