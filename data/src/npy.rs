//! A minimal reader and writer of NumPy `.npy` files: C-order arrays of
//! little-endian float32 (`<f4`) or uint8 (`|u1`).

/// The largest `.npy` header accepted, in bytes.
pub const NPY_HEADER_MAX: usize = 64 * 1024;
/// The most dimensions an accepted array may have.
pub const NPY_DIMS_MAX: usize = 8;

/// The elements of a parsed `.npy` array.
#[derive(Debug, Clone, PartialEq)]
pub enum NpyData {
    /// float32 elements (`<f4`).
    F32(Vec<f32>),
    /// uint8 elements (`|u1`).
    U8(Vec<u8>),
}

/// A parsed `.npy` array: its shape and its elements in C order.
#[derive(Debug, Clone, PartialEq)]
pub struct NpyArray {
    /// The array's shape, outermost dimension first.
    pub shape: Vec<usize>,
    /// The elements, in C (row-major) order.
    pub data: NpyData,
}

/// Parses a `.npy` file. The error says what was wrong with it.
pub fn parse_npy(bytes: &[u8]) -> Result<NpyArray, String> {
    if !bytes.starts_with(b"\x93NUMPY") {
        return Err("not a .npy file (no \\x93NUMPY magic)".into());
    }
    if bytes.len() < 10 {
        return Err(format!("truncated .npy preamble ({} bytes)", bytes.len()));
    }
    let major = bytes[6];
    let (header_len, start) = match major {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        2 | 3 => {
            if bytes.len() < 12 {
                return Err(format!("truncated .npy preamble ({} bytes)", bytes.len()));
            }
            let n = u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]);
            (n as usize, 12)
        }
        v => return Err(format!("unsupported .npy format version {v}")),
    };
    if header_len > NPY_HEADER_MAX {
        return Err(format!(
            ".npy header of {header_len} bytes is over the limit of {NPY_HEADER_MAX}"
        ));
    }
    let end = start + header_len;
    if bytes.len() < end {
        return Err(format!(
            "truncated .npy header: {header_len} bytes announced, {} present",
            bytes.len() - start
        ));
    }
    let header = std::str::from_utf8(&bytes[start..end])
        .map_err(|_| ".npy header is not text".to_string())?;
    let (descr, fortran, shape) = parse_header(header)?;
    if fortran {
        return Err(".npy array is in Fortran order; only C order is supported".into());
    }
    let item = match descr.as_str() {
        "<f4" => 4,
        "|u1" | "<u1" => 1,
        d => {
            return Err(format!(
                ".npy dtype {d:?} is not supported (only '<f4' float32 and '|u1' uint8)"
            ))
        }
    };
    let count = shape
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(|| format!(".npy shape {shape:?} overflows"))?;
    let data = &bytes[end..];
    let want = count
        .checked_mul(item)
        .ok_or_else(|| format!(".npy shape {shape:?} overflows"))?;
    if data.len() != want {
        return Err(format!(
            ".npy data is {} bytes but shape {shape:?} of {descr} needs {want}",
            data.len()
        ));
    }
    let data = if item == 4 {
        NpyData::F32(
            data.chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        )
    } else {
        NpyData::U8(data.to_vec())
    };
    Ok(NpyArray { shape, data })
}

/// A tiny parser of the header's Python dict literal.
struct Lexer<'a> {
    s: &'a [u8],
    i: usize,
}

enum Value {
    Str(String),
    Bool(bool),
    Tuple(Vec<usize>),
}

impl Lexer<'_> {
    fn ws(&mut self) {
        while self.i < self.s.len() && self.s[self.i].is_ascii_whitespace() {
            self.i += 1;
        }
    }
    fn peek(&mut self) -> Option<u8> {
        self.ws();
        self.s.get(self.i).copied()
    }
    fn expect(&mut self, c: u8) -> Result<(), String> {
        if self.peek() == Some(c) {
            self.i += 1;
            Ok(())
        } else {
            Err(format!(
                ".npy header: expected {:?} at byte {}",
                c as char, self.i
            ))
        }
    }
    fn string(&mut self) -> Result<String, String> {
        let q = self.peek().filter(|&c| c == b'\'' || c == b'"');
        let Some(q) = q else {
            return Err(format!(".npy header: expected a string at byte {}", self.i));
        };
        self.i += 1;
        let start = self.i;
        while self.i < self.s.len() && self.s[self.i] != q {
            self.i += 1;
        }
        if self.i == self.s.len() {
            return Err(".npy header: unterminated string".into());
        }
        let out = String::from_utf8_lossy(&self.s[start..self.i]).into_owned();
        self.i += 1;
        Ok(out)
    }
    fn value(&mut self) -> Result<Value, String> {
        match self.peek() {
            Some(b'\'') | Some(b'"') => Ok(Value::Str(self.string()?)),
            Some(b'T') if self.s[self.i..].starts_with(b"True") => {
                self.i += 4;
                Ok(Value::Bool(true))
            }
            Some(b'F') if self.s[self.i..].starts_with(b"False") => {
                self.i += 5;
                Ok(Value::Bool(false))
            }
            Some(b'(') => {
                self.i += 1;
                let mut dims = Vec::new();
                loop {
                    match self.peek() {
                        Some(b')') => {
                            self.i += 1;
                            break;
                        }
                        Some(c) if c.is_ascii_digit() => {
                            let start = self.i;
                            while self.i < self.s.len() && self.s[self.i].is_ascii_digit() {
                                self.i += 1;
                            }
                            let t = std::str::from_utf8(&self.s[start..self.i]).unwrap_or("");
                            let d: usize = t
                                .parse()
                                .map_err(|_| format!(".npy header: dimension {t} too large"))?;
                            dims.push(d);
                            if dims.len() > NPY_DIMS_MAX {
                                return Err(format!(
                                    ".npy header: more than {NPY_DIMS_MAX} dimensions"
                                ));
                            }
                            match self.peek() {
                                Some(b',') => self.i += 1,
                                Some(b')') => {}
                                _ => return Err(".npy header: bad shape tuple".into()),
                            }
                        }
                        _ => return Err(".npy header: bad shape tuple".into()),
                    }
                }
                Ok(Value::Tuple(dims))
            }
            _ => Err(format!(".npy header: unexpected value at byte {}", self.i)),
        }
    }
}

fn parse_header(h: &str) -> Result<(String, bool, Vec<usize>), String> {
    let mut lx = Lexer {
        s: h.as_bytes(),
        i: 0,
    };
    let (mut descr, mut fortran, mut shape) = (None, None, None);
    lx.expect(b'{')?;
    loop {
        if lx.peek() == Some(b'}') {
            lx.i += 1;
            if lx.peek().is_some() {
                return Err(".npy header: text after the closing '}'".into());
            }
            break;
        }
        let key = lx.string()?;
        lx.expect(b':')?;
        match (key.as_str(), lx.value()?) {
            ("descr", Value::Str(s)) => descr = Some(s),
            ("fortran_order", Value::Bool(b)) => fortran = Some(b),
            ("shape", Value::Tuple(t)) => shape = Some(t),
            (k, _) => return Err(format!(".npy header: unexpected key or value for {k:?}")),
        }
        match lx.peek() {
            Some(b',') => lx.i += 1,
            Some(b'}') => {}
            _ => return Err(".npy header: expected ',' or '}'".into()),
        }
    }
    match (descr, fortran, shape) {
        (Some(d), Some(f), Some(s)) => Ok((d, f, s)),
        _ => Err(".npy header lacks one of 'descr', 'fortran_order', 'shape'".into()),
    }
}

fn encode(descr: &str, shape: &[usize], data: &[u8]) -> Vec<u8> {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let shape = if dims.len() == 1 {
        format!("({},)", dims[0])
    } else {
        format!("({})", dims.join(", "))
    };
    let mut h = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
    // Pad so the data starts on a 64-byte boundary, newline last.
    while !(10 + h.len() + 1).is_multiple_of(64) {
        h.push(' ');
    }
    h.push('\n');
    let mut out = Vec::with_capacity(10 + h.len() + data.len());
    out.extend_from_slice(b"\x93NUMPY\x01\x00");
    out.extend_from_slice(&(h.len() as u16).to_le_bytes());
    out.extend_from_slice(h.as_bytes());
    out.extend_from_slice(data);
    out
}

/// A `.npy` file (version 1.0) holding a C-order float32 array of `shape`.
/// `data.len()` must be the product of `shape`.
pub fn encode_npy_f32(shape: &[usize], data: &[f32]) -> Vec<u8> {
    assert_eq!(shape.iter().product::<usize>(), data.len());
    let bytes: Vec<u8> = data.iter().flat_map(|x| x.to_le_bytes()).collect();
    encode("<f4", shape, &bytes)
}

/// A `.npy` file (version 1.0) holding a C-order uint8 array of `shape`.
/// `data.len()` must be the product of `shape`.
pub fn encode_npy_u8(shape: &[usize], data: &[u8]) -> Vec<u8> {
    assert_eq!(shape.iter().product::<usize>(), data.len());
    encode("|u1", shape, data)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let data: Vec<f32> = (0..24).map(|i| i as f32 * 0.5 - 3.0).collect();
        let b = encode_npy_f32(&[2, 3, 4], &data);
        assert_eq!(
            parse_npy(&b).unwrap(),
            NpyArray {
                shape: vec![2, 3, 4],
                data: NpyData::F32(data)
            }
        );
        let b = encode_npy_u8(&[5], &[1, 2, 3, 4, 5]);
        let a = parse_npy(&b).unwrap();
        assert_eq!(a.shape, vec![5]);
        assert_eq!(a.data, NpyData::U8(vec![1, 2, 3, 4, 5]));
    }

    #[test]
    fn numpy_written_header() {
        // The header numpy 1.x writes for np.zeros((2,2), dtype='<f4').
        let h = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 2), }";
        let mut b = b"\x93NUMPY\x01\x00".to_vec();
        let mut h = h.to_string();
        while !(10 + h.len() + 1).is_multiple_of(64) {
            h.push(' ');
        }
        h.push('\n');
        b.extend_from_slice(&(h.len() as u16).to_le_bytes());
        b.extend_from_slice(h.as_bytes());
        b.extend_from_slice(&[0u8; 16]);
        let a = parse_npy(&b).unwrap();
        assert_eq!(a.shape, vec![2, 2]);
    }

    #[test]
    fn rejects() {
        let good = encode_npy_f32(&[2, 2], &[0.0; 4]);
        assert!(parse_npy(&good[..good.len() - 1])
            .unwrap_err()
            .contains("needs 16"));
        let mut extra = good.clone();
        extra.push(0);
        assert!(parse_npy(&extra).is_err());
        assert!(parse_npy(&good[..20]).unwrap_err().contains("truncated"));
        assert!(parse_npy(b"\x93NUMPY").is_err());
        let f8 = encode("<f8", &[1], &[0; 8]);
        assert!(parse_npy(&f8).unwrap_err().contains("<f8"));
        let fo = String::from_utf8_lossy(&good).replace("False", "True ");
        assert!(parse_npy(fo.as_bytes()).is_err());
        let big = encode("<f4", &[usize::MAX, 2], &[]);
        assert!(parse_npy(&big).unwrap_err().contains("overflows"));
        let mut v2 = b"\x93NUMPY\x02\x00".to_vec();
        v2.extend_from_slice(&(1u32 << 30).to_le_bytes());
        assert!(parse_npy(&v2).unwrap_err().contains("limit"));
    }
}
