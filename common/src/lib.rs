//! Types and code that more than one distmind service needs: the wire
//! protocol and its framing, the cluster-key handshake, control messages,
//! limits, checksums, the memory servers' blocking control client, the
//! parsing of the `settings/` directory and the training job spec.
#![forbid(unsafe_code)]

pub mod checksum;
pub mod emulate;
pub mod handshake;
pub mod hex;
pub mod limits;
pub mod memserver_client;
pub mod metrics;
pub mod proto;
pub mod samples;
pub mod settings;
pub mod train_spec;
pub mod wire;
