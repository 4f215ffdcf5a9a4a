//! Zipf popularity: which target (or URI) each new connection (or call)
//! goes to. Sampling is rand_distr's rejection-inversion Zipf sampler; this
//! module only maps its ranks onto indices.

use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_distr::{Distribution, Zipf};
use thiserror::Error;

/// A popularity distribution that cannot be built.
#[derive(Debug, Error)]
pub enum PopularityError {
    /// rand_distr refused the parameters.
    #[error("Zipf(n={n}, alpha={alpha}): {err}")]
    Zipf {
        /// Number of items.
        n: u32,
        /// Exponent.
        alpha: f64,
        /// rand_distr's reason.
        err: rand_distr::ZipfError,
    },
}

/// Zipf(alpha) over `n` items: rank r (0-based) has probability
/// proportional to 1 / (r + 1)^alpha; ranks map to item indices through
/// the identity or a seeded permutation.
#[derive(Debug, Clone)]
pub struct Popularity {
    zipf: Zipf<f64>,
    last: u32,
    perm: Option<Vec<u32>>,
}

impl Popularity {
    /// Build the distribution; `permute_seed` draws the rank-to-item permutation.
    pub fn new(n: u32, alpha: f64, permute_seed: Option<u64>) -> Result<Self, PopularityError> {
        let zipf = Zipf::new(f64::from(n), alpha).map_err(|err| PopularityError::Zipf {
            n,
            alpha,
            err,
        })?;
        let perm = permute_seed.map(|seed| {
            let mut p: Vec<u32> = (0..n).collect();
            p.shuffle(&mut SmallRng::seed_from_u64(seed));
            p
        });
        Ok(Popularity {
            zipf,
            last: n.saturating_sub(1),
            perm,
        })
    }

    /// Draw a 0-based popularity rank.
    #[inline]
    pub fn rank<R: rand::Rng + ?Sized>(&self, rng: &mut R) -> u32 {
        // The sampler returns an integral float in [1, n].
        let r = self.zipf.sample(rng) as u32;
        r.saturating_sub(1).min(self.last)
    }

    /// Draw an item index (the rank mapped through the permutation).
    #[inline]
    pub fn sample<R: rand::Rng + ?Sized>(&self, rng: &mut R) -> u32 {
        let r = self.rank(rng);
        match &self.perm {
            Some(p) => p[r as usize],
            None => r,
        }
    }
}

/// CPU time this thread has used.
fn thread_cpu_time() -> Duration {
    // SAFETY: clock_gettime fills the zeroed timespec it is given.
    let mut ts: libc::timespec = unsafe { std::mem::zeroed() };
    // SAFETY: ts is a valid timespec to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// Speed of [`Popularity::sample`], in samples per second.
#[derive(Debug, Clone, Copy)]
pub struct SamplerSpeed {
    /// Per second of wall time (lower when other processes share the CPU).
    pub wall: f64,
    /// Per second of this thread's CPU time.
    pub cpu: f64,
}

/// Measure [`Popularity::sample`] over `samples` draws, after a warm-up on
/// a tenth as many (the hidden `--bench-sampler` flag prints this).
pub fn sampler_speed(
    n: u32,
    alpha: f64,
    samples: u64,
    seed: u64,
) -> Result<SamplerSpeed, PopularityError> {
    let pop = Popularity::new(n, alpha, Some(seed))?;
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut acc = 0u64;
    for _ in 0..samples / 10 {
        acc = acc.wrapping_add(u64::from(pop.sample(&mut rng)));
    }
    let (wall0, cpu0) = (Instant::now(), thread_cpu_time());
    for _ in 0..samples {
        acc = acc.wrapping_add(u64::from(pop.sample(&mut rng)));
    }
    let (wall, cpu) = (wall0.elapsed(), thread_cpu_time().saturating_sub(cpu0));
    std::hint::black_box(acc);
    let per = |d: Duration| samples as f64 / d.as_secs_f64().max(1e-9);
    Ok(SamplerSpeed {
        wall: per(wall),
        cpu: per(cpu),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use statrs::function::gamma::gamma_ur;

    const N: u32 = 4000;
    const SAMPLES: u64 = 1_000_000;

    /// The exact Zipf pmf over ranks 0..n.
    fn pmf(n: u32, alpha: f64) -> Vec<f64> {
        let w: Vec<f64> = (1..=n).map(|k| f64::from(k).powf(-alpha)).collect();
        let total: f64 = w.iter().sum();
        w.into_iter().map(|x| x / total).collect()
    }

    /// Chi-square p-value of observed rank counts against the pmf. Ranks
    /// are pooled (in rank order) into bins of expected count >= 5, as the
    /// test requires.
    fn chi_square_p(counts: &[u64], pmf: &[f64], total: u64) -> f64 {
        let (mut stat, mut bins) = (0.0, 0u32);
        let (mut obs, mut exp) = (0.0, 0.0);
        for (c, p) in counts.iter().zip(pmf) {
            obs += *c as f64;
            exp += p * total as f64;
            if exp >= 5.0 {
                stat += (obs - exp) * (obs - exp) / exp;
                bins += 1;
                obs = 0.0;
                exp = 0.0;
            }
        }
        if exp > 0.0 {
            stat += (obs - exp) * (obs - exp) / exp;
            bins += 1;
        }
        // Survival function of chi-square with bins-1 degrees of freedom.
        gamma_ur(f64::from(bins - 1) / 2.0, stat / 2.0)
    }

    fn counts(pop: &Popularity, n: u32, seed: u64) -> Vec<u64> {
        let mut rng = SmallRng::seed_from_u64(seed);
        let mut c = vec![0u64; n as usize];
        for _ in 0..SAMPLES {
            c[pop.rank(&mut rng) as usize] += 1;
        }
        c
    }

    #[test]
    fn ranks_pass_chi_square_against_exact_pmf() {
        for (i, alpha) in [0.0, 0.5, 1.0, 1.5].into_iter().enumerate() {
            let pop = Popularity::new(N, alpha, None).unwrap();
            let c = counts(&pop, N, 0x5eed + i as u64);
            let p = chi_square_p(&c, &pmf(N, alpha), SAMPLES);
            assert!(p > 0.01, "alpha {alpha}: chi-square p = {p}");
        }
    }

    #[test]
    fn chi_square_detects_a_wrong_exponent() {
        let pop = Popularity::new(N, 1.0, None).unwrap();
        let c = counts(&pop, N, 7);
        assert!(chi_square_p(&c, &pmf(N, 0.95), SAMPLES) < 1e-6);
    }

    #[test]
    fn permutation_is_a_seeded_bijection() {
        let a = Popularity::new(1000, 1.0, Some(3)).unwrap();
        let b = Popularity::new(1000, 1.0, Some(3)).unwrap();
        let p = a.perm.clone().unwrap();
        assert_eq!(Some(&p), b.perm.as_ref());
        let mut sorted = p.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..1000).collect::<Vec<_>>());
        assert_ne!(p, (0..1000).collect::<Vec<_>>());
        let mut rng = SmallRng::seed_from_u64(1);
        for _ in 0..1000 {
            assert!(a.sample(&mut rng) < 1000);
        }
    }

    #[test]
    fn single_item_always_wins() {
        let pop = Popularity::new(1, 1.2, None).unwrap();
        let mut rng = SmallRng::seed_from_u64(1);
        assert!((0..100).all(|_| pop.sample(&mut rng) == 0));
    }
}
