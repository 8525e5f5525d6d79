//! Distributed training jobs through a real controller: `distmind train
//! submit|status|stop` against a controller, a memory server and a GPU
//! server on loopback, a tiny model deployed; stage workers played by the
//! test over the real protocol (the runtime side of workers comes later).

mod support;

use std::path::Path;
use std::time::Duration;

use distmind_common::proto::{ControllerReply, ControllerRequest, ErrorCode, TrainJobState};
use distmind_common::train_spec::JobSpec;
use distmind_controller::ControllerClient;
use distmind_models::Package;
use support::*;

/// `distmind train <args> --settings S --controller C`.
fn train(controller: &str, args: &[&str]) -> (bool, String, String) {
    let s = settings_dir();
    let mut all = vec!["train"];
    all.extend_from_slice(args);
    all.extend_from_slice(&[
        "--settings",
        s.to_str().unwrap(),
        "--controller",
        controller,
    ]);
    run(&all)
}

fn spec_json(name: &str, model: &str, extra: &str) -> String {
    format!(
        r#"{{"name": "{name}", "model": "{model}", "optimizer": {{"sgd": {{"lr": 0.05, "momentum": 0.9}}}},
            "batch": 4, "microbatches": 2, "pipelines": 1, "stages": 2, "iterations": 3{extra}}}"#
    )
}

fn write(dir: &Path, name: &str, text: &str) -> String {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p.to_str().unwrap().to_string()
}

#[test]
fn jobs_are_submitted_refused_reported_and_stopped() {
    let tmp = tempfile::tempdir().unwrap();
    let pkgs = gen_tiny(tmp.path(), "resnet152", 1, 64 << 10);
    let pkg = Package::open(&pkgs[0]).unwrap();
    let model = pkg.manifest.name.clone();
    let layers = pkg.manifest.layers.len();
    let controller = spawn_controller();
    let _ms = spawn_memserver(&controller.addr, "32MiB");
    wait_alive(&controller.addr, 1);
    let (ok, _, stderr) = deploy(&controller.addr, &[], &pkgs);
    assert!(ok, "{stderr}");
    let runtime = spawn_runtime(&controller.addr, &["--devices", "0,1", "--cache", "64MiB"]);
    let rt = wait_runtime_alive(&controller.addr, &runtime.addr);
    let key = cluster_key();
    let mut c = ControllerClient::connect(&controller.addr, &key, Duration::from_secs(5)).unwrap();

    // A good spec: placed on the runtime's two devices at once.
    let good = write(tmp.path(), "good.json", &spec_json("tiny", &model, ""));
    let (ok, stdout, stderr) = train(&controller.addr, &["submit", "--spec", &good]);
    assert!(ok, "submit failed: {stderr}");
    let id = stdout
        .lines()
        .next()
        .and_then(|l| l.strip_prefix("submitted "))
        .unwrap_or_else(|| panic!("no job id in {stdout:?}"))
        .to_string();
    assert_eq!(id, "tiny-1");
    assert!(stdout.contains("tiny-1  placing"), "{stdout}");
    let (ok, stdout, stderr) = train(&controller.addr, &["status"]);
    assert!(ok, "{stderr}");
    assert!(
        stdout.contains(&format!("tiny-1  placing  model {model} ({layers} layers)")),
        "{stdout}"
    );
    assert!(
        stdout.contains(&format!("{} {}", rt.id, runtime.addr)),
        "the placement names the runtime: {stdout}"
    );
    let half = layers.div_ceil(2);
    assert!(
        stdout.contains(&format!("0..{half}")) && stdout.contains(&format!("{half}..{layers}")),
        "{stdout}"
    );

    // Inconsistent specs are refused, naming the field.
    let cases = [
        (
            "sum.json",
            spec_json("bad", &model, r#", "partition": [20, 20]"#),
            format!("partition = [20, 20] (sum 40): must sum to the model's {layers} layers"),
        ),
        (
            "ring.json",
            spec_json("bad", &model, r#", "sync": {"ring": {}}"#),
            "sync.ring: unknown variant `ring`".to_string(),
        ),
        (
            "huge.json",
            spec_json("bad", &model, "")
                .replace(
                    r#""pipelines": 1, "stages": 2"#,
                    r#""pipelines": 64, "stages": 16"#,
                )
                .replace(
                    r#""batch": 4, "microbatches": 2"#,
                    r#""batch": 16, "microbatches": 16"#,
                ),
            "pipelines x stages = 64 x 16 = 1024".to_string(),
        ),
    ];
    for (file, text, says) in &cases {
        let path = write(tmp.path(), file, text);
        let (ok, stdout, stderr) = train(&controller.addr, &["submit", "--spec", &path]);
        assert!(!ok, "{file} was accepted: {stdout}");
        assert!(stderr.contains(says.as_str()), "{file}: {stderr}");
    }
    // The controller checks specs itself too (other clients than the CLI).
    let mut huge: JobSpec = serde_json::from_str(&cases[2].1).unwrap();
    huge.name = "raw".into();
    let e = c
        .request(&ControllerRequest::TrainSubmit {
            spec: Box::new(huge),
        })
        .unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::BadRequest));
    assert!(
        e.to_string().contains("pipelines x stages = 64 x 16"),
        "{e}"
    );
    let mut unknown: JobSpec = serde_json::from_str(&spec_json("raw", "nope", "")).unwrap();
    unknown.name = "raw".into();
    let e = c
        .request(&ControllerRequest::TrainSubmit {
            spec: Box::new(unknown),
        })
        .unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::UnknownModel), "{e}");

    // The test plays the two stage workers.
    let report = |c: &mut ControllerClient, stage: u32, iteration: u64| match c
        .request(&ControllerRequest::TrainReport {
            job: id.clone(),
            pipeline: 0,
            stage,
            iteration,
            fwd_bwd_s: 0.02,
            loss: (stage == 1).then_some(2.25),
            samples: 4,
        })
        .unwrap()
    {
        ControllerReply::TrainReported { state, stop, .. } => (state, stop),
        r => panic!("{r:?}"),
    };
    assert_eq!(report(&mut c, 0, 1), (TrainJobState::Placing, false));
    assert_eq!(report(&mut c, 1, 1), (TrainJobState::Running, false));
    let (ok, stdout, stderr) = train(&controller.addr, &["status", "--job", &id]);
    assert!(ok, "{stderr}");
    assert!(
        stdout.contains("tiny-1  running") && stdout.contains("iteration 1/3"),
        "{stdout}"
    );
    assert!(stdout.contains("2.2500"), "the last stage's loss: {stdout}");

    // Stop: stopping until both workers heard it in a reply.
    let (ok, stdout, stderr) = train(&controller.addr, &["stop", "--job", &id]);
    assert!(ok, "{stderr}");
    assert!(stdout.starts_with("tiny-1: stopping"), "{stdout}");
    assert_eq!(report(&mut c, 0, 2), (TrainJobState::Stopping, true));
    assert_eq!(report(&mut c, 1, 2), (TrainJobState::Stopped, true));
    let (ok, stdout, stderr) = train(&controller.addr, &["status", "--job", &id, "--json"]);
    assert!(ok, "{stderr}");
    let jobs: Vec<serde_json::Value> = serde_json::from_str(&stdout).unwrap();
    assert_eq!(jobs[0]["state"], "stopped", "{stdout}");
    let (ok, _, stderr) = train(&controller.addr, &["stop", "--job", &id]);
    assert!(
        !ok && stderr.contains("job tiny-1 is stopped: cannot stop"),
        "{stderr}"
    );
    let (ok, _, stderr) = train(&controller.addr, &["status", "--job", "nope-7"]);
    assert!(
        !ok && stderr.contains("no training job \"nope-7\""),
        "{stderr}"
    );
}

#[test]
fn the_train_command_keeps_its_steps_and_explains_its_subcommands() {
    let (ok, stdout, _) = run(&["train", "--help"]);
    assert!(ok);
    for word in ["submit", "status", "stop", "--model", "--writeback"] {
        assert!(stdout.contains(word), "train --help lacks {word}: {stdout}");
    }
    let (ok, stdout, _) = run(&["train", "submit", "--help"]);
    assert!(
        ok && stdout.contains("--spec") && stdout.contains("--slowdown"),
        "{stdout}"
    );
    // Without a subcommand, --model is required as before.
    let (ok, _, stderr) = run(&["train"]);
    assert!(!ok && stderr.contains("--model"), "{stderr}");
    // A step's flags and a subcommand do not mix.
    let (ok, _, stderr) = run(&["train", "--model", "x", "status"]);
    assert!(!ok, "{stderr}");
}
