//! Blocking client of a runtime's request port, or of the dispatcher's
//! client port, which speaks the same protocol (`distmind client`, tests,
//! benches).
//!
//! [`RuntimeClient::infer`] sends one request and waits for its reply. For
//! pipelining, [`RuntimeClient::send_infer`] queues requests without waiting
//! and [`RuntimeClient::recv`] returns replies as they come (any order, each
//! with its id); [`RuntimeClient::split`] gives the two halves to two
//! threads. After an IO or framing error the connection is unusable: connect
//! again.

use std::io::{BufWriter, Write};
use std::net::TcpStream;
use std::path::Path;
use std::time::Duration;

use distmind_common::handshake::{self, ClusterKey, HandshakeError};
use distmind_common::limits::CONTROL_FRAME_BYTES_MAX;
use distmind_common::proto::{
    BatchMember, DispatchInfo, ErrorCode, ErrorReply, RuntimeReply, RuntimeRequest, RuntimeStats,
    ServePath, StageAssignment, TimingMsg, TraceEntry, BATCH_MEMBERS_MAX, RUNTIME_OUTPUTS_MAX,
};
use distmind_common::wire::{self, FrameKind, Role, WireError};

use crate::exec::HostTensor;
use crate::npy::{encode_npy, parse_npy, NpyError};

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RuntimeClientError {
    #[error("cannot connect to the runtime at {addr}: {source}")]
    Connect {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("handshake with the runtime at {addr} failed: {source}")]
    Handshake {
        addr: String,
        #[source]
        source: HandshakeError,
    },
    #[error("connection to the runtime at {addr} failed: {source}")]
    Wire {
        addr: String,
        #[source]
        source: WireError,
    },
    #[error("the runtime at {addr} refused request {id}: {reply}")]
    Server {
        addr: String,
        id: u64,
        reply: ErrorReply,
    },
    #[error("a batch of {got} requests: 1..={max} run together")]
    BatchSize { got: usize, max: usize },
    #[error("the input ({what}) is {len} bytes as .npy, more than a frame's {max} bytes: send a smaller batch")]
    InputTooLarge { what: String, len: usize, max: u32 },
    #[error("the runtime at {addr} sent a bad output frame: {source}")]
    BadOutput {
        addr: String,
        #[source]
        source: NpyError,
    },
    #[error("the runtime at {addr} answered request {request} with an unexpected reply: {reply}")]
    UnexpectedReply {
        addr: String,
        request: u64,
        reply: String,
    },
}

impl RuntimeClientError {
    /// The runtime's error code, when it refused the request.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            RuntimeClientError::Server { reply, .. } => Some(reply.code),
            _ => None,
        }
    }
}

/// Options of one inference request.
#[derive(Debug, Clone, Copy, Default)]
pub struct InferOptions {
    /// Give up when the request waited this long in the server's queue.
    pub deadline_ms: Option<u64>,
    /// Return the pipeline trace with the outputs.
    pub trace: bool,
    /// Run on the device with this ordinal (default: the server's choice).
    pub device: Option<u32>,
    /// The catalog version of the model the sender resolved; a runtime
    /// whose plan is older refreshes it first (default: its own view).
    pub catalog_version: Option<u64>,
}

/// One request of a batch sent with [`RuntimeSender::send_infer_batch`].
#[derive(Debug, Clone, Copy)]
pub struct BatchInput<'a> {
    pub input: &'a HostTensor,
    /// Give up on this request when it waited this long in the server's queue.
    pub deadline_ms: Option<u64>,
    /// Return the pipeline trace with this request's outputs.
    pub trace: bool,
}

/// A successful inference.
#[derive(Debug, Clone)]
pub struct Inference {
    pub id: u64,
    /// The manifest's output names, in order.
    pub names: Vec<String>,
    pub outputs: Vec<HostTensor>,
    pub timing: TimingMsg,
    pub trace: Option<Vec<TraceEntry>>,
    pub trace_truncated: bool,
    /// Models resident on the device after the request.
    pub resident: Vec<String>,
    /// The controller's dispatch record, when it routed the request.
    pub dispatch: Option<DispatchInfo>,
}

/// One reply, as [`RuntimeClient::recv`] returns it.
#[derive(Debug, Clone)]
pub enum Response {
    Output(Inference),
    /// A training stage worker's `TrainStageReady` or `TrainStageStarted`.
    TrainStage(RuntimeReply),
    Stats {
        id: u64,
        stats: RuntimeStats,
    },
    Evicted {
        id: u64,
        model: String,
        host_cache: bool,
        devices: u32,
    },
    Prefetched {
        id: u64,
        model: String,
        path: ServePath,
        ms: f64,
    },
    Training {
        id: u64,
        device: u32,
        model: Option<String>,
        iterations: u64,
    },
    Error {
        id: u64,
        error: ErrorReply,
    },
}

impl Response {
    pub fn id(&self) -> u64 {
        match self {
            Response::Output(i) => i.id,
            Response::TrainStage(r) => r.id(),
            Response::Stats { id, .. }
            | Response::Evicted { id, .. }
            | Response::Prefetched { id, .. }
            | Response::Training { id, .. }
            | Response::Error { id, .. } => *id,
        }
    }
}

/// The sending half: requests, numbered from 1.
#[derive(Debug)]
pub struct RuntimeSender {
    w: BufWriter<TcpStream>,
    addr: String,
    next_id: u64,
}

/// The receiving half: replies.
#[derive(Debug)]
pub struct RuntimeReceiver {
    r: TcpStream,
    addr: String,
}

/// A blocking connection to a runtime.
#[derive(Debug)]
pub struct RuntimeClient {
    tx: RuntimeSender,
    rx: RuntimeReceiver,
}

impl RuntimeClient {
    /// Connects, proves the cluster key, and uses `timeout` for the connect
    /// and for every reply.
    pub fn connect(
        addr: &str,
        key: &ClusterKey,
        timeout: Duration,
    ) -> Result<Self, RuntimeClientError> {
        let connect_err = |source| RuntimeClientError::Connect {
            addr: addr.to_string(),
            source,
        };
        let mut stream = handshake::dial_sync(addr, timeout).map_err(connect_err)?;
        handshake::client_sync(&mut stream, key, Role::Control).map_err(|source| {
            RuntimeClientError::Handshake {
                addr: addr.to_string(),
                source,
            }
        })?;
        let w = stream.try_clone().map_err(connect_err)?;
        Ok(RuntimeClient {
            tx: RuntimeSender {
                w: BufWriter::new(w),
                addr: addr.to_string(),
                next_id: 1,
            },
            rx: RuntimeReceiver {
                r: stream,
                addr: addr.to_string(),
            },
        })
    }

    pub fn addr(&self) -> &str {
        &self.tx.addr
    }

    /// The two halves, for a sending and a receiving thread.
    pub fn split(self) -> (RuntimeSender, RuntimeReceiver) {
        (self.tx, self.rx)
    }

    pub fn send_infer(
        &mut self,
        model: &str,
        input: &HostTensor,
        opts: InferOptions,
    ) -> Result<u64, RuntimeClientError> {
        self.tx.send_infer(model, input, opts)
    }

    pub fn send_infer_batch(
        &mut self,
        model: &str,
        device: Option<u32>,
        requests: &[BatchInput<'_>],
    ) -> Result<Vec<u64>, RuntimeClientError> {
        self.tx.send_infer_batch(model, device, requests)
    }

    pub fn recv(&mut self) -> Result<Response, RuntimeClientError> {
        self.rx.recv()
    }

    /// Runs `model` on `input`: the outputs in manifest order and the timing.
    pub fn infer(
        &mut self,
        model: &str,
        input: &HostTensor,
    ) -> Result<(Vec<HostTensor>, TimingMsg), RuntimeClientError> {
        let i = self.infer_with(model, input, InferOptions::default())?;
        Ok((i.outputs, i.timing))
    }

    /// [`infer`](Self::infer) with options (deadline, trace).
    pub fn infer_with(
        &mut self,
        model: &str,
        input: &HostTensor,
        opts: InferOptions,
    ) -> Result<Inference, RuntimeClientError> {
        let id = self.tx.send_infer(model, input, opts)?;
        match self.expect(id)? {
            Response::Output(i) => Ok(i),
            other => Err(self.unexpected(id, other)),
        }
    }

    pub fn stats(&mut self) -> Result<RuntimeStats, RuntimeClientError> {
        let id = self.tx.send(&|id| RuntimeRequest::Stats { id })?;
        match self.expect(id)? {
            Response::Stats { stats, .. } => Ok(stats),
            other => Err(self.unexpected(id, other)),
        }
    }

    /// Evicts `model` from the host cache and, unless `host_only`, from
    /// every device: whether it was in the host cache, and how many devices
    /// dropped it.
    pub fn evict(
        &mut self,
        model: &str,
        host_only: bool,
    ) -> Result<(bool, u32), RuntimeClientError> {
        let id = self.tx.send(&|id| RuntimeRequest::Evict {
            id,
            model: model.to_string(),
            host_only,
        })?;
        match self.expect(id)? {
            Response::Evicted {
                host_cache,
                devices,
                ..
            } => Ok((host_cache, devices)),
            other => Err(self.unexpected(id, other)),
        }
    }

    /// Cache-in of `model` without running it: into the host cache, and with
    /// `device` onto that device. Returns the path it took (`Cold`: fetched,
    /// `HostCached`: already in the host cache, `DeviceResident`: nothing to
    /// do) and the milliseconds from arrival to done.
    pub fn prefetch(
        &mut self,
        model: &str,
        device: Option<u32>,
    ) -> Result<(ServePath, f64), RuntimeClientError> {
        let id = self.tx.send(&|id| RuntimeRequest::Prefetch {
            id,
            model: model.to_string(),
            device,
        })?;
        match self.expect(id)? {
            Response::Prefetched { path, ms, .. } => Ok((path, ms)),
            other => Err(self.unexpected(id, other)),
        }
    }

    /// Starts (`Some(model)`), switches or stops (`None`) the background
    /// training job of `device`. Returns the job now running and the
    /// iterations the previous job ran.
    pub fn train(
        &mut self,
        device: u32,
        model: Option<&str>,
    ) -> Result<(Option<String>, u64), RuntimeClientError> {
        let id = self.tx.send(&|id| RuntimeRequest::Train {
            id,
            device,
            model: model.map(str::to_string),
        })?;
        match self.expect(id)? {
            Response::Training {
                model, iterations, ..
            } => Ok((model, iterations)),
            other => Err(self.unexpected(id, other)),
        }
    }

    /// Sends any request, numbered by this client (`make` gets the id),
    /// without waiting for its reply ([`recv`](Self::recv) returns it):
    /// how a coordinator sends every stage worker's `TrainStageStart`
    /// before reading the replies.
    pub fn send_request(
        &mut self,
        make: &dyn Fn(u64) -> RuntimeRequest,
    ) -> Result<u64, RuntimeClientError> {
        self.tx.send(make)
    }

    /// Starts a training stage worker (`TrainStage`); its data address
    /// once it is loaded (`TrainStageReady`).
    pub fn train_stage(
        &mut self,
        assignment: &StageAssignment,
    ) -> Result<String, RuntimeClientError> {
        let id = self.tx.send(&|id| RuntimeRequest::TrainStage {
            id,
            assignment: Box::new(assignment.clone()),
        })?;
        match self.expect(id)? {
            Response::TrainStage(RuntimeReply::TrainStageReady { data_addr, .. }) => Ok(data_addr),
            other => Err(self.unexpected(id, other)),
        }
    }

    /// Stops a training stage worker at its next iteration boundary
    /// (`TrainStageStop`); the iterations it completed.
    pub fn train_stage_stop(
        &mut self,
        job: &str,
        pipeline: u32,
        stage: u32,
        generation: u64,
    ) -> Result<u64, RuntimeClientError> {
        let id = self.tx.send(&|id| RuntimeRequest::TrainStageStop {
            id,
            job: job.to_string(),
            pipeline,
            stage,
            generation,
        })?;
        match self.expect(id)? {
            Response::Training { iterations, .. } => Ok(iterations),
            other => Err(self.unexpected(id, other)),
        }
    }

    /// The next reply, which must answer `id`; an error reply becomes
    /// [`RuntimeClientError::Server`].
    fn expect(&mut self, id: u64) -> Result<Response, RuntimeClientError> {
        match self.rx.recv()? {
            Response::Error { id: got, error } if got == id || got == 0 => {
                Err(RuntimeClientError::Server {
                    addr: self.tx.addr.clone(),
                    id: got,
                    reply: error,
                })
            }
            r if r.id() == id => Ok(r),
            other => Err(self.unexpected(id, other)),
        }
    }

    fn unexpected(&self, request: u64, reply: Response) -> RuntimeClientError {
        RuntimeClientError::UnexpectedReply {
            addr: self.tx.addr.clone(),
            request,
            reply: format!("{reply:?}"),
        }
    }
}

impl RuntimeSender {
    fn wire_err(&self, source: WireError) -> RuntimeClientError {
        RuntimeClientError::Wire {
            addr: self.addr.clone(),
            source,
        }
    }

    fn take_id(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    fn send(&mut self, make: &dyn Fn(u64) -> RuntimeRequest) -> Result<u64, RuntimeClientError> {
        let id = self.take_id();
        wire::send_message_sync(&mut self.w, &make(id)).map_err(|e| self.wire_err(e))?;
        self.w
            .flush()
            .map_err(|e| self.wire_err(WireError::from(e)))?;
        Ok(id)
    }

    /// Sends requests for `model` that the runtime runs as one batch (their
    /// inputs concatenated along dimension 0), each answered on its own
    /// under its own id with its own rows; returns the ids, in order. At
    /// most 1 + [`BATCH_MEMBERS_MAX`] requests.
    pub fn send_infer_batch(
        &mut self,
        model: &str,
        device: Option<u32>,
        requests: &[BatchInput<'_>],
    ) -> Result<Vec<u64>, RuntimeClientError> {
        let Some((head, rest)) = requests.split_first() else {
            return Err(RuntimeClientError::BatchSize {
                got: 0,
                max: 1 + BATCH_MEMBERS_MAX,
            });
        };
        if rest.len() > BATCH_MEMBERS_MAX {
            return Err(RuntimeClientError::BatchSize {
                got: requests.len(),
                max: 1 + BATCH_MEMBERS_MAX,
            });
        }
        let frames = requests
            .iter()
            .map(|r| encode_input(r.input))
            .collect::<Result<Vec<_>, _>>()?;
        let ids: Vec<u64> = requests.iter().map(|_| self.take_id()).collect();
        let req = RuntimeRequest::Infer {
            id: ids[0],
            model: model.to_string(),
            deadline_ms: head.deadline_ms,
            trace: head.trace,
            device,
            batch: rest
                .iter()
                .zip(&ids[1..])
                .map(|(r, &id)| BatchMember {
                    id,
                    deadline_ms: r.deadline_ms,
                    trace: r.trace,
                })
                .collect(),
            catalog_version: None,
        };
        wire::send_message_sync(&mut self.w, &req)
            .and_then(|()| {
                frames.iter().try_for_each(|f| {
                    wire::write_frame_sync(&mut self.w, FrameKind::WriteChunk, &[f])
                })
            })
            .and_then(|()| self.w.flush().map_err(WireError::from))
            .map_err(|e| self.wire_err(e))?;
        Ok(ids)
    }

    /// Sends an inference request and its input frame; returns its id.
    pub fn send_infer(
        &mut self,
        model: &str,
        input: &HostTensor,
        opts: InferOptions,
    ) -> Result<u64, RuntimeClientError> {
        let bytes = encode_input(input)?;
        let id = self.take_id();
        let req = RuntimeRequest::Infer {
            id,
            model: model.to_string(),
            deadline_ms: opts.deadline_ms,
            trace: opts.trace,
            device: opts.device,
            batch: Vec::new(),
            catalog_version: opts.catalog_version,
        };
        wire::send_message_sync(&mut self.w, &req)
            .and_then(|()| wire::write_frame_sync(&mut self.w, FrameKind::WriteChunk, &[&bytes]))
            .and_then(|()| self.w.flush().map_err(WireError::from))
            .map_err(|e| self.wire_err(e))?;
        Ok(id)
    }
}

/// `input` as an input frame, within a frame's bound.
fn encode_input(input: &HostTensor) -> Result<Vec<u8>, RuntimeClientError> {
    let bytes = encode_npy(input);
    if bytes.len() > CONTROL_FRAME_BYTES_MAX as usize {
        return Err(RuntimeClientError::InputTooLarge {
            what: input.describe(),
            len: bytes.len(),
            max: CONTROL_FRAME_BYTES_MAX,
        });
    }
    Ok(bytes)
}

impl RuntimeReceiver {
    fn wire_err(&self, source: WireError) -> RuntimeClientError {
        RuntimeClientError::Wire {
            addr: self.addr.clone(),
            source,
        }
    }

    /// The next reply, whichever request it answers.
    pub fn recv(&mut self) -> Result<Response, RuntimeClientError> {
        let reply: RuntimeReply = wire::recv_message_sync(&mut self.r, CONTROL_FRAME_BYTES_MAX)
            .map_err(|e| self.wire_err(e))?;
        Ok(match reply {
            RuntimeReply::Output {
                id,
                timing,
                outputs: names,
                trace,
                trace_truncated,
                resident,
                dispatch,
            } => {
                if names.len() > RUNTIME_OUTPUTS_MAX {
                    return Err(self.wire_err(WireError::Malformed(format!(
                        "{} outputs announced, at most {RUNTIME_OUTPUTS_MAX}",
                        names.len()
                    ))));
                }
                let mut outputs = Vec::with_capacity(names.len());
                for name in &names {
                    let frame = wire::read_frame_sync(&mut self.r, CONTROL_FRAME_BYTES_MAX)
                        .map_err(|e| self.wire_err(e))?;
                    let bytes = match frame {
                        Some((FrameKind::WriteChunk, b)) => b,
                        Some((kind, _)) => {
                            return Err(self.wire_err(WireError::Malformed(format!(
                                "expected output frame {name}, got a {kind:?} frame"
                            ))))
                        }
                        None => return Err(self.wire_err(WireError::Truncated)),
                    };
                    let t = parse_npy(&bytes, Path::new(name)).map_err(|source| {
                        RuntimeClientError::BadOutput {
                            addr: self.addr.clone(),
                            source,
                        }
                    })?;
                    outputs.push(t);
                }
                Response::Output(Inference {
                    id,
                    names,
                    outputs,
                    timing,
                    trace,
                    trace_truncated,
                    resident,
                    dispatch,
                })
            }
            RuntimeReply::Prefetched {
                id,
                model,
                path,
                ms,
            } => Response::Prefetched {
                id,
                model,
                path,
                ms,
            },
            RuntimeReply::Training {
                id,
                device,
                model,
                iterations,
            } => Response::Training {
                id,
                device,
                model,
                iterations,
            },
            RuntimeReply::Stats { id, stats } => Response::Stats { id, stats },
            RuntimeReply::Evicted {
                id,
                model,
                host_cache,
                devices,
            } => Response::Evicted {
                id,
                model,
                host_cache,
                devices,
            },
            r @ (RuntimeReply::TrainStageReady { .. } | RuntimeReply::TrainStageStarted { .. }) => {
                Response::TrainStage(r)
            }
            RuntimeReply::Error { id, error } => Response::Error { id, error },
        })
    }
}
