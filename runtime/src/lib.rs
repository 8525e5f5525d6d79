//! The GPU server (`distmind runtime`): the fetch path from the memory
//! servers into a host cache ([`fetch`], [`cache`]), device residency and
//! executors ([`device`], [`exec`]), the pipelined request path
//! ([`pipeline`]), the server the dispatcher talks to ([`server`]), and
//! training stages ([`dist`], [`train`]). `ARCHITECTURE.md` draws its shape.
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
