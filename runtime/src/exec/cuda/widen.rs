//! The CUDA C source of the kernels that widen a half-precision package's
//! parameters to f32 on the device, for NVRTC to compile next to
//! [`super::kernels::KERNEL_SOURCE`].
//!
//! How an upload uses them (see `distmind_models::dtype`): a half package's
//! device layout is its stored layout with every offset and size doubled,
//! and widening a whole stored group element by element gives the device
//! group (padding is zero bytes, and zero widens to `+0.0`). So a group
//! upload copies the group's stored bytes (`GroupEntry::bytes`) into a
//! device staging buffer and launches one kernel over the whole group,
//! `n = stored bytes / 2` elements, writing f32 at the group's device offset
//! (`GroupEntry::device_offset(param_dtype)`) in the arena. The copy cannot
//! widen in place: the f32 output overlaps the input it has not read yet.
//!
//! The kernels transcribe `distmind_models::dtype::{bf16_to_f32,
//! f16_to_f32}` (the unit-tested reference) bit for bit: bf16 is shifted into
//! an f32's top half; f16 is rebiased, with subnormals, signed zeros,
//! infinities and NaN payloads exact. One thread per element, grid-stride
//! so that any grid is correct; launch [`widen_grid`] blocks of
//! [`WIDEN_THREADS`] threads with arguments `(src, dst, n)`: the staging
//! buffer's device address (`u64`), the destination's (`u64`) and the
//! element count (`i64`).

use distmind_models::ParamDtype;

/// Kernel names: bf16 and f16 to f32.
pub const WIDEN_BF16_KERNEL: &str = "widen_bf16_f32";
pub const WIDEN_F16_KERNEL: &str = "widen_f16_f32";

/// Threads per block of the widening kernels.
pub const WIDEN_THREADS: u32 = 256;

/// Largest grid the widening launches use; beyond it threads loop.
pub const WIDEN_GRID_MAX: u32 = 1 << 20;

/// The CUDA C source (NVRTC, no headers).
pub const WIDEN_SOURCE: &str = r#"
/* bf16 -> f32: the bf16 bits are the f32's top 16 bits. */
extern "C" __global__ void widen_bf16_f32(const unsigned short* src, float* dst, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)blockDim.x * gridDim.x) {
        dst[i] = __uint_as_float(((unsigned int)src[i]) << 16);
    }
}

/* f16 -> f32, exact for every pattern (F. Giesen's half_to_float). */
extern "C" __global__ void widen_f16_f32(const unsigned short* src, float* dst, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)blockDim.x * gridDim.x) {
        unsigned int h = src[i];
        /* Exponent and mantissa in place, exponent rebiased from 15 to 127. */
        unsigned int o = (h & 0x7fffu) << 13;
        unsigned int e = o & (0x7c00u << 13);
        o += (127u - 15u) << 23;
        if (e == (0x7c00u << 13)) {
            /* Infinity or NaN: the exponent becomes all ones, payload kept. */
            o += (128u - 16u) << 23;
        } else if (e == 0u) {
            /* Zero or subnormal: m 2^-24 = 2^-14 (1 + m/1024) - 2^-14, exact. */
            o += 1u << 23;
            o = __float_as_uint(__fsub_rn(__uint_as_float(o), __uint_as_float(113u << 23)));
        }
        dst[i] = __uint_as_float(o | ((h & 0x8000u) << 16));
    }
}
"#;

/// The kernel that widens `stored` to f32; `None` for f32 packages, whose
/// groups are copied as they are.
pub fn widen_kernel(stored: ParamDtype) -> Option<&'static str> {
    match stored {
        ParamDtype::F32 => None,
        ParamDtype::F16 => Some(WIDEN_F16_KERNEL),
        ParamDtype::BF16 => Some(WIDEN_BF16_KERNEL),
    }
}

/// Blocks of [`WIDEN_THREADS`] for `elements` elements: one thread per
/// element up to [`WIDEN_GRID_MAX`] blocks (the kernels loop beyond), at
/// least one block.
pub fn widen_grid(elements: u64) -> u32 {
    elements
        .div_ceil(u64::from(WIDEN_THREADS))
        .clamp(1, u64::from(WIDEN_GRID_MAX)) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_kernels_are_defined_once_with_the_documented_arguments() {
        for name in [WIDEN_BF16_KERNEL, WIDEN_F16_KERNEL] {
            let def = format!(
                "extern \"C\" __global__ void {name}(const unsigned short* src, float* dst, \
                 long long n)"
            );
            assert_eq!(WIDEN_SOURCE.matches(&def).count(), 1, "{name}");
        }
        assert_eq!(WIDEN_SOURCE.matches("__global__").count(), 2);
        // Nothing to collide with the main kernel source when compiled together.
        for name in super::super::kernels::KERNEL_NAMES {
            assert!(!WIDEN_SOURCE.contains(name), "{name}");
        }
        assert!(!WIDEN_SOURCE.contains("#define"));
    }

    /// The f16 kernel is a transcription of the models crate's reference:
    /// the same constants in the same roles.
    #[test]
    fn the_f16_kernel_uses_the_reference_constants() {
        for c in [
            "(h & 0x7fffu) << 13",
            "0x7c00u << 13",
            "(127u - 15u) << 23",
            "(128u - 16u) << 23",
            "1u << 23",
            "113u << 23",
            "(h & 0x8000u) << 16",
        ] {
            assert!(WIDEN_SOURCE.contains(c), "{c}");
        }
        // The reference agrees on the cases each branch handles.
        let f = distmind_models::dtype::f16_to_f32;
        assert_eq!(f(0x3c00), 1.0);
        assert_eq!(f(0x0001), 2f32.powi(-24));
        assert_eq!(f(0xfc00), f32::NEG_INFINITY);
    }

    #[test]
    fn kernels_and_grids() {
        assert_eq!(widen_kernel(ParamDtype::F32), None);
        assert_eq!(widen_kernel(ParamDtype::BF16), Some(WIDEN_BF16_KERNEL));
        assert_eq!(widen_kernel(ParamDtype::F16), Some(WIDEN_F16_KERNEL));
        assert_eq!(widen_grid(0), 1);
        assert_eq!(widen_grid(1), 1);
        assert_eq!(widen_grid(256), 1);
        assert_eq!(widen_grid(257), 2);
        assert_eq!(widen_grid(u64::MAX), WIDEN_GRID_MAX);
    }
}
