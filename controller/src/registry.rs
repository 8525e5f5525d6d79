//! Memory servers known to the controller: where they are, how big, whether
//! they are alive.
//!
//! Every method that needs the time takes `now`, so the expiry rules are
//! tested on a made-up clock. A server is dead once it has missed
//! [`MISSED_HEARTBEATS_DEAD`] heartbeat intervals; a heartbeat brings it back.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use distmind_common::limits::NAME_BYTES_MAX;
use distmind_common::proto::{ErrorCode, ErrorReply, MemserverInfo};

/// Most memory servers the registry holds (dead ones included).
pub const MEMSERVERS_MAX: usize = 4096;

/// A server that has not sent a heartbeat for this many intervals is dead.
pub const MISSED_HEARTBEATS_DEAD: u32 = 3;

/// Default heartbeat interval, told to every memory server when it registers.
pub const HEARTBEAT_INTERVAL_DEFAULT: Duration = Duration::from_millis(1000);

#[derive(Debug, Clone)]
struct Memserver {
    addr: String,
    capacity_bytes: u64,
    used_bytes: u64,
    boot_id: u64,
    last_heartbeat: Instant,
    /// Liveness as of the last [`Registry::expire`] or heartbeat; only used to
    /// notice transitions. Readers use [`Registry::is_alive`].
    alive: bool,
}

/// What a registration found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Registration {
    /// A new address: a fresh id.
    New { id: u32 },
    /// The same address and boot id registering again (e.g. after a
    /// controller connection dropped): nothing was lost.
    Again { id: u32 },
    /// The same address with a different boot id: the server restarted and
    /// every slice it held is gone.
    Restarted { id: u32, old_boot_id: u64 },
}

impl Registration {
    pub fn id(&self) -> u32 {
        match *self {
            Registration::New { id }
            | Registration::Again { id }
            | Registration::Restarted { id, .. } => id,
        }
    }
}

/// The memory-server registry.
#[derive(Debug)]
pub struct Registry {
    servers: BTreeMap<u32, Memserver>,
    by_addr: HashMap<String, u32>,
    next_id: u32,
    heartbeat_interval: Duration,
}

impl Registry {
    pub fn new(heartbeat_interval: Duration) -> Self {
        assert!(
            !heartbeat_interval.is_zero(),
            "heartbeat interval must be positive"
        );
        Registry {
            servers: BTreeMap::new(),
            by_addr: HashMap::new(),
            next_id: 0,
            heartbeat_interval,
        }
    }

    pub fn heartbeat_interval(&self) -> Duration {
        self.heartbeat_interval
    }

    /// How long a server may stay silent before it is dead.
    pub fn dead_after(&self) -> Duration {
        self.heartbeat_interval * MISSED_HEARTBEATS_DEAD
    }

    pub fn len(&self) -> usize {
        self.servers.len()
    }

    pub fn is_empty(&self) -> bool {
        self.servers.is_empty()
    }

    /// The address a server registered with, if `id` is known.
    pub fn addr(&self, id: u32) -> Option<&str> {
        self.servers.get(&id).map(|s| s.addr.as_str())
    }

    pub fn register(
        &mut self,
        addr: &str,
        capacity_bytes: u64,
        boot_id: u64,
        now: Instant,
    ) -> Result<Registration, ErrorReply> {
        if addr.is_empty() || addr.len() > NAME_BYTES_MAX {
            return Err(ErrorReply::new(
                ErrorCode::BadRequest,
                format!(
                    "memory server address must be 1..={NAME_BYTES_MAX} bytes of host:port, got {} bytes",
                    addr.len()
                ),
            ));
        }
        if let Some(&id) = self.by_addr.get(addr) {
            let s = self
                .servers
                .get_mut(&id)
                .expect("by_addr and servers agree");
            let old_boot_id = s.boot_id;
            s.capacity_bytes = capacity_bytes;
            s.last_heartbeat = now;
            s.alive = true;
            if old_boot_id == boot_id {
                return Ok(Registration::Again { id });
            }
            s.boot_id = boot_id;
            s.used_bytes = 0;
            return Ok(Registration::Restarted { id, old_boot_id });
        }
        if self.servers.len() >= MEMSERVERS_MAX {
            return Err(ErrorReply::new(
                ErrorCode::Full,
                format!("the registry already holds {MEMSERVERS_MAX} memory servers; cannot register {addr}"),
            ));
        }
        let id = self.next_id;
        self.next_id += 1;
        self.by_addr.insert(addr.to_string(), id);
        self.servers.insert(
            id,
            Memserver {
                addr: addr.to_string(),
                capacity_bytes,
                used_bytes: 0,
                boot_id,
                last_heartbeat: now,
                alive: true,
            },
        );
        Ok(Registration::New { id })
    }

    /// Records a heartbeat. Returns true when the server was dead and is now
    /// back.
    pub fn heartbeat(
        &mut self,
        id: u32,
        boot_id: u64,
        used_bytes: u64,
        now: Instant,
    ) -> Result<bool, ErrorReply> {
        let dead_after = self.dead_after();
        let Some(s) = self.servers.get_mut(&id) else {
            return Err(ErrorReply::new(
                ErrorCode::BadRequest,
                format!("heartbeat from unknown memory server id {id}: register first"),
            ));
        };
        if s.boot_id != boot_id {
            return Err(ErrorReply::new(
                ErrorCode::BadRequest,
                format!(
                    "heartbeat for memory server {id} ({}) carries boot id {boot_id:#x} but it registered with \
                     {:#x}: it restarted, register again",
                    s.addr, s.boot_id
                ),
            ));
        }
        let was_alive = s.alive && !expired(s.last_heartbeat, now, dead_after);
        s.last_heartbeat = s.last_heartbeat.max(now);
        s.used_bytes = used_bytes;
        s.alive = true;
        Ok(!was_alive)
    }

    /// Whether a server is alive at `now`. Unknown ids are not.
    pub fn is_alive(&self, id: u32, now: Instant) -> bool {
        self.servers
            .get(&id)
            .is_some_and(|s| !expired(s.last_heartbeat, now, self.dead_after()))
    }

    /// Servers alive at `now`.
    pub fn alive(&self, now: Instant) -> usize {
        let dead_after = self.dead_after();
        let live = self.servers.values();
        live.filter(|s| !expired(s.last_heartbeat, now, dead_after))
            .count()
    }

    /// Marks servers that missed too many heartbeats as dead; returns the ids
    /// (and addresses) that died since the last call.
    pub fn expire(&mut self, now: Instant) -> Vec<(u32, String)> {
        let dead_after = self.dead_after();
        let mut died = Vec::new();
        for (&id, s) in self.servers.iter_mut() {
            if s.alive && expired(s.last_heartbeat, now, dead_after) {
                s.alive = false;
                died.push((id, s.addr.clone()));
            }
        }
        died
    }

    /// Every registered server, by id.
    pub fn list(&self, now: Instant) -> Vec<MemserverInfo> {
        let dead_after = self.dead_after();
        self.servers
            .iter()
            .map(|(&id, s)| MemserverInfo {
                id,
                addr: s.addr.clone(),
                capacity_bytes: s.capacity_bytes,
                used_bytes: s.used_bytes,
                alive: !expired(s.last_heartbeat, now, dead_after),
                last_heartbeat_ms_ago: u64::try_from(
                    now.saturating_duration_since(s.last_heartbeat).as_millis(),
                )
                .unwrap_or(u64::MAX),
            })
            .collect()
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
    fn same_address_keeps_its_id_and_new_boot_id_is_a_restart() {
        let t0 = Instant::now();
        let mut r = Registry::new(100 * MS);
        assert_eq!(
            r.register("a:1", 100, 7, t0).unwrap(),
            Registration::New { id: 0 }
        );
        assert_eq!(
            r.register("b:1", 100, 8, t0).unwrap(),
            Registration::New { id: 1 }
        );
        r.heartbeat(0, 7, 40, t0).unwrap();
        assert_eq!(
            r.register("a:1", 200, 7, t0).unwrap(),
            Registration::Again { id: 0 }
        );
        assert_eq!(r.list(t0)[0].used_bytes, 40);
        assert_eq!(
            r.register("a:1", 200, 9, t0).unwrap(),
            Registration::Restarted {
                id: 0,
                old_boot_id: 7
            }
        );
        let a = &r.list(t0)[0];
        assert_eq!((a.capacity_bytes, a.used_bytes), (200, 0));
        // The old boot id is refused from now on.
        let e = r.heartbeat(0, 7, 0, t0).unwrap_err();
        assert_eq!(e.code, ErrorCode::BadRequest);
        assert!(e.message.contains("register again"), "{e}");
        assert!(r
            .heartbeat(5, 7, 0, t0)
            .unwrap_err()
            .message
            .contains("unknown memory server id 5"));
    }

    #[test]
    fn expires_after_three_missed_intervals_and_comes_back() {
        let t0 = Instant::now();
        let mut r = Registry::new(100 * MS);
        r.register("a:1", 100, 1, t0).unwrap();
        r.register("b:1", 100, 2, t0).unwrap();
        assert!(
            r.expire(t0 + 300 * MS).is_empty(),
            "exactly 3 intervals is still alive"
        );
        assert!(
            !r.heartbeat(1, 2, 5, t0 + 250 * MS).unwrap(),
            "was alive all along"
        );
        let died = r.expire(t0 + 301 * MS);
        assert_eq!(died, vec![(0, "a:1".to_string())]);
        assert!(
            r.expire(t0 + 400 * MS).is_empty(),
            "a death is reported once"
        );
        let l = r.list(t0 + 400 * MS);
        assert!(!l[0].alive && l[1].alive);
        assert_eq!(l[0].last_heartbeat_ms_ago, 400);
        assert_eq!(l[1].last_heartbeat_ms_ago, 150);
        assert!(!r.is_alive(0, t0 + 400 * MS) && r.is_alive(1, t0 + 400 * MS));
        assert!(r.heartbeat(0, 1, 0, t0 + 500 * MS).unwrap(), "came back");
        assert!(r.is_alive(0, t0 + 500 * MS));
        assert!(!r.is_alive(9, t0));
    }

    #[test]
    fn liveness_is_exact_between_sweeps() {
        let t0 = Instant::now();
        let mut r = Registry::new(10 * MS);
        r.register("a:1", 1, 1, t0).unwrap();
        // No expire() call: list() still tells the truth.
        assert!(!r.list(t0 + 31 * MS)[0].alive);
        // A heartbeat after the deadline but before any sweep counts as a return.
        assert!(r.heartbeat(0, 1, 0, t0 + 40 * MS).unwrap());
    }

    #[test]
    fn bad_addresses_and_a_full_registry_are_refused() {
        let t0 = Instant::now();
        let mut r = Registry::new(MS);
        assert_eq!(
            r.register("", 1, 1, t0).unwrap_err().code,
            ErrorCode::BadRequest
        );
        assert_eq!(
            r.register(&"x".repeat(NAME_BYTES_MAX + 1), 1, 1, t0)
                .unwrap_err()
                .code,
            ErrorCode::BadRequest
        );
        for i in 0..MEMSERVERS_MAX {
            r.register(&format!("h:{i}"), 1, 1, t0).unwrap();
        }
        assert_eq!(
            r.register("one-more:1", 1, 1, t0).unwrap_err().code,
            ErrorCode::Full
        );
        // A known address may still re-register.
        assert!(r.register("h:0", 1, 2, t0).is_ok());
    }
}
