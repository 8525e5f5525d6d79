//! Network endpoints named in settings files: an address (IPv4, IPv6 or
//! hostname) and a port. Hostnames are kept as written and resolved only when
//! a caller asks, so loading settings never touches DNS.

use std::fmt;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};

/// `host:port` as written in a settings file.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Endpoint {
    /// An IPv4/IPv6 literal (without brackets) or a hostname.
    pub host: String,
    pub port: u16,
}

impl Endpoint {
    pub fn new(host: impl Into<String>, port: u16) -> Self {
        Endpoint {
            host: host.into(),
            port,
        }
    }

    /// The address when `host` is an IP literal.
    pub fn ip(&self) -> Option<IpAddr> {
        self.host.parse().ok()
    }

    /// The socket address when `host` is an IP literal (no DNS).
    pub fn socket_addr(&self) -> Option<SocketAddr> {
        self.ip().map(|ip| SocketAddr::new(ip, self.port))
    }

    /// Resolves `host` (DNS for hostnames) to socket addresses.
    pub fn resolve(&self) -> std::io::Result<Vec<SocketAddr>> {
        if let Some(sa) = self.socket_addr() {
            return Ok(vec![sa]);
        }
        Ok((self.host.as_str(), self.port).to_socket_addrs()?.collect())
    }
}

impl fmt::Display for Endpoint {
    /// `host:port`, with IPv6 literals in brackets (`[::1]:7777`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

/// Checks an address field; returns it without IPv6 brackets. The error
/// text says what is wrong with it.
pub(crate) fn parse_host(s: &str) -> Result<String, String> {
    let inner = s
        .strip_prefix('[')
        .and_then(|r| r.strip_suffix(']'))
        .unwrap_or(s);
    if inner.parse::<IpAddr>().is_ok() {
        return Ok(inner.to_string());
    }
    if inner.is_empty() {
        return Err("address is empty".into());
    }
    if inner != s || inner.contains(':') {
        return Err(format!("address \"{s}\" is not a valid IPv6 address"));
    }
    if inner.len() > 253 {
        return Err(format!("hostname \"{s}\" is longer than 253 characters"));
    }
    let labels: Vec<&str> = inner.split('.').collect();
    let last = labels.last().copied().unwrap_or("");
    if !last.is_empty() && last.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!(
            "address \"{s}\" is not a valid IPv4 address (nor a hostname: its last label is numeric)"
        ));
    }
    for label in labels {
        let ok = !label.is_empty()
            && label.len() <= 63
            && label
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-')
            && !label.starts_with('-')
            && !label.ends_with('-');
        if !ok {
            return Err(format!(
                "address \"{s}\" is neither an IP address nor a hostname (labels of letters, digits and '-', 1 to 63 characters)"
            ));
        }
    }
    Ok(inner.to_string())
}

/// Parses a port field: a number in 1..=65535.
pub(crate) fn parse_port(s: &str) -> Result<u16, String> {
    match s.parse::<u32>() {
        Ok(p) if (1..=65535).contains(&p) => Ok(p as u16),
        _ => Err(format!("port \"{s}\" is not a number in 1..=65535")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts() {
        assert_eq!(parse_host("127.0.0.1").unwrap(), "127.0.0.1");
        assert_eq!(parse_host("::1").unwrap(), "::1");
        assert_eq!(parse_host("[fe80::1]").unwrap(), "fe80::1");
        assert_eq!(
            parse_host("mem-0.cluster.local").unwrap(),
            "mem-0.cluster.local"
        );
        assert!(parse_host("127.0.0.256").unwrap_err().contains("IPv4"));
        assert!(parse_host("::g").unwrap_err().contains("IPv6"));
        assert!(parse_host("a_b").is_err());
        assert!(parse_host("-a").is_err());
        assert!(parse_host("").is_err());
        assert!(parse_host("a..b").is_err());
    }

    #[test]
    fn ports() {
        assert_eq!(parse_port("7777"), Ok(7777));
        assert_eq!(parse_port("65535"), Ok(65535));
        for bad in ["0", "65536", "-1", "77x", ""] {
            assert!(parse_port(bad).unwrap_err().contains("1..=65535"), "{bad}");
        }
    }

    #[test]
    fn display_and_addrs() {
        let v4 = Endpoint::new("127.0.0.1", 7777);
        assert_eq!(v4.to_string(), "127.0.0.1:7777");
        assert_eq!(v4.socket_addr(), Some("127.0.0.1:7777".parse().unwrap()));
        let v6 = Endpoint::new("::1", 7778);
        assert_eq!(v6.to_string(), "[::1]:7778");
        assert_eq!(v6.resolve().unwrap(), vec!["[::1]:7778".parse().unwrap()]);
        assert_eq!(Endpoint::new("localhost", 1).socket_addr(), None);
    }
}
