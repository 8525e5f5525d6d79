//! Network of the simulated cluster: one NIC per host (GPU server or
//! memory server), each a full-duplex link of one rate, shared by the flows
//! that cross it with max-min fairness (progressive filling). A flow goes
//! from one memory server's egress to one GPU server's ingress.
//!
//! Rates change only when a flow starts or ends, so the simulation advances
//! every flow by `rate x elapsed` at those instants and asks for the next
//! completion.

/// A flow's endpoints: memory server `src`, GPU server `dst`.
#[derive(Debug, Clone, Copy)]
struct Flow {
    src: usize,
    dst: usize,
    remaining: f64,
    rate: f64,
    /// Caller's tag, returned when the flow completes.
    tag: u64,
}

/// Remaining bytes below this count as done (float rounding).
const DONE_BYTES: f64 = 1e-3;

#[derive(Debug)]
pub struct Network {
    egress: Vec<f64>,
    ingress: Vec<f64>,
    flows: Vec<Flow>,
    /// Simulated time the flows were last advanced to.
    at: f64,
}

impl Network {
    /// `memservers` egress links and `gpu_servers` ingress links, each of
    /// `rate` bytes/s.
    pub fn new(memservers: usize, gpu_servers: usize, rate: f64) -> Network {
        assert!(rate > 0.0, "link rate must be positive");
        Network {
            egress: vec![rate; memservers],
            ingress: vec![rate; gpu_servers],
            flows: Vec::new(),
            at: 0.0,
        }
    }

    pub fn is_idle(&self) -> bool {
        self.flows.is_empty()
    }

    /// Moves every flow forward to `now` at its current rate.
    pub fn advance(&mut self, now: f64) {
        let dt = (now - self.at).max(0.0);
        for f in &mut self.flows {
            f.remaining = (f.remaining - f.rate * dt).max(0.0);
        }
        self.at = now;
    }

    /// Starts flows `(src, dst, bytes, tag)` at the current time (call
    /// [`Network::advance`] first); rates are shared once for all of them.
    pub fn start(&mut self, flows: impl IntoIterator<Item = (usize, usize, u64, u64)>) {
        for (src, dst, bytes, tag) in flows {
            self.flows.push(Flow {
                src,
                dst,
                remaining: bytes as f64,
                rate: 0.0,
                tag,
            });
        }
        self.share();
    }

    /// Removes and returns the tags of the flows that are done at the
    /// current time (after [`Network::advance`]).
    pub fn take_done(&mut self) -> Vec<u64> {
        let mut done = Vec::new();
        self.flows.retain(|f| {
            if f.remaining <= DONE_BYTES {
                done.push(f.tag);
                false
            } else {
                true
            }
        });
        if !done.is_empty() {
            self.share();
        }
        done
    }

    /// When the next flow completes at the current rates, if any.
    pub fn next_done(&self) -> Option<f64> {
        self.flows
            .iter()
            .filter(|f| f.rate > 0.0)
            .map(|f| self.at + f.remaining / f.rate)
            .min_by(f64::total_cmp)
    }

    /// Max-min fair rates by progressive filling: repeatedly find the link
    /// whose remaining capacity split over its unfixed flows is smallest,
    /// fix those flows at that share, and take it from their other link.
    fn share(&mut self) {
        let n = self.flows.len();
        let mut fixed = vec![false; n];
        let mut cap_e = self.egress.clone();
        let mut cap_i = self.ingress.clone();
        loop {
            let mut cnt_e = vec![0usize; cap_e.len()];
            let mut cnt_i = vec![0usize; cap_i.len()];
            for (f, _) in self.flows.iter().zip(&fixed).filter(|(_, &x)| !x) {
                cnt_e[f.src] += 1;
                cnt_i[f.dst] += 1;
            }
            // The tightest link's share (and whether it is an egress, and which).
            let mut best: Option<(f64, bool, usize)> = None;
            for (i, &c) in cnt_e.iter().enumerate().filter(|(_, &c)| c > 0) {
                let s = cap_e[i] / c as f64;
                if best.is_none_or(|b| s < b.0) {
                    best = Some((s, true, i));
                }
            }
            for (i, &c) in cnt_i.iter().enumerate().filter(|(_, &c)| c > 0) {
                let s = cap_i[i] / c as f64;
                if best.is_none_or(|b| s < b.0) {
                    best = Some((s, false, i));
                }
            }
            let Some((share, _, _)) = best else {
                break;
            };
            // Every link as tight as the tightest (within rounding) is
            // saturated in this round: symmetric clusters finish in one.
            let tol = share * 1e-9;
            let tight_e: Vec<bool> = (0..cap_e.len())
                .map(|i| cnt_e[i] > 0 && cap_e[i] / cnt_e[i] as f64 <= share + tol)
                .collect();
            let tight_i: Vec<bool> = (0..cap_i.len())
                .map(|i| cnt_i[i] > 0 && cap_i[i] / cnt_i[i] as f64 <= share + tol)
                .collect();
            for (k, f) in self.flows.iter_mut().enumerate() {
                if fixed[k] || !(tight_e[f.src] || tight_i[f.dst]) {
                    continue;
                }
                f.rate = share;
                fixed[k] = true;
                cap_e[f.src] = (cap_e[f.src] - share).max(0.0);
                cap_i[f.dst] = (cap_i[f.dst] - share).max(0.0);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_flow_runs_at_the_link_rate() {
        let mut n = Network::new(1, 1, 10.0);
        n.start([(0, 0, 100, 7)]);
        assert_eq!(n.next_done(), Some(10.0));
        n.advance(10.0);
        assert_eq!(n.take_done(), vec![7]);
        assert!(n.is_idle());
    }

    #[test]
    fn flows_share_links_max_min_fairly() {
        // Two GPU servers read from one memory server: each gets half of
        // its egress. A third flow from another memory server to GPU server
        // 0 gets what GPU server 0's ingress has left.
        let mut n = Network::new(2, 2, 10.0);
        n.start([(0, 0, 50, 1)]);
        n.start([(0, 1, 50, 2)]);
        n.start([(1, 0, 50, 3)]);
        let rate = |n: &Network, tag| n.flows.iter().find(|f| f.tag == tag).unwrap().rate;
        assert_eq!(rate(&n, 1), 5.0);
        assert_eq!(rate(&n, 2), 5.0);
        assert_eq!(rate(&n, 3), 5.0);
        // Flows 1 and 2 end at 10 s; flow 3 then has the whole link.
        n.advance(10.0);
        let mut done = n.take_done();
        done.sort();
        assert_eq!(done, vec![1, 2, 3]);
        n.start([(1, 0, 100, 4)]);
        assert_eq!(rate(&n, 4), 10.0);
    }

    #[test]
    fn a_bottleneck_elsewhere_frees_capacity_for_others() {
        // Flow A: ms0 -> gpu0, flow B: ms1 -> gpu0, flow C: ms1 -> gpu1,
        // flow D: ms1 -> gpu1. ms1 carries B, C, D: 10/3 each; A gets the
        // rest of gpu0's ingress, 10 - 10/3.
        let mut n = Network::new(2, 2, 10.0);
        n.start([(0, 0, 100, 1)]);
        n.start([(1, 0, 100, 2)]);
        n.start([(1, 1, 100, 3)]);
        n.start([(1, 1, 100, 4)]);
        let rate = |tag| n.flows.iter().find(|f| f.tag == tag).unwrap().rate;
        let third = 10.0 / 3.0;
        assert!((rate(2) - third).abs() < 1e-9);
        assert!((rate(3) - third).abs() < 1e-9);
        assert!((rate(1) - (10.0 - third)).abs() < 1e-9);
    }
}
