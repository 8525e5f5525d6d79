//! `preload`: the baselines of the evaluation (MPS, Ray Serve) hold the
//! whole model set in every GPU server's host memory. Every
//! [`PRELOAD_INTERVAL`] this asks the catalog for its models and fetches
//! each one the host cache lacks, one at a time, on a blocking thread.
//! A model that fails (the cache is full, a memory server is down) is
//! logged once and retried at the next round; serving goes on meanwhile.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Instant;

use log::{info, warn};
use tokio::sync::watch;

use super::worker::prefetch_host;
use super::{Core, PRELOAD_INTERVAL};
use distmind_common::proto::RuntimeReply;

pub(super) async fn run(core: Arc<Core>, mut stop: watch::Receiver<bool>) {
    let mut warned: HashSet<String> = HashSet::new();
    let mut announced = 0usize;
    loop {
        let c = core.clone();
        let stop_now = stop.clone();
        let round = tokio::task::spawn_blocking(move || preload_once(&c, &stop_now)).await;
        match round {
            Ok(Ok((loaded, failed))) => {
                for (model, why) in failed {
                    if warned.insert(model.clone()) {
                        warn!("preload: cannot cache {model} in host memory: {why}; retrying every {PRELOAD_INTERVAL:?}");
                    }
                }
                if loaded > announced {
                    info!("preload: {loaded} models in host memory");
                    announced = loaded;
                }
            }
            Ok(Err(why)) => {
                if warned.insert(String::new()) {
                    warn!("preload: cannot list the catalog: {why}; retrying every {PRELOAD_INTERVAL:?}");
                }
            }
            Err(e) => warn!("preload: the round panicked: {e}"),
        }
        tokio::select! {
            _ = tokio::time::sleep(PRELOAD_INTERVAL) => {}
            _ = stop.changed() => return,
        }
        if *stop.borrow() {
            return;
        }
    }
}

/// One round: returns how many catalog models are complete in the host
/// cache afterwards, and the ones that failed with why.
fn preload_once(
    core: &Core,
    stop: &watch::Receiver<bool>,
) -> Result<(usize, Vec<(String, String)>), String> {
    let names = core.catalog.list().map_err(|e| e.to_string())?;
    let mut failed = Vec::new();
    let mut loaded = 0;
    for name in names {
        if *stop.borrow() {
            break;
        }
        if core.cache.contains(&name) {
            loaded += 1;
            continue;
        }
        match prefetch_host(core, 0, &name, Instant::now()).reply {
            RuntimeReply::Prefetched { .. } => loaded += 1,
            RuntimeReply::Error { error, .. } => failed.push((name, error.message)),
            other => failed.push((name, format!("unexpected reply {other:?}"))),
        }
    }
    Ok((loaded, failed))
}
