//! The CUDA C source of every kernel the `cuda` executor launches, compiled
//! once by NVRTC when a [`super::CudaExecutor`] starts, and the list of their
//! names. Plain strings, compiled in every build, so that tests without a GPU
//! can check them.
//!
//! Index math follows [`super::geometry`] line for line (window starts, the
//! `len + pad` clip, adaptive bins, im2col sources): the Rust functions there
//! are the unit-tested reference, the kernels are their transcriptions.
//! Numerics follow the `cpu` executor: f64 where it uses f64 (batch-norm
//! folding, layer-norm statistics; also erf gelu), `__fmul_rn` / `__fadd_rn` where
//! it multiplies then adds in f32 (no fused multiply-add), f32 elsewhere.
//!
//! Every kernel takes sizes as `long long` (Rust `i64`), flags as `int`
//! (`i32`), pointers as device addresses (`u64`), and loops grid-stride, so
//! any grid size is correct.

/// Kernel names, in the order of [`KERNEL_NAMES`]'s users (`Kernel as usize`).
pub const KERNEL_NAMES: [&str; 19] = [
    "relu_f32",
    "tanh_f32",
    "gelu_erf_f32",
    "gelu_tanh_f32",
    "add_f32",
    "bias_add_f32",
    "batch_norm_f32",
    "im2col_f32",
    "max_pool2d_f32",
    "avg_pool2d_f32",
    "adaptive_avg_pool2d_f32",
    "concat_copy_f32",
    "select_f32",
    "embedding_f32",
    "layer_norm_f32",
    "softmax_rows_f32",
    "split_heads_f32",
    "merge_heads_f32",
    "swap_outer_f32",
];

/// Threads per block of the row-reduction kernels (`layer_norm_f32`,
/// `softmax_rows_f32`); must equal `REDUCE_THREADS` in the source.
pub const REDUCE_THREADS: u32 = 256;

/// The CUDA C source (NVRTC, no headers).
pub const KERNEL_SOURCE: &str = r#"
#define REDUCE_THREADS 256
#define GRID_STRIDE(i, n) \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
         i += (long long)blockDim.x * gridDim.x)
#define NEG_INF __int_as_float(0xff800000)

extern "C" __global__ void relu_f32(const float* x, float* y, long long n) {
    /* Rust's f32::max: max(NaN, 0) = 0, as fmaxf. */
    GRID_STRIDE(i, n) { y[i] = fmaxf(x[i], 0.0f); }
}

extern "C" __global__ void tanh_f32(const float* x, float* y, long long n) {
    GRID_STRIDE(i, n) { y[i] = tanhf(x[i]); }
}

/* 0.5 x (1 + erf(x / sqrt 2)), in f64 (candle's erf_f32 agrees to ~1e-7). */
extern "C" __global__ void gelu_erf_f32(const float* x, float* y, long long n) {
    GRID_STRIDE(i, n) {
        double v = (double)x[i];
        y[i] = (float)(v * (1.0 + erf(v * 0.70710678118654752440)) * 0.5);
    }
}

/* 0.5 x (1 + tanh(sqrt(2/pi) x (1 + 0.044715 x^2))), f32 as candle's gelu. */
extern "C" __global__ void gelu_tanh_f32(const float* x, float* y, long long n) {
    GRID_STRIDE(i, n) {
        float v = x[i];
        y[i] = 0.5f * v * (1.0f + tanhf(0.7978845608028654f * v * (1.0f + 0.044715f * v * v)));
    }
}

extern "C" __global__ void add_f32(const float* a, const float* b, float* y, long long n) {
    GRID_STRIDE(i, n) { y[i] = a[i] + b[i]; }
}

/* y[i] += bias[(i / inner) % channels]: conv (inner = H W) and linear (inner = 1). */
extern "C" __global__ void bias_add_f32(float* y, const float* bias, long long n,
                                        long long inner, long long channels) {
    GRID_STRIDE(i, n) { y[i] += bias[(i / inner) % channels]; }
}

/* Inference batch norm from the layer's own params: scale = w / sqrt(var + eps) and
   shift = b - mean scale in f64 (the cpu executor's fold), rounded to f32, then
   y = x scale + shift in f32. Each element folds its channel again, so a program
   keeps no folded copy and its first run launches nothing more than later ones. */
extern "C" __global__ void batch_norm_f32(const float* x, const float* w, const float* b,
                                          const float* mean, const float* var, double eps,
                                          float* y, long long n, long long plane,
                                          long long channels) {
    GRID_STRIDE(i, n) {
        long long c = (i / plane) % channels;
        double s = (double)w[c] / sqrt((double)var[c] + eps);
        float scale = (float)s;
        float shift = (float)((double)b[c] - (double)mean[c] * s);
        y[i] = __fadd_rn(__fmul_rn(x[i], scale), shift);
    }
}

/* col[(c kh + ky) kw + kx][img][oy ow + ox] = x[img][c][oy sh - ph + ky][ox sw - pw + kx], 0 outside:
   the images side by side, so that one GEMM covers the batch (for one image, the same as
   [img][c kh kw][oh ow]). */
extern "C" __global__ void im2col_f32(const float* x, float* col, long long images,
                                      long long c, long long h, long long w,
                                      long long kh, long long kw, long long sh, long long sw,
                                      long long ph, long long pw, long long oh, long long ow) {
    long long n = images * c * kh * kw * oh * ow;
    GRID_STRIDE(i, n) {
        long long ox = i % ow;
        long long t = i / ow;
        long long oy = t % oh; t /= oh;
        long long img = t % images; t /= images;
        long long kx = t % kw; t /= kw;
        long long ky = t % kh; t /= kh;
        long long ch = t;
        long long iy = oy * sh - ph + ky;
        long long ix = ox * sw - pw + kx;
        float v = 0.0f;
        if (iy >= 0 && iy < h && ix >= 0 && ix < w) {
            v = x[((img * c + ch) * h + iy) * w + ix];
        }
        col[i] = v;
    }
}

/* y[j][i][k] = x[i][j][k] for x [a, b, c]: a GEMM's output over side-by-side images
   [out][img][oh ow] back to [img][out][oh ow]. */
extern "C" __global__ void swap_outer_f32(const float* x, float* y, long long a, long long b,
                                          long long c) {
    GRID_STRIDE(i, a * b * c) {
        long long k = i % c;
        long long t = i / c;
        long long ai = t % a;
        long long bi = t / a;
        y[i] = x[(ai * b + bi) * c + k];
    }
}

/* Window o along one axis: start = o s - pad, end = min(start + k, len + pad). */
__device__ void pool_window(long long o, long long k, long long s, long long pad,
                            long long len, long long* start, long long* end) {
    *start = o * s - pad;
    long long e = *start + k;
    *end = e < len + pad ? e : len + pad;
}

extern "C" __global__ void max_pool2d_f32(const float* x, float* y, long long planes,
                                          long long h, long long w, long long oh, long long ow,
                                          long long kh, long long kw, long long sh, long long sw,
                                          long long ph, long long pw) {
    GRID_STRIDE(i, planes * oh * ow) {
        long long ox = i % ow;
        long long oy = (i / ow) % oh;
        long long p = i / (ow * oh);
        long long y0, y1, x0, x1;
        pool_window(oy, kh, sh, ph, h, &y0, &y1);
        pool_window(ox, kw, sw, pw, w, &x0, &x1);
        if (y0 < 0) y0 = 0;
        if (y1 > h) y1 = h;
        if (x0 < 0) x0 = 0;
        if (x1 > w) x1 = w;
        const float* plane = x + p * h * w;
        float m = NEG_INF;
        for (long long yy = y0; yy < y1; ++yy) {
            for (long long xx = x0; xx < x1; ++xx) {
                float v = plane[yy * w + xx];
                if (v > m || v != v) m = v;
            }
        }
        y[i] = m;
    }
}

extern "C" __global__ void avg_pool2d_f32(const float* x, float* y, long long planes,
                                          long long h, long long w, long long oh, long long ow,
                                          long long kh, long long kw, long long sh, long long sw,
                                          long long ph, long long pw, int count_include_pad) {
    GRID_STRIDE(i, planes * oh * ow) {
        long long ox = i % ow;
        long long oy = (i / ow) % oh;
        long long p = i / (ow * oh);
        long long y0, y1, x0, x1;
        pool_window(oy, kh, sh, ph, h, &y0, &y1);
        pool_window(ox, kw, sw, pw, w, &x0, &x1);
        long long padded = (y1 - y0) * (x1 - x0);
        if (y0 < 0) y0 = 0;
        if (y1 > h) y1 = h;
        if (x0 < 0) x0 = 0;
        if (x1 > w) x1 = w;
        long long rows = y1 > y0 ? y1 - y0 : 0;
        long long cols = x1 > x0 ? x1 - x0 : 0;
        long long count = count_include_pad ? padded : rows * cols;
        const float* plane = x + p * h * w;
        float sum = 0.0f;
        for (long long yy = y0; yy < y1; ++yy) {
            float row = 0.0f;
            for (long long xx = x0; xx < x1; ++xx) row += plane[yy * w + xx];
            sum += row;
        }
        y[i] = sum / (float)count;
    }
}

/* PyTorch's adaptive bins: [floor(i L / o), ceil((i + 1) L / o)). */
extern "C" __global__ void adaptive_avg_pool2d_f32(const float* x, float* y, long long planes,
                                                   long long h, long long w,
                                                   long long oh, long long ow) {
    GRID_STRIDE(i, planes * oh * ow) {
        long long ox = i % ow;
        long long oy = (i / ow) % oh;
        long long p = i / (ow * oh);
        long long y0 = (oy * h) / oh, y1 = ((oy + 1) * h + oh - 1) / oh;
        long long x0 = (ox * w) / ow, x1 = ((ox + 1) * w + ow - 1) / ow;
        const float* plane = x + p * h * w;
        float sum = 0.0f;
        for (long long yy = y0; yy < y1; ++yy) {
            float row = 0.0f;
            for (long long xx = x0; xx < x1; ++xx) row += plane[yy * w + xx];
            sum += row;
        }
        y[i] = sum / (float)((y1 - y0) * (x1 - x0));
    }
}

/* One concat input [outer, src_inner] into dst [outer, dst_inner] at column dst_offset. */
extern "C" __global__ void concat_copy_f32(const float* src, float* dst, long long outer,
                                           long long src_inner, long long dst_inner,
                                           long long dst_offset) {
    GRID_STRIDE(i, outer * src_inner) {
        long long o = i / src_inner;
        long long r = i % src_inner;
        dst[o * dst_inner + dst_offset + r] = src[i];
    }
}

/* dst[o][r] = src[o][index][r] for a source [outer, dim_len, inner]. */
extern "C" __global__ void select_f32(const float* src, float* dst, long long outer,
                                      long long dim_len, long long inner, long long index) {
    GRID_STRIDE(i, outer * inner) {
        long long o = i / inner;
        long long r = i % inner;
        dst[i] = src[(o * dim_len + index) * inner + r];
    }
}

/* mode 0: row ids[r]; 1: row r % len (positions); 2: row 0. Ids were checked on the
   host; an id outside the table still yields NaN here rather than a wild read. */
extern "C" __global__ void embedding_f32(const long long* ids, const float* weight, float* y,
                                         long long rows, long long len, long long dim,
                                         long long num, int mode) {
    GRID_STRIDE(i, rows * dim) {
        long long r = i / dim;
        long long j = i % dim;
        long long id = mode == 0 ? ids[r] : (mode == 1 ? r % len : 0);
        y[i] = (id >= 0 && id < num) ? weight[id * dim + j] : __int_as_float(0x7fc00000);
    }
}

__device__ double block_sum_f64(double v, double* shared) {
    shared[threadIdx.x] = v;
    __syncthreads();
    for (int s = REDUCE_THREADS / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) shared[threadIdx.x] += shared[threadIdx.x + s];
        __syncthreads();
    }
    double r = shared[0];
    __syncthreads();
    return r;
}

__device__ float block_max_f32(float v, float* shared) {
    shared[threadIdx.x] = v;
    __syncthreads();
    for (int s = REDUCE_THREADS / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) shared[threadIdx.x] = fmaxf(shared[threadIdx.x], shared[threadIdx.x + s]);
        __syncthreads();
    }
    float r = shared[0];
    __syncthreads();
    return r;
}

__device__ float block_sum_f32(float v, float* shared) {
    shared[threadIdx.x] = v;
    __syncthreads();
    for (int s = REDUCE_THREADS / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) shared[threadIdx.x] += shared[threadIdx.x + s];
        __syncthreads();
    }
    float r = shared[0];
    __syncthreads();
    return r;
}

/* One block of REDUCE_THREADS per row (grid-stride over rows); statistics in f64, the
   biased variance; y = (float)((x - mean) rstd) * g + b in f32 as the cpu executor. */
extern "C" __global__ void layer_norm_f32(const float* x, const float* g, const float* b,
                                          float* y, long long rows, long long d, double eps) {
    __shared__ double shared[REDUCE_THREADS];
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* row = x + r * d;
        double s = 0.0;
        for (long long j = threadIdx.x; j < d; j += REDUCE_THREADS) s += (double)row[j];
        double mean = block_sum_f64(s, shared) / (double)d;
        double q = 0.0;
        for (long long j = threadIdx.x; j < d; j += REDUCE_THREADS) {
            double c = (double)row[j] - mean;
            q += c * c;
        }
        double var = block_sum_f64(q, shared) / (double)d;
        double rstd = 1.0 / sqrt(var + eps);
        for (long long j = threadIdx.x; j < d; j += REDUCE_THREADS) {
            float nrm = (float)(((double)row[j] - mean) * rstd);
            y[r * d + j] = __fadd_rn(__fmul_rn(nrm, g[j]), b[j]);
        }
    }
}

/* In place over rows of len scores: s / scale, keys j > query masked when causal
   (probability 0), softmax. The query of row r is r % len. */
extern "C" __global__ void softmax_rows_f32(float* s, long long rows, long long len,
                                            float scale, int causal) {
    __shared__ float shared[REDUCE_THREADS];
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        float* row = s + r * len;
        long long keys = causal ? (r % len) + 1 : len;
        float m = NEG_INF;
        for (long long j = threadIdx.x; j < keys; j += REDUCE_THREADS) m = fmaxf(m, row[j] / scale);
        m = block_max_f32(m, shared);
        float sum = 0.0f;
        for (long long j = threadIdx.x; j < keys; j += REDUCE_THREADS) sum += expf(row[j] / scale - m);
        sum = block_sum_f32(sum, shared);
        for (long long j = threadIdx.x; j < len; j += REDUCE_THREADS) {
            row[j] = j < keys ? expf(row[j] / scale - m) / sum : 0.0f;
        }
    }
}

/* dst [N, heads, L, d] from columns col_offset.. of src rows [N L, row_stride]. */
extern "C" __global__ void split_heads_f32(const float* src, float* dst, long long n,
                                           long long len, long long heads, long long d,
                                           long long row_stride, long long col_offset) {
    GRID_STRIDE(i, n * heads * len * d) {
        long long j = i % d;
        long long l = (i / d) % len;
        long long h = (i / (d * len)) % heads;
        long long b = i / (d * len * heads);
        dst[i] = src[(b * len + l) * row_stride + col_offset + h * d + j];
    }
}

/* dst [N, L, heads d] from src [N, heads, L, d]. */
extern "C" __global__ void merge_heads_f32(const float* src, float* dst, long long n,
                                           long long len, long long heads, long long d) {
    GRID_STRIDE(i, n * heads * len * d) {
        long long j = i % d;
        long long l = (i / d) % len;
        long long h = (i / (d * len)) % heads;
        long long b = i / (d * len * heads);
        dst[(b * len + l) * heads * d + h * d + j] = src[i];
    }
}
"#;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_named_kernel_is_defined_once() {
        assert!(!KERNEL_SOURCE.trim().is_empty());
        for name in KERNEL_NAMES {
            let def = format!("__global__ void {name}(");
            assert_eq!(
                KERNEL_SOURCE.matches(&def).count(),
                1,
                "kernel {name} must be defined exactly once"
            );
        }
        let defined = KERNEL_SOURCE
            .matches("extern \"C\" __global__ void ")
            .count();
        assert_eq!(defined, KERNEL_NAMES.len(), "a kernel is missing a name");
    }

    #[test]
    fn reduce_threads_match_the_source() {
        assert!(KERNEL_SOURCE.contains(&format!("#define REDUCE_THREADS {REDUCE_THREADS}\n")));
        assert!(REDUCE_THREADS.is_power_of_two());
    }

    /// The source without its `/* ... */` comments (which use interval
    /// notation such as `[a, b)`).
    fn code() -> String {
        let mut out = String::new();
        let mut rest = KERNEL_SOURCE;
        while let Some(start) = rest.find("/*") {
            out.push_str(&rest[..start]);
            let end = rest[start..].find("*/").expect("comment closed") + start + 2;
            rest = &rest[end..];
        }
        out.push_str(rest);
        out
    }

    #[test]
    fn braces_and_parentheses_balance() {
        let code = code();
        assert!(!code.contains("//"), "use /* */ comments in the kernels");
        for (open, close) in [('{', '}'), ('(', ')'), ('[', ']')] {
            let o = code.matches(open).count();
            let c = code.matches(close).count();
            assert_eq!(o, c, "{open} vs {close}");
        }
    }
}
