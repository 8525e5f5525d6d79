//! Which tensors cross a cut of a model's layer list.
//!
//! The models are DAGs (residual adds, DenseNet concats, Inception
//! branches, transformer residuals), so a cut between layer `c - 1` and
//! layer `c` carries every LIVE tensor: each one produced before `c` (a
//! layer output, or a model input) that some layer `>= c` reads. Tensors
//! are named by the manifest's input convention: `r >= 0` is the output of
//! layer `r`, `-1` is model input 0, `-2` model input 1, ...
//!
//! A stage `[first, end)` takes `boundary(first)` and gives the tensors of
//! `boundary(end)` that it produced; the cut after the last layer carries
//! the model's outputs (`manifest.outputs`), so the last stage gives the
//! outputs it produced. A tensor may skip stages (a stage's input may come
//! from any earlier stage, or be a model input): routing it is the
//! pipeline driver's business, and so is summing the gradients of a tensor
//! that several later stages read.

use std::ops::Range;

use distmind_models::Manifest;

use super::TrainError;

/// A stage's boundary tensors, each list ascending (model inputs first).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StageIo {
    /// `boundary(first)`: what the stage's forward takes.
    pub inputs: Vec<i64>,
    /// What it produces that later layers read (or the model's outputs, for
    /// the last stage): what its forward returns and its backward wants
    /// gradients of.
    pub outputs: Vec<i64>,
}

/// The tensors live at cut `cut` (`0..=layers`): produced before layer
/// `cut` and read by a layer `>= cut`; at `cut == layers` the model's
/// outputs. Ascending: model inputs (`-1, -2, ...` sorts them last to
/// first, so they are listed as `-k..=-1`), then layer ids.
pub fn boundary(manifest: &Manifest, cut: usize) -> Result<Vec<i64>, TrainError> {
    let n = manifest.layers.len();
    if cut > n {
        return Err(model_err(
            manifest,
            format!("cut {cut} is beyond the {n} layers"),
        ));
    }
    check_graph(manifest)?;
    let outputs: Vec<usize> = manifest.outputs.iter().map(|o| o.layer).collect();
    Ok(live_tensors(&manifest.layers, &outputs, cut))
}

/// [`boundary`] over a bare layer list and its output layers, unchecked
/// (`cut <= layers.len()`, every input an earlier layer or a model input):
/// what a planner that has an architecture but no package uses.
pub fn live_tensors(layers: &[distmind_models::Layer], outputs: &[usize], cut: usize) -> Vec<i64> {
    let mut live: Vec<i64> = if cut >= layers.len() {
        outputs.iter().map(|&o| o as i64).collect()
    } else {
        layers[cut..]
            .iter()
            .flat_map(|l| l.inputs.iter().copied())
            .filter(|&r| r < cut as i64)
            .collect()
    };
    live.sort_unstable();
    live.dedup();
    live
}

/// The inputs and outputs of the stage `layers` (`first < end <= layers`).
pub fn stage_io(manifest: &Manifest, layers: Range<usize>) -> Result<StageIo, TrainError> {
    let n = manifest.layers.len();
    if layers.start >= layers.end || layers.end > n {
        return Err(model_err(
            manifest,
            format!(
                "stage [{}, {}) is not a non-empty range of its {n} layers",
                layers.start, layers.end
            ),
        ));
    }
    let inputs = boundary(manifest, layers.start)?;
    let outputs = boundary(manifest, layers.end)?
        .into_iter()
        .filter(|&r| r >= layers.start as i64)
        .collect();
    Ok(StageIo { inputs, outputs })
}

/// What tensor `r` is, for messages: `layer 12 (layer1.0.relu1)` or
/// `model input 0 (input_ids)`.
pub fn describe_ref(manifest: &Manifest, r: i64) -> String {
    if r < 0 {
        let k = (-r - 1) as usize;
        match manifest.inputs.get(k) {
            Some(spec) => format!("model input {k} ({})", spec.name),
            None => format!("model input {k} (the model has {})", manifest.inputs.len()),
        }
    } else {
        match manifest.layers.get(r as usize) {
            Some(l) => format!("the output of layer {r} ({})", l.name),
            None => format!("layer {r} (the model has {})", manifest.layers.len()),
        }
    }
}

/// Layer ids equal positions; every input is an earlier layer or a model
/// input; every output names a layer.
pub(crate) fn check_graph(manifest: &Manifest) -> Result<(), TrainError> {
    for (i, l) in manifest.layers.iter().enumerate() {
        if l.id != i {
            return Err(model_err(
                manifest,
                format!("layer {} ({}) is at position {i}", l.id, l.name),
            ));
        }
        for &r in &l.inputs {
            let ok = if r < 0 {
                ((-r - 1) as usize) < manifest.inputs.len()
            } else {
                (r as usize) < i
            };
            if !ok {
                return Err(model_err(
                    manifest,
                    format!(
                        "layer {i} ({}) reads {r}, which is neither an earlier layer nor a \
                         model input",
                        l.name
                    ),
                ));
            }
        }
    }
    if let Some(o) = manifest
        .outputs
        .iter()
        .find(|o| o.layer >= manifest.layers.len())
    {
        return Err(model_err(
            manifest,
            format!(
                "output {} names layer {}, which does not exist",
                o.name, o.layer
            ),
        ));
    }
    Ok(())
}

fn model_err(manifest: &Manifest, why: String) -> TrainError {
    TrainError::Model {
        model: manifest.name.clone(),
        why,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use distmind_models::{Family, Scale};

    fn manifest(family: Family) -> (tempfile::TempDir, Manifest) {
        let dir = tempfile::tempdir().unwrap();
        let opts = distmind_models::GenOptions {
            scale: Scale::Tiny,
            ..distmind_models::GenOptions::new(family, dir.path())
        };
        let path = distmind_models::generate(&opts).unwrap().remove(0);
        let m = distmind_models::Package::open(&path).unwrap().manifest;
        (dir, m)
    }

    fn id(m: &Manifest, name: &str) -> i64 {
        m.layers
            .iter()
            .find(|l| l.name == name)
            .unwrap_or_else(|| panic!("no layer {name}"))
            .id as i64
    }

    /// Brute force: every (producer, reader) edge that crosses the cut.
    fn crossing(m: &Manifest, cut: usize) -> Vec<i64> {
        let mut v: Vec<i64> = Vec::new();
        for l in &m.layers[cut..] {
            for &r in &l.inputs {
                if r < cut as i64 && !v.contains(&r) {
                    v.push(r);
                }
            }
        }
        v.sort_unstable();
        v
    }

    #[test]
    fn boundaries_of_every_family() {
        for family in Family::ALL {
            let (_dir, m) = manifest(family);
            let n = m.layers.len();
            assert_eq!(boundary(&m, 0).unwrap(), vec![-1], "{family:?}");
            let outs: Vec<i64> = m.outputs.iter().map(|o| o.layer as i64).collect();
            assert_eq!(boundary(&m, n).unwrap(), outs, "{family:?}");
            let mut widest = 0;
            for cut in 1..n {
                let b = boundary(&m, cut).unwrap();
                assert_eq!(b, crossing(&m, cut), "{family:?} cut {cut}");
                assert!(!b.is_empty(), "{family:?}: cut {cut} carries nothing");
                widest = widest.max(b.len());
            }
            // Every family's DAG has cuts that carry several tensors.
            assert!(widest >= 2, "{family:?}: widest cut carries {widest}");
            // Stages tile: the outputs of [a, b) are b's boundary minus what
            // came from before a.
            let io = stage_io(&m, 1..n / 2).unwrap();
            assert_eq!(io.inputs, boundary(&m, 1).unwrap());
            for r in &io.outputs {
                assert!(*r >= 1 && *r < (n / 2) as i64);
            }
            assert!(boundary(&m, n + 1).is_err());
            assert!(stage_io(&m, 3..3).is_err());
        }
    }

    #[test]
    fn a_cut_inside_a_resnet_bottleneck_carries_the_block_input() {
        let (_dir, m) = manifest(Family::Resnet152);
        // After layer1.0.conv1: bn1 reads conv1, the downsample reads the
        // block input (the max pool).
        let cut = id(&m, "layer1.0.conv1") as usize + 1;
        assert_eq!(
            boundary(&m, cut).unwrap(),
            vec![id(&m, "maxpool"), id(&m, "layer1.0.conv1")]
        );
        // Between the main path's last bn and the add: the shortcut too.
        let cut = id(&m, "layer1.0.add") as usize;
        let b = boundary(&m, cut).unwrap();
        assert_eq!(
            b,
            vec![id(&m, "layer1.0.bn3"), id(&m, "layer1.0.downsample.1")]
        );
    }

    #[test]
    fn transformer_cuts_carry_residuals_and_token_ids() {
        let (_dir, m) = manifest(Family::Gpt2);
        // After wte: wpe still reads the token ids (for their shape).
        let wte = id(&m, "wte");
        assert_eq!(boundary(&m, wte as usize + 1).unwrap(), vec![-1, wte]);
        // Inside block 0, after ln_1: the block input for the residual add.
        let ln1 = id(&m, "h.0.ln_1");
        let b = boundary(&m, ln1 as usize + 1).unwrap();
        assert_eq!(b.len(), 2, "{b:?}");
        assert_eq!(b[1], ln1);

        let (_dir, m) = manifest(Family::BertBase);
        // The last stage of BERT gives both outputs it produced.
        let n = m.layers.len();
        let last_ln = m.outputs[0].layer;
        let io = stage_io(&m, last_ln..n).unwrap();
        assert_eq!(io.inputs, vec![last_ln as i64 - 1]);
        assert_eq!(io.outputs, vec![last_ln as i64, (n - 1) as i64]);
        let io = stage_io(&m, last_ln + 1..n).unwrap();
        assert_eq!(io.inputs, vec![last_ln as i64]);
        assert_eq!(io.outputs, vec![(n - 1) as i64]);
    }
}
