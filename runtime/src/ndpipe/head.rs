//! The trainer's classifier head: one linear layer `feature_dim -> classes`
//! with softmax cross-entropy, trained by SGD with momentum on f32
//! features, hand-written gradients (it is one matmul).
//!
//! Semantics:
//! * logits `z = W x + b` (`W` is `[classes, dim]`, row-major);
//! * loss: mean over the minibatch of `-log softmax(z)[label]`; its
//!   gradient is `(softmax(z) - onehot(label)) / batch`;
//! * SGD as `torch.optim.SGD` (no dampening, no Nesterov): `g = grad + wd p`
//!   (weight decay on `W` and `b`), `buf = m buf + g` (`buf = g` on the
//!   first step), `p -= lr buf`;
//! * each epoch visits the samples in a seeded shuffled order, in
//!   minibatches of [`HeadConfig::batch`] (the last one may be smaller).
//!
//! Everything is a function of the seed: the initial weights
//! (`U(-1/sqrt(dim), 1/sqrt(dim))`, PyTorch's `nn.Linear` init) and every
//! epoch's order, so two runs with the same inputs give the same bits.
//!
//! NDPipe's schedule ([`Head::fine_tune_chunk`], [`chunk_lr`]): the
//! features arrive in `R` chunks, and chunk `i` (0-based) trains `E` epochs
//! over that chunk only, starting from chunk `i - 1`'s weights, with
//! learning rate `lr (R - i/2) / R`. That is the seed's
//! `Tuner/classifier.py` (dgist-datalab/NDPipe):
//! `self.lr_list = self.lr_list * ((lb-(loop/2))/lb)` where `lb` is the
//! split count `R` and `loop` the run index `i` (`Tuner/server.py` builds a
//! new `Classifier` per run, loading the previous run's saved model). As
//! there, each chunk starts with a fresh optimizer (the momentum buffers are
//! reset: the seed compiles a new Adam per run). Differences from the seed:
//! SGD with momentum instead of Adam, and one learning rate per chunk where
//! the seed steps through five within a run (`scheduler`, by fifths of the
//! epochs); no L2 activity regulariser.

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

/// How the head trains.
#[derive(Debug, Clone, PartialEq)]
pub struct HeadConfig {
    /// Epochs over each chunk (`E`).
    pub epochs: usize,
    /// Base learning rate (`lr`), before the chunk's scaling.
    pub lr: f32,
    pub momentum: f32,
    pub weight_decay: f32,
    /// Minibatch size.
    pub batch: usize,
    /// Seeds the initial weights and every epoch's order.
    pub seed: u64,
}

impl Default for HeadConfig {
    fn default() -> Self {
        HeadConfig {
            epochs: 10,
            lr: 0.05,
            momentum: 0.9,
            weight_decay: 0.0,
            batch: 64,
            seed: 0,
        }
    }
}

/// The learning rate of chunk `i` (0-based) of `r`: `lr (r - i/2) / r`
/// (NDPipe's `Tuner/classifier.py`, see the module doc): `lr` for the first
/// chunk, falling linearly to `lr (r + 1) / (2 r)` for the last.
pub fn chunk_lr(lr: f32, i: usize, r: usize) -> f32 {
    let r = r.max(1) as f64;
    (lr as f64 * (r - i as f64 / 2.0) / r) as f32
}

/// What training on one chunk did.
#[derive(Debug, Clone, PartialEq)]
pub struct ChunkStats {
    pub chunk: usize,
    pub samples: usize,
    pub lr: f32,
    /// Mean loss over the last epoch's minibatches (NaN without samples).
    pub last_epoch_loss: f32,
}

#[derive(Debug, thiserror::Error, PartialEq)]
#[non_exhaustive]
pub enum HeadError {
    #[error("{values} feature values for {samples} samples of {dim} features")]
    Shape {
        values: usize,
        samples: usize,
        dim: usize,
    },
    #[error("sample {index} has label {label}, the head has {classes} classes")]
    Label {
        index: usize,
        label: u32,
        classes: usize,
    },
    #[error("{0}")]
    Config(String),
}

/// A linear classifier head and its SGD state.
#[derive(Debug, Clone, PartialEq)]
pub struct Head {
    dim: usize,
    classes: usize,
    /// `[classes, dim]`, row-major.
    w: Vec<f32>,
    b: Vec<f32>,
    w_buf: Option<Vec<f32>>,
    b_buf: Option<Vec<f32>>,
    /// Seeds epochs' orders; advanced by every epoch.
    rng: StdRng,
}

impl Head {
    /// A head with seeded initial weights.
    pub fn new(dim: usize, classes: usize, seed: u64) -> Head {
        let mut rng = StdRng::seed_from_u64(seed);
        let bound = 1.0 / (dim.max(1) as f32).sqrt();
        let w = (0..dim * classes)
            .map(|_| rng.gen_range(-bound..=bound))
            .collect();
        let b = (0..classes)
            .map(|_| rng.gen_range(-bound..=bound))
            .collect();
        Head {
            dim,
            classes,
            w,
            b,
            w_buf: None,
            b_buf: None,
            rng: StdRng::seed_from_u64(seed ^ 0x9e37_79b9_7f4a_7c15),
        }
    }

    pub fn dim(&self) -> usize {
        self.dim
    }

    pub fn classes(&self) -> usize {
        self.classes
    }

    /// `[classes, dim]` row-major, then the biases.
    pub fn weights(&self) -> (&[f32], &[f32]) {
        (&self.w, &self.b)
    }

    fn check(&self, features: &[f32], labels: &[u32]) -> Result<(), HeadError> {
        if features.len() != labels.len() * self.dim {
            return Err(HeadError::Shape {
                values: features.len(),
                samples: labels.len(),
                dim: self.dim,
            });
        }
        if let Some((index, &label)) = labels
            .iter()
            .enumerate()
            .find(|(_, &l)| l as usize >= self.classes)
        {
            return Err(HeadError::Label {
                index,
                label,
                classes: self.classes,
            });
        }
        Ok(())
    }

    /// Logits of one feature row.
    fn logits(&self, x: &[f32], z: &mut [f32]) {
        for (c, zc) in z.iter_mut().enumerate() {
            let row = &self.w[c * self.dim..(c + 1) * self.dim];
            *zc = self.b[c] + row.iter().zip(x).map(|(w, x)| w * x).sum::<f32>();
        }
    }

    /// Softmax of `z` in place (max-subtracted); returns `log sum exp`
    /// relative to the max, and the max.
    fn softmax(z: &mut [f32]) -> (f32, f32) {
        let max = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0;
        for v in z.iter_mut() {
            *v = (*v - max).exp();
            sum += *v;
        }
        for v in z.iter_mut() {
            *v /= sum;
        }
        (sum.ln(), max)
    }

    /// One SGD step on the samples `idx`; returns their mean loss.
    fn step(
        &mut self,
        features: &[f32],
        labels: &[u32],
        idx: &[usize],
        cfg: &HeadConfig,
        lr: f32,
    ) -> f32 {
        let (d, k) = (self.dim, self.classes);
        let mut gw = vec![0f32; k * d];
        let mut gb = vec![0f32; k];
        let mut z = vec![0f32; k];
        let mut loss = 0f32;
        let scale = 1.0 / idx.len() as f32;
        for &s in idx {
            let x = &features[s * d..(s + 1) * d];
            let y = labels[s] as usize;
            self.logits(x, &mut z);
            let zy = z[y];
            let (lse, max) = Head::softmax(&mut z);
            loss += lse + max - zy;
            z[y] -= 1.0;
            for c in 0..k {
                let g = z[c] * scale;
                gb[c] += g;
                for (gw, x) in gw[c * d..(c + 1) * d].iter_mut().zip(x) {
                    *gw += g * x;
                }
            }
        }
        sgd(&mut self.w, gw, &mut self.w_buf, cfg, lr);
        sgd(&mut self.b, gb, &mut self.b_buf, cfg, lr);
        loss * scale
    }

    /// `epochs` epochs over these samples at learning rate `lr`; returns the
    /// last epoch's mean minibatch loss.
    pub fn train(
        &mut self,
        features: &[f32],
        labels: &[u32],
        cfg: &HeadConfig,
        lr: f32,
    ) -> Result<f32, HeadError> {
        self.check(features, labels)?;
        if cfg.batch == 0 {
            return Err(HeadError::Config("a minibatch of 0 samples".into()));
        }
        let mut order: Vec<usize> = (0..labels.len()).collect();
        let mut last = f32::NAN;
        for _ in 0..cfg.epochs {
            order.shuffle(&mut self.rng);
            let (mut sum, mut steps) = (0f32, 0usize);
            for idx in order.chunks(cfg.batch) {
                sum += self.step(features, labels, idx, cfg, lr);
                steps += 1;
            }
            if steps > 0 {
                last = sum / steps as f32;
            }
        }
        Ok(last)
    }

    /// NDPipe's step `i` of `r`: a fresh optimizer (momentum reset), then
    /// `cfg.epochs` epochs over this chunk's samples at [`chunk_lr`].
    pub fn fine_tune_chunk(
        &mut self,
        i: usize,
        r: usize,
        features: &[f32],
        labels: &[u32],
        cfg: &HeadConfig,
    ) -> Result<ChunkStats, HeadError> {
        if i >= r {
            return Err(HeadError::Config(format!("chunk {i} of {r}")));
        }
        self.w_buf = None;
        self.b_buf = None;
        let lr = chunk_lr(cfg.lr, i, r);
        let last_epoch_loss = self.train(features, labels, cfg, lr)?;
        Ok(ChunkStats {
            chunk: i,
            samples: labels.len(),
            lr,
            last_epoch_loss,
        })
    }

    /// Every chunk in order, as [`Head::fine_tune_chunk`] (all chunks at
    /// hand: the pipelined driver calls `fine_tune_chunk` as they arrive).
    pub fn fine_tune_chunked(
        &mut self,
        chunks: &[(Vec<f32>, Vec<u32>)],
        cfg: &HeadConfig,
    ) -> Result<Vec<ChunkStats>, HeadError> {
        let r = chunks.len();
        chunks
            .iter()
            .enumerate()
            .map(|(i, (f, l))| self.fine_tune_chunk(i, r, f, l, cfg))
            .collect()
    }

    /// The predicted class of each sample.
    pub fn predict(&self, features: &[f32]) -> Vec<u32> {
        let mut z = vec![0f32; self.classes];
        features
            .chunks_exact(self.dim.max(1))
            .map(|x| {
                self.logits(x, &mut z);
                let mut best = 0;
                for c in 1..self.classes {
                    if z[c] > z[best] {
                        best = c;
                    }
                }
                best as u32
            })
            .collect()
    }

    /// The fraction of samples whose predicted class is their label (NaN
    /// without samples).
    pub fn accuracy(&self, features: &[f32], labels: &[u32]) -> Result<f32, HeadError> {
        self.check(features, labels)?;
        if labels.is_empty() {
            return Ok(f32::NAN);
        }
        let right = self
            .predict(features)
            .iter()
            .zip(labels)
            .filter(|(p, l)| p == l)
            .count();
        Ok(right as f32 / labels.len() as f32)
    }
}

/// `torch.optim.SGD`'s update of `p` with gradient `g` (see the module doc).
fn sgd(p: &mut [f32], mut g: Vec<f32>, buf: &mut Option<Vec<f32>>, cfg: &HeadConfig, lr: f32) {
    if cfg.weight_decay != 0.0 {
        for (g, p) in g.iter_mut().zip(p.iter()) {
            *g += cfg.weight_decay * p;
        }
    }
    let step = if cfg.momentum != 0.0 {
        match buf {
            Some(b) => {
                for (b, g) in b.iter_mut().zip(&g) {
                    *b = cfg.momentum * *b + g;
                }
            }
            None => *buf = Some(g),
        }
        buf.as_ref().expect("set above")
    } else {
        &g
    };
    for (p, s) in p.iter_mut().zip(step) {
        *p -= lr * s;
    }
}
