//! Hibernation of a cell's idle VMs (`--idle-after`, `--max-live`): which
//! VMs go to sleep, and the counts and wake latencies the stats report.
//! Past `--max-live` the parent's cut over every cell's report decides
//! (`link::idle_profile`), so the host's least recently used VMs go first.
//!
//! A hibernated VM keeps its memory (which the pager moves to swap), its
//! rings and its listener; its holder releases its vCPU, thread and KVM VM.
//! Its next connection wakes it on a new vCPU (`holder::ToHolder::Wake`).

use crate::config::Hibernation;
use crate::holder::builder::Start;
use crate::link::idle_profile::{IdleProfile, Now};
use crate::link::wake_latency::WakeLatencies;
use serde_json::{json, Value};
use std::collections::{HashSet, VecDeque};
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

/// How a cell's VMs created asleep start at their first wake. With clone
/// boot the first VM of the run boots as the image's template and is
/// hibernated as soon as it is ready; the parent says when the pager has
/// saved it. Until then no VM takes a connection, so nothing a client sends
/// reaches a guest before the memory every clone starts from is fixed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FirstStart {
    /// The template is being saved: first wakes wait, their connections
    /// held.
    AwaitTemplate,
    /// Each boots from the image's entry.
    Boot,
    /// Each starts as a clone, on a copy of the template's memory.
    Clone,
}

impl FirstStart {
    /// How the VMs of a cell started with `hibernation` first start.
    pub fn at_start(hibernation: Option<&Hibernation>) -> FirstStart {
        match hibernation {
            Some(h) if h.clone_boot => FirstStart::AwaitTemplate,
            _ => FirstStart::Boot,
        }
    }

    /// The start of a VM created asleep now, if it may start.
    pub fn start(self) -> Option<Start> {
        match self {
            FirstStart::AwaitTemplate => None,
            FirstStart::Boot => Some(Start::Boot),
            FirstStart::Clone => Some(Start::Clone),
        }
    }
}

/// How often to look for idle VMs: often enough that a VM sleeps within
/// half its idle time of being due.
pub fn sweep_interval(hibernation: &Hibernation) -> Duration {
    (hibernation.idle_after / 2).min(SWEEP_MAX)
}

/// Whom a look puts to sleep.
#[derive(Debug, Clone)]
pub struct Choice {
    /// The VMs, least recently used first.
    pub vms: Vec<Candidate>,
    /// How many of the first are past the cap, which wants them asleep at
    /// once; the others are due by the timer alone, and may be spread out.
    pub capped: usize,
}

impl Choice {
    /// The VMs' indices, least recently used first.
    pub fn indices(&self) -> Vec<usize> {
        self.vms.iter().map(|c| c.index).collect()
    }

    /// The VMs to put to sleep at once.
    pub fn at_once(&self) -> &[Candidate] {
        &self.vms[..self.capped]
    }

    /// The VMs that may go over the interval to the next look.
    pub fn spread(&self) -> &[Candidate] {
        &self.vms[self.capped..]
    }
}

/// The VMs to hibernate now, least recently used first: every unused VM idle
/// for `idle_after`, and those `cap` takes.
pub fn choose(candidates: &[Candidate], idle_after: Duration, cap: Cap, now: &Now) -> Choice {
    let sleepers = sleepers(candidates);
    let due = sleepers
        .iter()
        .take_while(|c| now.instant.saturating_duration_since(c.last_active) >= idle_after)
        .count();
    let awake = candidates.iter().filter(|c| c.awake).count();
    let capped = match cap {
        Cap::None => 0,
        Cap::Local { share } => awake.saturating_sub(share as usize),
        Cap::Global { cut, floor } => sleepers
            .iter()
            .take_while(|c| now.ms_of(c.last_active) <= cut)
            .count()
            .min(awake.saturating_sub(floor as usize)),
    };
    let count = due.max(capped).min(sleepers.len());
    Choice {
        vms: sleepers[..count].iter().map(|&&c| c).collect(),
        capped: capped.min(count),
    }
}

/// The unused awake VMs, least recently used first.
fn sleepers(candidates: &[Candidate]) -> Vec<&Candidate> {
    let mut sleepers: Vec<&Candidate> = candidates.iter().filter(|c| c.awake && c.unused).collect();
    sleepers.sort_by_key(|c| c.last_active);
    sleepers
}

/// What the cell reports for the parent's next cut once `chosen` sleep:
/// its VMs awake but those, and of its unused ones the least recently used
/// that it would let sleep past `floor`.
pub fn profile(candidates: &[Candidate], chosen: &[usize], floor: u32, now: &Now) -> IdleProfile {
    let going: HashSet<usize> = chosen.iter().copied().collect();
    let awake = candidates.iter().filter(|c| c.awake).count() - going.len();
    let eligible = awake.saturating_sub(floor as usize);
    let idle = sleepers(candidates)
        .into_iter()
        .filter(|c| !going.contains(&c.index))
        .take(eligible)
        .map(|c| c.last_active);
    IdleProfile::of(awake as u32, idle, now)
}

/// The VMs a look found due by the timer alone, put to sleep one at a time
/// over the first half of the interval to the next look instead of all at
/// once (those past `--max-live` go at once, [`Choice::at_once`]). At 100 wakes a
/// second with `--idle-after 1`, a look every 0.5 s found some 50 VMs due:
/// parking them, releasing their KVM VMs and the pager's eviction of their
/// blocks came as one burst on two cores, and the wakes meanwhile waited
/// (the slowest wakes came in runs of consecutive VMs, one run per look).
#[derive(Debug, Default)]
pub struct SleepQueue {
    /// The VMs chosen, each with when it was last in use when chosen.
    due: VecDeque<(usize, Instant)>,
    /// Those VMs.
    queued: HashSet<usize>,
    /// When the next one goes.
    next_at: Option<Instant>,
    /// Between two.
    pace: Duration,
}

impl SleepQueue {
    /// Adds the VMs a look at `now` chose, and spreads those waiting over
    /// half of `interval`.
    pub fn refill(&mut self, chosen: &[Candidate], interval: Duration, now: Instant) {
        for c in chosen {
            if self.queued.insert(c.index) {
                self.due.push_back((c.index, c.last_active));
            }
        }
        if self.due.is_empty() {
            return;
        }
        self.pace = interval / 2 / self.due.len() as u32;
        self.next_at.get_or_insert(now);
    }

    /// When the next VM goes, if any waits.
    pub fn next_due(&self) -> Option<Instant> {
        self.next_at
    }

    /// The VM whose turn it is at `now`, with when it was last in use when
    /// chosen: the caller puts it to sleep only if it has not been in use
    /// since. At most one a turn, and behind time by one pace at most, so a
    /// late turn does not make a burst again.
    pub fn pop_due(&mut self, now: Instant) -> Option<(usize, Instant)> {
        let at = self.next_at.filter(|&at| at <= now)?;
        let (index, last_active) = self.due.pop_front()?;
        self.queued.remove(&index);
        self.next_at = match self.due.is_empty() {
            true => None,
            false => Some(at.max(now.checked_sub(self.pace).unwrap_or(now)) + self.pace),
        };
        Some((index, last_active))
    }
}

/// How a cell applies `--max-live`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cap {
    /// No cap.
    None,
    /// No cut from the parent yet: the cell's even share of the cap is its
    /// cap.
    Local {
        /// Its share.
        share: u32,
    },
    /// The parent's cut over every cell ([`crate::link::idle_profile::global_cut`]): unused VMs last
    /// in use at or before this CLOCK_MONOTONIC millisecond sleep (0: none
    /// need to), while more than `floor` are awake.
    Global {
        /// The cut.
        cut: u64,
        /// What the cell keeps awake whatever the cut.
        floor: u32,
    },
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
    wake_us: WakeLatencies,
}

impl SleepStats {
    /// Counts a wake that took `took`.
    pub fn record_wake(&mut self, took: Duration) {
        self.wakes += 1;
        self.wake_us.record(took);
    }

    /// The counters for the `stats` totals (the parent adds the cells' up).
    pub fn totals(&self) -> Value {
        json!({
            "hibernations": self.hibernations,
            "wakes": self.wakes,
            "wake_failures": self.wake_failures,
            "wake_us": self.wake_us.to_json(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn choose_ms(vms: &[Candidate], idle_ms: u64, share: Option<u32>, now: &Now) -> Vec<usize> {
        let cap = share.map_or(Cap::None, |share| Cap::Local { share });
        choose(vms, Duration::from_millis(idle_ms), cap, now).indices()
    }

    #[test]
    fn a_looks_choice_goes_to_sleep_spread_over_half_the_interval() {
        let now = Now::read();
        let vms: Vec<Candidate> = (0..4).map(|i| candidate(i, 2_000, &now)).collect();
        let mut queue = SleepQueue::default();
        let t0 = now.instant;
        let interval = Duration::from_millis(400);
        queue.refill(&vms, interval, t0);
        // Chosen again by the next look before its turn: queued once.
        queue.refill(&vms[1..2], interval, t0);
        let at = |ms| t0 + Duration::from_millis(ms);
        assert_eq!(queue.pop_due(t0), Some((0, vms[0].last_active)));
        assert_eq!(queue.pop_due(t0), None, "one at a time");
        assert_eq!(queue.next_due(), Some(at(50)));
        assert_eq!(queue.pop_due(at(50)).map(|(i, _)| i), Some(1));
        // A turn 120 ms late: the time kept is a pace behind at most, so one
        // more may follow at once, and the pace again after it.
        assert_eq!(queue.pop_due(at(220)).map(|(i, _)| i), Some(2));
        assert_eq!(queue.next_due(), Some(at(220)));
        assert_eq!(queue.pop_due(at(220)).map(|(i, _)| i), Some(3));
        assert_eq!(queue.next_due(), None);
        assert_eq!(queue.pop_due(at(1_000)), None);
    }

    #[test]
    fn each_cell_keeps_an_even_share_of_max_live() {
        let split = Hibernation {
            idle_after: Duration::from_secs(1),
            max_live: Some(7),
            cells: 3,
            clone_boot: false,
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
        // Only awake VMs hold descriptors: one cell may hold all the cap
        // allows, at most its capacity, or every VM without a cap.
        assert_eq!(split.vms_with_fds(8000), 7);
        assert_eq!(split.vms_with_fds(2), 2);
        let uncapped = Hibernation {
            max_live: None,
            ..split
        };
        assert_eq!(uncapped.vms_with_fds(8000), 8000);
    }

    fn candidate(index: usize, idle_ms: u64, now: &Now) -> Candidate {
        Candidate {
            index,
            awake: true,
            unused: true,
            last_active: now.instant - Duration::from_millis(idle_ms),
        }
    }

    #[test]
    fn only_unused_vms_idle_long_enough_sleep() {
        let now = Now::read();
        let mut busy = candidate(2, 5_000, &now);
        busy.unused = false;
        let mut asleep = candidate(3, 5_000, &now);
        asleep.awake = false;
        let vms = [
            candidate(0, 100, &now),
            candidate(1, 2_000, &now),
            busy,
            asleep,
        ];
        assert_eq!(choose_ms(&vms, 1_000, None, &now), vec![1]);
    }

    #[test]
    fn past_the_cap_the_least_recently_used_sleep_first() {
        let now = Now::read();
        let vms: Vec<Candidate> = [30, 10, 50, 20, 40]
            .iter()
            .enumerate()
            .map(|(i, &ms)| candidate(i, ms, &now))
            .collect();
        // Five awake, at most three: the two idle longest go, oldest first.
        assert_eq!(choose_ms(&vms, 60_000, Some(3), &now), vec![2, 4]);
        assert!(choose_ms(&vms, 60_000, Some(5), &now).is_empty());
    }

    #[test]
    fn the_cap_never_takes_a_vm_in_use() {
        let now = Now::read();
        let mut vms: Vec<Candidate> = (0..4).map(|i| candidate(i, 10, &now)).collect();
        vms.iter_mut().take(3).for_each(|c| c.unused = false);
        assert_eq!(choose_ms(&vms, 60_000, Some(1), &now), vec![3]);
    }

    #[test]
    fn past_its_floor_a_cell_hibernates_what_the_cut_takes_and_reports_the_rest() {
        let now = Now::read();
        // 20 awake VMs idle 1..20 s (VM i idle i + 1 s).
        let vms: Vec<Candidate> = (0..20)
            .map(|i| candidate(i, (i as u64 + 1) * 1000, &now))
            .collect();
        let long = Duration::from_secs(3600);
        let ago = |s: u64| now.ms_of(now.instant - Duration::from_secs(s));
        let cut = |cut, floor| Cap::Global { cut, floor };
        let choice = choose(&vms, long, cut(ago(19), 2), &now);
        assert_eq!(choice.at_once().len(), 2, "the cut's go at once");
        let chosen = choice.indices();
        // It reports the 18 left awake, of which 16 may sleep past its floor
        // of 2: the oldest 16, idle 3..18 s.
        let report = profile(&vms, &chosen, 2, &now);
        assert_eq!(report.awake, 18);
        assert_eq!(report.points.first().unwrap(), &(ago(18), 1));
        assert_eq!(report.points.last().unwrap(), &(ago(3), 16));
        // Its floor it keeps whatever the cut: a lying neighbour cannot take
        // a cell's every VM.
        assert_eq!(
            choose(&vms, long, cut(u64::MAX, 19), &now).indices(),
            vec![19]
        );
        // No cut needed: only the timer, whose choice may be spread out.
        assert!(choose(&vms, long, cut(0, 2), &now).vms.is_empty());
        let timer = Duration::from_millis(18_500);
        let choice = choose(&vms, timer, cut(0, 2), &now);
        assert_eq!(choice.indices(), vec![19, 18]);
        assert_eq!((choice.at_once().len(), choice.spread().len()), (0, 2));
    }
}
