//! Placement and routing policies: pure state machines, no IO, time passed
//! in as [`Micros`], so that they are tested on a virtual clock.
//!
//! * [`zipf`]: Zipf-distributed ranks (model popularity).
//! * [`cost`]: how long a request takes on a GPU, by where its model is
//!   (resident, host-cached, remote), learnt from observed replies with
//!   size-based priors.
//! * [`edf`]: one GPU's earliest-deadline-first queue and the admission
//!   test (would this request, and every one already admitted, still finish
//!   before its deadline?).
//! * [`distmind`]: the original's placement: every rescheduling period one
//!   GPU (round robin, interleaved across hosts) gets a Zipf-drawn model;
//!   `inference_workload_s` sets how many GPUs do inference each second.
//! * [`training`]: when a training GPU yields (iteration boundaries).
//!
//! The dispatcher ([`crate::dispatch`]) composes them.

pub mod cost;
pub mod distmind;
pub mod edf;
pub mod training;
pub mod zipf;

use std::fmt;
use std::str::FromStr;

/// Virtual time: microseconds since the dispatcher started.
pub type Micros = u64;

/// One GPU: a device of a runtime (GPU server). Runtimes are hosts: their
/// devices share one host cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Gpu {
    pub runtime: u32,
    pub device: u32,
}

impl fmt::Display for Gpu {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "runtime {} device {}", self.runtime, self.device)
    }
}

/// Where a model is, seen from one GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Where {
    Resident = 0,
    HostCached = 1,
    Remote = 2,
}

/// Which placement and routing the dispatcher runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PolicyKind {
    /// The original's: Zipf reassignment each period, least-outstanding
    /// routing among the GPUs assigned the model, no admission control.
    DistMind,
    /// Ours: earliest feasible finish, EDF queues, admission control,
    /// demand-driven prefetching, training on idle GPUs.
    Slo,
    /// Baseline of the evaluation: NVIDIA MPS. Every GPU serves every model
    /// (the GPU servers hold the whole model set in host memory and keep up
    /// to 12 models resident per GPU, loaded whole, no pipelining; those are
    /// runtime settings, see `distmind runtime --baseline`); routing: least
    /// outstanding among the GPUs where the model is resident, else among
    /// all. No placement, no cache-out, no training.
    Mps,
    /// Baseline of the evaluation: Ray Serve. Routing as [`PolicyKind::Mps`];
    /// its GPU servers keep one model resident and switch whole models.
    Ray,
    /// The GPU bound: one model, never switched. The first model asked for
    /// is the only one served; requests for another are refused.
    Gpu,
}

impl PolicyKind {
    /// Every policy name `FromStr` accepts.
    pub const NAMES: &'static str = "distmind, slo, mps, ray or gpu";

    /// A baseline of the evaluation (mps, ray, gpu), not a DistMind policy.
    pub fn is_baseline(&self) -> bool {
        matches!(self, PolicyKind::Mps | PolicyKind::Ray | PolicyKind::Gpu)
    }
}

impl PolicyKind {
    pub fn as_str(&self) -> &'static str {
        match self {
            PolicyKind::DistMind => "distmind",
            PolicyKind::Slo => "slo",
            PolicyKind::Mps => "mps",
            PolicyKind::Ray => "ray",
            PolicyKind::Gpu => "gpu",
        }
    }
}

impl FromStr for PolicyKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "distmind" => Ok(PolicyKind::DistMind),
            "slo" => Ok(PolicyKind::Slo),
            "mps" => Ok(PolicyKind::Mps),
            "ray" => Ok(PolicyKind::Ray),
            "gpu" => Ok(PolicyKind::Gpu),
            _ => Err(format!(
                "unknown policy {s:?}: expected {}",
                PolicyKind::NAMES
            )),
        }
    }
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The load balancer of the `distmind` policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Balancer {
    /// Least outstanding requests (< 8) among the GPUs holding the model,
    /// cache-aware cache-in/out (the original's `lb`).
    LeastOutstanding,
    /// Route by host-cache location, evict the least frequently used model
    /// (the original's `lb_lfu`, with its minimum tracked correctly).
    Lfu,
}

impl FromStr for Balancer {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "lor" | "least-outstanding" => Ok(Balancer::LeastOutstanding),
            "lfu" => Ok(Balancer::Lfu),
            _ => Err(format!("unknown balancer {s:?}: expected lor or lfu")),
        }
    }
}

impl Balancer {
    pub fn as_str(&self) -> &'static str {
        match self {
            Balancer::LeastOutstanding => "lor",
            Balancer::Lfu => "lfu",
        }
    }
}

/// Exponentially weighted moving average; `None` until the first sample.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Ewma {
    value: Option<f64>,
}

impl Ewma {
    /// Weight of a new sample.
    pub const ALPHA: f64 = 0.2;

    pub fn observe(&mut self, x: f64) {
        self.value = Some(match self.value {
            None => x,
            Some(v) => v + Self::ALPHA * (x - v),
        });
    }

    pub fn get(&self) -> Option<f64> {
        self.value
    }
}
