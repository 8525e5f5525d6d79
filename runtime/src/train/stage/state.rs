//! A stage's state: the SGD step, the accumulated gradients, and its params
//! as flat vectors (replica averaging) and packed bytes (checkpoints,
//! moving layers between stages).

use std::ops::Range;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};

use super::{variable, Slot, StageModel, StageStepReport, Weights};
use crate::train::packed::{device_range, read_device, span, write_f32, PackedLayers};
use crate::train::sgd::{update, SgdConfig, SgdState};
use crate::train::TrainError;

impl StageModel {
    /// Applies SGD to the current weights with the MEAN of the gradients
    /// accumulated since the last step (one per microbatch backward), and
    /// clears them. Momentum buffers persist in the stage. Microbatches in
    /// flight keep the weights their forward used.
    pub fn step(&mut self, cfg: &SgdConfig) -> Result<StageStepReport, TrainError> {
        if self.accumulated == 0 {
            return Err(self.stage_err(
                "step without a gradient: no microbatch finished its backward since the last \
                 step"
                    .into(),
            ));
        }
        let scale = 1.0 / self.accumulated as f64;
        let mut values = Vec::with_capacity(self.learnable.len());
        let mut momentum = Vec::with_capacity(self.learnable.len());
        for (k, w) in self.weights.values.iter().enumerate() {
            let name = self.param_name(self.learnable[k]);
            let stepped = (|| {
                let p = w.detach();
                let g = match &self.accum[k] {
                    Some(g) => g.affine(scale, 0.0)?,
                    None => p.zeros_like()?,
                };
                let (p, buf) = update(&p, &g, self.momentum[k].as_ref(), cfg)?;
                Ok::<_, candle_core::Error>((variable(&p)?, buf))
            })()
            .map_err(|e| self.stage_err(format!("SGD update of {name}: {e}")))?;
            values.push(stepped.0);
            momentum.push(stepped.1);
        }
        let microbatches = self.accumulated;
        self.install(values);
        self.momentum = momentum;
        self.accum = vec![None; self.learnable.len()];
        self.accumulated = 0;
        Ok(StageStepReport {
            version: self.weights.version,
            microbatches,
            params_updated: self.learnable.len(),
        })
    }

    /// The gradient [`StageModel::step`] would apply (without weight decay
    /// and momentum): the mean over the accumulated microbatches, per
    /// learnable param in packed order, as f64.
    pub fn gradients(&self) -> Result<Vec<(String, Vec<f64>)>, TrainError> {
        let scale = 1.0 / self.accumulated.max(1) as f64;
        self.learnable
            .iter()
            .enumerate()
            .map(|(k, &pos)| {
                let name = self.param_name(pos).to_string();
                let v = match &self.accum[k] {
                    Some(g) => f64s(
                        &g.affine(scale, 0.0)
                            .map_err(|e| self.stage_err(e.to_string()))?,
                    ),
                    None => f64s(
                        &self.weights.values[k]
                            .zeros_like()
                            .map_err(|e| self.stage_err(e.to_string()))?,
                    ),
                }
                .map_err(|e| self.stage_err(format!("gradient of {name}: {e}")))?;
                Ok((name, v))
            })
            .collect()
    }

    /// Names and lengths of the stage's params in the order of
    /// [`StageModel::params_flat`]: packed order, learnable params and
    /// running statistics alike.
    pub fn flat_layout(&self) -> Vec<(String, usize)> {
        self.params
            .iter()
            .map(|&pi| {
                let p = &self.manifest.params[pi];
                (p.name.clone(), p.numel() as usize)
            })
            .collect()
    }

    /// Every param of the stage (learnable and running statistics) in one
    /// f32 vector, in packed order (see [`StageModel::flat_layout`]): what
    /// replicas average. An f64 stage's values are rounded.
    pub fn params_flat(&self) -> Result<Vec<f32>, TrainError> {
        let mut out = Vec::new();
        for pos in 0..self.params.len() {
            out.extend(self.values_f32(pos)?);
        }
        Ok(out)
    }

    /// Replaces every param from a vector laid out as
    /// [`StageModel::params_flat`]'s (a new weight version; momentum,
    /// accumulated gradients and microbatches in flight are kept).
    pub fn set_params_flat(&mut self, flat: &[f32]) -> Result<(), TrainError> {
        let want: usize = self.flat_layout().iter().map(|(_, n)| n).sum();
        if flat.len() != want {
            return Err(self.stage_err(format!(
                "a flat vector of {} values, the stage's params have {want}",
                flat.len()
            )));
        }
        let mut at = 0;
        let mut news = Vec::with_capacity(self.params.len());
        for pos in 0..self.params.len() {
            let n = self.manifest.params[self.params[pos]].numel() as usize;
            news.push((pos, flat[at..at + n].to_vec()));
            at += n;
        }
        self.replace(news)
    }

    /// The params of `layers` (inside the stage) in the f32 packed layout,
    /// at their device offsets: a checkpoint of those layers, or what
    /// another stage loads when the cut moves.
    pub fn layer_params_packed(&self, layers: Range<usize>) -> Result<PackedLayers, TrainError> {
        let positions = self.positions_of(&layers)?;
        let ids: Vec<usize> = positions.iter().map(|&p| self.params[p]).collect();
        let range = span(&self.manifest, &ids).map_err(|why| self.stage_err(why))?;
        let mut bytes = vec![0u8; (range.end - range.start) as usize];
        for &pos in &positions {
            let r = device_range(&self.manifest, &self.manifest.params[self.params[pos]])
                .map_err(|why| self.stage_err(why))?;
            let values = self.values_f32(pos)?;
            let dst = &mut bytes[(r.start - range.start) as usize..(r.end - range.start) as usize];
            write_f32(dst, &values).map_err(|why| self.stage_err(why))?;
        }
        Ok(PackedLayers {
            model: self.manifest.name.clone(),
            layers,
            offset: range.start,
            bytes,
        })
    }

    /// Loads the params of `part`'s layers (inside the stage), as
    /// [`StageModel::layer_params_packed`] gave them: a new weight version.
    pub fn load_layer_params(&mut self, part: &PackedLayers) -> Result<(), TrainError> {
        if part.model != self.manifest.name {
            return Err(self.stage_err(format!(
                "params of layers {:?} are of model {}",
                part.layers, part.model
            )));
        }
        let positions = self.positions_of(&part.layers)?;
        let ids: Vec<usize> = positions.iter().map(|&p| self.params[p]).collect();
        let range = span(&self.manifest, &ids).map_err(|why| self.stage_err(why))?;
        if !ids.is_empty() && part.range() != range {
            return Err(self.stage_err(format!(
                "the params of layers [{}, {}) are device bytes {range:?}, the part gives {:?}",
                part.layers.start,
                part.layers.end,
                part.range()
            )));
        }
        let mut news = Vec::with_capacity(positions.len());
        for pos in positions {
            let values = read_device(
                &self.manifest,
                &self.manifest.params[self.params[pos]],
                part,
            )
            .map_err(|why| self.stage_err(why))?;
            news.push((pos, values));
        }
        self.replace(news)
    }

    /// The momentum buffers of the stage's params, by name.
    pub fn sgd_state(&self) -> Result<SgdState, TrainError> {
        let mut state = SgdState::new();
        for (k, buf) in self.momentum.iter().enumerate() {
            if let Some(b) = buf {
                let name = self.param_name(self.learnable[k]).to_string();
                let v = f32s(b).map_err(|e| self.stage_err(format!("momentum of {name}: {e}")))?;
                state.momentum.insert(name, v);
            }
        }
        Ok(state)
    }

    /// Takes the buffers of `state` for the stage's params (buffers of
    /// other params are ignored; a stage param without one in `state`
    /// keeps its own).
    pub fn load_sgd_state(&mut self, state: &SgdState) -> Result<(), TrainError> {
        let dtype = self.precision.dtype();
        for k in 0..self.learnable.len() {
            let p = &self.manifest.params[self.params[self.learnable[k]]];
            if let Some(v) = state.momentum.get(&p.name) {
                if v.len() as u64 != p.numel() {
                    return Err(self.stage_err(format!(
                        "momentum of {} has {} values, the param {}",
                        p.name,
                        v.len(),
                        p.numel()
                    )));
                }
                let t = Tensor::from_slice(v, p.shape.as_slice(), &Device::Cpu)
                    .and_then(|t| t.to_dtype(dtype))
                    .map_err(|e| self.stage_err(e.to_string()))?;
                self.momentum[k] = Some(t);
            }
        }
        Ok(())
    }

    /// The running statistics, by name, as f64.
    pub fn running_stats(&self) -> Result<Vec<(String, Vec<f64>)>, TrainError> {
        self.stat_params
            .iter()
            .zip(&self.stats)
            .map(|(&pos, t)| {
                let name = self.param_name(pos).to_string();
                let v = f64s(t).map_err(|e| self.stage_err(format!("{name}: {e}")))?;
                Ok((name, v))
            })
            .collect()
    }

    /// Every param's current values, as (manifest param index, f32 values).
    pub(crate) fn param_values(&self) -> Result<Vec<(usize, Vec<f32>)>, TrainError> {
        (0..self.params.len())
            .map(|pos| Ok((self.params[pos], self.values_f32(pos)?)))
            .collect()
    }

    fn param_name(&self, pos: usize) -> &str {
        &self.manifest.params[self.params[pos]].name
    }

    fn values_f32(&self, pos: usize) -> Result<Vec<f32>, TrainError> {
        let t = match self.slots[pos] {
            Slot::Learnable(k) => &self.weights.values[k],
            Slot::Stat(k) => &self.stats[k],
        };
        f32s(t).map_err(|e| self.stage_err(format!("{}: {e}", self.param_name(pos))))
    }

    /// Positions (in `params`) of the params of `layers`, which must lie
    /// inside the stage.
    fn positions_of(&self, layers: &Range<usize>) -> Result<Vec<usize>, TrainError> {
        if layers.start >= layers.end
            || layers.start < self.layers.start
            || layers.end > self.layers.end
        {
            return Err(self.stage_err(format!(
                "layers [{}, {}) are not a non-empty range inside the stage",
                layers.start, layers.end
            )));
        }
        Ok((0..self.params.len())
            .filter(|&pos| layers.contains(&self.manifest.params[self.params[pos]].layer))
            .collect())
    }

    /// Sets params (position, f32 values): learnable ones as a new weight
    /// version, running statistics in place. All or nothing.
    fn replace(&mut self, news: Vec<(usize, Vec<f32>)>) -> Result<(), TrainError> {
        let dtype = self.precision.dtype();
        let mut values = self.weights.values.clone();
        let mut stats = self.stats.clone();
        for (pos, v) in news {
            let p = &self.manifest.params[self.params[pos]];
            let t = Tensor::from_vec(v, p.shape.as_slice(), &Device::Cpu)
                .and_then(|t| t.to_dtype(dtype))
                .map_err(|e| self.stage_err(format!("{}: {e}", p.name)))?;
            match self.slots[pos] {
                Slot::Learnable(k) => {
                    values[k] = variable(&t).map_err(|e| self.stage_err(e.to_string()))?
                }
                Slot::Stat(k) => stats[k] = t,
            }
        }
        self.install(values);
        self.stats = stats;
        Ok(())
    }

    /// Makes `values` the next weight version.
    fn install(&mut self, values: Vec<Tensor>) {
        self.weights = Arc::new(Weights {
            version: self.weights.version + 1,
            values,
        });
    }
}

fn f64s(t: &Tensor) -> candle_core::Result<Vec<f64>> {
    t.flatten_all()?.to_dtype(DType::F64)?.to_vec1::<f64>()
}

fn f32s(t: &Tensor) -> candle_core::Result<Vec<f32>> {
    t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()
}
