//! What a `TrainStage` assignment must satisfy before a stage worker is
//! made for it: the checks that need nothing but the assignment
//! ([`check`]) and those that need the model's manifest ([`check_layers`]).

use distmind_common::limits::NAME_BYTES_MAX;
use distmind_common::proto::{DataPeer, ErrorCode, StageAssignment};
use distmind_common::train_spec::{layer_ranges, Optimizer, SpecError, SyncMode};
use distmind_controller::jobs::checkpoint::checkpoint_name;
use distmind_models::Manifest;

use super::schedule::in_flight_max;
use super::HETERO_S_LIMIT;
use crate::train::{SgdConfig, STAGE_MICROBATCHES_IN_FLIGHT_MAX};

/// Why an assignment (or a start) is refused; each names the field or the
/// resource and what to do.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub(crate) enum Refusal {
    #[error("this runtime has no device {device} (its devices: {devices:?})")]
    UnknownDevice { device: u32, devices: Vec<u32> },
    #[error(
        "device {device} already runs the stage worker of job {job} generation {generation} \
         pipeline {pipeline} stage {stage}: one stage worker per device; stop it first \
         (TrainStageStop) or place the stage on another device"
    )]
    DeviceTaken {
        device: u32,
        job: String,
        generation: u64,
        pipeline: u32,
        stage: u32,
    },
    #[error(
        "device {device}: the stage worker of job {job} pipeline {pipeline} stage {stage} is \
         still loading its layers; wait for its TrainStageReady"
    )]
    Loading {
        device: u32,
        job: String,
        pipeline: u32,
        stage: u32,
    },
    #[error(
        "this runtime already runs {running} stage workers, its bound \
         (STAGE_WORKERS_PER_SERVER_MAX = {max}); stop one or place the stage elsewhere"
    )]
    TooManyWorkers { running: usize, max: usize },
    #[error("{what} is not supported by the stage workers yet; {instead}")]
    Unsupported { what: String, instead: String },
    #[error("{0}")]
    Spec(#[from] SpecError),
    #[error("assignment field {field}: {detail}")]
    Invalid { field: &'static str, detail: String },
    #[error("the runtime is shutting down")]
    ShuttingDown,
}

impl Refusal {
    /// The error code the refusal is answered with.
    pub fn code(&self) -> ErrorCode {
        match self {
            Refusal::TooManyWorkers { .. } | Refusal::Loading { .. } => ErrorCode::Busy,
            Refusal::Unsupported { .. } => ErrorCode::Unsupported,
            Refusal::ShuttingDown => ErrorCode::ShuttingDown,
            _ => ErrorCode::BadRequest,
        }
    }
}

fn invalid(field: &'static str, detail: String) -> Refusal {
    Refusal::Invalid { field, detail }
}

/// The SGD hyper-parameters of an assignment that passed [`check`].
pub(crate) fn sgd_of(a: &StageAssignment) -> SgdConfig {
    match &a.spec.optimizer {
        Optimizer::Sgd(s) => SgdConfig {
            lr: s.lr as f32,
            momentum: s.momentum as f32,
            weight_decay: s.weight_decay as f32,
        },
        Optimizer::Adam(_) => unreachable!("check refuses adam"),
    }
}

/// Everything that needs no manifest: the spec is valid and supported,
/// the indices and the layer range agree with the spec's shape and the
/// partition, and the stage's in-flight microbatches fit the bound.
pub(crate) fn check(a: &StageAssignment) -> Result<(), Refusal> {
    if a.job.is_empty() || a.job.len() > NAME_BYTES_MAX {
        return Err(invalid(
            "job",
            format!(
                "a job id is 1..={NAME_BYTES_MAX} bytes, got {}",
                a.job.len()
            ),
        ));
    }
    let spec = &a.spec;
    spec.validate()?;
    // The spec's model, or (after a re-partitioning) the checkpoint that
    // generation loads.
    let checkpoint = checkpoint_name(&a.job, a.generation);
    if spec.model != a.model && (a.generation == 0 || a.model != checkpoint) {
        return Err(invalid(
            "model",
            format!(
                "{:?}, but the spec trains {:?} (or, in generation {}, its checkpoint {checkpoint:?})",
                a.model, spec.model, a.generation
            ),
        ));
    }
    if let Optimizer::Adam(_) = spec.optimizer {
        return Err(Refusal::Unsupported {
            what: "optimizer adam".into(),
            instead: "use {\"sgd\": {...}}".into(),
        });
    }
    if let SyncMode::Hetpipe(_) = spec.sync {
        return Err(Refusal::Unsupported {
            what: "sync mode hetpipe".into(),
            instead: "use allreduce, preduce or adpsgd".into(),
        });
    }
    let (p, s) = (spec.pipelines, spec.stages);
    if a.pipeline >= p {
        return Err(invalid(
            "pipeline",
            format!("{} of a job of {p} pipelines", a.pipeline),
        ));
    }
    if a.stage >= s {
        return Err(invalid(
            "stage",
            format!("{} of a job of {s} stages", a.stage),
        ));
    }
    if a.partition.len() != s as usize || a.partition.contains(&0) {
        return Err(invalid(
            "partition",
            format!(
                "{:?}: needs {s} entries (one per stage), each at least 1",
                a.partition
            ),
        ));
    }
    let want = &layer_ranges(&a.partition)[a.stage as usize];
    if a.layers.first != want.start || a.layers.end != want.end {
        return Err(invalid(
            "layers",
            format!(
                "[{}, {}), but partition {:?} gives stage {} layers [{}, {})",
                a.layers.first, a.layers.end, a.partition, a.stage, want.start, want.end
            ),
        ));
    }
    let in_flight = in_flight_max(s, a.stage, spec.microbatches);
    if in_flight as usize > STAGE_MICROBATCHES_IN_FLIGHT_MAX {
        return Err(invalid(
            "spec.stages",
            format!(
                "1F1B keeps {in_flight} microbatches in flight at stage {} of {s}, more than a \
                 stage holds (STAGE_MICROBATCHES_IN_FLIGHT_MAX = \
                 {STAGE_MICROBATCHES_IN_FLIGHT_MAX}); use fewer stages",
                a.stage
            ),
        ));
    }
    if a.start_iteration >= spec.iterations {
        return Err(invalid(
            "start_iteration",
            format!(
                "{}: the job runs {} iterations, none is left",
                a.start_iteration, spec.iterations
            ),
        ));
    }
    let hetero = spec.interference.hetero_s;
    if hetero > HETERO_S_LIMIT.as_secs_f64() {
        return Err(invalid(
            "spec.interference.hetero_s",
            format!(
                "{hetero} s: a straggler's sleep must stay under HETERO_S_LIMIT = {:?}, or its \
                 neighbours' stage links time out",
                HETERO_S_LIMIT
            ),
        ));
    }
    Ok(())
}

/// The assignment against the model it trains: the partition covers the
/// manifest's layers exactly.
pub(crate) fn check_layers(a: &StageAssignment, m: &Manifest) -> Result<(), Refusal> {
    let total: u64 = a.partition.iter().map(|&n| u64::from(n)).sum();
    if total != m.layers.len() as u64 {
        return Err(invalid(
            "partition",
            format!(
                "{:?} covers {total} layers; model {} (catalog version {}) has {}: the \
                 layer range [{}, {}) is not a stage of this model",
                a.partition,
                m.name,
                a.catalog_version,
                m.layers.len(),
                a.layers.first,
                a.layers.end
            ),
        ));
    }
    Ok(())
}

/// The peers a `TrainStageStart` names, checked against the worker's
/// assignment: `prev` and `next` are the neighbours of its pipeline (none
/// at the ends), `replicas` this stage of every pipeline in order, this
/// worker included.
pub(crate) fn check_peers(
    a: &StageAssignment,
    prev: Option<&DataPeer>,
    next: Option<&DataPeer>,
    replicas: &[DataPeer],
) -> Result<(), Refusal> {
    let (p, s) = (a.spec.pipelines, a.spec.stages);
    let expect =
        |field: &'static str, peer: Option<&DataPeer>, want: Option<(u32, u32)>| match (peer, want)
        {
            (None, None) => Ok(()),
            (Some(d), Some((pipeline, stage)))
                if d.pipeline == pipeline
                    && d.stage == stage
                    && d.worker == pipeline * s + stage =>
            {
                Ok(())
            }
            (got, want) => Err(invalid(
                field,
                format!(
                    "{}, expected {}",
                    got.map_or("none".into(), |d| format!(
                        "pipeline {} stage {} worker {}",
                        d.pipeline, d.stage, d.worker
                    )),
                    want.map_or("none".into(), |(q, t)| format!(
                        "pipeline {q} stage {t} worker {}",
                        q * s + t
                    ))
                ),
            )),
        };
    expect(
        "prev",
        prev,
        (a.stage > 0).then(|| (a.pipeline, a.stage - 1)),
    )?;
    expect(
        "next",
        next,
        (a.stage + 1 < s).then(|| (a.pipeline, a.stage + 1)),
    )?;
    if replicas.len() != p as usize {
        return Err(invalid(
            "replicas",
            format!("{} given, the job has {p} pipelines", replicas.len()),
        ));
    }
    for (q, d) in replicas.iter().enumerate() {
        expect("replicas", Some(d), Some((q as u32, a.stage)))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use distmind_common::proto::{LayerRange, StagePeers};
    use distmind_common::train_spec::JobSpec;

    fn spec(extra: &str) -> JobSpec {
        JobSpec::from_json(&format!(
            r#"{{"name": "t", "model": "m", "optimizer": {{"sgd": {{"lr": 0.1}}}},
                "batch": 8, "microbatches": 4, "pipelines": 2, "stages": 3,
                "iterations": 5{extra}}}"#
        ))
        .unwrap()
    }

    fn assignment(stage: u32, layers: (u32, u32)) -> StageAssignment {
        StageAssignment {
            job: "t-1".into(),
            generation: 1,
            pipeline: 1,
            stage,
            device: 0,
            model: "m".into(),
            catalog_version: 3,
            layers: LayerRange {
                first: layers.0,
                end: layers.1,
            },
            partition: vec![4, 3, 3],
            start_iteration: 0,
            peers: StagePeers::default(),
            spec: Box::new(spec("")),
        }
    }

    fn peer(pipeline: u32, stage: u32) -> DataPeer {
        DataPeer {
            pipeline,
            stage,
            worker: pipeline * 3 + stage,
            data_addr: format!("127.0.0.1:{}", 9000 + pipeline * 3 + stage),
        }
    }

    #[test]
    fn assignments_are_checked_field_by_field() {
        assert_eq!(check(&assignment(1, (4, 7))), Ok(()));
        let err = check(&assignment(1, (3, 7))).unwrap_err();
        assert!(
            err.to_string().contains("layers") && err.to_string().contains("[4, 7)"),
            "{err}"
        );
        assert_eq!(err.code(), ErrorCode::BadRequest);
        let mut a = assignment(1, (4, 7));
        a.spec.optimizer = Optimizer::Adam(distmind_common::train_spec::Adam {
            lr: 0.001,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        });
        let err = check(&a).unwrap_err();
        assert_eq!(err.code(), ErrorCode::Unsupported);
        assert!(err.to_string().contains("adam"), "{err}");
        let mut a = assignment(1, (4, 7));
        a.spec.sync = SyncMode::Hetpipe(Default::default());
        let err = check(&a).unwrap_err();
        assert!(err.to_string().contains("hetpipe") && err.code() == ErrorCode::Unsupported);
        let mut a = assignment(1, (4, 7));
        a.pipeline = 2;
        assert!(check(&a).unwrap_err().to_string().contains("pipeline"));
        let mut a = assignment(1, (4, 7));
        a.start_iteration = 5;
        assert!(check(&a)
            .unwrap_err()
            .to_string()
            .contains("start_iteration"));
        let mut a = assignment(1, (4, 7));
        a.spec.interference.hetero_s = HETERO_S_LIMIT.as_secs_f64() * 2.0;
        assert!(check(&a).unwrap_err().to_string().contains("hetero_s"));
        let mut a = assignment(1, (4, 7));
        a.model = "other".into();
        assert!(check(&a).unwrap_err().to_string().contains("model"));
    }

    #[test]
    fn peers_must_be_the_neighbours_and_every_replica() {
        let a = assignment(1, (4, 7));
        let replicas = [peer(0, 1), peer(1, 1)];
        assert_eq!(
            check_peers(&a, Some(&peer(1, 0)), Some(&peer(1, 2)), &replicas),
            Ok(())
        );
        let err = check_peers(&a, None, Some(&peer(1, 2)), &replicas).unwrap_err();
        assert!(
            err.to_string()
                .contains("prev: none, expected pipeline 1 stage 0"),
            "{err}"
        );
        let err = check_peers(&a, Some(&peer(0, 0)), Some(&peer(1, 2)), &replicas).unwrap_err();
        assert!(err.to_string().contains("prev"), "{err}");
        let err =
            check_peers(&a, Some(&peer(1, 0)), Some(&peer(1, 2)), &replicas[..1]).unwrap_err();
        assert!(err.to_string().contains("replicas"), "{err}");
        let swapped = [peer(1, 1), peer(0, 1)];
        assert!(check_peers(&a, Some(&peer(1, 0)), Some(&peer(1, 2)), &swapped).is_err());
        let last = assignment(2, (7, 10));
        assert!(check_peers(&last, Some(&peer(1, 1)), None, &[peer(0, 2), peer(1, 2)]).is_ok());
        assert!(check_peers(
            &last,
            Some(&peer(1, 1)),
            Some(&peer(1, 2)),
            &[peer(0, 2), peer(1, 2)]
        )
        .is_err());
    }
}
