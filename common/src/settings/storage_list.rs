//! `settings/storage_list.txt`: a CSV header, then `<address>, <port>` lines.
//! The FIRST data line is the metadata endpoint (the controller's catalog in
//! this rebuild); every later line is a memory server. Irregular spacing,
//! blank lines and `//` comments (whole-line or trailing) are accepted.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use super::endpoint::{parse_host, parse_port, Endpoint};
use super::error::{content_lines, read_required, Result, SettingsError};

const EXPECTED_DATA: &str = "\"<address>, <port>\"";
const EXPECTED_HEADER: &str = "the header \"storage_address, storage_port\"";

/// Upper bound on memory servers in one cluster.
pub const MEMSERVERS_MAX: usize = 4096;

/// The parsed storage list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StorageList {
    pub path: PathBuf,
    /// The first data line: where the metadata (catalog) service listens.
    pub metadata: Endpoint,
    /// The remaining lines, in file order: the memory servers.
    pub memservers: Vec<Endpoint>,
}

impl StorageList {
    pub fn load(path: &Path) -> Result<Self> {
        let text = read_required(
            path,
            "write a header \"storage_address, storage_port\", then the metadata endpoint line, then one line per memory server",
        )?;
        Self::parse(path, &text)
    }

    pub fn parse(path: &Path, text: &str) -> Result<Self> {
        let mut lines = content_lines(text);
        let Some((header_no, header)) = lines.next() else {
            return Err(SettingsError::file(
                path,
                "no header and no endpoints; expected \"storage_address, storage_port\", then the metadata endpoint, then the memory servers",
            ));
        };
        let squashed: String = header.chars().filter(|c| !c.is_whitespace()).collect();
        if !squashed.eq_ignore_ascii_case("storage_address,storage_port") {
            return Err(SettingsError::line(
                path,
                header_no,
                EXPECTED_HEADER,
                header,
                "the first line is the CSV header (the original read it as column names, so a missing header would silently drop the metadata line)",
            ));
        }
        let mut endpoints: Vec<(usize, Endpoint)> = Vec::new();
        let mut seen: HashMap<Endpoint, usize> = HashMap::new();
        for (line_no, line) in lines {
            let ep = parse_data_line(line)
                .map_err(|r| SettingsError::line(path, line_no, EXPECTED_DATA, line, r))?;
            if let Some(first) = seen.insert(ep.clone(), line_no) {
                return Err(SettingsError::line(
                    path,
                    line_no,
                    "an endpoint not listed before",
                    line,
                    format!("{ep} is already listed on line {first}; every service needs its own address and port"),
                ));
            }
            endpoints.push((line_no, ep));
        }
        if endpoints.len() > MEMSERVERS_MAX + 1 {
            return Err(SettingsError::file(
                path,
                format!("more than {MEMSERVERS_MAX} memory servers"),
            ));
        }
        let mut it = endpoints.into_iter().map(|(_, ep)| ep);
        let Some(metadata) = it.next() else {
            return Err(SettingsError::file(
                path,
                "no endpoints after the header; expected the metadata endpoint, then one line per memory server",
            ));
        };
        let memservers: Vec<Endpoint> = it.collect();
        if memservers.is_empty() {
            return Err(SettingsError::file(
                path,
                format!("only the metadata endpoint {metadata} is listed; the lines after the first data line are the memory servers, and there must be at least one"),
            ));
        }
        Ok(StorageList {
            path: path.to_path_buf(),
            metadata,
            memservers,
        })
    }
}

/// `<address>, <port>`; a line without a comma is split on blanks so that
/// the message can say which field is wrong.
fn parse_data_line(line: &str) -> Result<Endpoint, String> {
    let fields: Vec<&str> = if line.contains(',') {
        line.split(',').map(str::trim).collect()
    } else {
        line.split_whitespace().collect()
    };
    match fields.as_slice() {
        [addr, port] => {
            let host = parse_host(addr)?;
            let port = parse_port(port)?;
            Ok(Endpoint { host, port })
        }
        [_] => Err("missing the port".into()),
        _ => Err(format!("{} fields, expected 2", fields.len())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<StorageList> {
        StorageList::parse(Path::new("settings/storage_list.txt"), text)
    }

    fn err(text: &str) -> String {
        parse(text).unwrap_err().to_string()
    }

    #[test]
    fn original_files_parse() {
        let s = parse("storage_address,        storage_port\n127.0.0.1,            7777\n127.0.0.1,            7778").unwrap();
        assert_eq!(s.metadata, Endpoint::new("127.0.0.1", 7777));
        assert_eq!(s.memservers, vec![Endpoint::new("127.0.0.1", 7778)]);
        // The evaluation fork's five-host list.
        let s = parse("storage_address,        storage_port\n172.31.42.110,            7777\n172.31.42.110,            7778\n172.31.40.205,            7778\n172.31.38.97,            7778\n172.31.43.49,            7778").unwrap();
        assert_eq!(s.metadata, Endpoint::new("172.31.42.110", 7777));
        assert_eq!(s.memservers.len(), 4);
        assert_eq!(s.memservers[3], Endpoint::new("172.31.43.49", 7778));
    }

    #[test]
    fn comments_blank_lines_ipv6_and_hostnames() {
        let s = parse(
            "// cluster A\r\n\nstorage_address ,storage_port // header\n// metadata first\n::1, 7777 // catalog\n\n[::1],7778\n\tmem-1.local ,  7779\n",
        )
        .unwrap();
        assert_eq!(s.metadata, Endpoint::new("::1", 7777));
        assert_eq!(
            s.memservers,
            vec![
                Endpoint::new("::1", 7778),
                Endpoint::new("mem-1.local", 7779)
            ]
        );
    }

    #[test]
    fn broken_lines_name_file_and_line() {
        let head = "storage_address,        storage_port\n127.0.0.1, 7777\n";
        assert_eq!(
            err(&format!("{head}127.0.0.1 7778x\n")),
            "settings/storage_list.txt:3: expected \"<address>, <port>\", found \"127.0.0.1 7778x\": port \"7778x\" is not a number in 1..=65535"
        );
        let cases = [
            ("127.0.0.1, 70000", "not a number in 1..=65535"),
            ("127.0.0.1, 0", "not a number in 1..=65535"),
            ("127.0.0.1", "missing the port"),
            ("127.0.0.1, 1, 2", "3 fields"),
            ("999.0.0.1, 7778", "not a valid IPv4"),
            (", 7778", "address is empty"),
            ("bad_host, 7778", "neither an IP address nor a hostname"),
            ("127.0.0.1, 7777", "already listed on line 2"),
        ];
        for (line, why) in cases {
            let e = err(&format!("{head}// c\n{line}\n"));
            assert!(
                e.starts_with("settings/storage_list.txt:4: expected"),
                "{line}: {e}"
            );
            assert!(e.contains(why), "{line}: {e}");
        }
    }

    #[test]
    fn header_and_counts() {
        let e = err("127.0.0.1, 7777\n127.0.0.1, 7778\n");
        assert!(
            e.starts_with("settings/storage_list.txt:1: expected the header"),
            "{e}"
        );
        assert!(err("// only comments\n").contains("no header"));
        assert!(err("storage_address, storage_port\n").contains("no endpoints"));
        assert!(err("storage_address, storage_port\n127.0.0.1, 7777\n").contains("at least one"));
    }
}
