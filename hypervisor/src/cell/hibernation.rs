//! Hibernation of a cell's idle VMs (`--idle-after`, `--max-live`): which
//! VMs go to sleep, and the counts and wake latencies the stats report.
//!
//! A hibernated VM keeps its memory (which the pager moves to swap), its
//! rings and its listener; its holder releases its vCPU, thread and KVM VM.
//! Its next connection wakes it on a new vCPU (`holder::ToHolder::Wake`).

use crate::config::Hibernation;
use crate::link::wake_latency;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// Longest between two looks for idle VMs.
const SWEEP_MAX: Duration = Duration::from_secs(1);

/// A VM as the choice of whom to hibernate sees it.
#[derive(Debug, Clone, Copy)]
pub struct Candidate {
    /// Its index in the cell.
    pub index: usize,
    /// It has a vCPU (or is getting one).
    pub awake: bool,
    /// It could sleep now: booted, running, nothing of it in use.
    pub unused: bool,
    /// When it was last in use.
    pub last_active: Instant,
}

/// How often to look for idle VMs: often enough that a VM sleeps within
/// half its idle time of being due.
pub fn sweep_interval(hibernation: &Hibernation) -> Duration {
    (hibernation.idle_after / 2).min(SWEEP_MAX)
}

/// The VMs to hibernate now, least recently used first: every unused VM idle
/// for `idle_after`, and past the cap on awake VMs as many more unused ones,
/// least recently used first, as bring the awake count down to it.
pub fn choose(
    candidates: &[Candidate],
    idle_after: Duration,
    max_live: Option<u32>,
    now: Instant,
) -> Vec<usize> {
    let mut sleepers: Vec<&Candidate> = candidates.iter().filter(|c| c.awake && c.unused).collect();
    sleepers.sort_by_key(|c| c.last_active);
    let due = sleepers
        .iter()
        .take_while(|c| now.saturating_duration_since(c.last_active) >= idle_after)
        .count();
    let awake = candidates.iter().filter(|c| c.awake).count();
    let over_cap = max_live.map_or(0, |cap| awake.saturating_sub(cap as usize));
    let count = due.max(over_cap).min(sleepers.len());
    sleepers[..count].iter().map(|c| c.index).collect()
}

/// A cell's hibernation counters.
#[derive(Debug, Default)]
pub struct SleepStats {
    /// VMs hibernated.
    pub hibernations: u64,
    /// VMs woken.
    pub wakes: u64,
    /// Wakes that failed (the VM is then stopped as crashed).
    pub wake_failures: u64,
    /// Wake latencies, from the ask to the holder's answer.
    wake_us: [u64; wake_latency::BUCKETS],
}

impl SleepStats {
    /// Counts a wake that took `took`.
    pub fn record_wake(&mut self, took: Duration) {
        self.wakes += 1;
        self.wake_us[wake_latency::bucket(took.as_micros() as u64)] += 1;
    }

    /// The counters for the `stats` totals (the parent adds the cells' up).
    pub fn totals(&self) -> Value {
        json!({
            "hibernations": self.hibernations,
            "wakes": self.wakes,
            "wake_failures": self.wake_failures,
            "wake_us_log2": self.wake_us.to_vec(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn choose_ms(
        vms: &[Candidate],
        idle_ms: u64,
        max_live: Option<u32>,
        now: Instant,
    ) -> Vec<usize> {
        choose(vms, Duration::from_millis(idle_ms), max_live, now)
    }

    #[test]
    fn max_live_is_split_over_the_cells_at_boot() {
        let split = Hibernation {
            idle_after: Duration::from_secs(1),
            max_live: Some(7),
            cells: 3,
        };
        let shares: Vec<_> = (0..4).map(|cell| split.cell_max_live(cell)).collect();
        assert_eq!(shares, [Some(3), Some(2), Some(2), Some(2)]);
        let few = Hibernation {
            max_live: Some(1),
            ..split
        };
        assert_eq!(few.cell_max_live(2), Some(1));
        assert_eq!(
            Hibernation {
                max_live: None,
                ..split
            }
            .cell_max_live(0),
            None
        );
        // Only awake VMs hold descriptors: a cell's share of the cap, at
        // most its capacity, or every VM without a cap.
        assert_eq!(split.vms_with_fds(0, 8000), 3);
        assert_eq!(split.vms_with_fds(0, 2), 2);
        let uncapped = Hibernation {
            max_live: None,
            ..split
        };
        assert_eq!(uncapped.vms_with_fds(0, 8000), 8000);
    }

    fn candidate(index: usize, idle_ms: u64, now: Instant) -> Candidate {
        Candidate {
            index,
            awake: true,
            unused: true,
            last_active: now - Duration::from_millis(idle_ms),
        }
    }

    #[test]
    fn only_unused_vms_idle_long_enough_sleep() {
        let now = Instant::now();
        let mut busy = candidate(2, 5_000, now);
        busy.unused = false;
        let mut asleep = candidate(3, 5_000, now);
        asleep.awake = false;
        let vms = [
            candidate(0, 100, now),
            candidate(1, 2_000, now),
            busy,
            asleep,
        ];
        assert_eq!(choose_ms(&vms, 1_000, None, now), vec![1]);
    }

    #[test]
    fn past_the_cap_the_least_recently_used_sleep_first() {
        let now = Instant::now();
        let vms: Vec<Candidate> = [30, 10, 50, 20, 40]
            .iter()
            .enumerate()
            .map(|(i, &ms)| candidate(i, ms, now))
            .collect();
        // Five awake, at most three: the two idle longest go, oldest first.
        assert_eq!(choose_ms(&vms, 60_000, Some(3), now), vec![2, 4]);
        assert!(choose_ms(&vms, 60_000, Some(5), now).is_empty());
    }

    #[test]
    fn the_cap_never_takes_a_vm_in_use() {
        let now = Instant::now();
        let mut vms: Vec<Candidate> = (0..4).map(|i| candidate(i, 10, now)).collect();
        vms.iter_mut().take(3).for_each(|c| c.unused = false);
        assert_eq!(choose_ms(&vms, 60_000, Some(1), now), vec![3]);
    }
}
