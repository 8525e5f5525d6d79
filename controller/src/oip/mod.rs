//! The Open Inference Protocol (KServe v2, as Triton speaks it) on the
//! dispatcher: the protocol-neutral front end both wire forms share.
//!
//! [`http`] (REST, JSON tensors and the binary tensor data extension) and
//! the gRPC service convert their wire form to and from the types here and
//! call one [`Frontend`]. It answers metadata, readiness and the repository
//! index from the catalog, checks the optional api key, validates a request
//! against the model's inputs, and sends it through the same dispatcher as
//! the native client port: the input becomes the runtime's `.npy` frame,
//! the reply's `.npy` frames become output tensors.
//!
//! Every error is an [`OipError`]: a kind that maps to an HTTP status and a
//! gRPC code, and a message that starts with the distmind error code's wire
//! name (`unknown_model: ...`) and names what was wrong.

pub mod http;

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use distmind_common::limits::CONTROL_FRAME_BYTES_MAX;
use distmind_common::proto::{ErrorCode, ErrorReply, RuntimeReply};
use distmind_models::{Dtype, Manifest, TensorSpec};
use serde::Deserialize;

use crate::dispatch::net::DispatchHandle;
use crate::state::ControllerState;

pub mod grpc;

/// Element type of a protocol tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Datatype {
    Bool,
    U8,
    U16,
    U32,
    U64,
    I8,
    I16,
    I32,
    I64,
    F16,
    Bf16,
    F32,
    F64,
    Bytes,
}

impl Datatype {
    /// Every datatype, in the protocol's table order.
    pub const ALL: [Datatype; 14] = [
        Datatype::Bool,
        Datatype::U8,
        Datatype::U16,
        Datatype::U32,
        Datatype::U64,
        Datatype::I8,
        Datatype::I16,
        Datatype::I32,
        Datatype::I64,
        Datatype::F16,
        Datatype::Bf16,
        Datatype::F32,
        Datatype::F64,
        Datatype::Bytes,
    ];

    /// The protocol's name (`FP32`, `INT64`, `BYTES`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            Datatype::Bool => "BOOL",
            Datatype::U8 => "UINT8",
            Datatype::U16 => "UINT16",
            Datatype::U32 => "UINT32",
            Datatype::U64 => "UINT64",
            Datatype::I8 => "INT8",
            Datatype::I16 => "INT16",
            Datatype::I32 => "INT32",
            Datatype::I64 => "INT64",
            Datatype::F16 => "FP16",
            Datatype::Bf16 => "BF16",
            Datatype::F32 => "FP32",
            Datatype::F64 => "FP64",
            Datatype::Bytes => "BYTES",
        }
    }

    /// The datatype named `s` (exact protocol spelling).
    pub fn parse(s: &str) -> Result<Datatype, OipError> {
        Datatype::ALL
            .into_iter()
            .find(|d| d.as_str() == s)
            .ok_or_else(|| {
                OipError::bad_request(format!(
                    "unknown datatype {s:?}; the protocol's are {}",
                    Datatype::ALL.map(Datatype::as_str).join(", ")
                ))
            })
    }

    /// Bytes per element; `None` for BYTES (4-byte length + bytes each).
    pub fn element_bytes(self) -> Option<usize> {
        match self {
            Datatype::Bool | Datatype::U8 | Datatype::I8 => Some(1),
            Datatype::U16 | Datatype::I16 | Datatype::F16 | Datatype::Bf16 => Some(2),
            Datatype::U32 | Datatype::I32 | Datatype::F32 => Some(4),
            Datatype::U64 | Datatype::I64 | Datatype::F64 => Some(8),
            Datatype::Bytes => None,
        }
    }
}

impl std::fmt::Display for Datatype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One tensor on the protocol side: raw little-endian, row-major, no
/// padding (BOOL 1 byte, BYTES as a 4-byte LE length + bytes per element,
/// BF16 the high 2 bytes of an f32), as the binary extension and gRPC's
/// raw contents carry it.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    pub name: String,
    pub datatype: Datatype,
    pub shape: Vec<i64>,
    pub data: Vec<u8>,
}

impl Tensor {
    /// Elements the shape holds; an error names a negative or overflowing shape.
    pub fn element_count(&self) -> Result<usize, OipError> {
        element_count(&self.name, &self.shape)
    }

    /// Checks that `data` is exactly what `datatype` and `shape` promise.
    pub fn check_size(&self) -> Result<(), OipError> {
        let n = self.element_count()?;
        match self.datatype.element_bytes() {
            Some(b) => {
                let want = n.checked_mul(b).ok_or_else(|| {
                    OipError::bad_request(format!(
                        "tensor {}: shape {:?} overflows",
                        self.name, self.shape
                    ))
                })?;
                if self.data.len() != want {
                    return Err(OipError::bad_request(format!(
                        "tensor {}: {} {:?} is {want} bytes, got {}",
                        self.name,
                        self.datatype,
                        self.shape,
                        self.data.len()
                    )));
                }
            }
            None => {
                let mut at = 0usize;
                for i in 0..n {
                    let len = self
                        .data
                        .get(at..at + 4)
                        .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")) as usize)
                        .ok_or_else(|| {
                            OipError::bad_request(format!(
                                "tensor {}: BYTES element {i} of {n}: its 4-byte length is cut short",
                                self.name
                            ))
                        })?;
                    at += 4;
                    if self.data.len() - at < len {
                        return Err(OipError::bad_request(format!(
                            "tensor {}: BYTES element {i} of {n} claims {len} bytes, {} remain",
                            self.name,
                            self.data.len() - at
                        )));
                    }
                    at += len;
                }
                if at != self.data.len() {
                    return Err(OipError::bad_request(format!(
                        "tensor {}: {} bytes follow its {n} BYTES elements",
                        self.name,
                        self.data.len() - at
                    )));
                }
            }
        }
        Ok(())
    }
}

/// Elements of `shape`, checked: no negative dimension, no overflow.
pub fn element_count(name: &str, shape: &[i64]) -> Result<usize, OipError> {
    shape.iter().try_fold(1usize, |acc, &d| {
        let d = usize::try_from(d).map_err(|_| {
            OipError::bad_request(format!(
                "tensor {name}: shape {shape:?} has a negative dimension"
            ))
        })?;
        acc.checked_mul(d).ok_or_else(|| {
            OipError::bad_request(format!("tensor {name}: shape {shape:?} overflows"))
        })
    })
}

/// An inference request, whichever wire it came on.
#[derive(Debug, Clone)]
pub struct InferRequest {
    pub model: String,
    /// The version asked for (`None`: the current one).
    pub version: Option<String>,
    /// Echoed in the response.
    pub id: String,
    /// Request parameter `slo_ms` (a number): the latency SLO. `None`: the
    /// controller's default for the model.
    pub slo_ms: Option<u64>,
    /// Request parameter `priority`: 0 is the default level, 1 the highest
    /// (Triton's convention).
    pub priority: u32,
    pub inputs: Vec<Tensor>,
    /// The outputs to return, by name; `None`: all, in the model's order.
    pub outputs: Option<Vec<String>>,
}

/// The answer to an [`InferRequest`].
#[derive(Debug, Clone)]
pub struct InferResponse {
    pub model: String,
    pub version: Option<String>,
    pub id: String,
    pub outputs: Vec<Tensor>,
}

/// A model's metadata: what its inputs and outputs look like.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelMetadata {
    pub name: String,
    pub versions: Vec<String>,
    pub platform: String,
    pub inputs: Vec<TensorMeta>,
    pub outputs: Vec<TensorMeta>,
}

/// A tensor's name, type and shape; -1 marks a variable dimension.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorMeta {
    pub name: String,
    pub datatype: Datatype,
    pub shape: Vec<i64>,
}

/// One model of the repository index.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelIndex {
    pub name: String,
    pub version: Option<String>,
    /// `READY` or `UNAVAILABLE`.
    pub state: String,
    /// Why it is not ready; empty when it is.
    pub reason: String,
}

/// The server's name, version and protocol extensions.
#[derive(Debug, Clone, PartialEq)]
pub struct ServerMetadata {
    pub name: String,
    pub version: String,
    pub extensions: Vec<String>,
}

/// Which kind of failure: each maps to one HTTP status and one gRPC code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    InvalidArgument,
    NotFound,
    Unauthenticated,
    /// A body or message over the bound.
    TooLarge,
    /// Refused at admission: no GPU could meet the request's SLO.
    ResourceExhausted,
    DeadlineExceeded,
    Unavailable,
    Unimplemented,
    Internal,
}

/// An error on either wire: its kind and a message naming the problem.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct OipError {
    pub kind: ErrorKind,
    pub message: String,
}

/// gRPC status codes (`tonic::Code` as numbers).
pub mod grpc_code {
    pub const INVALID_ARGUMENT: i32 = 3;
    pub const DEADLINE_EXCEEDED: i32 = 4;
    pub const NOT_FOUND: i32 = 5;
    pub const RESOURCE_EXHAUSTED: i32 = 8;
    pub const UNIMPLEMENTED: i32 = 12;
    pub const INTERNAL: i32 = 13;
    pub const UNAVAILABLE: i32 = 14;
    pub const UNAUTHENTICATED: i32 = 16;
}

impl OipError {
    /// An error of distmind's `code`: the message starts with its wire name.
    pub fn code(code: ErrorCode, message: impl std::fmt::Display) -> OipError {
        let kind = match code {
            ErrorCode::BadRequest => ErrorKind::InvalidArgument,
            ErrorCode::UnknownModel => ErrorKind::NotFound,
            ErrorCode::Rejected | ErrorCode::Full => ErrorKind::ResourceExhausted,
            ErrorCode::DeadlineExceeded => ErrorKind::DeadlineExceeded,
            ErrorCode::Busy | ErrorCode::ShuttingDown | ErrorCode::Unavailable => {
                ErrorKind::Unavailable
            }
            ErrorCode::Unsupported => ErrorKind::Unimplemented,
            ErrorCode::UnknownExtent | ErrorCode::ChecksumMismatch | ErrorCode::Internal => {
                ErrorKind::Internal
            }
        };
        OipError {
            kind,
            message: format!("{}: {message}", code.as_str()),
        }
    }

    /// A request that is malformed or does not fit the model (`bad_request`).
    pub fn bad_request(message: impl std::fmt::Display) -> OipError {
        OipError::code(ErrorCode::BadRequest, message)
    }

    /// A body or message over `max` bytes.
    pub fn too_large(what: &str, got: Option<usize>, max: usize) -> OipError {
        let got = got.map_or_else(|| "more".to_string(), |g| g.to_string());
        OipError {
            kind: ErrorKind::TooLarge,
            message: format!(
                "too_large: the {what} is {got} bytes, over the limit of {max} bytes ({} MiB)",
                max >> 20
            ),
        }
    }

    /// The request lacks the api key (or carries another).
    pub fn unauthenticated(message: impl std::fmt::Display) -> OipError {
        OipError {
            kind: ErrorKind::Unauthenticated,
            message: format!("unauthenticated: {message}"),
        }
    }

    /// The HTTP status for this error.
    pub fn http_status(&self) -> u16 {
        match self.kind {
            ErrorKind::InvalidArgument => 400,
            ErrorKind::Unauthenticated => 401,
            ErrorKind::NotFound => 404,
            ErrorKind::TooLarge => 413,
            ErrorKind::ResourceExhausted => 429,
            ErrorKind::Internal => 500,
            ErrorKind::Unimplemented => 501,
            ErrorKind::Unavailable => 503,
            ErrorKind::DeadlineExceeded => 504,
        }
    }

    /// The gRPC status code for this error (see [`grpc_code`]).
    pub fn grpc_code(&self) -> i32 {
        match self.kind {
            ErrorKind::InvalidArgument => grpc_code::INVALID_ARGUMENT,
            ErrorKind::NotFound => grpc_code::NOT_FOUND,
            ErrorKind::Unauthenticated => grpc_code::UNAUTHENTICATED,
            ErrorKind::TooLarge | ErrorKind::ResourceExhausted => grpc_code::RESOURCE_EXHAUSTED,
            ErrorKind::DeadlineExceeded => grpc_code::DEADLINE_EXCEEDED,
            ErrorKind::Unavailable => grpc_code::UNAVAILABLE,
            ErrorKind::Unimplemented => grpc_code::UNIMPLEMENTED,
            ErrorKind::Internal => grpc_code::INTERNAL,
        }
    }
}

impl From<ErrorReply> for OipError {
    fn from(e: ErrorReply) -> OipError {
        OipError::code(e.code, e.message)
    }
}

/// What the front end shares between connections.
struct Inner {
    dispatch: DispatchHandle,
    state: Arc<Mutex<ControllerState>>,
    /// `settings/api.key`: when set, every request needs `Bearer <key>`.
    api_key: Option<String>,
}

/// The protocol-neutral front end; cheap to clone (an `Arc` inside).
#[derive(Clone)]
pub struct Frontend {
    inner: Arc<Inner>,
}

/// The server name in server metadata.
pub const SERVER_NAME: &str = "distmind";
/// The platform models report in their metadata.
pub const PLATFORM: &str = "distmind";

impl Frontend {
    /// Largest request body (HTTP) or message (gRPC) accepted.
    pub const BODY_BYTES_MAX: usize = 64 << 20;
    /// Most connections each front end keeps open at once.
    pub const CONNECTIONS_MAX: usize = 1024;

    /// A front end on the dispatcher `dispatch`, reading the catalog and
    /// GPU servers from `state`; `api_key` from `settings/api.key`.
    pub fn new(
        dispatch: DispatchHandle,
        state: Arc<Mutex<ControllerState>>,
        api_key: Option<String>,
    ) -> Frontend {
        Frontend {
            inner: Arc::new(Inner {
                dispatch,
                state,
                api_key,
            }),
        }
    }

    fn state(&self) -> MutexGuard<'_, ControllerState> {
        self.inner.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The server answers: always true while it runs.
    pub fn live(&self) -> bool {
        true
    }

    /// Ready to serve inference: at least one GPU server is up.
    pub fn ready(&self) -> bool {
        self.ready_reason().is_none()
    }

    /// Why the server is not ready (for error messages), or `None` when it is.
    pub fn ready_reason(&self) -> Option<String> {
        let s = self.state();
        let alive = s
            .runtimes()
            .list(Instant::now())
            .iter()
            .filter(|r| r.alive)
            .count();
        (alive == 0).then(|| {
            format!(
                "no GPU server is up ({} registered, none heartbeating)",
                s.runtimes().len()
            )
        })
    }

    /// The server's name, version and the extensions it serves.
    pub fn server_metadata(&self) -> ServerMetadata {
        ServerMetadata {
            name: SERVER_NAME.into(),
            version: env!("CARGO_PKG_VERSION").into(),
            extensions: vec!["binary_tensor_data".into(), "model_repository".into()],
        }
    }

    /// The catalog entry's signature, checked against `version`.
    fn signature(&self, name: &str, version: Option<&str>) -> Result<Signature, OipError> {
        let entry = self.state().catalog().get(name)?;
        let current = entry.version.to_string();
        if let Some(v) = version {
            if v != current {
                return Err(OipError::code(
                    ErrorCode::UnknownModel,
                    format!("model {name} has version {current} only, not {v:?}"),
                ));
            }
        }
        Signature::of(name, current, &entry.manifest)
    }

    /// A model's inputs and outputs, from its catalog entry.
    pub fn model_metadata(
        &self,
        name: &str,
        version: Option<&str>,
    ) -> Result<ModelMetadata, OipError> {
        let sig = self.signature(name, version)?;
        Ok(ModelMetadata {
            name: name.to_string(),
            versions: vec![sig.version],
            platform: PLATFORM.into(),
            inputs: sig.inputs,
            outputs: sig.outputs,
        })
    }

    /// Whether `name` (at `version`) can serve now; an unknown model is an error.
    pub fn model_ready(&self, name: &str, version: Option<&str>) -> Result<bool, OipError> {
        self.signature(name, version)?;
        Ok(self.ready())
    }

    /// The catalog's models, sorted by name; `ready_only`: only the ready.
    pub fn repository_index(&self, ready_only: bool) -> Vec<ModelIndex> {
        let not_ready = self.ready_reason();
        let s = self.state();
        let mut out: Vec<ModelIndex> = s
            .catalog()
            .list()
            .into_iter()
            .map(|m| ModelIndex {
                version: s.catalog().get(&m.name).ok().map(|e| e.version.to_string()),
                name: m.name,
                state: if not_ready.is_some() {
                    "UNAVAILABLE"
                } else {
                    "READY"
                }
                .into(),
                reason: not_ready.clone().unwrap_or_default(),
            })
            .filter(|m| !ready_only || m.state == "READY")
            .collect();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        out
    }

    /// Checks the request's `authorization` value (HTTP header or gRPC
    /// metadata): Ok when no api key is set, or when it is `Bearer <key>`.
    pub fn authorize(&self, header: Option<&str>) -> Result<(), OipError> {
        let Some(key) = &self.inner.api_key else {
            return Ok(());
        };
        let Some(h) = header else {
            return Err(OipError::unauthenticated(
                "this server needs an api key: send the header `authorization: Bearer <key>` \
                 (the key is in the cluster's settings/api.key)",
            ));
        };
        let token = h
            .strip_prefix("Bearer ")
            .or_else(|| h.strip_prefix("bearer "))
            .map(str::trim);
        match token {
            Some(t) if constant_time_eq(t.as_bytes(), key.as_bytes()) => Ok(()),
            Some(_) => Err(OipError::unauthenticated(
                "the bearer token is not this server's api key (settings/api.key)",
            )),
            None => Err(OipError::unauthenticated(
                "the authorization header must be `Bearer <key>`",
            )),
        }
    }

    /// Runs one inference through the dispatcher.
    pub async fn infer(&self, req: InferRequest) -> Result<InferResponse, OipError> {
        let sig = self.signature(&req.model, req.version.as_deref())?;
        let input = sig.input_frame(&req.inputs)?;
        let wanted = sig.requested_outputs(req.outputs.as_deref())?;
        let out = self
            .inner
            .dispatch
            .infer(req.model.clone(), req.slo_ms, req.priority, input)
            .await;
        let (names, frames) = match out.reply {
            RuntimeReply::Output { outputs, .. } => (outputs, out.frames),
            RuntimeReply::Error { error, .. } => return Err(error.into()),
            other => {
                return Err(OipError::code(
                    ErrorCode::Internal,
                    format!(
                        "model {}: the dispatcher answered with {other:?}",
                        req.model
                    ),
                ))
            }
        };
        if names.len() != frames.len() {
            return Err(OipError::code(
                ErrorCode::Internal,
                format!(
                    "model {}: the reply names {} outputs and carries {} frames",
                    req.model,
                    names.len(),
                    frames.len()
                ),
            ));
        }
        let mut outputs = Vec::with_capacity(wanted.len());
        for want in &wanted {
            let Some(i) = names.iter().position(|n| n == want) else {
                return Err(OipError::code(
                    ErrorCode::Internal,
                    format!(
                        "model {}: the GPU server returned outputs {names:?}, without {want}",
                        req.model
                    ),
                ));
            };
            let (datatype, shape, data) = npy::decode(&frames[i]).map_err(|e| {
                OipError::code(
                    ErrorCode::Internal,
                    format!("model {} output {want}: {e}", req.model),
                )
            })?;
            outputs.push(Tensor {
                name: want.clone(),
                datatype,
                shape,
                data,
            });
        }
        Ok(InferResponse {
            model: req.model,
            version: Some(sig.version),
            id: req.id,
            outputs,
        })
    }
}

/// Compares without an early exit, so the time taken says nothing about
/// how much of the key a guess got right.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The inputs and outputs of a package manifest, as the catalog holds it.
#[derive(Debug, Deserialize)]
struct ManifestIo {
    inputs: Vec<TensorSpec>,
    outputs: Vec<ManifestTensor>,
}

#[derive(Debug, Deserialize)]
struct ManifestTensor {
    name: String,
    shape: Vec<usize>,
    dtype: Dtype,
}

/// A model's protocol signature, from its manifest.
struct Signature {
    model: String,
    version: String,
    inputs: Vec<TensorMeta>,
    outputs: Vec<TensorMeta>,
    /// The package's input declarations: which dimensions a request
    /// chooses, and their bounds.
    specs: Vec<TensorSpec>,
}

impl Signature {
    fn of(
        model: &str,
        version: String,
        manifest: &serde_json::Value,
    ) -> Result<Signature, OipError> {
        let io = ManifestIo::deserialize(manifest).map_err(|e| {
            OipError::code(
                ErrorCode::Internal,
                format!("model {model}: its catalog manifest has no readable inputs/outputs: {e}"),
            )
        })?;
        // Output dims that follow a variable input dim are variable too; the
        // shape rules over the layers say which. A manifest without its
        // layers (none the deploy tool writes) frees the batch only.
        let output_shapes: Vec<Vec<i64>> = match Manifest::deserialize(manifest) {
            Ok(m) => m.output_protocol_shapes(),
            Err(_) => io
                .outputs
                .iter()
                .map(|o| TensorSpec::batched(o.name.clone(), o.shape.clone(), Dtype::F32))
                .map(|spec| spec.protocol_shape())
                .collect(),
        };
        let inputs = io
            .inputs
            .iter()
            .map(|t| TensorMeta {
                name: t.name.clone(),
                datatype: datatype_of(t.dtype),
                shape: t.protocol_shape(),
            })
            .collect();
        let outputs = io
            .outputs
            .iter()
            .zip(output_shapes)
            .map(|(t, shape)| TensorMeta {
                name: t.name.clone(),
                datatype: datatype_of(t.dtype),
                shape,
            })
            .collect();
        Ok(Signature {
            model: model.to_string(),
            version,
            inputs,
            outputs,
            specs: io.inputs,
        })
    }

    /// Checks `inputs` against the model's (one tensor of the right name,
    /// datatype and shape) and encodes it as the runtime's `.npy` frame.
    fn input_frame(&self, inputs: &[Tensor]) -> Result<Vec<u8>, OipError> {
        let ([meta], [spec]) = (self.inputs.as_slice(), self.specs.as_slice()) else {
            return Err(OipError::code(
                ErrorCode::Unsupported,
                format!(
                    "model {} has {} inputs; the protocol front end serves one-input models",
                    self.model,
                    self.inputs.len()
                ),
            ));
        };
        let [t] = inputs else {
            return Err(OipError::bad_request(format!(
                "model {} takes one input, {} {} {}; the request has {}",
                self.model,
                meta.name,
                meta.datatype,
                spec.expected(),
                inputs.len()
            )));
        };
        if t.name != meta.name {
            return Err(OipError::bad_request(format!(
                "model {} has no input {:?}; its input is {} {} {}",
                self.model,
                t.name,
                meta.name,
                meta.datatype,
                spec.expected()
            )));
        }
        if t.datatype != meta.datatype {
            return Err(OipError::bad_request(format!(
                "model {} input {}: datatype {}, expected {}",
                self.model, t.name, t.datatype, meta.datatype
            )));
        }
        let shape: Vec<usize> = t
            .shape
            .iter()
            .map(|&d| usize::try_from(d).unwrap_or(0))
            .collect();
        if let Err(why) = spec.check_shape(&shape) {
            return Err(OipError::bad_request(format!(
                "model {} input {}: shape {:?} does not fit {:?}, i.e. {}: {why}",
                self.model,
                t.name,
                t.shape,
                meta.shape,
                spec.expected()
            )));
        }
        t.check_size()?;
        let frame = npy::encode(t.datatype, &shape, &t.data);
        // The GPU servers take one input frame of at most this many bytes.
        let max = CONTROL_FRAME_BYTES_MAX as usize;
        if frame.len() > max {
            return Err(OipError {
                kind: ErrorKind::TooLarge,
                message: format!(
                    "too_large: model {} input {} {:?} is {} bytes as the GPU server's input frame, over \
                     its limit of {max} bytes ({} MiB); send a smaller batch",
                    self.model,
                    t.name,
                    t.shape,
                    frame.len(),
                    max >> 20
                ),
            });
        }
        Ok(frame)
    }

    /// The output names to return, in order; unknown names are errors.
    fn requested_outputs(&self, asked: Option<&[String]>) -> Result<Vec<String>, OipError> {
        let all = || self.outputs.iter().map(|o| o.name.clone());
        let Some(asked) = asked else {
            return Ok(all().collect());
        };
        for name in asked {
            if !self.outputs.iter().any(|o| &o.name == name) {
                return Err(OipError::bad_request(format!(
                    "model {} has no output {name:?}; its outputs are {}",
                    self.model,
                    all().collect::<Vec<_>>().join(", ")
                )));
            }
        }
        Ok(asked.to_vec())
    }
}

/// The protocol datatype of a package tensor's element type.
fn datatype_of(dtype: Dtype) -> Datatype {
    match dtype {
        Dtype::F32 => Datatype::F32,
        Dtype::I64 => Datatype::I64,
    }
}

/// The runtime's frames: NumPy `.npy` files, little-endian `<f4` or `<i8`,
/// C order (what the GPU server reads and writes).
mod npy {
    use super::Datatype;

    const MAGIC: &[u8; 6] = b"\x93NUMPY";
    /// NumPy's own bound for untrusted headers is 10 000 bytes.
    const HEADER_BYTES_MAX: usize = 64 << 10;

    /// A version 1.0 `.npy` file of `data` (raw LE `datatype` elements).
    pub fn encode(datatype: Datatype, shape: &[usize], data: &[u8]) -> Vec<u8> {
        let descr = match datatype {
            Datatype::F32 => "<f4",
            Datatype::I64 => "<i8",
            // The signature check admits F32 and I64 inputs only.
            other => unreachable!("no .npy descr for {other}"),
        };
        let shape = match shape {
            [n] => format!("({n},)"),
            dims => format!(
                "({})",
                dims.iter()
                    .map(usize::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        };
        let mut dict =
            format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
        // magic + version + u16 length + dict + '\n', padded to 64 bytes.
        let total = (MAGIC.len() + 2 + 2 + dict.len() + 1).div_ceil(64) * 64;
        while MAGIC.len() + 4 + dict.len() + 1 < total {
            dict.push(' ');
        }
        dict.push('\n');
        let mut out = Vec::with_capacity(total + data.len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&[1, 0]);
        out.extend_from_slice(&(dict.len() as u16).to_le_bytes());
        out.extend_from_slice(dict.as_bytes());
        out.extend_from_slice(data);
        out
    }

    /// The datatype, shape and raw data of a `.npy` file.
    pub fn decode(bytes: &[u8]) -> Result<(Datatype, Vec<i64>, Vec<u8>), String> {
        if bytes.len() < 10 || &bytes[..6] != MAGIC {
            return Err("not a .npy frame (no \\x93NUMPY magic)".into());
        }
        let (len_bytes, start) = match (bytes[6], bytes[7]) {
            (1, 0) => (2, 10),
            (2, 0) | (3, 0) => (4, 12),
            (a, b) => return Err(format!(".npy format version {a}.{b} is not supported")),
        };
        let len = if len_bytes == 2 {
            u16::from_le_bytes([bytes[8], bytes[9]]) as usize
        } else {
            let b = bytes.get(8..12).ok_or(".npy header length cut short")?;
            u32::from_le_bytes(b.try_into().expect("4 bytes")) as usize
        };
        if len > HEADER_BYTES_MAX {
            return Err(format!(
                ".npy header of {len} bytes, over {HEADER_BYTES_MAX}"
            ));
        }
        let header = bytes
            .get(start..start + len)
            .ok_or(".npy header cut short")?;
        let header = std::str::from_utf8(header).map_err(|_| ".npy header is not UTF-8")?;
        let value = |key: &str| -> Result<&str, String> {
            let at = header
                .find(&format!("'{key}':"))
                .ok_or_else(|| format!(".npy header {header:?} has no {key}"))?;
            Ok(header[at + key.len() + 3..].trim_start())
        };
        let descr = value("descr")?;
        let datatype = if descr.starts_with("'<f4'") {
            Datatype::F32
        } else if descr.starts_with("'<i8'") {
            Datatype::I64
        } else {
            return Err(format!(
                ".npy header {header:?}: only <f4 and <i8 are expected"
            ));
        };
        if !value("fortran_order")?.starts_with("False") {
            return Err(format!(".npy header {header:?}: not C order"));
        }
        let shape = value("shape")?;
        let inner = shape
            .strip_prefix('(')
            .and_then(|s| s.split_once(')'))
            .map(|(s, _)| s)
            .ok_or_else(|| format!(".npy header {header:?}: shape is not a tuple"))?;
        let shape: Vec<i64> = inner
            .split(',')
            .map(str::trim)
            .filter(|d| !d.is_empty())
            .map(|d| {
                d.parse::<i64>()
                    .map_err(|_| format!(".npy shape ({inner}): {d:?} is not a size"))
            })
            .collect::<Result<_, _>>()?;
        let data = &bytes[start + len..];
        let n = super::element_count("output", &shape).map_err(|e| e.message)?;
        let want = n.checked_mul(datatype.element_bytes().expect("fixed width"));
        if want != Some(data.len()) {
            return Err(format!(
                ".npy {} {shape:?} needs {want:?} bytes of data, the frame has {}",
                datatype,
                data.len()
            ));
        }
        Ok((datatype, shape, data.to_vec()))
    }
}

#[cfg(test)]
mod tests;
