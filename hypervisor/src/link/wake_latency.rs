//! The wake-latency histogram cells report in their `stats` totals
//! (`wake_us_log2`) and the parent sums and reads quantiles from.

/// Buckets: bucket `i` holds [2^i, 2^(i+1)) µs, the last everything longer
/// (8 s and more).
pub const BUCKETS: usize = 24;

/// The bucket of a latency of `us` microseconds.
pub fn bucket(us: u64) -> usize {
    (63 - us.max(1).leading_zeros() as usize).min(BUCKETS - 1)
}

/// The `q` quantile (0..1) of a histogram, as its bucket's upper bound in
/// microseconds; None when it is empty.
pub fn quantile(buckets: &[u64], q: f64) -> Option<u64> {
    let total: u64 = buckets.iter().sum();
    if total == 0 {
        return None;
    }
    let rank = ((q * total as f64).ceil() as u64).clamp(1, total);
    let mut seen = 0;
    for (i, &n) in buckets.iter().enumerate() {
        seen += n;
        if seen >= rank {
            return Some(1u64 << (i + 1));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latencies_land_in_their_power_of_two_and_quantiles_read_back() {
        let mut buckets = [0u64; BUCKETS];
        for us in [0, 3, 900, 1_500, 1_900, 70_000] {
            buckets[bucket(us)] += 1;
        }
        assert_eq!(
            (buckets[0], buckets[1], buckets[9], buckets[10], buckets[16]),
            (1, 1, 1, 2, 1)
        );
        assert_eq!(bucket(u64::MAX), BUCKETS - 1);
        assert_eq!(quantile(&buckets, 0.5), Some(1 << 10));
        assert_eq!(quantile(&buckets, 0.99), Some(1 << 17));
        assert_eq!(quantile(&[0; BUCKETS], 0.5), None);
    }
}
