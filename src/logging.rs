//! Logging: spdlog-rs behind the `log` facade.
//!
//! Every crate logs through `log::info!` and friends; the binary installs
//! spdlog's proxy once, writing to stderr so that stdout carries only results
//! (bench tables, inspect output) and stays machine-readable.

use std::sync::Arc;

use spdlog::sink::{StdStream, StdStreamSink};
use spdlog::{Level, LevelFilter, Logger};

/// Parses a level name as given on the command line or in `DISTMIND_LOG`.
pub fn parse_level(name: &str) -> Result<log::LevelFilter, String> {
    name.parse::<log::LevelFilter>().map_err(|_| {
        format!("unknown log level {name:?}: expected off, error, warn, info, debug or trace")
    })
}

/// Installs the logger; call once, first thing in `main`.
pub fn init(level: log::LevelFilter) -> anyhow::Result<()> {
    let sink = Arc::new(
        StdStreamSink::builder()
            .std_stream(StdStream::Stderr)
            .build()?,
    );
    let logger = Arc::new(
        Logger::builder()
            .sink(sink)
            .level_filter(LevelFilter::All)
            .build()?,
    );
    // Flush warnings at once: a crash must not eat the reason.
    logger.set_flush_level_filter(LevelFilter::MoreSevereEqual(Level::Warn));
    spdlog::set_default_logger(logger);
    spdlog::init_log_crate_proxy().map_err(|e| anyhow::anyhow!("logger already installed: {e}"))?;
    log::set_max_level(level);
    Ok(())
}
