//! A whole cluster inside this process: a controller and N memory servers on
//! 127.0.0.1 ephemeral ports, for benches. Real servers, real sockets, real
//! handshakes; only the process boundary is missing.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use distmind_common::handshake::ClusterKey;
use distmind_controller::dispatch::DispatchThread;
use distmind_controller::{Controller, ControllerClient, ControllerConfig};
use distmind_memserver::{Memserver, MemserverConfig, OneSidedConfig};
use tokio::sync::watch;

/// Name of the cluster's threads (the controller's and the memory
/// servers'), so that a bench can tell their CPU time from its own
/// ([`distmind_transport::priority::threads_cpu_time`]).
pub const THREAD_NAME: &str = "local-cluster";

pub struct LocalCluster {
    pub controller: String,
    /// The dispatcher's client port, when started with one.
    pub dispatcher: Option<String>,
    pub memservers: Vec<String>,
    pub key: ClusterKey,
    stop: watch::Sender<bool>,
    runtime: Option<tokio::runtime::Runtime>,
}

impl LocalCluster {
    /// The cluster's async runtime, to run more servers on it.
    pub fn handle(&self) -> tokio::runtime::Handle {
        self.runtime.as_ref().expect("alive").handle().clone()
    }

    /// A future that resolves when the cluster stops.
    pub fn stopped(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut rx = self.stop.subscribe();
        async move {
            let _ = rx.wait_for(|s| *s).await;
        }
    }
}

impl LocalCluster {
    /// Starts the controller and `n` memory servers of `capacity_bytes` each,
    /// and waits until all are registered and alive.
    pub fn start(n: usize, capacity_bytes: u64, key: ClusterKey) -> anyhow::Result<LocalCluster> {
        Self::start_with(n, capacity_bytes, key, None)
    }

    /// [`start`](Self::start) with the controller's dispatcher on an
    /// ephemeral client port, its tasks where `thread` says.
    pub fn start_with(
        n: usize,
        capacity_bytes: u64,
        key: ClusterKey,
        dispatch: Option<(
            distmind_controller::dispatch::DispatchConfig,
            DispatchThread,
        )>,
    ) -> anyhow::Result<LocalCluster> {
        Self::start_full(
            n,
            capacity_bytes,
            key,
            dispatch,
            &OneSidedConfig::default(),
            None,
            0,
        )
    }

    /// [`start`](Self::start) with every memory server's tcp replies held
    /// to `nic_bytes_per_s` (its own NIC, for emulated links), and the
    /// cluster's threads at nice value `nice` (0: the process's own; a bench
    /// whose GPU server computes on this host's cores gives the servers that
    /// stand for other machines the lowest priority,
    /// [`NICE_OTHER_MACHINE`](distmind_transport::priority::NICE_OTHER_MACHINE)).
    pub fn start_with_nic(
        n: usize,
        capacity_bytes: u64,
        key: ClusterKey,
        nic_bytes_per_s: Option<u64>,
        nice: i32,
    ) -> anyhow::Result<LocalCluster> {
        Self::start_full(
            n,
            capacity_bytes,
            key,
            None,
            &OneSidedConfig::default(),
            nic_bytes_per_s,
            nice,
        )
    }

    /// [`start`](Self::start) with every memory server also serving its
    /// arena over the one-sided paths `one_sided` names (e.g. a libfabric
    /// provider), next to tcp.
    pub fn start_with_one_sided(
        n: usize,
        capacity_bytes: u64,
        key: ClusterKey,
        one_sided: &OneSidedConfig,
    ) -> anyhow::Result<LocalCluster> {
        Self::start_full(n, capacity_bytes, key, None, one_sided, None, 0)
    }

    fn start_full(
        n: usize,
        capacity_bytes: u64,
        key: ClusterKey,
        dispatch: Option<(
            distmind_controller::dispatch::DispatchConfig,
            DispatchThread,
        )>,
        one_sided: &OneSidedConfig,
        nic_bytes_per_s: Option<u64>,
        nice: i32,
    ) -> anyhow::Result<LocalCluster> {
        let runtime = crate::services::runtime_named(THREAD_NAME, nice)?;
        let (stop, stop_rx) = watch::channel(false);
        let shutdown = move || {
            let mut rx = stop_rx.clone();
            async move {
                let _ = rx.wait_for(|s| *s).await;
            }
        };
        let (controller, dispatcher, memservers) = runtime.block_on(async {
            let mut config = ControllerConfig::new("127.0.0.1:0".parse()?, key.clone());
            if let Some((d, thread)) = dispatch {
                config.dispatch = Some(("127.0.0.1:0".parse().expect("literal"), d));
                config.dispatch_thread = thread;
            }
            let c = Controller::bind(config).await?;
            let controller = c.local_addr().to_string();
            let dispatcher = c.client_addr().map(|a| a.to_string());
            tokio::spawn(c.serve(shutdown()));
            let mut memservers = Vec::new();
            for _ in 0..n {
                let mut cfg =
                    MemserverConfig::new("127.0.0.1:0".parse()?, capacity_bytes, key.clone());
                cfg.controller = Some(controller.clone());
                cfg.one_sided = one_sided.clone();
                cfg.nic_bytes_per_s = nic_bytes_per_s;
                let m = Memserver::bind(cfg).await?;
                memservers.push(m.local_addr().to_string());
                tokio::spawn(m.serve(shutdown()));
            }
            anyhow::Ok((controller, dispatcher, memservers))
        })?;
        let cluster = LocalCluster {
            controller,
            dispatcher,
            memservers,
            key,
            stop,
            runtime: Some(runtime),
        };
        cluster.wait_registered(n, Duration::from_secs(30))?;
        Ok(cluster)
    }

    /// Polls the controller until `n` memory servers are alive.
    fn wait_registered(&self, n: usize, limit: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + limit;
        let mut client = ControllerClient::connect(&self.controller, &self.key, limit)
            .context("connecting to the local controller")?;
        loop {
            let alive = client.list_memservers()?.iter().filter(|m| m.alive).count();
            if alive >= n {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("only {alive} of {n} memory servers registered within {limit:?}");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for LocalCluster {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_timeout(Duration::from_secs(5));
        }
    }
}
