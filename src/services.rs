//! Long-running services started from the CLI: each builds its config from
//! flags and `settings/`, binds, prints one `<service> listening on <addr>`
//! line on stdout (scripts and tests wait for it instead of sleeping), and
//! serves until Ctrl-C or SIGTERM.

use std::net::SocketAddr;
use std::path::Path;

use anyhow::Context;
use distmind_common::handshake::ClusterKey;
use distmind_common::settings::Settings;

/// Resolves on Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => log::info!("interrupted: shutting down"),
        _ = term => log::info!("terminated: shutting down"),
    }
}

pub fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("distmind")
        .build()
        .context("cannot start the async runtime")
}

pub fn load_settings(dir: &Path) -> anyhow::Result<Settings> {
    Settings::load(dir).with_context(|| format!("cannot load settings from {}", dir.display()))
}

pub fn cluster_key(settings: &Settings) -> ClusterKey {
    ClusterKey::from_secret(settings.cluster_key.as_bytes())
}

pub struct MemserverArgs<'a> {
    pub settings: &'a Path,
    pub listen: SocketAddr,
    pub capacity_bytes: u64,
    pub controller: Option<String>,
    pub advertise: Option<String>,
    pub max_connections: usize,
    pub huge_pages: bool,
}

pub fn run_memserver(args: MemserverArgs<'_>) -> anyhow::Result<()> {
    let settings = load_settings(args.settings)?;
    let controller = args
        .controller
        .unwrap_or_else(|| settings.metadata_endpoint().to_string());
    let mut config = distmind_memserver::MemserverConfig::new(
        args.listen,
        args.capacity_bytes,
        cluster_key(&settings),
    );
    config.controller = Some(controller);
    config.advertise = args.advertise;
    config.max_connections = args.max_connections;
    config.huge_pages = args.huge_pages;
    runtime()?.block_on(async move {
        let server = distmind_memserver::Memserver::bind(config).await?;
        println!("memserver listening on {}", server.local_addr());
        server.serve(shutdown_signal()).await?;
        anyhow::Ok(())
    })
}

pub struct ControllerArgs<'a> {
    pub settings: &'a Path,
    pub listen: Option<SocketAddr>,
}

pub fn run_controller(args: ControllerArgs<'_>) -> anyhow::Result<()> {
    let settings = load_settings(args.settings)?;
    let listen = match args.listen {
        Some(a) => a,
        None => settings
            .metadata_endpoint()
            .socket_addr()
            .context("the metadata endpoint (first line of storage_list.txt) is not a local address to listen on; pass --listen")?,
    };
    let config = distmind_controller::ControllerConfig::new(listen, cluster_key(&settings));
    runtime()?.block_on(async move {
        let server = distmind_controller::Controller::bind(config).await?;
        println!("controller listening on {}", server.local_addr());
        server.serve(shutdown_signal()).await?;
        anyhow::Ok(())
    })
}
