//! The requests that make, start and stop stage workers, as the
//! connection task calls them: each checks what it can at once (never
//! blocking the connection) and hands the rest to the worker's thread or a
//! blocking task, which replies.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use crossbeam::channel::{self, Receiver, Sender, TrySendError};
use distmind_common::proto::{ErrorCode, RuntimeReply, StageAssignment};
use tokio::sync::{mpsc, OwnedSemaphorePermit};

use super::assignment::{check, check_peers, Refusal};
use super::{
    run, Command, Control, Handle, Peers, Reply, StageKey, StagePhase, StageWorkerStatus,
    StageWorkers, STAGE_COMMANDS_MAX, STAGE_WORKERS_PER_SERVER_MAX, STOP_REPLY_TIMEOUT,
};
use crate::server::worker::{self, Outgoing};
use crate::server::Shared;

/// `TrainStage`: checks the assignment, reserves its device and starts the
/// worker's thread, which answers `TrainStageReady` once loaded (or the
/// load's error). Returns the reply to send at once, if any.
pub(crate) fn train_stage(
    shared: &Arc<Shared>,
    tx: &mpsc::Sender<Outgoing>,
    id: u64,
    assignment: StageAssignment,
    permit: OwnedSemaphorePermit,
) -> Option<Outgoing> {
    let core = &shared.core;
    let refuse = |e: Refusal, permit| {
        let who = format!(
            "request {id}: job {} pipeline {} stage {}",
            assignment.job, assignment.pipeline, assignment.stage
        );
        log::warn!("{who}: stage worker refused: {e}");
        Some(Outgoing {
            permit: Some(permit),
            ..worker::error(id, e.code(), format!("{who}: {e}"))
        })
    };
    if let Err(e) = check(&assignment) {
        return refuse(e, permit);
    }
    let index = match core.device_index(assignment.device) {
        Ok(i) => i,
        Err(_) => {
            let e = Refusal::UnknownDevice {
                device: assignment.device,
                devices: core.devices.iter().map(|d| d.id).collect(),
            };
            return refuse(e, permit);
        }
    };
    let workers = &core.stages;
    if workers.closed.load(Ordering::Relaxed) {
        return refuse(Refusal::ShuttingDown, permit);
    }
    let mut slots = workers.slots();
    if let Some(h) = slots[index].clone() {
        if h.ended() {
            // Its thread is at its very end.
            h.join();
            slots[index] = None;
        } else if *h.assignment == assignment {
            let s = h.control.status().clone();
            return match (s.phase, s.data_addr) {
                (StagePhase::Ready | StagePhase::Running, Some(data_addr)) => Some(Outgoing {
                    permit: Some(permit),
                    ..ready_reply(id, &h.key, data_addr, s.layer_checksums)
                }),
                _ => refuse(
                    Refusal::Loading {
                        device: assignment.device,
                        job: h.key.job.clone(),
                        pipeline: h.key.pipeline,
                        stage: h.key.stage,
                    },
                    permit,
                ),
            };
        } else {
            let k = &h.key;
            return refuse(
                Refusal::DeviceTaken {
                    device: assignment.device,
                    job: k.job.clone(),
                    generation: k.generation,
                    pipeline: k.pipeline,
                    stage: k.stage,
                },
                permit,
            );
        }
    }
    let running = slots.iter().flatten().filter(|h| !h.ended()).count();
    if running >= STAGE_WORKERS_PER_SERVER_MAX {
        return refuse(
            Refusal::TooManyWorkers {
                running,
                max: STAGE_WORKERS_PER_SERVER_MAX,
            },
            permit,
        );
    }
    let key = StageKey::of(&assignment);
    let status = StageWorkerStatus {
        job: key.job.clone(),
        generation: key.generation,
        pipeline: key.pipeline,
        stage: key.stage,
        device: assignment.device,
        phase: StagePhase::Loading,
        data_addr: None,
        iterations: assignment.start_iteration,
        losses: Vec::new(),
        params_checksum: None,
        params_checksum_before_sync: None,
        op_ms_max: 0.0,
        layer_checksums: Vec::new(),
        end: None,
    };
    let control = Arc::new(Control {
        stop: AtomicBool::new(false),
        abort: AtomicBool::new(false),
        status: Mutex::new(status),
        ended: Condvar::new(),
    });
    let (commands, inbox): (Sender<Command>, Receiver<Command>) =
        channel::bounded(STAGE_COMMANDS_MAX);
    let assignment = Arc::new(assignment);
    let handle = Arc::new(Handle {
        key: key.clone(),
        assignment: assignment.clone(),
        control: control.clone(),
        commands,
        started: Mutex::new(None),
        thread: Mutex::new(None),
    });
    let reply = Reply {
        id,
        tx: tx.clone(),
        permit: Some(permit),
    };
    let spawned = {
        let (core, config) = (core.clone(), workers.config.clone());
        std::thread::Builder::new()
            .name(format!("stage {}/{}", key.pipeline, key.stage))
            .spawn(move || run::main(&core, &config, index, &assignment, &control, &inbox, reply))
    };
    match spawned {
        Ok(t) => {
            *handle.thread.lock().unwrap_or_else(|p| p.into_inner()) = Some(t);
            log::info!(
                "device {}: stage worker of {key} starting: layers [{}, {}) of {}",
                core.devices[index].id,
                handle.assignment.layers.first,
                handle.assignment.layers.end,
                handle.assignment.model
            );
            slots[index] = Some(handle);
            None
        }
        Err(e) => Some(worker::error(
            id,
            ErrorCode::Internal,
            format!("request {id}: {key}: cannot start the worker's thread: {e}"),
        )),
    }
}

pub(crate) fn ready_reply(
    id: u64,
    key: &StageKey,
    data_addr: String,
    layer_checksums: Vec<u64>,
) -> Outgoing {
    Outgoing {
        reply: RuntimeReply::TrainStageReady {
            id,
            job: key.job.clone(),
            generation: key.generation,
            pipeline: key.pipeline,
            stage: key.stage,
            data_addr,
            layer_checksums,
        },
        frames: Vec::new(),
        permit: None,
        spent: Vec::new(),
    }
}

pub(crate) fn started_reply(id: u64, key: &StageKey) -> RuntimeReply {
    RuntimeReply::TrainStageStarted {
        id,
        job: key.job.clone(),
        generation: key.generation,
        pipeline: key.pipeline,
        stage: key.stage,
    }
}

/// No worker of `job` `generation` at (`pipeline`, `stage`): the refusal
/// names what this runtime runs instead.
fn unknown(
    workers: &StageWorkers,
    what: &str,
    job: &str,
    generation: u64,
    pipeline: u32,
    stage: u32,
) -> String {
    let here: Vec<String> = workers
        .statuses()
        .iter()
        .map(|s| {
            format!(
                "job {} generation {} pipeline {} stage {} ({:?})",
                s.job, s.generation, s.pipeline, s.stage, s.phase
            )
        })
        .collect();
    format!(
        "{what}: this runtime has no stage worker of job {job} generation {generation} \
         pipeline {pipeline} stage {stage} (it has: {}); send TrainStage first",
        if here.is_empty() {
            "none".to_string()
        } else {
            here.join("; ")
        }
    )
}

/// `TrainStageStart`: hands the peers to the worker's thread, which
/// connects and answers `TrainStageStarted`. Returns the reply to send at
/// once, if any.
#[allow(clippy::too_many_arguments)]
pub(crate) fn train_stage_start(
    shared: &Arc<Shared>,
    tx: &mpsc::Sender<Outgoing>,
    id: u64,
    job: String,
    generation: u64,
    pipeline: u32,
    stage: u32,
    peers: Peers,
    permit: OwnedSemaphorePermit,
) -> Option<Outgoing> {
    let workers = &shared.core.stages;
    let fail = |code, message: String, permit| {
        log::warn!("{message}");
        Some(Outgoing {
            permit: Some(permit),
            ..worker::error(id, code, message)
        })
    };
    let what = format!("request {id}: start");
    let Some(h) = workers
        .find(&job, pipeline, stage)
        .filter(|h| h.key.generation == generation)
    else {
        return fail(
            ErrorCode::BadRequest,
            unknown(workers, &what, &job, generation, pipeline, stage),
            permit,
        );
    };
    if let Err(e) = check_peers(
        &h.assignment,
        peers.prev.as_ref(),
        peers.next.as_ref(),
        &peers.replicas,
    ) {
        return fail(e.code(), format!("{what} of {}: {e}", h.key), permit);
    }
    {
        let mut started = h.started.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(before) = &*started {
            return if *before == peers && !h.ended() {
                // A retried start: the worker runs with these peers.
                Some(Outgoing {
                    reply: started_reply(id, &h.key),
                    frames: Vec::new(),
                    permit: Some(permit),
                    spent: Vec::new(),
                })
            } else {
                fail(
                    ErrorCode::BadRequest,
                    format!(
                        "{what} of {}: it was started already{}",
                        h.key,
                        if h.ended() {
                            " and has ended"
                        } else {
                            ", with other peers"
                        }
                    ),
                    permit,
                )
            };
        }
        *started = Some(peers.clone());
    }
    let reply = Reply {
        id,
        tx: tx.clone(),
        permit: Some(permit),
    };
    let unstarted = || *h.started.lock().unwrap_or_else(|p| p.into_inner()) = None;
    match h.commands.try_send(Command::Start { peers, reply }) {
        Ok(()) => None,
        Err(TrySendError::Full(Command::Start { reply, .. })) => {
            unstarted();
            reply.error(
                ErrorCode::Busy,
                format!("{what} of {}: its command queue is full; retry", h.key),
            );
            None
        }
        Err(TrySendError::Disconnected(Command::Start { reply, .. })) => {
            unstarted();
            let end = h.control.status().end.clone();
            reply.error(
                ErrorCode::BadRequest,
                format!("{what} of {}: the worker has ended ({end:?})", h.key),
            );
            None
        }
    }
}

/// `TrainStageStop`: the worker of `job` (this `generation`) stops at its
/// next iteration boundary; answered `Training` (`model: None`, its
/// iterations) once it ended, or after [`STOP_REPLY_TIMEOUT`].
#[allow(clippy::too_many_arguments)]
pub(crate) fn train_stage_stop(
    shared: &Arc<Shared>,
    tx: &mpsc::Sender<Outgoing>,
    id: u64,
    job: String,
    pipeline: u32,
    stage: u32,
    generation: u64,
    permit: OwnedSemaphorePermit,
) -> Option<Outgoing> {
    let core = &shared.core;
    let what = format!("request {id}: stop");
    let h = match core.stages.find(&job, pipeline, stage) {
        Some(h) if h.key.generation == generation => h,
        Some(h) => {
            return Some(Outgoing {
                permit: Some(permit),
                ..worker::error(
                    id,
                    ErrorCode::BadRequest,
                    format!(
                        "{what}: the stage worker of job {job} pipeline {pipeline} stage {stage} \
                         here is generation {}, not {generation}; it is left alone",
                        h.key.generation
                    ),
                )
            })
        }
        None => {
            return Some(Outgoing {
                permit: Some(permit),
                ..worker::error(
                    id,
                    ErrorCode::BadRequest,
                    unknown(&core.stages, &what, &job, generation, pipeline, stage),
                )
            })
        }
    };
    h.control.stop.store(true, Ordering::Relaxed);
    let device = h.assignment.device;
    let reply = Reply {
        id,
        tx: tx.clone(),
        permit: Some(permit),
    };
    tokio::task::spawn_blocking(move || {
        let iterations = h.control.wait_end(STOP_REPLY_TIMEOUT);
        if !h.ended() {
            log::warn!(
                "{}: not ended {STOP_REPLY_TIMEOUT:?} after the stop; answering now, it stops \
                 at its iteration boundary",
                h.key
            );
        }
        reply.send(RuntimeReply::Training {
            id,
            device,
            model: None,
            iterations,
        });
    });
    None
}
