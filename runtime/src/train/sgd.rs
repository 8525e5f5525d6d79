//! `torch.optim.SGD`: its hyper-parameters, its momentum buffers, and the
//! update of one param.

use std::collections::HashMap;

use candle_core::Tensor;

/// `torch.optim.SGD`'s hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SgdConfig {
    pub lr: f32,
    /// 0 = plain SGD. Momentum buffers live in an [`SgdState`] (or a
    /// [`crate::train::StageModel`]); `sgd_step` starts from empty buffers,
    /// which makes one step plain SGD.
    pub momentum: f32,
    pub weight_decay: f32,
}

impl Default for SgdConfig {
    /// torchvision's ImageNet recipe: lr 0.1, momentum 0.9, weight decay 1e-4.
    fn default() -> Self {
        SgdConfig {
            lr: 0.1,
            momentum: 0.9,
            weight_decay: 1e-4,
        }
    }
}

/// What persists between steps: momentum buffers, by param name.
#[derive(Debug, Clone, Default)]
pub struct SgdState {
    pub(crate) momentum: HashMap<String, Vec<f32>>,
}

impl SgdState {
    pub fn new() -> Self {
        SgdState::default()
    }

    /// Number of params holding a momentum buffer.
    pub fn buffers(&self) -> usize {
        self.momentum.len()
    }

    /// The momentum buffer of param `name`, if it has one.
    pub fn buffer(&self, name: &str) -> Option<&[f32]> {
        self.momentum.get(name).map(Vec::as_slice)
    }

    /// Moves the buffers of `other` into this state (replacing same names):
    /// how buffers follow layers that move to another stage.
    pub fn merge(&mut self, other: SgdState) {
        self.momentum.extend(other.momentum);
    }
}

/// One param's update: `g = grad + wd p`; with momentum `buf = m buf + g`
/// (`buf = g` without a buffer yet) and `g = buf`; `p - lr g`. Returns the
/// new param and the new buffer (`None` without momentum). Every tensor is
/// in the param's dtype; the hyper-parameters are the f32 values of `cfg`,
/// so an f32 step rounds as the f32 arithmetic of `torch.optim.SGD` does.
pub(crate) fn update(
    param: &Tensor,
    grad: &Tensor,
    buf: Option<&Tensor>,
    cfg: &SgdConfig,
) -> candle_core::Result<(Tensor, Option<Tensor>)> {
    let mut g = grad.add(&param.affine(f64::from(cfg.weight_decay), 0.0)?)?;
    let mut new_buf = None;
    if cfg.momentum != 0.0 {
        let b = match buf {
            Some(b) if b.dims() == g.dims() => b.affine(f64::from(cfg.momentum), 0.0)?.add(&g)?,
            _ => g.clone(),
        };
        g = b.clone();
        new_buf = Some(b);
    }
    let p = param.sub(&g.affine(f64::from(cfg.lr), 0.0)?)?;
    Ok((p, new_buf))
}
