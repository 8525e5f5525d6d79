//! The GPU server side. This release holds the fetch path: reading every
//! group of a model from the memory servers that hold its slices into host
//! memory, group 0 first, with bounded bytes in flight, replica fallback, and
//! a group made visible only once its checksum matched.
#![deny(unsafe_code)]

pub mod cache;
pub mod client;
pub mod device;
pub mod dist;
pub mod exec;
pub mod fetch;
pub mod infer;
pub mod loader;
pub mod ndpipe;
pub mod npy;
pub mod pipeline;
pub mod profile;
pub mod server;
pub mod train;
pub mod transports;
pub use fetch::{fetch_model, Destination, FetchError, FetchOptions, FetchReport, Peers};
