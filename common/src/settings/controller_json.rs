//! `settings/controller.json`, `mps_controller.json` and `ray_controller.json`.
//!
//! The original's keys are required as in the original; keys this rebuild
//! adds are optional with the defaults documented on each field (and in
//! `settings/README.md`). Unknown keys are errors, so a misspelt option is
//! not silently ignored. Errors carry the file, line, column and field.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::de::{DeserializeOwned, Error as _};
use serde::{Deserialize, Deserializer, Serialize};

use super::endpoint::parse_host;
use super::error::{read_optional, read_required, Result, SettingsError};
use crate::limits::GROUP_BYTES_DEFAULT;

/// Largest accepted `group_bytes`: 1 GiB (the group-size sweep goes to 512 MiB).
pub const GROUP_BYTES_MAX: u64 = 1 << 30;

/// Default `rescheduling_period_s`, as in the original.
pub const RESCHEDULING_PERIOD_S_DEFAULT: f64 = 1.0;
/// Default `zipf_s`, as in the original.
pub const ZIPF_S_DEFAULT: f64 = 0.9;
/// Default `policy`.
pub const POLICY_DEFAULT: &str = "distmind";
/// Most memory servers one model is sharded over when `shard_width` is 0,
/// as in the original ("min(#memory servers, 4)").
pub const SHARD_WIDTH_AUTO_MAX: usize = 4;

/// How a model's parameter groups are laid out over memory servers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ShardStrategy {
    /// Every group split into equal slices over all shard servers (the original's).
    #[default]
    Hybrid,
    /// The whole model on one server.
    PerApp,
    /// Group i on server i mod n.
    Horizontal,
    /// The model cut into n contiguous equal parts.
    Vertical,
}

/// `controller.json` (and `mps_controller.json`, which has the same keys).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ControllerSettings {
    /// Model list file; relative paths resolve against the repository root
    /// (see `Settings::resolve_path`).
    pub model_list_filename: PathBuf,
    /// Address the controller listens on for GPU workers.
    pub addr_for_server: String,
    pub port_for_server: u16,
    /// Address the controller listens on for subscribers (load balancer, clients).
    pub addr_for_subscriber: String,
    pub port_for_subscriber: u16,
    /// Metadata (catalog) endpoint.
    pub metadata_addr: String,
    pub metadata_port: u16,
    /// 0: accept worker registrations for a while; N > 0: N synthetic ids.
    pub num_servers: u32,
    /// GPUs doing inference, indexed by `wall_clock_second % len`.
    pub inference_workload_s: Vec<u32>,
    /// NEW. Seconds between reassignments (default 1.0). The evaluation
    /// fork's spelling `rescheduling_period` is accepted as an alias.
    #[serde(
        default = "default_rescheduling_period_s",
        alias = "rescheduling_period"
    )]
    pub rescheduling_period_s: f64,
    /// NEW. Zipf exponent of model popularity (default 0.9).
    #[serde(default = "default_zipf_s")]
    pub zipf_s: f64,
    /// NEW. Share GPUs with training (default false). A JSON boolean only:
    /// the original's argparse turned the string "False" into true.
    #[serde(default, deserialize_with = "strict_bool")]
    pub use_train: bool,
    /// NEW. Placement policy name (default "distmind").
    #[serde(default = "default_policy")]
    pub policy: String,
    /// NEW. Memory servers per model; 0 (default) = min(#memory servers, 4).
    #[serde(default)]
    pub shard_width: u32,
    /// NEW. Copies of every slice on distinct memory servers (default 1).
    #[serde(default = "default_replication")]
    pub replication: u32,
    /// NEW. Sharding scheme (default hybrid).
    #[serde(default)]
    pub strategy: ShardStrategy,
    /// NEW. Bytes per parameter group (default 32,768,000).
    #[serde(default = "default_group_bytes")]
    pub group_bytes: u64,
    /// NEW. Latency objective per model family in ms (optional).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slo_ms: Option<BTreeMap<String, f64>>,
}

/// `ray_controller.json`: the Ray Serve baseline's controller.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RayControllerSettings {
    pub model_list_filename: PathBuf,
    /// File of `ip:gpu` lines (see `parse_ray_server_list`).
    pub server_list_file: PathBuf,
    pub addr_for_subscriber: String,
    pub port_for_subscriber: u16,
    pub inference_workload_s: Vec<u32>,
    /// NEW, as in [`ControllerSettings`].
    #[serde(
        default = "default_rescheduling_period_s",
        alias = "rescheduling_period"
    )]
    pub rescheduling_period_s: f64,
    /// NEW, as in [`ControllerSettings`].
    #[serde(default = "default_zipf_s")]
    pub zipf_s: f64,
    /// NEW, as in [`ControllerSettings`].
    #[serde(default, deserialize_with = "strict_bool")]
    pub use_train: bool,
    /// NEW, as in [`ControllerSettings`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slo_ms: Option<BTreeMap<String, f64>>,
}

fn default_rescheduling_period_s() -> f64 {
    RESCHEDULING_PERIOD_S_DEFAULT
}
fn default_zipf_s() -> f64 {
    ZIPF_S_DEFAULT
}
fn default_policy() -> String {
    POLICY_DEFAULT.to_string()
}
fn default_replication() -> u32 {
    1
}
fn default_group_bytes() -> u64 {
    GROUP_BYTES_DEFAULT
}

/// Accepts `true`/`false` only, explaining why strings are refused.
fn strict_bool<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<bool, D::Error> {
    match serde_json::Value::deserialize(d)? {
        serde_json::Value::Bool(b) => Ok(b),
        serde_json::Value::String(s) => Err(D::Error::custom(format!(
            "expected a JSON boolean (true or false, without quotes), found the string \"{s}\"; strings are refused because the original's argparse read any non-empty string, \"False\" included, as true"
        ))),
        other => Err(D::Error::custom(format!(
            "expected a JSON boolean (true or false), found {other}"
        ))),
    }
}

impl ControllerSettings {
    /// Reads a required controller file.
    pub fn load(path: &Path) -> Result<Self> {
        let text = read_required(
            path,
            "copy settings/controller.json from the repository (keys: model_list_filename, addr_for_server, port_for_server, addr_for_subscriber, port_for_subscriber, metadata_addr, metadata_port, num_servers, inference_workload_s)",
        )?;
        Self::parse(path, &text)
    }

    /// Reads an optional controller file (`mps_controller.json`).
    pub fn load_optional(path: &Path) -> Result<Option<Self>> {
        read_optional(path)?
            .map(|text| Self::parse(path, &text))
            .transpose()
    }

    pub fn parse(path: &Path, text: &str) -> Result<Self> {
        let s: Self = from_json(path, text)?;
        let check = Checker { path, text };
        check.host("addr_for_server", &s.addr_for_server)?;
        check.host("addr_for_subscriber", &s.addr_for_subscriber)?;
        check.host("metadata_addr", &s.metadata_addr)?;
        check.port("port_for_server", s.port_for_server)?;
        check.port("port_for_subscriber", s.port_for_subscriber)?;
        check.port("metadata_port", s.metadata_port)?;
        check.common(
            &s.inference_workload_s,
            s.rescheduling_period_s,
            s.zipf_s,
            &s.slo_ms,
        )?;
        if s.policy.trim().is_empty() {
            return Err(check.err("policy", "expected a policy name, found an empty string"));
        }
        if s.replication == 0 {
            return Err(check.err(
                "replication",
                "expected at least 1 copy of every slice, found 0",
            ));
        }
        if !(1..=GROUP_BYTES_MAX).contains(&s.group_bytes) {
            return Err(check.err(
                "group_bytes",
                format!(
                    "expected bytes per group in 1..={GROUP_BYTES_MAX}, found {}",
                    s.group_bytes
                ),
            ));
        }
        Ok(s)
    }

    /// Memory servers each model is sharded over, given how many exist:
    /// `shard_width`, or min(`num_memservers`, 4) when it is 0.
    pub fn effective_shard_width(&self, num_memservers: usize) -> usize {
        match self.shard_width {
            0 => num_memservers.min(SHARD_WIDTH_AUTO_MAX),
            w => w as usize,
        }
    }

    /// The metadata endpoint this file names.
    pub fn metadata_endpoint(&self) -> super::Endpoint {
        super::Endpoint::new(self.metadata_addr.clone(), self.metadata_port)
    }
}

impl RayControllerSettings {
    pub fn load_optional(path: &Path) -> Result<Option<Self>> {
        read_optional(path)?
            .map(|text| Self::parse(path, &text))
            .transpose()
    }

    pub fn parse(path: &Path, text: &str) -> Result<Self> {
        let s: Self = from_json(path, text)?;
        let check = Checker { path, text };
        check.host("addr_for_subscriber", &s.addr_for_subscriber)?;
        check.port("port_for_subscriber", s.port_for_subscriber)?;
        check.common(
            &s.inference_workload_s,
            s.rescheduling_period_s,
            s.zipf_s,
            &s.slo_ms,
        )?;
        Ok(s)
    }
}

/// Deserializes with errors that name file, line, column and field.
pub(super) fn from_json<T: DeserializeOwned>(path: &Path, text: &str) -> Result<T> {
    serde_json::from_str(text).map_err(|e| {
        let message = e.to_string();
        // serde_json appends " at line L column C"; we print those ourselves.
        let message = match message.rfind(" at line ") {
            Some(i) => message[..i].to_string(),
            None => message,
        };
        let field = backticked_field(&message)
            .or_else(|| field_at(text, offset_of(text, e.line(), e.column())));
        SettingsError::Json {
            path: path.to_path_buf(),
            line: e.line().max(1),
            column: e.column().max(1),
            field,
            message,
        }
    })
}

/// The field of "missing field `x`" / "unknown field `x`, ..." messages.
fn backticked_field(message: &str) -> Option<String> {
    let rest = message
        .strip_prefix("missing field `")
        .or_else(|| message.strip_prefix("unknown field `"))?;
    rest.split('`').next().map(str::to_string)
}

/// Byte offset of a 1-based (line, column) position.
fn offset_of(text: &str, line: usize, column: usize) -> usize {
    let start: usize = text
        .split_inclusive('\n')
        .take(line.saturating_sub(1))
        .map(str::len)
        .sum();
    (start + column.saturating_sub(1)).min(text.len())
}

/// 1-based (line, column) of a byte offset.
fn position_of(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let col = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, col)
}

/// Object keys with the offset of their opening quote: top-level keys as
/// `key`, keys one level down as `parent.key`.
fn keys_with_offsets(text: &str) -> Vec<(String, usize)> {
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    let mut depth = 0usize;
    let mut top_key = String::new();
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'{' | b'[' => depth += 1,
            b'}' | b']' => depth = depth.saturating_sub(1),
            b'"' => {
                let start = i;
                i += 1;
                while i < bytes.len() && bytes[i] != b'"' {
                    i += if bytes[i] == b'\\' { 2 } else { 1 };
                }
                let s = &text[start + 1..i.min(text.len())];
                let after = text[(i + 1).min(text.len())..].trim_start();
                if after.starts_with(':') {
                    if depth == 1 {
                        top_key = s.to_string();
                        out.push((top_key.clone(), start));
                    } else if depth == 2 {
                        out.push((format!("{top_key}.{s}"), start));
                    }
                }
            }
            _ => {}
        }
        i += 1;
    }
    out
}

/// The key whose entry contains `offset`: the last key starting before it.
fn field_at(text: &str, offset: usize) -> Option<String> {
    keys_with_offsets(text)
        .into_iter()
        .take_while(|(_, o)| *o < offset)
        .last()
        .map(|(k, _)| k)
}

/// Checks after deserialization, with positions found from the key.
pub(super) struct Checker<'a> {
    pub path: &'a Path,
    pub text: &'a str,
}

impl Checker<'_> {
    pub fn err(&self, field: &str, message: impl Into<String>) -> SettingsError {
        let offset = keys_with_offsets(self.text)
            .into_iter()
            .find(|(k, _)| k == field)
            .map_or(0, |(_, o)| o);
        let (line, column) = position_of(self.text, offset);
        SettingsError::Json {
            path: self.path.to_path_buf(),
            line,
            column,
            field: Some(field.to_string()),
            message: message.into(),
        }
    }

    fn host(&self, field: &str, value: &str) -> Result<()> {
        parse_host(value)
            .map(|_| ())
            .map_err(|r| self.err(field, format!("expected an IPv4, IPv6 or hostname: {r}")))
    }

    fn port(&self, field: &str, value: u16) -> Result<()> {
        if value == 0 {
            return Err(self.err(field, "expected a port in 1..=65535, found 0"));
        }
        Ok(())
    }

    fn common(
        &self,
        workload: &[u32],
        period_s: f64,
        zipf_s: f64,
        slo_ms: &Option<BTreeMap<String, f64>>,
    ) -> Result<()> {
        if workload.is_empty() {
            return Err(self.err(
                "inference_workload_s",
                "expected at least one entry (GPUs doing inference in each second), found []",
            ));
        }
        if !(period_s.is_finite() && period_s > 0.0) {
            let field = if self.text.contains("\"rescheduling_period\"") {
                "rescheduling_period"
            } else {
                "rescheduling_period_s"
            };
            return Err(self.err(
                field,
                format!("expected a positive number of seconds, found {period_s}"),
            ));
        }
        if !(zipf_s.is_finite() && zipf_s >= 0.0) {
            return Err(self.err(
                "zipf_s",
                format!("expected a Zipf exponent >= 0, found {zipf_s}"),
            ));
        }
        for (family, ms) in slo_ms.iter().flatten() {
            if !(ms.is_finite() && *ms > 0.0) {
                return Err(self.err(
                    &format!("slo_ms.{family}"),
                    format!("expected a positive number of milliseconds, found {ms}"),
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ORIGINAL: &str = "{\n    \"model_list_filename\": \"build/resource/model_list.txt\",\n    \"addr_for_server\": \"0.0.0.0\",\n    \"port_for_server\": 8013,\n    \"addr_for_subscriber\": \"0.0.0.0\",\n    \"port_for_subscriber\": 8014,\n    \"metadata_addr\": \"127.0.0.1\",\n    \"metadata_port\": 7777,\n    \"num_servers\": 0,\n    \"inference_workload_s\": [\n        2,\n        2\n    ]\n}";
    const ORIGINAL_RAY: &str = "{\n    \"model_list_filename\": \"build/ray/model_list.txt\",\n    \"server_list_file\": \"build/ray/server_list.txt\",\n    \"addr_for_subscriber\": \"0.0.0.0\",\n    \"port_for_subscriber\": 8014,\n    \"inference_workload_s\": [\n        2,\n        2\n    ]\n}";
    /// The evaluation fork's controller.json (new keys, other spelling).
    const AE_FORK: &str = "{\n    \"model_list_filename\": \"build/resource/model_list.txt\",\n    \"zipf_s\": 0.9,\n    \"addr_for_server\": \"0.0.0.0\",\n    \"port_for_server\": 8013,\n    \"addr_for_subscriber\": \"0.0.0.0\",\n    \"port_for_subscriber\": 9014,\n    \"metadata_addr\": \"127.0.0.1\",\n    \"metadata_port\": 7777,\n    \"rescheduling_period\": 1,\n    \"num_servers\": 0,\n    \"inference_workload_s\": [8, 8, 16, 16]\n}";

    fn parse(text: &str) -> Result<ControllerSettings> {
        ControllerSettings::parse(Path::new("settings/controller.json"), text)
    }

    fn err(text: &str) -> String {
        parse(text).unwrap_err().to_string()
    }

    /// The original with `"inference_workload_s": [2, 2]` replaced by `extra`.
    fn with(extra: &str) -> String {
        ORIGINAL.replace(
            "\"num_servers\": 0,",
            &format!("\"num_servers\": 0,\n    {extra},"),
        )
    }

    #[test]
    fn original_files_parse_with_defaults() {
        let c = parse(ORIGINAL).unwrap();
        assert_eq!(
            c.model_list_filename,
            Path::new("build/resource/model_list.txt")
        );
        assert_eq!(
            (c.port_for_server, c.port_for_subscriber, c.metadata_port),
            (8013, 8014, 7777)
        );
        assert_eq!(c.inference_workload_s, vec![2, 2]);
        assert_eq!(c.rescheduling_period_s, 1.0);
        assert_eq!(c.zipf_s, 0.9);
        assert!(!c.use_train);
        assert_eq!(c.policy, "distmind");
        assert_eq!((c.shard_width, c.replication), (0, 1));
        assert_eq!(c.strategy, ShardStrategy::Hybrid);
        assert_eq!(c.group_bytes, 32_768_000);
        assert_eq!(c.slo_ms, None);
        assert_eq!(c.effective_shard_width(2), 2);
        assert_eq!(c.effective_shard_width(9), 4);
        assert_eq!(c.metadata_endpoint().to_string(), "127.0.0.1:7777");

        let r =
            RayControllerSettings::parse(Path::new("settings/ray_controller.json"), ORIGINAL_RAY)
                .unwrap();
        assert_eq!(r.server_list_file, Path::new("build/ray/server_list.txt"));
        assert_eq!(r.inference_workload_s, vec![2, 2]);

        let a = parse(AE_FORK).unwrap();
        assert_eq!(
            (a.rescheduling_period_s, a.port_for_subscriber),
            (1.0, 9014)
        );
    }

    #[test]
    fn new_keys() {
        let c = parse(&with(
            "\"rescheduling_period_s\": 0.5, \"zipf_s\": 0.99, \"use_train\": true, \"policy\": \"lfu\", \"shard_width\": 2, \"replication\": 2, \"strategy\": \"per-app\", \"group_bytes\": 1, \"slo_ms\": {\"resnet152\": 100, \"bert_base\": 250.5}",
        ))
        .unwrap();
        assert_eq!(
            (c.rescheduling_period_s, c.zipf_s, c.use_train),
            (0.5, 0.99, true)
        );
        assert_eq!(
            (c.policy.as_str(), c.shard_width, c.replication),
            ("lfu", 2, 2)
        );
        assert_eq!((c.strategy, c.group_bytes), (ShardStrategy::PerApp, 1));
        assert_eq!(c.slo_ms.as_ref().unwrap()["bert_base"], 250.5);
        assert_eq!(c.effective_shard_width(9), 2);
        for (name, s) in [
            ("hybrid", ShardStrategy::Hybrid),
            ("horizontal", ShardStrategy::Horizontal),
            ("vertical", ShardStrategy::Vertical),
        ] {
            assert_eq!(
                parse(&with(&format!("\"strategy\": \"{name}\"")))
                    .unwrap()
                    .strategy,
                s
            );
        }
    }

    #[test]
    fn use_train_string_is_refused_with_reason() {
        let e = err(&with("\"use_train\": \"False\""));
        assert!(e.starts_with("settings/controller.json:10:"), "{e}");
        assert!(e.contains("field \"use_train\""), "{e}");
        assert!(e.contains("\"False\" included, as true"), "{e}");
        assert!(err(&with("\"use_train\": 0")).contains("expected a JSON boolean"));
    }

    #[test]
    fn errors_name_line_column_and_field() {
        let e = err(&ORIGINAL.replace("8014", "\"8014\""));
        assert!(e.starts_with("settings/controller.json:6:"), "{e}");
        assert!(e.contains("field \"port_for_subscriber\""), "{e}");
        let e = err(&ORIGINAL.replace("8013", "70000"));
        assert!(
            e.starts_with("settings/controller.json:4:") && e.contains("field \"port_for_server\""),
            "{e}"
        );
        let e = err(&ORIGINAL.replace("    \"metadata_port\": 7777,\n", ""));
        assert!(
            e.contains("field \"metadata_port\": missing field `metadata_port`"),
            "{e}"
        );
        let e = err(&with("\"zipf\": 0.9"));
        assert!(
            e.starts_with("settings/controller.json:10:")
                && e.contains("field \"zipf\": unknown field `zipf`"),
            "{e}"
        );
        let e = err(&ORIGINAL.replace("8013,", "8013"));
        assert!(
            e.starts_with("settings/controller.json:5:5:") && e.contains("expected `,`"),
            "{e}"
        );
        let e = err(&with("\"strategy\": \"diagonal\""));
        assert!(
            e.contains("field \"strategy\"") && e.contains("per-app"),
            "{e}"
        );
        let e = err(&with("\"slo_ms\": {\"gpt2\": -1}"));
        assert!(
            e.starts_with("settings/controller.json:10:") && e.contains("field \"slo_ms.gpt2\""),
            "{e}"
        );
        let e = err(&with("\"slo_ms\": {\"gpt2\": \"x\"}"));
        assert!(e.contains("field \"slo_ms.gpt2\""), "{e}");
    }

    #[test]
    fn value_checks() {
        let cases = [
            (
                "\"rescheduling_period_s\": 0",
                "rescheduling_period_s",
                "positive number of seconds",
            ),
            (
                "\"rescheduling_period\": -1",
                "rescheduling_period",
                "positive number of seconds",
            ),
            ("\"zipf_s\": -0.1", "zipf_s", "Zipf exponent"),
            ("\"replication\": 0", "replication", "at least 1"),
            ("\"group_bytes\": 0", "group_bytes", "1..="),
            ("\"group_bytes\": 2000000000", "group_bytes", "1..="),
            ("\"policy\": \" \"", "policy", "policy name"),
        ];
        for (extra, field, why) in cases {
            let e = err(&with(extra));
            assert!(
                e.starts_with("settings/controller.json:10:5:"),
                "{extra}: {e}"
            );
            assert!(
                e.contains(&format!("field \"{field}\"")) && e.contains(why),
                "{extra}: {e}"
            );
        }
        let e = err(&ORIGINAL.replace(
            "\"metadata_addr\": \"127.0.0.1\"",
            "\"metadata_addr\": \"1.2.3\"",
        ));
        assert!(
            e.starts_with("settings/controller.json:7:5:") && e.contains("not a valid IPv4"),
            "{e}"
        );
        let e = err(&ORIGINAL.replace("7777", "0"));
        assert!(
            e.contains("field \"metadata_port\"") && e.contains("found 0"),
            "{e}"
        );
        let e = err(&ORIGINAL.replace("[\n        2,\n        2\n    ]", "[]"));
        assert!(e.contains("field \"inference_workload_s\""), "{e}");
    }

    #[test]
    fn positions() {
        let t = "ab\ncd\n";
        assert_eq!(offset_of(t, 2, 2), 4);
        assert_eq!(position_of(t, 4), (2, 2));
        assert_eq!(position_of(t, 0), (1, 1));
    }
}
