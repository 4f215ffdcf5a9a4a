//! Per-VM and total counters, and fault-latency histograms.
//!
//! Per-VM histograms are compact log-linear bucket arrays (512 bytes each,
//! 4 buckets per power of two, so percentiles are within ~19%): thousands of
//! VMs must not cost megabytes each. Totals use an HDR histogram.

use hdrhistogram::Histogram;
use serde_json::{json, Value};

const SUB: u32 = 4;
const BUCKETS: usize = 32 * SUB as usize;

/// Log-linear latency histogram in microseconds.
#[derive(Debug, Clone)]
pub struct LogHist {
    counts: [u32; BUCKETS],
    count: u64,
    max: u64,
}

impl Default for LogHist {
    fn default() -> Self {
        LogHist {
            counts: [0; BUCKETS],
            count: 0,
            max: 0,
        }
    }
}

impl LogHist {
    fn bucket(v: u64) -> usize {
        if v < SUB as u64 {
            return v as usize;
        }
        let p = 63 - v.leading_zeros();
        let sub = (v >> (p - 2)) & (SUB as u64 - 1);
        ((p - 1) * SUB + sub as u32).min(BUCKETS as u32 - 1) as usize
    }

    fn upper(i: usize) -> u64 {
        let i = i as u32;
        if i < SUB {
            return i as u64;
        }
        let p = i / SUB + 1;
        let sub = (i % SUB) as u64;
        ((SUB as u64 + sub + 1) << (p - 2)) - 1
    }

    /// Records one latency.
    pub fn record(&mut self, us: u64) {
        let i = Self::bucket(us);
        self.counts[i] = self.counts[i].saturating_add(1);
        self.count += 1;
        self.max = self.max.max(us);
    }

    fn quantile(&self, q: f64) -> u64 {
        if self.count == 0 {
            return 0;
        }
        let target = ((self.count as f64) * q).ceil().max(1.0) as u64;
        let mut seen = 0u64;
        for (i, &c) in self.counts.iter().enumerate() {
            seen += c as u64;
            if seen >= target {
                return Self::upper(i).min(self.max);
            }
        }
        self.max
    }

    /// `{p50,p90,p99,max,count}`.
    pub fn to_json(&self) -> Value {
        json!({
            "p50": self.quantile(0.5), "p90": self.quantile(0.9), "p99": self.quantile(0.99),
            "max": self.max, "count": self.count,
        })
    }
}

/// Counters of one VM (or of all VMs).
#[derive(Debug, Clone, Default)]
pub struct VmCounters {
    /// Missing-page faults served (each may install several blocks).
    pub faults: u64,
    /// Write-protect faults (first write to a clean block).
    pub wp_faults: u64,
    /// Missing-block faults raised by a write (the block comes in dirty).
    pub write_faults: u64,
    /// Blocks installed.
    pub blocks_in: u64,
    /// Blocks evicted.
    pub blocks_out: u64,
    /// Times the VM was hibernated (`Pager::hibernate`).
    pub hibernations: u64,
    /// Blocks its hibernations evicted (also counted in `blocks_out`).
    pub hibernated_blocks_out: u64,
    /// Bytes read from swap.
    pub swap_read_bytes: u64,
    /// Bytes written to swap.
    pub swap_write_bytes: u64,
    /// Time in swap I/O, including modeled disk time (seconds).
    pub io_seconds: f64,
    /// Fault latency.
    pub latency: LogHist,
}

impl VmCounters {
    /// Records one served fault that installed `blocks` blocks, `read_bytes`
    /// of them read from swap.
    pub fn record_fault(&mut self, blocks: u64, read_bytes: u64, io_seconds: f64, latency_us: u64) {
        self.faults += 1;
        self.blocks_in += blocks;
        self.swap_read_bytes += read_bytes;
        self.io_seconds += io_seconds;
        self.latency.record(latency_us);
    }

    /// The counters as JSON (without resident/budget, which the caller adds).
    pub fn to_json(&self) -> Value {
        json!({
            "faults": self.faults,
            "wp_faults": self.wp_faults,
            "write_faults": self.write_faults,
            "blocks_in": self.blocks_in,
            "blocks_out": self.blocks_out,
            "hibernations": self.hibernations,
            "hibernated_blocks_out": self.hibernated_blocks_out,
            "swap_read_bytes": self.swap_read_bytes,
            "swap_write_bytes": self.swap_write_bytes,
            "io_seconds": self.io_seconds,
            "fault_latency_us": self.latency.to_json(),
        })
    }
}

/// Total fault-latency histogram (HDR, 3 significant digits, 1 µs..1 h).
#[derive(Debug, Clone)]
pub struct TotalLatency(Histogram<u64>);

impl Default for TotalLatency {
    fn default() -> Self {
        TotalLatency(
            Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("static bounds are valid"),
        )
    }
}

impl TotalLatency {
    /// Records one latency (saturating at the upper bound).
    pub fn record(&mut self, us: u64) {
        self.0.saturating_record(us.max(1));
    }

    /// `{p50,p90,p99,max,count}`.
    pub fn to_json(&self) -> Value {
        let h = &self.0;
        json!({
            "p50": h.value_at_quantile(0.5), "p90": h.value_at_quantile(0.9),
            "p99": h.value_at_quantile(0.99), "max": h.max(), "count": h.len(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loghist_quantiles_bound_values() {
        let mut h = LogHist::default();
        for v in 1..=1000u64 {
            h.record(v);
        }
        let j = h.to_json();
        let p50 = j["p50"].as_u64().unwrap();
        assert!((500..=600).contains(&p50), "{p50}");
        assert_eq!(j["max"], 1000);
        assert_eq!(j["count"], 1000);
        for v in [0u64, 1, 3, 4, 5, 7, 8, 100, 12345, 1 << 40] {
            let i = LogHist::bucket(v);
            assert!(
                LogHist::upper(i) >= v.min(LogHist::upper(BUCKETS - 1)),
                "{v}"
            );
            if i > 0 && v < (1 << 30) {
                assert!(LogHist::upper(i - 1) < v, "{v}");
            }
        }
    }
}
