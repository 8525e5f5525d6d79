//! How long a request takes on a GPU, by where its model is.
//!
//! Estimates come from live observations first (the service time each
//! runtime reports, per model and path, as moving averages), then from the
//! model's family, then from size-based priors (bytes over the link and the
//! host-to-device bandwidth, plus a default compute time). Estimates are
//! service times at the device; the dispatcher adds queueing itself.

use std::collections::HashMap;

use super::{Ewma, Micros, Where};

/// What the dispatcher knows of a model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelMeta {
    pub name: String,
    pub family: String,
    /// Parameter bytes (what a cold start moves).
    pub bytes: u64,
}

/// Size-based priors, used until a path has been observed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Priors {
    /// Memory servers to host cache, bytes/s.
    pub net_bytes_per_s: f64,
    /// Host cache to device, bytes/s.
    pub h2d_bytes_per_s: f64,
    /// Compute time of a model never seen run.
    pub compute_ms: f64,
}

impl Default for Priors {
    /// A 10 Gbit/s link, PCIe-class uploads, 10 ms of compute.
    fn default() -> Self {
        Priors {
            net_bytes_per_s: 1.25e9,
            h2d_bytes_per_s: 10e9,
            compute_ms: 10.0,
        }
    }
}

/// Service-time estimates, learnt from replies.
#[derive(Debug, Clone, Default)]
pub struct CostModel {
    priors: Priors,
    /// Indexed by model id (ids are small and dense).
    by_model: Vec<[Ewma; 3]>,
    /// Family index of each model id, once [`register`](Self::register)ed.
    family_of: Vec<Option<u32>>,
    family_ids: HashMap<String, u32>,
    by_family: Vec<[Ewma; 3]>,
    /// Dispatcher-to-runtime round trip not spent at the device, ms.
    overhead: Ewma,
}

impl CostModel {
    pub fn new(priors: Priors) -> Self {
        CostModel {
            priors,
            ..Default::default()
        }
    }

    /// Notes model `id`'s family (lookups by id skip hashing its name).
    pub fn register(&mut self, id: u32, family: &str) {
        let f = self.family(family);
        let i = id as usize;
        if self.family_of.len() <= i {
            self.family_of.resize(i + 1, None);
        }
        self.family_of[i] = Some(f);
    }

    fn family(&mut self, family: &str) -> u32 {
        if let Some(&f) = self.family_ids.get(family) {
            return f;
        }
        let f = self.by_family.len() as u32;
        self.family_ids.insert(family.to_string(), f);
        self.by_family.push([Ewma::default(); 3]);
        f
    }

    fn family_index(&self, id: u32, family: &str) -> Option<u32> {
        match self.family_of.get(id as usize) {
            Some(Some(f)) => Some(*f),
            _ => self.family_ids.get(family).copied(),
        }
    }

    /// Service time of model `id` at a GPU where it is `at`, plus the
    /// observed dispatch overhead.
    pub fn estimate(&self, id: u32, meta: &ModelMeta, at: Where) -> Micros {
        let ms = self.service_ms(id, meta, at) + self.overhead.get().unwrap_or(0.0);
        (ms * 1e3).ceil().max(1.0) as Micros
    }

    fn observed(&self, id: u32, family: &str, at: Where) -> Option<f64> {
        let i = at as usize;
        self.by_model
            .get(id as usize)
            .and_then(|e| e[i].get())
            .or_else(|| {
                let f = self.family_index(id, family)?;
                self.by_family[f as usize][i].get()
            })
    }

    fn service_ms(&self, id: u32, meta: &ModelMeta, at: Where) -> f64 {
        if let Some(ms) = self.observed(id, &meta.family, at) {
            return ms;
        }
        let compute = self
            .observed(id, &meta.family, Where::Resident)
            .unwrap_or(self.priors.compute_ms);
        let upload = meta.bytes as f64 / self.priors.h2d_bytes_per_s * 1e3;
        match at {
            Where::Resident => compute,
            Where::HostCached => compute + upload,
            Where::Remote => {
                // A cold start after a host-cached one was observed: add the
                // transfer to what the host-cached path took.
                let host = self
                    .observed(id, &meta.family, Where::HostCached)
                    .unwrap_or(compute + upload);
                host + meta.bytes as f64 / self.priors.net_bytes_per_s * 1e3
            }
        }
    }

    /// Records one served request: `service_ms` at the device (the runtime's
    /// total minus its queueing) and `round_trip_ms` as the dispatcher saw it.
    pub fn observe(
        &mut self,
        id: u32,
        meta: &ModelMeta,
        at: Where,
        service_ms: f64,
        round_trip_ms: Option<f64>,
        runtime_total_ms: f64,
    ) {
        if !service_ms.is_finite() || service_ms < 0.0 {
            return;
        }
        let i = at as usize;
        let m = id as usize;
        if self.by_model.len() <= m {
            self.by_model.resize(m + 1, [Ewma::default(); 3]);
        }
        self.by_model[m][i].observe(service_ms);
        let f = match self.family_index(id, &meta.family) {
            Some(f) => f,
            None => self.family(&meta.family),
        };
        self.by_family[f as usize][i].observe(service_ms);
        if let Some(rtt) = round_trip_ms {
            let extra = rtt - runtime_total_ms;
            if extra.is_finite() && extra >= 0.0 {
                self.overhead.observe(extra);
            }
        }
    }

    /// Forgets a model's observations (it was redeployed).
    pub fn forget(&mut self, id: u32) {
        if let Some(e) = self.by_model.get_mut(id as usize) {
            *e = [Ewma::default(); 3];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(bytes: u64) -> ModelMeta {
        ModelMeta {
            name: "m".into(),
            family: "resnet152".into(),
            bytes,
        }
    }

    #[test]
    fn priors_order_paths_and_observations_take_over() {
        let mut c = CostModel::new(Priors {
            net_bytes_per_s: 1e9,
            h2d_bytes_per_s: 1e10,
            compute_ms: 10.0,
        });
        let m = meta(100_000_000); // 100 ms over the link, 10 ms upload
        assert_eq!(c.estimate(0, &m, Where::Resident), 10_000);
        assert_eq!(c.estimate(0, &m, Where::HostCached), 20_000);
        assert_eq!(c.estimate(0, &m, Where::Remote), 120_000);
        c.observe(0, &m, Where::Resident, 4.0, Some(5.0), 4.0);
        // Compute observed: the derived paths use it; 1 ms of overhead.
        assert_eq!(c.estimate(0, &m, Where::Resident), 5_000);
        assert_eq!(c.estimate(0, &m, Where::HostCached), 15_000);
        // Another model of the same family borrows the family's numbers.
        assert_eq!(c.estimate(1, &m, Where::Resident), 5_000);
        c.observe(0, &m, Where::Remote, 50.0, None, 50.0);
        assert_eq!(c.estimate(0, &m, Where::Remote), 51_000);
        // Bad samples are ignored.
        c.observe(0, &m, Where::Remote, f64::NAN, None, 0.0);
        assert_eq!(c.estimate(0, &m, Where::Remote), 51_000);
    }
}
