//! What starting and stopping a job's stage workers sends to the GPU
//! servers: the exact `RuntimeRequest`s, built from the job (pure).

use distmind_common::proto::{
    DataPeer, LayerRange, RuntimeRequest, StageAssignment, StagePeer, StagePeers,
};
use distmind_common::train_spec::layer_ranges;

use super::Job;

/// A request for one stage worker's runtime.
#[derive(Debug, Clone, PartialEq)]
pub struct StageRequest {
    /// The worker it is for.
    pub pipeline: u32,
    pub stage: u32,
    pub runtime: u32,
    /// The runtime's request address.
    pub addr: String,
    pub request: RuntimeRequest,
}

/// The `TrainStage` request of every stage worker of a placed job, in
/// pipeline-major order, with request ids `first_id..`. Empty while the job
/// is pending.
pub fn start_requests(job: &Job, first_id: u64) -> Vec<StageRequest> {
    start_requests_with(
        job,
        &job.partition,
        job.generation,
        job.resume_iteration(),
        first_id,
    )
}

/// The `TrainStage` request of every stage worker of a placed job as if it
/// ran `partition` in `generation` from `start_iteration` (a
/// re-partitioning's restart), with request ids `first_id..`.
pub fn start_requests_with(
    job: &Job,
    partition: &[u32],
    generation: u64,
    start_iteration: u64,
    first_id: u64,
) -> Vec<StageRequest> {
    let s = job.spec.stages;
    let ranges = layer_ranges(partition);
    let peer = |pipeline: u32, stage: u32| {
        let p = &job.placement[job.index(pipeline, stage)];
        StagePeer {
            pipeline,
            stage,
            runtime: p.runtime,
            addr: p.addr.clone(),
            device: p.device,
        }
    };
    job.placement
        .iter()
        .enumerate()
        .map(|(i, at)| {
            let (pipeline, stage) = (i as u32 / s, i as u32 % s);
            let r = &ranges[stage as usize];
            let assignment = StageAssignment {
                job: job.id.clone(),
                generation,
                pipeline,
                stage,
                device: at.device,
                model: job.model_now().0.to_string(),
                catalog_version: job.model_now().1,
                layers: LayerRange {
                    first: r.start,
                    end: r.end,
                },
                partition: partition.to_vec(),
                start_iteration,
                peers: StagePeers {
                    prev: (stage > 0).then(|| peer(pipeline, stage - 1)),
                    next: (stage + 1 < s).then(|| peer(pipeline, stage + 1)),
                    same_stage: (0..job.spec.pipelines)
                        .filter(|&q| q != pipeline)
                        .map(|q| peer(q, stage))
                        .collect(),
                },
                spec: Box::new(job.spec.clone()),
            };
            StageRequest {
                pipeline,
                stage,
                runtime: at.runtime,
                addr: at.addr.clone(),
                request: RuntimeRequest::TrainStage {
                    id: first_id + i as u64,
                    assignment: Box::new(assignment),
                },
            }
        })
        .collect()
}

/// The `TrainStageStop` request of every stage worker of a placed job,
/// with request ids `first_id..`.
pub fn stop_requests(job: &Job, first_id: u64) -> Vec<StageRequest> {
    stop_requests_where(job, first_id, |_| true)
}

/// The `TrainStageStop` request of the workers `pick` chooses (by their
/// pipeline-major index); worker `i`'s id is `first_id + i`.
pub fn stop_requests_where(
    job: &Job,
    first_id: u64,
    pick: impl Fn(usize) -> bool,
) -> Vec<StageRequest> {
    let s = job.spec.stages;
    job.placement
        .iter()
        .enumerate()
        .filter(|&(i, _)| pick(i))
        .map(|(i, at)| StageRequest {
            pipeline: i as u32 / s,
            stage: i as u32 % s,
            runtime: at.runtime,
            addr: at.addr.clone(),
            request: RuntimeRequest::TrainStageStop {
                id: first_id + i as u64,
                job: job.id.clone(),
                pipeline: i as u32 / s,
                stage: i as u32 % s,
                generation: job.generation,
            },
        })
        .collect()
}

/// The `TrainStageStart` request of every worker of a job whose workers
/// all answered ready (empty otherwise), with request ids `first_id..`:
/// each learns its previous and next stage's data address in its pipeline
/// and its stage's replicas' in every pipeline, itself included.
pub fn start_link_requests(job: &Job, first_id: u64) -> Vec<StageRequest> {
    let (pipelines, stages) = (job.spec.pipelines, job.spec.stages);
    let Some(addrs) = job
        .stages
        .iter()
        .map(|s| s.launch.data_addr())
        .collect::<Option<Vec<&str>>>()
    else {
        return Vec::new();
    };
    let peer = |pipeline: u32, stage: u32| {
        let worker = pipeline * stages + stage;
        DataPeer {
            pipeline,
            stage,
            worker,
            data_addr: addrs[worker as usize].to_string(),
        }
    };
    job.placement
        .iter()
        .enumerate()
        .map(|(i, at)| {
            let (pipeline, stage) = (i as u32 / stages, i as u32 % stages);
            StageRequest {
                pipeline,
                stage,
                runtime: at.runtime,
                addr: at.addr.clone(),
                request: RuntimeRequest::TrainStageStart {
                    id: first_id + i as u64,
                    job: job.id.clone(),
                    generation: job.generation,
                    pipeline,
                    stage,
                    prev: (stage > 0).then(|| peer(pipeline, stage - 1)),
                    next: (stage + 1 < stages).then(|| peer(pipeline, stage + 1)),
                    replicas: (0..pipelines).map(|q| peer(q, stage)).collect(),
                },
            }
        })
        .collect()
}
