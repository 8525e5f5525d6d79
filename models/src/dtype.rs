//! How a package stores its parameters, and the exact widening to f32.
//!
//! A package keeps every parameter in one storage dtype, [`ParamDtype`]:
//! `f32`, or half precision (`f16`, `bf16`) to halve the bytes memory
//! servers hold and send and host caches keep. Executors compute in f32, so
//! half-precision bytes are widened when they reach a device.
//!
//! **Device layout.** The packed layout is computed on stored bytes (params
//! 512-byte aligned, groups cut at layer boundaries). On a device every
//! parameter is f32, so the device layout of a half package is the stored
//! layout with every offset and size multiplied by
//! [`ParamDtype::widen_factor`] (2; 1 for f32): alignment still holds, and
//! because padding is zero bytes and zero widens to `+0.0`, **widening a
//! whole stored group element by element gives exactly the device group**.
//! An upload therefore widens the group's bytes as one flat array
//! ([`widen`] / [`widen_to_le_bytes`] on the host, the kernel of the cuda
//! executor's `exec/cuda/widen.rs` on a GPU) and needs no per-param work.
//! [`ParamDtype::device_bytes`] is that mapping; the manifest's
//! `device_*` methods use it.
//!
//! Widening is exact for every value: bf16 is the top half of an f32 (a
//! shift), and every f16, subnormals, infinities and NaN payloads included,
//! is an f32 value.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::ModelError;

/// The dtype a package stores its parameters in (the manifest's
/// `param_dtype`; `F32` when absent, as in every package written before
/// half-precision storage existed). Serialised with safetensors' spelling.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub enum ParamDtype {
    #[default]
    F32,
    F16,
    BF16,
}

impl ParamDtype {
    pub const ALL: [ParamDtype; 3] = [ParamDtype::F32, ParamDtype::F16, ParamDtype::BF16];

    /// Bytes per stored element.
    pub const fn size_bytes(self) -> u64 {
        match self {
            ParamDtype::F32 => 4,
            ParamDtype::F16 | ParamDtype::BF16 => 2,
        }
    }

    /// Device (f32) bytes per stored byte: 1 for f32, 2 for half precision.
    pub const fn widen_factor(self) -> u64 {
        4 / self.size_bytes()
    }

    /// The device (f32) size or offset of a stored size or offset: the one
    /// mapping from the stored layout to the device layout.
    pub const fn device_bytes(self, stored: u64) -> u64 {
        stored * self.widen_factor()
    }

    pub const fn is_half(self) -> bool {
        !matches!(self, ParamDtype::F32)
    }

    /// Lower-case name, as `model gen --dtype` takes it.
    pub const fn as_str(self) -> &'static str {
        match self {
            ParamDtype::F32 => "f32",
            ParamDtype::F16 => "f16",
            ParamDtype::BF16 => "bf16",
        }
    }

    /// The safetensors dtype name (`F32`, `F16`, `BF16`).
    pub const fn safetensors_name(self) -> &'static str {
        match self {
            ParamDtype::F32 => "F32",
            ParamDtype::F16 => "F16",
            ParamDtype::BF16 => "BF16",
        }
    }

    /// The storage dtype of a safetensors dtype name; `None` for the
    /// non-float (or other float) dtypes a parameter may not have.
    pub fn from_safetensors(name: &str) -> Option<ParamDtype> {
        ParamDtype::ALL
            .into_iter()
            .find(|d| d.safetensors_name() == name)
    }

    /// The element nearest `v` in this dtype (round to nearest, ties to
    /// even; NaN stays NaN), as little-endian bytes appended to `out`.
    pub fn push_narrowed(self, v: f32, out: &mut Vec<u8>) {
        match self {
            ParamDtype::F32 => out.extend_from_slice(&v.to_le_bytes()),
            ParamDtype::F16 => out.extend_from_slice(&half::f16::from_f32(v).to_le_bytes()),
            ParamDtype::BF16 => out.extend_from_slice(&half::bf16::from_f32(v).to_le_bytes()),
        }
    }

    /// How many of the little-endian elements in `bytes` are NaN or
    /// infinite (`bytes.len()` a multiple of the element size).
    pub fn count_non_finite(self, bytes: &[u8]) -> usize {
        match self {
            ParamDtype::F32 => bytes
                .chunks_exact(4)
                .filter(|c| !f32::from_le_bytes([c[0], c[1], c[2], c[3]]).is_finite())
                .count(),
            // All-ones exponent: infinity or NaN.
            ParamDtype::F16 => count_u16(bytes, |b| b & 0x7c00 == 0x7c00),
            ParamDtype::BF16 => count_u16(bytes, |b| b & 0x7f80 == 0x7f80),
        }
    }
}

fn count_u16(bytes: &[u8], pred: impl Fn(u16) -> bool) -> usize {
    bytes
        .chunks_exact(2)
        .filter(|c| pred(u16::from_le_bytes([c[0], c[1]])))
        .count()
}

impl fmt::Display for ParamDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for ParamDtype {
    type Err = ModelError;
    /// `f32`, `f16` or `bf16` (any case).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ParamDtype::ALL
            .into_iter()
            .find(|d| d.as_str().eq_ignore_ascii_case(s))
            .ok_or_else(|| ModelError::UnknownDtype(s.to_string()))
    }
}

/// The f32 of a bf16 bit pattern (exact: bf16 is an f32's top 16 bits).
#[inline(always)]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// The f32 of an f16 bit pattern, exact for every pattern: normals,
/// subnormals (which are normal f32s), signed zeros, infinities and NaN
/// (payload kept, shifted into the f32 mantissa's top bits). Branch-free up
/// to selects, so loops over it vectorize (F. Giesen's `half_to_float`).
#[inline(always)]
pub fn f16_to_f32(bits: u16) -> f32 {
    // 2^-14: the smallest normal f16, which the subnormal path subtracts.
    const MAGIC: f32 = f32::from_bits(113 << 23);
    const SHIFTED_EXP: u32 = 0x7c00 << 13;
    let h = u32::from(bits);
    // Exponent and mantissa in place, exponent rebiased from 15 to 127.
    let shifted = (h & 0x7fff) << 13;
    let exp = shifted & SHIFTED_EXP;
    let normal = shifted + ((127 - 15) << 23);
    // Infinity or NaN: the exponent becomes all ones.
    let inf_nan = normal + ((128 - 16) << 23);
    // Zero or subnormal: m * 2^-24 = (2^-14 (1 + m/1024)) - 2^-14, exact.
    let subnormal = (f32::from_bits(normal + (1 << 23)) - MAGIC).to_bits();
    // All three computed, one selected: selects vectorize, branches do not.
    let o = if exp == SHIFTED_EXP {
        inf_nan
    } else if exp == 0 {
        subnormal
    } else {
        normal
    };
    f32::from_bits(o | ((h & 0x8000) << 16))
}

/// Elements per inner block: fixed-size blocks let the compiler drop bounds
/// checks and vectorize the loop.
const BLOCK: usize = 64;

fn check_lengths(dtype: ParamDtype, src: usize, dst_elems: usize) {
    assert!(
        src == dst_elems * dtype.size_bytes() as usize,
        "widening {src} stored {dtype} bytes into {dst_elems} f32 elements: the stored bytes \
         must hold exactly one {dtype} per f32 ({} bytes)",
        dst_elems * dtype.size_bytes() as usize
    );
}

#[inline(always)]
fn widen_u16_with(src: &[u8], dst: &mut [f32], f: impl Fn(u16) -> f32 + Copy) {
    let mut s = src.chunks_exact(2 * BLOCK);
    let mut d = dst.chunks_exact_mut(BLOCK);
    for (s, d) in (&mut s).zip(&mut d) {
        let s: &[u8; 2 * BLOCK] = s.try_into().expect("exact chunk");
        let d: &mut [f32; BLOCK] = d.try_into().expect("exact chunk");
        for i in 0..BLOCK {
            d[i] = f(u16::from_le_bytes([s[2 * i], s[2 * i + 1]]));
        }
    }
    for (c, o) in s.remainder().chunks_exact(2).zip(d.into_remainder()) {
        *o = f(u16::from_le_bytes([c[0], c[1]]));
    }
}

#[inline(always)]
fn widen_u16_to_bytes_with(src: &[u8], dst: &mut [u8], f: impl Fn(u16) -> f32 + Copy) {
    let mut s = src.chunks_exact(2 * BLOCK);
    let mut d = dst.chunks_exact_mut(4 * BLOCK);
    for (s, d) in (&mut s).zip(&mut d) {
        let s: &[u8; 2 * BLOCK] = s.try_into().expect("exact chunk");
        let d: &mut [u8; 4 * BLOCK] = d.try_into().expect("exact chunk");
        for i in 0..BLOCK {
            let v = f(u16::from_le_bytes([s[2 * i], s[2 * i + 1]])).to_bits();
            // Byte by byte with shifts: a pattern the compiler vectorizes.
            d[4 * i] = v as u8;
            d[4 * i + 1] = (v >> 8) as u8;
            d[4 * i + 2] = (v >> 16) as u8;
            d[4 * i + 3] = (v >> 24) as u8;
        }
    }
    for (c, o) in s
        .remainder()
        .chunks_exact(2)
        .zip(d.into_remainder().chunks_exact_mut(4))
    {
        o.copy_from_slice(&f(u16::from_le_bytes([c[0], c[1]])).to_le_bytes());
    }
}

/// Widens little-endian bf16 values (`src`, 2 bytes each) into `dst`.
///
/// # Panics
/// If `src.len() != 2 * dst.len()`.
pub fn widen_bf16(src: &[u8], dst: &mut [f32]) {
    check_lengths(ParamDtype::BF16, src.len(), dst.len());
    widen_u16_with(src, dst, bf16_to_f32);
}

/// Widens little-endian f16 values (`src`, 2 bytes each) into `dst`.
///
/// # Panics
/// If `src.len() != 2 * dst.len()`.
pub fn widen_f16(src: &[u8], dst: &mut [f32]) {
    check_lengths(ParamDtype::F16, src.len(), dst.len());
    widen_u16_with(src, dst, f16_to_f32);
}

/// Widens little-endian values stored as `dtype` into `dst` (f32 is copied).
/// Widening a whole stored group gives its device group (module docs).
///
/// # Panics
/// If `src.len() != dtype.size_bytes() * dst.len()`.
pub fn widen(dtype: ParamDtype, src: &[u8], dst: &mut [f32]) {
    match dtype {
        ParamDtype::F32 => {
            check_lengths(dtype, src.len(), dst.len());
            for (c, o) in src.chunks_exact(4).zip(dst) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        ParamDtype::F16 => widen_f16(src, dst),
        ParamDtype::BF16 => widen_bf16(src, dst),
    }
}

/// [`widen`] into little-endian f32 bytes: for destinations that are byte
/// buffers (an arena, a device staging buffer) with no f32 alignment.
///
/// # Panics
/// If `4 * src.len() != dtype.size_bytes() * dst.len()`.
pub fn widen_to_le_bytes(dtype: ParamDtype, src: &[u8], dst: &mut [u8]) {
    assert!(
        dst.len().is_multiple_of(4),
        "widening into {} bytes: not a whole number of f32",
        dst.len()
    );
    check_lengths(dtype, src.len(), dst.len() / 4);
    match dtype {
        ParamDtype::F32 => dst.copy_from_slice(src),
        ParamDtype::F16 => widen_u16_to_bytes_with(src, dst, f16_to_f32),
        ParamDtype::BF16 => widen_u16_to_bytes_with(src, dst, bf16_to_f32),
    }
}

/// [`widen`] into a new vector (for code off the hot path: training,
/// inspection, tests).
pub fn widen_to_vec(dtype: ParamDtype, src: &[u8]) -> Vec<f32> {
    let mut out = vec![0f32; src.len() / dtype.size_bytes() as usize];
    widen(dtype, src, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn le(bits: &[u16]) -> Vec<u8> {
        bits.iter().flat_map(|b| b.to_le_bytes()).collect()
    }

    #[test]
    fn every_bf16_widens_to_the_f32_with_its_bits_on_top() {
        let all: Vec<u16> = (0..=u16::MAX).collect();
        let mut out = vec![0f32; all.len()];
        widen_bf16(&le(&all), &mut out);
        for (&b, &v) in all.iter().zip(&out) {
            assert_eq!(v.to_bits(), u32::from(b) << 16, "bf16 {b:#06x}");
            let h = half::bf16::from_bits(b).to_f32();
            assert!(v == h || (v.is_nan() && h.is_nan()), "bf16 {b:#06x}");
        }
    }

    #[test]
    fn every_f16_widens_exactly() {
        let all: Vec<u16> = (0..=u16::MAX).collect();
        let mut out = vec![0f32; all.len()];
        widen_f16(&le(&all), &mut out);
        for (&b, &v) in all.iter().zip(&out) {
            let want = half::f16::from_bits(b).to_f32();
            if want.is_nan() {
                // NaN: sign and payload kept in the mantissa's top bits.
                assert!(v.is_nan(), "f16 {b:#06x}");
                assert_eq!(v.to_bits() >> 31, u32::from(b >> 15), "f16 {b:#06x} sign");
                assert_eq!(v.to_bits() & 0x7f_ffff, u32::from(b & 0x3ff) << 13);
            } else {
                assert_eq!(v.to_bits(), want.to_bits(), "f16 {b:#06x}");
            }
            // And back: the widened value narrows to the same pattern.
            if !v.is_nan() {
                assert_eq!(half::f16::from_f32(v).to_bits(), b, "f16 {b:#06x}");
            }
        }
    }

    #[test]
    fn special_values_widen_to_themselves() {
        let cases: [(u16, f32); 9] = [
            (0x0000, 0.0),
            (0x8000, -0.0),
            (0x3c00, 1.0),
            (0xc000, -2.0),
            (0x7bff, 65504.0),
            (0x0400, 6.103_515_6e-5), // smallest normal, 2^-14
            (0x0001, 5.960_464_5e-8), // smallest subnormal, 2^-24
            (0x7c00, f32::INFINITY),
            (0xfc00, f32::NEG_INFINITY),
        ];
        for (b, want) in cases {
            let v = f16_to_f32(b);
            assert_eq!(v.to_bits(), want.to_bits(), "f16 {b:#06x}: {v:e}");
        }
        assert_eq!(f16_to_f32(0x0001), 2f32.powi(-24));
        assert_eq!(f16_to_f32(0x03ff), 1023.0 * 2f32.powi(-24)); // largest subnormal
        assert!(f16_to_f32(0x7e00).is_nan() && f16_to_f32(0x7c01).is_nan());
        assert!(f16_to_f32(0x8000).is_sign_negative());
        assert_eq!(bf16_to_f32(0x3f80), 1.0);
        assert_eq!(bf16_to_f32(0x7f80), f32::INFINITY);
        assert_eq!(bf16_to_f32(0x0001), f32::from_bits(0x0001_0000)); // f32 subnormal
        assert!(bf16_to_f32(0xffc1).is_nan());
        assert_eq!(
            ParamDtype::BF16.count_non_finite(&le(&[0x7f80, 0x3f80, 0xffc1])),
            2
        );
        assert_eq!(
            ParamDtype::F16.count_non_finite(&le(&[0x7c00, 0x7bff, 0x7e00])),
            2
        );
    }

    #[test]
    fn narrowing_rounds_to_nearest_even_and_widening_returns_it() {
        for dtype in [ParamDtype::F16, ParamDtype::BF16] {
            let mut bytes = Vec::new();
            // 1 + half an ulp (a tie) rounds to 1 (even); 1 + 3 half-ulps to 1 + 2 ulps.
            let ulp = match dtype {
                ParamDtype::F16 => 2f32.powi(-10),
                _ => 2f32.powi(-7),
            };
            for v in [1.0 + ulp / 2.0, 1.0 + 1.5 * ulp, 1.0 + 0.75 * ulp, -0.1] {
                dtype.push_narrowed(v, &mut bytes);
            }
            let back = widen_to_vec(dtype, &bytes);
            assert_eq!(back[0], 1.0, "{dtype}: tie to even");
            assert_eq!(back[1], 1.0 + 2.0 * ulp, "{dtype}: tie to even, upwards");
            assert_eq!(back[2], 1.0 + ulp, "{dtype}: nearest");
            assert!((back[3] + 0.1).abs() <= 0.1 * ulp, "{dtype}: {}", back[3]);
            // Widened values narrow back to the same bits.
            let mut again = Vec::new();
            for v in &back {
                dtype.push_narrowed(*v, &mut again);
            }
            assert_eq!(again, bytes, "{dtype}");
        }
    }

    #[test]
    fn byte_and_f32_destinations_agree_at_every_length() {
        let bits: Vec<u16> = (0..300u32)
            .map(|i| (i.wrapping_mul(2654435761) >> 16) as u16)
            .collect();
        for dtype in [ParamDtype::F16, ParamDtype::BF16] {
            // Lengths around the block size, so both the blocks and the tail run.
            for n in [0, 1, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK + 7, 300] {
                let src = le(&bits[..n]);
                let mut f = vec![0f32; n];
                widen(dtype, &src, &mut f);
                let mut b = vec![0u8; 4 * n];
                widen_to_le_bytes(dtype, &src, &mut b);
                let from_bytes: Vec<u32> = b
                    .chunks_exact(4)
                    .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect();
                let bits_f: Vec<u32> = f.iter().map(|v| v.to_bits()).collect();
                assert_eq!(bits_f, from_bytes, "{dtype} n={n}");
                for (i, v) in f.iter().enumerate() {
                    let want = match dtype {
                        ParamDtype::F16 => f16_to_f32(bits[i]),
                        _ => bf16_to_f32(bits[i]),
                    };
                    assert_eq!(v.to_bits(), want.to_bits(), "{dtype} n={n} i={i}");
                }
            }
        }
        let f32_src: Vec<u8> = [1.5f32, -3.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        assert_eq!(widen_to_vec(ParamDtype::F32, &f32_src), [1.5, -3.0]);
    }

    #[test]
    #[should_panic(expected = "must hold exactly one bf16 per f32")]
    fn a_length_mismatch_is_refused() {
        widen_bf16(&[0u8; 6], &mut [0f32; 2]);
    }

    #[test]
    fn names_parse_and_print() {
        for d in ParamDtype::ALL {
            assert_eq!(d.as_str().parse::<ParamDtype>().unwrap(), d);
            assert_eq!(d.safetensors_name().parse::<ParamDtype>().unwrap(), d);
            assert_eq!(ParamDtype::from_safetensors(d.safetensors_name()), Some(d));
            assert_eq!(d.device_bytes(512), 512 * 4 / d.size_bytes());
        }
        let e = "f64".parse::<ParamDtype>().unwrap_err().to_string();
        assert!(e.contains("f64") && e.contains("bf16"), "{e}");
        assert_eq!(ParamDtype::from_safetensors("I64"), None);
        assert_eq!(
            serde_json::to_string(&ParamDtype::BF16).unwrap(),
            "\"BF16\"",
            "manifests spell it as safetensors does"
        );
    }

    /// Host widening throughput (printed, never asserted): what the cpu
    /// executor's upload stage pays per stored byte.
    /// `cargo test --release -p distmind-models widening_throughput -- --nocapture`
    #[test]
    fn widening_throughput() {
        let n = 16 << 20; // 16 Mi elements: 32 MiB stored, 64 MiB widened
        let src: Vec<u8> = (0..n as u32)
            .flat_map(|i| ((i.wrapping_mul(2654435761) >> 16) as u16).to_le_bytes())
            .collect();
        let mut dst = vec![0f32; n];
        let mut dst_bytes = vec![0u8; 4 * n];
        for dtype in [ParamDtype::BF16, ParamDtype::F16] {
            for (what, into_bytes) in [("f32 slice", false), ("le bytes", true)] {
                let mut best = f64::INFINITY;
                for _ in 0..3 {
                    let t = std::time::Instant::now();
                    if into_bytes {
                        widen_to_le_bytes(dtype, &src, &mut dst_bytes);
                    } else {
                        widen(dtype, &src, &mut dst);
                    }
                    best = best.min(t.elapsed().as_secs_f64());
                }
                println!(
                    "widen {dtype} -> {what}: {:.2} GB/s stored in, {:.2} GB/s f32 out \
                     ({} MiB, best of 3)",
                    src.len() as f64 / best / 1e9,
                    4.0 * n as f64 / best / 1e9,
                    src.len() >> 20
                );
            }
        }
        // Keep the results observable so the loops are not optimised away.
        assert!(dst.iter().any(|v| *v != 0.0) && dst_bytes.iter().any(|b| *b != 0));
    }
}
