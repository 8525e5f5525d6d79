//! Emulated links by time dilation.
//!
//! This machine's loopback moves a few GB/s on cores it shares with every
//! process of the cluster; DistMind is built for GPU servers whose NIC is as
//! fast as their PCIe (100 Gbit/s next to PCIe 3, 400 Gbit/s next to
//! PCIe 5). To run real processes at those balances, the whole cluster runs
//! on a clock slowed by `K = link / loopback`:
//!
//! - every host's data path is held by a token bucket at `loopback` bytes/s
//!   (well below what loopback sustains, so the bucket, not the machine, is
//!   the bottleneck);
//! - every modelled time (the `sim` executor's layer and H2D times) and every
//!   time a user states (SLOs, durations, think times, periods, deadlines,
//!   timeouts) is multiplied by `K`; rates a user states are divided by `K`;
//! - every reported latency is divided by `K` and every rate multiplied by it.
//!
//! In emulated time a byte then crosses the network at `link` bytes/s while
//! the GPU keeps its profiled speed: the hardware's balance, on loopback.
//! Heartbeats and liveness stay on the real clock (they are about processes,
//! not the emulated hardware). The known bias: CPU work (routing, framing,
//! checksums) takes real time, so it shrinks by `K` in emulated time.
//!
//! Every process of a cluster must use the same `K`: they read the same
//! `transport.json` `emulate` section, or are given the same flags.

use std::fmt;
use std::time::Duration;

/// Largest dilation accepted: a 1 s emulated run takes `K` seconds.
pub const DILATION_MAX: f64 = 1000.0;
/// Slowest loopback rate a bucket may enforce (bytes/s): below this the
/// buckets' granularity and the processes' own overheads dominate.
pub const LOOPBACK_BYTES_PER_S_MIN: f64 = 10e6;

/// Parses a link rate: `100gbit`, `400Gbit/s`, `25gbps` (bits per second,
/// decimal), `12.5GB/s`, `800MB/s`, `1.5GiB/s`, `2GBps` (bytes per second).
/// Returns bytes per second.
pub fn parse_rate(s: &str) -> Result<f64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '_'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: f64 = num.replace('_', "").parse().map_err(|_| {
        format!("rate {s:?}: expected a number and a unit, e.g. 100gbit or 1.5GB/s")
    })?;
    let unit = unit.trim();
    let per_s = unit
        .strip_suffix("/s")
        .or_else(|| unit.strip_suffix("ps"))
        .unwrap_or(unit);
    // `bit`, or a lower-case `b` after the prefix (`Gb`, `gbps`), is bits;
    // an upper-case `B` (`GB/s`, `MiB/s`) is bytes.
    let lower = per_s.to_ascii_lowercase();
    let (prefix, rest) = lower.split_at(lower.len().min(1));
    let binary = rest.starts_with("ib");
    let bits = rest == "bit" || (rest == "b" && per_s.as_bytes().get(1) == Some(&b'b'));
    let bytes = rest == "b" || binary && rest == "ib";
    let scale = match (prefix, binary) {
        ("k", false) => 1e3,
        ("m", false) => 1e6,
        ("g", false) => 1e9,
        ("t", false) => 1e12,
        ("k", true) => 1024.0,
        ("m", true) => (1u64 << 20) as f64,
        ("g", true) => (1u64 << 30) as f64,
        _ => 0.0,
    };
    if scale == 0.0 || !(bits || bytes) || (bits && binary) {
        return Err(format!(
            "rate {s:?}: unknown unit {unit:?}; use gbit (Gbit/s), mbit, GB/s, MB/s, GiB/s or MiB/s"
        ));
    }
    let bytes_per_s = if bits {
        value * scale / 8.0
    } else {
        value * scale
    };
    if !(bytes_per_s.is_finite() && bytes_per_s > 0.0) {
        return Err(format!("rate {s:?} must be positive"));
    }
    Ok(bytes_per_s)
}

/// Formats a link rate in bytes/s as bits the way [`parse_rate`] reads it
/// back: `100gbit`, `12.5gbit`.
pub fn format_link(bytes_per_s: f64) -> String {
    let gbit = bytes_per_s * 8.0 / 1e9;
    let text = format!("{gbit:.3}");
    let text = text.trim_end_matches('0').trim_end_matches('.');
    format!("{text}gbit")
}

/// Formats a rate in bytes/s as bytes: `1.000GB/s`.
pub fn format_rate(bytes_per_s: f64) -> String {
    format!("{:.3}GB/s", bytes_per_s / 1e9)
}

/// An emulated link: the rate it stands for and the loopback rate that
/// carries it. `K = link / loopback`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EmulatedLink {
    link_bytes_per_s: f64,
    loopback_bytes_per_s: f64,
}

impl EmulatedLink {
    /// Checks both rates: loopback at least [`LOOPBACK_BYTES_PER_S_MIN`], the
    /// link at least as fast as loopback (a dilation below 1 would speed the
    /// clock up, which real processes cannot), and `K` at most [`DILATION_MAX`].
    pub fn new(link_bytes_per_s: f64, loopback_bytes_per_s: f64) -> Result<Self, String> {
        if !(loopback_bytes_per_s.is_finite() && loopback_bytes_per_s >= LOOPBACK_BYTES_PER_S_MIN) {
            return Err(format!(
                "the loopback rate {} is below {}: the emulation would measure the processes, not the link",
                format_rate(loopback_bytes_per_s),
                format_rate(LOOPBACK_BYTES_PER_S_MIN)
            ));
        }
        if !(link_bytes_per_s.is_finite() && link_bytes_per_s >= loopback_bytes_per_s) {
            return Err(format!(
                "the emulated link ({}) must be at least the loopback rate ({}) that carries it",
                format_link(link_bytes_per_s),
                format_rate(loopback_bytes_per_s)
            ));
        }
        let k = link_bytes_per_s / loopback_bytes_per_s;
        if k > DILATION_MAX {
            return Err(format!(
                "emulating {} on {} is a dilation of {k:.0}, more than {DILATION_MAX}: raise the loopback rate",
                format_link(link_bytes_per_s),
                format_rate(loopback_bytes_per_s)
            ));
        }
        Ok(EmulatedLink {
            link_bytes_per_s,
            loopback_bytes_per_s,
        })
    }

    /// Parses both rates ([`parse_rate`]) and checks them ([`EmulatedLink::new`]).
    pub fn parse(link: &str, loopback: &str) -> Result<Self, String> {
        EmulatedLink::new(parse_rate(link)?, parse_rate(loopback)?)
    }

    pub fn link_bytes_per_s(&self) -> f64 {
        self.link_bytes_per_s
    }

    /// What each host's token bucket enforces.
    pub fn loopback_bytes_per_s(&self) -> f64 {
        self.loopback_bytes_per_s
    }

    /// `K`: real seconds per emulated second.
    pub fn dilation(&self) -> f64 {
        self.link_bytes_per_s / self.loopback_bytes_per_s
    }

    /// An emulated duration in real time (x K).
    pub fn dilate(&self, emulated: Duration) -> Duration {
        emulated.mul_f64(self.dilation())
    }

    /// A real duration in emulated time (/ K).
    pub fn undilate(&self, real: Duration) -> Duration {
        real.div_f64(self.dilation())
    }

    /// For tables, CSV rows and captions:
    /// `emulated 100gbit link (K 12.50, loopback 1.000GB/s)`.
    pub fn label(&self) -> String {
        format!(
            "emulated {} link (K {:.2}, loopback {})",
            format_link(self.link_bytes_per_s),
            self.dilation(),
            format_rate(self.loopback_bytes_per_s)
        )
    }
}

impl fmt::Display for EmulatedLink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.label())
    }
}

/// `K` of an optional emulation: 1 without one.
pub fn dilation(link: Option<&EmulatedLink>) -> f64 {
    link.map_or(1.0, EmulatedLink::dilation)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_parse_in_bits_and_bytes() {
        let cases = [
            ("100gbit", 12.5e9),
            ("400Gbit/s", 50e9),
            ("25gbps", 3.125e9),
            ("800mbit", 1e8),
            ("12.5GB/s", 12.5e9),
            ("1GB/s", 1e9),
            ("800MB/s", 8e8),
            ("2GBps", 2e9),
            ("1GiB/s", (1u64 << 30) as f64),
            ("1_000MB/s", 1e9),
        ];
        for (s, v) in cases {
            let got = parse_rate(s).unwrap();
            assert!((got - v).abs() < 1e-3, "{s}: {got} != {v}");
        }
        for bad in [
            "",
            "gbit",
            "100",
            "100 furlongs",
            "-1gbit",
            "0GB/s",
            "1e400GB/s",
        ] {
            assert!(parse_rate(bad).is_err(), "{bad:?} should not parse");
        }
        assert_eq!(format_link(12.5e9), "100gbit");
        assert_eq!(format_link(50e9), "400gbit");
        assert_eq!(format_link(1.5625e9), "12.5gbit");
        assert_eq!(format_rate(1.1e9), "1.100GB/s");
        for r in [12.5e9, 50e9, 1.1e9, 7.3e8] {
            for text in [format_rate(r), format_link(r)] {
                let back = parse_rate(&text).unwrap();
                assert!((back - r).abs() / r < 1e-3, "{text}");
            }
        }
    }

    #[test]
    fn dilation_is_link_over_loopback() {
        let e = EmulatedLink::parse("100gbit", "1GB/s").unwrap();
        assert!((e.dilation() - 12.5).abs() < 1e-12);
        assert_eq!(
            e.dilate(Duration::from_millis(2)),
            Duration::from_millis(25)
        );
        assert_eq!(
            e.undilate(Duration::from_millis(25)),
            Duration::from_millis(2)
        );
        assert_eq!(
            e.label(),
            "emulated 100gbit link (K 12.50, loopback 1.000GB/s)"
        );
        assert_eq!(dilation(None), 1.0);
        assert_eq!(dilation(Some(&e)), e.dilation());
    }

    #[test]
    fn impossible_emulations_are_refused() {
        // Slower than the loopback that carries it.
        assert!(EmulatedLink::parse("1gbit", "1GB/s")
            .unwrap_err()
            .contains("at least the loopback"));
        // A loopback bucket so slow the processes dominate.
        assert!(EmulatedLink::parse("100gbit", "1MB/s")
            .unwrap_err()
            .contains("below"));
        // Runs would last K times their emulated length.
        assert!(EmulatedLink::parse("3200gbit", "100MB/s")
            .unwrap_err()
            .contains("dilation"));
    }
}
