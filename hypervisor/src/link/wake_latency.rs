//! The wake-latency histogram cells report in their `stats` totals
//! (`wake_us`) and the parent merges and reads quantiles from.
//!
//! An HDR histogram, to two significant digits: a quantile read from it is
//! within 1% of the latency measured (power-of-two buckets read 2.1 ms and
//! 4.0 ms both as "4,096 µs"). On the wire it is its recorded buckets,
//! `[[µs, count], ...]` ascending, each bucket named by the largest latency
//! it holds, so that recording that value again lands in the same bucket.

use std::time::Duration;

use hdrhistogram::Histogram;
use serde_json::{json, Value};
use thiserror::Error;

/// The longest latency told apart from longer ones: an hour, in µs.
pub const LONGEST_US: u64 = 3_600_000_000;
/// Significant digits of every latency the histogram keeps.
const SIGNIFICANT_DIGITS: u8 = 2;
/// Most wakes a cell's bucket may count: a hostile cell's larger counts are
/// refused rather than summed into every other cell's.
const MAX_COUNT: u64 = u32::MAX as u64;

/// Why a cell's `wake_us` was refused (nothing of it is added).
#[derive(Debug, Error, PartialEq, Eq)]
pub enum WakeLatencyError {
    /// Not an array of `[µs, count]` pairs of integers.
    #[error("wake_us is not a list of [microseconds, count] pairs")]
    Shape,
    /// More buckets than the histogram has.
    #[error("wake_us names {0} buckets, more than a histogram has")]
    TooLong(usize),
    /// A latency past [`LONGEST_US`], or not ascending.
    #[error("wake_us bucket {0} µs is out of order or past {LONGEST_US}")]
    Value(u64),
    /// A count of 0 or past [`MAX_COUNT`].
    #[error("wake_us counts {0} wakes in one bucket")]
    Count(u64),
}

/// Wake latencies in microseconds.
#[derive(Debug, Clone)]
pub struct WakeLatencies(Histogram<u64>);

impl Default for WakeLatencies {
    fn default() -> Self {
        Self::new()
    }
}

impl WakeLatencies {
    /// An empty histogram.
    pub fn new() -> Self {
        let histogram = Histogram::new_with_bounds(1, LONGEST_US, SIGNIFICANT_DIGITS)
            .expect("constant bounds are valid");
        WakeLatencies(histogram)
    }

    /// Counts a wake that took `took` (past [`LONGEST_US`] as that).
    pub fn record(&mut self, took: Duration) {
        let us = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
        self.0.saturating_record(us.max(1));
    }

    /// The `q` quantile (0..1) in µs, within 1%; None when empty.
    pub fn quantile(&self, q: f64) -> Option<u64> {
        (!self.0.is_empty()).then(|| self.0.value_at_quantile(q))
    }

    /// The recorded buckets, `[[µs, count], ...]` ascending.
    pub fn to_json(&self) -> Value {
        let pairs: Vec<Value> = self
            .0
            .iter_recorded()
            .map(|v| json!([v.value_iterated_to(), v.count_at_value()]))
            .collect();
        Value::Array(pairs)
    }

    /// Adds the buckets of `value` (as [`to_json`](Self::to_json) writes
    /// them), all or, if any is malformed, none.
    pub fn add_json(&mut self, value: &Value) -> Result<(), WakeLatencyError> {
        let pairs = value.as_array().ok_or(WakeLatencyError::Shape)?;
        if pairs.len() > self.0.distinct_values() {
            return Err(WakeLatencyError::TooLong(pairs.len()));
        }
        let mut theirs = Vec::with_capacity(pairs.len());
        let mut last = 0;
        for pair in pairs {
            let (us, count) = match pair.as_array().map(Vec::as_slice) {
                Some([us, count]) => (us.as_u64(), count.as_u64()),
                _ => return Err(WakeLatencyError::Shape),
            };
            let (us, count) = us.zip(count).ok_or(WakeLatencyError::Shape)?;
            if us <= last || us > self.0.highest_equivalent(LONGEST_US) {
                return Err(WakeLatencyError::Value(us));
            }
            if count == 0 || count > MAX_COUNT {
                return Err(WakeLatencyError::Count(count));
            }
            theirs.push((us, count));
            last = us;
        }
        for (us, count) in theirs {
            self.0.saturating_record_n(us, count);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn of_us(latencies: &[u64]) -> WakeLatencies {
        let mut h = WakeLatencies::new();
        for &us in latencies {
            h.record(Duration::from_micros(us));
        }
        h
    }

    #[test]
    fn quantiles_read_within_one_percent_where_powers_of_two_could_not() {
        // 2.1 ms and 3.9 ms fell in one power-of-two bucket (read as 4,096 µs).
        let h = of_us(&[2_100, 2_100, 2_100, 3_900, 3_900]);
        let p50 = h.quantile(0.5).unwrap();
        let p99 = h.quantile(0.99).unwrap();
        assert!((2_100..=2_121).contains(&p50), "{p50}");
        assert!((3_900..=3_939).contains(&p99), "{p99}");
        assert_eq!(h.0.len(), 5);
        assert_eq!(WakeLatencies::new().quantile(0.5), None);
        // Longer than an hour is counted as an hour, a zero as 1 µs.
        let ends = of_us(&[0, u64::MAX / 2]);
        assert_eq!(ends.quantile(0.0), Some(1));
        assert!(ends.quantile(1.0).unwrap() >= LONGEST_US);
    }

    #[test]
    fn cells_histograms_merge_through_their_json_as_if_recorded_in_one() {
        let (a, b) = (of_us(&[900, 1_500, 70_000]), of_us(&[3, 1_900, 1_500]));
        let mut merged = WakeLatencies::new();
        merged.add_json(&a.to_json()).unwrap();
        merged.add_json(&b.to_json()).unwrap();
        let all = of_us(&[900, 1_500, 70_000, 3, 1_900, 1_500]);
        assert_eq!(merged.to_json(), all.to_json());
        for q in [0.0, 0.5, 0.9, 0.99, 1.0] {
            assert_eq!(merged.quantile(q), all.quantile(q));
        }
    }

    #[test]
    fn a_malformed_histogram_adds_nothing() {
        let mut h = of_us(&[1_000]);
        let before = h.to_json();
        for (bad, error) in [
            (json!({"1000": 1}), WakeLatencyError::Shape),
            (json!([[1000, 1], [2000]]), WakeLatencyError::Shape),
            (json!([[1000, 1], [-5, 1]]), WakeLatencyError::Shape),
            (json!([[2000, 1], [1000, 1]]), WakeLatencyError::Value(1000)),
            (json!([[1000, 1], [2000, 0]]), WakeLatencyError::Count(0)),
            (json!([[1000, u64::MAX]]), WakeLatencyError::Count(u64::MAX)),
        ] {
            assert_eq!(h.add_json(&bad), Err(error), "{bad}");
            assert_eq!(h.to_json(), before, "{bad}");
        }
        let past = h.0.highest_equivalent(LONGEST_US) + 1;
        let longest = json!([[1000, 1], [past, 1]]);
        assert_eq!(h.add_json(&longest), Err(WakeLatencyError::Value(past)));
        let buckets = h.0.distinct_values();
        let many = Value::Array((1..=buckets as u64 + 1).map(|us| json!([us, 1])).collect());
        assert_eq!(
            h.add_json(&many),
            Err(WakeLatencyError::TooLong(buckets + 1))
        );
        assert_eq!(h.to_json(), before);
    }
}
