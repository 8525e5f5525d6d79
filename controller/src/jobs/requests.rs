//! What starting and stopping a job's stage workers sends to the GPU
//! servers: the exact `RuntimeRequest`s, built from the job (pure).

use distmind_common::proto::{LayerRange, RuntimeRequest, StageAssignment, StagePeer, StagePeers};
use distmind_common::train_spec::layer_ranges;

use super::Job;

/// A request for one stage worker's runtime.
#[derive(Debug, Clone, PartialEq)]
pub struct StageRequest {
    pub runtime: u32,
    /// The runtime's request address.
    pub addr: String,
    pub request: RuntimeRequest,
}

/// The `TrainStage` request of every stage worker of a placed job, in
/// pipeline-major order, with request ids `first_id..`. Empty while the job
/// is pending.
pub fn start_requests(job: &Job, first_id: u64) -> Vec<StageRequest> {
    let s = job.spec.stages;
    let ranges = layer_ranges(&job.partition);
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
    let start_iteration = job.resume_iteration();
    job.placement
        .iter()
        .enumerate()
        .map(|(i, at)| {
            let (pipeline, stage) = (i as u32 / s, i as u32 % s);
            let r = &ranges[stage as usize];
            let assignment = StageAssignment {
                job: job.id.clone(),
                generation: job.generation,
                pipeline,
                stage,
                device: at.device,
                model: job.spec.model.clone(),
                catalog_version: job.catalog_version,
                layers: LayerRange {
                    first: r.start,
                    end: r.end,
                },
                partition: job.partition.clone(),
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
    let s = job.spec.stages;
    job.placement
        .iter()
        .enumerate()
        .map(|(i, at)| StageRequest {
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
