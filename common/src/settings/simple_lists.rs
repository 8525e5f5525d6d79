//! Small line-based files: `username.txt`, model lists, family weight files
//! and the Ray baseline's server list. All accept `//` comments (whole-line
//! or trailing) and blank lines.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use super::endpoint::parse_host;
use super::error::{content_lines, read_optional, read_required, Result, SettingsError};
use crate::limits::NAME_BYTES_MAX;

/// Reads `username.txt`; `Ok(None)` when the file does not exist.
pub fn load_username(path: &Path) -> Result<Option<String>> {
    read_optional(path)?
        .map(|text| parse_username(path, &text))
        .transpose()
}

/// The one ssh user named in the file.
pub fn parse_username(path: &Path, text: &str) -> Result<String> {
    let mut users = content_lines(text);
    let Some((line_no, user)) = users.next() else {
        return Err(SettingsError::file(
            path,
            "no user name; expected exactly one line with the ssh user for remote mode",
        ));
    };
    let valid = user.len() <= 64
        && user.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_')
        && user
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'));
    if !valid {
        return Err(SettingsError::line(
            path,
            line_no,
            "an ssh user name",
            user,
            "user names start with a letter or '_' and hold only letters, digits, '_', '-', '.' (at most 64)",
        ));
    }
    if let Some((extra_no, extra)) = users.next() {
        return Err(SettingsError::line(
            path,
            extra_no,
            "nothing after the user name",
            extra,
            format!(
                "exactly one user is allowed and \"{user}\" is already given on line {line_no}"
            ),
        ));
    }
    Ok(user.to_string())
}

/// A model list: the names, in file order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelList {
    pub path: PathBuf,
    pub names: Vec<String>,
}

impl ModelList {
    pub fn load(path: &Path) -> Result<Self> {
        let text = read_required(
            path,
            "write a \"model_name\" header line, then one model name per line (settings/model_list.txt is an example)",
        )?;
        Self::parse(path, &text)
    }

    /// A `model_name` header, then one distinct name per line.
    pub fn parse(path: &Path, text: &str) -> Result<Self> {
        let mut lines = content_lines(text);
        expect_header(path, lines.next(), "model_name", "model_name")?;
        let mut names = Vec::new();
        let mut seen: HashMap<&str, usize> = HashMap::new();
        for (line_no, line) in lines {
            check_name(line)
                .map_err(|r| SettingsError::line(path, line_no, "a model name", line, r))?;
            if let Some(first) = seen.insert(line, line_no) {
                return Err(SettingsError::line(
                    path,
                    line_no,
                    "a model name not listed before",
                    line,
                    format!("already listed on line {first}"),
                ));
            }
            names.push(line.to_string());
        }
        if names.is_empty() {
            return Err(SettingsError::file(
                path,
                "no model names after the \"model_name\" header",
            ));
        }
        Ok(ModelList {
            path: path.to_path_buf(),
            names,
        })
    }
}

/// Relative popularity of model families, from a `model_name, weight` file.
#[derive(Debug, Clone, PartialEq)]
pub struct FamilyWeights {
    pub path: PathBuf,
    /// (family, weight) in file order; weights are >= 0, at least one > 0.
    pub weights: Vec<(String, f64)>,
}

impl FamilyWeights {
    /// Reads the file; `Ok(None)` when it does not exist.
    pub fn load_optional(path: &Path) -> Result<Option<Self>> {
        read_optional(path)?
            .map(|text| Self::parse(path, &text))
            .transpose()
    }

    pub fn parse(path: &Path, text: &str) -> Result<Self> {
        const EXPECTED: &str = "\"<family>, <weight>\"";
        let mut lines = content_lines(text);
        expect_header(
            path,
            lines.next(),
            "model_name,weight",
            "model_name, weight",
        )?;
        let mut weights: Vec<(String, f64)> = Vec::new();
        for (line_no, line) in lines {
            let bad = |r: String| SettingsError::line(path, line_no, EXPECTED, line, r);
            let fields: Vec<&str> = line.split(',').map(str::trim).collect();
            let [family, weight] = fields.as_slice() else {
                return Err(bad(format!("{} fields, expected 2", fields.len())));
            };
            check_name(family).map_err(bad)?;
            let w = match weight.parse::<f64>() {
                Ok(w) if w.is_finite() && w >= 0.0 => w,
                _ => return Err(bad(format!("weight \"{weight}\" is not a number >= 0"))),
            };
            if let Some(first) = weights.iter().position(|(f, _)| f == family) {
                return Err(bad(format!(
                    "family \"{family}\" already has a weight (entry {})",
                    first + 1
                )));
            }
            weights.push((family.to_string(), w));
        }
        if !weights.iter().any(|(_, w)| *w > 0.0) {
            return Err(SettingsError::file(
                path,
                "no family has a weight > 0; expected \"<family>, <weight>\" lines after the header",
            ));
        }
        Ok(FamilyWeights {
            path: path.to_path_buf(),
            weights,
        })
    }

    /// The weight of `family`, if listed.
    pub fn get(&self, family: &str) -> Option<f64> {
        self.weights
            .iter()
            .find(|(f, _)| f == family)
            .map(|(_, w)| *w)
    }
}

/// One line of the Ray baseline's server list: `ip:gpu`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RayServer {
    pub host: String,
    pub gpu: u32,
}

/// Parses the Ray baseline's `server_list_file` (`<address>:<gpu>` lines;
/// IPv6 addresses in brackets, `[::1]:0`).
pub fn parse_ray_server_list(path: &Path, text: &str) -> Result<Vec<RayServer>> {
    let mut out = Vec::new();
    for (line_no, line) in content_lines(text) {
        let bad = |r: String| SettingsError::line(path, line_no, "\"<address>:<gpu>\"", line, r);
        let (addr, gpu) = line
            .rsplit_once(':')
            .ok_or_else(|| bad("missing \":<gpu>\"".into()))?;
        let host = parse_host(addr.trim()).map_err(bad)?;
        let gpu = gpu.trim().parse::<u32>().map_err(|_| {
            bad(format!(
                "GPU index \"{}\" is not a whole number",
                gpu.trim()
            ))
        })?;
        let server = RayServer { host, gpu };
        if out.contains(&server) {
            return Err(bad("listed twice".into()));
        }
        out.push(server);
    }
    if out.is_empty() {
        return Err(SettingsError::file(
            path,
            "no servers; expected \"<address>:<gpu>\" lines",
        ));
    }
    Ok(out)
}

/// Reads a Ray server list file.
pub fn load_ray_server_list(path: &Path) -> Result<Vec<RayServer>> {
    let text = read_required(path, "write one \"<address>:<gpu>\" line per GPU")?;
    parse_ray_server_list(path, &text)
}

/// Model and family names: non-empty, bounded, no blanks, commas or quotes.
fn check_name(name: &str) -> Result<(), String> {
    if name.len() > NAME_BYTES_MAX {
        return Err(format!("name is longer than {NAME_BYTES_MAX} bytes"));
    }
    if !name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
    {
        return Err("names hold only letters, digits, '_', '-' and '.'".into());
    }
    Ok(())
}

/// Checks a CSV header (blanks ignored, case-insensitive).
fn expect_header(
    path: &Path,
    first: Option<(usize, &str)>,
    squashed_expected: &str,
    shown: &str,
) -> Result<()> {
    let Some((line_no, header)) = first else {
        return Err(SettingsError::file(
            path,
            format!("empty; expected the header \"{shown}\", then one entry per line"),
        ));
    };
    let squashed: String = header.chars().filter(|c| !c.is_whitespace()).collect();
    if !squashed.eq_ignore_ascii_case(squashed_expected) {
        return Err(SettingsError::line(
            path,
            line_no,
            format!("the header \"{shown}\""),
            header,
            "the first line is the CSV header",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(name: &str) -> PathBuf {
        PathBuf::from(format!("settings/{name}"))
    }

    #[test]
    fn username() {
        assert_eq!(
            parse_username(&p("username.txt"), "// ssh user\n\nubuntu // aws\n").unwrap(),
            "ubuntu"
        );
        let e = parse_username(&p("username.txt"), "ubuntu\nec2-user\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("settings/username.txt:2: expected nothing after the user name")
                && e.contains("exactly one user"),
            "{e}"
        );
        let e = parse_username(&p("username.txt"), "// c\nroot; rm\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("settings/username.txt:2: expected an ssh user name"),
            "{e}"
        );
        assert!(parse_username(&p("username.txt"), "// none\n")
            .unwrap_err()
            .to_string()
            .contains("no user name"));
    }

    #[test]
    fn model_list() {
        // The evaluation fork's list (head).
        let m = ModelList::parse(
            &p("model_list.txt"),
            "model_name\nresnet152_train\nresnet152-alter-1-00000000\nresnet152-alter-1-00000001\n",
        )
        .unwrap();
        assert_eq!(
            m.names,
            vec![
                "resnet152_train",
                "resnet152-alter-1-00000000",
                "resnet152-alter-1-00000001"
            ]
        );
        let m = ModelList::parse(
            &p("model_list.txt"),
            "// c\nmodel_name\n\ngpt2-tiny-00000004 // tiny\n",
        )
        .unwrap();
        assert_eq!(m.names, vec!["gpt2-tiny-00000004"]);
        let err = |t: &str| {
            ModelList::parse(&p("model_list.txt"), t)
                .unwrap_err()
                .to_string()
        };
        assert!(err("resnet152\n")
            .starts_with("settings/model_list.txt:1: expected the header \"model_name\""));
        assert!(err("model_name\na\nb c\n")
            .starts_with("settings/model_list.txt:3: expected a model name"));
        assert!(err("model_name\na\na\n").contains("already listed on line 2"));
        assert!(err("model_name\n").contains("no model names"));
        assert!(err("").contains("empty"));
        assert!(err(&format!("model_name\n{}\n", "a".repeat(300))).contains("longer than"));
    }

    #[test]
    fn family_weights() {
        let w = FamilyWeights::parse(
            &p("family_weights.txt"),
            "model_name,   weight\nresnet152, 1\ninception_v3,0.5 // half\nbert_base, 0\n",
        )
        .unwrap();
        assert_eq!(w.get("inception_v3"), Some(0.5));
        assert_eq!(w.get("gpt2"), None);
        assert_eq!(w.weights.len(), 3);
        let err = |t: &str| {
            FamilyWeights::parse(&p("family_weights.txt"), t)
                .unwrap_err()
                .to_string()
        };
        assert!(err("model_name, weight\ngpt2, x\n").starts_with("settings/family_weights.txt:2: expected \"<family>, <weight>\", found \"gpt2, x\": weight \"x\" is not a number >= 0"));
        assert!(err("model_name, weight\ngpt2, -1\n").contains("not a number >= 0"));
        assert!(err("model_name, weight\ngpt2\n").contains("1 fields"));
        assert!(err("model_name, weight\ngpt2, 1\ngpt2, 2\n").contains("already has a weight"));
        assert!(err("model_name, weight\ngpt2, 0\n").contains("no family has a weight > 0"));
        assert!(err("family, weight\n").contains("expected the header \"model_name, weight\""));
    }

    #[test]
    fn ray_server_list() {
        let s = parse_ray_server_list(
            &p("server_list.txt"),
            "// gpus\n10.0.0.1:0\n10.0.0.1:1\n[::1]:0\n",
        )
        .unwrap();
        assert_eq!(
            s[1],
            RayServer {
                host: "10.0.0.1".into(),
                gpu: 1
            }
        );
        assert_eq!(s[2].host, "::1");
        let err = |t: &str| {
            parse_ray_server_list(&p("server_list.txt"), t)
                .unwrap_err()
                .to_string()
        };
        assert!(err("10.0.0.1\n")
            .starts_with("settings/server_list.txt:1: expected \"<address>:<gpu>\""));
        assert!(err("10.0.0.1:x\n").contains("not a whole number"));
        assert!(err("10.0.0.1:0\n10.0.0.1:0\n").contains("listed twice"));
    }
}
