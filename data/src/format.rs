//! Sample file formats: JPEG and PNG images, and `.npy` tensors.

use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// The encoding of one sample's file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SampleFormat {
    /// A JPEG image (`.jpg`, `.jpeg`).
    Jpeg,
    /// A PNG image (`.png`).
    Png,
    /// A NumPy array file (`.npy`).
    Npy,
}

/// Why a file's format could not be told, or was inconsistent.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FormatError {
    /// The file's extension is none of .jpg, .jpeg, .png, .npy.
    #[error("{path}: unknown sample extension (expected .jpg, .jpeg, .png or .npy)")]
    UnknownExtension {
        /// The file.
        path: PathBuf,
    },
    /// The extension says one format, the first bytes another (or none).
    #[error("{path}: extension says {ext:?} but the file's first bytes {}", match .magic { Some(m) => format!("are those of {m:?}"), None => "match no known format".to_string() })]
    Mismatch {
        /// The file.
        path: PathBuf,
        /// The format the extension names.
        ext: SampleFormat,
        /// The format the magic bytes name, if any.
        magic: Option<SampleFormat>,
    },
}

impl SampleFormat {
    /// The format named by a path's extension (case-insensitive), if any.
    pub fn from_path(path: &Path) -> Option<SampleFormat> {
        let ext = path.extension()?.to_str()?.to_ascii_lowercase();
        match ext.as_str() {
            "jpg" | "jpeg" => Some(SampleFormat::Jpeg),
            "png" => Some(SampleFormat::Png),
            "npy" => Some(SampleFormat::Npy),
            _ => None,
        }
    }

    /// The format named by a file's first bytes (its magic number), if any:
    /// JPEG `FF D8 FF`, PNG `89 50 4E 47`, NPY `93 'NUMPY'`.
    pub fn sniff(bytes: &[u8]) -> Option<SampleFormat> {
        if bytes.starts_with(&[0xFF, 0xD8, 0xFF]) {
            Some(SampleFormat::Jpeg)
        } else if bytes.starts_with(&[0x89, 0x50, 0x4E, 0x47]) {
            Some(SampleFormat::Png)
        } else if bytes.starts_with(b"\x93NUMPY") {
            Some(SampleFormat::Npy)
        } else {
            None
        }
    }

    /// The format of a file from both its extension and its first bytes;
    /// an error naming the file when the extension is unknown or the two
    /// disagree.
    pub fn check(path: &Path, bytes: &[u8]) -> Result<SampleFormat, FormatError> {
        let ext = SampleFormat::from_path(path).ok_or_else(|| FormatError::UnknownExtension {
            path: path.to_path_buf(),
        })?;
        let magic = SampleFormat::sniff(bytes);
        if magic != Some(ext) {
            return Err(FormatError::Mismatch {
                path: path.to_path_buf(),
                ext,
                magic,
            });
        }
        Ok(ext)
    }

    /// The name datasets' manifests and the sample protocol use (`jpeg`,
    /// `png`, `npy`: serde's spelling).
    pub fn name(self) -> &'static str {
        match self {
            SampleFormat::Jpeg => "jpeg",
            SampleFormat::Png => "png",
            SampleFormat::Npy => "npy",
        }
    }

    /// The format of a [`SampleFormat::name`]; the error says what is accepted.
    pub fn from_name(s: &str) -> Result<SampleFormat, String> {
        match s {
            "jpeg" => Ok(SampleFormat::Jpeg),
            "png" => Ok(SampleFormat::Png),
            "npy" => Ok(SampleFormat::Npy),
            other => Err(format!(
                "unknown format {other:?} (expected jpeg, png or npy)"
            )),
        }
    }

    /// The usual file extension, without the dot.
    pub fn extension(self) -> &'static str {
        match self {
            SampleFormat::Jpeg => "jpg",
            SampleFormat::Png => "png",
            SampleFormat::Npy => "npy",
        }
    }

    /// Whether the format is an image (JPEG or PNG) that the image steps
    /// (decode, crop, flip, ...) apply to.
    pub fn is_image(self) -> bool {
        matches!(self, SampleFormat::Jpeg | SampleFormat::Png)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extension_and_magic() {
        assert_eq!(
            SampleFormat::from_path(Path::new("a/b.JPG")),
            Some(SampleFormat::Jpeg)
        );
        assert_eq!(
            SampleFormat::from_path(Path::new("b.jpeg")),
            Some(SampleFormat::Jpeg)
        );
        assert_eq!(
            SampleFormat::from_path(Path::new("b.png")),
            Some(SampleFormat::Png)
        );
        assert_eq!(
            SampleFormat::from_path(Path::new("b.npy")),
            Some(SampleFormat::Npy)
        );
        assert_eq!(SampleFormat::from_path(Path::new("b.gif")), None);
        assert_eq!(SampleFormat::from_path(Path::new("noext")), None);
        assert_eq!(
            SampleFormat::sniff(&[0xFF, 0xD8, 0xFF, 0xE0]),
            Some(SampleFormat::Jpeg)
        );
        assert_eq!(
            SampleFormat::sniff(b"\x89PNG\r\n\x1a\n"),
            Some(SampleFormat::Png)
        );
        assert_eq!(
            SampleFormat::sniff(b"\x93NUMPY\x01\x00"),
            Some(SampleFormat::Npy)
        );
        assert_eq!(SampleFormat::sniff(b"GIF89a"), None);
        assert_eq!(SampleFormat::sniff(&[0xFF, 0xD8]), None);
    }

    #[test]
    fn check_names_the_file() {
        let p = Path::new("d/x.png");
        assert_eq!(
            SampleFormat::check(p, b"\x89PNG...."),
            Ok(SampleFormat::Png)
        );
        let e = SampleFormat::check(p, &[0xFF, 0xD8, 0xFF, 0]).unwrap_err();
        assert!(e.to_string().contains("d/x.png"), "{e}");
        assert!(e.to_string().contains("Jpeg"), "{e}");
        let e = SampleFormat::check(Path::new("y.txt"), b"").unwrap_err();
        assert!(matches!(e, FormatError::UnknownExtension { .. }));
        assert!(e.to_string().contains("y.txt"));
    }

    #[test]
    fn serde_snake_case() {
        assert_eq!(
            serde_json::to_string(&SampleFormat::Jpeg).unwrap(),
            "\"jpeg\""
        );
        let f: SampleFormat = serde_json::from_str("\"npy\"").unwrap();
        assert_eq!(f, SampleFormat::Npy);
    }
}
