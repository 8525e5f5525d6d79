//! `settings/cluster.key`: the shared secret every connection's handshake
//! proves knowledge of. The whole file, trimmed, is the key (no comments).

use std::fmt;
use std::path::Path;

use super::error::{read_optional, Result, SettingsError};

/// Shortest accepted key, in characters (bytes: the key is text).
pub const CLUSTER_KEY_CHARS_MIN: usize = 16;
/// Longest accepted key.
pub const CLUSTER_KEY_BYTES_MAX: usize = 4096;

/// How to make a key; part of every "missing/short key" message.
pub const CLUSTER_KEY_HINT: &str =
    "create one with `head -c 32 /dev/urandom | base64 > settings/cluster.key` and copy the same file to every host";

/// The cluster secret. `Debug` does not print it.
#[derive(Clone, PartialEq, Eq)]
pub struct ClusterKey(Vec<u8>);

impl ClusterKey {
    pub fn load(path: &Path) -> Result<Self> {
        let text = read_optional(path)?.ok_or_else(|| SettingsError::Missing {
            path: path.to_path_buf(),
            hint: CLUSTER_KEY_HINT.to_string(),
        })?;
        Self::parse(path, &text)
    }

    /// The trimmed text; at least [`CLUSTER_KEY_CHARS_MIN`] characters.
    pub fn parse(path: &Path, text: &str) -> Result<Self> {
        let key = text.trim();
        if key.chars().count() < CLUSTER_KEY_CHARS_MIN {
            return Err(SettingsError::file(
                path,
                format!(
                    "the key has {} characters, fewer than the {CLUSTER_KEY_CHARS_MIN} required; {CLUSTER_KEY_HINT}",
                    key.chars().count()
                ),
            ));
        }
        if key.len() > CLUSTER_KEY_BYTES_MAX {
            return Err(SettingsError::file(
                path,
                format!("the key is longer than {CLUSTER_KEY_BYTES_MAX} bytes; {CLUSTER_KEY_HINT}"),
            ));
        }
        Ok(ClusterKey(key.as_bytes().to_vec()))
    }

    /// The raw trimmed bytes the handshake derives its key from.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

impl fmt::Debug for ClusterKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ClusterKey(<{} bytes, redacted>)", self.0.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trimmed_and_checked() {
        let p = Path::new("settings/cluster.key");
        let k = ClusterKey::parse(p, "  0123456789abcdefXYZ=\n").unwrap();
        assert_eq!(k.as_bytes(), b"0123456789abcdefXYZ=");
        assert!(!format!("{k:?}").contains("0123"));
        let e = ClusterKey::parse(p, "short\n").unwrap_err().to_string();
        assert!(
            e.starts_with("settings/cluster.key: the key has 5 characters")
                && e.contains("head -c 32 /dev/urandom | base64"),
            "{e}"
        );
        assert!(ClusterKey::parse(p, &"k".repeat(5000)).is_err());
    }

    #[test]
    fn missing_key_has_hint() {
        let dir = tempfile::tempdir().unwrap();
        let e = ClusterKey::load(&dir.path().join("cluster.key")).unwrap_err();
        assert!(matches!(e, SettingsError::Missing { .. }));
        assert!(
            e.to_string()
                .contains("head -c 32 /dev/urandom | base64 > settings/cluster.key"),
            "{e}"
        );
    }
}
