//! Checksums of parameter bytes: every group and every slice carries one.
//!
//! xxh3-64 runs at memory speed (tens of GB/s), so verifying a group costs far
//! less than transferring it. It detects corruption, not tampering: the cluster
//! key handshake is what keeps strangers out.

/// Checksum of a byte range, as stored in manifests and the catalog.
pub fn checksum(bytes: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(bytes)
}

/// Incremental checksum over bytes that arrive in pieces (in order).
#[derive(Default, Clone)]
pub struct Checksummer(xxhash_rust::xxh3::Xxh3);

impl Checksummer {
    pub fn new() -> Self {
        Self::default()
    }
    pub fn update(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }
    pub fn finish(&self) -> u64 {
        self.0.digest()
    }
}

/// Checksums are written as 16 lowercase hex digits in JSON files, so that
/// tools which read JSON numbers as f64 cannot corrupt them.
pub fn to_hex(sum: u64) -> String {
    format!("{sum:016x}")
}

/// Parses [`to_hex`] output.
pub fn from_hex(text: &str) -> Option<u64> {
    if text.len() != 16 {
        return None;
    }
    u64::from_str_radix(text, 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn incremental_matches_one_shot() {
        let data: Vec<u8> = (0..100_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let mut c = Checksummer::new();
        for piece in data.chunks(4097) {
            c.update(piece);
        }
        assert_eq!(c.finish(), checksum(&data));
        assert_ne!(checksum(&data[1..]), checksum(&data));
    }

    #[test]
    fn hex_round_trip() {
        for v in [0u64, 1, u64::MAX, 0xdead_beef_0123_4567] {
            assert_eq!(from_hex(&to_hex(v)), Some(v));
        }
        assert_eq!(from_hex("xyz"), None);
        assert_eq!(from_hex("0123"), None);
    }
}
