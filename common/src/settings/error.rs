//! The one error type of settings parsing, and the file-reading helpers that
//! produce its `Io`/`Missing` variants.

use std::path::{Path, PathBuf};

/// Largest settings file read, checked before reading: settings files are
/// small text; anything bigger is a wrong path (a model file, a log).
pub const SETTINGS_FILE_BYTES_MAX: u64 = 16 << 20;

/// How much of an offending line an error message quotes.
const FOUND_CHARS_MAX: usize = 160;

/// Everything that can go wrong loading `settings/`. Every variant names the
/// file; line-based variants name the 1-based line, JSON ones the column too.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SettingsError {
    /// The file exists (or should) but could not be read.
    #[error("{}: cannot read settings file: {source}", .path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A required file is absent.
    #[error("{}: required settings file is missing; {hint}", .path.display())]
    Missing { path: PathBuf, hint: String },
    /// One line of a text file is malformed.
    #[error("{}:{line}: expected {expected}, found {found:?}: {reason}", .path.display())]
    Line {
        path: PathBuf,
        /// 1-based.
        line: usize,
        expected: String,
        found: String,
        reason: String,
    },
    /// A JSON file is malformed or a field has a bad value.
    #[error("{}:{line}:{column}: {}{message}", .path.display(), field_prefix(.field))]
    Json {
        path: PathBuf,
        /// 1-based.
        line: usize,
        /// 1-based.
        column: usize,
        /// The top-level key the error is in (`slo_ms.bert_base` for nested
        /// keys), when known.
        field: Option<String>,
        message: String,
    },
    /// Something about the file as a whole (empty, too big, inconsistent with
    /// another file).
    #[error("{}: {reason}", .path.display())]
    File { path: PathBuf, reason: String },
}

fn field_prefix(field: &Option<String>) -> String {
    match field {
        Some(f) => format!("field \"{f}\": "),
        None => String::new(),
    }
}

pub type Result<T, E = SettingsError> = std::result::Result<T, E>;

impl SettingsError {
    /// A `Line` error; `found` is cut to a readable length.
    pub(crate) fn line(
        path: &Path,
        line: usize,
        expected: impl Into<String>,
        found: &str,
        reason: impl Into<String>,
    ) -> Self {
        let found = if found.chars().count() > FOUND_CHARS_MAX {
            let mut cut: String = found.chars().take(FOUND_CHARS_MAX).collect();
            cut.push_str("...");
            cut
        } else {
            found.to_string()
        };
        SettingsError::Line {
            path: path.to_path_buf(),
            line,
            expected: expected.into(),
            found,
            reason: reason.into(),
        }
    }

    pub(crate) fn file(path: &Path, reason: impl Into<String>) -> Self {
        SettingsError::File {
            path: path.to_path_buf(),
            reason: reason.into(),
        }
    }

    /// The file the error is about.
    pub fn path(&self) -> &Path {
        match self {
            SettingsError::Io { path, .. }
            | SettingsError::Missing { path, .. }
            | SettingsError::Line { path, .. }
            | SettingsError::Json { path, .. }
            | SettingsError::File { path, .. } => path,
        }
    }

    /// The 1-based line the error is on, if it is about one line.
    pub fn line_number(&self) -> Option<usize> {
        match self {
            SettingsError::Line { line, .. } | SettingsError::Json { line, .. } => Some(*line),
            _ => None,
        }
    }
}

/// Reads a settings file as UTF-8 text. `Ok(None)` when it does not exist.
pub(crate) fn read_optional(path: &Path) -> Result<Option<String>> {
    let io_err = |source| SettingsError::Io {
        path: path.to_path_buf(),
        source,
    };
    let meta = match std::fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_err(e)),
    };
    if !meta.is_file() {
        return Err(SettingsError::file(path, "expected a regular file"));
    }
    if meta.len() > SETTINGS_FILE_BYTES_MAX {
        return Err(SettingsError::file(
            path,
            format!(
                "file is {} bytes, more than the {} allowed for a settings file; wrong path?",
                meta.len(),
                SETTINGS_FILE_BYTES_MAX
            ),
        ));
    }
    let bytes = std::fs::read(path).map_err(io_err)?;
    let mut text = String::from_utf8(bytes).map_err(|e| {
        SettingsError::file(
            path,
            format!(
                "not UTF-8 text (invalid byte at offset {})",
                e.utf8_error().valid_up_to()
            ),
        )
    })?;
    // Editors on some systems prepend a byte-order mark; it is not content.
    if text.starts_with('\u{feff}') {
        text.drain(..'\u{feff}'.len_utf8());
    }
    Ok(Some(text))
}

/// Reads a required settings file; a missing one gets `hint`.
pub(crate) fn read_required(path: &Path, hint: &str) -> Result<String> {
    read_optional(path)?.ok_or_else(|| SettingsError::Missing {
        path: path.to_path_buf(),
        hint: hint.to_string(),
    })
}

/// Removes a `//` comment (whole-line or trailing) and surrounding spaces.
pub(crate) fn strip_slash_comment(line: &str) -> &str {
    match line.find("//") {
        Some(i) => line[..i].trim(),
        None => line.trim(),
    }
}

/// The meaningful lines of a `//`-commented text file: (1-based number,
/// content without comment, trimmed), blank and comment-only lines skipped.
pub(crate) fn content_lines(text: &str) -> impl Iterator<Item = (usize, &str)> {
    text.lines()
        .enumerate()
        .map(|(i, l)| {
            (
                i + 1,
                strip_slash_comment(l.strip_suffix('\r').unwrap_or(l)),
            )
        })
        .filter(|(_, l)| !l.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_error_formats_like_the_brief() {
        let e = SettingsError::line(
            Path::new("settings/storage_list.txt"),
            3,
            "\"<address>, <port>\"",
            "127.0.0.1 7778x",
            "port \"7778x\" is not a number in 1..=65535",
        );
        assert_eq!(
            e.to_string(),
            "settings/storage_list.txt:3: expected \"<address>, <port>\", found \"127.0.0.1 7778x\": port \"7778x\" is not a number in 1..=65535"
        );
        assert_eq!(e.line_number(), Some(3));
    }

    #[test]
    fn comments_and_blank_lines_are_skipped() {
        let text = "// c\n\n a // b\r\n  //x\nb\n";
        let got: Vec<_> = content_lines(text).collect();
        assert_eq!(got, vec![(3, "a"), (5, "b")]);
    }

    #[test]
    fn long_found_is_cut() {
        let long = "x".repeat(1000);
        match SettingsError::line(Path::new("f"), 1, "e", &long, "r") {
            SettingsError::Line { found, .. } => {
                assert!(found.len() < 200 && found.ends_with("..."))
            }
            _ => unreachable!(),
        }
    }

    #[test]
    fn byte_order_mark_is_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        std::fs::write(&p, "\u{feff}A=1\n").unwrap();
        assert_eq!(read_optional(&p).unwrap().unwrap(), "A=1\n");
    }

    #[test]
    fn missing_optional_file_is_none() {
        let dir = tempfile::tempdir().unwrap();
        assert!(read_optional(&dir.path().join("nope")).unwrap().is_none());
        let e = read_required(&dir.path().join("nope"), "create it").unwrap_err();
        assert!(e.to_string().contains("missing; create it"), "{e}");
    }
}
