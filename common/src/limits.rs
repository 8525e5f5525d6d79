//! Every bound in the system, in one place, with the relations between them
//! checked at compile time. Units are last in names.

/// Parameters are laid out so that each one starts at a multiple of this.
pub const PARAM_ALIGN_BYTES: u64 = 512;

/// Default parameter-group size, the original's 32,768,000 bytes.
pub const GROUP_BYTES_DEFAULT: u64 = 32_768_000;

/// Largest control frame (JSON messages, catalog entries).
pub const CONTROL_FRAME_BYTES_MAX: u32 = 16 << 20;

/// Largest single read a data connection serves; bigger reads are chunked
/// by the client.
pub const READ_CHUNK_BYTES_MAX: u64 = 64 << 20;

/// Largest payload of one write frame when deploying into a memory server.
pub const WRITE_CHUNK_BYTES_MAX: u64 = 16 << 20;

/// Names (models, hosts) on the wire and in settings.
pub const NAME_BYTES_MAX: usize = 256;

const _: () = assert!(PARAM_ALIGN_BYTES.is_power_of_two());
const _: () = assert!(GROUP_BYTES_DEFAULT.is_multiple_of(PARAM_ALIGN_BYTES));
const _: () = assert!(WRITE_CHUNK_BYTES_MAX <= CONTROL_FRAME_BYTES_MAX as u64);
const _: () = assert!(READ_CHUNK_BYTES_MAX >= WRITE_CHUNK_BYTES_MAX);
