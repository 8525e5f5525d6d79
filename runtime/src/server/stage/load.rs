//! A stage worker's setup, on its own thread (never a connection's task
//! nor a device's worker): the model's catalog entry at (at least) the
//! assignment's version from the runtime's plan catalog, its bytes brought
//! into the host cache over the DistMind data path (the fetch engine; the
//! cache fills whole models, so the whole model comes, and a model already
//! cached is not fetched again), the stage's params copied out of the
//! groups its layers use ([`StageModel::from_groups`]; the cache pin is
//! dropped right after), and the worker's data listener bound on the
//! runtime's listen address, port 0.

use std::net::SocketAddr;
use std::sync::Arc;

use distmind_common::proto::{train_job_key, ErrorCode, ErrorReply, StageAssignment};
use distmind_common::train_spec::DataSource;

use super::assignment::check_layers;
use super::checkpoint::layer_checksums;
use super::data::Synthetic;
use super::routing::StageCompute;
use super::schedule::in_flight_max;
use super::StageConfig;
use crate::dist::{DistListener, WorkerIdentity};
use crate::pipeline::cache_in;
use crate::server::worker::pipeline_error_reply;
use crate::server::Core;
use crate::train::{Precision, StageModel};

/// A loaded stage, ready for its links.
pub(crate) struct Loaded {
    pub compute: StageCompute,
    pub data: Synthetic,
    pub listener: Arc<DistListener>,
    /// `host:port` of the listener, as peers dial it.
    pub data_addr: String,
    /// The catalog version loaded (at least the assignment's).
    pub version: u64,
    /// Per layer, the checksum of the params loaded.
    pub layer_checksums: Vec<u64>,
}

/// `host:port`, bracketing an IPv6 host.
pub(crate) fn host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// Loads the stage of `a` for the runtime's device `a.device`; the error
/// is the reply to its `TrainStage` (`id`).
pub(crate) fn load(
    core: &Core,
    config: &StageConfig,
    id: u64,
    a: &StageAssignment,
) -> Result<Loaded, ErrorReply> {
    let who = format!(
        "request {id}: job {} pipeline {} stage {}",
        a.job, a.pipeline, a.stage
    );
    let plan = core
        .catalog
        .resolve(&a.model, Some(a.catalog_version))
        .map_err(|e| ErrorReply::new(e.code, format!("{who}: {}", e.message)))?;
    let m = &plan.manifest;
    check_layers(a, m).map_err(|e| ErrorReply::new(e.code(), format!("{who}: {e}")))?;
    let (cached, _, _) = cache_in(&core.cache, &plan.entry, m, &core.pipeline)
        .map_err(|e| pipeline_error_reply(core, id, &a.model, &e))?;
    let layers = a.layers.first as usize..a.layers.end as usize;
    let mut model = StageModel::from_groups(m, layers, |g| cached.group(g), Precision::F32)
        .map_err(|e| ErrorReply::new(ErrorCode::BadRequest, format!("{who}: {e}")))?;
    drop(cached);
    let layer_checksums = layer_checksums(&model).map_err(|e| {
        ErrorReply::new(ErrorCode::Internal, format!("{who}: layer checksums: {e}"))
    })?;
    let spec = &a.spec;
    model
        .set_in_flight_limit(in_flight_max(spec.stages, a.stage, spec.microbatches) as usize)
        .map_err(|e| ErrorReply::new(ErrorCode::BadRequest, format!("{who}: {e}")))?;
    let compute = StageCompute::new(model)
        .map_err(|e| ErrorReply::new(ErrorCode::BadRequest, format!("{who}: {e}")))?;
    let DataSource::Synthetic(synthetic) = &spec.data;
    let rows = (spec.batch / spec.microbatches) as usize;
    let data = Synthetic::new(m, synthetic.seed, a.pipeline, rows).map_err(|why| {
        ErrorReply::new(
            ErrorCode::BadRequest,
            format!("{who}: synthetic data: {why}"),
        )
    })?;
    let identity = WorkerIdentity {
        job: train_job_key(&a.job),
        worker: a.pipeline * spec.stages + a.stage,
        pipeline: a.pipeline,
        stage: a.stage,
    };
    let bind = SocketAddr::new(config.bind_ip, 0);
    let listener = DistListener::bind(bind, config.key.clone(), identity).map_err(|e| {
        ErrorReply::new(
            ErrorCode::Internal,
            format!("{who}: cannot bind the data listener on {bind}: {e}"),
        )
    })?;
    let data_addr = host_port(&config.data_host, listener.local_addr().port());
    Ok(Loaded {
        compute,
        data,
        listener: Arc::new(listener),
        data_addr,
        version: plan.version,
        layer_checksums,
    })
}
