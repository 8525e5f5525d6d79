//! What two peers exchange over the control connection to connect their RC
//! queue pairs and read the serving side's memory.
//!
//! The encoding is fixed-size little-endian ([`QP_INFO_WIRE_BYTES`] bytes, a
//! magic and a version first) so it can travel inside any control frame (as
//! bytes or hex); [`QpInfo::decode`] validates every field before anything
//! reaches the driver. The fields are plain public integers, so a serde
//! message in `common::proto` can mirror them and call [`QpInfo::validate`].

use super::qp::{Gid, PSN_MAX, QPN_MAX};
use super::VerbsError;

/// Size of [`QpInfo::encode`]'s output.
pub const QP_INFO_WIRE_BYTES: usize = 56;
const MAGIC: [u8; 4] = *b"DMQP";
const VERSION: u8 = 1;
/// The largest remote region a peer may advertise (1 TiB: far above any
/// memory server's arena, far below address-space overflow).
pub const REMOTE_REGION_MAX_BYTES: u64 = 1 << 40;

/// One side's queue pair and registered region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpInfo {
    /// Queue-pair number (24 bits).
    pub qpn: u32,
    /// Initial packet sequence number of its send queue (24 bits).
    pub psn: u32,
    /// Port LID (0 on RoCE).
    pub lid: u16,
    /// Port GID (all zero when unused on InfiniBand).
    pub gid: Gid,
    /// Remote key of the region the peer may read (0 and `len` 0 when none).
    pub rkey: u32,
    /// Virtual address of that region's first byte, as registered.
    pub addr: u64,
    /// Length of that region in bytes.
    pub len: u64,
}

impl QpInfo {
    /// Checks the bounds of every field; called by [`Self::decode`].
    pub fn validate(&self) -> Result<(), VerbsError> {
        let bad = |m: String| Err(VerbsError::InvalidQpInfo(m));
        if self.qpn < 2 || self.qpn > QPN_MAX {
            return bad(format!(
                "qpn {} outside 2..={QPN_MAX} (24 bits; 0 and 1 are special QPs)",
                self.qpn
            ));
        }
        if self.psn > PSN_MAX {
            return bad(format!("psn {} exceeds 24 bits", self.psn));
        }
        if self.lid == 0 && self.gid == [0; 16] {
            return bad("neither a LID nor a GID: the queue pair cannot be addressed".into());
        }
        if self.len > REMOTE_REGION_MAX_BYTES {
            return bad(format!(
                "region of {} bytes exceeds {REMOTE_REGION_MAX_BYTES}",
                self.len
            ));
        }
        if self.addr.checked_add(self.len).is_none() {
            return bad(format!(
                "region {:#x}+{} wraps the address space",
                self.addr, self.len
            ));
        }
        if self.len == 0 && (self.addr != 0 || self.rkey != 0) {
            return bad("an empty region must have addr 0 and rkey 0".into());
        }
        Ok(())
    }

    /// Whether `[addr, addr+len)` of the peer's memory lies inside the advertised region.
    pub fn covers(&self, addr: u64, len: u64) -> bool {
        addr >= self.addr
            && addr
                .checked_add(len)
                .is_some_and(|end| end <= self.addr + self.len)
    }

    pub fn encode(&self) -> [u8; QP_INFO_WIRE_BYTES] {
        let mut b = [0u8; QP_INFO_WIRE_BYTES];
        b[0..4].copy_from_slice(&MAGIC);
        b[4] = VERSION;
        b[8..12].copy_from_slice(&self.qpn.to_le_bytes());
        b[12..16].copy_from_slice(&self.psn.to_le_bytes());
        b[16..18].copy_from_slice(&self.lid.to_le_bytes());
        b[20..36].copy_from_slice(&self.gid);
        b[36..40].copy_from_slice(&self.rkey.to_le_bytes());
        b[40..48].copy_from_slice(&self.addr.to_le_bytes());
        b[48..56].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Parses and validates a peer's info.
    pub fn decode(b: &[u8]) -> Result<QpInfo, VerbsError> {
        let bad = |m: String| Err(VerbsError::InvalidQpInfo(m));
        if b.len() != QP_INFO_WIRE_BYTES {
            return bad(format!("{} bytes, expected {QP_INFO_WIRE_BYTES}", b.len()));
        }
        if b[0..4] != MAGIC {
            return bad("bad magic (not a distmind queue-pair info)".into());
        }
        if b[4] != VERSION {
            return bad(format!("version {} (this build speaks {VERSION})", b[4]));
        }
        if b[5..8] != [0; 3] || b[18..20] != [0; 2] {
            return bad("reserved bytes are not zero".into());
        }
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let info = QpInfo {
            qpn: u32_at(8),
            psn: u32_at(12),
            lid: u16::from_le_bytes([b[16], b[17]]),
            gid: b[20..36].try_into().expect("16 bytes"),
            rkey: u32_at(36),
            addr: u64_at(40),
            len: u64_at(48),
        };
        info.validate()?;
        Ok(info)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> QpInfo {
        QpInfo {
            qpn: 0x00ab_cdef,
            psn: 0x0012_3456,
            lid: 3,
            gid: [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8],
            rkey: 0xdead_beef,
            addr: 0x7f00_0000_1000,
            len: 1 << 30,
        }
    }

    #[test]
    fn round_trips() {
        let i = sample();
        let b = i.encode();
        assert_eq!(&b[0..4], b"DMQP");
        assert_eq!(QpInfo::decode(&b).unwrap(), i);
        let roce = QpInfo { lid: 0, ..i };
        assert_eq!(QpInfo::decode(&roce.encode()).unwrap(), roce);
        let no_region = QpInfo {
            rkey: 0,
            addr: 0,
            len: 0,
            ..i
        };
        assert_eq!(QpInfo::decode(&no_region.encode()).unwrap(), no_region);
    }

    #[test]
    fn out_of_bounds_fields_are_refused_on_receive() {
        let cases = [
            (QpInfo { qpn: 0, ..sample() }, "qpn"),
            (QpInfo { qpn: 1, ..sample() }, "qpn"),
            (
                QpInfo {
                    qpn: 1 << 24,
                    ..sample()
                },
                "qpn",
            ),
            (
                QpInfo {
                    psn: 1 << 24,
                    ..sample()
                },
                "psn",
            ),
            (
                QpInfo {
                    lid: 0,
                    gid: [0; 16],
                    ..sample()
                },
                "LID",
            ),
            (
                QpInfo {
                    len: REMOTE_REGION_MAX_BYTES + 1,
                    ..sample()
                },
                "exceeds",
            ),
            (
                QpInfo {
                    addr: u64::MAX - 10,
                    len: 11,
                    ..sample()
                },
                "wraps",
            ),
            (QpInfo { len: 0, ..sample() }, "empty region"),
        ];
        for (info, word) in cases {
            let e = QpInfo::decode(&info.encode()).unwrap_err();
            assert!(matches!(e, VerbsError::InvalidQpInfo(_)));
            assert!(e.to_string().contains(word), "{e} should name {word}");
        }
    }

    #[test]
    fn malformed_bytes_are_refused() {
        let b = sample().encode();
        assert!(QpInfo::decode(&b[..55])
            .unwrap_err()
            .to_string()
            .contains("55 bytes"));
        let mut long = b.to_vec();
        long.push(0);
        assert!(QpInfo::decode(&long).is_err());
        let mut m = b;
        m[0] = b'X';
        assert!(QpInfo::decode(&m)
            .unwrap_err()
            .to_string()
            .contains("magic"));
        let mut v = b;
        v[4] = 2;
        assert!(QpInfo::decode(&v)
            .unwrap_err()
            .to_string()
            .contains("version 2"));
        let mut r = b;
        r[6] = 1;
        assert!(QpInfo::decode(&r)
            .unwrap_err()
            .to_string()
            .contains("reserved"));
    }

    #[test]
    fn covers_is_exact_at_the_edges() {
        let i = QpInfo {
            addr: 1000,
            len: 100,
            ..sample()
        };
        assert!(i.covers(1000, 100));
        assert!(i.covers(1099, 1));
        assert!(!i.covers(999, 1));
        assert!(!i.covers(1000, 101));
        assert!(!i.covers(1100, 1));
        assert!(!i.covers(u64::MAX, 2));
    }
}
