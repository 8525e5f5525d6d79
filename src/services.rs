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

pub struct RuntimeArgs<'a> {
    pub settings: &'a Path,
    /// Default: 127.0.0.1:<GLOBAL_CAHCE_PORT_FOR_SERVER of config.sh>.
    pub listen: Option<SocketAddr>,
    /// Default: the GPUs of config.sh (the first WORLD_SIZE of GPU_LIST).
    pub devices: Vec<u32>,
    pub executor: std::sync::Arc<dyn distmind_runtime::exec::Executor>,
    pub cache_bytes: u64,
    /// Default: the host cache size.
    pub device_bytes: Option<u64>,
    pub controller: Option<String>,
    pub advertise: Option<String>,
    pub rate_limit_gbps: Option<f64>,
    pub max_connections: usize,
    pub queue_depth: usize,
}

/// `distmind runtime`: the GPU server's request port.
pub fn run_runtime(args: RuntimeArgs<'_>) -> anyhow::Result<()> {
    let settings = load_settings(args.settings)?;
    let listen = args.listen.unwrap_or_else(|| {
        SocketAddr::from(([127, 0, 0, 1], settings.config.cache_port_for_server))
    });
    let controller = args
        .controller
        .unwrap_or_else(|| settings.metadata_endpoint().to_string());
    let mut config = distmind_runtime::server::RuntimeConfig::new(
        listen,
        cluster_key(&settings),
        controller,
        args.executor,
    );
    config.devices = if args.devices.is_empty() {
        settings.config.gpus().to_vec()
    } else {
        args.devices
    };
    if config.devices.is_empty() {
        config.devices = vec![0];
    }
    config.cache_bytes = args.cache_bytes;
    config.device_bytes = args.device_bytes.unwrap_or(args.cache_bytes);
    if let Some(g) = args.rate_limit_gbps {
        anyhow::ensure!(
            g.is_finite() && g > 0.0,
            "--rate-limit-gbps must be a positive number of Gbit/s, got {g}"
        );
        config.rate_limit_bytes_per_s = Some((g * 1e9 / 8.0).max(1.0) as u64);
    }
    config.advertise = args.advertise;
    config.max_connections = args.max_connections;
    config.queue_depth_max = args.queue_depth;
    runtime()?.block_on(async move {
        let server = distmind_runtime::server::RuntimeServer::bind(config).await?;
        println!("runtime listening on {}", server.local_addr());
        server.serve(shutdown_signal()).await?;
        anyhow::Ok(())
    })
}
