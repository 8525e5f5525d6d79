//! `settings/config.sh`: bash `KEY=VALUE` lines that the original's scripts
//! `source`. We parse the file, never execute it: only assignments, comments
//! and blank lines are accepted. `$NAME` / `${NAME}` expand to keys assigned
//! earlier in the same file (not the environment); command substitution
//! (`$(...)`, backticks) and shell operators are refused.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::endpoint::{parse_host, parse_port};
use super::error::{read_required, Result, SettingsError};

const EXPECTED_LINE: &str = "KEY=VALUE, a # comment or a blank line";

/// Where the cluster runs: everything on this host, or over ssh.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Local,
    Remote,
}

/// One assignment as written (after quote removal and expansion).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigValue {
    pub value: String,
    /// 1-based line of the assignment that won (the last one).
    pub line: usize,
}

/// The parsed `config.sh`: typed fields for the keys the original knows (with
/// its shipped values as defaults when absent) plus every assignment, known
/// or not, through [`ConfigSh::get`].
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigSh {
    pub path: PathBuf,
    /// `GLOBAL_LOCAL_IP` (127.0.0.1): this host's address.
    pub local_ip: String,
    /// `GLOBAL_METADATA_IP` (127.0.0.1).
    pub metadata_ip: String,
    /// `GLOBAL_CONTROLLER_IP` (127.0.0.1).
    pub controller_ip: String,
    /// `GLOBAL_TRAIN_CONTROLLER_IP` (127.0.0.1).
    pub train_controller_ip: String,
    /// `GLOBAL_LOAD_BALANCER_IP` (127.0.0.1).
    pub load_balancer_ip: String,
    /// `GLOBAL_METADATA_PORT` (7777).
    pub metadata_port: u16,
    /// `GLOBAL_STORAGE_PORT` (7778).
    pub storage_port: u16,
    /// `GLOBAL_CONTROLLER_PORT_FOR_SERVER` (8013).
    pub controller_port_for_server: u16,
    /// `GLOBAL_CONTROLLER_PORT_FOR_SUBSCRIBER` (8014).
    pub controller_port_for_subscriber: u16,
    /// `GLOBAL_TRAIN_CONTROLLER_PORT_FOR_TRAINING` (8015).
    pub train_controller_port_for_training: u16,
    /// `GLOBAL_LOAD_BALANCER_PORT_FOR_CACHE` (8880).
    pub load_balancer_port_for_cache: u16,
    /// `GLOBAL_LOAD_BALANCER_PORT_FOR_SERVER` (8888).
    pub load_balancer_port_for_server: u16,
    /// `GLOBAL_LOAD_BALANCER_PORT_FOR_CLIENT` (9999).
    pub load_balancer_port_for_client: u16,
    /// `GLOBAL_CAHCE_PORT_FOR_SERVER` (sic; 10009). The correct spelling
    /// `GLOBAL_CACHE_PORT_FOR_SERVER` is accepted too; the later line wins.
    pub cache_port_for_server: u16,
    /// `GLOBAL_TRAINING_PORT` (9998).
    pub training_port: u16,
    /// `GLOBAL_SERVER_PORT_FOR_INDEX` (7000).
    pub server_port_for_index: u16,
    /// `GLOBAL_INFERENCE_HTTP_PORT` (8000): the Open Inference Protocol
    /// over HTTP, on the controller's host (Triton's default port).
    pub inference_http_port: u16,
    /// `GLOBAL_INFERENCE_GRPC_PORT` (8001): the Open Inference Protocol
    /// over gRPC, on the controller's host (Triton's default port).
    pub inference_grpc_port: u16,
    /// `GLOBAL_NUM_MODELS` (128).
    pub num_models: u32,
    /// `GLOBAL_NUM_REQUEST` (1000): requests per client thread; 0 = unlimited.
    pub num_request: u64,
    /// `MODE` (`local`).
    pub mode: Mode,
    /// `WORLD_SIZE` (the length of `GPU_LIST`, or 1): GPUs on this machine.
    pub world_size: u32,
    /// `BACKEND` (`nccl`).
    pub backend: String,
    /// `GPU_LIST` (`0 .. WORLD_SIZE-1`): CUDA device ids, space separated.
    pub gpu_list: Vec<u32>,
    values: BTreeMap<String, ConfigValue>,
}

/// Keys with typed fields above; anything else is "unknown" but kept.
pub const KNOWN_KEYS: &[&str] = &[
    "GLOBAL_LOCAL_IP",
    "GLOBAL_METADATA_IP",
    "GLOBAL_CONTROLLER_IP",
    "GLOBAL_TRAIN_CONTROLLER_IP",
    "GLOBAL_LOAD_BALANCER_IP",
    "GLOBAL_METADATA_PORT",
    "GLOBAL_STORAGE_PORT",
    "GLOBAL_CONTROLLER_PORT_FOR_SERVER",
    "GLOBAL_CONTROLLER_PORT_FOR_SUBSCRIBER",
    "GLOBAL_TRAIN_CONTROLLER_PORT_FOR_TRAINING",
    "GLOBAL_LOAD_BALANCER_PORT_FOR_CACHE",
    "GLOBAL_LOAD_BALANCER_PORT_FOR_SERVER",
    "GLOBAL_LOAD_BALANCER_PORT_FOR_CLIENT",
    "GLOBAL_CAHCE_PORT_FOR_SERVER",
    "GLOBAL_CACHE_PORT_FOR_SERVER",
    "GLOBAL_TRAINING_PORT",
    "GLOBAL_SERVER_PORT_FOR_INDEX",
    "GLOBAL_INFERENCE_HTTP_PORT",
    "GLOBAL_INFERENCE_GRPC_PORT",
    "GLOBAL_NUM_MODELS",
    "GLOBAL_NUM_REQUEST",
    "MODE",
    "WORLD_SIZE",
    "BACKEND",
    "GPU_LIST",
];

/// Upper bound on `WORLD_SIZE` / `GPU_LIST` entries: GPUs in one machine.
pub const GPUS_PER_HOST_MAX: u32 = 64;

impl ConfigSh {
    /// Reads and parses `path`.
    pub fn load(path: &Path) -> Result<Self> {
        let text = read_required(
            path,
            "copy settings/config.sh from the repository and edit it (bash KEY=VALUE lines)",
        )?;
        Self::parse(path, &text)
    }

    /// Parses the text of a `config.sh`; `path` is used in messages.
    pub fn parse(path: &Path, text: &str) -> Result<Self> {
        let values = parse_assignments(path, text)?;
        let typed = Typed {
            path,
            values: &values,
        };
        let gpu_list = typed.gpu_list()?;
        let world_size = typed.num::<u32>("WORLD_SIZE", None, 1, GPUS_PER_HOST_MAX as u64)?;
        let (world_size, gpu_list) = match (world_size, gpu_list) {
            (Some(w), Some(g)) => {
                if (w as usize) > g.len() {
                    return Err(typed.err(
                        "WORLD_SIZE",
                        format!("at most the {} GPU ids of GPU_LIST", g.len()),
                        format!("WORLD_SIZE={w} but GPU_LIST names only {} GPUs", g.len()),
                    ));
                }
                if (w as usize) < g.len() {
                    log::warn!(
                        "{}: WORLD_SIZE={w} uses only the first {w} of the {} GPUs in GPU_LIST",
                        path.display(),
                        g.len()
                    );
                }
                (w, g)
            }
            (Some(w), None) => (w, (0..w).collect()),
            (None, Some(g)) => (g.len() as u32, g),
            (None, None) => (1, vec![0]),
        };
        let cache_key = match (
            values.get("GLOBAL_CAHCE_PORT_FOR_SERVER"),
            values.get("GLOBAL_CACHE_PORT_FOR_SERVER"),
        ) {
            (Some(a), Some(b)) if b.line > a.line => "GLOBAL_CACHE_PORT_FOR_SERVER",
            (None, Some(_)) => "GLOBAL_CACHE_PORT_FOR_SERVER",
            _ => "GLOBAL_CAHCE_PORT_FOR_SERVER",
        };
        let cfg = ConfigSh {
            path: path.to_path_buf(),
            local_ip: typed.host("GLOBAL_LOCAL_IP")?,
            metadata_ip: typed.host("GLOBAL_METADATA_IP")?,
            controller_ip: typed.host("GLOBAL_CONTROLLER_IP")?,
            train_controller_ip: typed.host("GLOBAL_TRAIN_CONTROLLER_IP")?,
            load_balancer_ip: typed.host("GLOBAL_LOAD_BALANCER_IP")?,
            metadata_port: typed.port("GLOBAL_METADATA_PORT", 7777)?,
            storage_port: typed.port("GLOBAL_STORAGE_PORT", 7778)?,
            controller_port_for_server: typed.port("GLOBAL_CONTROLLER_PORT_FOR_SERVER", 8013)?,
            controller_port_for_subscriber: typed
                .port("GLOBAL_CONTROLLER_PORT_FOR_SUBSCRIBER", 8014)?,
            train_controller_port_for_training: typed
                .port("GLOBAL_TRAIN_CONTROLLER_PORT_FOR_TRAINING", 8015)?,
            load_balancer_port_for_cache: typed
                .port("GLOBAL_LOAD_BALANCER_PORT_FOR_CACHE", 8880)?,
            load_balancer_port_for_server: typed
                .port("GLOBAL_LOAD_BALANCER_PORT_FOR_SERVER", 8888)?,
            load_balancer_port_for_client: typed
                .port("GLOBAL_LOAD_BALANCER_PORT_FOR_CLIENT", 9999)?,
            cache_port_for_server: typed.port(cache_key, 10009)?,
            training_port: typed.port("GLOBAL_TRAINING_PORT", 9998)?,
            server_port_for_index: typed.port("GLOBAL_SERVER_PORT_FOR_INDEX", 7000)?,
            inference_http_port: typed.port("GLOBAL_INFERENCE_HTTP_PORT", 8000)?,
            inference_grpc_port: typed.port("GLOBAL_INFERENCE_GRPC_PORT", 8001)?,
            num_models: typed
                .num::<u32>("GLOBAL_NUM_MODELS", Some(128), 1, u32::MAX as u64)?
                .unwrap_or(128),
            num_request: typed
                .num::<u64>("GLOBAL_NUM_REQUEST", Some(1000), 0, u64::MAX)?
                .unwrap_or(1000),
            mode: typed.mode()?,
            world_size,
            backend: typed.get("BACKEND").unwrap_or("nccl").to_string(),
            gpu_list,
            values: values.clone(),
        };
        Ok(cfg)
    }

    /// The value of any assigned key, known or not.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.values.get(key).map(|v| v.value.as_str())
    }

    /// The value and line of any assigned key.
    pub fn entry(&self, key: &str) -> Option<&ConfigValue> {
        self.values.get(key)
    }

    /// Every assigned key, in sorted order.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.values.keys().map(String::as_str)
    }

    /// Assigned keys that have no typed field (kept, not an error).
    pub fn unknown_keys(&self) -> impl Iterator<Item = &str> {
        self.keys().filter(|k| !KNOWN_KEYS.contains(k))
    }

    /// The GPUs this machine uses: the first `world_size` of `gpu_list`.
    pub fn gpus(&self) -> &[u32] {
        &self.gpu_list[..self.world_size as usize]
    }
}

/// Typed views over the raw assignments, with errors that point at the line.
struct Typed<'a> {
    path: &'a Path,
    values: &'a BTreeMap<String, ConfigValue>,
}

impl Typed<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.values.get(key).map(|v| v.value.as_str())
    }

    fn err(&self, key: &str, expected: String, reason: String) -> SettingsError {
        let v = &self.values[key];
        SettingsError::line(
            self.path,
            v.line,
            format!("{key}={expected}"),
            &format!("{key}={}", v.value),
            reason,
        )
    }

    fn host(&self, key: &str) -> Result<String> {
        match self.get(key) {
            None => Ok("127.0.0.1".into()),
            Some(v) => {
                parse_host(v).map_err(|r| self.err(key, "<IPv4, IPv6 or hostname>".into(), r))
            }
        }
    }

    fn port(&self, key: &str, default: u16) -> Result<u16> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => parse_port(v).map_err(|r| self.err(key, "<port>".into(), r)),
        }
    }

    fn num<T: std::str::FromStr + Into<u64> + Copy>(
        &self,
        key: &str,
        default: Option<T>,
        min: u64,
        max: u64,
    ) -> Result<Option<T>> {
        let Some(v) = self.get(key) else {
            return Ok(default);
        };
        match v.parse::<T>() {
            Ok(n) if (min..=max).contains(&n.into()) => Ok(Some(n)),
            _ => Err(self.err(
                key,
                "<number>".into(),
                format!("\"{v}\" is not a whole number in {min}..={max}"),
            )),
        }
    }

    fn mode(&self) -> Result<Mode> {
        match self.get("MODE") {
            None | Some("local") => Ok(Mode::Local),
            Some("remote") => Ok(Mode::Remote),
            Some(v) => Err(self.err(
                "MODE",
                "'local' or 'remote'".into(),
                format!("unknown mode \"{v}\""),
            )),
        }
    }

    fn gpu_list(&self) -> Result<Option<Vec<u32>>> {
        let Some(v) = self.get("GPU_LIST") else {
            return Ok(None);
        };
        let expected = || "\"<gpu id> <gpu id> ...\"".to_string();
        let mut ids = Vec::new();
        for tok in v
            .split(|c: char| c.is_whitespace() || c == ',')
            .filter(|t| !t.is_empty())
        {
            let id: u32 = tok.parse().map_err(|_| {
                self.err(
                    "GPU_LIST",
                    expected(),
                    format!("GPU id \"{tok}\" is not a whole number"),
                )
            })?;
            if ids.contains(&id) {
                return Err(self.err(
                    "GPU_LIST",
                    expected(),
                    format!("GPU id {id} is listed twice"),
                ));
            }
            ids.push(id);
        }
        if ids.is_empty() {
            return Err(self.err("GPU_LIST", expected(), "GPU_LIST is empty".into()));
        }
        if ids.len() > GPUS_PER_HOST_MAX as usize {
            return Err(self.err(
                "GPU_LIST",
                expected(),
                format!("more than {GPUS_PER_HOST_MAX} GPUs"),
            ));
        }
        Ok(Some(ids))
    }
}

/// Every assignment of the file, later duplicates overriding earlier ones.
fn parse_assignments(path: &Path, text: &str) -> Result<BTreeMap<String, ConfigValue>> {
    let mut values: BTreeMap<String, ConfigValue> = BTreeMap::new();
    for (i, raw) in text.lines().enumerate() {
        let line_no = i + 1;
        let line = raw.strip_suffix('\r').unwrap_or(raw);
        let parsed = parse_line(line, &values)
            .map_err(|reason| SettingsError::line(path, line_no, EXPECTED_LINE, line, reason))?;
        let Some((key, value)) = parsed else { continue };
        if let Some(old) = values.get(&key) {
            log::warn!(
                "{}:{line_no}: {key} assigned again (first at line {}); the last value {value:?} wins over {:?}",
                path.display(),
                old.line,
                old.value
            );
        }
        values.insert(
            key,
            ConfigValue {
                value,
                line: line_no,
            },
        );
    }
    Ok(values)
}

/// One line: `Ok(None)` for blank/comment lines, the assignment otherwise, or
/// why the line is not one we accept.
fn parse_line(
    line: &str,
    earlier: &BTreeMap<String, ConfigValue>,
) -> Result<Option<(String, String)>, String> {
    let t = line.trim_start();
    if t.is_empty() || t.starts_with('#') {
        return Ok(None);
    }
    let t = match t.strip_prefix("export") {
        Some(rest) if rest.starts_with([' ', '\t']) => rest.trim_start(),
        _ => t,
    };
    let key_len = t
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(t.len());
    let key = &t[..key_len];
    let rest = &t[key_len..];
    let not_assignment = "not a shell variable assignment; only KEY=VALUE lines, comments and blank lines are accepted (the file is parsed, never executed)";
    if key.is_empty() || key.starts_with(|c: char| c.is_ascii_digit()) {
        return Err(not_assignment.into());
    }
    let Some(value_text) = rest.strip_prefix('=') else {
        if rest.trim_start().starts_with('=') {
            return Err(format!(
                "spaces around '=' after {key} (bash would run {key} as a command); write {key}=VALUE"
            ));
        }
        return Err(not_assignment.into());
    };
    let (value, tail) = parse_value(value_text, earlier)?;
    let tail = tail.trim_start();
    if !(tail.is_empty() || tail.starts_with('#')) {
        return Err(format!(
            "unquoted space inside the value of {key} (bash would run \"{}\" as a command); quote the value: {key}=\"...\"",
            tail.split_whitespace().next().unwrap_or(tail)
        ));
    }
    Ok(Some((key.to_string(), value)))
}

/// Parses a shell word: unquoted text, '...' and "..." segments, `\x`
/// escapes and `$NAME` expansion. Returns the value and the unparsed rest,
/// which starts at the first unquoted blank.
fn parse_value<'a>(
    s: &'a str,
    earlier: &BTreeMap<String, ConfigValue>,
) -> Result<(String, &'a str), String> {
    let mut out = String::new();
    let mut chars = s.char_indices().peekable();
    while let Some(&(i, c)) = chars.peek() {
        match c {
            ' ' | '\t' => return Ok((out, &s[i..])),
            '\'' => {
                chars.next();
                loop {
                    match chars.next() {
                        Some((_, '\'')) => break,
                        Some((_, ch)) => out.push(ch),
                        None => {
                            return Err(
                                "unterminated single quote (values must fit on one line)".into()
                            )
                        }
                    }
                }
            }
            '"' => {
                chars.next();
                loop {
                    match chars.next() {
                        Some((_, '"')) => break,
                        Some((_, '\\')) => match chars.peek() {
                            Some(&(_, e @ ('"' | '\\' | '$' | '`'))) => {
                                out.push(e);
                                chars.next();
                            }
                            _ => out.push('\\'),
                        },
                        Some((j, '$')) => expand(s, j, &mut chars, earlier, &mut out)?,
                        Some((_, '`')) => return Err(refused_substitution()),
                        Some((_, ch)) => out.push(ch),
                        None => {
                            return Err(
                                "unterminated double quote (values must fit on one line)".into()
                            )
                        }
                    }
                }
            }
            '\\' => {
                chars.next();
                match chars.next() {
                    Some((_, ch)) => out.push(ch),
                    None => return Err(
                        "line continuation with '\\' is not supported; put the value on one line"
                            .into(),
                    ),
                }
            }
            '$' => {
                chars.next();
                expand(s, i, &mut chars, earlier, &mut out)?;
            }
            '`' => return Err(refused_substitution()),
            ';' | '|' | '&' | '<' | '>' | '(' | ')' => {
                return Err(format!(
                    "shell operator '{c}' is not accepted; quote the value if '{c}' is part of it"
                ))
            }
            _ => {
                out.push(c);
                chars.next();
            }
        }
    }
    Ok((out, ""))
}

fn refused_substitution() -> String {
    "command substitution ($(...) or backticks) is refused: settings files are parsed, never executed; write the value itself".into()
}

/// Expands the `$...` whose `$` is at byte `dollar` of `s` (already
/// consumed from `chars`).
fn expand(
    s: &str,
    dollar: usize,
    chars: &mut std::iter::Peekable<std::str::CharIndices<'_>>,
    earlier: &BTreeMap<String, ConfigValue>,
    out: &mut String,
) -> Result<(), String> {
    let is_name = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let name = match chars.peek().map(|&(_, c)| c) {
        Some('(') => return Err(refused_substitution()),
        Some('{') => {
            chars.next();
            let mut name = String::new();
            loop {
                match chars.next() {
                    Some((_, '}')) => break,
                    Some((_, c)) if is_name(c) => name.push(c),
                    _ => {
                        return Err(format!(
                            "only $NAME and ${{NAME}} are expanded, not \"{}\"",
                            &s[dollar..]
                        ))
                    }
                }
            }
            name
        }
        Some(c) if c.is_ascii_alphabetic() || c == '_' => {
            let mut name = String::new();
            while let Some(&(_, c)) = chars.peek() {
                if !is_name(c) {
                    break;
                }
                name.push(c);
                chars.next();
            }
            name
        }
        // A lone `$` is literal in bash.
        _ => {
            out.push('$');
            return Ok(());
        }
    };
    match earlier.get(&name) {
        Some(v) => {
            out.push_str(&v.value);
            Ok(())
        }
        None => Err(format!(
            "${name} is not assigned earlier in this file (the environment is not consulted)"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The original's `settings/config.sh`, verbatim (no final newline),
    /// plus the commented variant of the artifact notes.
    const ORIGINAL: &str = "GLOBAL_LOCAL_IP=127.0.0.1\n\nGLOBAL_METADATA_IP=127.0.0.1\nGLOBAL_CONTROLLER_IP=127.0.0.1\nGLOBAL_TRAIN_CONTROLLER_IP=127.0.0.1\nGLOBAL_LOAD_BALANCER_IP=127.0.0.1\n\nGLOBAL_METADATA_PORT=7777\nGLOBAL_STORAGE_PORT=7778\nGLOBAL_CONTROLLER_PORT_FOR_SERVER=8013\nGLOBAL_CONTROLLER_PORT_FOR_SUBSCRIBER=8014\nGLOBAL_TRAIN_CONTROLLER_PORT_FOR_TRAINING=8015\nGLOBAL_LOAD_BALANCER_PORT_FOR_CACHE=8880\nGLOBAL_LOAD_BALANCER_PORT_FOR_SERVER=8888\nGLOBAL_LOAD_BALANCER_PORT_FOR_CLIENT=9999\nGLOBAL_CAHCE_PORT_FOR_SERVER=10009\nGLOBAL_TRAINING_PORT=9998\nGLOBAL_SERVER_PORT_FOR_INDEX=7000\n\nGLOBAL_NUM_MODELS=128\nGLOBAL_NUM_REQUEST=1000\n\nMODE='local'\n\nWORLD_SIZE=2\nBACKEND='nccl'\nGPU_LIST=\"0 1\"";

    const ANNOTATED: &str = r#"GLOBAL_LOCAL_IP=127.0.0.1        # this host's address
GLOBAL_METADATA_IP=127.0.0.1
GLOBAL_CONTROLLER_IP=127.0.0.1
GLOBAL_LOAD_BALANCER_IP=127.0.0.1
GLOBAL_METADATA_PORT=7777
GLOBAL_STORAGE_PORT=7778
GLOBAL_CONTROLLER_PORT_FOR_SERVER=8013
GLOBAL_CONTROLLER_PORT_FOR_SUBSCRIBER=8014
GLOBAL_LOAD_BALANCER_PORT_FOR_CACHE=8880
GLOBAL_LOAD_BALANCER_PORT_FOR_SERVER=8888
GLOBAL_LOAD_BALANCER_PORT_FOR_CLIENT=9999
GLOBAL_CAHCE_PORT_FOR_SERVER=10009   # (sic) spelling of the original
GLOBAL_NUM_MODELS=128
GLOBAL_NUM_REQUEST=1000          # requests per client thread; 0 = unlimited
MODE='local'                     # or 'remote'
WORLD_SIZE=2                     # GPUs on this machine
BACKEND='nccl'
GPU_LIST="0 1"
"#;

    fn parse(text: &str) -> Result<ConfigSh> {
        ConfigSh::parse(Path::new("settings/config.sh"), text)
    }

    fn err(text: &str) -> String {
        parse(text).unwrap_err().to_string()
    }

    #[test]
    fn original_files_parse() {
        for text in [ORIGINAL, ANNOTATED] {
            let c = parse(text).unwrap();
            assert_eq!(c.local_ip, "127.0.0.1");
            assert_eq!(c.metadata_port, 7777);
            assert_eq!(c.storage_port, 7778);
            assert_eq!(c.controller_port_for_server, 8013);
            assert_eq!(c.controller_port_for_subscriber, 8014);
            assert_eq!(c.cache_port_for_server, 10009);
            assert_eq!(c.load_balancer_port_for_client, 9999);
            assert_eq!(c.num_models, 128);
            assert_eq!(c.num_request, 1000);
            assert_eq!(c.mode, Mode::Local);
            assert_eq!(c.world_size, 2);
            assert_eq!(c.backend, "nccl");
            assert_eq!(c.gpu_list, vec![0, 1]);
            assert_eq!(c.gpus(), &[0, 1]);
            assert_eq!(c.unknown_keys().count(), 0);
        }
        let c = parse(ORIGINAL).unwrap();
        assert_eq!(c.entry("GPU_LIST").unwrap().line, 27);
        assert_eq!(c.training_port, 9998);
        assert_eq!(c.server_port_for_index, 7000);
    }

    #[test]
    fn inference_ports() {
        let c =
            parse("GLOBAL_INFERENCE_HTTP_PORT=18000\nGLOBAL_INFERENCE_GRPC_PORT=18001\n").unwrap();
        assert_eq!(
            (c.inference_http_port, c.inference_grpc_port),
            (18000, 18001)
        );
        assert_eq!(c.unknown_keys().count(), 0);
        let e = parse("\nGLOBAL_INFERENCE_GRPC_PORT=80010")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(":2") && e.contains("GLOBAL_INFERENCE_GRPC_PORT") && e.contains("1..=65535"),
            "{e}"
        );
    }

    #[test]
    fn defaults_when_absent() {
        let c = parse("").unwrap();
        assert_eq!(c.metadata_ip, "127.0.0.1");
        assert_eq!(c.metadata_port, 7777);
        assert_eq!(c.cache_port_for_server, 10009);
        assert_eq!(c.train_controller_port_for_training, 8015);
        assert_eq!((c.inference_http_port, c.inference_grpc_port), (8000, 8001));
        assert_eq!(c.mode, Mode::Local);
        assert_eq!((c.world_size, c.gpu_list.clone()), (1, vec![0]));
        let c = parse("WORLD_SIZE=3").unwrap();
        assert_eq!(c.gpu_list, vec![0, 1, 2]);
        let c = parse("GPU_LIST='2,3'").unwrap();
        assert_eq!((c.world_size, c.gpu_list), (2, vec![2, 3]));
    }

    #[test]
    fn quoting_export_and_comments() {
        let c = parse(
            "export MODE=remote\n  # indented comment\nBACKEND=\"gl\"'oo'\nX='a # b'  # real comment\nY=a#b\nZ=\"q\\\"uote \\$HOME\"\nE=\nF=''\nW=a\\ b\r\n",
        )
        .unwrap();
        assert_eq!(c.mode, Mode::Remote);
        assert_eq!(c.backend, "gloo");
        assert_eq!(c.get("X"), Some("a # b"));
        assert_eq!(c.get("Y"), Some("a#b"));
        assert_eq!(c.get("Z"), Some("q\"uote $HOME"));
        assert_eq!(c.get("E"), Some(""));
        assert_eq!(c.get("F"), Some(""));
        assert_eq!(c.get("W"), Some("a b"));
        let unknown: Vec<_> = c.unknown_keys().collect();
        assert_eq!(unknown, vec!["E", "F", "W", "X", "Y", "Z"]);
    }

    #[test]
    fn expansion_of_earlier_keys_only() {
        let c = parse("GLOBAL_LOCAL_IP=10.0.0.5\nGLOBAL_METADATA_IP=$GLOBAL_LOCAL_IP\nGLOBAL_CONTROLLER_IP=\"${GLOBAL_LOCAL_IP}\"\nP='$GLOBAL_LOCAL_IP'\nD=5$").unwrap();
        assert_eq!(c.metadata_ip, "10.0.0.5");
        assert_eq!(c.controller_ip, "10.0.0.5");
        assert_eq!(c.get("P"), Some("$GLOBAL_LOCAL_IP"));
        assert_eq!(c.get("D"), Some("5$"));
        let e = err("A=$HOME");
        assert!(
            e.contains("settings/config.sh:1:") && e.contains("$HOME is not assigned earlier"),
            "{e}"
        );
        assert!(err("A=${B:-x}").contains("only $NAME and ${NAME}"));
    }

    #[test]
    fn command_substitution_is_refused() {
        for text in [
            "A=$(hostname)",
            "A=\"$(rm -rf /)\"",
            "A=`id`",
            "A=\"x`id`\"",
        ] {
            let e = err(&format!("B=1\n{text}\n"));
            assert!(
                e.starts_with("settings/config.sh:2: expected KEY=VALUE"),
                "{e}"
            );
            assert!(e.contains("never executed"), "{e}");
        }
    }

    #[test]
    fn non_assignments_are_errors_with_line() {
        let cases = [
            ("if [ -z \"$X\" ]; then", "not a shell variable assignment"),
            ("fi", "not a shell variable assignment"),
            ("source other.sh", "not a shell variable assignment"),
            ("MODE = local", "spaces around '='"),
            ("A=b c", "unquoted space inside the value of A"),
            ("A='open", "unterminated single quote"),
            ("A=\"open", "unterminated double quote"),
            ("A=b; rm x", "shell operator ';'"),
            ("A=b\\", "line continuation"),
            ("1A=b", "not a shell variable assignment"),
        ];
        for (line, why) in cases {
            let e = err(&format!("# header\n\n{line}\n"));
            assert!(
                e.starts_with("settings/config.sh:3: expected KEY=VALUE"),
                "{line}: {e}"
            );
            assert!(e.contains(why), "{line}: {e}");
        }
    }

    #[test]
    fn typed_values_are_checked() {
        let e = err("X=1\nGLOBAL_METADATA_PORT=77x\n");
        assert_eq!(e, "settings/config.sh:2: expected GLOBAL_METADATA_PORT=<port>, found \"GLOBAL_METADATA_PORT=77x\": port \"77x\" is not a number in 1..=65535");
        assert!(err("MODE='cloud'").contains("'local' or 'remote'"));
        assert!(err("GLOBAL_LOCAL_IP=1.2.3.400").contains("not a valid IPv4"));
        assert!(err("GPU_LIST=\"0 x\"").contains("\"x\" is not a whole number"));
        assert!(err("GPU_LIST=\"0 0\"").contains("listed twice"));
        assert!(err("GPU_LIST=\"\"").contains("empty"));
        assert!(err("WORLD_SIZE=3\nGPU_LIST=\"0 1\"").contains("names only 2"));
        assert!(err("WORLD_SIZE=0").contains("1..=64"));
        assert!(err("GLOBAL_NUM_MODELS=-1").contains("whole number"));
        let c = parse("GLOBAL_NUM_REQUEST=0\nWORLD_SIZE=1\nGPU_LIST=\"3 4\"").unwrap();
        assert_eq!((c.num_request, c.gpus()), (0, &[3u32][..]));
    }

    #[test]
    fn duplicate_keys_last_wins_and_both_spellings_of_cache_port() {
        let c = parse("GLOBAL_METADATA_PORT=1\nGLOBAL_METADATA_PORT=2\n").unwrap();
        assert_eq!(c.metadata_port, 2);
        assert_eq!(c.entry("GLOBAL_METADATA_PORT").unwrap().line, 2);
        let c = parse("GLOBAL_CAHCE_PORT_FOR_SERVER=1\nGLOBAL_CACHE_PORT_FOR_SERVER=2\n").unwrap();
        assert_eq!(c.cache_port_for_server, 2);
        let c = parse("GLOBAL_CACHE_PORT_FOR_SERVER=2\nGLOBAL_CAHCE_PORT_FOR_SERVER=1\n").unwrap();
        assert_eq!(c.cache_port_for_server, 1);
        let c = parse("GLOBAL_CACHE_PORT_FOR_SERVER=3\n").unwrap();
        assert_eq!(c.cache_port_for_server, 3);
    }
}
