//! Keeps the controller informed: `RegisterRuntime` once per connection
//! (with this process's boot id, device ordinals and memory budgets), then a
//! `RuntimeHeartbeat` every interval the controller asked for, carrying the
//! queued requests and a [`RuntimeSnapshot`](distmind_common::proto::RuntimeSnapshot):
//! per device its queue, resident models (most recently used first) and
//! training job, and the models complete in the host cache. If the
//! controller is down, restarts or refuses a heartbeat: reconnect and
//! register again with capped exponential backoff (requests keep being
//! served meanwhile). An outage is logged once when it starts and once when
//! it ends.

use std::sync::Arc;
use std::time::Duration;

use distmind_common::handshake;
use distmind_common::limits::CONTROL_FRAME_BYTES_MAX;
use distmind_common::proto::{ControllerReply, ControllerRequest};
use distmind_common::wire::{self, Role};
use log::{info, warn};
use tokio::net::TcpStream;
use tokio::sync::watch;

use super::Shared;

pub const BACKOFF_MIN: Duration = Duration::from_millis(50);
pub const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// Bounds on the interval the controller may ask for.
pub const HEARTBEAT_INTERVAL_MS_MIN: u64 = 10;
pub const HEARTBEAT_INTERVAL_MS_MAX: u64 = 60_000;
/// Connecting, and each request/reply, must finish in this long.
pub const CONTROLLER_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
enum SessionError {
    #[error("cannot connect: {0}")]
    Connect(std::io::Error),
    #[error("handshake failed: {0}")]
    Handshake(#[from] handshake::HandshakeError),
    #[error("{0}")]
    Wire(#[from] wire::WireError),
    #[error("the controller replied {0}")]
    Refused(String),
    #[error("no reply within {0:?}")]
    Timeout(Duration),
}

async fn request(
    s: &mut TcpStream,
    req: &ControllerRequest,
) -> Result<ControllerReply, SessionError> {
    let run = async {
        wire::send_message(s, req).await?;
        wire::recv_message(s, CONTROL_FRAME_BYTES_MAX).await
    };
    match tokio::time::timeout(CONTROLLER_TIMEOUT, run).await {
        Ok(r) => r.map_err(SessionError::from),
        Err(_) => Err(SessionError::Timeout(CONTROLLER_TIMEOUT)),
    }
}

/// Runs until `stop` turns true.
pub(crate) async fn run(
    shared: Arc<Shared>,
    controller: String,
    advertise: String,
    boot_id: u64,
    mut stop: watch::Receiver<bool>,
) {
    let mut backoff = BACKOFF_MIN;
    let mut in_outage = false;
    loop {
        let mut registered = false;
        let session = session(
            &shared,
            &controller,
            &advertise,
            boot_id,
            &mut registered,
            &mut in_outage,
        );
        let err = tokio::select! {
            _ = stop.wait_for(|&s| s) => return,
            e = session => e,
        };
        if registered {
            backoff = BACKOFF_MIN;
        }
        if !in_outage {
            warn!(
                "controller {controller}: {err}; retrying with backoff up to {BACKOFF_MAX:?} \
                 (requests keep being served meanwhile)"
            );
            in_outage = true;
        }
        tokio::select! {
            _ = stop.wait_for(|&s| s) => return,
            _ = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(BACKOFF_MAX);
    }
}

/// One connection to the controller: register, then heartbeat until an error.
async fn session(
    shared: &Shared,
    controller: &str,
    advertise: &str,
    boot_id: u64,
    registered: &mut bool,
    in_outage: &mut bool,
) -> SessionError {
    let mut s = match tokio::time::timeout(CONTROLLER_TIMEOUT, TcpStream::connect(controller)).await
    {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => return SessionError::Connect(e),
        Err(_) => return SessionError::Timeout(CONTROLLER_TIMEOUT),
    };
    let _ = s.set_nodelay(true);
    if let Err(e) = handshake::client(&mut s, &shared.key, Role::Control).await {
        return e.into();
    }
    let core = &shared.core;
    let register = ControllerRequest::RegisterRuntime {
        addr: advertise.to_owned(),
        devices: core.devices.len() as u32,
        executor: core.executor.kind().to_string(),
        boot_id,
        device_ids: core.devices.iter().map(|d| d.id).collect(),
        cache_bytes: core.cache.capacity_bytes(),
        device_bytes: core.device_bytes,
        resident_models_max: core
            .devices
            .first()
            .map_or(0, |d| d.residency.max_models())
            .try_into()
            .unwrap_or(u32::MAX),
    };
    let (runtime, interval_ms) = match request(&mut s, &register).await {
        Ok(ControllerReply::RuntimeRegistered {
            runtime,
            heartbeat_interval_ms,
        }) => (runtime, heartbeat_interval_ms),
        Ok(other) => return SessionError::Refused(format!("{other:?} to RegisterRuntime")),
        Err(e) => return e,
    };
    let interval = Duration::from_millis(
        interval_ms.clamp(HEARTBEAT_INTERVAL_MS_MIN, HEARTBEAT_INTERVAL_MS_MAX),
    );
    *registered = true;
    let again = if std::mem::take(in_outage) {
        " again"
    } else {
        ""
    };
    info!(
        "registered{again} with controller {controller} as runtime {runtime} ({advertise}, boot \
         {boot_id:016x}); heartbeat every {interval:?}"
    );
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tick.tick().await;
        let hb = ControllerRequest::RuntimeHeartbeat {
            runtime,
            boot_id,
            queued: core.queued(),
            snapshot: Some(core.snapshot()),
        };
        match request(&mut s, &hb).await {
            Ok(ControllerReply::HeartbeatOk) => {}
            Ok(other) => return SessionError::Refused(format!("{other:?} to RuntimeHeartbeat")),
            Err(e) => return e,
        }
    }
}
