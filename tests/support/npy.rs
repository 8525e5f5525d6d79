//! The `.npy` files of the numerics goldens and the comparison every
//! reference check uses (`tests/numerics.rs`, `tests/import.rs`).
#![allow(dead_code)]

use std::path::Path;

// ---------------------------------------------------------------------------
// A minimal .npy reader (f32, little-endian, C order).
// ---------------------------------------------------------------------------

#[derive(Debug, Clone, PartialEq)]
pub struct NpyF32 {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

/// The value of `'key': VALUE` in a .npy header dict (up to the next `,` at
/// depth 0 or the closing `}`).
pub fn header_field<'a>(header: &'a str, key: &str) -> Result<&'a str, String> {
    let pat = format!("'{key}':");
    let start = header
        .find(&pat)
        .ok_or_else(|| format!("npy header lacks {key}: {header}"))?
        + pat.len();
    let rest = &header[start..];
    let mut depth = 0i32;
    for (i, c) in rest.char_indices() {
        match c {
            '(' | '[' => depth += 1,
            ')' | ']' => depth -= 1,
            ',' | '}' if depth == 0 => return Ok(rest[..i].trim()),
            _ => {}
        }
    }
    Err(format!("npy header: unterminated {key}: {header}"))
}

pub fn parse_npy_f32(bytes: &[u8]) -> Result<NpyF32, String> {
    const MAGIC: &[u8] = b"\x93NUMPY";
    if bytes.len() < 10 || &bytes[..6] != MAGIC {
        return Err("not a .npy file (bad magic)".into());
    }
    let major = bytes[6];
    let (hlen, hstart) = match major {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        2 | 3 => {
            if bytes.len() < 12 {
                return Err("truncated .npy header".into());
            }
            (
                u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize,
                12,
            )
        }
        v => return Err(format!("unsupported .npy version {v}")),
    };
    if hlen > 1 << 20 || hstart + hlen > bytes.len() {
        return Err(format!("bad .npy header length {hlen}"));
    }
    let header = std::str::from_utf8(&bytes[hstart..hstart + hlen])
        .map_err(|_| "npy header is not UTF-8".to_string())?;
    let descr = header_field(header, "descr")?.trim_matches(|c| c == '\'' || c == '"');
    if descr != "<f4" {
        return Err(format!("npy dtype {descr}, expected <f4 (f32)"));
    }
    if header_field(header, "fortran_order")? != "False" {
        return Err("npy fortran_order arrays are not supported".into());
    }
    let shape_s = header_field(header, "shape")?;
    let inner = shape_s
        .strip_prefix('(')
        .and_then(|s| s.strip_suffix(')'))
        .ok_or_else(|| format!("npy shape {shape_s}"))?;
    let shape = inner
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.parse::<usize>()
                .map_err(|e| format!("npy shape {shape_s}: {e}"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let numel: usize = shape.iter().product();
    let body = &bytes[hstart + hlen..];
    if body.len() != numel * 4 {
        return Err(format!(
            "npy body has {} bytes, shape {shape:?} needs {}",
            body.len(),
            numel * 4
        ));
    }
    let data = body
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    Ok(NpyF32 { shape, data })
}

pub fn read_npy_f32(path: &Path) -> NpyF32 {
    let bytes =
        std::fs::read(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    parse_npy_f32(&bytes).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

// ---------------------------------------------------------------------------
// Comparison
// ---------------------------------------------------------------------------

#[derive(Debug, Clone, Copy)]
pub struct Errors {
    pub max_abs: f64,
    pub max_rel: f64,
}

/// `max|a - b|` and `max|a - b| / max(max|b|, 1e-6)`; NaN anywhere in `a`
/// (or a length mismatch) makes both infinite.
pub fn compare(a: &[f32], b: &[f32]) -> Errors {
    if a.len() != b.len() || a.iter().any(|v| !v.is_finite()) {
        return Errors {
            max_abs: f64::INFINITY,
            max_rel: f64::INFINITY,
        };
    }
    let scale = b
        .iter()
        .fold(0f64, |m, &v| m.max((v as f64).abs()))
        .max(1e-6);
    let max_abs = a
        .iter()
        .zip(b)
        .fold(0f64, |m, (&x, &y)| m.max((x as f64 - y as f64).abs()));
    Errors {
        max_abs,
        max_rel: max_abs / scale,
    }
}
