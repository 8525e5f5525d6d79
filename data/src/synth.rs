//! Labelled image sets generated deterministically from a seed and encoded
//! as real JPEGs: each class has its own hue and stripe orientation and
//! frequency; each sample its own random phase, offset, hue jitter and pixel
//! noise, so no two samples are the same and large images stay large files.

use crate::dir::RawSample;
use crate::format::SampleFormat;
use crate::rng::SplitMix64;
use image::codecs::jpeg::JpegEncoder;
use image::ColorType;

/// What to generate.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SynthSpec {
    /// How many samples.
    pub samples: usize,
    /// How many classes; sample i has label i % classes.
    pub classes: u32,
    /// The seed; the same spec always gives the same bytes.
    pub seed: u64,
    /// Image sizes as (width, height); sample i has sizes[i % sizes.len()].
    pub sizes: Vec<(u32, u32)>,
    /// JPEG quality, 1..=100.
    pub quality: u8,
}

/// The amplitude of the uniform per-pixel, per-channel noise, in levels.
pub const NOISE: i32 = 24;

/// cos and sin of k * 22.5 degrees, k = 0..8, written out (no libm).
const DIRS: [(f32, f32); 8] = [
    (1.0, 0.0),
    (0.923_879_5, 0.382_683_43),
    (0.707_106_77, 0.707_106_77),
    (0.382_683_43, 0.923_879_5),
    (0.0, 1.0),
    (-0.382_683_43, 0.923_879_5),
    (-0.707_106_77, 0.707_106_77),
    (-0.923_879_5, 0.382_683_43),
];

/// HSV (h in [0, 360), s and v in [0, 1]) to RGB in [0, 1].
fn hsv(h: f32, s: f32, v: f32) -> [f32; 3] {
    let h = h.rem_euclid(360.0) / 60.0;
    let i = h.floor();
    let f = h - i;
    let (p, q, t) = (v * (1.0 - s), v * (1.0 - s * f), v * (1.0 - s * (1.0 - f)));
    match i as u32 {
        0 => [v, t, p],
        1 => [q, v, p],
        2 => [p, v, t],
        3 => [p, q, v],
        4 => [t, p, v],
        _ => [v, p, q],
    }
}

/// The RGB8 pixels (row-major, `h * w * 3`) of one sample of class `label`
/// out of `classes`, drawn from `rng`.
pub fn render(label: u32, classes: u32, w: u32, h: u32, rng: &mut SplitMix64) -> Vec<u8> {
    let hue = label as f32 * 360.0 / classes.max(1) as f32 + rng.uniform(-4.0, 4.0) as f32;
    let (dx, dy) = DIRS[(label % 8) as usize];
    let cycles = 3.0 + 2.0 * ((label / 8) % 4) as f32;
    let phase = rng.next_f64() as f32;
    let (ox, oy) = (rng.below(w as u64) as f32, rng.below(h as u64) as f32);
    let side = w.min(h).max(1) as f32;
    let mut out = Vec::with_capacity(w as usize * h as usize * 3);
    for y in 0..h {
        for x in 0..w {
            let u = ((x as f32 + ox) * dx + (y as f32 + oy) * dy) / side * cycles + phase;
            let tri = 1.0 - 2.0 * (u - u.floor() - 0.5).abs();
            let rgb = hsv(hue, 0.75, 0.3 + 0.6 * tri);
            let r = rng.next_u64();
            for (c, v) in rgb.iter().enumerate() {
                let noise = ((r >> (16 * c)) & 0xFFFF) as i32 * (2 * NOISE + 1) / 65536 - NOISE;
                out.push(((v * 255.0).round() as i32 + noise).clamp(0, 255) as u8);
            }
        }
    }
    out
}

/// Generates the set: `spec.samples` JPEG samples named `s000000.jpg`, ...,
/// sample i of label i % classes and size sizes[i % sizes.len()], each drawn
/// from its own stream of the seed (so sample i does not depend on how many
/// samples are generated).
///
/// Panics when `classes` is 0, `sizes` is empty or holds a zero side, or
/// `quality` is not in 1..=100.
pub fn generate(spec: &SynthSpec) -> Vec<RawSample> {
    assert!(spec.classes > 0, "SynthSpec.classes must be at least 1");
    assert!(!spec.sizes.is_empty(), "SynthSpec.sizes must not be empty");
    assert!(
        spec.sizes
            .iter()
            .all(|&(w, h)| w > 0 && h > 0 && w <= 65535 && h <= 65535),
        "SynthSpec.sizes must be in 1..=65535"
    );
    assert!(
        (1..=100).contains(&spec.quality),
        "SynthSpec.quality must be in 1..=100"
    );
    (0..spec.samples)
        .map(|i| {
            let label = (i % spec.classes as usize) as u32;
            let (w, h) = spec.sizes[i % spec.sizes.len()];
            let mut rng = SplitMix64::derive(spec.seed, i as u64);
            let pixels = render(label, spec.classes, w, h, &mut rng);
            let mut bytes = Vec::new();
            JpegEncoder::new_with_quality(&mut bytes, spec.quality)
                .encode(&pixels, w, h, ColorType::Rgb8)
                .expect("encoding a JPEG into memory cannot fail");
            RawSample {
                name: format!("s{i:06}.jpg"),
                label,
                format: SampleFormat::Jpeg,
                bytes,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prep::decode_rgb8;

    fn mean_rgb(s: &RawSample) -> [f64; 3] {
        let (_, _, px) = decode_rgb8(&s.bytes, s.format, 1 << 30).unwrap();
        let mut m = [0f64; 3];
        for p in px.chunks_exact(3) {
            for c in 0..3 {
                m[c] += p[c] as f64;
            }
        }
        m.map(|v| v / (px.len() / 3) as f64)
    }

    #[test]
    fn small_and_large_sizes_deterministic() {
        let spec = SynthSpec {
            samples: 4,
            classes: 2,
            seed: 9,
            sizes: vec![(64, 64), (96, 128), (900, 700)],
            quality: 95,
        };
        let a = generate(&spec);
        assert_eq!(a, generate(&spec));
        assert_eq!(a.len(), 4);
        assert_eq!(a[0].name, "s000000.jpg");
        assert_eq!(a[3].name, "s000003.jpg");
        assert_eq!(a.iter().map(|s| s.label).collect::<Vec<_>>(), [0, 1, 0, 1]);
        let raw224 = 224 * 224 * 3;
        assert!(a[0].bytes.len() < raw224, "{}", a[0].bytes.len());
        assert!(a[1].bytes.len() < raw224, "{}", a[1].bytes.len());
        assert!(a[2].bytes.len() > raw224, "{}", a[2].bytes.len());
        // Sample 3 has size (64,64) again but differs from sample 0 (and 1).
        assert_ne!(a[3].bytes, a[0].bytes);
        let dims = |s: &RawSample| {
            let (h, w, _) = decode_rgb8(&s.bytes, s.format, 1 << 30).unwrap();
            (w, h)
        };
        assert_eq!(dims(&a[1]), (96, 128));
        assert_eq!(dims(&a[2]), (900, 700));
        let other = generate(&SynthSpec { seed: 10, ..spec });
        assert_ne!(other[0].bytes, a[0].bytes);
    }

    #[test]
    fn classes_differ_in_mean_colour() {
        let spec = SynthSpec {
            samples: 8,
            classes: 4,
            seed: 1,
            sizes: vec![(64, 64)],
            quality: 90,
        };
        let s = generate(&spec);
        let means: Vec<[f64; 3]> = s.iter().map(mean_rgb).collect();
        let dist = |a: &[f64; 3], b: &[f64; 3]| {
            a.iter()
                .zip(b)
                .map(|(x, y)| (x - y).powi(2))
                .sum::<f64>()
                .sqrt()
        };
        for i in 0..4 {
            // Same class (i and i + 4): close; different classes: far apart.
            let same = dist(&means[i], &means[i + 4]);
            for j in 0..4 {
                if i != j {
                    let diff = dist(&means[i], &means[j]);
                    assert!(diff > 3.0 * same.max(1.0), "{i} {j}: {diff} vs {same}");
                }
            }
        }
    }
}
