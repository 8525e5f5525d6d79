//! `distmind train submit|status|stop`: distributed training jobs, through
//! the controller's metadata port (the address and key come from the
//! settings directory, as for `distmind deploy`).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Subcommand};
use distmind_common::proto::{ControllerReply, ControllerRequest, TrainJobState, TrainJobStatus};
use distmind_common::train_spec::{JobSpec, Slowdown, SPEC_BYTES_MAX};
use distmind_controller::ControllerClient;

use crate::services;

/// How long a job request may take (connect and reply).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Subcommand, Debug)]
pub enum JobCommand {
    /// Submit a distributed training job: P pipelines x S stages of a deployed model, placed by
    /// the controller on GPUs the inference policy leaves idle. The spec is JSON (every field:
    /// settings/README.md, "Training job specs"; examples: settings/train_*.json); an
    /// inconsistent spec is refused naming the field. Prints the job id and where each stage runs.
    Submit(SubmitArgs),
    /// Show training jobs: state (pending, placing, running, repartitioning, stopping, stopped,
    /// failed with the stage and why, finished), the partition, and per stage where it runs,
    /// its iteration, loss, throughput and last report.
    Status(StatusArgs),
    /// Stop a training job: a pending one at once; a running one as its workers finish their
    /// iteration.
    Stop(StopArgs),
    /// Simulate a job on a virtual clock at any scale (no cluster): the controller's own sync-group
    /// schedulers, 1F1B simulator, straggler monitor and re-partitioner, layer times from a GPU
    /// profile, links at one rate. Prints samples/s, the groups and any re-partitioning.
    Simulate(crate::simulate::train::TrainSimArgs),
}

/// Where the controller is.
#[derive(Args, Debug)]
pub struct ControllerAt {
    /// Settings directory (cluster.key; storage_list.txt for the controller's address).
    #[arg(long, default_value = "settings")]
    pub settings: PathBuf,
    /// Controller metadata address (default: first line of storage_list.txt).
    #[arg(long)]
    pub controller: Option<String>,
}

#[derive(Args, Debug)]
pub struct SubmitArgs {
    #[command(flatten)]
    pub at: ControllerAt,
    /// The job spec (JSON).
    #[arg(long)]
    pub spec: PathBuf,
    /// Interference: each step of every stage sleeps this many seconds with probability
    /// interference.hetero_p (SD-Pipe's --hetero); overrides the spec's interference.hetero_s.
    #[arg(long, value_name = "SECONDS")]
    pub hetero: Option<f64>,
    /// Interference: from iteration ITER on, STAGE computes FACTOR times slower (in every
    /// pipeline, or PIPELINE/STAGE:FACTOR@ITER in one); repeatable, added to the spec's
    /// interference.slowdowns.
    #[arg(long, value_name = "STAGE:FACTOR@ITER")]
    pub slowdown: Vec<Slowdown>,
    /// Print the controller's reply as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct StatusArgs {
    #[command(flatten)]
    pub at: ControllerAt,
    /// One job (its id, as submit printed it); default: every job the controller keeps.
    #[arg(long)]
    pub job: Option<String>,
    /// Print the jobs as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct StopArgs {
    #[command(flatten)]
    pub at: ControllerAt,
    /// The job's id.
    #[arg(long)]
    pub job: String,
}

pub fn run(cmd: &JobCommand) -> anyhow::Result<()> {
    match cmd {
        JobCommand::Simulate(a) => crate::simulate::train::run(a),
        JobCommand::Submit(a) => {
            let spec = load_spec(&a.spec, a.hetero, &a.slowdown)?;
            let reply = request(
                &a.at,
                ControllerRequest::TrainSubmit {
                    spec: Box::new(spec),
                },
            )
            .with_context(|| format!("submitting {}", a.spec.display()))?;
            let ControllerReply::TrainSubmitted { job } = reply else {
                anyhow::bail!("the controller answered a submit with {reply:?}");
            };
            if a.json {
                println!("{}", serde_json::to_string_pretty(&job)?);
            } else {
                println!("submitted {}", job.id);
                print!("{}", render_jobs(std::slice::from_ref(&job)));
            }
            Ok(())
        }
        JobCommand::Status(a) => {
            let reply = request(&a.at, ControllerRequest::TrainStatus { job: a.job.clone() })?;
            let ControllerReply::TrainJobs { jobs } = reply else {
                anyhow::bail!("the controller answered a status request with {reply:?}");
            };
            if a.json {
                println!("{}", serde_json::to_string_pretty(&jobs)?);
            } else if jobs.is_empty() {
                println!("no training jobs");
            } else {
                print!("{}", render_jobs(&jobs));
            }
            Ok(())
        }
        JobCommand::Stop(a) => {
            let reply = request(&a.at, ControllerRequest::TrainStop { job: a.job.clone() })?;
            let ControllerReply::TrainStopped { job } = reply else {
                anyhow::bail!("the controller answered a stop with {reply:?}");
            };
            match job.state {
                TrainJobState::Stopping => println!(
                    "{}: stopping (each worker stops at the end of its iteration)",
                    job.id
                ),
                _ => println!("{}: {}", job.id, job.state.name()),
            }
            Ok(())
        }
    }
}

/// Reads, parses and checks a spec file, with the command line's
/// interference knobs applied.
pub fn load_spec(
    path: &Path,
    hetero: Option<f64>,
    slowdowns: &[Slowdown],
) -> anyhow::Result<JobSpec> {
    let len = std::fs::metadata(path)
        .with_context(|| format!("cannot read the spec {}", path.display()))?
        .len();
    anyhow::ensure!(
        len <= SPEC_BYTES_MAX as u64,
        "{}: {len} bytes, more than a spec's {SPEC_BYTES_MAX}",
        path.display()
    );
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the spec {}", path.display()))?;
    let mut spec = JobSpec::from_json(&text).with_context(|| path.display().to_string())?;
    if let Some(h) = hetero {
        spec.interference.hetero_s = h;
    }
    spec.interference.slowdowns.extend_from_slice(slowdowns);
    spec.validate()
        .with_context(|| path.display().to_string())?;
    Ok(spec)
}

fn request(at: &ControllerAt, req: ControllerRequest) -> anyhow::Result<ControllerReply> {
    let settings = services::load_settings(&at.settings)?;
    let addr = at
        .controller
        .clone()
        .unwrap_or_else(|| settings.metadata_endpoint().to_string());
    let key = services::cluster_key(&settings);
    let mut c = ControllerClient::connect(&addr, &key, REQUEST_TIMEOUT)?;
    Ok(c.request(&req)?)
}

/// Jobs as a readable report: a line per job, what it waits for or why it
/// failed, and a table of its stages.
pub fn render_jobs(jobs: &[TrainJobStatus]) -> String {
    let mut out = String::new();
    for j in jobs {
        let s = &j.spec;
        let iter_done = j.stages.iter().filter_map(|st| st.iteration).min();
        let _ = writeln!(
            out,
            "{}  {}  model {} ({} layers)  {} x {} (pipelines x stages)  sync {}{}  iteration {}/{}  \
             partition {:?} (generation {})  {} in this state",
            j.id,
            j.state.name(),
            s.model,
            j.layers,
            s.pipelines,
            s.stages,
            s.sync.name(),
            if s.dynamic.enabled { ", dynamic" } else { "" },
            iter_done.map_or_else(|| "-".into(), |i| i.to_string()),
            s.iterations,
            j.partition,
            j.generation,
            ago(j.state_ms_ago),
        );
        if let Some(w) = &j.waiting {
            let _ = writeln!(out, "  waiting: {w}");
        }
        if j.group_asks_waiting > 0 {
            let _ = writeln!(
                out,
                "  sync: {} workers wait for their group",
                j.group_asks_waiting
            );
        }
        if let TrainJobState::Failed {
            pipeline,
            stage,
            reason,
        } = &j.state
        {
            let _ = writeln!(out, "  failed: pipeline {pipeline} stage {stage}: {reason}");
        }
        if let Some(d) = &j.repartition {
            let ratios: Vec<String> = d.ratios.iter().map(|r| format!("{r:.2}")).collect();
            let _ = writeln!(
                out,
                "  dynpipe: re-partition {:?} -> {:?} before iteration {} (decided at {}, generation {}; \
                 stage ratios [{}], stragglers {:?}); predicted {:.6} s per microbatch, now {:.6} s; \
                 layer costs by {}",
                d.old_partition,
                d.new_partition,
                d.at_iteration,
                d.decided_at_iteration,
                d.generation,
                ratios.join(", "),
                d.stragglers,
                d.predicted_s_per_microbatch,
                d.current_s_per_microbatch,
                d.layer_costs,
            );
        }
        if let Some(c) = &j.checkpoint {
            let hex = |v: Option<u64>| v.map_or_else(|| "-".to_string(), |v| format!("{v:016x}"));
            let loaded: Vec<String> = c.loaded.iter().map(|&v| hex(v)).collect();
            let _ = writeln!(
                out,
                "  checkpoint: {} (catalog version {}) of generation {} after iteration {}; \
                 params written {}, loaded [{}]",
                c.model,
                c.catalog_version
                    .map_or_else(|| "-".to_string(), |v| v.to_string()),
                c.generation,
                c.after_iteration,
                hex(c.written),
                loaded.join(", "),
            );
        }
        match &j.last_checkpoint {
            Some(c) => {
                let _ = writeln!(
                    out,
                    "  last checkpoint: {c} of generation {}; params written {:016x}",
                    c.generation, c.written
                );
            }
            None if s.checkpoint_every.is_some() => {
                let _ = writeln!(
                    out,
                    "  last checkpoint: none yet (every {} iterations)",
                    s.checkpoint_every.unwrap_or(0)
                );
            }
            None => {}
        }
        let mut rows = vec![[
            "pipeline",
            "stage",
            "layers",
            "runtime",
            "device",
            "use",
            "iter",
            "loss",
            "samples/s",
            "fwd+bwd s",
            "last report",
        ]
        .map(String::from)];
        let dash = || "-".to_string();
        for st in &j.stages {
            let p = st.placement.as_ref();
            rows.push([
                st.pipeline.to_string(),
                st.stage.to_string(),
                format!("{}..{}", st.layers.first, st.layers.end),
                p.map_or_else(dash, |p| format!("{} {}", p.runtime, p.addr)),
                p.map_or_else(dash, |p| p.device.to_string()),
                p.map_or_else(dash, |p| p.usage.as_str().to_string()),
                st.iteration.map_or_else(dash, |i| i.to_string()),
                st.loss.map_or_else(dash, |l| format!("{l:.4}")),
                st.samples_per_s.map_or_else(dash, |r| format!("{r:.1}")),
                st.fwd_bwd_s.map_or_else(dash, |t| format!("{t:.3}")),
                st.last_report_ms_ago
                    .map_or_else(dash, |ms| format!("{} ago", ago(ms))),
            ]);
        }
        let widths: Vec<usize> = (0..rows[0].len())
            .map(|c| rows.iter().map(|r| r[c].len()).max().unwrap_or(0))
            .collect();
        for r in &rows {
            let line: Vec<String> = r
                .iter()
                .zip(&widths)
                .map(|(cell, &w)| format!("{cell:<w$}"))
                .collect();
            let _ = writeln!(out, "  {}", line.join("  ").trim_end());
        }
    }
    out
}

fn ago(ms: u64) -> String {
    if ms < 1000 {
        format!("{ms} ms")
    } else {
        format!("{:.1} s", ms as f64 / 1000.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use distmind_common::proto::{
        DeviceUse, LastCheckpoint, LayerRange, RepartitionDecision, StagePlacement, StageStatus,
    };

    fn job(state: TrainJobState, waiting: Option<&str>) -> TrainJobStatus {
        let spec = JobSpec::from_json(
            r#"{"name": "r", "model": "resnet152-tiny-00000000", "optimizer": {"sgd": {"lr": 0.1}},
                "batch": 8, "microbatches": 2, "pipelines": 1, "stages": 2, "iterations": 20}"#,
        )
        .unwrap();
        let stage = |s: u32, reported: bool| StageStatus {
            pipeline: 0,
            stage: s,
            layers: LayerRange {
                first: s * 28,
                end: if s == 0 { 28 } else { 55 },
            },
            placement: Some(StagePlacement {
                runtime: 0,
                addr: "127.0.0.1:40001".into(),
                device: s,
                usage: DeviceUse::Idle,
            }),
            iteration: reported.then_some(5),
            loss: (reported && s == 1).then_some(2.25),
            samples_per_s: reported.then_some(12.25),
            fwd_bwd_s: reported.then_some(0.0304),
            last_report_ms_ago: reported.then_some(1500),
            reports: u64::from(reported) * 5,
        };
        TrainJobStatus {
            id: "r-1".into(),
            state,
            waiting: waiting.map(String::from),
            spec: Box::new(spec),
            layers: 55,
            catalog_version: 3,
            partition: vec![28, 27],
            generation: 0,
            submitted_ms_ago: 4000,
            state_ms_ago: 250,
            stages: vec![stage(0, true), stage(1, true)],
            group_asks_waiting: 0,
            repartition: None,
            checkpoint: None,
            last_checkpoint: None,
        }
    }

    #[test]
    fn status_is_a_readable_table() {
        let text = render_jobs(&[job(TrainJobState::Running, None)]);
        let want = "\
r-1  running  model resnet152-tiny-00000000 (55 layers)  1 x 2 (pipelines x stages)  sync allreduce  iteration 5/20  partition [28, 27] (generation 0)  250 ms in this state
  pipeline  stage  layers  runtime            device  use   iter  loss    samples/s  fwd+bwd s  last report
  0         0      0..28   0 127.0.0.1:40001  0       idle  5     -       12.2       0.030      1.5 s ago
  0         1      28..55  0 127.0.0.1:40001  1       idle  5     2.2500  12.2       0.030      1.5 s ago
";
        assert_eq!(text, want, "\n{text}");
        let failed = TrainJobState::Failed {
            pipeline: 0,
            stage: 1,
            reason: "its GPU server, runtime 0 (127.0.0.1:40001), device 1: restarted".into(),
        };
        let text = render_jobs(&[
            job(failed, None),
            job(TrainJobState::Pending, Some("needs 2 GPUs")),
        ]);
        assert!(
            text.contains("\n  failed: pipeline 0 stage 1: its GPU server, runtime 0 (127.0.0.1:40001), device 1: restarted\n"),
            "{text}"
        );
        assert!(text.contains("r-1  pending"), "{text}");
        assert!(text.contains("\n  waiting: needs 2 GPUs\n"), "{text}");
        let mut decided = job(TrainJobState::Running, None);
        decided.repartition = Some(RepartitionDecision {
            generation: 0,
            decided_at_iteration: 150,
            at_iteration: 210,
            ratios: vec![1.0, 3.0],
            stragglers: vec![1],
            old_partition: vec![28, 27],
            new_partition: vec![36, 19],
            predicted_s_per_microbatch: 0.0123,
            current_s_per_microbatch: 0.03,
            layer_costs: "flops".into(),
        });
        let text = render_jobs(&[decided]);
        assert!(
            text.contains(
                "\n  dynpipe: re-partition [28, 27] -> [36, 19] before iteration 210 (decided at 150, \
                 generation 0; stage ratios [1.00, 3.00], stragglers [1]); predicted 0.012300 s per \
                 microbatch, now 0.030000 s; layer costs by flops\n"
            ),
            "{text}"
        );
        let mut every = job(TrainJobState::Running, None);
        every.spec.checkpoint_every = Some(4);
        let text = render_jobs(&[every.clone()]);
        assert!(
            text.contains("\n  last checkpoint: none yet (every 4 iterations)\n"),
            "{text}"
        );
        every.last_checkpoint = Some(LastCheckpoint {
            model: "r-1-ckpt".into(),
            catalog_version: 12,
            generation: 0,
            iteration: 4,
            written: 0xab,
            group_checksums: vec!["01".into(), "02".into()],
        });
        let text = render_jobs(&[every]);
        assert!(
            text.contains(
                "\n  last checkpoint: r-1-ckpt (catalog version 12) after iteration 4 of \
                 generation 0; params written 00000000000000ab\n"
            ),
            "{text}"
        );
    }

    #[test]
    fn a_spec_file_is_checked_with_the_command_line_knobs() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("spec.json");
        let shipped = Path::new(env!("CARGO_MANIFEST_DIR")).join("settings/train_tiny.json");
        std::fs::copy(&shipped, &path).unwrap();
        let slow: Slowdown = "1:2.5@10".parse().unwrap();
        let spec = load_spec(&path, Some(0.5), std::slice::from_ref(&slow)).unwrap();
        assert_eq!(spec.interference.hetero_s, 0.5);
        assert_eq!(spec.interference.slowdowns, vec![slow]);
        // A knob the spec cannot take is refused naming the field and the file.
        let e = load_spec(&path, None, &["5:2@1".parse().unwrap()]).unwrap_err();
        let e = format!("{e:#}");
        assert!(
            e.contains("spec.json: training spec: interference.slowdowns[0].stage = 5"),
            "{e}"
        );
        std::fs::write(&path, r#"{"name": "x", "sync": {"ring": {}}}"#).unwrap();
        let e = format!("{:#}", load_spec(&path, None, &[]).unwrap_err());
        assert!(
            e.contains("training spec: sync.ring: unknown variant `ring`"),
            "{e}"
        );
    }
}
