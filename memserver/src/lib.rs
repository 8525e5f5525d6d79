//! Memory server: keeps model parameters in one DRAM arena and serves
//! one-sided reads of it to GPU servers.
//!
//! Code map:
//! * [`alloc`]: the extent allocator (pure; best fit, coalescing).
//! * [`extents`]: extent states (Writing -> Committed) and read leases.
//! * [`arena`]: the arena's bytes behind those leases (the crate's only `unsafe`).
//! * [`server`]: the tokio listener; `control` and `data` handle one
//!   connection each; [`register`] keeps the controller informed.
//! * [`client`]: the blocking control client (it lives in `distmind_common`,
//!   so that the controller can free extents without linking this crate).
//! * [`metrics`]: the Prometheus series, served on `metrics_listen`.
//! * [`samples`]: the sample service (datasets' samples preprocessed or run
//!   through a frozen backbone on the server's own worker pool);
//!   [`sample_client`] is its blocking client.
//! * [`onesided`]: the arena registered with libfabric / RDMA verbs (features
//!   `fabric`, `verbs`) so GPU servers read it one-sided; offered over the
//!   control connection.
//!
//! **Architecture invariant:** the data path (read requests) takes no lock
//! but the extent table's short one, allocates nothing per request and parses
//! no JSON; bytes go from the arena to the socket with `write_all`.
//! **Architecture invariant:** one connection is one task: no transfer ever
//! waits behind another client's transfer.
#![deny(unsafe_code)]

pub mod alloc;
pub mod arena;
pub use distmind_common::memserver_client as client;
mod control;
mod data;
pub mod extents;
pub mod metrics;
pub mod onesided;
pub mod register;
pub mod sample_client;
pub mod samples;
pub mod server;

pub use client::{ClientError, MemserverClient};
pub use onesided::{OneSidedConfig, OneSidedError};
pub use sample_client::SampleClient;
pub use samples::FeatureExtractor;
pub use server::{Memserver, MemserverConfig, MemserverError, StatsHandle};

/// Why a size string did not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid size {input:?}: {why} (examples: 8GiB, 512M, 64KiB, 1073741824)")]
pub struct ParseSizeError {
    pub input: String,
    pub why: &'static str,
}

/// Parses a size such as `8GiB`, `512M`, `64 KiB`, `1t` or `1073741824`.
/// Units are binary (K = 1024), with or without a trailing `iB` / `B`.
pub fn parse_size(s: &str) -> Result<u64, ParseSizeError> {
    let err = |why| ParseSizeError {
        input: s.to_owned(),
        why,
    };
    let t = s.trim();
    let digits_end = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(digits_end);
    if num.is_empty() {
        return Err(err("it does not start with a number"));
    }
    let n: u64 = num.parse().map_err(|_| err("the number is too large"))?;
    let unit = unit.trim().to_ascii_lowercase();
    let unit = unit
        .strip_suffix("ib")
        .or_else(|| unit.strip_suffix('b'))
        .unwrap_or(&unit);
    let shift = match unit {
        "" => 0,
        "k" => 10,
        "m" => 20,
        "g" => 30,
        "t" => 40,
        _ => {
            return Err(err(
                "unknown unit (use K, M, G or T, optionally followed by iB or B)",
            ))
        }
    };
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| err("the size overflows 64 bits"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_units() {
        for (s, v) in [
            ("1073741824", 1u64 << 30),
            ("8GiB", 8 << 30),
            ("512M", 512 << 20),
            ("512MB", 512 << 20),
            ("64 KiB", 64 << 10),
            ("1t", 1 << 40),
            ("2g", 2 << 30),
            ("100B", 100),
            (" 7 ", 7),
        ] {
            assert_eq!(parse_size(s), Ok(v), "{s}");
        }
        for s in [
            "",
            "GiB",
            "1.5G",
            "12X",
            "-1",
            "99999999999999999999",
            "16777216T",
        ] {
            assert!(parse_size(s).is_err(), "{s} should not parse");
        }
        let e = parse_size("12X").unwrap_err().to_string();
        assert!(e.contains("\"12X\"") && e.contains("unknown unit"), "{e}");
    }
}
