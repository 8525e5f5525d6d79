//! How long a request takes on a GPU, by where its model is.
//!
//! Estimates come from live observations first (the service time each
//! runtime reports, per model and path, as moving averages), then from the
//! model's family, then from size-based priors (bytes over the link and the
//! host-to-device bandwidth, plus a default compute time), never above a
//! slower path's observed time (a load computes too). A batch's time stands
//! for one request's on its path until a request runs alone there.
//! Estimates are service times at the device; the dispatcher adds queueing
//! itself, and the observed dispatch overhead ([`CostModel::overhead`])
//! once per request: it is latency, not device time.
//!
//! Loads from the memory servers share their GPU server's link: a load's
//! time is learnt as what it would have taken alone, from the mean number
//! of GPUs that loaded while it ran (the dispatcher counts them), and a new
//! load is estimated with the other GPUs loading now
//! ([`CostModel::estimate_load`], [`CostModel::load_alone_ms`]).
//!
//! Batches: a batch of `n` requests costs the single request's time plus
//! what `n` adds over one, learnt per family and batch size from replies
//! that ran batched (`TimingMsg::batch_requests`): a size observed is
//! taken as observed, one between two observed sizes interpolated
//! linearly, one above the largest observed scaled from it in proportion
//! to `n - 1` (an overestimate where, as on a GPU, each extra request
//! costs less than the one before), and with no batch observed yet a prior
//! fraction of the compute time per extra request. Kernels are far from linear in the
//! batch: ResNet-152 on an H200 with the `cuda` executor measured 4.45 ms
//! at 1, 8.58 at 2, 10.65 at 4 and 15.78 at 8, so one increment fitted to a
//! mix of sizes misjudges every size (batch 2 adds 4.1 ms, batch 8 1.6 ms
//! a request).

use std::collections::HashMap;

use super::{Ewma, Micros, Where};

/// A sample counts for at most this many times the observed estimate it
/// updates (the model's own on that path, else its family's). One stall,
/// such as a load that waited behind a queue or a page-fault storm, must
/// not lift an estimate past the SLO: the requests it then rejects would
/// bring no sample to lower it again, and the model would stay shut out.
/// A real slowdown still raises the estimate by up to 60% a sample
/// (`Ewma::ALPHA` x 3).
pub const SAMPLE_CAP_FACTOR: f64 = 4.0;

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
    /// Each request a batch adds, as a fraction of one request's compute,
    /// until batches have been observed. 1 (no gain) by default: admission
    /// counts on batching only once the device has shown it (a GPU's
    /// estimated profiles give 0.02-0.1; the cpu executor about 1, and a
    /// smaller prior there over-admits whatever joins a batch).
    pub batch_increment: f64,
}

impl Default for Priors {
    /// A 10 Gbit/s link, PCIe-class uploads, 10 ms of compute.
    fn default() -> Self {
        Priors {
            net_bytes_per_s: 1.25e9,
            h2d_bytes_per_s: 10e9,
            compute_ms: 10.0,
            batch_increment: 1.0,
        }
    }
}

/// A load's estimate for any number of loads sharing its link
/// ([`CostModel::load_cost`]): routing works it out once per request and
/// applies it per GPU server.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoadCost {
    /// The load alone.
    alone_ms: f64,
    /// Its transfer alone.
    xfer_ms: f64,
    /// What a transfer hides behind: the longer of the transfer alone and
    /// the host-cached path (the pipeline uploads and computes while bytes
    /// arrive).
    hidden_ms: f64,
}

impl LoadCost {
    /// Device time while `others` more loads share the link (a fraction
    /// where the memory servers' side counts): the load alone, plus what
    /// its transfer, `others + 1` times longer than alone, takes beyond
    /// what it hides behind.
    pub fn sharing(&self, others: f64) -> Micros {
        if others <= 0.0 {
            return us(self.alone_ms);
        }
        us(self.alone_ms + (self.xfer_ms * (others + 1.0) - self.hidden_ms).max(0.0))
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
    /// Per family: what a batch of `n` adds over one request, ms, observed
    /// (index `n - 2`, `n` up to [`BATCH_SIZES`]).
    extra: Vec<Vec<Ewma>>,
    /// Per family: the same for every size, from those observed (see the
    /// module's doc); `None` before any batch was observed.
    curve: Vec<Option<Vec<f64>>>,
    /// Dispatcher-to-runtime round trip not spent at the device, ms.
    overhead: Ewma,
    /// A GPU server's link to the memory servers, bytes per ms, as one load
    /// alone would have it (each load's rate times the loads that shared
    /// the link with it).
    link_bytes_per_ms: Ewma,
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
        self.extra.push(vec![Ewma::default(); BATCH_SIZES - 1]);
        self.curve.push(None);
        f
    }

    fn family_index(&self, id: u32, family: &str) -> Option<u32> {
        match self.family_of.get(id as usize) {
            Some(Some(f)) => Some(*f),
            _ => self.family_ids.get(family).copied(),
        }
    }

    /// Device time of one request for model `id` at a GPU where it is `at`.
    pub fn estimate(&self, id: u32, meta: &ModelMeta, at: Where) -> Micros {
        us(self.service_ms(id, meta, at))
    }

    /// Device time of a load of model `id` (from the memory servers) while
    /// `others` more loads share its GPU server's link ([`LoadCost`]).
    pub fn estimate_load(&self, id: u32, meta: &ModelMeta, others: u32) -> Micros {
        self.load_cost(id, meta).sharing(f64::from(others))
    }

    /// What a load of model `id` costs, for any number of loads beside it.
    pub fn load_cost(&self, id: u32, meta: &ModelMeta) -> LoadCost {
        let xfer_ms = self.transfer_ms(meta);
        LoadCost {
            alone_ms: self.service_ms(id, meta, Where::Remote),
            xfer_ms,
            hidden_ms: xfer_ms.max(self.service_ms(id, meta, Where::HostCached)),
        }
    }

    /// The transfer of `meta`'s bytes over a GPU server's link alone, ms.
    fn transfer_ms(&self, meta: &ModelMeta) -> f64 {
        let rate = self
            .link_bytes_per_ms
            .get()
            .unwrap_or(self.priors.net_bytes_per_s / 1e3);
        meta.bytes as f64 / rate.max(1.0)
    }

    /// What a load of model `id` that took `service_ms` at the device, of
    /// it `fetch_ms` fetching `fetched_bytes`, while `share` loads (itself
    /// included, on average) shared its GPU server's link, would have taken
    /// alone: the inverse of [`Self::estimate_load`]. Learns the link's
    /// rate alone from it (a load that fetched nothing itself, waiting for
    /// another's, says nothing of the link).
    pub fn load_alone_ms(
        &mut self,
        id: u32,
        meta: &ModelMeta,
        service_ms: f64,
        fetch_ms: f64,
        fetched_bytes: u64,
        share: f64,
    ) -> f64 {
        if !(share > 1.0 && fetch_ms > 0.0 && service_ms.is_finite()) {
            return service_ms;
        }
        if fetched_bytes > 0 {
            self.link_bytes_per_ms
                .observe(fetched_bytes as f64 * share / fetch_ms);
        }
        let host = self.service_ms(id, meta, Where::HostCached);
        let shared = (fetch_ms - (fetch_ms / share).max(host)).max(0.0);
        // Never below the host-cached path: a load also uploads and computes.
        (service_ms - shared).max(host.min(service_ms))
    }

    /// What a batch of `n` requests for model `id` takes beyond one
    /// request (never more than `n - 1` requests alone).
    pub fn batch_extra(&self, id: u32, meta: &ModelMeta, n: u32) -> Micros {
        (self.batch_extra_ms(id, meta, n) * 1e3).round() as Micros
    }

    fn batch_extra_ms(&self, id: u32, meta: &ModelMeta, n: u32) -> f64 {
        if n <= 1 {
            return 0.0;
        }
        let compute = self.service_ms(id, meta, Where::Resident);
        let alone = f64::from(n - 1) * compute;
        let i = (n.min(BATCH_SIZES as u32) - 2) as usize;
        let fitted = self
            .family_index(id, &meta.family)
            .and_then(|f| self.curve[f as usize].as_ref())
            .map(|c| {
                let e = c[i];
                // Past the sizes tracked: in proportion to the last.
                if n as usize > BATCH_SIZES {
                    e * f64::from(n - 1) / (BATCH_SIZES - 1) as f64
                } else {
                    e
                }
            });
        // Batching never costs more than running the requests one after
        // another.
        fitted
            .unwrap_or(alone * self.priors.batch_increment)
            .clamp(0.0, alone)
    }

    /// Device time of a batch of `n` requests for model `id` where it is `at`.
    pub fn estimate_batch(&self, id: u32, meta: &ModelMeta, at: Where, n: u32) -> Micros {
        self.estimate(id, meta, at) + self.batch_extra(id, meta, n)
    }

    /// The latency a request pays beyond its device time (dispatcher to
    /// runtime and back), observed.
    pub fn overhead(&self) -> Micros {
        self.overhead
            .get()
            .map_or(0, |ms| (ms * 1e3).ceil() as Micros)
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
        // A load computes too: a path not yet observed costs no more than
        // a slower path that was. (A prior above what loads were seen to
        // take once shut out resident requests the device served in half
        // that time.)
        let slower = |from: Where| {
            [Where::HostCached, Where::Remote]
                .into_iter()
                .filter(|&w| w > from)
                .filter_map(|w| self.observed(id, &meta.family, w))
                .fold(f64::INFINITY, f64::min)
        };
        match at {
            Where::Resident => compute.min(slower(at)),
            Where::HostCached => (compute + upload).min(slower(at)),
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

    /// Records one batch of `n` requests (one observation per batch):
    /// `service_ms` at the device for the whole batch. A batch of one is
    /// [`observe`](Self::observe)d; a larger one is what `n` added over what
    /// one request costs at `at` (a batch above [`BATCH_SIZES`] counts, in
    /// proportion, for the largest size tracked). Once the family has a
    /// curve, a sample counts for at most [`SAMPLE_CAP_FACTOR`] times the
    /// batch's estimate: a stalled batch must not price its size out of
    /// every later plan, which would leave no sample to correct it.
    pub fn observe_batch(&mut self, id: u32, meta: &ModelMeta, at: Where, n: u32, service_ms: f64) {
        if n <= 1 || !service_ms.is_finite() || service_ms < 0.0 {
            return;
        }
        if self.observed(id, &meta.family, at).is_none() {
            // One request alone takes no longer than a batch it ran in:
            // until one runs alone on this path, the batch's time is its
            // estimate (else a prior, or a slower path's time, stands for
            // it, and a model whose requests always run batched would keep
            // that). What the batch added over one is learnt from later
            // batches, against that estimate.
            self.observe(id, meta, at, service_ms, None, service_ms);
            return;
        }
        let one = self.service_ms(id, meta, at);
        let f = match self.family_index(id, &meta.family) {
            Some(f) => f,
            None => self.family(&meta.family),
        } as usize;
        let estimate = self.curve[f]
            .is_some()
            .then(|| one + self.batch_extra_ms(id, meta, n));
        let service_ms = estimate.map_or(service_ms, |e| service_ms.min(e * SAMPLE_CAP_FACTOR));
        let mut extra = (service_ms - one).max(0.0);
        let mut n = n as usize;
        if n > BATCH_SIZES {
            extra *= (BATCH_SIZES - 1) as f64 / (n - 1) as f64;
            n = BATCH_SIZES;
        }
        self.extra[f][n - 2].observe(extra);
        self.curve[f] = Some(fill_curve(&self.extra[f]));
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
        // One sample moves an observed estimate up by at most
        // `SAMPLE_CAP_FACTOR` times itself (see there).
        let service_ms = match self.observed(id, &meta.family, at) {
            Some(e) => service_ms.min(e * SAMPLE_CAP_FACTOR),
            None => service_ms,
        };
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
            self.observe_overhead(rtt, runtime_total_ms);
        }
    }

    /// Records the dispatcher's round trip of a request the runtime took
    /// `runtime_total_ms` for: the rest is overhead.
    pub fn observe_overhead(&mut self, round_trip_ms: f64, runtime_total_ms: f64) {
        let extra = round_trip_ms - runtime_total_ms;
        if extra.is_finite() && extra >= 0.0 {
            self.overhead.observe(extra);
        }
    }

    /// Forgets a model's observations (it was redeployed).
    pub fn forget(&mut self, id: u32) {
        if let Some(e) = self.by_model.get_mut(id as usize) {
            *e = [Ewma::default(); 3];
        }
    }
}

/// Batch sizes whose cost is learnt one by one (2 to this): the protocol's
/// largest batch.
pub const BATCH_SIZES: usize = distmind_common::proto::BATCH_MEMBERS_MAX + 1;

/// Every size's extra time (index `n - 2`) from the sizes observed: exact
/// where observed, linear between observed sizes (from 0 at a batch of 1),
/// in proportion to `n - 1` above the largest observed. At least one size
/// is observed.
fn fill_curve(observed: &[Ewma]) -> Vec<f64> {
    let points: Vec<(f64, f64)> = std::iter::once((1.0, 0.0))
        .chain(
            observed
                .iter()
                .enumerate()
                .filter_map(|(i, e)| e.get().map(|x| ((i + 2) as f64, x))),
        )
        .collect();
    let &(last_n, last_e) = points.last().expect("the batch of one");
    let mut j = 0;
    (2..=observed.len() + 1)
        .map(|n| {
            let n = n as f64;
            if n >= last_n {
                return last_e * (n - 1.0) / (last_n - 1.0);
            }
            while points[j + 1].0 < n {
                j += 1;
            }
            let ((n0, e0), (n1, e1)) = (points[j], points[j + 1]);
            e0 + (e1 - e0) * (n - n0) / (n1 - n0)
        })
        .collect()
}

fn us(ms: f64) -> Micros {
    (ms * 1e3).ceil().max(1.0) as Micros
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
            batch_increment: 0.1,
        });
        let m = meta(100_000_000); // 100 ms over the link, 10 ms upload
        assert_eq!(c.estimate(0, &m, Where::Resident), 10_000);
        assert_eq!(c.estimate(0, &m, Where::HostCached), 20_000);
        assert_eq!(c.estimate(0, &m, Where::Remote), 120_000);
        c.observe(0, &m, Where::Resident, 4.0, Some(5.0), 4.0);
        // Compute observed: the derived paths use it. The 1 ms of overhead
        // is latency, kept apart from device time.
        assert_eq!(c.estimate(0, &m, Where::Resident), 4_000);
        assert_eq!(c.overhead(), 1_000);
        assert_eq!(c.estimate(0, &m, Where::HostCached), 14_000);
        // Another model of the same family borrows the family's numbers.
        assert_eq!(c.estimate(1, &m, Where::Resident), 4_000);
        c.observe(0, &m, Where::Remote, 50.0, None, 50.0);
        assert_eq!(c.estimate(0, &m, Where::Remote), 50_000);
        // Bad samples are ignored.
        c.observe(0, &m, Where::Remote, f64::NAN, None, 0.0);
        assert_eq!(c.estimate(0, &m, Where::Remote), 50_000);
    }

    #[test]
    fn a_path_not_yet_observed_costs_no_more_than_a_slower_one_that_was() {
        // The prior's 10 ms of compute, while loads (an upload and a
        // compute) are seen to take 4.9 ms: a model whose requests always
        // ran batched when resident kept the prior, and admission rejected
        // its resident requests as twice as long as a load.
        let mut c = CostModel::new(Priors::default());
        let m = meta(240_000_000);
        assert_eq!(c.estimate(0, &m, Where::Resident), 10_000);
        c.observe(0, &m, Where::HostCached, 4.9, None, 4.9);
        assert_eq!(c.estimate(0, &m, Where::Resident), 4_900);
        // The family's observation bounds its other models too.
        assert_eq!(c.estimate(1, &m, Where::Resident), 4_900);
        // A cold start seen bounds the paths below it (another family, 240
        // ms of upload at the prior's bandwidth).
        let cold = ModelMeta {
            family: "gpt2".into(),
            ..meta(2_400_000_000)
        };
        assert_eq!(c.estimate(2, &cold, Where::HostCached), 250_000);
        c.observe(2, &cold, Where::Remote, 30.0, None, 30.0);
        assert_eq!(c.estimate(2, &cold, Where::HostCached), 30_000);
        assert_eq!(c.estimate(2, &cold, Where::Resident), 10_000);
        // Once observed, a path is what it was seen to take.
        c.observe(0, &m, Where::Resident, 2.8, None, 2.8);
        assert_eq!(c.estimate(0, &m, Where::Resident), 2_800);
    }

    #[test]
    fn a_batch_bounds_one_request_until_one_runs_alone() {
        let mut c = CostModel::new(Priors::default());
        let m = meta(240_000_000);
        c.observe(0, &m, Where::HostCached, 4.9, None, 4.9);
        // Resident requests so far only ran in batches: a batch of 3 took
        // 3.2 ms, so one alone takes at most that.
        c.observe_batch(0, &m, Where::Resident, 3, 3.2);
        assert_eq!(c.estimate(0, &m, Where::Resident), 3_200);
        // That sample was the single's, not what the batch added.
        assert_eq!(c.batch_extra(0, &m, 3), 2 * 3_200);
        // Later batches are learnt against it, and a request alone takes
        // over the estimate.
        c.observe_batch(0, &m, Where::Resident, 3, 3.6);
        assert_eq!(c.batch_extra(0, &m, 3), 400);
        c.observe(0, &m, Where::Resident, 2.8, None, 2.8);
        assert!(c.estimate(0, &m, Where::Resident) < 3_200);
    }

    #[test]
    fn one_stalled_sample_cannot_shut_a_model_out() {
        let mut c = CostModel::new(Priors::default());
        let m = meta(240_000_000);
        // The family's host-cached path is known: about 13 ms.
        for _ in 0..5 {
            c.observe(0, &m, Where::HostCached, 13.0, None, 13.0);
        }
        // Model 1's first sample stalled for 190 ms: it counts as 52 ms,
        // an estimate that still fits a 100 ms SLO, so its next requests
        // run and bring it back down.
        c.observe(1, &m, Where::HostCached, 190.0, None, 190.0);
        assert_eq!(c.estimate(1, &m, Where::HostCached), 52_000);
        for _ in 0..20 {
            c.observe(1, &m, Where::HostCached, 13.0, None, 13.0);
        }
        assert!(c.estimate(1, &m, Where::HostCached) < 14_000);
        // A real slowdown is still followed, by up to 60% a sample.
        c.observe(1, &m, Where::HostCached, 1_000.0, None, 1_000.0);
        let e = c.estimate(1, &m, Where::HostCached);
        assert!(e > 20_000 && e < 22_000, "{e}");
        // With nothing observed on the path yet, a sample is taken whole.
        c.observe(2, &m, Where::Remote, 500.0, None, 500.0);
        assert_eq!(c.estimate(2, &m, Where::Remote), 500_000);
    }

    #[test]
    fn batches_cost_what_their_size_was_seen_to_add() {
        let mut c = CostModel::new(Priors {
            batch_increment: 0.25,
            ..Priors::default()
        });
        let m = meta(1_000);
        c.observe(0, &m, Where::Resident, 4.0, None, 4.0);
        // Prior: a quarter of the compute per extra request.
        assert_eq!(c.estimate_batch(0, &m, Where::Resident, 1), 4_000);
        assert_eq!(c.estimate_batch(0, &m, Where::Resident, 5), 8_000);
        // A batch of 8 observed at 5.4 ms adds 1.4 ms: every size up to it
        // on the line from a batch of 1, larger ones in proportion.
        c.observe_batch(0, &m, Where::Resident, 8, 5.4);
        assert_eq!(c.estimate_batch(0, &m, Where::Resident, 8), 5_400);
        assert_eq!(c.batch_extra(0, &m, 2), 200);
        assert_eq!(c.batch_extra(0, &m, 15), 2_800);
        // The same family shares it.
        assert_eq!(c.batch_extra(1, &m, 8), 1_400);
        // A GPU's curve: batch 2 costs almost two requests, 4 and 8 far
        // less each. Each size keeps its own cost; sizes between observed
        // ones are interpolated.
        for _ in 0..50 {
            c.observe_batch(0, &m, Where::Resident, 2, 7.7);
            c.observe_batch(0, &m, Where::Resident, 4, 9.6);
            c.observe_batch(0, &m, Where::Resident, 8, 14.2);
        }
        let extra = |c: &CostModel, n| c.batch_extra(0, &m, n) as f64 / 1e3;
        assert!((extra(&c, 2) - 3.7).abs() < 0.01, "{}", extra(&c, 2));
        assert!((extra(&c, 3) - 4.65).abs() < 0.01, "{}", extra(&c, 3));
        assert!((extra(&c, 4) - 5.6).abs() < 0.01, "{}", extra(&c, 4));
        assert!((extra(&c, 6) - 7.9).abs() < 0.01, "{}", extra(&c, 6));
        assert!((extra(&c, 8) - 10.2).abs() < 0.01, "{}", extra(&c, 8));
        // A batch far past the protocol's sizes is scaled from the largest.
        let top = BATCH_SIZES as u32;
        assert_eq!(
            c.batch_extra(0, &m, 2 * top - 1),
            2 * c.batch_extra(0, &m, top)
        );
        // One stalled batch of 4 counts for at most 4x its estimate (9.6
        // ms), and the next samples bring it back.
        c.observe_batch(0, &m, Where::Resident, 4, 500.0);
        let stalled = extra(&c, 4);
        assert!(
            (stalled - (5.6 + 0.2 * (38.4 - 4.0 - 5.6))).abs() < 0.01,
            "{stalled}"
        );
        for _ in 0..50 {
            c.observe_batch(0, &m, Where::Resident, 4, 9.6);
        }
        assert!((extra(&c, 4) - 5.6).abs() < 0.01, "{}", extra(&c, 4));
        // Never more than the requests alone.
        for _ in 0..50 {
            c.observe_batch(0, &m, Where::Resident, 2, 100.0);
        }
        assert_eq!(c.batch_extra(0, &m, 2), 4_000);
    }
}
