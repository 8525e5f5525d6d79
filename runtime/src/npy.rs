//! NumPy `.npy` files as [`HostTensor`]s: what `distmind infer` reads and
//! writes, so a NumPy reference can feed and check the executors.
//!
//! Supported: format versions 1.0, 2.0 and 3.0, little-endian `<f4` and
//! `<i8`, C order, any shape (a scalar `()` is shape `[]`). Written files
//! are version 1.0 (2.0 if the header would not fit), as `numpy.save` does.

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::exec::{HostTensor, TensorData};

const MAGIC: &[u8; 6] = b"\x93NUMPY";
/// Largest header accepted, checked before allocating it. NumPy's own
/// limit for reading untrusted files is 10 000 bytes; a shape of a few
/// dimensions needs under 200.
pub const NPY_HEADER_BYTES_MAX: usize = 64 << 10;
/// NumPy pads magic + length + header to a multiple of this.
const HEADER_ALIGN: usize = 64;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NpyError {
    #[error("{path}: {what}: {source}")]
    Io {
        path: PathBuf,
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: not a .npy file: {what}")]
    Format { path: PathBuf, what: String },
    #[error(
        "{path}: unsupported .npy contents: {what} (supported: little-endian <f4 or <i8, C order)"
    )]
    Unsupported { path: PathBuf, what: String },
    #[error("{path}: truncated data: the header promises {want} bytes of {descr} {shape:?}, the file has {got}")]
    Truncated {
        path: PathBuf,
        descr: &'static str,
        shape: Vec<usize>,
        want: u64,
        got: u64,
    },
}

/// Reads a `.npy` file.
pub fn read_npy(path: &Path) -> Result<HostTensor, NpyError> {
    let bytes = std::fs::read(path).map_err(|source| NpyError::Io {
        path: path.to_path_buf(),
        what: "cannot read",
        source,
    })?;
    parse_npy(&bytes, path)
}

/// Writes `t` as a `.npy` file (replacing any file there).
pub fn write_npy(path: &Path, t: &HostTensor) -> Result<(), NpyError> {
    let io = |what| {
        move |source| NpyError::Io {
            path: path.to_path_buf(),
            what,
            source,
        }
    };
    let file = std::fs::File::create(path).map_err(io("cannot create"))?;
    let mut w = std::io::BufWriter::new(file);
    w.write_all(&encode_header(t))
        .and_then(|_| match &t.data {
            TensorData::F32(v) => v.iter().try_for_each(|x| w.write_all(&x.to_le_bytes())),
            TensorData::I64(v) => v.iter().try_for_each(|x| w.write_all(&x.to_le_bytes())),
        })
        .and_then(|_| w.flush())
        .map_err(io("cannot write"))
}

// `encode_npy` writes the values' own bytes as little-endian ones.
#[cfg(target_endian = "big")]
compile_error!("npy encoding assumes a little-endian host");

/// The whole file for `t` in memory.
pub fn encode_npy(t: &HostTensor) -> Vec<u8> {
    let mut out = encode_header(t);
    // One allocation and one copy: the values' bytes are already in the
    // file's little-endian order (on the little-endian hosts supported).
    let data: &[u8] = match &t.data {
        TensorData::F32(v) => bytemuck::cast_slice(v),
        TensorData::I64(v) => bytemuck::cast_slice(v),
    };
    out.reserve_exact(data.len());
    out.extend_from_slice(data);
    out
}

/// The length of [`encode_npy`]'s bytes for `t`, without encoding them.
pub fn encoded_len(t: &HostTensor) -> usize {
    let data = match &t.data {
        TensorData::F32(v) => 4 * v.len(),
        TensorData::I64(v) => 8 * v.len(),
    };
    encode_header(t).len() + data
}

fn encode_header(t: &HostTensor) -> Vec<u8> {
    let descr = match t.data {
        TensorData::F32(_) => "<f4",
        TensorData::I64(_) => "<i8",
    };
    let shape = match t.shape.as_slice() {
        [] => "()".to_string(),
        [n] => format!("({n},)"),
        dims => format!(
            "({})",
            dims.iter()
                .map(|d| d.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    let mut dict = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
    // Version 1.0 has a u16 header length; 2.0 a u32.
    let (version, len_bytes) = if MAGIC.len() + 2 + 2 + dict.len() < u16::MAX as usize {
        (1u8, 2)
    } else {
        (2u8, 4)
    };
    let prefix = MAGIC.len() + 2 + len_bytes;
    let total = (prefix + dict.len() + 1).div_ceil(HEADER_ALIGN) * HEADER_ALIGN;
    while prefix + dict.len() + 1 < total {
        dict.push(' ');
    }
    dict.push('\n');
    let mut out = Vec::with_capacity(total);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&[version, 0]);
    if version == 1 {
        out.extend_from_slice(&(dict.len() as u16).to_le_bytes());
    } else {
        out.extend_from_slice(&(dict.len() as u32).to_le_bytes());
    }
    out.extend_from_slice(dict.as_bytes());
    out
}

/// Parses a whole `.npy` file; `path` only names it in errors.
pub fn parse_npy(bytes: &[u8], path: &Path) -> Result<HostTensor, NpyError> {
    let format = |what: String| NpyError::Format {
        path: path.to_path_buf(),
        what,
    };
    let unsupported = |what: String| NpyError::Unsupported {
        path: path.to_path_buf(),
        what,
    };
    if bytes.len() < MAGIC.len() + 2 || &bytes[..MAGIC.len()] != MAGIC {
        return Err(format("it does not start with the magic \\x93NUMPY".into()));
    }
    let (major, minor) = (bytes[6], bytes[7]);
    let len_bytes = match (major, minor) {
        (1, 0) => 2,
        (2, 0) | (3, 0) => 4,
        _ => return Err(unsupported(format!("format version {major}.{minor}"))),
    };
    let start = 8 + len_bytes;
    if bytes.len() < start {
        return Err(format("the file ends inside the header length".into()));
    }
    let header_len = if len_bytes == 2 {
        u16::from_le_bytes([bytes[8], bytes[9]]) as usize
    } else {
        u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize
    };
    if header_len > NPY_HEADER_BYTES_MAX {
        return Err(format(format!(
            "the header claims {header_len} bytes, more than the {NPY_HEADER_BYTES_MAX} accepted"
        )));
    }
    let Some(header) = bytes.get(start..start + header_len) else {
        return Err(format(format!(
            "the header claims {header_len} bytes, the file ends after {}",
            bytes.len() - start
        )));
    };
    let header =
        std::str::from_utf8(header).map_err(|_| format("the header is not UTF-8 text".into()))?;
    let dict = Header::parse(header)
        .map_err(|e| format(format!("bad header {:?}: {e}", header.trim_end())))?;
    if dict.fortran_order {
        return Err(unsupported(
            "fortran_order is True (save a C-ordered array: np.ascontiguousarray)".into(),
        ));
    }
    let (descr, item) = match dict.descr.as_str() {
        "<f4" => ("<f4", 4usize),
        "<i8" => ("<i8", 8),
        // '=' is native order, and only little-endian hosts are supported.
        "=f4" if cfg!(target_endian = "little") => ("<f4", 4),
        "=i8" if cfg!(target_endian = "little") => ("<i8", 8),
        other => return Err(unsupported(format!("dtype {other:?}"))),
    };
    let count = dict
        .shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .filter(|n| n.checked_mul(item).is_some())
        .ok_or_else(|| format(format!("shape {:?} overflows", dict.shape)))?;
    let data = &bytes[start + header_len..];
    let want = (count * item) as u64;
    if (data.len() as u64) < want {
        return Err(NpyError::Truncated {
            path: path.to_path_buf(),
            descr,
            shape: dict.shape,
            want,
            got: data.len() as u64,
        });
    }
    if data.len() as u64 > want {
        return Err(format(format!(
            "{} bytes follow the {want} bytes of {descr} {:?}",
            data.len() as u64 - want,
            dict.shape
        )));
    }
    // One allocation, then one copy (the bytes may sit at any alignment),
    // with no zero fill before it.
    Ok(if item == 4 {
        let mut v = Vec::<f32>::with_capacity(count);
        v.extend(
            data.chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes"))),
        );
        HostTensor::f32(dict.shape, v)
    } else {
        let mut v = Vec::<i64>::with_capacity(count);
        v.extend(
            data.chunks_exact(8)
                .map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes"))),
        );
        HostTensor::i64(dict.shape, v)
    })
}

/// The three keys of a `.npy` header dict.
#[derive(Debug, PartialEq)]
struct Header {
    descr: String,
    fortran_order: bool,
    shape: Vec<usize>,
}

impl Header {
    /// Parses the Python dict literal `{'descr': '<f4', 'fortran_order':
    /// False, 'shape': (2, 3), }` (any key order, either quote style).
    fn parse(text: &str) -> Result<Header, String> {
        let mut p = Parser {
            s: text.as_bytes(),
            i: 0,
        };
        let (mut descr, mut fortran, mut shape) = (None, None, None);
        p.expect(b'{')?;
        loop {
            p.ws();
            if p.eat(b'}') {
                break;
            }
            let key = p.string()?;
            p.ws();
            p.expect(b':')?;
            p.ws();
            match key.as_str() {
                "descr" => descr = Some(p.string()?),
                "fortran_order" => fortran = Some(p.boolean()?),
                "shape" => shape = Some(p.tuple()?),
                other => return Err(format!("unexpected key {other:?}")),
            }
            p.ws();
            if !p.eat(b',') {
                p.ws();
                p.expect(b'}')?;
                break;
            }
        }
        p.ws();
        if p.i != p.s.len() {
            return Err("text after the dict".into());
        }
        Ok(Header {
            descr: descr.ok_or("no 'descr'")?,
            fortran_order: fortran.ok_or("no 'fortran_order'")?,
            shape: shape.ok_or("no 'shape'")?,
        })
    }
}

struct Parser<'a> {
    s: &'a [u8],
    i: usize,
}

impl Parser<'_> {
    fn ws(&mut self) {
        while self.s.get(self.i).is_some_and(|c| c.is_ascii_whitespace()) {
            self.i += 1;
        }
    }

    fn eat(&mut self, c: u8) -> bool {
        if self.s.get(self.i) == Some(&c) {
            self.i += 1;
            true
        } else {
            false
        }
    }

    fn expect(&mut self, c: u8) -> Result<(), String> {
        if self.eat(c) {
            Ok(())
        } else {
            Err(format!("expected {:?} at byte {}", c as char, self.i))
        }
    }

    fn string(&mut self) -> Result<String, String> {
        let quote = match self.s.get(self.i) {
            Some(&q @ (b'\'' | b'"')) => q,
            _ => return Err(format!("expected a quoted string at byte {}", self.i)),
        };
        self.i += 1;
        let start = self.i;
        while self.s.get(self.i).is_some_and(|&c| c != quote) {
            self.i += 1;
        }
        let text = String::from_utf8_lossy(&self.s[start..self.i]).into_owned();
        self.expect(quote)?;
        Ok(text)
    }

    fn boolean(&mut self) -> Result<bool, String> {
        for (word, value) in [("True", true), ("False", false)] {
            if self.s[self.i..].starts_with(word.as_bytes()) {
                self.i += word.len();
                return Ok(value);
            }
        }
        Err(format!("expected True or False at byte {}", self.i))
    }

    fn tuple(&mut self) -> Result<Vec<usize>, String> {
        self.expect(b'(')?;
        let mut dims = Vec::new();
        loop {
            self.ws();
            if self.eat(b')') {
                return Ok(dims);
            }
            let start = self.i;
            while self.s.get(self.i).is_some_and(u8::is_ascii_digit) {
                self.i += 1;
            }
            let digits = std::str::from_utf8(&self.s[start..self.i]).expect("ascii digits");
            // NumPy writes `3L` for long ints in old Python 2 files.
            self.eat(b'L');
            dims.push(
                digits
                    .parse()
                    .map_err(|_| format!("expected a dimension at byte {start}"))?,
            );
            self.ws();
            if !self.eat(b',') {
                self.ws();
                self.expect(b')')?;
                return Ok(dims);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p() -> &'static Path {
        Path::new("x.npy")
    }

    /// A hand-made file: version, header text (padded as given), data.
    fn file(version: u8, header: &str, data: &[u8]) -> Vec<u8> {
        let mut out = MAGIC.to_vec();
        out.extend_from_slice(&[version, 0]);
        if version == 1 {
            out.extend_from_slice(&(header.len() as u16).to_le_bytes());
        } else {
            out.extend_from_slice(&(header.len() as u32).to_le_bytes());
        }
        out.extend_from_slice(header.as_bytes());
        out.extend_from_slice(data);
        out
    }

    fn f32_bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn round_trips_f32_and_i64_any_shape() {
        let dir = tempfile::tempdir().unwrap();
        let cases = [
            HostTensor::f32(vec![2, 3], vec![1.0, -2.5, 3.0, f32::MAX, 0.0, -0.0]),
            HostTensor::f32(vec![], vec![7.0]),
            HostTensor::f32(vec![4], vec![1.0, 2.0, 3.0, 4.0]),
            HostTensor::f32(vec![1, 0, 3], vec![]),
            HostTensor::i64(vec![1, 2, 2], vec![0, -1, i64::MAX, 99]),
        ];
        for (i, t) in cases.iter().enumerate() {
            let path = dir.path().join(format!("{i}.npy"));
            write_npy(&path, t).unwrap();
            let bytes = std::fs::read(&path).unwrap();
            assert_eq!(bytes, encode_npy(t));
            assert_eq!(encoded_len(t), bytes.len());
            assert_eq!(&parse_npy(&bytes, &path).unwrap(), t);
            let header_end = 10 + u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
            assert_eq!(
                header_end % HEADER_ALIGN,
                0,
                "numpy aligns the data to 64 bytes"
            );
            assert_eq!(bytes[header_end - 1], b'\n');
            assert_eq!(&read_npy(&path).unwrap(), t);
        }
    }

    #[test]
    fn writes_numpy_header_text() {
        let bytes = encode_npy(&HostTensor::f32(vec![1, 3, 2], vec![0.0; 6]));
        let text = std::str::from_utf8(&bytes[10..]).unwrap_or("");
        assert!(text.starts_with("{'descr': '<f4', 'fortran_order': False, 'shape': (1, 3, 2), }"));
        let one = encode_npy(&HostTensor::i64(vec![5], vec![0; 5]));
        assert!(std::str::from_utf8(&one[10..64])
            .unwrap()
            .contains("'shape': (5,)"));
    }

    #[test]
    fn reads_version_2_and_other_key_orders() {
        let data = f32_bytes(&[1.0, 2.0]);
        let t = parse_npy(
            &file(
                2,
                "{\"shape\": (2,), \"fortran_order\": False, \"descr\": \"<f4\"}\n",
                &data,
            ),
            p(),
        )
        .unwrap();
        assert_eq!(t, HostTensor::f32(vec![2], vec![1.0, 2.0]));
        let t = parse_npy(
            &file(
                3,
                "{'descr':'<f4','fortran_order':False,'shape':(1,2)}",
                &data,
            ),
            p(),
        )
        .unwrap();
        assert_eq!(t.shape, vec![1, 2]);
    }

    fn err(bytes: &[u8]) -> String {
        parse_npy(bytes, p()).unwrap_err().to_string()
    }

    #[test]
    fn rejects_bad_files_with_clear_errors() {
        let data = f32_bytes(&[1.0, 2.0, 3.0, 4.0]);
        let fortran = file(
            1,
            "{'descr': '<f4', 'fortran_order': True, 'shape': (2, 2), }\n",
            &data,
        );
        assert!(
            err(&fortran).contains("fortran_order is True"),
            "{}",
            err(&fortran)
        );
        let f64s = file(
            1,
            "{'descr': '<f8', 'fortran_order': False, 'shape': (2,), }\n",
            &data,
        );
        assert!(err(&f64s).contains("dtype \"<f8\""), "{}", err(&f64s));
        let big = file(
            1,
            "{'descr': '>f4', 'fortran_order': False, 'shape': (4,), }\n",
            &data,
        );
        assert!(err(&big).contains("unsupported"), "{}", err(&big));
        let short = file(
            1,
            "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }\n",
            &data,
        );
        let e = err(&short);
        assert!(
            e.contains("truncated") && e.contains("24 bytes") && e.contains("has 16"),
            "{e}"
        );
        let long = file(
            1,
            "{'descr': '<f4', 'fortran_order': False, 'shape': (3,), }\n",
            &data,
        );
        assert!(err(&long).contains("4 bytes follow"), "{}", err(&long));
        assert!(err(b"PK\x03\x04 zip").contains("magic"));
        assert!(err(&file(4, "{}", &[])).contains("version 4.0"));
        let mut huge = MAGIC.to_vec();
        huge.extend_from_slice(&[2, 0]);
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(err(&huge).contains("more than the"), "{}", err(&huge));
        let cut = file(1, "{'descr': '<f4'", &[]);
        let mut cut = cut[..cut.len() - 3].to_vec();
        cut[8] = 200;
        assert!(err(&cut).contains("the file ends after"), "{}", err(&cut));
        let missing = file(1, "{'descr': '<f4', 'shape': (1,), }\n", &data[..4]);
        assert!(
            err(&missing).contains("no 'fortran_order'"),
            "{}",
            err(&missing)
        );
        let overflow = file(
            1,
            "{'descr': '<f4', 'fortran_order': False, 'shape': (4294967296, 4294967296, 16), }\n",
            &[],
        );
        assert!(err(&overflow).contains("overflows"), "{}", err(&overflow));
        let e = read_npy(Path::new("/nonexistent/in.npy"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("/nonexistent/in.npy") && e.contains("cannot read"),
            "{e}"
        );
    }
}
