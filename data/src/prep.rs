//! The preprocessing of a training sample, torchvision's ImageNet training
//! pipeline as five numbered steps applied in order:
//!
//! 1. Decode: JPEG/PNG to RGB8 (H x W x 3); grayscale and RGBA become RGB.
//! 2. RandomResizedCrop: torchvision's algorithm (scale (0.08, 1), log-uniform
//!    aspect ratio (3/4, 4/3), 10 attempts, then a center crop clamped to the
//!    ratio range), the crop resized bilinearly (antialiased, like PIL) to
//!    `crop x crop`.
//! 3. RandomHorizontalFlip with probability 0.5.
//! 4. ToTensor: f32, channels first (C x H x W), values in [0, 1].
//! 5. Normalize: `(x - mean) / std` per channel.
//!
//! After `k` steps a sample is a [`Prepped`]: the file's bytes (k = 0), RGB8
//! pixels (k = 1..=3) or a tensor (k = 4, 5). Its wire form
//! ([`Prepped::to_bytes`]) is what a memory server ships to a GPU server,
//! which finishes the remaining steps with [`run`]. The random choices of
//! steps 2 and 3 depend only on the sample's seed, never on where the
//! pipeline was split, so any split gives the same tensor bit for bit.

use crate::format::SampleFormat;
use crate::npy::{parse_npy, NpyData};
use crate::rng::SplitMix64;
use image::codecs::jpeg::JpegDecoder;
use image::codecs::png::PngDecoder;
use image::{DynamicImage, ImageDecoder};
use std::io::Cursor;
use std::time::Instant;

/// The number of preprocessing steps.
pub const STEPS: usize = 5;

/// The magic at the start of the wire form of a sample after k >= 1 steps.
pub const WIRE_MAGIC: [u8; 4] = *b"DMP1";
/// The size of the wire form's header (k >= 1), in bytes.
pub const WIRE_HEADER: usize = 20;

const DTYPE_RGB8: u8 = 1;
const DTYPE_F32: u8 = 2;

/// The name of step `k` (0 = the encoded file, 1..=5 the steps); "?" beyond.
pub fn step_name(k: usize) -> &'static str {
    match k {
        0 => "encoded",
        1 => "decode",
        2 => "random_resized_crop",
        3 => "random_horizontal_flip",
        4 => "to_tensor",
        5 => "normalize",
        _ => "?",
    }
}

/// Whether a sample of `format` can be stopped after `k` steps (and shipped
/// in that form). Images can stop anywhere in 0..=STEPS; `.npy` tensors only
/// at 0 (the file) or STEPS (the tensor), since image steps do not apply.
pub fn can_stop_after(format: SampleFormat, k: usize) -> bool {
    match format {
        SampleFormat::Jpeg | SampleFormat::Png => k <= STEPS,
        SampleFormat::Npy => k == 0 || k == STEPS,
    }
}

/// What went wrong preprocessing one sample. The messages say what was wrong;
/// the caller adds which sample it was.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PrepError {
    /// The image is corrupt, truncated or not of its stated format.
    #[error("cannot decode the image: {why}")]
    Decode {
        /// What the decoder found wrong.
        why: String,
    },
    /// The image's header announces more pixels than allowed (a decoder
    /// bomb guard); nothing was decoded.
    #[error("image of {w}x{h} pixels is over the limit of {max_pixels} pixels")]
    TooLarge {
        /// Width from the header.
        w: u32,
        /// Height from the header.
        h: u32,
        /// The limit ([`PrepConfig::max_pixels`]).
        max_pixels: u64,
    },
    /// A wire form (see [`Prepped::from_bytes`]) is malformed.
    #[error("bad preprocessed sample bytes: {why}")]
    BadWire {
        /// What was wrong.
        why: String,
    },
    /// An image step was asked of a `.npy` sample.
    #[error("step {step} ({}) does not apply to .npy samples: image steps do not apply to .npy tensors, which go from 0 to {STEPS} steps in one go", step_name(*step))]
    NotImage {
        /// The step asked for.
        step: usize,
    },
    /// A `.npy` sample could not be read as a tensor.
    #[error("bad .npy sample: {why}")]
    Npy {
        /// What was wrong.
        why: String,
    },
    /// The steps asked for do not fit the input, or are out of range.
    #[error("cannot run steps {from}..{to}: {why}")]
    BadSteps {
        /// Steps already done.
        from: usize,
        /// Steps wanted done.
        to: usize,
        /// What was wrong.
        why: String,
    },
    /// The configuration is unusable.
    #[error("bad preprocessing configuration: {why}")]
    BadConfig {
        /// What was wrong.
        why: String,
    },
}

/// The parameters of the pipeline.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PrepConfig {
    /// The side of the square crop of step 2 (and so of the tensors).
    pub crop: u32,
    /// Per-channel (R, G, B) mean of step 5.
    pub mean: [f32; 3],
    /// Per-channel (R, G, B) standard deviation of step 5.
    pub std: [f32; 3],
    /// The most pixels (width x height) an image may announce in its
    /// header; larger images are refused before decoding.
    pub max_pixels: u64,
}

/// The largest crop side [`PrepConfig::validate`] accepts.
pub const CROP_MAX: u32 = 4096;

impl Default for PrepConfig {
    /// torchvision's ImageNet defaults: 224 crop, ImageNet mean and std, and
    /// a 64 Mpixel limit.
    fn default() -> Self {
        PrepConfig {
            crop: 224,
            mean: [0.485, 0.456, 0.406],
            std: [0.229, 0.224, 0.225],
            max_pixels: 64 << 20,
        }
    }
}

impl PrepConfig {
    /// Checks the configuration: crop in 1..=CROP_MAX, finite means,
    /// positive finite stds, max_pixels > 0.
    pub fn validate(&self) -> Result<(), PrepError> {
        let bad = |why: String| Err(PrepError::BadConfig { why });
        if self.crop == 0 || self.crop > CROP_MAX {
            return bad(format!("crop {} is not in 1..={CROP_MAX}", self.crop));
        }
        if self.mean.iter().any(|m| !m.is_finite()) {
            return bad(format!("mean {:?} is not finite", self.mean));
        }
        if self.std.iter().any(|s| !s.is_finite() || *s <= 0.0) {
            return bad(format!("std {:?} must be positive and finite", self.std));
        }
        if self.max_pixels == 0 {
            return bad("max_pixels is 0".into());
        }
        Ok(())
    }
}

/// A sample after some number of steps.
#[derive(Debug, Clone, PartialEq)]
pub enum Prepped {
    /// After 0 steps: the file's bytes.
    Encoded {
        /// The file's format.
        format: SampleFormat,
        /// The file's bytes.
        bytes: Vec<u8>,
    },
    /// After 1..=3 steps: 8-bit RGB pixels, row-major, `h * w * 3` bytes.
    Rgb8 {
        /// Height in pixels.
        h: u32,
        /// Width in pixels.
        w: u32,
        /// The pixels, R, G, B interleaved.
        data: Vec<u8>,
    },
    /// After 4 or 5 steps: f32 channels-first, `c * h * w` values.
    Tensor {
        /// Channels (3).
        c: u32,
        /// Height.
        h: u32,
        /// Width.
        w: u32,
        /// The values, channel-major.
        data: Vec<f32>,
    },
}

/// The product of dims as a usize, or a BadWire error.
fn elems(dims: &[u32]) -> Result<usize, PrepError> {
    dims.iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d as usize))
        .ok_or_else(|| PrepError::BadWire {
            why: format!("dimensions {dims:?} overflow"),
        })
}

impl Prepped {
    /// The size of the wire form ([`Prepped::to_bytes`]) in bytes.
    pub fn wire_len(&self) -> usize {
        match self {
            Prepped::Encoded { bytes, .. } => bytes.len(),
            Prepped::Rgb8 { data, .. } => WIRE_HEADER + data.len(),
            Prepped::Tensor { data, .. } => WIRE_HEADER + 4 * data.len(),
        }
    }

    /// The wire form with `k` recorded in its header: after 0 steps exactly
    /// the file's bytes; otherwise a 20-byte header (magic "DMP1", k, dtype
    /// 1 = RGB8 HWC or 2 = f32 CHW, 2 zero bytes, three u32 LE dimensions:
    /// h, w, 3 or c, h, w) followed by the pixels (u8) or values (f32 LE).
    /// `k` must be the number of steps done (see [`Prepped::to_bytes`]).
    pub fn to_bytes_k(&self, k: usize) -> Vec<u8> {
        let header = |dtype: u8, d: [u32; 3], n: usize| {
            let mut out = Vec::with_capacity(WIRE_HEADER + n);
            out.extend_from_slice(&WIRE_MAGIC);
            out.push(k as u8);
            out.push(dtype);
            out.extend_from_slice(&[0, 0]);
            for x in d {
                out.extend_from_slice(&x.to_le_bytes());
            }
            out
        };
        match self {
            Prepped::Encoded { bytes, .. } => bytes.clone(),
            Prepped::Rgb8 { h, w, data } => {
                let mut out = header(DTYPE_RGB8, [*h, *w, 3], data.len());
                out.extend_from_slice(data);
                out
            }
            Prepped::Tensor { c, h, w, data } => {
                let mut out = header(DTYPE_F32, [*c, *h, *w], 4 * data.len());
                for x in data {
                    out.extend_from_slice(&x.to_le_bytes());
                }
                out
            }
        }
    }

    /// The wire form; the step count in the header is the usual one for the
    /// variant (0, 1 for RGB8, 4 for a tensor) unless written with
    /// [`Prepped::to_bytes_k`]. [`Prepped::from_bytes`] checks the header's
    /// k, so prefer `to_bytes_k` when k is known.
    pub fn to_bytes(&self) -> Vec<u8> {
        let k = match self {
            Prepped::Encoded { .. } => 0,
            Prepped::Rgb8 { .. } => 1,
            Prepped::Tensor { .. } => 4,
        };
        self.to_bytes_k(k)
    }

    /// Reads the wire form of a sample after `k` steps. For k = 0 the bytes
    /// are the file (its format told by its magic bytes). For k >= 1 the
    /// header must carry the magic, this k (or, for the forms written by
    /// [`Prepped::to_bytes`], any k of the same kind), the dtype that k
    /// implies and 3 channels, and the length must match the dimensions
    /// exactly.
    pub fn from_bytes(k: usize, bytes: &[u8]) -> Result<Prepped, PrepError> {
        let bad = |why: String| Err(PrepError::BadWire { why });
        if k > STEPS {
            return bad(format!("{k} steps asked for, there are only {STEPS}"));
        }
        if k == 0 {
            return match SampleFormat::sniff(bytes) {
                Some(format) => Ok(Prepped::Encoded {
                    format,
                    bytes: bytes.to_vec(),
                }),
                None => bad("bytes after 0 steps are not a JPEG, PNG or .npy file".into()),
            };
        }
        if bytes.len() < WIRE_HEADER {
            return bad(format!(
                "{} bytes, shorter than the {WIRE_HEADER}-byte header",
                bytes.len()
            ));
        }
        if bytes[..4] != WIRE_MAGIC {
            return bad(format!("magic {:02x?} is not \"DMP1\"", &bytes[..4]));
        }
        let hk = bytes[4] as usize;
        let dtype = bytes[5];
        let want_dtype = if k <= 3 { DTYPE_RGB8 } else { DTYPE_F32 };
        if dtype != want_dtype {
            return bad(format!(
                "dtype {dtype} where {want_dtype} is expected after {k} steps"
            ));
        }
        let same_kind = (hk <= 3) == (k <= 3) && (1..=STEPS).contains(&hk);
        if hk != k && !same_kind {
            return bad(format!("header says {hk} steps, {k} expected"));
        }
        if bytes[6] != 0 || bytes[7] != 0 {
            return bad("reserved header bytes are not zero".into());
        }
        let d = |i: usize| u32::from_le_bytes(bytes[8 + 4 * i..12 + 4 * i].try_into().unwrap());
        let (d0, d1, d2) = (d(0), d(1), d(2));
        let body = &bytes[WIRE_HEADER..];
        if dtype == DTYPE_RGB8 {
            if d2 != 3 || d0 == 0 || d1 == 0 {
                return bad(format!("RGB8 dimensions {d0}x{d1}x{d2} are not HxWx3"));
            }
            let n = elems(&[d0, d1, 3])?;
            if body.len() != n {
                return bad(format!(
                    "{} pixel bytes where {d0}x{d1}x3 needs {n}",
                    body.len()
                ));
            }
            Ok(Prepped::Rgb8 {
                h: d0,
                w: d1,
                data: body.to_vec(),
            })
        } else {
            if d0 != 3 || d1 == 0 || d2 == 0 {
                return bad(format!("tensor dimensions {d0}x{d1}x{d2} are not 3xHxW"));
            }
            let n = elems(&[d0, d1, d2])?;
            if Some(body.len()) != n.checked_mul(4) {
                return bad(format!(
                    "{} value bytes where {d0}x{d1}x{d2} f32 needs {}",
                    body.len(),
                    n.saturating_mul(4)
                ));
            }
            Ok(Prepped::Tensor {
                c: d0,
                h: d1,
                w: d2,
                data: body
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            })
        }
    }

    /// The kind's name, for messages.
    fn kind(&self) -> &'static str {
        match self {
            Prepped::Encoded { .. } => "an encoded file",
            Prepped::Rgb8 { .. } => "RGB8 pixels",
            Prepped::Tensor { .. } => "a tensor",
        }
    }
}

fn decode_err(e: impl std::fmt::Display) -> PrepError {
    PrepError::Decode { why: e.to_string() }
}

/// The width and height an image's header announces, read without decoding
/// its pixels.
pub fn image_dims(bytes: &[u8], format: SampleFormat) -> Result<(u32, u32), PrepError> {
    check_magic(bytes, format)?;
    guarded(|| match format {
        SampleFormat::Jpeg => Ok(JpegDecoder::new(Cursor::new(bytes))
            .map_err(decode_err)?
            .dimensions()),
        SampleFormat::Png => Ok(PngDecoder::new(Cursor::new(bytes))
            .map_err(decode_err)?
            .dimensions()),
        SampleFormat::Npy => Err(PrepError::NotImage { step: 1 }),
    })
}

fn check_magic(bytes: &[u8], format: SampleFormat) -> Result<(), PrepError> {
    let magic = SampleFormat::sniff(bytes);
    if magic != Some(format) {
        return Err(PrepError::Decode {
            why: match magic {
                Some(m) => format!("the sample is said to be {format:?} but its bytes are {m:?}"),
                None => format!("the bytes do not start like a {format:?} file"),
            },
        });
    }
    Ok(())
}

/// Runs a decoder, turning a panic inside it into a Decode error (belt and
/// braces: the decoders return errors for corrupt input).
fn guarded<T>(f: impl FnOnce() -> Result<T, PrepError>) -> Result<T, PrepError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|_| {
        Err(PrepError::Decode {
            why: "the decoder panicked on malformed data".into(),
        })
    })
}

/// Step 1: decodes a JPEG or PNG to RGB8, refusing images whose header
/// announces more than `max_pixels` pixels before decoding them.
pub fn decode_rgb8(
    bytes: &[u8],
    format: SampleFormat,
    max_pixels: u64,
) -> Result<(u32, u32, Vec<u8>), PrepError> {
    check_magic(bytes, format)?;
    let check = |(w, h): (u32, u32)| {
        if w == 0 || h == 0 {
            return Err(PrepError::Decode {
                why: format!("image header announces {w}x{h} pixels"),
            });
        }
        if w as u64 * h as u64 > max_pixels {
            return Err(PrepError::TooLarge { w, h, max_pixels });
        }
        Ok(())
    };
    let img = guarded(|| match format {
        SampleFormat::Jpeg => {
            let d = JpegDecoder::new(Cursor::new(bytes)).map_err(decode_err)?;
            check(d.dimensions())?;
            DynamicImage::from_decoder(d).map_err(decode_err)
        }
        SampleFormat::Png => {
            let d = PngDecoder::new(Cursor::new(bytes)).map_err(decode_err)?;
            check(d.dimensions())?;
            DynamicImage::from_decoder(d).map_err(decode_err)
        }
        SampleFormat::Npy => Err(PrepError::NotImage { step: 1 }),
    })?;
    let rgb = img.into_rgb8();
    let (w, h) = rgb.dimensions();
    Ok((h, w, rgb.into_raw()))
}

/// ln(3/4) and ln(4/3), written out so no libm is involved.
const LOG_RATIO: (f64, f64) = (-0.287_682_072_451_780_9, 0.287_682_072_451_780_9);

/// exp(x) for |x| <= 0.3 by its Taylor series: only + * /, so the same on
/// every machine.
fn exp_small(x: f64) -> f64 {
    let mut term = 1.0;
    let mut sum = 1.0;
    for n in 1..=20 {
        term = term * x / n as f64;
        sum += term;
    }
    sum
}

/// Python's int(round(x)): ties to even.
fn round_half_even(x: f64) -> i64 {
    x.round_ties_even() as i64
}

/// torchvision's RandomResizedCrop.get_params: the crop (top, left, height,
/// width) of an `h x w` image, drawn from `rng`.
pub fn random_resized_crop_params(h: u32, w: u32, rng: &mut SplitMix64) -> (u32, u32, u32, u32) {
    let (scale_lo, scale_hi) = (0.08, 1.0);
    let area = h as f64 * w as f64;
    for _ in 0..10 {
        let target_area = area * rng.uniform(scale_lo, scale_hi);
        let ratio = exp_small(rng.uniform(LOG_RATIO.0, LOG_RATIO.1));
        let cw = round_half_even((target_area * ratio).sqrt());
        let ch = round_half_even((target_area / ratio).sqrt());
        if 0 < cw && cw <= w as i64 && 0 < ch && ch <= h as i64 {
            let top = rng.below((h as i64 - ch + 1) as u64) as u32;
            let left = rng.below((w as i64 - cw + 1) as u64) as u32;
            return (top, left, ch as u32, cw as u32);
        }
    }
    // Fallback: a center crop with the ratio clamped to (3/4, 4/3).
    let in_ratio = w as f64 / h as f64;
    let (cw, ch) = if in_ratio < 0.75 {
        (w, (round_half_even(w as f64 / 0.75) as u32).clamp(1, h))
    } else if in_ratio > 4.0 / 3.0 {
        (
            (round_half_even(h as f64 * (4.0 / 3.0)) as u32).clamp(1, w),
            h,
        )
    } else {
        (w, h)
    };
    ((h - ch) / 2, (w - cw) / 2, ch, cw)
}

/// The taps of a 1-D antialiased bilinear (triangle) resampling of `in_len`
/// samples to `out_len`, PIL-style: for each output index its first input
/// index and normalised weights.
fn taps(in_len: usize, out_len: usize) -> Vec<(usize, Vec<f32>)> {
    let scale = in_len as f64 / out_len as f64;
    let fscale = scale.max(1.0);
    let support = fscale; // the triangle's support is 1, widened when shrinking
    (0..out_len)
        .map(|i| {
            let center = (i as f64 + 0.5) * scale;
            let lo = ((center - support + 0.5).floor().max(0.0)) as usize;
            let hi = ((center + support + 0.5).floor() as usize).min(in_len);
            let hi = hi.max(lo + 1);
            let mut ws: Vec<f64> = (lo..hi)
                .map(|j| {
                    let x = (j as f64 + 0.5 - center) / fscale;
                    (1.0 - x.abs()).max(0.0)
                })
                .collect();
            let sum: f64 = ws.iter().sum();
            if sum > 0.0 {
                ws.iter_mut().for_each(|w| *w /= sum);
            } else {
                ws.iter_mut().for_each(|w| *w = 1.0 / (hi - lo) as f64);
            }
            (lo, ws.into_iter().map(|w| w as f32).collect())
        })
        .collect()
}

/// Resizes the `ch x cw` region at (top, left) of an RGB8 image `src` of
/// width `w` to `oh x ow`, bilinearly with antialiasing (like PIL's
/// BILINEAR): horizontal pass, then vertical, rounding to u8 at the end.
#[allow(clippy::too_many_arguments)]
pub fn resize_rgb8(
    src: &[u8],
    w: u32,
    top: u32,
    left: u32,
    ch: u32,
    cw: u32,
    oh: u32,
    ow: u32,
) -> Vec<u8> {
    let (w, top, left, ch, cw, oh, ow) = (
        w as usize,
        top as usize,
        left as usize,
        ch as usize,
        cw as usize,
        oh as usize,
        ow as usize,
    );
    let tx = taps(cw, ow);
    let ty = taps(ch, oh);
    // Horizontal: ch rows of ow pixels.
    let mut mid = vec![0f32; ch * ow * 3];
    for y in 0..ch {
        let row = &src[((top + y) * w + left) * 3..][..cw * 3];
        let out = &mut mid[y * ow * 3..][..ow * 3];
        for (x, (lo, ws)) in tx.iter().enumerate() {
            let mut acc = [0f32; 3];
            for (k, wt) in ws.iter().enumerate() {
                let p = &row[(lo + k) * 3..][..3];
                acc[0] += wt * p[0] as f32;
                acc[1] += wt * p[1] as f32;
                acc[2] += wt * p[2] as f32;
            }
            out[x * 3..x * 3 + 3].copy_from_slice(&acc);
        }
    }
    // Vertical: oh rows.
    let mut out = vec![0u8; oh * ow * 3];
    let mut acc = vec![0f32; ow * 3];
    for (y, (lo, ws)) in ty.iter().enumerate() {
        acc.iter_mut().for_each(|a| *a = 0.0);
        for (k, wt) in ws.iter().enumerate() {
            let row = &mid[(lo + k) * ow * 3..][..ow * 3];
            for (a, v) in acc.iter_mut().zip(row) {
                *a += wt * v;
            }
        }
        for (o, a) in out[y * ow * 3..][..ow * 3].iter_mut().zip(&acc) {
            *o = a.round().clamp(0.0, 255.0) as u8;
        }
    }
    out
}

/// The sub-seed of step `k` of a sample with seed `seed`.
fn step_rng(seed: u64, k: usize) -> SplitMix64 {
    SplitMix64::derive(seed, k as u64)
}

/// Step 4: RGB8 HWC to f32 CHW in [0, 1].
fn to_tensor(h: u32, w: u32, data: &[u8]) -> Vec<f32> {
    let n = h as usize * w as usize;
    let mut out = vec![0f32; 3 * n];
    for (i, p) in data.chunks_exact(3).enumerate() {
        for c in 0..3 {
            out[c * n + i] = p[c] as f32 / 255.0;
        }
    }
    out
}

/// Step 5 in place on a CHW tensor of `c` channels.
fn normalize(data: &mut [f32], c: usize, cfg: &PrepConfig) {
    let n = data.len() / c.max(1);
    for (ch, plane) in data.chunks_mut(n.max(1)).enumerate().take(3) {
        let (m, s) = (cfg.mean[ch], cfg.std[ch]);
        for x in plane {
            *x = (*x - m) / s;
        }
    }
}

/// Reads a `.npy` sample as the tensor after all steps: a (3, H, W) or
/// (H, W, 3) array (if both fit, (3, H, W)); float32 values are taken as
/// already preprocessed and passed through, uint8 values get ToTensor and
/// Normalize.
pub fn npy_tensor(bytes: &[u8], cfg: &PrepConfig) -> Result<Prepped, PrepError> {
    let arr = parse_npy(bytes).map_err(|why| PrepError::Npy { why })?;
    let bad = || PrepError::Npy {
        why: format!(
            "shape {:?} is neither (3, H, W) nor (H, W, 3) with H, W >= 1",
            arr.shape
        ),
    };
    if arr.shape.len() != 3 || arr.shape.contains(&0) {
        return Err(bad());
    }
    let too_big = |d: usize| u32::try_from(d).map_err(|_| bad());
    let (s0, s1, s2) = (arr.shape[0], arr.shape[1], arr.shape[2]);
    let (chw, h, w) = if s0 == 3 {
        (true, too_big(s1)?, too_big(s2)?)
    } else if s2 == 3 {
        (false, too_big(s0)?, too_big(s1)?)
    } else {
        return Err(bad());
    };
    let n = h as usize * w as usize;
    let to_chw = |v: Vec<f32>| {
        if chw {
            v
        } else {
            let mut out = vec![0f32; v.len()];
            for (i, p) in v.chunks_exact(3).enumerate() {
                for c in 0..3 {
                    out[c * n + i] = p[c];
                }
            }
            out
        }
    };
    let data = match arr.data {
        NpyData::F32(v) => to_chw(v),
        NpyData::U8(v) => {
            let mut t = to_chw(v.iter().map(|&x| x as f32 / 255.0).collect());
            normalize(&mut t, 3, cfg);
            t
        }
    };
    Ok(Prepped::Tensor { c: 3, h, w, data })
}

/// Applies step `k` (1..=5) to a sample that has had k - 1 steps.
fn step(k: usize, input: Prepped, cfg: &PrepConfig, seed: u64) -> Result<Prepped, PrepError> {
    match (k, input) {
        (1, Prepped::Encoded { format, bytes }) => {
            if format == SampleFormat::Npy {
                return Err(PrepError::NotImage { step: 1 });
            }
            let (h, w, data) = decode_rgb8(&bytes, format, cfg.max_pixels)?;
            Ok(Prepped::Rgb8 { h, w, data })
        }
        (2, Prepped::Rgb8 { h, w, data }) => {
            let mut rng = step_rng(seed, 2);
            let (top, left, ch, cw) = random_resized_crop_params(h, w, &mut rng);
            let data = resize_rgb8(&data, w, top, left, ch, cw, cfg.crop, cfg.crop);
            Ok(Prepped::Rgb8 {
                h: cfg.crop,
                w: cfg.crop,
                data,
            })
        }
        (3, Prepped::Rgb8 { h, w, mut data }) => {
            let mut rng = step_rng(seed, 3);
            if rng.next_f64() < 0.5 {
                for row in data.chunks_exact_mut(w as usize * 3) {
                    let n = w as usize;
                    for x in 0..n / 2 {
                        for c in 0..3 {
                            row.swap(x * 3 + c, (n - 1 - x) * 3 + c);
                        }
                    }
                }
            }
            Ok(Prepped::Rgb8 { h, w, data })
        }
        (4, Prepped::Rgb8 { h, w, data }) => Ok(Prepped::Tensor {
            c: 3,
            h,
            w,
            data: to_tensor(h, w, &data),
        }),
        (5, Prepped::Tensor { c, h, w, mut data }) => {
            normalize(&mut data, c as usize, cfg);
            Ok(Prepped::Tensor { c, h, w, data })
        }
        (k, input) => Err(PrepError::BadSteps {
            from: k - 1,
            to: k,
            why: format!("step {k} ({}) cannot take {}", step_name(k), input.kind()),
        }),
    }
}

/// Applies steps `from + 1 ..= to` to a sample that has had `from` steps.
/// The random choices (steps 2 and 3) depend only on `seed`, so splitting
/// the steps between machines gives the same result bit for bit. `.npy`
/// samples go from 0 to [`STEPS`] in one go (see [`npy_tensor`]); any other
/// step on them is a [`PrepError::NotImage`].
pub fn run(
    input: Prepped,
    from: usize,
    to: usize,
    cfg: &PrepConfig,
    seed: u64,
) -> Result<Prepped, PrepError> {
    cfg.validate()?;
    if from > to || to > STEPS {
        return Err(PrepError::BadSteps {
            from,
            to,
            why: format!("need from <= to <= {STEPS}"),
        });
    }
    let fits = match &input {
        Prepped::Encoded { .. } => from == 0,
        Prepped::Rgb8 { .. } => (1..=3).contains(&from),
        Prepped::Tensor { .. } => from >= 4,
    };
    if !fits {
        return Err(PrepError::BadSteps {
            from,
            to,
            why: format!("{} is not a sample after {from} steps", input.kind()),
        });
    }
    if let Prepped::Encoded {
        format: SampleFormat::Npy,
        bytes,
    } = &input
    {
        return match to {
            0 => Ok(input),
            STEPS => npy_tensor(bytes, cfg),
            k => Err(PrepError::NotImage { step: k }),
        };
    }
    let mut x = input;
    for k in from + 1..=to {
        x = step(k, x, cfg, seed)?;
    }
    Ok(x)
}

/// The cost of a sample after k steps: its wire size and how long step k
/// took.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StepCost {
    /// Size of the wire form after the step, in bytes.
    pub bytes_after: u64,
    /// Seconds the step took (0 for k = 0).
    pub secs: f64,
}

/// Runs all steps on one sample, timing each: `STEPS + 1` entries, k = 0
/// (the file's size, 0 s) through k = STEPS. What a profiling epoch records
/// per sample. For `.npy` samples, steps 1..=4 do not apply (see
/// [`can_stop_after`]): their entries repeat the file's size at 0 s and the
/// last entry holds the whole conversion to a tensor.
pub fn profile(
    bytes: &[u8],
    format: SampleFormat,
    cfg: &PrepConfig,
    seed: u64,
) -> Result<Vec<StepCost>, PrepError> {
    cfg.validate()?;
    let mut out = vec![StepCost {
        bytes_after: bytes.len() as u64,
        secs: 0.0,
    }];
    if format == SampleFormat::Npy {
        let t = Instant::now();
        let x = npy_tensor(bytes, cfg)?;
        let secs = t.elapsed().as_secs_f64();
        out.extend(std::iter::repeat_n(out[0], STEPS - 1));
        out.push(StepCost {
            bytes_after: x.wire_len() as u64,
            secs,
        });
        return Ok(out);
    }
    let mut x = Prepped::Encoded {
        format,
        bytes: bytes.to_vec(),
    };
    for k in 1..=STEPS {
        let t = Instant::now();
        x = step(k, x, cfg, seed)?;
        out.push(StepCost {
            bytes_after: x.wire_len() as u64,
            secs: t.elapsed().as_secs_f64(),
        });
    }
    Ok(out)
}

/// The evaluation transform (for feature extraction): decode, resize the
/// short side to `size` (bilinear, antialiased), center-crop `size x size`,
/// ToTensor, Normalize. Returns `3 * size * size` values, channels first.
/// Deterministic. A `.npy` sample is accepted when it already is a
/// (3, size, size) or (size, size, 3) tensor.
pub fn eval_tensor(
    bytes: &[u8],
    format: SampleFormat,
    size: u32,
    cfg: &PrepConfig,
) -> Result<Vec<f32>, PrepError> {
    cfg.validate()?;
    if size == 0 || size > CROP_MAX {
        return Err(PrepError::BadConfig {
            why: format!("eval size {size} is not in 1..={CROP_MAX}"),
        });
    }
    if format == SampleFormat::Npy {
        return match npy_tensor(bytes, cfg)? {
            Prepped::Tensor { h, w, data, .. } if h == size && w == size => Ok(data),
            Prepped::Tensor { h, w, .. } => Err(PrepError::Npy {
                why: format!("tensor is {h}x{w}, the evaluation needs {size}x{size}"),
            }),
            _ => unreachable!("npy_tensor returns a tensor"),
        };
    }
    let (h, w, data) = decode_rgb8(bytes, format, cfg.max_pixels)?;
    // torchvision Resize(size): short side to size, long side truncated.
    let (oh, ow) = if w <= h {
        (((size as u64 * h as u64) / w as u64) as u32, size)
    } else {
        (size, ((size as u64 * w as u64) / h as u64) as u32)
    };
    // CenterCrop: offsets int(round((len - size) / 2)), ties to even.
    let off = |len: u32| {
        let d = len - size;
        let q = d / 2;
        if d % 2 == 1 && q % 2 == 1 {
            q + 1
        } else {
            q
        }
    };
    let resized = resize_rgb8(&data, w, 0, 0, h, w, oh, ow);
    let (top, left) = (off(oh) as usize, off(ow) as usize);
    let s = size as usize;
    let mut crop = Vec::with_capacity(s * s * 3);
    for y in 0..s {
        crop.extend_from_slice(&resized[((top + y) * ow as usize + left) * 3..][..s * 3]);
    }
    let mut t = to_tensor(size, size, &crop);
    normalize(&mut t, 3, cfg);
    Ok(t)
}

/// f32 values as IEEE half-precision, little-endian, 2 bytes each.
pub fn f32_to_f16_le(values: &[f32]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
        .collect()
}

/// The inverse of [`f32_to_f16_le`]; an error when the length is odd.
pub fn f16_le_to_f32(bytes: &[u8]) -> Result<Vec<f32>, PrepError> {
    if !bytes.len().is_multiple_of(2) {
        return Err(PrepError::BadWire {
            why: format!("{} bytes is not a whole number of f16 values", bytes.len()),
        });
    }
    Ok(bytes
        .chunks_exact(2)
        .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::npy::{encode_npy_f32, encode_npy_u8};
    use crate::synth::{generate, SynthSpec};

    fn jpeg(w: u32, h: u32, seed: u64) -> Vec<u8> {
        generate(&SynthSpec {
            samples: 1,
            classes: 3,
            seed,
            sizes: vec![(w, h)],
            quality: 90,
        })
        .remove(0)
        .bytes
    }

    fn png(w: u32, h: u32, color: image::ColorType) -> Vec<u8> {
        let n = (w * h) as usize * color.bytes_per_pixel() as usize;
        let data: Vec<u8> = (0..n).map(|i| (i * 7 % 251) as u8).collect();
        let mut out = Vec::new();
        image::codecs::png::PngEncoder::new(&mut out)
            .write_image(&data, w, h, color)
            .unwrap();
        out
    }

    use image::ImageEncoder;

    fn enc(format: SampleFormat, bytes: Vec<u8>) -> Prepped {
        Prepped::Encoded { format, bytes }
    }

    #[test]
    fn names_and_stop_points() {
        assert_eq!(STEPS, 5);
        assert_eq!(step_name(1), "decode");
        assert_eq!(step_name(5), "normalize");
        assert!(can_stop_after(SampleFormat::Jpeg, 3));
        assert!(!can_stop_after(SampleFormat::Npy, 3));
        assert!(can_stop_after(SampleFormat::Npy, 5));
    }

    #[test]
    fn shapes_and_wire_sizes_of_each_step() {
        let cfg = PrepConfig::default();
        let b = jpeg(120, 80, 1);
        let mut x = enc(SampleFormat::Jpeg, b.clone());
        assert_eq!(x.to_bytes(), b);
        for k in 1..=STEPS {
            x = run(x, k - 1, k, &cfg, 7).unwrap();
            let wire = x.to_bytes_k(k);
            assert_eq!(wire.len(), x.wire_len());
            match (k, &x) {
                (1, Prepped::Rgb8 { h, w, data }) => {
                    assert_eq!((*h, *w, data.len()), (80, 120, 80 * 120 * 3));
                }
                (2 | 3, Prepped::Rgb8 { h, w, .. }) => {
                    assert_eq!((*h, *w), (224, 224));
                    assert_eq!(wire.len(), 150528 + WIRE_HEADER);
                }
                (4 | 5, Prepped::Tensor { c, h, w, data }) => {
                    assert_eq!((*c, *h, *w, data.len()), (3, 224, 224, 150528));
                    assert_eq!(wire.len(), 4 * 150528 + WIRE_HEADER);
                }
                _ => panic!("step {k} gave {:?}", x.kind()),
            }
            assert_eq!(Prepped::from_bytes(k, &wire).unwrap(), x);
        }
        if let Prepped::Tensor { data, .. } = &x {
            // Normalized: values in [(0 - 0.485) / 0.229, (1 - 0.406) / 0.225].
            assert!(data.iter().all(|v| (-2.2..=2.7).contains(v)));
        }
        let costs = profile(&b, SampleFormat::Jpeg, &cfg, 7).unwrap();
        assert_eq!(costs.len(), STEPS + 1);
        assert_eq!(costs[0].bytes_after, b.len() as u64);
        assert_eq!(costs[0].secs, 0.0);
        assert_eq!(costs[1].bytes_after, (80 * 120 * 3 + WIRE_HEADER) as u64);
        assert_eq!(costs[3].bytes_after, (150528 + WIRE_HEADER) as u64);
        assert_eq!(costs[5].bytes_after, (4 * 150528 + WIRE_HEADER) as u64);
    }

    #[test]
    fn split_runs_equal_the_whole_bit_for_bit() {
        let cfg = PrepConfig::default();
        for (i, (w, h)) in [(300, 200), (90, 250), (224, 224)].into_iter().enumerate() {
            let b = jpeg(w, h, i as u64);
            for seed in [0u64, 1, 42, u64::MAX] {
                let whole = run(enc(SampleFormat::Jpeg, b.clone()), 0, STEPS, &cfg, seed)
                    .unwrap()
                    .to_bytes_k(STEPS);
                for split in 0..=STEPS {
                    let a = run(enc(SampleFormat::Jpeg, b.clone()), 0, split, &cfg, seed).unwrap();
                    // Shipped over the wire between the two halves.
                    let a = Prepped::from_bytes(split, &a.to_bytes_k(split)).unwrap();
                    let z = run(a, split, STEPS, &cfg, seed).unwrap();
                    assert_eq!(z.to_bytes_k(STEPS), whole, "split at {split}, seed {seed}");
                }
                // Three machines: 0..1, 1..3, 3..5.
                let a = run(enc(SampleFormat::Jpeg, b.clone()), 0, 1, &cfg, seed).unwrap();
                let a = run(a, 1, 3, &cfg, seed).unwrap();
                assert_eq!(run(a, 3, 5, &cfg, seed).unwrap().to_bytes_k(5), whole);
            }
        }
    }

    #[test]
    fn deterministic_per_seed_and_different_across_seeds() {
        let cfg = PrepConfig::default();
        let b = jpeg(400, 300, 3);
        let go = |seed| {
            run(enc(SampleFormat::Jpeg, b.clone()), 0, STEPS, &cfg, seed)
                .unwrap()
                .to_bytes()
        };
        assert_eq!(go(5), go(5));
        let outs: Vec<Vec<u8>> = (0..6).map(go).collect();
        for i in 0..outs.len() {
            for j in i + 1..outs.len() {
                assert_ne!(outs[i], outs[j], "seeds {i} and {j}");
            }
        }
        // Flips happen about half the time.
        let flips = (0..200u64)
            .filter(|&s| step_rng(s, 3).next_f64() < 0.5)
            .count();
        assert!((70..130).contains(&flips), "{flips}");
    }

    #[test]
    fn crop_params_follow_torchvision() {
        for seed in 0..500u64 {
            let mut rng = SplitMix64::new(seed);
            let (h, w) = (300 + (seed % 7) as u32 * 50, 500 - (seed % 5) as u32 * 60);
            let (top, left, ch, cw) = random_resized_crop_params(h, w, &mut rng);
            assert!(ch >= 1 && cw >= 1 && top + ch <= h && left + cw <= w);
            let frac = (ch * cw) as f64 / (h * w) as f64;
            assert!((0.07..=1.0).contains(&frac), "{frac}");
            let ratio = cw as f64 / ch as f64;
            assert!((0.74..=1.35).contains(&ratio), "{ratio}");
        }
        // A 1000x10 strip never fits a sampled crop: the center fallback,
        // width clamped to the 4/3 ratio.
        let mut rng = SplitMix64::new(1);
        assert_eq!(
            random_resized_crop_params(10, 1000, &mut rng),
            (0, 493, 10, 13)
        );
        assert!((exp_small(LOG_RATIO.1) - 4.0 / 3.0).abs() < 1e-15);
    }

    #[test]
    fn flip_mirrors_rows() {
        let data: Vec<u8> = (0..2 * 3 * 3).map(|i| i as u8).collect();
        let seed = (0..).find(|&s| step_rng(s, 3).next_f64() < 0.5).unwrap();
        let out = step(
            3,
            Prepped::Rgb8 { h: 2, w: 3, data },
            &PrepConfig::default(),
            seed,
        );
        let Prepped::Rgb8 { data, .. } = out.unwrap() else {
            panic!()
        };
        assert_eq!(
            data,
            [6, 7, 8, 3, 4, 5, 0, 1, 2, 15, 16, 17, 12, 13, 14, 9, 10, 11]
        );
    }

    #[test]
    fn resize_of_a_flat_image_is_flat_and_identity_is_exact() {
        let src: Vec<u8> = [10u8, 200, 30].repeat(50 * 40);
        let out = resize_rgb8(&src, 50, 3, 4, 30, 40, 224, 224);
        assert!(out.chunks_exact(3).all(|p| p == [10, 200, 30]));
        let src: Vec<u8> = (0..20 * 10 * 3).map(|i| (i * 13 % 256) as u8).collect();
        assert_eq!(resize_rgb8(&src, 20, 0, 0, 10, 20, 10, 20), src);
    }

    #[test]
    fn png_gray_and_rgba_become_rgb() {
        let cfg = PrepConfig::default();
        for color in [
            image::ColorType::L8,
            image::ColorType::Rgba8,
            image::ColorType::Rgb8,
        ] {
            let b = png(31, 17, color);
            let x = run(enc(SampleFormat::Png, b), 0, 1, &cfg, 0).unwrap();
            let Prepped::Rgb8 { h, w, data } = x else {
                panic!()
            };
            assert_eq!((h, w, data.len()), (17, 31, 17 * 31 * 3));
            if color == image::ColorType::L8 {
                assert!(data.chunks_exact(3).all(|p| p[0] == p[1] && p[1] == p[2]));
            }
        }
        let x = run(
            enc(SampleFormat::Png, png(300, 200, image::ColorType::Rgb8)),
            0,
            5,
            &cfg,
            3,
        );
        assert!(matches!(x, Ok(Prepped::Tensor { h: 224, w: 224, .. })));
    }

    #[test]
    fn corrupt_and_truncated_images_give_decode_errors() {
        let cfg = PrepConfig::default();
        let b = jpeg(64, 48, 2);
        let dec = |bytes: Vec<u8>| run(enc(SampleFormat::Jpeg, bytes), 0, 1, &cfg, 0);
        for cut in [3, 10, 50, 200, b.len() / 2, b.len() - 2] {
            let e = dec(b[..cut].to_vec()).unwrap_err();
            assert!(matches!(e, PrepError::Decode { .. }), "cut {cut}: {e}");
        }
        // The start-of-frame marker overwritten: no frame.
        let sof = b.windows(2).position(|w| w == [0xFF, 0xC0]).unwrap();
        let mut x = b.clone();
        x[sof + 1] = 0x01;
        assert!(matches!(dec(x), Err(PrepError::Decode { .. })));
        // Bit flips anywhere: an error or some image, never a panic (the
        // decoder is also guarded, but it should not need to be).
        let prev = std::panic::take_hook();
        let panicked = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let p2 = panicked.clone();
        std::panic::set_hook(Box::new(move |_| {
            p2.store(true, std::sync::atomic::Ordering::SeqCst)
        }));
        let mut rng = SplitMix64::new(99);
        let mut errors = 0;
        for _ in 0..300 {
            let mut x = b.clone();
            for _ in 0..3 {
                let i = 3 + rng.below(x.len() as u64 - 3) as usize;
                x[i] ^= 1 << rng.below(8);
            }
            match dec(x) {
                Ok(Prepped::Rgb8 { data, h, w }) => assert_eq!(data.len(), (h * w * 3) as usize),
                Ok(other) => panic!("{:?}", other.kind()),
                Err(PrepError::Decode { .. }) | Err(PrepError::TooLarge { .. }) => errors += 1,
                Err(e) => panic!("{e}"),
            }
        }
        std::panic::set_hook(prev);
        assert!(
            !panicked.load(std::sync::atomic::Ordering::SeqCst),
            "decoder panicked"
        );
        assert!(errors > 0);
        // Garbage, and a PNG labelled as a JPEG.
        assert!(matches!(
            dec(vec![0xFF, 0xD8, 0xFF, 0, 0, 0]),
            Err(PrepError::Decode { .. })
        ));
        let p = png(4, 4, image::ColorType::Rgb8);
        let e = dec(p).unwrap_err();
        assert!(e.to_string().contains("Png"), "{e}");
        let mut p = png(40, 40, image::ColorType::Rgb8);
        let n = p.len();
        p.truncate(n - 30);
        let e = run(enc(SampleFormat::Png, p), 0, 1, &cfg, 0).unwrap_err();
        assert!(matches!(e, PrepError::Decode { .. }), "{e}");
    }

    #[test]
    fn too_large_header_is_refused_before_decoding() {
        let cfg = PrepConfig {
            max_pixels: 100 * 100,
            ..PrepConfig::default()
        };
        let b = jpeg(101, 100, 1);
        let e = run(enc(SampleFormat::Jpeg, b.clone()), 0, 1, &cfg, 0).unwrap_err();
        assert_eq!(
            e,
            PrepError::TooLarge {
                w: 101,
                h: 100,
                max_pixels: 10000
            }
        );
        assert!(run(enc(SampleFormat::Jpeg, jpeg(100, 100, 1)), 0, 1, &cfg, 0).is_ok());
        // A JPEG whose header claims 60000x60000 but holds no data: refused
        // from the header alone (decoding it would fail differently).
        let sof = b.windows(2).position(|w| w == [0xFF, 0xC0]).unwrap();
        let mut bomb = b[..sof + 9].to_vec(); // through height and width
        bomb[sof + 5..sof + 9].copy_from_slice(&[0xEA, 0x60, 0xEA, 0x60]);
        bomb.extend_from_slice(&b[sof + 9..]);
        let e = run(
            enc(SampleFormat::Jpeg, bomb.clone()),
            0,
            1,
            &PrepConfig::default(),
            0,
        );
        assert_eq!(
            e.unwrap_err(),
            PrepError::TooLarge {
                w: 60000,
                h: 60000,
                max_pixels: 64 << 20
            }
        );
        assert_eq!(
            image_dims(&bomb, SampleFormat::Jpeg).unwrap(),
            (60000, 60000)
        );
        let p = png(300, 300, image::ColorType::Rgb8);
        let e = run(enc(SampleFormat::Png, p), 0, 1, &cfg, 0).unwrap_err();
        assert!(matches!(e, PrepError::TooLarge { w: 300, h: 300, .. }));
    }

    #[test]
    fn from_bytes_rejects_bad_headers_and_lengths() {
        let x = Prepped::Rgb8 {
            h: 2,
            w: 3,
            data: vec![1; 18],
        };
        let good = x.to_bytes_k(2);
        assert_eq!(good.len(), WIRE_HEADER + 18);
        assert_eq!(Prepped::from_bytes(2, &good).unwrap(), x);
        let bad = |k: usize, b: &[u8]| match Prepped::from_bytes(k, b) {
            Err(PrepError::BadWire { why }) => why,
            other => panic!("{other:?}"),
        };
        assert!(bad(2, &good[..good.len() - 1]).contains("needs 18"));
        let mut long = good.clone();
        long.push(0);
        assert!(bad(2, &long).contains("needs 18"));
        assert!(bad(2, &good[..10]).contains("header"));
        let mut m = good.clone();
        m[0] = b'X';
        assert!(bad(2, &m).contains("magic"));
        assert!(bad(4, &good).contains("dtype"));
        assert!(bad(6, &good).contains("steps"));
        let mut d = good.clone();
        d[16] = 4; // channels 4
        assert!(bad(2, &d).contains("HxWx3"));
        let mut d = good.clone();
        d[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        d[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
        bad(2, &d);
        let mut r = good.clone();
        r[6] = 1;
        assert!(bad(2, &r).contains("reserved"));
        let t = Prepped::Tensor {
            c: 3,
            h: 1,
            w: 2,
            data: vec![0.5, -1.0, 2.0, 3.0, 4.0, 5.0],
        };
        let tb = t.to_bytes_k(5);
        assert_eq!(tb.len(), WIRE_HEADER + 24);
        assert_eq!(Prepped::from_bytes(5, &tb).unwrap(), t);
        assert!(bad(5, &tb[..tb.len() - 4]).contains("needs 24"));
        assert!(bad(2, &tb).contains("dtype"));
        let mut wrong_k = tb.clone();
        wrong_k[4] = 2;
        bad(5, &wrong_k);
        assert!(bad(0, b"hello").contains("0 steps"));
        assert!(matches!(
            Prepped::from_bytes(0, &[0xFF, 0xD8, 0xFF, 1]),
            Ok(Prepped::Encoded {
                format: SampleFormat::Jpeg,
                ..
            })
        ));
    }

    #[test]
    fn run_rejects_mismatched_inputs() {
        let cfg = PrepConfig::default();
        let x = Prepped::Rgb8 {
            h: 2,
            w: 2,
            data: vec![0; 12],
        };
        assert!(matches!(
            run(x.clone(), 0, 2, &cfg, 0),
            Err(PrepError::BadSteps { .. })
        ));
        assert!(matches!(
            run(x.clone(), 4, 5, &cfg, 0),
            Err(PrepError::BadSteps { .. })
        ));
        assert!(matches!(
            run(x.clone(), 3, 2, &cfg, 0),
            Err(PrepError::BadSteps { .. })
        ));
        assert!(matches!(
            run(x.clone(), 3, 6, &cfg, 0),
            Err(PrepError::BadSteps { .. })
        ));
        assert_eq!(run(x.clone(), 2, 2, &cfg, 0).unwrap(), x);
        let bad_cfg = PrepConfig {
            crop: 0,
            ..cfg.clone()
        };
        assert!(matches!(
            run(x, 1, 2, &bad_cfg, 0),
            Err(PrepError::BadConfig { .. })
        ));
    }

    #[test]
    fn npy_samples_go_straight_to_a_tensor() {
        let cfg = PrepConfig::default();
        let vals: Vec<f32> = (0..3 * 4 * 5).map(|i| i as f32).collect();
        let chw = encode_npy_f32(&[3, 4, 5], &vals);
        let t = run(enc(SampleFormat::Npy, chw.clone()), 0, 5, &cfg, 0).unwrap();
        assert_eq!(
            t,
            Prepped::Tensor {
                c: 3,
                h: 4,
                w: 5,
                data: vals.clone()
            }
        );
        assert_eq!(Prepped::from_bytes(5, &t.to_bytes_k(5)).unwrap(), t);
        // (H, W, 3) is transposed to channels first.
        let hwc = encode_npy_f32(&[4, 5, 3], &vals);
        let Prepped::Tensor { data, h, w, .. } =
            run(enc(SampleFormat::Npy, hwc), 0, 5, &cfg, 0).unwrap()
        else {
            panic!()
        };
        assert_eq!((h, w), (4, 5));
        assert_eq!(&data[..3], &[0.0, 3.0, 6.0]);
        assert_eq!(data[20], 1.0);
        // uint8 gets ToTensor and Normalize.
        let u = encode_npy_u8(&[3, 1, 1], &[255, 0, 128]);
        let Prepped::Tensor { data, .. } = run(enc(SampleFormat::Npy, u), 0, 5, &cfg, 0).unwrap()
        else {
            panic!()
        };
        assert_eq!(data[0], (1.0 - 0.485) / 0.229);
        assert_eq!(data[1], (0.0 - 0.456) / 0.224);
        for k in 1..STEPS {
            let e = run(enc(SampleFormat::Npy, chw.clone()), 0, k, &cfg, 0).unwrap_err();
            assert_eq!(e, PrepError::NotImage { step: k });
            assert!(e.to_string().contains(".npy"), "{e}");
        }
        let e = run(
            enc(SampleFormat::Npy, encode_npy_f32(&[2, 2], &[0.0; 4])),
            0,
            5,
            &cfg,
            0,
        );
        assert!(matches!(e, Err(PrepError::Npy { .. })));
        let p = profile(&chw, SampleFormat::Npy, &cfg, 0).unwrap();
        assert_eq!(p.len(), STEPS + 1);
        assert_eq!(p[5].bytes_after, (WIRE_HEADER + 4 * 60) as u64);
        assert_eq!(p[2].bytes_after, chw.len() as u64);
        assert!(eval_tensor(&chw, SampleFormat::Npy, 4, &cfg).is_err());
        let sq = encode_npy_f32(&[3, 4, 4], &[0.25; 48]);
        assert_eq!(
            eval_tensor(&sq, SampleFormat::Npy, 4, &cfg).unwrap(),
            vec![0.25; 48]
        );
    }

    #[test]
    fn eval_tensor_shape_and_determinism() {
        let cfg = PrepConfig::default();
        for (w, h) in [(300, 200), (100, 333), (224, 224), (50, 40)] {
            let b = jpeg(w, h, 4);
            let t = eval_tensor(&b, SampleFormat::Jpeg, 224, &cfg).unwrap();
            assert_eq!(t.len(), 3 * 224 * 224);
            assert_eq!(t, eval_tensor(&b, SampleFormat::Jpeg, 224, &cfg).unwrap());
            assert!(t.iter().all(|v| v.is_finite()));
        }
        let t = eval_tensor(&jpeg(64, 64, 4), SampleFormat::Jpeg, 32, &cfg).unwrap();
        assert_eq!(t.len(), 3 * 32 * 32);
        assert!(eval_tensor(&[1, 2, 3], SampleFormat::Jpeg, 32, &cfg).is_err());
    }

    #[test]
    fn f16_round_trip() {
        let v = [0.0f32, 1.0, -2.5, 65504.0, 0.1];
        let b = f32_to_f16_le(&v);
        assert_eq!(b.len(), 10);
        assert_eq!(&b[2..4], &[0x00, 0x3C]);
        let back = f16_le_to_f32(&b).unwrap();
        assert_eq!(&back[..4], &v[..4]);
        assert!((back[4] - 0.1).abs() < 1e-4);
        assert!(matches!(
            f16_le_to_f32(&b[..3]),
            Err(PrepError::BadWire { .. })
        ));
    }
}

#[cfg(test)]
mod golden {
    use super::*;
    use crate::synth::{generate, SynthSpec};

    /// FNV-1a, to pin outputs in a few bytes.
    fn fnv(bytes: &[u8]) -> u64 {
        bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
            (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
        })
    }

    /// The same sample and seed give the same bytes on every machine: a
    /// change here means the generator, decoder, crop or resize changed.
    #[test]
    fn pinned_outputs() {
        let s = generate(&SynthSpec {
            samples: 2,
            classes: 2,
            seed: 2024,
            sizes: vec![(160, 120), (900, 700)],
            quality: 95,
        });
        let cfg = PrepConfig::default();
        let mut got = vec![fnv(&s[0].bytes)];
        for k in 1..=STEPS {
            let x = run(
                Prepped::Encoded {
                    format: s[0].format,
                    bytes: s[0].bytes.clone(),
                },
                0,
                k,
                &cfg,
                77,
            )
            .unwrap();
            got.push(fnv(&x.to_bytes_k(k)));
        }
        let t = eval_tensor(&s[1].bytes, s[1].format, 224, &cfg).unwrap();
        got.push(fnv(&f32_to_f16_le(&t)));
        let costs = profile(&s[1].bytes, s[1].format, &cfg, 5).unwrap();
        eprintln!(
            "pinned: {got:#x?}\nlarge sample {} bytes, costs {costs:?}",
            s[1].bytes.len()
        );
        assert!(s[1].bytes.len() > 224 * 224 * 3);
        assert_eq!(costs[2].bytes_after, (224 * 224 * 3 + WIRE_HEADER) as u64);
        assert_eq!(got, PINNED);
    }

    const PINNED: [u64; 7] = [
        0x1189_cbce_1bc0_fa75,
        0x68d3_b9d0_fbba_631c,
        0x4897_28ac_857e_6cf1,
        0x2d53_3567_a2c1_09f4,
        0x08fa_e575_8057_9834,
        0xbc8b_dcee_6ffa_c2eb,
        0x5cfb_c19f_7278_65cc,
    ];
}
