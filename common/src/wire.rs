//! Framing of every distmind connection.
//!
//! A connection starts with the cluster-key handshake ([`crate::handshake`]),
//! which also says what the connection is for ([`Role`]). After it:
//!
//! * **Control** connections carry frames: an 8-byte header
//!   (`len: u32`, `kind: u16`, `reserved: u16`, little-endian) and `len`
//!   bytes of payload. `len` is checked against a bound *before* anything is
//!   allocated. Message frames hold one JSON document; write-chunk frames hold
//!   a `u64` extent offset and raw bytes (deploying parameters).
//! * **Data** connections carry fixed 32-byte [`ReadRequest`]s one way and
//!   [`ReadReply`] headers followed by the raw bytes the other way, so the
//!   reader can land bytes straight in their destination with no parsing.

use std::io::{Read, Write};

use serde::{de::DeserializeOwned, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// First bytes of every handshake and of every data-path header.
pub const MAGIC: [u8; 4] = *b"DMND";
/// Bumped on any incompatible change of this module or the handshake.
pub const PROTOCOL_VERSION: u16 = 1;

pub const FRAME_HEADER_BYTES: usize = 8;
pub const READ_REQUEST_BYTES: usize = 32;
pub const READ_REPLY_BYTES: usize = 32;

/// What a connection carries after the handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u16)]
pub enum Role {
    /// Framed JSON requests/replies (and write chunks to memory servers).
    Control = 1,
    /// One-sided reads from a memory server's arena.
    Data = 2,
    /// A memory server's sample service: JSON requests, each answered by a
    /// JSON reply and, when it carries data, one `Bytes` frame.
    Sample = 3,
}

impl Role {
    pub fn from_u16(v: u16) -> Option<Role> {
        match v {
            1 => Some(Role::Control),
            2 => Some(Role::Data),
            3 => Some(Role::Sample),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u16)]
pub enum FrameKind {
    /// One JSON document.
    Message = 1,
    /// `u64` offset of the destination within an extent's arena, then bytes.
    WriteChunk = 2,
    /// Raw bytes that the JSON message before it describes.
    Bytes = 3,
}

impl FrameKind {
    fn from_u16(v: u16) -> Option<FrameKind> {
        match v {
            1 => Some(FrameKind::Message),
            2 => Some(FrameKind::WriteChunk),
            3 => Some(FrameKind::Bytes),
            _ => None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    #[error("connection closed by peer in the middle of a frame")]
    Truncated,
    #[error("length of {len} bytes exceeds the bound of {max} bytes")]
    TooLarge { len: u64, max: u64 },
    #[error("malformed frame header: {0}")]
    Malformed(String),
    #[error("malformed JSON message: {0}")]
    Json(#[from] serde_json::Error),
    #[error("i/o error: {0}")]
    Io(#[source] std::io::Error),
}

impl From<std::io::Error> for WireError {
    fn from(e: std::io::Error) -> Self {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            WireError::Truncated
        } else {
            WireError::Io(e)
        }
    }
}

/// A frame header, checked against `max_len` before its payload is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    pub kind: FrameKind,
    pub len: u32,
}

impl FrameHeader {
    pub fn encode(&self) -> [u8; FRAME_HEADER_BYTES] {
        let mut b = [0u8; FRAME_HEADER_BYTES];
        b[0..4].copy_from_slice(&self.len.to_le_bytes());
        b[4..6].copy_from_slice(&(self.kind as u16).to_le_bytes());
        b
    }

    pub fn decode(b: &[u8; FRAME_HEADER_BYTES], max_len: u32) -> Result<Self, WireError> {
        let len = u32::from_le_bytes(b[0..4].try_into().unwrap());
        let kind_raw = u16::from_le_bytes(b[4..6].try_into().unwrap());
        let reserved = u16::from_le_bytes(b[6..8].try_into().unwrap());
        let kind = FrameKind::from_u16(kind_raw)
            .ok_or_else(|| WireError::Malformed(format!("unknown frame kind {kind_raw}")))?;
        if reserved != 0 {
            return Err(WireError::Malformed(format!(
                "reserved header field is {reserved}, expected 0"
            )));
        }
        if len > max_len {
            return Err(WireError::TooLarge {
                len: len as u64,
                max: max_len as u64,
            });
        }
        Ok(FrameHeader { kind, len })
    }
}

/// Reads one frame. `Ok(None)` is a clean end of stream between frames.
pub async fn read_frame<R: AsyncRead + Unpin>(
    r: &mut R,
    max_len: u32,
) -> Result<Option<(FrameKind, Vec<u8>)>, WireError> {
    let mut hb = [0u8; FRAME_HEADER_BYTES];
    let n = r.read(&mut hb).await?;
    if n == 0 {
        return Ok(None);
    }
    r.read_exact(&mut hb[n..]).await?;
    let h = FrameHeader::decode(&hb, max_len)?;
    let payload = read_payload(r, h.len as usize).await?;
    Ok(Some((h.kind, payload)))
}

/// Reads exactly `len` bytes into a new vector that is not zero-filled
/// first: for an input tensor the fill costs as much CPU as the kernel's
/// copy out of the socket. A stream that ends first is `UnexpectedEof`,
/// as `read_exact`'s. The caller bounds `len`.
pub async fn read_payload<R: AsyncRead + Unpin>(r: &mut R, len: usize) -> std::io::Result<Vec<u8>> {
    let mut payload = Vec::with_capacity(len);
    let mut rest = (&mut *r).take(len as u64);
    while payload.len() < len {
        if rest.read_buf(&mut payload).await? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
    }
    Ok(payload)
}

/// Blocking twin of [`read_payload`].
pub fn read_payload_sync<R: Read>(r: &mut R, len: usize) -> std::io::Result<Vec<u8>> {
    let mut payload = Vec::with_capacity(len);
    (&mut *r).take(len as u64).read_to_end(&mut payload)?;
    if payload.len() < len {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    Ok(payload)
}

pub async fn write_frame<W: AsyncWrite + Unpin>(
    w: &mut W,
    kind: FrameKind,
    parts: &[&[u8]],
) -> Result<(), WireError> {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    let len = u32::try_from(len).map_err(|_| WireError::TooLarge {
        len: len as u64,
        max: u32::MAX as u64,
    })?;
    w.write_all(&FrameHeader { kind, len }.encode()).await?;
    for p in parts {
        w.write_all(p).await?;
    }
    Ok(())
}

/// Blocking twin of [`read_frame`].
pub fn read_frame_sync<R: Read>(
    r: &mut R,
    max_len: u32,
) -> Result<Option<(FrameKind, Vec<u8>)>, WireError> {
    let mut hb = [0u8; FRAME_HEADER_BYTES];
    let n = loop {
        match r.read(&mut hb) {
            Ok(n) => break n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e.into()),
        }
    };
    if n == 0 {
        return Ok(None);
    }
    r.read_exact(&mut hb[n..])?;
    let h = FrameHeader::decode(&hb, max_len)?;
    let payload = read_payload_sync(r, h.len as usize)?;
    Ok(Some((h.kind, payload)))
}

/// Blocking twin of [`write_frame`].
pub fn write_frame_sync<W: Write>(
    w: &mut W,
    kind: FrameKind,
    parts: &[&[u8]],
) -> Result<(), WireError> {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    let len = u32::try_from(len).map_err(|_| WireError::TooLarge {
        len: len as u64,
        max: u32::MAX as u64,
    })?;
    w.write_all(&FrameHeader { kind, len }.encode())?;
    for p in parts {
        w.write_all(p)?;
    }
    Ok(())
}

/// Serialises a message into a frame payload.
pub fn encode_message<T: Serialize>(msg: &T) -> Vec<u8> {
    serde_json::to_vec(msg).expect("protocol messages always serialise")
}

pub fn decode_message<T: DeserializeOwned>(payload: &[u8]) -> Result<T, WireError> {
    Ok(serde_json::from_slice(payload)?)
}

/// Sends one JSON message frame.
pub async fn send_message<W: AsyncWrite + Unpin, T: Serialize>(
    w: &mut W,
    msg: &T,
) -> Result<(), WireError> {
    write_frame(w, FrameKind::Message, &[&encode_message(msg)]).await
}

/// Blocking twin of [`send_message`].
pub fn send_message_sync<W: Write, T: Serialize>(w: &mut W, msg: &T) -> Result<(), WireError> {
    write_frame_sync(w, FrameKind::Message, &[&encode_message(msg)])
}

/// Receives one JSON message frame (a write chunk here is a protocol error).
pub fn recv_message_sync<R: Read, T: DeserializeOwned>(
    r: &mut R,
    max_len: u32,
) -> Result<T, WireError> {
    match read_frame_sync(r, max_len)? {
        None => Err(WireError::Truncated),
        Some((FrameKind::Message, p)) => decode_message(&p),
        Some((kind, _)) => Err(WireError::Malformed(format!(
            "expected a message frame, got {kind:?}"
        ))),
    }
}

/// Async twin of [`recv_message_sync`].
pub async fn recv_message<R: AsyncRead + Unpin, T: DeserializeOwned>(
    r: &mut R,
    max_len: u32,
) -> Result<T, WireError> {
    match read_frame(r, max_len).await? {
        None => Err(WireError::Truncated),
        Some((FrameKind::Message, p)) => decode_message(&p),
        Some((kind, _)) => Err(WireError::Malformed(format!(
            "expected a message frame, got {kind:?}"
        ))),
    }
}

/// A one-sided read of `len` bytes at `offset` of a memory server's arena.
/// `wr_id` is the reader's tag, echoed in the reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadRequest {
    pub wr_id: u64,
    pub offset: u64,
    pub len: u64,
}

const READ_REQUEST_TAG: [u8; 4] = *b"RDRQ";
const READ_REPLY_TAG: [u8; 4] = *b"RDRP";

impl ReadRequest {
    pub fn encode(&self) -> [u8; READ_REQUEST_BYTES] {
        let mut b = [0u8; READ_REQUEST_BYTES];
        b[0..4].copy_from_slice(&READ_REQUEST_TAG);
        b[8..16].copy_from_slice(&self.wr_id.to_le_bytes());
        b[16..24].copy_from_slice(&self.offset.to_le_bytes());
        b[24..32].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Decodes and bounds a request; `max_len` is the largest read served.
    pub fn decode(b: &[u8; READ_REQUEST_BYTES], max_len: u64) -> Result<Self, WireError> {
        if b[0..4] != READ_REQUEST_TAG || b[4..8] != [0; 4] {
            return Err(WireError::Malformed(format!(
                "bad read-request tag {:02x?}",
                &b[0..8]
            )));
        }
        let req = ReadRequest {
            wr_id: u64::from_le_bytes(b[8..16].try_into().unwrap()),
            offset: u64::from_le_bytes(b[16..24].try_into().unwrap()),
            len: u64::from_le_bytes(b[24..32].try_into().unwrap()),
        };
        if req.len > max_len {
            return Err(WireError::TooLarge {
                len: req.len,
                max: max_len,
            });
        }
        Ok(req)
    }
}

/// Status of a read, sent before its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum ReadStatus {
    /// `len` bytes follow.
    Ok = 0,
    /// The range is not inside one live, committed extent; nothing follows.
    OutOfRange = 1,
    /// The request was malformed; the server closes the connection after this.
    BadRequest = 2,
    /// The server is shutting down; nothing follows.
    ShuttingDown = 3,
}

/// Header of the reply to a [`ReadRequest`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadReply {
    pub wr_id: u64,
    pub status: ReadStatus,
    pub len: u64,
}

impl ReadReply {
    pub fn encode(&self) -> [u8; READ_REPLY_BYTES] {
        let mut b = [0u8; READ_REPLY_BYTES];
        b[0..4].copy_from_slice(&READ_REPLY_TAG);
        b[4..8].copy_from_slice(&(self.status as u32).to_le_bytes());
        b[8..16].copy_from_slice(&self.wr_id.to_le_bytes());
        b[16..24].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8; READ_REPLY_BYTES], max_len: u64) -> Result<Self, WireError> {
        if b[0..4] != READ_REPLY_TAG {
            return Err(WireError::Malformed(format!(
                "bad read-reply tag {:02x?}",
                &b[0..4]
            )));
        }
        let status = match u32::from_le_bytes(b[4..8].try_into().unwrap()) {
            0 => ReadStatus::Ok,
            1 => ReadStatus::OutOfRange,
            2 => ReadStatus::BadRequest,
            3 => ReadStatus::ShuttingDown,
            s => return Err(WireError::Malformed(format!("unknown read status {s}"))),
        };
        let len = u64::from_le_bytes(b[16..24].try_into().unwrap());
        if len > max_len {
            return Err(WireError::TooLarge { len, max: max_len });
        }
        Ok(ReadReply {
            wr_id: u64::from_le_bytes(b[8..16].try_into().unwrap()),
            status,
            len,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frame_header_round_trip_and_bounds() {
        let h = FrameHeader {
            kind: FrameKind::Message,
            len: 1234,
        };
        assert_eq!(FrameHeader::decode(&h.encode(), 2000).unwrap(), h);
        assert!(matches!(
            FrameHeader::decode(&h.encode(), 1000),
            Err(WireError::TooLarge {
                len: 1234,
                max: 1000
            })
        ));
        let mut bad = h.encode();
        bad[4] = 99;
        assert!(matches!(
            FrameHeader::decode(&bad, 2000),
            Err(WireError::Malformed(_))
        ));
        let mut bad = h.encode();
        bad[7] = 1;
        assert!(matches!(
            FrameHeader::decode(&bad, 2000),
            Err(WireError::Malformed(_))
        ));
    }

    #[test]
    fn sync_frames_round_trip_and_truncation() {
        let mut buf = Vec::new();
        send_message_sync(&mut buf, &serde_json::json!({"hello": 1})).unwrap();
        write_frame_sync(
            &mut buf,
            FrameKind::WriteChunk,
            &[&7u64.to_le_bytes(), b"abc"],
        )
        .unwrap();
        let mut r = &buf[..];
        let v: serde_json::Value = recv_message_sync(&mut r, 1 << 20).unwrap();
        assert_eq!(v["hello"], 1);
        let (k, p) = read_frame_sync(&mut r, 1 << 20).unwrap().unwrap();
        assert_eq!(k, FrameKind::WriteChunk);
        assert_eq!(&p[8..], b"abc");
        assert!(read_frame_sync(&mut r, 1 << 20).unwrap().is_none());
        // Cut inside the payload and inside the header.
        for cut in [3, FRAME_HEADER_BYTES + 2] {
            let mut r = &buf[..cut];
            assert!(matches!(
                read_frame_sync(&mut r, 1 << 20),
                Err(WireError::Truncated)
            ));
        }
    }

    #[tokio::test]
    async fn async_frames_match_sync() {
        let mut buf = Vec::new();
        send_message(&mut buf, &serde_json::json!([1, 2, 3]))
            .await
            .unwrap();
        let mut sync_buf = Vec::new();
        send_message_sync(&mut sync_buf, &serde_json::json!([1, 2, 3])).unwrap();
        assert_eq!(buf, sync_buf);
        let mut r = &buf[..];
        let v: Vec<u32> = recv_message(&mut r, 100).await.unwrap();
        assert_eq!(v, vec![1, 2, 3]);
    }

    #[test]
    fn read_request_and_reply_round_trip() {
        let q = ReadRequest {
            wr_id: 9,
            offset: 1 << 40,
            len: 4096,
        };
        assert_eq!(ReadRequest::decode(&q.encode(), 1 << 20).unwrap(), q);
        assert!(matches!(
            ReadRequest::decode(&q.encode(), 100),
            Err(WireError::TooLarge { .. })
        ));
        let mut bad = q.encode();
        bad[0] = b'X';
        assert!(matches!(
            ReadRequest::decode(&bad, 1 << 20),
            Err(WireError::Malformed(_))
        ));
        let r = ReadReply {
            wr_id: 9,
            status: ReadStatus::OutOfRange,
            len: 0,
        };
        assert_eq!(ReadReply::decode(&r.encode(), 10).unwrap(), r);
    }
}
