//! The Open Inference Protocol over gRPC: the protocol's
//! `inference.GRPCInferenceService` (`proto/inference.proto`), on tonic.
//!
//! Each rpc converts its protobuf message to the protocol-neutral types of
//! [`super`] and calls the shared [`Frontend`], as the HTTP front end does.
//! Inputs arrive either as `raw_input_contents` (what tritonclient sends) or
//! as typed `contents` (what kserve sends for Python lists); outputs always
//! go back as `raw_output_contents`, one entry per output, in order, which
//! is the only form tritonclient's `as_numpy` reads.
//!
//! Bounds: messages up to [`Frontend::BODY_BYTES_MAX`] each way (tonic's
//! default of 4 MiB is below what clients send; a larger one gets
//! RESOURCE_EXHAUSTED `too_large: ...`, as HTTP gets 413), at most
//! [`Frontend::CONNECTIONS_MAX`] connections (further ones wait in the
//! listen backlog), [`STREAMS_PER_CONNECTION_MAX`] concurrent calls on one
//! connection, [`STREAM_IN_FLIGHT_MAX`] requests in flight on one
//! `ModelStreamInfer` stream. When `settings/api.key` is set every call needs
//! `authorization: Bearer <key>` metadata, else UNAUTHENTICATED. Every error
//! is a gRPC status of the [`OipError`]'s code, whose message starts with the
//! distmind error code's wire name and names what was wrong.
//!
//! Served: ServerLive, ServerReady, ModelReady, ServerMetadata,
//! ModelMetadata, ModelInfer, ModelStreamInfer, RepositoryIndex. Triton's
//! other rpcs (ModelConfig, ModelStatistics, repository load/unload, shared
//! memory, trace and log settings) are not declared: clients get
//! UNIMPLEMENTED `unsupported: <path> is not served here; ...`.

use std::collections::HashMap;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use distmind_common::proto::ErrorCode;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch, OwnedSemaphorePermit, Semaphore};
use tokio_stream::wrappers::ReceiverStream;
use tonic::codegen::http;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::server::{Connected, TcpConnectInfo};
use tonic::{Request, Response, Status, Streaming};

use super::{
    element_count, Datatype, Frontend, InferRequest, InferResponse, OipError, Tensor, TensorMeta,
};

/// The protobuf messages and the tonic service generated from
/// `proto/inference.proto` by `build.rs`.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod pb {
    tonic::include_proto!("inference");
}

use pb::grpc_inference_service_server::{GrpcInferenceService, GrpcInferenceServiceServer};
use pb::infer_parameter::ParameterChoice;
use pb::model_infer_request::{InferInputTensor, InferRequestedOutputTensor};
use pb::model_infer_response::InferOutputTensor;

/// Most calls (HTTP/2 streams) open at once on one connection.
pub const STREAMS_PER_CONNECTION_MAX: u32 = 128;

/// Most requests of one `ModelStreamInfer` stream being served at once;
/// the stream's next request is read when one finishes.
pub const STREAM_IN_FLIGHT_MAX: usize = 32;

/// HTTP/2 pings on idle connections, so a vanished client's connection (and
/// its slot under the connection limit) is closed.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(20);

/// How long the accept loop backs off after a failed accept (out of file
/// descriptors, a reset before accept).
const ACCEPT_RETRY: Duration = Duration::from_millis(50);

/// Serves `GRPCInferenceService` on `listener` until `stop` turns true.
pub async fn serve(listener: TcpListener, frontend: Frontend, stop: watch::Receiver<bool>) {
    let addr = listener
        .local_addr()
        .map_or_else(|_| "?".into(), |a| a.to_string());
    let auth = frontend.clone();
    let service = GrpcInferenceServiceServer::new(InferenceService { frontend })
        .max_decoding_message_size(Frontend::BODY_BYTES_MAX)
        .max_encoding_message_size(Frontend::BODY_BYTES_MAX);
    let service = InterceptedService::new(service, move |req: Request<()>| {
        authorize(&auth, &req)?;
        Ok(req)
    });
    // Connections come through a channel from our own accept loop, which
    // holds a permit per open connection (tonic's own loop has no cap).
    let (conns_tx, conns_rx) = mpsc::channel(1);
    let accept = tokio::spawn(accept_loop(
        listener,
        Frontend::CONNECTIONS_MAX,
        conns_tx,
        stop.clone(),
    ));
    let mut stop_serving = stop;
    let result = tonic::transport::Server::builder()
        .max_concurrent_streams(STREAMS_PER_CONNECTION_MAX)
        .http2_keepalive_interval(Some(KEEPALIVE_INTERVAL))
        .http2_keepalive_timeout(Some(KEEPALIVE_TIMEOUT))
        .layer(tower::layer::layer_fn(ProtocolStatus))
        .add_service(service)
        .serve_with_incoming_shutdown(ReceiverStream::new(conns_rx), async move {
            let _ = stop_serving.wait_for(|s| *s).await;
        })
        .await;
    accept.abort();
    if let Err(e) = result {
        log::error!("Open Inference Protocol (gRPC) server on {addr} failed: {e}");
    }
}

/// Accepts connections while fewer than `max` are open and hands them to
/// tonic; the others wait in the listen backlog until one closes.
async fn accept_loop(
    listener: TcpListener,
    max: usize,
    conns: mpsc::Sender<io::Result<LimitedConn>>,
    mut stop: watch::Receiver<bool>,
) {
    let limit = Arc::new(Semaphore::new(max));
    loop {
        let permit = match limit.clone().try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                log::warn!("gRPC: {max} connections open (the limit): new connections wait");
                tokio::select! {
                    p = limit.clone().acquire_owned() => p.expect("the semaphore is never closed"),
                    _ = stop.wait_for(|s| *s) => return,
                }
            }
        };
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = stop.wait_for(|s| *s) => return,
        };
        let stream = match accepted {
            Ok((stream, _peer)) => stream,
            Err(e) => {
                log::warn!("gRPC: accept failed: {e}; retrying");
                tokio::time::sleep(ACCEPT_RETRY).await;
                continue;
            }
        };
        // Small replies (readiness, metadata) must not wait for Nagle.
        let _ = stream.set_nodelay(true);
        let conn = LimitedConn {
            stream,
            _permit: permit,
        };
        if conns.send(Ok(conn)).await.is_err() {
            return; // the server stopped
        }
    }
}

/// An accepted connection holding its slot under the connection limit until
/// it is dropped (closed).
struct LimitedConn {
    stream: TcpStream,
    _permit: OwnedSemaphorePermit,
}

impl Connected for LimitedConn {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        self.stream.connect_info()
    }
}

impl AsyncRead for LimitedConn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for LimitedConn {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

/// Checks the call's `authorization` metadata against the api key.
#[allow(clippy::result_large_err)] // tonic's interceptors return `Status`
fn authorize(frontend: &Frontend, req: &Request<()>) -> Result<(), Status> {
    let header = match req.metadata().get("authorization") {
        None => None,
        Some(v) => Some(v.to_str().map_err(|_| {
            status(OipError::unauthenticated(
                "the authorization metadata is not printable ASCII; send `Bearer <key>`",
            ))
        })?),
    };
    frontend.authorize(header).map_err(status)
}

/// The gRPC status of an error: its code, and its message (which starts
/// with the distmind error code's wire name).
pub fn status(e: OipError) -> Status {
    Status::new(tonic::Code::from_i32(e.grpc_code()), e.message)
}

/// tonic refuses a message over the decoding limit itself, before any rpc
/// runs, as OUT_OF_RANGE "Error, decoded message length too large: found N
/// bytes, the limit is: M bytes". The protocol's clients (and gRPC's own
/// implementations) say RESOURCE_EXHAUSTED for that, and every error here
/// names its distmind code: give that status instead. Anything else is kept.
fn too_large_status(s: &Status) -> Option<Status> {
    const TONIC_TOO_LARGE: &str = "decoded message length too large: found ";
    if s.code() != tonic::Code::OutOfRange {
        return None;
    }
    let (_, rest) = s.message().split_once(TONIC_TOO_LARGE)?;
    let found = rest
        .split_once(' ')
        .and_then(|(n, _)| n.parse::<usize>().ok());
    Some(status(OipError::too_large(
        "message",
        found,
        Frontend::BODY_BYTES_MAX,
    )))
}

/// The rpcs this server declares, for the message of any other.
const SERVED_RPCS: &str = "ServerLive, ServerReady, ModelReady, ServerMetadata, ModelMetadata, \
                           ModelInfer, ModelStreamInfer and RepositoryIndex";

/// The statuses tonic answers by itself, before any rpc of ours runs, made
/// the protocol's with a message: an over-size message ([`too_large_status`])
/// and an rpc this server does not declare (UNIMPLEMENTED, which tonic sends
/// with no message at all).
#[derive(Clone)]
struct ProtocolStatus<S>(S);

impl<S, B, RB> tower::Service<http::Request<B>> for ProtocolStatus<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<RB>>,
    S::Future: Send + 'static,
{
    type Response = http::Response<RB>;
    type Error = S::Error;
    type Future =
        Pin<Box<dyn std::future::Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let path = req.uri().path().to_string();
        let answer = self.0.call(req);
        Box::pin(async move { Ok(protocol_status(answer.await?, &path)) })
    }
}

/// [`ProtocolStatus`] on one response. Only a trailers-only response (the
/// status in the headers: how tonic answers before an rpc runs) is looked
/// at; a success carries its status in the trailers.
fn protocol_status<B>(mut resp: http::Response<B>, path: &str) -> http::Response<B> {
    let code = match resp.headers().get("grpc-status").map(|v| v.as_bytes()) {
        Some(b"11") => tonic::Code::OutOfRange,
        Some(b"12") => tonic::Code::Unimplemented,
        _ => return resp,
    };
    let Some(s) = Status::from_header_map(resp.headers()) else {
        return resp;
    };
    let better = match code {
        tonic::Code::OutOfRange => too_large_status(&s),
        _ if s.message().is_empty() => Some(status(OipError::code(
            ErrorCode::Unsupported,
            format!("{path} is not served here; this server serves {SERVED_RPCS}"),
        ))),
        _ => None,
    };
    if let Some(better) = better {
        // `add_header` inserts, replacing grpc-status and grpc-message.
        if let Err(e) = better.add_header(resp.headers_mut()) {
            log::warn!("gRPC: cannot rewrite the status of {path}: {e}");
        }
    }
    resp
}

/// The service: protobuf in, [`Frontend`] calls, protobuf out.
struct InferenceService {
    frontend: Frontend,
}

/// `""` (proto3's unset string) as `None`.
fn version(v: &str) -> Option<&str> {
    (!v.is_empty()).then_some(v)
}

#[tonic::async_trait]
impl GrpcInferenceService for InferenceService {
    async fn server_live(
        &self,
        _: Request<pb::ServerLiveRequest>,
    ) -> Result<Response<pb::ServerLiveResponse>, Status> {
        Ok(Response::new(pb::ServerLiveResponse {
            live: self.frontend.live(),
        }))
    }

    async fn server_ready(
        &self,
        _: Request<pb::ServerReadyRequest>,
    ) -> Result<Response<pb::ServerReadyResponse>, Status> {
        Ok(Response::new(pb::ServerReadyResponse {
            ready: self.frontend.ready(),
        }))
    }

    async fn model_ready(
        &self,
        req: Request<pb::ModelReadyRequest>,
    ) -> Result<Response<pb::ModelReadyResponse>, Status> {
        let req = req.into_inner();
        // As Triton: a model the server does not know is simply not ready.
        let ready = match self.frontend.model_ready(&req.name, version(&req.version)) {
            Ok(ready) => ready,
            Err(e) if e.kind == super::ErrorKind::NotFound => false,
            Err(e) => return Err(status(e)),
        };
        Ok(Response::new(pb::ModelReadyResponse { ready }))
    }

    async fn server_metadata(
        &self,
        _: Request<pb::ServerMetadataRequest>,
    ) -> Result<Response<pb::ServerMetadataResponse>, Status> {
        let m = self.frontend.server_metadata();
        Ok(Response::new(pb::ServerMetadataResponse {
            name: m.name,
            version: m.version,
            extensions: m.extensions,
        }))
    }

    async fn model_metadata(
        &self,
        req: Request<pb::ModelMetadataRequest>,
    ) -> Result<Response<pb::ModelMetadataResponse>, Status> {
        let req = req.into_inner();
        let m = self
            .frontend
            .model_metadata(&req.name, version(&req.version))
            .map_err(status)?;
        let meta = |t: TensorMeta| pb::model_metadata_response::TensorMetadata {
            name: t.name,
            datatype: t.datatype.as_str().to_string(),
            shape: t.shape,
        };
        Ok(Response::new(pb::ModelMetadataResponse {
            name: m.name,
            versions: m.versions,
            platform: m.platform,
            inputs: m.inputs.into_iter().map(meta).collect(),
            outputs: m.outputs.into_iter().map(meta).collect(),
        }))
    }

    async fn model_infer(
        &self,
        req: Request<pb::ModelInferRequest>,
    ) -> Result<Response<pb::ModelInferResponse>, Status> {
        infer(&self.frontend, req.into_inner())
            .await
            .map(Response::new)
            .map_err(status)
    }

    type ModelStreamInferStream = ReceiverStream<Result<pb::ModelStreamInferResponse, Status>>;

    async fn model_stream_infer(
        &self,
        req: Request<Streaming<pb::ModelInferRequest>>,
    ) -> Result<Response<Self::ModelStreamInferStream>, Status> {
        let inbound = req.into_inner();
        let (out_tx, out_rx) = mpsc::channel(STREAM_IN_FLIGHT_MAX);
        tokio::spawn(stream_infer(self.frontend.clone(), inbound, out_tx));
        Ok(Response::new(ReceiverStream::new(out_rx)))
    }

    async fn repository_index(
        &self,
        req: Request<pb::RepositoryIndexRequest>,
    ) -> Result<Response<pb::RepositoryIndexResponse>, Status> {
        let req = req.into_inner();
        if !req.repository_name.is_empty() {
            return Err(status(OipError::code(
                ErrorCode::UnknownModel,
                format!(
                    "unknown repository {:?}: this server has one model repository \
                     (the catalog); leave repository_name empty",
                    req.repository_name
                ),
            )));
        }
        let models = self
            .frontend
            .repository_index(req.ready)
            .into_iter()
            .map(|m| pb::repository_index_response::ModelIndex {
                name: m.name,
                version: m.version.unwrap_or_default(),
                state: m.state,
                reason: m.reason,
            })
            .collect();
        Ok(Response::new(pb::RepositoryIndexResponse { models }))
    }
}

/// One `ModelInfer`: decode, run, encode.
async fn infer(
    frontend: &Frontend,
    req: pb::ModelInferRequest,
) -> Result<pb::ModelInferResponse, OipError> {
    let req = infer_request(req)?;
    Ok(infer_response(frontend.infer(req).await?))
}

/// Serves one `ModelStreamInfer` stream: reads requests, runs up to
/// [`STREAM_IN_FLIGHT_MAX`] at once, and answers them in the order they
/// came (as Triton does for models that give one response per request). A
/// request that fails is answered with its `error_message`; the stream goes
/// on. Ends when the client ends its side, or when it goes away.
async fn stream_infer(
    frontend: Frontend,
    mut inbound: Streaming<pb::ModelInferRequest>,
    out: mpsc::Sender<Result<pb::ModelStreamInferResponse, Status>>,
) {
    // Running requests, oldest first; the channel's capacity bounds them.
    let (running_tx, mut running_rx) = mpsc::channel::<AbortOnDrop>(STREAM_IN_FLIGHT_MAX);
    let writer_out = out.clone();
    let writer = tokio::spawn(async move {
        while let Some(mut task) = running_rx.recv().await {
            let answer = match (&mut task.0).await {
                Ok(answer) => answer,
                Err(e) => pb::ModelStreamInferResponse {
                    error_message: format!("internal: the request's task failed: {e}"),
                    infer_response: None,
                },
            };
            if writer_out.send(Ok(answer)).await.is_err() {
                return; // the client went away
            }
        }
    });
    loop {
        let req = match inbound.message().await {
            Ok(Some(req)) => req,
            Ok(None) => break,
            Err(e) => {
                // A broken or over-size message ends the stream with its status.
                let _ = out.send(Err(too_large_status(&e).unwrap_or(e))).await;
                break;
            }
        };
        let frontend = frontend.clone();
        let task = tokio::spawn(async move {
            let id = req.id.clone();
            match infer(&frontend, req).await {
                Ok(resp) => pb::ModelStreamInferResponse {
                    error_message: String::new(),
                    infer_response: Some(resp),
                },
                Err(e) => pb::ModelStreamInferResponse {
                    error_message: if id.is_empty() {
                        e.message
                    } else {
                        format!("request {id:?}: {}", e.message)
                    },
                    infer_response: None,
                },
            }
        });
        if running_tx.send(AbortOnDrop(task)).await.is_err() {
            break; // the writer stopped: the client went away
        }
    }
    drop(running_tx);
    let _ = writer.await;
}

/// A spawned request that is cancelled if nobody will read its answer.
struct AbortOnDrop(tokio::task::JoinHandle<pb::ModelStreamInferResponse>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The protocol-neutral request of a `ModelInferRequest`: inputs from raw
/// or typed contents, checked against their datatype and shape, and the
/// `slo_ms` and `priority` parameters.
pub fn infer_request(mut req: pb::ModelInferRequest) -> Result<InferRequest, OipError> {
    let raw = std::mem::take(&mut req.raw_input_contents);
    if !raw.is_empty() && raw.len() != req.inputs.len() {
        return Err(OipError::bad_request(format!(
            "the request has {} raw_input_contents for {} inputs: either every input is raw \
             (one entry each, in inputs order) or none is",
            raw.len(),
            req.inputs.len()
        )));
    }
    let mut raw = raw.into_iter();
    let inputs = std::mem::take(&mut req.inputs)
        .into_iter()
        .map(|input| input_tensor(input, raw.next()))
        .collect::<Result<Vec<_>, _>>()?;
    let (slo_ms, priority) = request_parameters(&req.parameters)?;
    let outputs = if req.outputs.is_empty() {
        None
    } else {
        Some(
            std::mem::take(&mut req.outputs)
                .into_iter()
                .map(requested_output)
                .collect::<Result<_, _>>()?,
        )
    };
    Ok(InferRequest {
        model: req.model_name,
        version: version(&req.model_version).map(str::to_string),
        id: req.id,
        slo_ms,
        priority,
        inputs,
        outputs,
    })
}

/// The name of a requested output; parameters that change what is returned
/// (Triton's classification extension) are refused rather than ignored.
fn requested_output(o: InferRequestedOutputTensor) -> Result<String, OipError> {
    if let Some(p) = o.parameters.get("classification") {
        if !matches!(p.parameter_choice, Some(ParameterChoice::Int64Param(0))) {
            return Err(OipError::code(
                ErrorCode::Unsupported,
                format!(
                    "output {:?}: the classification extension is not supported; ask for the \
                     tensor itself",
                    o.name
                ),
            ));
        }
    }
    Ok(o.name)
}

/// One input: its bytes from `raw` (its `raw_input_contents` entry) or from
/// its typed `contents`, checked against its datatype and shape.
fn input_tensor(input: InferInputTensor, raw: Option<Vec<u8>>) -> Result<Tensor, OipError> {
    let datatype = Datatype::parse(&input.datatype).map_err(|_| {
        OipError::bad_request(format!(
            "input {:?}: unknown datatype {:?}; the protocol's are {}",
            input.name,
            input.datatype,
            Datatype::ALL.map(Datatype::as_str).join(", ")
        ))
    })?;
    let count = element_count(&input.name, &input.shape)?;
    let has_contents = input.contents.as_ref().is_some_and(|c| !contents_empty(c));
    let data = match (raw, input.contents) {
        (Some(_), Some(_)) if has_contents => {
            return Err(OipError::bad_request(format!(
                "input {:?} has both typed contents and a raw_input_contents entry; send one",
                input.name
            )))
        }
        (Some(raw), _) => raw,
        (None, Some(c)) => contents_to_raw(&input.name, datatype, c, count)?,
        (None, None) if count == 0 => Vec::new(),
        (None, None) => {
            return Err(OipError::bad_request(format!(
                "input {:?} ({datatype} {:?}) has no data: neither contents nor \
                 raw_input_contents",
                input.name, input.shape
            )))
        }
    };
    let tensor = Tensor {
        name: input.name,
        datatype,
        shape: input.shape,
        data,
    };
    tensor.check_size()?;
    Ok(tensor)
}

fn contents_empty(c: &pb::InferTensorContents) -> bool {
    c.bool_contents.is_empty()
        && c.int_contents.is_empty()
        && c.int64_contents.is_empty()
        && c.uint_contents.is_empty()
        && c.uint64_contents.is_empty()
        && c.fp32_contents.is_empty()
        && c.fp64_contents.is_empty()
        && c.bytes_contents.is_empty()
}

/// The raw little-endian bytes of typed `contents` for `datatype`: the one
/// field that carries that datatype, with exactly `count` elements, each in
/// the datatype's range; every other field empty.
fn contents_to_raw(
    name: &str,
    datatype: Datatype,
    c: pb::InferTensorContents,
    count: usize,
) -> Result<Vec<u8>, OipError> {
    use Datatype as D;
    let field = match datatype {
        D::Bool => "bool_contents",
        D::I8 | D::I16 | D::I32 => "int_contents",
        D::I64 => "int64_contents",
        D::U8 | D::U16 | D::U32 => "uint_contents",
        D::U64 => "uint64_contents",
        D::F32 => "fp32_contents",
        D::F64 => "fp64_contents",
        D::Bytes => "bytes_contents",
        D::F16 | D::Bf16 => {
            return Err(OipError::bad_request(format!(
                "input {name:?} ({datatype}): typed contents have no field for {datatype}; \
                 send it in raw_input_contents"
            )))
        }
    };
    let lens = [
        ("bool_contents", c.bool_contents.len()),
        ("int_contents", c.int_contents.len()),
        ("int64_contents", c.int64_contents.len()),
        ("uint_contents", c.uint_contents.len()),
        ("uint64_contents", c.uint64_contents.len()),
        ("fp32_contents", c.fp32_contents.len()),
        ("fp64_contents", c.fp64_contents.len()),
        ("bytes_contents", c.bytes_contents.len()),
    ];
    if let Some((other, _)) = lens.iter().find(|(f, n)| *f != field && *n > 0) {
        return Err(OipError::bad_request(format!(
            "input {name:?} ({datatype}): its contents belong in {field}, found {other}"
        )));
    }
    let got = lens
        .iter()
        .find(|(f, _)| *f == field)
        .map_or(0, |(_, n)| *n);
    if got != count {
        return Err(OipError::bad_request(format!(
            "input {name:?} ({datatype}): {field} holds {got} elements, its shape needs {count}"
        )));
    }
    // Narrow an int_contents/uint_contents value, naming it if it does not fit.
    fn narrow<T: TryFrom<W>, W: Copy + std::fmt::Display>(
        name: &str,
        datatype: Datatype,
        field: &str,
        i: usize,
        v: W,
    ) -> Result<T, OipError> {
        T::try_from(v).map_err(|_| {
            OipError::bad_request(format!(
                "input {name:?}: {field}[{i}] = {v} does not fit {datatype}"
            ))
        })
    }
    let mut out = Vec::with_capacity(count * datatype.element_bytes().unwrap_or(8));
    match datatype {
        D::Bool => out.extend(c.bool_contents.iter().map(|&b| u8::from(b))),
        D::I8 => {
            for (i, &v) in c.int_contents.iter().enumerate() {
                out.extend(narrow::<i8, _>(name, datatype, field, i, v)?.to_le_bytes());
            }
        }
        D::I16 => {
            for (i, &v) in c.int_contents.iter().enumerate() {
                out.extend(narrow::<i16, _>(name, datatype, field, i, v)?.to_le_bytes());
            }
        }
        D::I32 => out.extend(c.int_contents.iter().flat_map(|v| v.to_le_bytes())),
        D::I64 => out.extend(c.int64_contents.iter().flat_map(|v| v.to_le_bytes())),
        D::U8 => {
            for (i, &v) in c.uint_contents.iter().enumerate() {
                out.extend(narrow::<u8, _>(name, datatype, field, i, v)?.to_le_bytes());
            }
        }
        D::U16 => {
            for (i, &v) in c.uint_contents.iter().enumerate() {
                out.extend(narrow::<u16, _>(name, datatype, field, i, v)?.to_le_bytes());
            }
        }
        D::U32 => out.extend(c.uint_contents.iter().flat_map(|v| v.to_le_bytes())),
        D::U64 => out.extend(c.uint64_contents.iter().flat_map(|v| v.to_le_bytes())),
        D::F32 => out.extend(c.fp32_contents.iter().flat_map(|v| v.to_le_bytes())),
        D::F64 => out.extend(c.fp64_contents.iter().flat_map(|v| v.to_le_bytes())),
        D::Bytes => {
            for (i, b) in c.bytes_contents.iter().enumerate() {
                let len = u32::try_from(b.len()).map_err(|_| {
                    OipError::bad_request(format!(
                        "input {name:?}: bytes_contents[{i}] is {} bytes, over the protocol's \
                         4 GiB element bound",
                        b.len()
                    ))
                })?;
                out.extend(len.to_le_bytes());
                out.extend_from_slice(b);
            }
        }
        D::F16 | D::Bf16 => unreachable!("refused above"),
    }
    Ok(out)
}

/// The request parameters the dispatcher reads: `slo_ms` (a positive number
/// of milliseconds: int64, uint64 or double, rounded up) and `priority`
/// (tritonclient sends uint64; 0 = the default level). Others are ignored,
/// as the protocol allows.
fn request_parameters(
    params: &HashMap<String, pb::InferParameter>,
) -> Result<(Option<u64>, u32), OipError> {
    let slo_ms = match params.get("slo_ms").map(|p| &p.parameter_choice) {
        None => None,
        Some(Some(ParameterChoice::Int64Param(v))) if *v > 0 => Some(*v as u64),
        Some(Some(ParameterChoice::Uint64Param(v))) if *v > 0 => Some(*v),
        // `as` saturates; the bound keeps the cast exact enough to mean it.
        Some(Some(ParameterChoice::DoubleParam(v))) if *v > 0.0 && *v < 1e15 => {
            Some(v.ceil() as u64)
        }
        Some(other) => {
            return Err(OipError::bad_request(format!(
                "parameter slo_ms must be a positive number of milliseconds (int64, uint64 or \
                 double), got {}",
                describe(other)
            )))
        }
    };
    let priority = match params.get("priority").map(|p| &p.parameter_choice) {
        None => 0,
        Some(Some(ParameterChoice::Uint64Param(v))) if *v <= u64::from(u32::MAX) => *v as u32,
        Some(Some(ParameterChoice::Int64Param(v))) if (0..=i64::from(u32::MAX)).contains(v) => {
            *v as u32
        }
        Some(other) => {
            return Err(OipError::bad_request(format!(
                "parameter priority must be a level from 0 (the default) to {} (1 is the \
                 highest), as uint64 or int64, got {}",
                u32::MAX,
                describe(other)
            )))
        }
    };
    Ok((slo_ms, priority))
}

/// A parameter value as an error message shows it.
fn describe(p: &Option<ParameterChoice>) -> String {
    match p {
        None => "no value".into(),
        Some(ParameterChoice::BoolParam(v)) => format!("bool {v}"),
        Some(ParameterChoice::Int64Param(v)) => format!("int64 {v}"),
        Some(ParameterChoice::StringParam(v)) => format!("string {v:?}"),
        Some(ParameterChoice::DoubleParam(v)) => format!("double {v}"),
        Some(ParameterChoice::Uint64Param(v)) => format!("uint64 {v}"),
    }
}

/// The `ModelInferResponse` of a response: every output's data as its
/// `raw_output_contents` entry, in order.
pub fn infer_response(resp: InferResponse) -> pb::ModelInferResponse {
    let mut outputs = Vec::with_capacity(resp.outputs.len());
    let mut raw = Vec::with_capacity(resp.outputs.len());
    for t in resp.outputs {
        outputs.push(InferOutputTensor {
            name: t.name,
            datatype: t.datatype.as_str().to_string(),
            shape: t.shape,
            parameters: HashMap::new(),
            contents: None,
        });
        raw.push(t.data);
    }
    pb::ModelInferResponse {
        model_name: resp.model,
        model_version: resp.version.unwrap_or_default(),
        id: resp.id,
        parameters: HashMap::new(),
        outputs,
        raw_output_contents: raw,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::oip::ErrorKind;
    use prost::Message;

    fn input(name: &str, datatype: &str, shape: &[i64]) -> InferInputTensor {
        InferInputTensor {
            name: name.into(),
            datatype: datatype.into(),
            shape: shape.to_vec(),
            parameters: HashMap::new(),
            contents: None,
        }
    }

    fn with_contents(
        datatype: &str,
        shape: &[i64],
        c: pb::InferTensorContents,
    ) -> Result<Tensor, OipError> {
        let mut i = input("x", datatype, shape);
        i.contents = Some(c);
        input_tensor(i, None)
    }

    fn request(inputs: Vec<InferInputTensor>, raw: Vec<Vec<u8>>) -> pb::ModelInferRequest {
        pb::ModelInferRequest {
            model_name: "m".into(),
            model_version: String::new(),
            id: "r1".into(),
            parameters: HashMap::new(),
            inputs,
            outputs: Vec::new(),
            raw_input_contents: raw,
        }
    }

    fn param(p: ParameterChoice) -> pb::InferParameter {
        pb::InferParameter {
            parameter_choice: Some(p),
        }
    }

    fn bad(r: Result<impl std::fmt::Debug, OipError>, needle: &str) {
        let e = r.expect_err("must fail");
        assert_eq!(e.kind, ErrorKind::InvalidArgument, "{e:?}");
        assert!(e.message.starts_with("bad_request: "), "{}", e.message);
        assert!(
            e.message.contains(needle),
            "{:?} lacks {needle:?}",
            e.message
        );
    }

    #[test]
    fn typed_contents_of_every_datatype_become_little_endian_bytes() {
        let c = pb::InferTensorContents::default;
        let cases: Vec<(&str, pb::InferTensorContents, Vec<u8>)> = vec![
            (
                "BOOL",
                pb::InferTensorContents {
                    bool_contents: vec![true, false],
                    ..c()
                },
                vec![1, 0],
            ),
            (
                "INT8",
                pb::InferTensorContents {
                    int_contents: vec![-1, 127],
                    ..c()
                },
                vec![0xff, 0x7f],
            ),
            (
                "INT16",
                pb::InferTensorContents {
                    int_contents: vec![-2, 0x1234],
                    ..c()
                },
                [(-2i16).to_le_bytes(), 0x1234i16.to_le_bytes()].concat(),
            ),
            (
                "INT32",
                pb::InferTensorContents {
                    int_contents: vec![i32::MIN, 7],
                    ..c()
                },
                [i32::MIN.to_le_bytes(), 7i32.to_le_bytes()].concat(),
            ),
            (
                "INT64",
                pb::InferTensorContents {
                    int64_contents: vec![i64::MIN, 1 << 40],
                    ..c()
                },
                [i64::MIN.to_le_bytes(), (1i64 << 40).to_le_bytes()].concat(),
            ),
            (
                "UINT8",
                pb::InferTensorContents {
                    uint_contents: vec![0, 255],
                    ..c()
                },
                vec![0, 255],
            ),
            (
                "UINT16",
                pb::InferTensorContents {
                    uint_contents: vec![65535, 1],
                    ..c()
                },
                [65535u16.to_le_bytes(), 1u16.to_le_bytes()].concat(),
            ),
            (
                "UINT32",
                pb::InferTensorContents {
                    uint_contents: vec![u32::MAX, 3],
                    ..c()
                },
                [u32::MAX.to_le_bytes(), 3u32.to_le_bytes()].concat(),
            ),
            (
                "UINT64",
                pb::InferTensorContents {
                    uint64_contents: vec![u64::MAX, 5],
                    ..c()
                },
                [u64::MAX.to_le_bytes(), 5u64.to_le_bytes()].concat(),
            ),
            (
                "FP32",
                pb::InferTensorContents {
                    fp32_contents: vec![1.5, -0.25],
                    ..c()
                },
                [1.5f32.to_le_bytes(), (-0.25f32).to_le_bytes()].concat(),
            ),
            (
                "FP64",
                pb::InferTensorContents {
                    fp64_contents: vec![std::f64::consts::PI, -1e300],
                    ..c()
                },
                [
                    std::f64::consts::PI.to_le_bytes(),
                    (-1e300f64).to_le_bytes(),
                ]
                .concat(),
            ),
            (
                "BYTES",
                pb::InferTensorContents {
                    bytes_contents: vec![b"ab".to_vec(), Vec::new()],
                    ..c()
                },
                vec![2, 0, 0, 0, b'a', b'b', 0, 0, 0, 0],
            ),
        ];
        for (datatype, contents, want) in cases {
            let t = with_contents(datatype, &[1, 2], contents)
                .unwrap_or_else(|e| panic!("{datatype}: {e:?}"));
            assert_eq!(t.datatype.as_str(), datatype);
            assert_eq!(t.shape, vec![1, 2]);
            assert_eq!(t.data, want, "{datatype}");
        }
    }

    #[test]
    fn raw_contents_pass_through_in_input_order() {
        let a = [1.0f32, 2.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect::<Vec<_>>();
        let b = 9i64.to_le_bytes().to_vec();
        let req = request(
            vec![input("a", "FP32", &[1, 2]), input("b", "INT64", &[1])],
            vec![a.clone(), b.clone()],
        );
        let r = infer_request(req).unwrap();
        assert_eq!(r.model, "m");
        assert_eq!(r.version, None);
        assert_eq!(r.id, "r1");
        assert_eq!((r.slo_ms, r.priority, r.outputs), (None, 0, None));
        assert_eq!(r.inputs.len(), 2);
        assert_eq!((r.inputs[0].name.as_str(), &r.inputs[0].data), ("a", &a));
        assert_eq!((r.inputs[1].name.as_str(), &r.inputs[1].data), ("b", &b));
        // BF16 and FP16 travel raw only.
        let req = request(
            vec![input("h", "BF16", &[2])],
            vec![vec![0x80, 0x3f, 0, 0x40]],
        );
        assert_eq!(
            infer_request(req).unwrap().inputs[0].data,
            [0x80, 0x3f, 0, 0x40]
        );
    }

    #[test]
    fn shape_and_size_mismatches_are_bad_requests_naming_the_input() {
        // Raw: 8 bytes for a [1, 3] FP32 (12 bytes).
        let req = request(vec![input("x", "FP32", &[1, 3])], vec![vec![0; 8]]);
        bad(infer_request(req), "tensor x");
        // Raw BYTES whose length prefix runs past the end.
        let req = request(vec![input("s", "BYTES", &[1])], vec![vec![9, 0, 0, 0, 1]]);
        bad(infer_request(req), "claims 9 bytes");
        // Fewer raw entries than inputs.
        let req = request(
            vec![input("a", "FP32", &[1]), input("b", "FP32", &[1])],
            vec![vec![0; 4]],
        );
        bad(infer_request(req), "1 raw_input_contents for 2 inputs");
        // Typed: 2 values for 3 elements; the wrong field; out of range.
        let fp = |v: Vec<f32>| pb::InferTensorContents {
            fp32_contents: v,
            ..Default::default()
        };
        bad(
            with_contents("FP32", &[3], fp(vec![1.0, 2.0])),
            "holds 2 elements, its shape needs 3",
        );
        bad(
            with_contents("INT32", &[1], fp(vec![1.0])),
            "belong in int_contents, found fp32_contents",
        );
        let ints = pb::InferTensorContents {
            int_contents: vec![1, 300],
            ..Default::default()
        };
        bad(
            with_contents("INT8", &[2], ints),
            "int_contents[1] = 300 does not fit INT8",
        );
        bad(
            with_contents("FP16", &[1], fp(vec![1.0])),
            "send it in raw_input_contents",
        );
        // A negative dimension, an unknown datatype, no data at all.
        bad(
            with_contents("FP32", &[-1], fp(vec![])),
            "negative dimension",
        );
        bad(
            with_contents("FP99", &[1], fp(vec![1.0])),
            "input \"x\": unknown datatype \"FP99\"",
        );
        bad(input_tensor(input("x", "FP32", &[2]), None), "has no data");
        // Both forms for one input.
        let mut both = input("x", "FP32", &[1]);
        both.contents = Some(fp(vec![1.0]));
        bad(
            input_tensor(both, Some(vec![0; 4])),
            "both typed contents and a raw",
        );
    }

    #[test]
    fn slo_and_priority_parameters() {
        let with = |params: Vec<(&str, ParameterChoice)>| {
            let mut req = request(vec![input("x", "FP32", &[1])], vec![vec![0; 4]]);
            req.parameters = params
                .into_iter()
                .map(|(k, v)| (k.to_string(), param(v)))
                .collect();
            infer_request(req)
        };
        let get = |params| {
            let r = with(params).unwrap();
            (r.slo_ms, r.priority)
        };
        assert_eq!(
            get(vec![("slo_ms", ParameterChoice::Int64Param(250))]),
            (Some(250), 0)
        );
        assert_eq!(
            get(vec![("slo_ms", ParameterChoice::Uint64Param(40))]),
            (Some(40), 0)
        );
        assert_eq!(
            get(vec![("slo_ms", ParameterChoice::DoubleParam(12.2))]),
            (Some(13), 0)
        );
        assert_eq!(
            get(vec![("priority", ParameterChoice::Uint64Param(1))]),
            (None, 1)
        );
        assert_eq!(
            get(vec![("priority", ParameterChoice::Int64Param(3))]),
            (None, 3)
        );
        // Parameters the dispatcher does not read are ignored, as the protocol allows.
        assert_eq!(
            get(vec![("sequence_id", ParameterChoice::Int64Param(7))]),
            (None, 0)
        );
        bad(
            with(vec![("slo_ms", ParameterChoice::Int64Param(0))]),
            "slo_ms must be a positive",
        );
        bad(
            with(vec![("slo_ms", ParameterChoice::DoubleParam(f64::NAN))]),
            "double NaN",
        );
        bad(
            with(vec![(
                "slo_ms",
                ParameterChoice::StringParam("fast".into()),
            )]),
            "got string \"fast\"",
        );
        bad(
            with(vec![("priority", ParameterChoice::Uint64Param(1 << 40))]),
            "got uint64 1099511627776",
        );
        bad(
            with(vec![("priority", ParameterChoice::Int64Param(-1))]),
            "got int64 -1",
        );
    }

    #[test]
    fn requested_outputs_and_version() {
        let mut req = request(vec![input("x", "FP32", &[1])], vec![vec![0; 4]]);
        req.model_version = "3".into();
        let out = |name: &str| InferRequestedOutputTensor {
            name: name.into(),
            parameters: HashMap::new(),
        };
        req.outputs = vec![out("b"), out("a")];
        let r = infer_request(req.clone()).unwrap();
        assert_eq!(r.version.as_deref(), Some("3"));
        assert_eq!(r.outputs, Some(vec!["b".to_string(), "a".to_string()]));
        let mut classify = out("a");
        classify.parameters.insert(
            "classification".into(),
            param(ParameterChoice::Int64Param(3)),
        );
        req.outputs = vec![classify];
        let e = infer_request(req).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Unimplemented);
        assert!(e.message.starts_with("unsupported: "), "{}", e.message);
    }

    #[test]
    fn responses_carry_every_output_raw_in_order() {
        let t = |name: &str, datatype, data: Vec<u8>| Tensor {
            name: name.into(),
            datatype,
            shape: vec![1, data.len() as i64 / 4],
            data,
        };
        let resp = infer_response(InferResponse {
            model: "m".into(),
            version: Some("2".into()),
            id: "r9".into(),
            outputs: vec![
                t("z", Datatype::F32, vec![1; 8]),
                t("a", Datatype::I32, vec![2; 4]),
            ],
        });
        assert_eq!(
            (resp.model_name.as_str(), resp.model_version.as_str()),
            ("m", "2")
        );
        assert_eq!(resp.id, "r9");
        let names: Vec<_> = resp
            .outputs
            .iter()
            .map(|o| (o.name.as_str(), o.datatype.as_str()))
            .collect();
        assert_eq!(names, [("z", "FP32"), ("a", "INT32")]);
        assert!(resp.outputs.iter().all(|o| o.contents.is_none()));
        assert_eq!(resp.outputs[0].shape, vec![1, 2]);
        assert_eq!(resp.raw_output_contents, vec![vec![1; 8], vec![2; 4]]);
    }

    #[test]
    fn tonics_over_size_status_becomes_resource_exhausted() {
        let tonic_says = Status::out_of_range(
            "Error, decoded message length too large: found 67108869 bytes, the limit is: \
             67108864 bytes",
        );
        let s = too_large_status(&tonic_says).expect("rewritten");
        assert_eq!(s.code(), tonic::Code::ResourceExhausted);
        assert!(s.message().starts_with("too_large: "), "{}", s.message());
        assert!(s.message().contains("67108869"), "{}", s.message());
        assert!(s.message().contains(&Frontend::BODY_BYTES_MAX.to_string()));
        // As a unary response: the status is in the headers.
        let path = "/inference.GRPCInferenceService/ModelInfer";
        let resp = protocol_status(tonic_says.into_http::<()>(), path);
        let s = Status::from_header_map(resp.headers()).unwrap();
        assert_eq!(s.code(), tonic::Code::ResourceExhausted);
        assert!(s
            .message()
            .starts_with("too_large: the message is 67108869 bytes"));
        // Other statuses are left alone.
        assert!(too_large_status(&Status::out_of_range("index 3 of 2")).is_none());
        for kept in [Status::not_found("x"), Status::unimplemented("said")] {
            let code = kept.code();
            let resp = protocol_status(kept.into_http::<()>(), path);
            assert_eq!(
                Status::from_header_map(resp.headers()).unwrap().code(),
                code
            );
        }
    }

    #[test]
    fn an_undeclared_rpc_is_unimplemented_with_a_message() {
        let mut resp = http::Response::new(());
        resp.headers_mut().insert("grpc-status", 12.into());
        let path = "/inference.GRPCInferenceService/ModelConfig";
        let s = Status::from_header_map(protocol_status(resp, path).headers()).unwrap();
        assert_eq!(s.code(), tonic::Code::Unimplemented);
        assert!(s.message().starts_with("unsupported: "), "{}", s.message());
        assert!(s.message().contains(path), "{}", s.message());
        assert!(s.message().contains("ModelInfer"), "{}", s.message());
    }

    #[tokio::test]
    async fn connections_over_the_limit_wait_for_a_slot() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (conns_tx, mut conns) = mpsc::channel(8);
        let (stop_tx, stop) = watch::channel(false);
        let accept = tokio::spawn(accept_loop(listener, 2, conns_tx, stop));
        // All three connect (the kernel's backlog), two are accepted.
        let mut clients = Vec::new();
        for _ in 0..3 {
            clients.push(TcpStream::connect(addr).await.unwrap());
        }
        let first = conns.recv().await.unwrap().unwrap();
        let _second = conns.recv().await.unwrap().unwrap();
        let waited = tokio::time::timeout(Duration::from_millis(300), conns.recv()).await;
        assert!(
            waited.is_err(),
            "a third connection was accepted over the limit of 2"
        );
        // Closing one frees its slot for the one waiting.
        drop(first);
        let third = tokio::time::timeout(Duration::from_secs(30), conns.recv()).await;
        assert!(
            matches!(third, Ok(Some(Ok(_)))),
            "the waiting connection was not accepted"
        );
        stop_tx.send(true).unwrap();
        accept.await.unwrap();
    }

    #[test]
    fn wire_field_numbers_match_the_protocol() {
        // tritonclient builds its stubs from Triton's proto: the field
        // numbers, not the names, must agree. Spot-check the encoding.
        let req = pb::ModelInferRequest {
            model_name: "m".into(),
            raw_input_contents: vec![vec![7]],
            ..Default::default()
        };
        // Field 1 (string "m"), field 7 (bytes [7]).
        assert_eq!(req.encode_to_vec(), [0x0a, 1, b'm', 0x3a, 1, 7]);
        let p = param(ParameterChoice::Uint64Param(1));
        assert_eq!(p.encode_to_vec(), [0x28, 1]); // uint64_param = 5
        let p = param(ParameterChoice::DoubleParam(0.0));
        assert_eq!(p.encode_to_vec()[0], 0x21); // double_param = 4, fixed64
        let resp = pb::ModelInferResponse {
            raw_output_contents: vec![vec![1]],
            ..Default::default()
        };
        assert_eq!(resp.encode_to_vec(), [0x32, 1, 1]); // raw_output_contents = 6
        let c = pb::InferTensorContents {
            bytes_contents: vec![vec![5]],
            ..Default::default()
        };
        assert_eq!(c.encode_to_vec(), [0x42, 1, 5]); // bytes_contents = 8
        let idx = pb::repository_index_response::ModelIndex {
            reason: "r".into(),
            ..Default::default()
        };
        assert_eq!(idx.encode_to_vec(), [0x22, 1, b'r']); // reason = 4
    }
}
