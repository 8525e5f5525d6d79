//! One GPU's earliest-deadline-first queue and its admission test.
//!
//! The dispatcher keeps, per GPU, the requests it admitted but has not yet
//! sent, ordered by deadline (ties: arrival order). A request is admitted
//! only if, inserted at its deadline's place, it finishes before its
//! deadline AND every request already queued still finishes before its
//! own: admission never makes an admitted request late. "Finishes" uses the
//! service-time estimates of [`super::cost`] and the time the device frees
//! up (its outstanding work and a training iteration to yield), plus the
//! latency every request pays beyond its device time (`overhead`).

use std::collections::BTreeMap;

use super::Micros;

/// The outcome of [`EdfQueue::admit`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Admission {
    /// Estimated finish of the new request.
    pub finish: Micros,
    /// It meets its deadline and makes no queued request late.
    pub feasible: bool,
}

/// Where an item sits in an [`EdfQueue`]: its deadline and arrival order.
pub type Slot = (Micros, u64);

/// A bounded EDF queue of `T`.
#[derive(Debug)]
pub struct EdfQueue<T> {
    q: BTreeMap<Slot, (Micros, T)>,
    seq: u64,
    work: Micros,
    cap: usize,
}

impl<T> EdfQueue<T> {
    pub fn new(cap: usize) -> Self {
        assert!(cap > 0, "an EDF queue holds at least one request");
        EdfQueue {
            q: BTreeMap::new(),
            seq: 0,
            work: 0,
            cap,
        }
    }

    pub fn len(&self) -> usize {
        self.q.len()
    }

    pub fn is_empty(&self) -> bool {
        self.q.is_empty()
    }

    pub fn is_full(&self) -> bool {
        self.q.len() >= self.cap
    }

    /// Sum of the queued requests' service estimates.
    pub fn work(&self) -> Micros {
        self.work
    }

    /// Would a request with `deadline` and `service` be admitted, with the
    /// device free from `free_at` and `overhead` of latency added to every
    /// request's finish? Does not change the queue.
    pub fn admit(
        &self,
        free_at: Micros,
        deadline: Micros,
        service: Micros,
        overhead: Micros,
    ) -> Admission {
        // Every finish moves by the overhead: compare device finishes with
        // deadlines that much earlier.
        self.admit_device(free_at + overhead, deadline, service, |_| false)
    }

    /// [`EdfQueue::admit`] as if the queued items for which `gone` holds
    /// were not there (they would be dropped to make room).
    pub fn admit_without(
        &self,
        free_at: Micros,
        deadline: Micros,
        service: Micros,
        overhead: Micros,
        gone: impl Fn(&T) -> bool,
    ) -> Admission {
        self.admit_device(free_at + overhead, deadline, service, gone)
    }

    fn admit_device(
        &self,
        free_at: Micros,
        deadline: Micros,
        service: Micros,
        gone: impl Fn(&T) -> bool,
    ) -> Admission {
        if self.q.is_empty() {
            let finish = free_at + service;
            return Admission {
                finish,
                feasible: finish <= deadline,
            };
        }
        // Work ahead of it: everything due no later than its deadline.
        let mut t = free_at;
        for (_, (s, item)) in self.q.range(..(deadline, u64::MAX)) {
            if !gone(item) {
                t += s;
            }
        }
        let finish = t + service;
        if finish > deadline {
            return Admission {
                finish,
                feasible: false,
            };
        }
        // Everything due later moves back by `service`.
        let mut after = finish;
        for (&(d, _), (s, item)) in self.q.range((deadline, u64::MAX)..) {
            if gone(item) {
                continue;
            }
            let s = *s;
            let before = after - service + s;
            after += s;
            // A request already late without the newcomer does not veto it.
            if after > d && before <= d {
                return Admission {
                    finish,
                    feasible: false,
                };
            }
        }
        Admission {
            finish,
            feasible: true,
        }
    }

    /// Queues an item; gives it back when the queue is full.
    pub fn push(&mut self, deadline: Micros, service: Micros, item: T) -> Result<(), T> {
        if self.is_full() {
            return Err(item);
        }
        self.seq += 1;
        self.q.insert((deadline, self.seq), (service, item));
        self.work += service;
        Ok(())
    }

    /// The earliest-deadline request: (deadline, service, item).
    pub fn pop(&mut self) -> Option<(Micros, Micros, T)> {
        let ((d, _), (s, item)) = self.q.pop_first()?;
        self.work -= s;
        Some((d, s, item))
    }

    /// The earliest deadline queued.
    pub fn peek_deadline(&self) -> Option<Micros> {
        self.q.keys().next().map(|&(d, _)| d)
    }

    /// The latest deadline queued.
    pub fn last_deadline(&self) -> Option<Micros> {
        self.q.keys().next_back().map(|&(d, _)| d)
    }

    /// The queue in EDF order: (slot, service, item).
    pub fn iter(&self) -> impl Iterator<Item = (Slot, Micros, &T)> {
        self.q.iter().map(|(&k, (s, t))| (k, *s, t))
    }

    /// Takes the item at `slot` out of the queue: (deadline, service, item).
    pub fn remove(&mut self, slot: Slot) -> Option<(Micros, Micros, T)> {
        let (s, item) = self.q.remove(&slot)?;
        self.work -= s;
        Some((slot.0, s, item))
    }

    /// Empties the queue, in deadline order.
    pub fn drain(&mut self) -> Vec<T> {
        self.work = 0;
        std::mem::take(&mut self.q)
            .into_values()
            .map(|(_, t)| t)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pops_in_deadline_order_ties_by_arrival() {
        let mut q = EdfQueue::new(8);
        q.push(30, 1, "c").unwrap();
        q.push(10, 1, "a").unwrap();
        q.push(20, 1, "b1").unwrap();
        q.push(20, 1, "b2").unwrap();
        assert_eq!(q.work(), 4);
        let order: Vec<_> = std::iter::from_fn(|| q.pop().map(|(_, _, t)| t)).collect();
        assert_eq!(order, ["a", "b1", "b2", "c"]);
        assert_eq!(q.work(), 0);
    }

    #[test]
    fn bounded() {
        let mut q = EdfQueue::new(2);
        q.push(1, 1, 1).unwrap();
        q.push(1, 1, 2).unwrap();
        assert_eq!(q.push(1, 1, 3), Err(3));
        assert_eq!(q.drain(), vec![1, 2]);
        assert!(q.is_empty());
    }

    /// Brute force: simulate EDF service with and without the newcomer.
    fn feasible_by_simulation(
        queued: &[(Micros, Micros)],
        free_at: Micros,
        new: (Micros, Micros),
    ) -> bool {
        let finish_all = |items: &[(Micros, Micros, bool)]| {
            let mut v = items.to_vec();
            v.sort_by_key(|&(d, _, is_new)| (d, is_new)); // ties: queued first
            let mut t = free_at;
            v.iter()
                .map(|&(d, s, is_new)| {
                    t += s;
                    (d, t, is_new)
                })
                .collect::<Vec<_>>()
        };
        let before: Vec<_> = queued.iter().map(|&(d, s)| (d, s, false)).collect();
        let late_before: Vec<bool> = finish_all(&before).iter().map(|&(d, t, _)| t > d).collect();
        let mut with = before.clone();
        with.push((new.0, new.1, true));
        let after = finish_all(&with);
        let mut k = 0;
        for &(d, t, is_new) in &after {
            if is_new {
                if t > d {
                    return false;
                }
            } else {
                if t > d && !late_before[k] {
                    return false;
                }
                k += 1;
            }
        }
        true
    }

    #[test]
    fn admission_rejects_exactly_the_infeasible() {
        // Every combination of a small queue and newcomer, against the
        // brute-force schedule.
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        for _ in 0..5000 {
            let n = rng.gen_range(0..6);
            let mut q = EdfQueue::new(16);
            let mut queued = Vec::new();
            // Keep the queue sorted the way EDF pops it (so `late_before`
            // indexes match): insert and remember in pop order.
            for _ in 0..n {
                let d = rng.gen_range(5..60);
                let s = rng.gen_range(1..15);
                q.push(d, s, ()).unwrap();
                queued.push((d, s));
            }
            queued.sort_by_key(|&(d, _)| d);
            let free_at = rng.gen_range(0..10);
            let new = (rng.gen_range(1..70), rng.gen_range(1..15));
            let a = q.admit(free_at, new.0, new.1, 0);
            assert_eq!(
                a.feasible,
                feasible_by_simulation(&queued, free_at, new),
                "queue {queued:?}, free at {free_at}, new {new:?}: {a:?}"
            );
        }
    }

    #[test]
    fn a_newcomer_that_would_make_a_queued_request_late_is_refused() {
        let mut q = EdfQueue::new(4);
        q.push(20, 10, ()).unwrap(); // finishes at 10 from 0
                                     // Deadline 15, 5 long: it goes first and finishes at 5, but the
                                     // queued one would finish at 15, still in time.
        assert!(q.admit(0, 15, 5, 0).feasible);
        // 12 long: it would finish at 12 <= 15 but push the queued one to 22.
        let a = q.admit(0, 15, 12, 0);
        assert_eq!((a.finish, a.feasible), (12, false));
        // Its own deadline cannot be met at all.
        assert!(!q.admit(0, 30, 25, 0).feasible);
        // 6 ms of overhead on every reply: 5 + 6 > 10, and the queued one
        // would end at 15 + 6 > 20.
        assert!(q.admit(0, 15, 5, 0).feasible);
        assert!(!q.admit(0, 15, 5, 6).feasible);
        assert!(q.admit(0, 15, 4, 1).feasible);
    }

    #[test]
    fn remove_by_slot_keeps_the_work_sum() {
        let mut q = EdfQueue::new(4);
        q.push(10, 3, 'a').unwrap();
        q.push(20, 4, 'b').unwrap();
        let slot = q.iter().find(|(_, _, &t)| t == 'b').unwrap().0;
        assert_eq!(q.remove(slot), Some((20, 4, 'b')));
        assert_eq!(q.work(), 3);
        assert_eq!(q.remove(slot), None);
    }
}
