//! Every bound of the training data plane, with the relations between them
//! checked at compile time. Units are last in names.

use std::time::Duration;

/// Hard ceiling on tensors in one stage message ([`super::MessageLimits`]
/// may only lower it).
pub const MESSAGE_TENSORS_MAX: u32 = 1024;
/// Default bound on tensors in one stage message.
pub const MESSAGE_TENSORS_DEFAULT: u32 = 64;
/// Hard ceiling on the rank of one tensor.
pub const TENSOR_DIMS_MAX: u32 = 16;
/// Default bound on the rank of one tensor.
pub const TENSOR_DIMS_DEFAULT: u32 = 8;
/// Hard ceiling on the encoded bytes of one stage message, header included.
pub const MESSAGE_BYTES_MAX: u64 = 2 << 30;
/// Default bound on the encoded bytes of one stage message.
pub const MESSAGE_BYTES_DEFAULT: u64 = 256 << 20;
/// Default bound on the elements of one tensor: as many f32 as the default
/// message holds.
pub const TENSOR_ELEMENTS_DEFAULT: u64 = MESSAGE_BYTES_DEFAULT / 4;

/// The largest opening hello or verdict (a JSON frame) on a dist connection.
pub const HELLO_FRAME_BYTES_MAX: u32 = 16 << 10;
/// Members of one all-reduce group.
pub const GROUP_MEMBERS_MAX: usize = 256;
/// Bytes of one member id written in JSON, comma included (`u32::MAX` has 10 digits).
const MEMBER_ID_JSON_BYTES_MAX: usize = 11;
/// Everything else a ring hello holds (field names, job, from, to).
const HELLO_FIXED_JSON_BYTES_MAX: usize = 256;

/// Connections a listener accepted that no link or ring has taken yet; the
/// oldest is dropped when a new one arrives on a full table.
pub const PENDING_CONNECTIONS_MAX: usize = 16;
/// Connections a listener accepted that are still open (pending or taken);
/// more are refused with [`super::Refusal::Busy`].
pub const LISTENER_CONNECTIONS_MAX: usize = 64;
/// How long a listener gives a new connection to say what it is.
pub const HELLO_TIMEOUT: Duration = distmind_common::handshake::HANDSHAKE_TIMEOUT;

/// The largest in-flight window of a stage link, messages per direction.
pub const LINK_WINDOW_MAX: u32 = 64;
/// Stage links one worker holds: to the previous and to the next stage.
pub const STAGE_LINKS_PER_WORKER: usize = 2;

/// Rings a collective keeps open (least recently used evicted first).
pub const RING_CACHE_MAX: usize = 8;
/// Elements of one ring data frame: a step's chunk goes in frames this size.
pub const RING_SEGMENT_ELEMENTS: usize = 256 << 10;
/// Encoded segments the ring's sender thread holds (being written or queued).
pub const RING_SEGMENTS_IN_FLIGHT: usize = 4;
/// Largest buffer one all-reduce or broadcast carries, elements.
pub const COLLECTIVE_ELEMENTS_MAX: u64 = 1 << 36;

const _: () = assert!(MESSAGE_TENSORS_DEFAULT <= MESSAGE_TENSORS_MAX);
const _: () = assert!(TENSOR_DIMS_DEFAULT <= TENSOR_DIMS_MAX);
const _: () = assert!(MESSAGE_BYTES_DEFAULT <= MESSAGE_BYTES_MAX);
// Every length a message states fits in a usize on the platforms we build for.
const _: () = assert!(MESSAGE_BYTES_MAX <= usize::MAX as u64);
const _: () = assert!(TENSOR_ELEMENTS_DEFAULT * 4 <= MESSAGE_BYTES_DEFAULT);
const _: () = assert!(
    GROUP_MEMBERS_MAX * MEMBER_ID_JSON_BYTES_MAX + HELLO_FIXED_JSON_BYTES_MAX
        <= HELLO_FRAME_BYTES_MAX as usize
);
const _: () = assert!(PENDING_CONNECTIONS_MAX <= LISTENER_CONNECTIONS_MAX);
// A worker's stage links, one accepted connection per cached ring and a full
// pending table fit in the listener at once.
const _: () = assert!(
    STAGE_LINKS_PER_WORKER + RING_CACHE_MAX + PENDING_CONNECTIONS_MAX <= LISTENER_CONNECTIONS_MAX
);
const _: () = assert!(RING_SEGMENTS_IN_FLIGHT >= 1);
const _: () = assert!(RING_SEGMENT_ELEMENTS > 0 && RING_SEGMENT_ELEMENTS <= u32::MAX as usize);
