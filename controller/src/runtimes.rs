//! GPU servers (runtimes) known to the controller: where they take requests,
//! how many devices they serve, whether they are alive.
//!
//! Same liveness rules as the memory-server [`Registry`](crate::registry):
//! every method that needs the time takes `now`; a runtime that missed
//! [`MISSED_HEARTBEATS_DEAD`] heartbeat intervals is dead and a heartbeat
//! brings it back; the same address with a new boot id is a restart. The
//! dispatcher reads [`RuntimeRegistry::live`] every tick.
//!
//! Losing a runtime: the dispatcher notices a closed or reset link at once;
//! a host that vanishes silently (no FIN, no reset: power, network) is
//! noticed here, once [`RuntimeRegistry::dead_after`] passed without a
//! heartbeat, within a dispatcher tick after that. That bound is the
//! longest a request in flight there can wait before it is sent again.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use distmind_common::limits::NAME_BYTES_MAX;
use distmind_common::proto::{
    ErrorCode, ErrorReply, RuntimeInfo, RuntimeSnapshot, SNAPSHOT_MODELS_MAX,
};

use crate::registry::{Registration, MISSED_HEARTBEATS_DEAD};

/// Most runtimes the registry holds (dead ones included).
pub const RUNTIMES_MAX: usize = 4096;

/// Most devices one runtime may declare.
pub const DEVICES_PER_RUNTIME_MAX: u32 = 1024;

/// What a runtime declares about itself when it registers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RuntimeShape {
    /// Device ordinals; `devices` of them (0..devices when not given).
    pub device_ids: Vec<u32>,
    pub cache_bytes: u64,
    pub device_bytes: u64,
    pub resident_models_max: u32,
}

#[derive(Debug, Clone)]
struct Runtime {
    addr: String,
    devices: u32,
    executor: String,
    queued: u64,
    boot_id: u64,
    last_heartbeat: Instant,
    /// Liveness as of the last expire or heartbeat (transitions only).
    alive: bool,
    shape: RuntimeShape,
    /// The last state it reported, if any, and how many it reported.
    snapshot: Option<RuntimeSnapshot>,
    snapshot_seq: u64,
}

/// A live runtime as the dispatcher sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct RuntimeView {
    pub id: u32,
    pub addr: String,
    pub boot_id: u64,
    pub executor: String,
    pub shape: RuntimeShape,
    pub snapshot: Option<RuntimeSnapshot>,
    /// Grows with every snapshot received: apply a snapshot once.
    pub snapshot_seq: u64,
}

/// The runtime registry.
#[derive(Debug)]
pub struct RuntimeRegistry {
    runtimes: BTreeMap<u32, Runtime>,
    by_addr: HashMap<String, u32>,
    next_id: u32,
    heartbeat_interval: Duration,
}

impl RuntimeRegistry {
    pub fn new(heartbeat_interval: Duration) -> Self {
        assert!(
            !heartbeat_interval.is_zero(),
            "heartbeat interval must be positive"
        );
        RuntimeRegistry {
            runtimes: BTreeMap::new(),
            by_addr: HashMap::new(),
            next_id: 0,
            heartbeat_interval,
        }
    }

    pub fn heartbeat_interval(&self) -> Duration {
        self.heartbeat_interval
    }

    /// How long a runtime may stay silent before it is dead.
    pub fn dead_after(&self) -> Duration {
        self.heartbeat_interval * MISSED_HEARTBEATS_DEAD
    }

    pub fn len(&self) -> usize {
        self.runtimes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.runtimes.is_empty()
    }

    pub fn addr(&self, id: u32) -> Option<&str> {
        self.runtimes.get(&id).map(|r| r.addr.as_str())
    }

    pub fn register(
        &mut self,
        addr: &str,
        devices: u32,
        executor: &str,
        boot_id: u64,
        now: Instant,
    ) -> Result<Registration, ErrorReply> {
        let bad = |m: String| Err(ErrorReply::new(ErrorCode::BadRequest, m));
        if addr.is_empty() || addr.len() > NAME_BYTES_MAX {
            return bad(format!(
                "runtime address must be 1..={NAME_BYTES_MAX} bytes of host:port, got {} bytes",
                addr.len()
            ));
        }
        if executor.is_empty() || executor.len() > NAME_BYTES_MAX {
            return bad(format!(
                "runtime {addr}: executor name must be 1..={NAME_BYTES_MAX} bytes, got {}",
                executor.len()
            ));
        }
        if devices == 0 || devices > DEVICES_PER_RUNTIME_MAX {
            return bad(format!(
                "runtime {addr}: devices must be 1..={DEVICES_PER_RUNTIME_MAX}, got {devices}"
            ));
        }
        if let Some(&id) = self.by_addr.get(addr) {
            let r = self
                .runtimes
                .get_mut(&id)
                .expect("by_addr and runtimes agree");
            let old_boot_id = r.boot_id;
            r.devices = devices;
            r.executor = executor.to_string();
            r.last_heartbeat = now;
            r.alive = true;
            r.shape = default_shape(devices);
            if old_boot_id == boot_id {
                return Ok(Registration::Again { id });
            }
            r.boot_id = boot_id;
            r.queued = 0;
            r.snapshot = None;
            return Ok(Registration::Restarted { id, old_boot_id });
        }
        if self.runtimes.len() >= RUNTIMES_MAX {
            return Err(ErrorReply::new(
                ErrorCode::Full,
                format!(
                    "the registry already holds {RUNTIMES_MAX} runtimes; cannot register {addr}"
                ),
            ));
        }
        let id = self.next_id;
        self.next_id += 1;
        self.by_addr.insert(addr.to_string(), id);
        self.runtimes.insert(
            id,
            Runtime {
                addr: addr.to_string(),
                devices,
                executor: executor.to_string(),
                queued: 0,
                boot_id,
                last_heartbeat: now,
                alive: true,
                shape: default_shape(devices),
                snapshot: None,
                snapshot_seq: 0,
            },
        );
        Ok(Registration::New { id })
    }

    /// Records what runtime `id` declared about its devices and memory
    /// (after [`register`](Self::register)). Empty `device_ids` means
    /// 0..devices; otherwise there must be exactly `devices` distinct ids.
    pub fn set_shape(&mut self, id: u32, mut shape: RuntimeShape) -> Result<(), ErrorReply> {
        let Some(r) = self.runtimes.get_mut(&id) else {
            return Err(ErrorReply::new(
                ErrorCode::BadRequest,
                format!("unknown runtime id {id}"),
            ));
        };
        if shape.device_ids.is_empty() {
            shape.device_ids = (0..r.devices).collect();
        }
        let mut ids = shape.device_ids.clone();
        ids.sort_unstable();
        ids.dedup();
        if ids.len() != shape.device_ids.len() || ids.len() != r.devices as usize {
            return Err(ErrorReply::new(
                ErrorCode::BadRequest,
                format!(
                    "runtime {id} ({}): device_ids {:?} must be {} distinct ordinals",
                    r.addr, shape.device_ids, r.devices
                ),
            ));
        }
        r.shape = shape;
        Ok(())
    }

    /// Live runtimes with what they declared and last reported.
    pub fn live(&self, now: Instant) -> Vec<RuntimeView> {
        self.live_newer(now, |_| 0)
    }

    /// [`live`](Self::live), with each snapshot only when its sequence
    /// number is above `seen(id)` (the caller's last applied one): the
    /// dispatcher polls every tick and a snapshot lists up to thousands of
    /// names.
    pub fn live_newer(&self, now: Instant, seen: impl Fn(u32) -> u64) -> Vec<RuntimeView> {
        let dead_after = self.dead_after();
        self.runtimes
            .iter()
            .filter(|(_, r)| !expired(r.last_heartbeat, now, dead_after))
            .map(|(&id, r)| RuntimeView {
                id,
                addr: r.addr.clone(),
                boot_id: r.boot_id,
                executor: r.executor.clone(),
                shape: r.shape.clone(),
                snapshot: if r.snapshot_seq > seen(id) {
                    r.snapshot.clone()
                } else {
                    None
                },
                snapshot_seq: r.snapshot_seq,
            })
            .collect()
    }

    /// Records a heartbeat. Returns true when the runtime was dead and is
    /// now back.
    pub fn heartbeat(
        &mut self,
        id: u32,
        boot_id: u64,
        queued: u64,
        snapshot: Option<RuntimeSnapshot>,
        now: Instant,
    ) -> Result<bool, ErrorReply> {
        if let Some(s) = &snapshot {
            let too_many = s.host_cached.len() > SNAPSHOT_MODELS_MAX
                || s.devices.len() > DEVICES_PER_RUNTIME_MAX as usize
                || s.devices
                    .iter()
                    .any(|d| d.resident.len() > SNAPSHOT_MODELS_MAX);
            if too_many {
                return Err(ErrorReply::new(
                    ErrorCode::BadRequest,
                    format!(
                        "heartbeat of runtime {id}: a snapshot lists at most {SNAPSHOT_MODELS_MAX} models per list \
                         and {DEVICES_PER_RUNTIME_MAX} devices"
                    ),
                ));
            }
        }
        let dead_after = self.dead_after();
        let Some(r) = self.runtimes.get_mut(&id) else {
            return Err(ErrorReply::new(
                ErrorCode::BadRequest,
                format!("heartbeat from unknown runtime id {id}: register first"),
            ));
        };
        if r.boot_id != boot_id {
            return Err(ErrorReply::new(
                ErrorCode::BadRequest,
                format!(
                    "heartbeat for runtime {id} ({}) carries boot id {boot_id:#x} but it registered with \
                     {:#x}: it restarted, register again",
                    r.addr, r.boot_id
                ),
            ));
        }
        let was_alive = r.alive && !expired(r.last_heartbeat, now, dead_after);
        r.last_heartbeat = r.last_heartbeat.max(now);
        r.queued = queued;
        r.alive = true;
        if snapshot.is_some() {
            r.snapshot = snapshot;
            r.snapshot_seq += 1;
        }
        Ok(!was_alive)
    }

    pub fn is_alive(&self, id: u32, now: Instant) -> bool {
        self.runtimes
            .get(&id)
            .is_some_and(|r| !expired(r.last_heartbeat, now, self.dead_after()))
    }

    /// Marks runtimes that missed too many heartbeats as dead; returns those
    /// that died since the last call.
    pub fn expire(&mut self, now: Instant) -> Vec<(u32, String)> {
        let dead_after = self.dead_after();
        let mut died = Vec::new();
        for (&id, r) in self.runtimes.iter_mut() {
            if r.alive && expired(r.last_heartbeat, now, dead_after) {
                r.alive = false;
                died.push((id, r.addr.clone()));
            }
        }
        died
    }

    /// Every registered runtime, by id.
    pub fn list(&self, now: Instant) -> Vec<RuntimeInfo> {
        let dead_after = self.dead_after();
        self.runtimes
            .iter()
            .map(|(&id, r)| RuntimeInfo {
                id,
                addr: r.addr.clone(),
                devices: r.devices,
                executor: r.executor.clone(),
                queued: r.queued,
                alive: !expired(r.last_heartbeat, now, dead_after),
                last_heartbeat_ms_ago: u64::try_from(
                    now.saturating_duration_since(r.last_heartbeat).as_millis(),
                )
                .unwrap_or(u64::MAX),
            })
            .collect()
    }
}

fn default_shape(devices: u32) -> RuntimeShape {
    RuntimeShape {
        device_ids: (0..devices).collect(),
        ..RuntimeShape::default()
    }
}

fn expired(last: Instant, now: Instant, dead_after: Duration) -> bool {
    now.saturating_duration_since(last) > dead_after
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn registration_restart_and_stale_boot_ids() {
        let t0 = Instant::now();
        let mut r = RuntimeRegistry::new(100 * MS);
        assert_eq!(
            r.register("g:1", 2, "cpu", 7, t0).unwrap(),
            Registration::New { id: 0 }
        );
        assert_eq!(
            r.register("g:2", 1, "sim", 8, t0).unwrap(),
            Registration::New { id: 1 }
        );
        r.heartbeat(0, 7, 5, None, t0).unwrap();
        assert_eq!(
            r.register("g:1", 2, "cpu", 7, t0).unwrap(),
            Registration::Again { id: 0 }
        );
        assert_eq!(r.list(t0)[0].queued, 5);
        assert_eq!(
            r.register("g:1", 4, "cpu", 9, t0).unwrap(),
            Registration::Restarted {
                id: 0,
                old_boot_id: 7
            }
        );
        let g = &r.list(t0)[0];
        assert_eq!((g.devices, g.queued, g.executor.as_str()), (4, 0, "cpu"));
        let e = r.heartbeat(0, 7, 0, None, t0).unwrap_err();
        assert!(e.message.contains("register again"), "{e}");
        assert!(r
            .heartbeat(5, 7, 0, None, t0)
            .unwrap_err()
            .message
            .contains("unknown runtime id 5"));
    }

    #[test]
    fn expires_after_three_missed_intervals_and_comes_back() {
        let t0 = Instant::now();
        let mut r = RuntimeRegistry::new(100 * MS);
        r.register("g:1", 1, "cpu", 1, t0).unwrap();
        r.register("g:2", 1, "cpu", 2, t0).unwrap();
        assert!(r.expire(t0 + 300 * MS).is_empty(), "3 intervals: alive");
        assert!(!r.heartbeat(1, 2, 0, None, t0 + 250 * MS).unwrap());
        assert_eq!(r.expire(t0 + 301 * MS), vec![(0, "g:1".to_string())]);
        assert!(r.expire(t0 + 400 * MS).is_empty(), "reported once");
        let l = r.list(t0 + 400 * MS);
        assert!(!l[0].alive && l[1].alive);
        assert_eq!(l[0].last_heartbeat_ms_ago, 400);
        assert!(!r.is_alive(0, t0 + 400 * MS) && r.is_alive(1, t0 + 400 * MS));
        assert!(
            r.heartbeat(0, 1, 0, None, t0 + 500 * MS).unwrap(),
            "came back"
        );
        assert!(r.is_alive(0, t0 + 500 * MS));
        // Between sweeps, liveness is still exact.
        assert!(!r.list(t0 + 900 * MS)[1].alive);
    }

    #[test]
    fn bad_registrations_are_refused() {
        let t0 = Instant::now();
        let mut r = RuntimeRegistry::new(MS);
        for (addr, devices, exec) in [
            ("", 1, "cpu"),
            ("g:1", 0, "cpu"),
            ("g:1", DEVICES_PER_RUNTIME_MAX + 1, "cpu"),
            ("g:1", 1, ""),
        ] {
            let e = r.register(addr, devices, exec, 1, t0).unwrap_err();
            assert_eq!(e.code, ErrorCode::BadRequest, "{addr} {devices} {exec}");
        }
        let long = "x".repeat(NAME_BYTES_MAX + 1);
        assert!(r.register(&long, 1, "cpu", 1, t0).is_err());
        assert!(r.is_empty());
    }
}
