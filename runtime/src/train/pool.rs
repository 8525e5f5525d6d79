//! Max and average pooling over NCHW with PyTorch's padding rules, as a
//! candle op with its own backward.

use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor, WithDType};

/// PyTorch's pooled length, `ceil_mode` rule included.
fn pool_out_len(
    len: usize,
    kernel: usize,
    stride: usize,
    pad: usize,
    ceil_mode: bool,
) -> candle_core::Result<usize> {
    if kernel == 0 || stride == 0 {
        candle_core::bail!("kernel {kernel} and stride {stride} must be positive");
    }
    if pad > kernel / 2 {
        candle_core::bail!("padding {pad} exceeds half the kernel {kernel}");
    }
    let Some(span) = (len + 2 * pad).checked_sub(kernel) else {
        candle_core::bail!(
            "input length {len} with padding {pad} is smaller than the kernel {kernel}"
        );
    };
    let mut out = if ceil_mode {
        span.div_ceil(stride) + 1
    } else {
        span / stride + 1
    };
    if ceil_mode && (out - 1) * stride >= len + pad {
        out -= 1;
    }
    Ok(out)
}

/// Max or average pooling over NCHW with PyTorch's padding rules, as a
/// candle op with its own backward: max pads with -inf and routes the
/// gradient to the first maximum of each window (PyTorch's argmax); average
/// divides by the padded window (`count_include_pad`) or the in-bounds count.
#[derive(Debug, Clone, Copy)]
pub(super) struct Pool2d {
    pub(super) max: bool,
    pub(super) kernel: [usize; 2],
    pub(super) stride: [usize; 2],
    pub(super) padding: [usize; 2],
    pub(super) ceil_mode: bool,
    pub(super) count_include_pad: bool,
}

/// `(n * c planes, h, w, oh, ow)`.
pub(super) type Geometry = (usize, usize, usize, usize, usize);

impl Pool2d {
    pub(super) fn geometry(&self, dims: &[usize]) -> candle_core::Result<Geometry> {
        let &[n, c, h, w] = dims else {
            candle_core::bail!("pooling wants an NCHW input, got shape {dims:?}");
        };
        let oh = pool_out_len(
            h,
            self.kernel[0],
            self.stride[0],
            self.padding[0],
            self.ceil_mode,
        )?;
        let ow = pool_out_len(
            w,
            self.kernel[1],
            self.stride[1],
            self.padding[1],
            self.ceil_mode,
        )?;
        Ok((n * c, h, w, oh, ow))
    }

    /// Window `o` along axis `a` (0 = rows): in-bounds range and padded length.
    fn window(&self, a: usize, o: usize, len: usize) -> (std::ops::Range<usize>, usize) {
        let pad = self.padding[a] as isize;
        let start = (o * self.stride[a]) as isize - pad;
        let end = (start + self.kernel[a] as isize).min(len as isize + pad);
        let padded = (end - start).max(0) as usize;
        let lo = start.max(0) as usize;
        let hi = (end.max(0) as usize).min(len);
        (lo..hi.max(lo), padded)
    }

    /// Calls `f(output index, plane offset, rows, cols, divisor)` per output.
    fn for_each(
        &self,
        (planes, h, w, oh, ow): Geometry,
        mut f: impl FnMut(usize, usize, std::ops::Range<usize>, std::ops::Range<usize>, usize),
    ) {
        for plane in 0..planes {
            for oy in 0..oh {
                let (rows, ph) = self.window(0, oy, h);
                for ox in 0..ow {
                    let (cols, pw) = self.window(1, ox, w);
                    let divisor = if self.count_include_pad {
                        ph * pw
                    } else {
                        rows.len() * cols.len()
                    };
                    f(
                        (plane * oh + oy) * ow + ox,
                        plane * h * w,
                        rows.clone(),
                        cols,
                        divisor,
                    );
                }
            }
        }
    }

    /// Index (in `src`) of the first maximum of a window; NaN wins. `None`
    /// for a window entirely in the padding.
    fn argmax<T: WithDType>(
        src: &[T],
        base: usize,
        w: usize,
        rows: std::ops::Range<usize>,
        cols: std::ops::Range<usize>,
    ) -> Option<usize> {
        let mut best: Option<(T, usize)> = None;
        for y in rows {
            for x in cols.clone() {
                let i = base + y * w + x;
                let v = src[i];
                match best {
                    Some((m, _)) if m.to_f64().is_nan() => return best.map(|b| b.1),
                    Some((m, _)) if !(v > m || v.to_f64().is_nan()) => {}
                    _ => best = Some((v, i)),
                }
            }
        }
        best.map(|b| b.1)
    }

    fn fwd<T: WithDType>(&self, src: &[T], g: Geometry) -> Vec<T> {
        let (planes, _, w, oh, ow) = g;
        let mut out = vec![T::from_f64(0.0); planes * oh * ow];
        self.for_each(g, |o, base, rows, cols, divisor| {
            out[o] = if self.max {
                match Self::argmax(src, base, w, rows, cols) {
                    Some(i) => src[i],
                    None => T::from_f64(f64::NEG_INFINITY),
                }
            } else {
                let mut sum = T::from_f64(0.0);
                for y in rows {
                    for &v in &src[base + y * w + cols.start..base + y * w + cols.end] {
                        sum += v;
                    }
                }
                sum / T::from_f64(divisor.max(1) as f64)
            };
        });
        out
    }

    fn bwd_values<T: WithDType>(&self, src: &[T], grad: &[T], g: Geometry) -> Vec<T> {
        let (_, _, w, _, _) = g;
        let mut out = vec![T::from_f64(0.0); src.len()];
        self.for_each(g, |o, base, rows, cols, divisor| {
            if self.max {
                if let Some(i) = Self::argmax(src, base, w, rows, cols) {
                    out[i] += grad[o];
                }
            } else {
                let share = grad[o] / T::from_f64(divisor.max(1) as f64);
                for y in rows {
                    for v in &mut out[base + y * w + cols.start..base + y * w + cols.end] {
                        *v += share;
                    }
                }
            }
        });
        out
    }
}

impl CustomOp1 for Pool2d {
    fn name(&self) -> &'static str {
        if self.max {
            "train-max-pool2d"
        } else {
            "train-avg-pool2d"
        }
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let g = self.geometry(l.dims())?;
        let dims = l.dims();
        let out_shape = Shape::from((dims[0], dims[1], g.3, g.4));
        let Some((start, end)) = l.contiguous_offsets() else {
            candle_core::bail!("pooling input is not contiguous");
        };
        let out = match s {
            CpuStorage::F32(v) => CpuStorage::F32(self.fwd(&v[start..end], g)),
            CpuStorage::F64(v) => CpuStorage::F64(self.fwd(&v[start..end], g)),
            _ => candle_core::bail!("pooling supports f32 and f64 only"),
        };
        Ok((out, out_shape))
    }

    fn bwd(
        &self,
        arg: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let g = self.geometry(arg.dims())?;
        let arg_flat = arg.flatten_all()?;
        let grad_flat = grad.to_dtype(arg.dtype())?.flatten_all()?;
        let out = match arg.dtype() {
            DType::F32 => {
                let v =
                    self.bwd_values(&arg_flat.to_vec1::<f32>()?, &grad_flat.to_vec1::<f32>()?, g);
                Tensor::from_vec(v, arg.shape(), arg.device())?
            }
            DType::F64 => {
                let v =
                    self.bwd_values(&arg_flat.to_vec1::<f64>()?, &grad_flat.to_vec1::<f64>()?, g);
                Tensor::from_vec(v, arg.shape(), arg.device())?
            }
            other => candle_core::bail!("pooling of {other:?} is not supported"),
        };
        Ok(Some(out))
    }
}
