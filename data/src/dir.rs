//! Dataset directories, as `distmind dataset put NAME DIR` reads them: sample
//! files (`.jpg`, `.jpeg`, `.png` images or `.npy` tensors) next to a labels
//! file `labels.txt` with one line `<file name> <integer label>` per sample.
//! `#` starts a comment; blank lines are skipped. Files in the directory that
//! the labels file does not list are ignored.

use crate::format::{FormatError, SampleFormat};
use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};

/// The name of the labels file inside a dataset directory.
pub const LABELS_FILE: &str = "labels.txt";
/// The largest sample file accepted, in bytes (32 MiB).
pub const SAMPLE_BYTES_MAX: u64 = 32 << 20;
/// The most samples one dataset may hold.
pub const SAMPLES_MAX: usize = 1_000_000;

/// One sample as stored: its file name, label, format and the file's bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawSample {
    /// The file name inside the dataset directory (no directory part).
    pub name: String,
    /// The class label.
    pub label: u32,
    /// The file's format (extension and magic bytes agree).
    pub format: SampleFormat,
    /// The file's bytes, unchanged.
    pub bytes: Vec<u8>,
}

/// What was wrong with a dataset directory. Each variant names the file (and
/// line, for the labels file) at fault.
#[derive(Debug, thiserror::Error)]
pub enum DatasetError {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A line of the labels file is not `<file name> <integer label>`.
    #[error("{file}:{line}: {why}")]
    BadLine {
        /// The labels file.
        file: PathBuf,
        /// The 1-based line number.
        line: usize,
        /// What was wrong.
        why: String,
    },
    /// The labels file lists a sample whose file does not exist.
    #[error("{file}:{line}: sample file {name:?} does not exist in the dataset directory")]
    Missing {
        /// The labels file.
        file: PathBuf,
        /// The 1-based line number.
        line: usize,
        /// The sample's file name.
        name: String,
    },
    /// The labels file lists the same sample twice.
    #[error("{file}:{line}: sample {name:?} is listed again (first at line {first_line})")]
    Duplicate {
        /// The labels file.
        file: PathBuf,
        /// The 1-based line number of the second listing.
        line: usize,
        /// The 1-based line number of the first listing.
        first_line: usize,
        /// The sample's file name.
        name: String,
    },
    /// A sample file is larger than [`SAMPLE_BYTES_MAX`].
    #[error("{path}: sample is {bytes} bytes, over the limit of {max} bytes")]
    SampleTooLarge {
        /// The sample file.
        path: PathBuf,
        /// Its size.
        bytes: u64,
        /// The limit.
        max: u64,
    },
    /// The labels file lists more than [`SAMPLES_MAX`] samples.
    #[error("{file}:{line}: more than {max} samples")]
    TooManySamples {
        /// The labels file.
        file: PathBuf,
        /// The line of the first sample over the limit.
        line: usize,
        /// The limit.
        max: usize,
    },
    /// The labels file lists no sample.
    #[error("{file}: lists no sample (a dataset needs at least one)")]
    Empty {
        /// The labels file.
        file: PathBuf,
    },
    /// A sample's extension is unknown or disagrees with its contents.
    #[error("{file}:{line}: {source}")]
    Format {
        /// The labels file.
        file: PathBuf,
        /// The 1-based line number.
        line: usize,
        /// The format error, which names the sample file.
        #[source]
        source: FormatError,
    },
    /// A sample to write has a name unfit for a file in the directory or a
    /// labels line.
    #[error("sample {name:?}: {why}")]
    BadName {
        /// The sample's name.
        name: String,
        /// What was wrong.
        why: String,
    },
}

/// Why `name` is unfit as a sample file name (a plain file name with no
/// directory part and no whitespace), or `None` when it is fine.
fn bad_name(name: &str) -> Option<&'static str> {
    if name.is_empty() {
        Some("empty file name")
    } else if name == "." || name == ".." || name.contains('/') || name.contains('\\') {
        Some("a sample name must be a plain file name, with no directory part")
    } else if name.chars().any(|c| c.is_whitespace() || c.is_control()) {
        Some("a sample name may not contain whitespace or control characters")
    } else if name.starts_with('#') {
        Some("a sample name may not start with '#'")
    } else if name == LABELS_FILE {
        Some("the labels file is not a sample")
    } else {
        None
    }
}

/// One parsed line of a labels file.
struct LabelLine {
    line: usize,
    name: String,
    label: u32,
}

/// Parses a labels file's text; `file` only names it in errors.
fn parse_labels(file: &Path, text: &str) -> Result<Vec<LabelLine>, DatasetError> {
    let mut out = Vec::new();
    let mut seen: HashMap<String, usize> = HashMap::new();
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        let content = match raw.find('#') {
            Some(p) => &raw[..p],
            None => raw,
        };
        let mut fields = content.split_whitespace();
        let Some(name) = fields.next() else { continue };
        let bad = |why: String| DatasetError::BadLine {
            file: file.to_path_buf(),
            line,
            why,
        };
        let Some(label) = fields.next() else {
            return Err(bad(format!(
                "expected `<file name> <integer label>`, found only {name:?}"
            )));
        };
        if let Some(extra) = fields.next() {
            return Err(bad(format!(
                "expected `<file name> <integer label>`, found an extra field {extra:?}"
            )));
        }
        let label: u32 = label.parse().map_err(|_| {
            bad(format!(
                "label {label:?} of {name:?} is not an integer in 0..={}",
                u32::MAX
            ))
        })?;
        if let Some(why) = bad_name(name) {
            return Err(bad(format!("{name:?}: {why}")));
        }
        if let Some(&first_line) = seen.get(name) {
            return Err(DatasetError::Duplicate {
                file: file.to_path_buf(),
                line,
                first_line,
                name: name.to_string(),
            });
        }
        if out.len() == SAMPLES_MAX {
            return Err(DatasetError::TooManySamples {
                file: file.to_path_buf(),
                line,
                max: SAMPLES_MAX,
            });
        }
        seen.insert(name.to_string(), line);
        out.push(LabelLine {
            line,
            name: name.to_string(),
            label,
        });
    }
    if out.is_empty() {
        return Err(DatasetError::Empty {
            file: file.to_path_buf(),
        });
    }
    Ok(out)
}

/// Reads a dataset directory: every sample listed in its `labels.txt`, in
/// the labels file's order, with its bytes and format (extension and magic
/// bytes must agree). Files the labels file does not list are ignored.
pub fn read_dir(dir: &Path) -> Result<Vec<RawSample>, DatasetError> {
    let labels_path = dir.join(LABELS_FILE);
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| DatasetError::Io { path, source }
    };
    let text = std::fs::read_to_string(&labels_path).map_err(io(&labels_path))?;
    let lines = parse_labels(&labels_path, &text)?;
    let mut out = Vec::with_capacity(lines.len());
    for l in lines {
        let path = dir.join(&l.name);
        let file = match std::fs::File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(DatasetError::Missing {
                    file: labels_path,
                    line: l.line,
                    name: l.name,
                });
            }
            Err(e) => return Err(DatasetError::Io { path, source: e }),
        };
        let meta = file.metadata().map_err(io(&path))?;
        if !meta.is_file() {
            return Err(DatasetError::BadLine {
                file: labels_path,
                line: l.line,
                why: format!("{} is not a regular file", path.display()),
            });
        }
        if meta.len() > SAMPLE_BYTES_MAX {
            return Err(DatasetError::SampleTooLarge {
                path,
                bytes: meta.len(),
                max: SAMPLE_BYTES_MAX,
            });
        }
        let mut bytes = Vec::with_capacity(meta.len() as usize);
        // Read at most one byte past the limit, in case the file grew.
        file.take(SAMPLE_BYTES_MAX + 1)
            .read_to_end(&mut bytes)
            .map_err(io(&path))?;
        if bytes.len() as u64 > SAMPLE_BYTES_MAX {
            return Err(DatasetError::SampleTooLarge {
                path,
                bytes: bytes.len() as u64,
                max: SAMPLE_BYTES_MAX,
            });
        }
        let format = SampleFormat::check(&path, &bytes).map_err(|source| DatasetError::Format {
            file: labels_path.clone(),
            line: l.line,
            source,
        })?;
        out.push(RawSample {
            name: l.name,
            label: l.label,
            format,
            bytes,
        });
    }
    Ok(out)
}

/// Writes samples as a dataset directory that [`read_dir`] reads back: each
/// sample's bytes to `dir/<name>` and `dir/labels.txt` listing them in order.
/// Creates `dir` if needed; overwrites files of the same names.
pub fn write_dir(dir: &Path, samples: &[RawSample]) -> Result<(), DatasetError> {
    let mut seen = std::collections::HashSet::new();
    for s in samples {
        if let Some(why) = bad_name(&s.name) {
            return Err(DatasetError::BadName {
                name: s.name.clone(),
                why: why.to_string(),
            });
        }
        if !seen.insert(s.name.as_str()) {
            return Err(DatasetError::BadName {
                name: s.name.clone(),
                why: "two samples have this name".to_string(),
            });
        }
    }
    std::fs::create_dir_all(dir).map_err(|source| DatasetError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let mut labels = String::new();
    for s in samples {
        let path = dir.join(&s.name);
        std::fs::write(&path, &s.bytes).map_err(|source| DatasetError::Io { path, source })?;
        labels.push_str(&format!("{} {}\n", s.name, s.label));
    }
    let path = dir.join(LABELS_FILE);
    std::fs::write(&path, labels).map_err(|source| DatasetError::Io { path, source })
}

#[cfg(test)]
mod tests {
    use super::*;

    const JPEG_MAGIC: &[u8] = &[0xFF, 0xD8, 0xFF, 0xE0, 1, 2, 3];
    const PNG_MAGIC: &[u8] = b"\x89PNG\r\n\x1a\nxyz";

    fn sample(name: &str, label: u32, format: SampleFormat, bytes: &[u8]) -> RawSample {
        RawSample {
            name: name.into(),
            label,
            format,
            bytes: bytes.to_vec(),
        }
    }

    #[test]
    fn round_trip_in_labels_order_ignoring_unlisted() {
        let d = tempfile::tempdir().unwrap();
        let samples = vec![
            sample("b.jpg", 3, SampleFormat::Jpeg, JPEG_MAGIC),
            sample("a.png", 0, SampleFormat::Png, PNG_MAGIC),
            sample("c.npy", 7, SampleFormat::Npy, b"\x93NUMPYrest"),
        ];
        write_dir(d.path(), &samples).unwrap();
        std::fs::write(d.path().join("unlisted.jpg"), b"whatever").unwrap();
        assert_eq!(read_dir(d.path()).unwrap(), samples);
    }

    fn write_labels(dir: &Path, text: &str) {
        std::fs::write(dir.join(LABELS_FILE), text).unwrap();
    }

    fn err_of(text: &str, files: &[(&str, &[u8])]) -> String {
        let d = tempfile::tempdir().unwrap();
        for (n, b) in files {
            std::fs::write(d.path().join(n), b).unwrap();
        }
        write_labels(d.path(), text);
        read_dir(d.path()).unwrap_err().to_string()
    }

    #[test]
    fn comments_and_blank_lines() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("x.jpg"), JPEG_MAGIC).unwrap();
        write_labels(d.path(), "# header\n\n  x.jpg\t 5  # five\n");
        let s = read_dir(d.path()).unwrap();
        assert_eq!(s.len(), 1);
        assert_eq!((s[0].name.as_str(), s[0].label), ("x.jpg", 5));
    }

    #[test]
    fn errors_name_file_and_line() {
        let f: &[(&str, &[u8])] = &[("x.jpg", JPEG_MAGIC), ("y.png", PNG_MAGIC)];
        let e = err_of("x.jpg 1\n# c\ny.png cat\n", f);
        assert!(e.contains("labels.txt:3:") && e.contains("\"cat\""), "{e}");
        let e = err_of("x.jpg\n", f);
        assert!(e.contains("labels.txt:1:"), "{e}");
        let e = err_of("x.jpg 1 2\n", f);
        assert!(e.contains("labels.txt:1:") && e.contains("extra"), "{e}");
        let e = err_of("x.jpg -1\n", f);
        assert!(e.contains("labels.txt:1:"), "{e}");
        let e = err_of("x.jpg 1\n\nnope.jpg 2\n", f);
        assert!(e.contains("labels.txt:3:") && e.contains("nope.jpg"), "{e}");
        let e = err_of("x.jpg 1\ny.png 2\nx.jpg 3\n", f);
        assert!(
            e.contains("labels.txt:3:") && e.contains("x.jpg") && e.contains("line 1"),
            "{e}"
        );
        let e = err_of("# nothing\n\n", f);
        assert!(e.contains("labels.txt") && e.contains("no sample"), "{e}");
        let e = err_of("../x.jpg 1\n", f);
        assert!(e.contains("labels.txt:1:"), "{e}");
        // Extension and magic disagree: names the labels line and the file.
        let e = err_of(
            "x.jpg 1\nz.png 2\n",
            &[("x.jpg", JPEG_MAGIC), ("z.png", JPEG_MAGIC)],
        );
        assert!(e.contains("labels.txt:2:") && e.contains("z.png"), "{e}");
        let e = err_of("q.gif 1\n", &[("q.gif", b"GIF89a")]);
        assert!(e.contains("labels.txt:1:") && e.contains("q.gif"), "{e}");
    }

    #[test]
    fn missing_labels_file_and_oversized_sample() {
        let d = tempfile::tempdir().unwrap();
        let e = read_dir(d.path()).unwrap_err().to_string();
        assert!(e.contains("labels.txt"), "{e}");
        let big = d.path().join("big.jpg");
        let f = std::fs::File::create(&big).unwrap();
        f.set_len(SAMPLE_BYTES_MAX + 1).unwrap();
        write_labels(d.path(), "big.jpg 0\n");
        let e = read_dir(d.path()).unwrap_err();
        assert!(matches!(e, DatasetError::SampleTooLarge { .. }), "{e}");
        assert!(e.to_string().contains("big.jpg"), "{e}");
    }

    #[test]
    fn too_many_samples() {
        let mut text = String::with_capacity(SAMPLES_MAX * 12);
        for i in 0..=SAMPLES_MAX {
            text.push_str(&format!("s{i}.jpg 0\n"));
        }
        let e = parse_labels(Path::new("d/labels.txt"), &text)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains(&format!("d/labels.txt:{}:", SAMPLES_MAX + 1)),
            "{e}"
        );
    }

    #[test]
    fn write_dir_rejects_bad_names() {
        let d = tempfile::tempdir().unwrap();
        for n in ["a b.jpg", "x/y.jpg", "", "labels.txt"] {
            let e = write_dir(d.path(), &[sample(n, 0, SampleFormat::Jpeg, JPEG_MAGIC)]);
            assert!(matches!(e, Err(DatasetError::BadName { .. })), "{n:?}");
        }
        let s = sample("a.jpg", 0, SampleFormat::Jpeg, JPEG_MAGIC);
        assert!(write_dir(d.path(), &[s.clone(), s]).is_err());
    }
}
