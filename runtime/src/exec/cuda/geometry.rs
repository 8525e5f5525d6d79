//! The index math of the `cuda` executor's window kernels, in Rust: output
//! lengths (PyTorch's `ceil_mode` rule), pooling windows (the `len + pad`
//! clip that `count_include_pad` divides by), adaptive bins and im2col
//! sources. The host computes every size it passes to a kernel with these
//! functions, and the kernels in [`super::kernels`] transcribe
//! [`pool_window`], [`adaptive_bin`], [`im2col_source`],
//! [`im2col_stacked_source`] and [`swap_outer_source`] line for line; the
//! reference loops below ([`max_pool2d_ref`], [`avg_pool2d_ref`],
//! [`conv2d_im2col_ref`]) are built on them and unit-tested on the CPU
//! against values computed by hand and a direct convolution.

/// PyTorch's pooled (or convolved, with `ceil_mode = false`) length.
pub fn out_len(
    len: usize,
    kernel: usize,
    stride: usize,
    pad: usize,
    ceil_mode: bool,
) -> Result<usize, String> {
    if kernel == 0 || stride == 0 {
        return Err(format!(
            "kernel {kernel} and stride {stride} must be positive"
        ));
    }
    let Some(span) = (len + 2 * pad).checked_sub(kernel) else {
        return Err(format!(
            "input length {len} with padding {pad} is smaller than the kernel {kernel}"
        ));
    };
    let mut out = if ceil_mode {
        span.div_ceil(stride) + 1
    } else {
        span / stride + 1
    };
    // The last window must start inside the input or its left padding.
    if ceil_mode && (out - 1) * stride >= len + pad {
        out -= 1;
    }
    Ok(out)
}

/// The pooling checks of the `cpu` executor: padding at most half the kernel.
pub fn pool_out_len(
    len: usize,
    kernel: usize,
    stride: usize,
    pad: usize,
    ceil_mode: bool,
) -> Result<usize, String> {
    if pad > kernel / 2 {
        return Err(format!("padding {pad} exceeds half the kernel {kernel}"));
    }
    out_len(len, kernel, stride, pad, ceil_mode)
}

/// Window `o` along one axis, in input coordinates: `start = o s - pad`,
/// `end = min(start + k, len + pad)` (not yet clipped to the input).
pub fn pool_window(o: usize, kernel: usize, stride: usize, pad: usize, len: usize) -> (i64, i64) {
    let start = (o * stride) as i64 - pad as i64;
    let end = (start + kernel as i64).min((len + pad) as i64);
    (start, end)
}

/// A window clipped to the input `0..len`.
pub fn clip(window: (i64, i64), len: usize) -> std::ops::Range<usize> {
    let start = window.0.max(0) as usize;
    let end = (window.1.max(0) as usize).min(len);
    start..end.max(start)
}

/// Adaptive bin `i` of `o` over `len`: `[floor(i len / o), ceil((i + 1) len / o))`.
pub fn adaptive_bin(i: usize, len: usize, o: usize) -> std::ops::Range<usize> {
    (i * len) / o..((i + 1) * len).div_ceil(o)
}

/// 2-d window geometry over NCHW planes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window2d {
    pub h: usize,
    pub w: usize,
    pub oh: usize,
    pub ow: usize,
    pub kernel: [usize; 2],
    pub stride: [usize; 2],
    pub padding: [usize; 2],
}

impl Window2d {
    /// Pooling geometry (the `cpu` executor's checks and `ceil_mode` rule).
    pub fn pool(
        h: usize,
        w: usize,
        kernel: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 2],
        ceil_mode: bool,
    ) -> Result<Self, String> {
        Ok(Window2d {
            h,
            w,
            oh: pool_out_len(h, kernel[0], stride[0], padding[0], ceil_mode)?,
            ow: pool_out_len(w, kernel[1], stride[1], padding[1], ceil_mode)?,
            kernel,
            stride,
            padding,
        })
    }

    /// Convolution geometry (zero padding, dilation 1).
    pub fn conv(
        h: usize,
        w: usize,
        kernel: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 2],
    ) -> Result<Self, String> {
        Ok(Window2d {
            h,
            w,
            oh: out_len(h, kernel[0], stride[0], padding[0], false)?,
            ow: out_len(w, kernel[1], stride[1], padding[1], false)?,
            kernel,
            stride,
            padding,
        })
    }

    /// Windows of output `(oy, ox)`, unclipped.
    pub fn windows(&self, oy: usize, ox: usize) -> ((i64, i64), (i64, i64)) {
        (
            pool_window(oy, self.kernel[0], self.stride[0], self.padding[0], self.h),
            pool_window(ox, self.kernel[1], self.stride[1], self.padding[1], self.w),
        )
    }
}

/// The input pixel that im2col puts at kernel tap `(ky, kx)` of output
/// `(oy, ox)`, or `None` in the zero padding.
pub fn im2col_source(
    g: &Window2d,
    ky: usize,
    kx: usize,
    oy: usize,
    ox: usize,
) -> Option<(usize, usize)> {
    let iy = (oy * g.stride[0]) as i64 - g.padding[0] as i64 + ky as i64;
    let ix = (ox * g.stride[1]) as i64 - g.padding[1] as i64 + kx as i64;
    let inside = iy >= 0 && (iy as usize) < g.h && ix >= 0 && (ix as usize) < g.w;
    inside.then_some((iy as usize, ix as usize))
}

/// Max pooling of `planes` planes, as `max_pool2d_f32` computes it.
pub fn max_pool2d_ref(x: &[f32], planes: usize, g: &Window2d) -> Vec<f32> {
    let mut out = Vec::with_capacity(planes * g.oh * g.ow);
    for plane in x.chunks_exact(g.h * g.w).take(planes) {
        for oy in 0..g.oh {
            for ox in 0..g.ow {
                let (wy, wx) = g.windows(oy, ox);
                let mut m = f32::NEG_INFINITY;
                for y in clip(wy, g.h) {
                    for &v in &plane[y * g.w..(y + 1) * g.w][clip(wx, g.w)] {
                        if v > m || v.is_nan() {
                            m = v;
                        }
                    }
                }
                out.push(m);
            }
        }
    }
    out
}

/// Average pooling of `planes` planes, as `avg_pool2d_f32` computes it.
pub fn avg_pool2d_ref(x: &[f32], planes: usize, g: &Window2d, count_include_pad: bool) -> Vec<f32> {
    let mut out = Vec::with_capacity(planes * g.oh * g.ow);
    for plane in x.chunks_exact(g.h * g.w).take(planes) {
        for oy in 0..g.oh {
            for ox in 0..g.ow {
                let (wy, wx) = g.windows(oy, ox);
                let padded = ((wy.1 - wy.0) * (wx.1 - wx.0)) as usize;
                let (rows, cols) = (clip(wy, g.h), clip(wx, g.w));
                let count = if count_include_pad {
                    padded
                } else {
                    rows.len() * cols.len()
                };
                let mut sum = 0f32;
                for y in rows {
                    sum += plane[y * g.w..(y + 1) * g.w][cols.clone()]
                        .iter()
                        .sum::<f32>();
                }
                out.push(sum / count as f32);
            }
        }
    }
    out
}

/// im2col of one image `[c, h, w]`: `[c kh kw, oh ow]`, row-major.
pub fn im2col_ref(x: &[f32], c: usize, g: &Window2d) -> Vec<f32> {
    let [kh, kw] = g.kernel;
    let mut col = Vec::with_capacity(c * kh * kw * g.oh * g.ow);
    for ch in 0..c {
        for ky in 0..kh {
            for kx in 0..kw {
                for oy in 0..g.oh {
                    for ox in 0..g.ow {
                        col.push(match im2col_source(g, ky, kx, oy, ox) {
                            Some((iy, ix)) => x[(ch * g.h + iy) * g.w + ix],
                            None => 0.0,
                        });
                    }
                }
            }
        }
    }
    col
}

/// im2col of `images` images `[images, c, h, w]` side by side, as the
/// `im2col_f32` kernel writes it: `[c kh kw, images, oh ow]`, so that a
/// batch's convolution is one GEMM, `weight [out, c kh kw] x col [c kh kw,
/// images oh ow]`. For one image, the same as [`im2col_ref`].
pub fn im2col_stacked_ref(x: &[f32], images: usize, c: usize, g: &Window2d) -> Vec<f32> {
    let per_image: Vec<Vec<f32>> = x
        .chunks_exact(c * g.h * g.w)
        .take(images)
        .map(|img| im2col_ref(img, c, g))
        .collect();
    let p = g.oh * g.ow;
    let mut col = Vec::with_capacity(images * c * g.kernel[0] * g.kernel[1] * p);
    for kk in 0..c * g.kernel[0] * g.kernel[1] {
        for img in &per_image {
            col.extend_from_slice(&img[kk * p..(kk + 1) * p]);
        }
    }
    col
}

/// Where `im2col_f32` reads element `i` of its stacked output for an input
/// `[images, c, h, w]`: the input's flat index, or `None` for padding. The
/// kernel's index math, line for line.
pub fn im2col_stacked_source(i: usize, images: usize, c: usize, g: &Window2d) -> Option<usize> {
    let [kh, kw] = g.kernel;
    let ox = i % g.ow;
    let mut t = i / g.ow;
    let oy = t % g.oh;
    t /= g.oh;
    let img = t % images;
    t /= images;
    let kx = t % kw;
    t /= kw;
    let ky = t % kh;
    t /= kh;
    let ch = t;
    debug_assert!(ch < c);
    let (iy, ix) = im2col_source(g, ky, kx, oy, ox)?;
    Some(((img * c + ch) * g.h + iy) * g.w + ix)
}

/// Where `swap_outer_f32` reads element `i` of its output `[b, a, c]` from
/// its input `[a, b, c]`. The kernel's index math, line for line.
pub fn swap_outer_source(i: usize, a: usize, b: usize, c: usize) -> usize {
    let k = i % c;
    let t = i / c;
    let ai = t % a;
    let bi = t / a;
    (ai * b + bi) * c + k
}

/// `y[j][i][k] = x[i][j][k]` for `x` of shape `[a, b, c]`.
pub fn swap_outer_ref(x: &[f32], a: usize, b: usize, c: usize) -> Vec<f32> {
    let mut y = Vec::with_capacity(a * b * c);
    for j in 0..b {
        for i in 0..a {
            y.extend_from_slice(&x[(i * b + j) * c..(i * b + j + 1) * c]);
        }
    }
    y
}

/// Convolution of a batch as the executor runs it for more than one image:
/// [`im2col_stacked_ref`], one GEMM over every image, then
/// [`swap_outer_ref`] back to `[images, out, oh ow]`.
pub fn conv2d_stacked_ref(
    x: &[f32],
    images: usize,
    c: usize,
    weight: &[f32],
    out: usize,
    g: &Window2d,
) -> Vec<f32> {
    let col = im2col_stacked_ref(x, images, c, g);
    let k = c * g.kernel[0] * g.kernel[1];
    let n = images * g.oh * g.ow;
    let mut y = vec![0f32; out * n];
    for o in 0..out {
        for kk in 0..k {
            let wv = weight[o * k + kk];
            for j in 0..n {
                y[o * n + j] += wv * col[kk * n + j];
            }
        }
    }
    swap_outer_ref(&y, out, images, g.oh * g.ow)
}

/// Convolution of one image as the executor runs it: im2col, then
/// `weight [out, c kh kw] x col [c kh kw, oh ow]`.
pub fn conv2d_im2col_ref(
    x: &[f32],
    c: usize,
    weight: &[f32],
    out: usize,
    g: &Window2d,
) -> Vec<f32> {
    let col = im2col_ref(x, c, g);
    let k = c * g.kernel[0] * g.kernel[1];
    let p = g.oh * g.ow;
    let mut y = vec![0f32; out * p];
    for o in 0..out {
        for kk in 0..k {
            let wv = weight[o * k + kk];
            for j in 0..p {
                y[o * p + j] += wv * col[kk * p + j];
            }
        }
    }
    y
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exec::test_values::noise;

    fn close(got: &[f32], want: &[f32]) {
        assert_eq!(got.len(), want.len(), "{got:?} vs {want:?}");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
                "element {i}: {g} vs {w}"
            );
        }
    }

    #[test]
    fn out_len_follows_pytorch() {
        // floor((H + 2p - k) / s) + 1
        assert_eq!(out_len(224, 7, 2, 3, false), Ok(112));
        assert_eq!(pool_out_len(112, 3, 2, 1, false), Ok(56));
        assert_eq!(pool_out_len(147, 3, 2, 0, false), Ok(73));
        // ceil_mode: 5 with k 2 s 2 -> ceil(3 / 2) + 1 = 3 (torch gives 3).
        assert_eq!(pool_out_len(5, 2, 2, 0, true), Ok(3));
        // ceil_mode, but the last window would start in the right padding:
        // len 4, k 2, s 2, p 1: ceil(4 / 2) + 1 = 3, (3 - 1) 2 = 4 >= 4 + 1? no -> 3.
        assert_eq!(pool_out_len(4, 2, 2, 1, true), Ok(3));
        // len 6, k 3, s 3, p 1: span 5, ceil(5/3) + 1 = 3, (3 - 1) 3 = 6 >= 7? no.
        assert_eq!(pool_out_len(6, 3, 3, 1, true), Ok(3));
        // len 5, k 3, s 3, p 1: span 4, ceil(4/3)+1 = 3, 6 >= 6 -> 2 (torch: 2).
        assert_eq!(pool_out_len(5, 3, 3, 1, true), Ok(2));
        assert!(pool_out_len(5, 2, 2, 2, false).is_err(), "pad > k / 2");
        assert!(
            out_len(2, 5, 1, 0, false).is_err(),
            "kernel larger than input"
        );
        assert!(out_len(4, 0, 1, 0, false).is_err());
    }

    #[test]
    fn windows_clip_at_len_plus_pad() {
        // len 5, k 3, s 2, p 1: windows [-1, 2), [1, 4), [3, 6).
        assert_eq!(pool_window(0, 3, 2, 1, 5), (-1, 2));
        assert_eq!(pool_window(2, 3, 2, 1, 5), (3, 6));
        // A ceil_mode window hanging past the padding is cut at len + pad.
        assert_eq!(pool_window(2, 2, 2, 0, 5), (4, 5));
        assert_eq!(clip((-1, 2), 5), 0..2);
        assert_eq!(clip((3, 6), 5), 3..5);
        assert_eq!(clip((-3, -1), 5), 0..0);
    }

    #[test]
    fn adaptive_bins_cover_the_input() {
        assert_eq!(adaptive_bin(0, 7, 1), 0..7);
        // torch: 5 -> 3 bins [0,2), [1,4), [3,5).
        assert_eq!(adaptive_bin(0, 5, 3), 0..2);
        assert_eq!(adaptive_bin(1, 5, 3), 1..4);
        assert_eq!(adaptive_bin(2, 5, 3), 3..5);
    }

    #[test]
    fn max_pool_pads_with_minus_infinity_and_keeps_nan() {
        // 1 plane 3x3 = 0..9, k 2, s 2, p 1 -> 2x2 of maxima.
        let x: Vec<f32> = (0..9).map(|v| v as f32 - 20.0).collect();
        let g = Window2d::pool(3, 3, [2, 2], [2, 2], [1, 1], false).unwrap();
        assert_eq!((g.oh, g.ow), (2, 2));
        close(&max_pool2d_ref(&x, 1, &g), &[-20.0, -18.0, -14.0, -12.0]);
        let mut y = x.clone();
        y[4] = f32::NAN;
        assert!(max_pool2d_ref(&y, 1, &g)[3].is_nan());
    }

    #[test]
    fn avg_pool_divisors() {
        // 1 plane 2x2 of ones, k 3, s 1, p 1: 2x2 outputs.
        let x = vec![1f32; 4];
        let g = Window2d::pool(2, 2, [3, 3], [1, 1], [1, 1], false).unwrap();
        // Each window holds 4 real ones; count_include_pad divides by 9.
        close(&avg_pool2d_ref(&x, 1, &g, true), &[4.0 / 9.0; 4]);
        close(&avg_pool2d_ref(&x, 1, &g, false), &[1.0; 4]);
        // ceil_mode: len 3, k 2, s 2 -> 2 outputs; the last window [2, 3) is
        // cut at len + pad = 3, so it divides by 1 even with count_include_pad
        // (PyTorch: avg_pool2d(ones(1,1,3,3), 2, 2, ceil_mode=True) == 1).
        let x = vec![1f32; 9];
        let g = Window2d::pool(3, 3, [2, 2], [2, 2], [0, 0], true).unwrap();
        close(&avg_pool2d_ref(&x, 1, &g, true), &[1.0; 4]);
        // ceil_mode with padding: len 3, k 2, s 2, p 1 -> windows [-1,1), [1,3).
        let g = Window2d::pool(3, 3, [2, 2], [2, 2], [1, 1], true).unwrap();
        assert_eq!((g.oh, g.ow), (2, 2));
        close(&avg_pool2d_ref(&x, 1, &g, true), &[0.25, 0.5, 0.5, 1.0]);
        close(&avg_pool2d_ref(&x, 1, &g, false), &[1.0; 4]);
    }

    /// A direct convolution loop written from OPS.md.
    fn conv_direct(x: &[f32], c: usize, weight: &[f32], out: usize, g: &Window2d) -> Vec<f32> {
        let [kh, kw] = g.kernel;
        let mut y = Vec::new();
        for o in 0..out {
            for oy in 0..g.oh {
                for ox in 0..g.ow {
                    let mut s = 0f32;
                    for ch in 0..c {
                        for ky in 0..kh {
                            for kx in 0..kw {
                                let iy = (oy * g.stride[0] + ky) as i64 - g.padding[0] as i64;
                                let ix = (ox * g.stride[1] + kx) as i64 - g.padding[1] as i64;
                                if iy < 0 || ix < 0 || iy >= g.h as i64 || ix >= g.w as i64 {
                                    continue;
                                }
                                s += x[(ch * g.h + iy as usize) * g.w + ix as usize]
                                    * weight[((o * c + ch) * kh + ky) * kw + kx];
                            }
                        }
                    }
                    y.push(s);
                }
            }
        }
        y
    }

    #[test]
    fn im2col_gemm_is_a_convolution() {
        for (h, w, kernel, stride, padding) in [
            (5, 5, [3, 3], [1, 1], [1, 1]),
            (7, 6, [3, 2], [2, 1], [1, 0]),
            (9, 9, [7, 7], [2, 2], [3, 3]),
            (4, 4, [1, 1], [2, 2], [0, 0]),
            (8, 5, [1, 7], [1, 1], [0, 3]),
        ] {
            let (c, out) = (3, 4);
            let g = Window2d::conv(h, w, kernel, stride, padding).unwrap();
            let x = noise(c * h * w, 1);
            let weight = noise(out * c * kernel[0] * kernel[1], 2);
            close(
                &conv2d_im2col_ref(&x, c, &weight, out, &g),
                &conv_direct(&x, c, &weight, out, &g),
            );
        }
    }

    #[test]
    fn one_gemm_over_side_by_side_images_is_each_images_convolution() {
        for (h, w, kernel, stride, padding) in [
            (5, 5, [3, 3], [1, 1], [1, 1]),
            (7, 6, [3, 2], [2, 1], [1, 0]),
            (4, 4, [1, 1], [1, 1], [0, 0]),
            (4, 4, [1, 1], [2, 2], [0, 0]),
        ] {
            let (c, out) = (3, 4);
            let g = Window2d::conv(h, w, kernel, stride, padding).unwrap();
            let weight = noise(out * c * kernel[0] * kernel[1], 2);
            for images in [1, 2, 3] {
                let x = noise(images * c * h * w, 1 + images as u32);
                let want: Vec<f32> = x
                    .chunks_exact(c * h * w)
                    .flat_map(|img| conv_direct(img, c, &weight, out, &g))
                    .collect();
                close(&conv2d_stacked_ref(&x, images, c, &weight, out, &g), &want);
            }
            // One image: the stacked layout is the per-image one.
            let x = noise(c * h * w, 9);
            assert_eq!(im2col_stacked_ref(&x, 1, c, &g), im2col_ref(&x, c, &g));
            // The kernel's index math writes the reference's layout.
            let images = 3;
            let x = noise(images * c * h * w, 4);
            let want = im2col_stacked_ref(&x, images, c, &g);
            let got: Vec<f32> = (0..want.len())
                .map(|i| im2col_stacked_source(i, images, c, &g).map_or(0.0, |j| x[j]))
                .collect();
            assert_eq!(got, want);
        }
    }

    #[test]
    fn swap_outer_swaps_the_two_outer_axes() {
        // x [2, 3, 2]: x[i][j][k] = 100 i + 10 j + k.
        let x: Vec<f32> = (0..2)
            .flat_map(|i| {
                (0..3).flat_map(move |j| (0..2).map(move |k| (100 * i + 10 * j + k) as f32))
            })
            .collect();
        let y = swap_outer_ref(&x, 2, 3, 2);
        let by_index: Vec<f32> = (0..x.len())
            .map(|i| x[swap_outer_source(i, 2, 3, 2)])
            .collect();
        assert_eq!(by_index, y);
        let want: Vec<f32> = (0..3)
            .flat_map(|j| {
                (0..2).flat_map(move |i| (0..2).map(move |k| (100 * i + 10 * j + k) as f32))
            })
            .collect();
        assert_eq!(y, want);
    }
}
