//! The wire form of what crosses a stage link: one message header, then
//! tensors named by a layer reference, each with its shape and f32 data.
//!
//! ```text
//! message header (48 bytes, little-endian)
//!   0..4    tag "DMTM"
//!   4..6    format version u16 (1)
//!   6..8    kind u16: 1 activation, 2 gradient, 3 control
//!   8..16   job u64
//!   16..20  pipeline u32
//!   20..24  stage u32 (the stage that sent it)
//!   24..32  microbatch u64
//!   32..36  tensors u32
//!   36..40  reserved u32, 0
//!   40..48  body bytes u64 (everything after the header)
//! each tensor, in the body
//!   0..8    reference i64 (a producing layer id, or -1 - i for model input i)
//!   8..12   rank u32
//!   12..16  reserved u32, 0
//!   16..    rank x u64 dimensions
//!   then    product(dimensions) x f32
//! ```
//!
//! Every count and length is checked against [`MessageLimits`] before it is
//! used to size anything, so a malformed or hostile message costs at most
//! `bytes_max` bytes and is an error naming the field, never a panic. The body
//! must be consumed exactly: trailing bytes are an error too.

use super::limits::{
    MESSAGE_BYTES_DEFAULT, MESSAGE_BYTES_MAX, MESSAGE_TENSORS_DEFAULT, MESSAGE_TENSORS_MAX,
    TENSOR_DIMS_DEFAULT, TENSOR_DIMS_MAX, TENSOR_ELEMENTS_DEFAULT,
};

pub const MESSAGE_TAG: [u8; 4] = *b"DMTM";
pub const MESSAGE_FORMAT_VERSION: u16 = 1;
pub const MESSAGE_HEADER_BYTES: usize = 48;
pub const TENSOR_HEADER_BYTES: usize = 16;
const DIM_BYTES: u64 = 8;
const ELEMENT_BYTES: u64 = 4;

/// What a message carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum MessageKind {
    /// Forward: a stage's outputs for the next stage.
    Activation = 1,
    /// Backward: gradients with respect to the previous stage's outputs.
    Gradient = 2,
    /// Stage-to-stage control (flush, stop); tensors optional.
    Control = 3,
}

impl MessageKind {
    pub fn from_u16(v: u16) -> Option<Self> {
        match v {
            1 => Some(MessageKind::Activation),
            2 => Some(MessageKind::Gradient),
            3 => Some(MessageKind::Control),
            _ => None,
        }
    }
}

/// Who a message is for and which microbatch it belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MessageHeader {
    pub job: u64,
    pub pipeline: u32,
    /// The stage that sent the message.
    pub stage: u32,
    pub microbatch: u64,
    pub kind: MessageKind,
}

/// One tensor: `data.len()` is the product of `shape` (1 for rank 0).
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    /// A producing layer's id, or a negative model-input reference (-1 is
    /// input 0), as in the manifest.
    pub reference: i64,
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

impl Tensor {
    /// Elements the shape holds, or `None` on overflow.
    pub fn shape_elements(&self) -> Option<u64> {
        self.shape
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(u64::try_from(d).ok()?))
    }

    fn encoded_bytes(&self) -> u64 {
        TENSOR_HEADER_BYTES as u64
            + self.shape.len() as u64 * DIM_BYTES
            + self.data.len() as u64 * ELEMENT_BYTES
    }
}

/// One message over a stage link.
#[derive(Debug, Clone, PartialEq)]
pub struct StageMessage {
    pub header: MessageHeader,
    pub tensors: Vec<Tensor>,
}

/// What one message may hold; both ends of a link check it (the sender
/// before writing, the receiver before allocating).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MessageLimits {
    pub tensors_max: u32,
    pub dims_max: u32,
    /// Per tensor.
    pub elements_max: u64,
    /// The whole message, header included.
    pub bytes_max: u64,
}

impl Default for MessageLimits {
    fn default() -> Self {
        MessageLimits {
            tensors_max: MESSAGE_TENSORS_DEFAULT,
            dims_max: TENSOR_DIMS_DEFAULT,
            elements_max: TENSOR_ELEMENTS_DEFAULT,
            bytes_max: MESSAGE_BYTES_DEFAULT,
        }
    }
}

impl MessageLimits {
    /// Checks the limits against the hard ceilings of [`super::limits`].
    pub fn validate(&self) -> Result<(), MessageError> {
        let bad = |what: String| Err(MessageError::BadLimits(what));
        if self.tensors_max > MESSAGE_TENSORS_MAX {
            return bad(format!(
                "tensors_max {} above the ceiling {MESSAGE_TENSORS_MAX}",
                self.tensors_max
            ));
        }
        if self.dims_max > TENSOR_DIMS_MAX {
            return bad(format!(
                "dims_max {} above the ceiling {TENSOR_DIMS_MAX}",
                self.dims_max
            ));
        }
        if self.bytes_max < MESSAGE_HEADER_BYTES as u64 || self.bytes_max > MESSAGE_BYTES_MAX {
            return bad(format!(
                "bytes_max {} outside {MESSAGE_HEADER_BYTES}..={MESSAGE_BYTES_MAX}",
                self.bytes_max
            ));
        }
        Ok(())
    }
}

/// Why a message could not be encoded or decoded. The link that read it adds
/// the peer and the job/pipeline/stage.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MessageError {
    #[error("message tag is {found:02x?}, expected \"DMTM\": the peer is not speaking the stage-link protocol")]
    BadTag { found: [u8; 4] },
    #[error(
        "message format version {found}, ours is {ours}: run the same distmind on both workers"
    )]
    BadVersion { found: u16, ours: u16 },
    #[error("message kind {found} is none of activation (1), gradient (2), control (3)")]
    BadKind { found: u16 },
    #[error("reserved field `{field}` is {value}, expected 0")]
    Reserved { field: &'static str, value: u64 },
    #[error("field `tensors` is {count}, above the limit of {max} tensors per message")]
    TooManyTensors { count: u64, max: u32 },
    #[error("field `body bytes` makes the message {bytes} bytes, above the limit of {max} bytes (raise MessageLimits::bytes_max on both ends, or send fewer microbatch samples)")]
    TooLarge { bytes: u64, max: u64 },
    #[error("tensor {index} (reference {reference}): field `rank` is {rank}, above the limit of {max} dimensions")]
    TooManyDims {
        index: usize,
        reference: i64,
        rank: u32,
        max: u32,
    },
    #[error("tensor {index} (reference {reference}): field `shape` {shape:?} holds more than the limit of {max} elements")]
    TooManyElements {
        index: usize,
        reference: i64,
        shape: Vec<u64>,
        max: u64,
    },
    #[error("field `{field}` of tensor {index} needs {needed} bytes but only {left} of the stated body remain")]
    Truncated {
        field: &'static str,
        index: usize,
        needed: u64,
        left: u64,
    },
    #[error("field `body bytes` states {stated} bytes but the tensors end after {used}")]
    TrailingBytes { stated: u64, used: u64 },
    #[error("tensor {index} (reference {reference}): field `shape` {shape:?} holds {shape_elements:?} elements but `data` has {data_len}")]
    ShapeMismatch {
        index: usize,
        reference: i64,
        shape: Vec<usize>,
        shape_elements: Option<u64>,
        data_len: usize,
    },
    #[error("message of {bytes} bytes given where the header states {stated}")]
    LengthMismatch { bytes: u64, stated: u64 },
    #[error("invalid message limits: {0}")]
    BadLimits(String),
}

/// A decoded header and the sizes the body must have.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodedHeader {
    pub header: MessageHeader,
    pub tensors: u32,
    pub body_bytes: u64,
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// Writes `src` as little-endian f32 into `dst` (`dst.len() == 4 * src.len()`).
pub fn f32s_to_le(src: &[f32], dst: &mut [u8]) {
    debug_assert_eq!(dst.len(), src.len() * 4);
    for (d, v) in dst.chunks_exact_mut(4).zip(src) {
        d.copy_from_slice(&v.to_le_bytes());
    }
}

/// Reads little-endian f32 from `src` into `dst` (`src.len() == 4 * dst.len()`).
pub fn le_to_f32s(src: &[u8], dst: &mut [f32]) {
    debug_assert_eq!(src.len(), dst.len() * 4);
    for (d, s) in dst.iter_mut().zip(src.chunks_exact(4)) {
        *d = f32::from_le_bytes(s.try_into().expect("4 bytes"));
    }
}

impl MessageHeader {
    /// Decodes and bounds a header; nothing is allocated.
    pub fn decode(
        b: &[u8; MESSAGE_HEADER_BYTES],
        limits: &MessageLimits,
    ) -> Result<DecodedHeader, MessageError> {
        let tag: [u8; 4] = b[0..4].try_into().expect("4 bytes");
        if tag != MESSAGE_TAG {
            return Err(MessageError::BadTag { found: tag });
        }
        let version = u16_at(b, 4);
        if version != MESSAGE_FORMAT_VERSION {
            return Err(MessageError::BadVersion {
                found: version,
                ours: MESSAGE_FORMAT_VERSION,
            });
        }
        let kind_raw = u16_at(b, 6);
        let kind =
            MessageKind::from_u16(kind_raw).ok_or(MessageError::BadKind { found: kind_raw })?;
        let tensors = u32_at(b, 32);
        let reserved = u32_at(b, 36);
        if reserved != 0 {
            return Err(MessageError::Reserved {
                field: "header reserved",
                value: reserved.into(),
            });
        }
        if tensors > limits.tensors_max {
            return Err(MessageError::TooManyTensors {
                count: tensors.into(),
                max: limits.tensors_max,
            });
        }
        let body_bytes = u64_at(b, 40);
        let bytes = body_bytes.saturating_add(MESSAGE_HEADER_BYTES as u64);
        if bytes > limits.bytes_max {
            return Err(MessageError::TooLarge {
                bytes,
                max: limits.bytes_max,
            });
        }
        Ok(DecodedHeader {
            header: MessageHeader {
                job: u64_at(b, 8),
                pipeline: u32_at(b, 16),
                stage: u32_at(b, 20),
                microbatch: u64_at(b, 24),
                kind,
            },
            tensors,
            body_bytes,
        })
    }

    fn encode(&self, tensors: u32, body_bytes: u64) -> [u8; MESSAGE_HEADER_BYTES] {
        let mut b = [0u8; MESSAGE_HEADER_BYTES];
        b[0..4].copy_from_slice(&MESSAGE_TAG);
        b[4..6].copy_from_slice(&MESSAGE_FORMAT_VERSION.to_le_bytes());
        b[6..8].copy_from_slice(&(self.kind as u16).to_le_bytes());
        b[8..16].copy_from_slice(&self.job.to_le_bytes());
        b[16..20].copy_from_slice(&self.pipeline.to_le_bytes());
        b[20..24].copy_from_slice(&self.stage.to_le_bytes());
        b[24..32].copy_from_slice(&self.microbatch.to_le_bytes());
        b[32..36].copy_from_slice(&tensors.to_le_bytes());
        b[40..48].copy_from_slice(&body_bytes.to_le_bytes());
        b
    }
}

impl StageMessage {
    /// A message with no tensors.
    pub fn control(header: MessageHeader) -> Self {
        StageMessage {
            header,
            tensors: Vec::new(),
        }
    }

    /// Checks the message against `limits` (what the receiver would check)
    /// and returns its encoded size.
    pub fn check(&self, limits: &MessageLimits) -> Result<u64, MessageError> {
        if self.tensors.len() as u64 > u64::from(limits.tensors_max) {
            return Err(MessageError::TooManyTensors {
                count: self.tensors.len() as u64,
                max: limits.tensors_max,
            });
        }
        let mut bytes = MESSAGE_HEADER_BYTES as u64;
        for (index, t) in self.tensors.iter().enumerate() {
            if t.shape.len() as u64 > u64::from(limits.dims_max) {
                return Err(MessageError::TooManyDims {
                    index,
                    reference: t.reference,
                    rank: u32::try_from(t.shape.len()).unwrap_or(u32::MAX),
                    max: limits.dims_max,
                });
            }
            let elements = t.shape_elements();
            if elements != Some(t.data.len() as u64) {
                return Err(MessageError::ShapeMismatch {
                    index,
                    reference: t.reference,
                    shape: t.shape.clone(),
                    shape_elements: elements,
                    data_len: t.data.len(),
                });
            }
            if t.data.len() as u64 > limits.elements_max {
                return Err(MessageError::TooManyElements {
                    index,
                    reference: t.reference,
                    shape: t.shape.iter().map(|&d| d as u64).collect(),
                    max: limits.elements_max,
                });
            }
            bytes = bytes.saturating_add(t.encoded_bytes());
        }
        if bytes > limits.bytes_max {
            return Err(MessageError::TooLarge {
                bytes,
                max: limits.bytes_max,
            });
        }
        Ok(bytes)
    }

    /// Appends the encoded message to `out` (cleared first; its capacity is
    /// reused).
    pub fn encode_into(
        &self,
        out: &mut Vec<u8>,
        limits: &MessageLimits,
    ) -> Result<(), MessageError> {
        let bytes = self.check(limits)?;
        let bytes_usize = usize::try_from(bytes).expect("bounded by MESSAGE_BYTES_MAX");
        out.clear();
        out.reserve(bytes_usize);
        let tensors = u32::try_from(self.tensors.len()).expect("bounded by tensors_max");
        out.extend_from_slice(
            &self
                .header
                .encode(tensors, bytes - MESSAGE_HEADER_BYTES as u64),
        );
        for t in &self.tensors {
            out.extend_from_slice(&t.reference.to_le_bytes());
            let rank = u32::try_from(t.shape.len()).expect("bounded by dims_max");
            out.extend_from_slice(&rank.to_le_bytes());
            out.extend_from_slice(&0u32.to_le_bytes());
            for &d in &t.shape {
                out.extend_from_slice(&(d as u64).to_le_bytes());
            }
            let start = out.len();
            out.resize(start + t.data.len() * 4, 0);
            f32s_to_le(&t.data, &mut out[start..]);
        }
        debug_assert_eq!(out.len(), bytes_usize);
        Ok(())
    }

    /// Encodes into a new buffer.
    pub fn encode(&self, limits: &MessageLimits) -> Result<Vec<u8>, MessageError> {
        let mut out = Vec::new();
        self.encode_into(&mut out, limits)?;
        Ok(out)
    }

    /// Decodes one whole message (header and body, nothing more).
    pub fn decode(bytes: &[u8], limits: &MessageLimits) -> Result<Self, MessageError> {
        let Some(head) = bytes.first_chunk::<MESSAGE_HEADER_BYTES>() else {
            return Err(MessageError::LengthMismatch {
                bytes: bytes.len() as u64,
                stated: MESSAGE_HEADER_BYTES as u64,
            });
        };
        let h = MessageHeader::decode(head, limits)?;
        let body = &bytes[MESSAGE_HEADER_BYTES..];
        if body.len() as u64 != h.body_bytes {
            return Err(MessageError::LengthMismatch {
                bytes: bytes.len() as u64,
                stated: h.body_bytes + MESSAGE_HEADER_BYTES as u64,
            });
        }
        Self::decode_body(&h, body, limits)
    }

    /// Decodes the body that follows a decoded header (`body.len()` must be
    /// `h.body_bytes`, which the caller read after [`MessageHeader::decode`]
    /// bounded it).
    pub fn decode_body(
        h: &DecodedHeader,
        body: &[u8],
        limits: &MessageLimits,
    ) -> Result<Self, MessageError> {
        if body.len() as u64 != h.body_bytes {
            return Err(MessageError::LengthMismatch {
                bytes: body.len() as u64 + MESSAGE_HEADER_BYTES as u64,
                stated: h.body_bytes + MESSAGE_HEADER_BYTES as u64,
            });
        }
        // Bounded by tensors_max, itself bounded by MESSAGE_TENSORS_MAX.
        let mut tensors = Vec::with_capacity(h.tensors as usize);
        let mut at = 0usize;
        for index in 0..h.tensors as usize {
            let left = (body.len() - at) as u64;
            let need = |field, needed: u64| -> Result<(), MessageError> {
                if needed > left {
                    Err(MessageError::Truncated {
                        field,
                        index,
                        needed,
                        left,
                    })
                } else {
                    Ok(())
                }
            };
            need("tensor header", TENSOR_HEADER_BYTES as u64)?;
            let reference = i64::from_le_bytes(body[at..at + 8].try_into().expect("8 bytes"));
            let rank = u32_at(body, at + 8);
            let reserved = u32_at(body, at + 12);
            if reserved != 0 {
                return Err(MessageError::Reserved {
                    field: "tensor reserved",
                    value: reserved.into(),
                });
            }
            if rank > limits.dims_max {
                return Err(MessageError::TooManyDims {
                    index,
                    reference,
                    rank,
                    max: limits.dims_max,
                });
            }
            let dims_bytes = u64::from(rank) * DIM_BYTES;
            need("shape", TENSOR_HEADER_BYTES as u64 + dims_bytes)?;
            let dims_at = at + TENSOR_HEADER_BYTES;
            let mut shape = Vec::with_capacity(rank as usize);
            let mut elements = Some(1u64);
            for i in 0..rank as usize {
                let d = u64_at(body, dims_at + i * 8);
                elements = elements.and_then(|e| e.checked_mul(d));
                shape.push(d);
            }
            let elements = match elements {
                Some(e) if e <= limits.elements_max => e,
                _ => {
                    return Err(MessageError::TooManyElements {
                        index,
                        reference,
                        shape,
                        max: limits.elements_max,
                    })
                }
            };
            // elements <= elements_max and every length <= bytes_max, so no
            // overflow: the check against `left` comes before any allocation.
            let data_bytes = elements.saturating_mul(ELEMENT_BYTES);
            need(
                "data",
                (TENSOR_HEADER_BYTES as u64 + dims_bytes).saturating_add(data_bytes),
            )?;
            let data_at = dims_at + dims_bytes as usize;
            let mut data = vec![0f32; elements as usize];
            le_to_f32s(&body[data_at..data_at + data_bytes as usize], &mut data);
            tensors.push(Tensor {
                reference,
                shape: shape.into_iter().map(|d| d as usize).collect(),
                data,
            });
            at = data_at + data_bytes as usize;
        }
        if at != body.len() {
            return Err(MessageError::TrailingBytes {
                stated: h.body_bytes,
                used: at as u64,
            });
        }
        Ok(StageMessage {
            header: h.header,
            tensors,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    fn header(kind: MessageKind) -> MessageHeader {
        MessageHeader {
            job: 0xdead_beef_0000_0001,
            pipeline: 3,
            stage: 2,
            microbatch: 41,
            kind,
        }
    }

    /// A random message within `limits`.
    fn random_message(rng: &mut StdRng, limits: &MessageLimits) -> StageMessage {
        loop {
            let m = random_message_any(rng, limits);
            if m.check(limits).is_ok() {
                return m;
            }
        }
    }

    fn random_message_any(rng: &mut StdRng, limits: &MessageLimits) -> StageMessage {
        let kind = [
            MessageKind::Activation,
            MessageKind::Gradient,
            MessageKind::Control,
        ][rng.gen_range(0..3)];
        let n = rng.gen_range(0..=limits.tensors_max.min(6));
        let tensors = (0..n)
            .map(|_| {
                let rank = rng.gen_range(0..=limits.dims_max.min(4));
                let shape: Vec<usize> = (0..rank).map(|_| rng.gen_range(0..5)).collect();
                let elements: usize = shape.iter().product();
                Tensor {
                    reference: rng.gen_range(-3..200),
                    shape,
                    data: (0..elements)
                        .map(|_| f32::from_bits(rng.gen::<u32>()))
                        .collect(),
                }
            })
            .collect();
        StageMessage {
            header: MessageHeader {
                job: rng.gen(),
                pipeline: rng.gen(),
                stage: rng.gen(),
                microbatch: rng.gen(),
                kind,
            },
            tensors,
        }
    }

    /// Compares bit patterns, so NaN payloads count too.
    fn same_bits(a: &StageMessage, b: &StageMessage) -> bool {
        a.header == b.header
            && a.tensors.len() == b.tensors.len()
            && a.tensors.iter().zip(&b.tensors).all(|(x, y)| {
                x.reference == y.reference
                    && x.shape == y.shape
                    && x.data.len() == y.data.len()
                    && x.data
                        .iter()
                        .zip(&y.data)
                        .all(|(p, q)| p.to_bits() == q.to_bits())
            })
    }

    #[test]
    fn random_messages_round_trip_bit_exact() {
        let limits = MessageLimits::default();
        let mut rng = StdRng::seed_from_u64(7);
        let mut buf = Vec::new();
        for _ in 0..500 {
            let m = random_message(&mut rng, &limits);
            m.encode_into(&mut buf, &limits).unwrap();
            assert_eq!(buf.len() as u64, m.check(&limits).unwrap());
            let back = StageMessage::decode(&buf, &limits).unwrap();
            assert!(same_bits(&m, &back), "{m:?} != {back:?}");
        }
    }

    #[test]
    fn every_truncation_and_every_extension_is_an_error() {
        let limits = MessageLimits::default();
        let mut rng = StdRng::seed_from_u64(11);
        for _ in 0..40 {
            let m = random_message(&mut rng, &limits);
            let full = m.encode(&limits).unwrap();
            // The stated length is checked before anything else is read.
            for cut in 0..full.len() {
                assert!(matches!(
                    StageMessage::decode(&full[..cut], &limits),
                    Err(MessageError::LengthMismatch { .. })
                ));
            }
            let mut longer = full.clone();
            longer.push(0);
            assert!(matches!(
                StageMessage::decode(&longer, &limits),
                Err(MessageError::LengthMismatch { .. })
            ));
        }
    }

    #[test]
    fn random_corruption_never_panics_and_never_overallocates() {
        // Tight limits: any accepted message must respect them.
        let limits = MessageLimits {
            tensors_max: 8,
            dims_max: 4,
            elements_max: 64,
            bytes_max: 4096,
        };
        let mut rng = StdRng::seed_from_u64(13);
        for _ in 0..2000 {
            let m = random_message(&mut rng, &limits);
            let mut b = m.encode(&limits).unwrap();
            for _ in 0..rng.gen_range(1..4) {
                let i = rng.gen_range(0..b.len());
                b[i] = rng.gen();
            }
            if let Ok(back) = StageMessage::decode(&b, &limits) {
                assert!(back.tensors.len() <= 8);
                assert!(back.tensors.iter().all(|t| t.data.len() <= 64));
                assert_eq!(back.encode(&limits).unwrap(), b);
            }
        }
    }

    fn one_tensor(shape: Vec<usize>) -> StageMessage {
        let n = shape.iter().product();
        StageMessage {
            header: header(MessageKind::Activation),
            tensors: vec![Tensor {
                reference: -1,
                shape,
                data: vec![1.5; n],
            }],
        }
    }

    #[test]
    fn header_rejections_name_the_field() {
        let limits = MessageLimits::default();
        let good = one_tensor(vec![2, 3]).encode(&limits).unwrap();
        let mut head: [u8; MESSAGE_HEADER_BYTES] = good[..MESSAGE_HEADER_BYTES].try_into().unwrap();
        assert!(MessageHeader::decode(&head, &limits).is_ok());

        let mut b = head;
        b[0] = b'X';
        assert!(matches!(
            MessageHeader::decode(&b, &limits),
            Err(MessageError::BadTag { .. })
        ));
        let mut b = head;
        b[4] = 9;
        assert!(matches!(
            MessageHeader::decode(&b, &limits),
            Err(MessageError::BadVersion { found: 9, .. })
        ));
        let mut b = head;
        b[6] = 4;
        assert!(matches!(
            MessageHeader::decode(&b, &limits),
            Err(MessageError::BadKind { found: 4 })
        ));
        let mut b = head;
        b[37] = 1;
        let e = MessageHeader::decode(&b, &limits).unwrap_err();
        assert!(matches!(
            e,
            MessageError::Reserved {
                field: "header reserved",
                ..
            }
        ));
        assert!(e.to_string().contains("reserved"));
        let mut b = head;
        b[32..36].copy_from_slice(&(limits.tensors_max + 1).to_le_bytes());
        let e = MessageHeader::decode(&b, &limits).unwrap_err();
        assert!(matches!(e, MessageError::TooManyTensors { .. }));
        assert!(e.to_string().contains("`tensors`"), "{e}");
        // A body as long as the limit allows passes; one byte more does not,
        // and u64::MAX does not overflow.
        head[40..48]
            .copy_from_slice(&(limits.bytes_max - MESSAGE_HEADER_BYTES as u64).to_le_bytes());
        assert!(MessageHeader::decode(&head, &limits).is_ok());
        for body in [limits.bytes_max - MESSAGE_HEADER_BYTES as u64 + 1, u64::MAX] {
            head[40..48].copy_from_slice(&body.to_le_bytes());
            let e = MessageHeader::decode(&head, &limits).unwrap_err();
            assert!(matches!(e, MessageError::TooLarge { .. }));
            assert!(e.to_string().contains("`body bytes`"), "{e}");
        }
    }

    #[test]
    fn tensor_rejections_name_the_field() {
        let limits = MessageLimits {
            tensors_max: 4,
            dims_max: 3,
            elements_max: 100,
            bytes_max: 1 << 20,
        };
        let loose = MessageLimits {
            tensors_max: 64,
            dims_max: 8,
            elements_max: 1 << 20,
            bytes_max: 1 << 24,
        };
        // Too many dims.
        let b = one_tensor(vec![1, 1, 1, 1]).encode(&loose).unwrap();
        let e = StageMessage::decode(&b, &limits).unwrap_err();
        assert!(
            matches!(
                e,
                MessageError::TooManyDims {
                    rank: 4,
                    max: 3,
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("`rank`"));
        // Too many elements.
        let b = one_tensor(vec![11, 10]).encode(&loose).unwrap();
        let e = StageMessage::decode(&b, &limits).unwrap_err();
        assert!(matches!(e, MessageError::TooManyElements { .. }), "{e}");
        assert!(e.to_string().contains("`shape`"));
        // Dimensions whose product overflows u64.
        let mut b = one_tensor(vec![1, 1]).encode(&loose).unwrap();
        let dims = MESSAGE_HEADER_BYTES + TENSOR_HEADER_BYTES;
        b[dims..dims + 8].copy_from_slice(&u64::MAX.to_le_bytes());
        b[dims + 8..dims + 16].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(
            StageMessage::decode(&b, &loose),
            Err(MessageError::TooManyElements { .. })
        ));
        // A shape that claims more data than the body holds.
        let mut b = one_tensor(vec![2, 2]).encode(&loose).unwrap();
        b[dims..dims + 8].copy_from_slice(&3u64.to_le_bytes());
        let e = StageMessage::decode(&b, &loose).unwrap_err();
        assert!(
            matches!(e, MessageError::Truncated { field: "data", .. }),
            "{e}"
        );
        // A count of tensors the body does not hold.
        let mut b = one_tensor(vec![2]).encode(&loose).unwrap();
        b[32..36].copy_from_slice(&2u32.to_le_bytes());
        let e = StageMessage::decode(&b, &loose).unwrap_err();
        assert!(
            matches!(
                e,
                MessageError::Truncated {
                    field: "tensor header",
                    index: 1,
                    ..
                }
            ),
            "{e}"
        );
        // A rank whose dims run past the body.
        let mut b = one_tensor(vec![]).encode(&loose).unwrap();
        b[MESSAGE_HEADER_BYTES + 8..MESSAGE_HEADER_BYTES + 12].copy_from_slice(&2u32.to_le_bytes());
        assert!(matches!(
            StageMessage::decode(&b, &loose),
            Err(MessageError::Truncated { field: "shape", .. })
        ));
        // Reserved tensor field.
        let mut b = one_tensor(vec![2]).encode(&loose).unwrap();
        b[MESSAGE_HEADER_BYTES + 12] = 1;
        assert!(matches!(
            StageMessage::decode(&b, &loose),
            Err(MessageError::Reserved {
                field: "tensor reserved",
                ..
            })
        ));
        // Fewer tensors than the body holds: trailing bytes.
        let two = StageMessage {
            header: header(MessageKind::Gradient),
            tensors: vec![one_tensor(vec![1]).tensors[0].clone(); 2],
        };
        let mut b = two.encode(&loose).unwrap();
        b[32..36].copy_from_slice(&1u32.to_le_bytes());
        assert!(matches!(
            StageMessage::decode(&b, &loose),
            Err(MessageError::TrailingBytes { .. })
        ));
    }

    #[test]
    fn the_sender_checks_what_the_receiver_would() {
        let limits = MessageLimits {
            tensors_max: 2,
            dims_max: 2,
            elements_max: 10,
            bytes_max: 256,
        };
        let mut m = one_tensor(vec![2, 2]);
        m.encode(&limits).unwrap();
        m.tensors[0].data.pop();
        assert!(matches!(
            m.encode(&limits),
            Err(MessageError::ShapeMismatch { data_len: 3, .. })
        ));
        assert!(matches!(
            one_tensor(vec![1, 1, 1]).encode(&limits),
            Err(MessageError::TooManyDims { .. })
        ));
        assert!(matches!(
            one_tensor(vec![11]).encode(&limits),
            Err(MessageError::TooManyElements { .. })
        ));
        let three = StageMessage {
            header: header(MessageKind::Control),
            tensors: vec![one_tensor(vec![1]).tensors[0].clone(); 3],
        };
        assert!(matches!(
            three.encode(&limits),
            Err(MessageError::TooManyTensors { count: 3, max: 2 })
        ));
        // 48 + 2 * (16 + 8 + 40) = 176 fits in 256; a limit of 175 does not.
        let two = StageMessage {
            header: header(MessageKind::Control),
            tensors: vec![one_tensor(vec![10]).tensors[0].clone(); 2],
        };
        assert_eq!(two.check(&limits).unwrap(), 176);
        let tight = MessageLimits {
            bytes_max: 175,
            ..limits
        };
        assert!(matches!(
            two.encode(&tight),
            Err(MessageError::TooLarge {
                bytes: 176,
                max: 175
            })
        ));
        // The receiver refuses it too.
        let b = two.encode(&limits).unwrap();
        assert!(matches!(
            StageMessage::decode(&b, &tight),
            Err(MessageError::TooLarge { .. })
        ));
    }

    #[test]
    fn limits_are_validated_against_the_ceilings() {
        MessageLimits::default().validate().unwrap();
        for bad in [
            MessageLimits {
                tensors_max: MESSAGE_TENSORS_MAX + 1,
                ..Default::default()
            },
            MessageLimits {
                dims_max: TENSOR_DIMS_MAX + 1,
                ..Default::default()
            },
            MessageLimits {
                bytes_max: MESSAGE_BYTES_MAX + 1,
                ..Default::default()
            },
            MessageLimits {
                bytes_max: 10,
                ..Default::default()
            },
        ] {
            assert!(matches!(bad.validate(), Err(MessageError::BadLimits(_))));
        }
    }

    #[test]
    fn scalars_and_empty_tensors_round_trip() {
        let limits = MessageLimits::default();
        let m = StageMessage {
            header: header(MessageKind::Control),
            tensors: vec![
                Tensor {
                    reference: 5,
                    shape: vec![],
                    data: vec![2.0],
                },
                Tensor {
                    reference: -2,
                    shape: vec![0, 7],
                    data: vec![],
                },
            ],
        };
        let b = m.encode(&limits).unwrap();
        assert_eq!(StageMessage::decode(&b, &limits).unwrap(), m);
        let c = StageMessage::control(header(MessageKind::Control));
        let b = c.encode(&limits).unwrap();
        assert_eq!(b.len(), MESSAGE_HEADER_BYTES);
        assert_eq!(StageMessage::decode(&b, &limits).unwrap(), c);
    }
}
