//! The frames of a ring edge and how reading one fails.

use std::io::{self, Read};
use std::net::TcpStream;

pub(super) const START_TAG: [u8; 4] = *b"DMRS";
pub(super) const ACK_TAG: [u8; 4] = *b"DMRA";
pub(super) const DATA_TAG: [u8; 4] = *b"DMRD";
/// Sent on both edges by a member that retires a ring it cached (evicted
/// the group): the neighbours move to the connections it dials next time.
pub(super) const BYE_TAG: [u8; 4] = *b"DMRB";
pub const RING_FRAME_HEADER_BYTES: usize = 40;

/// Identifies a group in start frames.
pub(super) fn fingerprint(ids: &[u32]) -> u64 {
    // FNV-1a over the count and the ids.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in (ids.len() as u64)
        .to_le_bytes()
        .into_iter()
        .chain(ids.iter().flat_map(|i| i.to_le_bytes()))
    {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct FrameHeader {
    pub(super) tag: [u8; 4],
    pub(super) op: u16,
    pub(super) seq: u64,
    pub(super) a: u64,
    pub(super) b: u64,
    pub(super) c: u64,
}

impl FrameHeader {
    pub(super) fn encode(&self) -> [u8; RING_FRAME_HEADER_BYTES] {
        let mut out = [0u8; RING_FRAME_HEADER_BYTES];
        out[0..4].copy_from_slice(&self.tag);
        out[4..6].copy_from_slice(&self.op.to_le_bytes());
        out[8..16].copy_from_slice(&self.seq.to_le_bytes());
        out[16..24].copy_from_slice(&self.a.to_le_bytes());
        out[24..32].copy_from_slice(&self.b.to_le_bytes());
        out[32..40].copy_from_slice(&self.c.to_le_bytes());
        out
    }

    pub(super) fn decode(b: &[u8; RING_FRAME_HEADER_BYTES]) -> Result<Self, String> {
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let reserved = u16::from_le_bytes([b[6], b[7]]);
        if reserved != 0 {
            return Err(format!("ring frame reserved field is {reserved}"));
        }
        Ok(FrameHeader {
            tag: b[0..4].try_into().expect("4 bytes"),
            op: u16::from_le_bytes([b[4], b[5]]),
            seq: u64_at(8),
            a: u64_at(16),
            b: u64_at(24),
            c: u64_at(32),
        })
    }

    /// Checks a frame against the one expected, field by field.
    pub(super) fn expect(&self, want: &FrameHeader) -> Result<(), String> {
        let name = |t: &[u8; 4]| String::from_utf8_lossy(t).into_owned();
        if self.tag != want.tag {
            return Err(format!(
                "frame tag {:?} where {:?} was due",
                name(&self.tag),
                name(&want.tag)
            ));
        }
        for (field, got, exp) in [
            ("op", u64::from(self.op), u64::from(want.op)),
            ("seq", self.seq, want.seq),
        ] {
            if got != exp {
                return Err(format!("field `{field}` is {got}, expected {exp}"));
            }
        }
        let fields: [&str; 3] = match self.tag {
            START_TAG => ["elements", "group fingerprint", "root"],
            DATA_TAG => ["step", "first element", "elements"],
            _ => ["a", "b", "c"],
        };
        for (field, got, exp) in [
            (fields[0], self.a, want.a),
            (fields[1], self.b, want.b),
            (fields[2], self.c, want.c),
        ] {
            if got != exp {
                return Err(format!("field `{field}` is {got}, expected {exp}"));
            }
        }
        Ok(())
    }
}

/// How a read or write on an edge failed.
pub(super) enum EdgeError {
    /// The neighbour closed the connection: a clean end of stream, or
    /// `reset` (reset, aborted, broken pipe: it closed with our bytes unread).
    Closed {
        reset: bool,
        detail: String,
    },
    TimedOut,
    Io(io::Error),
    Protocol(String),
}

impl From<io::Error> for EdgeError {
    fn from(e: io::Error) -> Self {
        match e.kind() {
            io::ErrorKind::UnexpectedEof => EdgeError::Closed {
                reset: false,
                detail: "end of stream".into(),
            },
            io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe => EdgeError::Closed {
                reset: true,
                detail: e.to_string(),
            },
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => EdgeError::TimedOut,
            _ => EdgeError::Io(e),
        }
    }
}

pub(super) fn read_header(s: &mut TcpStream) -> Result<FrameHeader, EdgeError> {
    let mut b = [0u8; RING_FRAME_HEADER_BYTES];
    s.read_exact(&mut b)?;
    FrameHeader::decode(&b).map_err(EdgeError::Protocol)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dist::allreduce::Op;

    #[test]
    fn ring_frames_round_trip_and_name_the_wrong_field() {
        let h = FrameHeader {
            tag: DATA_TAG,
            op: Op::AllReduceMean as u16,
            seq: 3,
            a: 1,
            b: 1000,
            c: 77,
        };
        assert_eq!(FrameHeader::decode(&h.encode()).unwrap(), h);
        h.expect(&h).unwrap();
        let e = h.expect(&FrameHeader { c: 78, ..h }).unwrap_err();
        assert!(e.contains("`elements`"), "{e}");
        let e = h.expect(&FrameHeader { seq: 4, ..h }).unwrap_err();
        assert!(e.contains("`seq`"), "{e}");
        let e = h
            .expect(&FrameHeader {
                tag: START_TAG,
                ..h
            })
            .unwrap_err();
        assert!(e.contains("DMRS"), "{e}");
        let s = FrameHeader {
            tag: START_TAG,
            ..h
        };
        let e = s.expect(&FrameHeader { a: 5, ..s }).unwrap_err();
        assert!(e.contains("`elements`"), "{e}");
        let mut b = h.encode();
        b[7] = 1;
        assert!(FrameHeader::decode(&b).is_err());
        assert_ne!(fingerprint(&[1, 2, 3]), fingerprint(&[1, 2, 4]));
        assert_ne!(fingerprint(&[1, 2]), fingerprint(&[1, 2, 0]));
    }
}
