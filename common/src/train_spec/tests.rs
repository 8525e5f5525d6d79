//! The spec's parsing, every validation rule, and the shipped examples.

use super::*;

/// A good CNN spec: resnet152, 2 pipelines x 4 stages, SD-Pipe's partial
/// reduce, DynPipe on.
const CNN: &str = r#"{
  "name": "resnet-dp",
  "model": "resnet152-alter-1-00000000",
  "optimizer": {"sgd": {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-4}},
  "batch": 64,
  "microbatches": 8,
  "pipelines": 2,
  "stages": 4,
  "partition": [128, 129, 129, 129],
  "sync": {"preduce": {"wait_ms_initial": 50, "ssp_bound": 4}},
  "dynamic": {"enabled": true},
  "data": {"synthetic": {"seed": 7}},
  "iterations": 1000,
  "interference": {"hetero_s": 0.5, "slowdowns": [{"stage": 2, "factor": 3.0, "at_iteration": 200}]},
  "checkpoint_every": 100
}"#;

/// A good transformer spec with only the required fields.
const TRANSFORMER: &str = r#"{
  "name": "gpt2.small_1",
  "model": "gpt2-tiny-00000000",
  "optimizer": {"adam": {"lr": 3e-4}},
  "batch": 8,
  "microbatches": 4,
  "pipelines": 1,
  "stages": 2,
  "iterations": 10
}"#;

fn cnn() -> JobSpec {
    JobSpec::from_json(CNN).unwrap()
}

fn transformer() -> JobSpec {
    JobSpec::from_json(TRANSFORMER).unwrap()
}

#[track_caller]
fn refused(spec: &JobSpec, field: &str, says: &str) {
    match spec.validate() {
        Err(e) => {
            assert_eq!(e.field(), field, "{e}");
            assert!(e.to_string().contains(says), "{e}");
        }
        Ok(()) => panic!("accepted, expected a refusal naming {field}"),
    }
}

#[track_caller]
fn bad_json(text: &str, path: &str, says: &str) {
    match JobSpec::from_json(text) {
        Err(e @ SpecError::Json { .. }) => {
            assert_eq!(e.field(), path, "{e}");
            assert!(e.to_string().contains(says), "{e}");
        }
        other => panic!("expected a JSON error at {path}, got {other:?}"),
    }
}

#[test]
fn good_specs_parse_validate_and_default() {
    let c = cnn();
    c.validate().unwrap();
    assert_eq!(c.partition_for(515).unwrap(), vec![128, 129, 129, 129]);
    assert_eq!(c.sync.name(), "preduce");
    assert!(c.dynamic.enabled);
    assert_eq!(
        c.dynamic.window, 50,
        "unset DynPipe knobs keep their defaults"
    );
    assert_eq!(c.interference.hetero_p, 0.1);

    let t = transformer();
    t.validate().unwrap();
    assert_eq!(t.sync, SyncMode::Allreduce(Allreduce {}));
    assert_eq!(t.dynamic, Dynamic::default());
    assert_eq!(t.data, DataSource::Synthetic(Synthetic { seed: 0 }));
    assert_eq!(t.interference, Interference::default());
    assert_eq!(t.partition_for(24).unwrap(), vec![12, 12]);
    match &t.optimizer {
        Optimizer::Adam(a) => assert_eq!(
            (a.beta1, a.beta2, a.eps, a.weight_decay),
            (0.9, 0.999, 1e-8, 0.0)
        ),
        o => panic!("{o:?}"),
    }
    // What is serialized parses back the same (the wire form).
    for s in [c, t] {
        let text = serde_json::to_string(&s).unwrap();
        assert_eq!(JobSpec::from_json(&text).unwrap(), s);
    }
}

#[test]
fn json_errors_name_the_field_path() {
    bad_json(
        &CNN.replace(r#""preduce": {"#, r#""ring": {"#),
        "sync.ring",
        "unknown variant `ring`",
    );
    bad_json(
        &CNN.replace(r#""ssp_bound": 4"#, r#""ssp_bound": "four""#),
        "sync.preduce.ssp_bound",
        "invalid type: string \"four\"",
    );
    bad_json(
        &CNN.replace(r#""batch": 64"#, r#""batch": 64, "batchsize": 2"#),
        "batchsize",
        "unknown field `batchsize`",
    );
    bad_json(
        &CNN.replace(r#""lr": 0.1, "#, ""),
        "optimizer.sgd",
        "missing field `lr`",
    );
    bad_json(
        &CNN.replace("[128, 129, 129, 129]", "[128, -1, 129, 129]"),
        "partition[1]",
        "invalid value: integer `-1`",
    );
    bad_json(
        &CNN.replace(r#""stage": 2"#, r#""stage": 2, "speed": 1"#),
        "interference.slowdowns[0].speed",
        "unknown field `speed`",
    );
    bad_json(
        &TRANSFORMER.replace(r#"  "iterations": 10"#, r#"  "iters": 10"#),
        "iters",
        "unknown field",
    );
    bad_json(
        &TRANSFORMER.replace(
            r#",
  "iterations": 10"#,
            "",
        ),
        "",
        "missing field `iterations`",
    );
    bad_json(
        &TRANSFORMER.replace(r#"{"adam": {"lr": 3e-4}}"#, r#""adam""#),
        "optimizer",
        "an object keyed by its name",
    );
    bad_json("{\"name\": ", "name", "EOF");
    let e = JobSpec::from_json(&CNN.replace(r#""preduce": {"#, r#""ring": {"#)).unwrap_err();
    assert!(
        e.to_string()
            .starts_with("training spec: sync.ring: unknown variant `ring`, expected one of"),
        "{e}"
    );
    assert!(e.to_string().contains("(line 10, column"), "{e}");
}

#[test]
fn names_and_models() {
    let mut s = transformer();
    for bad in ["", "-x", "a b", "x/y", &"n".repeat(JOB_NAME_BYTES_MAX + 1)] {
        s.name = bad.into();
        refused(&s, "name", "letters, digits");
    }
    s.name = "n".repeat(JOB_NAME_BYTES_MAX);
    s.validate().unwrap();
    s.model = String::new();
    refused(&s, "model", "1..=256 bytes");
}

fn sgd(s: &mut JobSpec) -> &mut Sgd {
    match &mut s.optimizer {
        Optimizer::Sgd(x) => x,
        o => panic!("{o:?}"),
    }
}

#[test]
fn optimizer_hyper_parameters() {
    let mut s = cnn();
    for (lr, ok) in [
        (0.0, false),
        (-1.0, false),
        (f64::NAN, false),
        (LR_MAX, true),
        (1e3, false),
    ] {
        sgd(&mut s).lr = lr;
        if ok {
            s.validate().unwrap();
        } else {
            refused(&s, "optimizer.sgd.lr", "must be in (0, 100]");
        }
    }
    sgd(&mut s).lr = 0.1;
    sgd(&mut s).momentum = 1.0;
    refused(&s, "optimizer.sgd.momentum", "[0, 1)");
    sgd(&mut s).momentum = 0.0;
    sgd(&mut s).weight_decay = -0.1;
    refused(&s, "optimizer.sgd.weight_decay", "[0, 1]");

    let mut t = transformer();
    let base = match &t.optimizer {
        Optimizer::Adam(a) => a.clone(),
        o => panic!("{o:?}"),
    };
    for (f, edit, says) in [
        (
            "optimizer.adam.lr",
            Adam {
                lr: 0.0,
                ..base.clone()
            },
            "(0, 100]",
        ),
        (
            "optimizer.adam.beta1",
            Adam {
                beta1: 1.0,
                ..base.clone()
            },
            "[0, 1)",
        ),
        (
            "optimizer.adam.beta2",
            Adam {
                beta2: -0.5,
                ..base.clone()
            },
            "[0, 1)",
        ),
        (
            "optimizer.adam.eps",
            Adam {
                eps: 0.0,
                ..base.clone()
            },
            "(0, 1]",
        ),
        (
            "optimizer.adam.weight_decay",
            Adam {
                weight_decay: 2.0,
                ..base.clone()
            },
            "[0, 1]",
        ),
    ] {
        t.optimizer = Optimizer::Adam(edit);
        refused(&t, f, says);
    }
}

#[test]
fn pipeline_shape_and_batch() {
    let mut s = cnn();
    s.pipelines = 0;
    refused(&s, "pipelines", "1..=64");
    s.pipelines = PIPELINES_MAX + 1;
    refused(&s, "pipelines", "1..=64");
    s.pipelines = 2;
    s.stages = 0;
    refused(&s, "stages", "1..=64");
    s.stages = STAGES_MAX + 1;
    refused(&s, "stages", "1..=64");
    // 64 x 16 = 1024 > 512.
    s.pipelines = 64;
    s.stages = 16;
    s.microbatches = 16;
    refused(&s, "pipelines x stages", "64 x 16 = 1024");
    s.pipelines = 32;
    s.partition = None;
    s.validate().unwrap();
    s.pipelines = 2;
    s.stages = 4;
    s.microbatches = 8;

    s.batch = 0;
    refused(&s, "batch", "1..=65536");
    s.batch = BATCH_MAX + 1;
    refused(&s, "batch", "1..=65536");
    s.batch = 64;
    s.microbatches = 0;
    refused(&s, "microbatches", "1..=1024");
    s.microbatches = 7;
    refused(&s, "microbatches", "batch 64 is not divisible into 7");
    s.microbatches = 2;
    refused(&s, "microbatches", "microbatches >= stages");
    s.microbatches = 4;
    s.validate().unwrap();
}

#[test]
fn partitions() {
    let mut s = cnn();
    s.partition = Some(vec![128, 129, 258]);
    refused(&s, "partition", "3 entries for stages = 4");
    s.partition = Some(vec![128, 0, 258, 129]);
    refused(&s, "partition[1]", "1..=1048576 layers");
    s.partition = Some(vec![128, 129, 129, 130]);
    s.validate().unwrap();
    let e = s.partition_for(515).unwrap_err();
    assert_eq!(e.field(), "partition");
    assert!(
        e.to_string().contains(
            "(sum 516): must sum to the model's 515 layers (model \"resnet152-alter-1-00000000\")"
        ),
        "{e}"
    );
    let e = s.partition_for(3).unwrap_err();
    assert_eq!(e.field(), "stages");
    assert!(
        e.to_string().contains("has 3 layers: at most 3 stages"),
        "{e}"
    );
    s.partition = None;
    assert_eq!(s.partition_for(515).unwrap(), vec![129, 129, 129, 128]);
    assert_eq!(balanced_partition(4, 4), vec![1; 4]);
    assert_eq!(layer_ranges(&[2, 3, 1]), vec![0..2, 2..5, 5..6]);
    assert!(check_partition(&[1, 2], 2, 3).is_ok());
    assert_eq!(
        check_partition(&[0, 3], 2, 3).unwrap_err().field(),
        "partition[0]"
    );
}

#[test]
fn sync_modes() {
    let mut s = cnn();
    s.sync = SyncMode::Preduce(Preduce {
        wait_ms_initial: Some(PREDUCE_WAIT_MS_MAX + 1),
        ssp_bound: None,
    });
    refused(&s, "sync.preduce.wait_ms_initial", "0..=600000");
    s.sync = SyncMode::Preduce(Preduce {
        wait_ms_initial: None,
        ssp_bound: Some(SSP_BOUND_MAX + 1),
    });
    refused(&s, "sync.preduce.ssp_bound", "0..=1000");
    s.sync = SyncMode::Hetpipe(Hetpipe { push_every: 0 });
    refused(&s, "sync.hetpipe.push_every", "1..=100000");
    s.sync = SyncMode::Hetpipe(Hetpipe::default());
    s.validate().unwrap();
    s.pipelines = 1;
    for mode in [
        SyncMode::Preduce(Preduce::default()),
        SyncMode::Adpsgd(Adpsgd { seed: 3 }),
    ] {
        let name = mode.name();
        s.sync = mode;
        refused(&s, &format!("sync.{name}"), "needs pipelines >= 2");
    }
    s.sync = SyncMode::default();
    s.validate().unwrap();
    let h: JobSpec = JobSpec::from_json(&TRANSFORMER.replace(
        r#""iterations": 10"#,
        r#""iterations": 10, "sync": {"hetpipe": {}}"#,
    ))
    .unwrap();
    assert_eq!(h.sync, SyncMode::Hetpipe(Hetpipe { push_every: 10 }));
}

#[test]
fn dynamic_repartitioning() {
    let mut s = cnn();
    let d = Dynamic::default();
    s.dynamic = Dynamic {
        window: 0,
        ..d.clone()
    };
    refused(&s, "dynamic.window", "1..=100000");
    s.dynamic = Dynamic {
        baseline_at: 10,
        ..d.clone()
    };
    refused(&s, "dynamic.baseline_at", "window (50)");
    s.dynamic = Dynamic {
        threshold_up: 1.0,
        ..d.clone()
    };
    refused(&s, "dynamic.threshold_up", "above 1");
    s.dynamic = Dynamic {
        threshold_down: 1.0,
        ..d.clone()
    };
    refused(&s, "dynamic.threshold_down", "(0, 1)");
    s.dynamic = Dynamic {
        delay: ITERATIONS_MAX + 1,
        ..d.clone()
    };
    refused(&s, "dynamic.delay", "0..=");
    s.dynamic = Dynamic { enabled: true, ..d };
    s.validate().unwrap();
    s.stages = 1;
    s.partition = None;
    refused(&s, "dynamic.enabled", "needs stages >= 2");
}

#[test]
fn iterations_interference_and_checkpoints() {
    let mut s = cnn();
    s.iterations = 0;
    refused(&s, "iterations", "1..=1000000000");
    s.iterations = 1000;
    s.interference.hetero_s = -1.0;
    refused(&s, "interference.hetero_s", "0..=3600");
    s.interference.hetero_s = 0.0;
    s.interference.hetero_p = 1.5;
    refused(&s, "interference.hetero_p", "[0, 1]");
    s.interference.hetero_p = 0.1;
    let good = Slowdown {
        pipeline: Some(1),
        stage: 3,
        factor: 0.5,
        at_iteration: 999,
    };
    s.interference.slowdowns = vec![good.clone()];
    s.validate().unwrap();
    for (edit, field, says) in [
        (
            Slowdown {
                pipeline: Some(2),
                ..good.clone()
            },
            "pipeline",
            "pipelines are 0..2",
        ),
        (
            Slowdown {
                stage: 4,
                ..good.clone()
            },
            "stage",
            "stages are 0..4",
        ),
        (
            Slowdown {
                factor: 0.0,
                ..good.clone()
            },
            "factor",
            "(0, 1000]",
        ),
        (
            Slowdown {
                factor: f64::INFINITY,
                ..good.clone()
            },
            "factor",
            "(0, 1000]",
        ),
        (
            Slowdown {
                at_iteration: 1000,
                ..good.clone()
            },
            "at_iteration",
            "never start",
        ),
    ] {
        s.interference.slowdowns = vec![good.clone(), edit];
        refused(&s, &format!("interference.slowdowns[1].{field}"), says);
    }
    s.interference.slowdowns = vec![good; SLOWDOWNS_MAX + 1];
    refused(&s, "interference.slowdowns", "at most 64");
    s.interference.slowdowns.clear();
    s.checkpoint_every = Some(0);
    refused(&s, "checkpoint_every", "1..=iterations (1000)");
    s.checkpoint_every = Some(1001);
    refused(&s, "checkpoint_every", "1..=iterations");
}

#[test]
fn slowdowns_parse_from_the_command_line_form() {
    assert_eq!(
        "2:3.0@100".parse::<Slowdown>().unwrap(),
        Slowdown {
            pipeline: None,
            stage: 2,
            factor: 3.0,
            at_iteration: 100
        }
    );
    assert_eq!("1/0:0.5@7".parse::<Slowdown>().unwrap().pipeline, Some(1));
    for bad in ["2", "2:3", "x:3@1", "2:y@1", "2:3@z", "p/2:3@1"] {
        let e = bad.parse::<Slowdown>().unwrap_err();
        assert!(e.contains("STAGE:FACTOR@ITER"), "{e}");
    }
}

#[test]
fn oversized_specs_are_refused_before_parsing() {
    let e = JobSpec::from_json(&" ".repeat(SPEC_BYTES_MAX + 1)).unwrap_err();
    assert!(e.to_string().contains("more than 1048576"), "{e}");
}

/// Every `settings/train_*.json` parses and validates; the full-size
/// resnet152 one partitions the package's 515 layers.
#[test]
fn shipped_example_specs_are_valid() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../settings");
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if !(name.starts_with("train_") && name.ends_with(".json")) {
            continue;
        }
        let spec = JobSpec::from_json(&std::fs::read_to_string(&path).unwrap())
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        spec.validate().unwrap_or_else(|e| panic!("{name}: {e}"));
        if spec.model.starts_with("resnet152-alter-1") {
            spec.partition_for(515)
                .unwrap_or_else(|e| panic!("{name}: {e}"));
        }
        seen += 1;
    }
    assert!(
        seen >= 2,
        "expected the shipped example specs in {}",
        dir.display()
    );
}
