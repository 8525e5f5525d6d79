//! Zipf-distributed choice among `n` ranked items: item `k` (0-based) has
//! probability proportional to `1 / (k + 1)^s`. `s = 0` is uniform; the
//! original draws model popularity with `s = 0.9`.

use rand::Rng;

/// Most items a sampler holds (its table is `8 * n` bytes).
pub const ZIPF_ITEMS_MAX: usize = 1 << 20;

/// A Zipf sampler over ranks `0..n`, by inverse transform on a cumulative table.
#[derive(Debug, Clone)]
pub struct Zipf {
    cdf: Vec<f64>,
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ZipfError {
    #[error("a Zipf distribution needs 1..={ZIPF_ITEMS_MAX} items, got {0}")]
    Items(usize),
    #[error("the Zipf exponent must be finite and >= 0, got {0}")]
    Exponent(f64),
}

impl Zipf {
    pub fn new(n: usize, s: f64) -> Result<Zipf, ZipfError> {
        if n == 0 || n > ZIPF_ITEMS_MAX {
            return Err(ZipfError::Items(n));
        }
        if !s.is_finite() || s < 0.0 {
            return Err(ZipfError::Exponent(s));
        }
        let mut cdf = Vec::with_capacity(n);
        let mut total = 0.0;
        for k in 0..n {
            total += 1.0 / ((k + 1) as f64).powf(s);
            cdf.push(total);
        }
        for c in &mut cdf {
            *c /= total;
        }
        Ok(Zipf { cdf })
    }

    pub fn len(&self) -> usize {
        self.cdf.len()
    }

    pub fn is_empty(&self) -> bool {
        self.cdf.is_empty()
    }

    /// Probability of rank `k`.
    pub fn probability(&self, k: usize) -> f64 {
        let below = if k == 0 { 0.0 } else { self.cdf[k - 1] };
        self.cdf[k] - below
    }

    /// A rank in `0..n`.
    pub fn sample(&self, rng: &mut impl Rng) -> usize {
        let u: f64 = rng.gen();
        self.cdf
            .partition_point(|&c| c <= u)
            .min(self.cdf.len() - 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn frequencies_follow_the_law() {
        let z = Zipf::new(20, 0.9).unwrap();
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let n = 200_000;
        let mut counts = [0u32; 20];
        for _ in 0..n {
            counts[z.sample(&mut rng)] += 1;
        }
        for (k, &c) in counts.iter().enumerate() {
            let expected = z.probability(k) * n as f64;
            // 5 standard deviations of a binomial count.
            let sd = (expected * (1.0 - z.probability(k))).sqrt();
            assert!(
                (c as f64 - expected).abs() < 5.0 * sd,
                "rank {k}: {c} draws, expected {expected:.0}"
            );
        }
        // Rank 0 over rank 9 is 10^0.9.
        let ratio = z.probability(0) / z.probability(9);
        assert!((ratio - 10f64.powf(0.9)).abs() < 1e-9);
    }

    #[test]
    fn zero_exponent_is_uniform_and_bad_input_is_refused() {
        let z = Zipf::new(4, 0.0).unwrap();
        for k in 0..4 {
            assert!((z.probability(k) - 0.25).abs() < 1e-12);
        }
        assert_eq!(Zipf::new(0, 1.0).unwrap_err(), ZipfError::Items(0));
        assert!(matches!(Zipf::new(3, -1.0), Err(ZipfError::Exponent(_))));
        assert!(matches!(
            Zipf::new(3, f64::NAN),
            Err(ZipfError::Exponent(_))
        ));
    }
}
