//! `settings/serverhost_list.txt`: one GPU host per line,
//! `"<address> slots=<num_gpus>"` (the quotes are optional), `//` comments.

use std::collections::HashMap;
use std::path::Path;

use super::config_sh::GPUS_PER_HOST_MAX;
use super::endpoint::parse_host;
use super::error::{content_lines, read_optional, Result, SettingsError};

const EXPECTED: &str = "\"<address> slots=<num_gpus>\"";

/// A GPU server and how many GPUs it contributes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuHost {
    /// IPv4/IPv6 literal or hostname.
    pub host: String,
    pub slots: u32,
}

/// Reads the file; `Ok(None)` when it does not exist.
pub fn load_serverhost_list(path: &Path) -> Result<Option<Vec<GpuHost>>> {
    match read_optional(path)? {
        Some(text) => parse_serverhost_list(path, &text).map(Some),
        None => Ok(None),
    }
}

/// Parses the text of a server host list; an empty list is an error.
pub fn parse_serverhost_list(path: &Path, text: &str) -> Result<Vec<GpuHost>> {
    let mut hosts: Vec<GpuHost> = Vec::new();
    let mut seen: HashMap<String, usize> = HashMap::new();
    for (line_no, line) in content_lines(text) {
        let host =
            parse_line(line).map_err(|r| SettingsError::line(path, line_no, EXPECTED, line, r))?;
        if let Some(first) = seen.insert(host.host.clone(), line_no) {
            return Err(SettingsError::line(
                path,
                line_no,
                "a host not listed before",
                line,
                format!(
                    "host {} is already listed on line {first}; give it more slots instead",
                    host.host
                ),
            ));
        }
        hosts.push(host);
    }
    if hosts.is_empty() {
        return Err(SettingsError::file(
            path,
            format!("no GPU hosts; expected one line {EXPECTED} per GPU server"),
        ));
    }
    Ok(hosts)
}

fn parse_line(line: &str) -> Result<GpuHost, String> {
    let unquoted = match line.strip_prefix('"') {
        Some(rest) => rest
            .strip_suffix('"')
            .ok_or("opening quote without a closing one")?,
        None if line.ends_with('"') => return Err("closing quote without an opening one".into()),
        None => line,
    };
    let fields: Vec<&str> = unquoted.split_whitespace().collect();
    let (addr, slots) = match fields.as_slice() {
        [addr, slots] => (*addr, *slots),
        [_] => return Err("missing \"slots=<num_gpus>\"".into()),
        _ => return Err(format!("{} fields, expected 2", fields.len())),
    };
    let host = parse_host(addr)?;
    let n = slots
        .strip_prefix("slots=")
        .ok_or_else(|| format!("\"{slots}\" is not \"slots=<num_gpus>\""))?;
    let slots = match n.parse::<u32>() {
        Ok(s) if (1..=GPUS_PER_HOST_MAX).contains(&s) => s,
        _ => {
            return Err(format!(
                "slots \"{n}\" is not a number of GPUs in 1..={GPUS_PER_HOST_MAX}"
            ))
        }
    };
    Ok(GpuHost { host, slots })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Vec<GpuHost>> {
        parse_serverhost_list(Path::new("settings/serverhost_list.txt"), text)
    }

    #[test]
    fn quoted_unquoted_and_comments() {
        let hosts = parse("// GPU servers\n\"172.31.0.1 slots=8\"\n172.31.0.2   slots=4 // half\n\n\"gpu-3 slots=1\"\r\n").unwrap();
        assert_eq!(
            hosts,
            vec![
                GpuHost {
                    host: "172.31.0.1".into(),
                    slots: 8
                },
                GpuHost {
                    host: "172.31.0.2".into(),
                    slots: 4
                },
                GpuHost {
                    host: "gpu-3".into(),
                    slots: 1
                },
            ]
        );
    }

    #[test]
    fn broken_lines() {
        let cases = [
            ("127.0.0.1", "missing \"slots=<num_gpus>\""),
            ("127.0.0.1 slots=x", "slots \"x\" is not a number"),
            ("127.0.0.1 slots=0", "1..=64"),
            ("127.0.0.1 gpus=2", "is not \"slots=<num_gpus>\""),
            ("\"127.0.0.1 slots=2", "opening quote"),
            ("127.0.0.1 slots=2\"", "closing quote"),
            ("1.2.3.4.5 slots=1", "not a valid IPv4"),
            ("127.0.0.2 slots=1", "already listed on line 1"),
            ("a b c", "3 fields"),
        ];
        for (line, why) in cases {
            let e = parse(&format!("127.0.0.2 slots=1\n// x\n{line}\n"))
                .unwrap_err()
                .to_string();
            assert!(
                e.starts_with("settings/serverhost_list.txt:3: expected "),
                "{line}: {e}"
            );
            assert!(e.contains(why), "{line}: {e}");
        }
        assert!(parse("// none\n")
            .unwrap_err()
            .to_string()
            .contains("no GPU hosts"));
    }

    #[test]
    fn missing_file_is_none() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(
            load_serverhost_list(&dir.path().join("serverhost_list.txt")).unwrap(),
            None
        );
    }
}
