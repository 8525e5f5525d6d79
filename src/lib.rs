//! The `distmind` binary's commands, as a library so that integration tests
//! and benches call the same code the CLI runs.
#![forbid(unsafe_code)]

pub mod bench;
pub mod cluster;
pub mod dataset;
pub mod deploy;
pub mod emulate;
pub mod loadgen;
pub mod logging;
pub mod ndpipe;
pub mod plot;
pub mod prep;
pub mod profile;
pub mod services;
pub mod simulate;
pub mod train;
pub mod up;
