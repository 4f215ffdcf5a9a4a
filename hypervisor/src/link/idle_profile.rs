//! `--max-live` over all cells: what each cell reports of its awake VMs
//! ([`IdleProfile`]) and the cut the parent answers with ([`global_cut`]),
//! so that the host's least recently used VMs sleep first, as under one
//! LRU, whichever cell holds them. Times cross the link as CLOCK_MONOTONIC
//! milliseconds ([`Now`]).

use serde::{Deserialize, Serialize};
use std::time::Instant;

/// Points of a profile: a cell's unused awake VMs at this many evenly
/// spaced ranks, so the cut falls within a 32nd of a cell's idle VMs.
pub const PROFILE_POINTS: usize = 32;

/// What a cell tells the parent of its awake VMs.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct IdleProfile {
    /// VMs awake (or waking, or parking).
    pub awake: u32,
    /// `(t, n)`: `n` of its unused awake VMs were last in use at or before
    /// CLOCK_MONOTONIC millisecond `t`; both increasing.
    pub points: Vec<(u64, u32)>,
}

impl IdleProfile {
    /// The profile of a cell with `awake` VMs awake, whose unused ones were
    /// last in use at `last_used`.
    pub fn of(awake: u32, last_used: impl Iterator<Item = Instant>, now: &Now) -> Self {
        let mut times: Vec<u64> = last_used.map(|at| now.ms_of(at)).collect();
        times.sort_unstable();
        let n = times.len();
        let steps = PROFILE_POINTS.min(n);
        let mut points: Vec<(u64, u32)> = (1..=steps)
            .map(|k| {
                let rank = (k * n).div_ceil(steps);
                (times[rank - 1], rank as u32)
            })
            .collect();
        // Of equal times, the larger count.
        points.dedup_by(|later, earlier| {
            let same = later.0 == earlier.0;
            if same {
                earlier.1 = later.1;
            }
            same
        });
        IdleProfile { awake, points }
    }

    /// Why the profile cannot be that of a cell of `capacity` VMs, if it
    /// cannot.
    pub fn check(&self, capacity: u32) -> Result<(), String> {
        let increasing = self
            .points
            .windows(2)
            .all(|w| w[0].0 < w[1].0 && w[0].1 < w[1].1);
        if self.points.len() > PROFILE_POINTS || !increasing {
            return Err(format!(
                "an idle profile of {} points that do not increase",
                self.points.len()
            ));
        }
        let idle = self.points.last().map_or(0, |p| p.1);
        if idle > self.awake || self.awake > capacity {
            return Err(format!(
                "an idle profile of {idle} idle of {} awake VMs in a cell of {capacity}",
                self.awake
            ));
        }
        Ok(())
    }

    /// Of its unused awake VMs, how many were last in use at or before `t`
    /// (rounded down to its points).
    fn idle_before(&self, t: u64) -> u32 {
        self.points
            .iter()
            .take_while(|p| p.0 <= t)
            .last()
            .map_or(0, |p| p.1)
    }
}

/// The cut for `--max-live` over the cells' latest profiles: the earliest
/// time at or before which, over all cells, as many unused VMs were last in
/// use as are awake past the cap; 0 when none are past it; the latest
/// reported time when too few are unused. Each cell then hibernates its VMs
/// last in use then or before, down to its floor (a quarter of its share
/// of the cap): an even split of the cap alone hibernated the popular VMs
/// of a cell that holds many.
pub fn global_cut<'a>(
    profiles: impl Iterator<Item = &'a IdleProfile> + Clone,
    max_live: u32,
) -> u64 {
    let awake: u64 = profiles.clone().map(|p| u64::from(p.awake)).sum();
    let excess = awake.saturating_sub(u64::from(max_live));
    if excess == 0 {
        return 0;
    }
    let mut times: Vec<u64> = profiles
        .clone()
        .flat_map(|p| p.points.iter().map(|point| point.0))
        .collect();
    times.sort_unstable();
    times.dedup();
    let idle_before =
        |t: u64| -> u64 { profiles.clone().map(|p| u64::from(p.idle_before(t))).sum() };
    let first = times.partition_point(|&t| idle_before(t) < excess);
    times.get(first).or(times.last()).copied().unwrap_or(0)
}

/// Now, as an `Instant` and as a CLOCK_MONOTONIC millisecond (which
/// `Instant` reads on Linux, and which every process of the host shares).
#[derive(Debug, Clone, Copy)]
pub struct Now {
    /// Now.
    pub instant: Instant,
    ms: u64,
}

impl Now {
    /// The clock now.
    pub fn read() -> Self {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        let instant = Instant::now();
        // SAFETY: clock_gettime writes the struct given.
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
        Now {
            instant,
            ms: ts.tv_sec as u64 * 1000 + ts.tv_nsec as u64 / 1_000_000,
        }
    }

    /// `at` (not after now) as a CLOCK_MONOTONIC millisecond.
    pub fn ms_of(&self, at: Instant) -> u64 {
        let ago = self.instant.saturating_duration_since(at).as_millis() as u64;
        self.ms.saturating_sub(ago)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A cell's profile: `awake` VMs, the unused ones idle `idle_s` seconds.
    fn profile(awake: u32, idle_s: &[u64], now: &Now) -> IdleProfile {
        let at = idle_s.iter().map(|&s| now.instant - Duration::from_secs(s));
        IdleProfile::of(awake, at, now)
    }

    fn ago(now: &Now, s: u64) -> u64 {
        now.ms_of(now.instant - Duration::from_secs(s))
    }

    #[test]
    fn a_profile_counts_the_idle_vms_by_when_they_were_last_used() {
        let now = Now::read();
        let idle: Vec<u64> = (2..=64).collect();
        let p = profile(64, &idle, &now);
        assert_eq!(p.awake, 64);
        assert_eq!(p.points.len(), PROFILE_POINTS);
        assert_eq!(p.points.last().unwrap().1, 63);
        assert!(p.check(64).is_ok());
        // The 2 oldest (64 and 63 s idle) were last used at or before 63 s ago.
        assert_eq!(p.idle_before(ago(&now, 63)), 2);
        assert_eq!(p.idle_before(0), 0);
        assert!(profile(3, &[], &now).points.is_empty());
    }

    #[test]
    fn a_profile_that_cannot_be_a_cells_is_refused() {
        let lying = |awake, points: Vec<(u64, u32)>| IdleProfile { awake, points };
        assert!(lying(5, vec![(10, 2), (20, 4)]).check(8).is_ok());
        assert!(lying(9, vec![]).check(8).is_err());
        assert!(lying(3, vec![(10, 2), (20, 4)]).check(8).is_err());
        assert!(lying(5, vec![(20, 2), (10, 4)]).check(8).is_err());
        assert!(lying(5, vec![(10, 4), (20, 4)]).check(8).is_err());
        let too_many = (1..=PROFILE_POINTS as u32 + 1)
            .map(|i| (u64::from(i), i))
            .collect();
        assert!(lying(40, too_many).check(40).is_err());
    }

    #[test]
    fn the_cut_takes_the_hosts_least_recently_used_whichever_cell_holds_them() {
        let now = Now::read();
        // A busy cell: 20 awake, idle 1..20 s; a quiet one: 4, idle 100..400 s.
        let busy = profile(20, &(1..=20).collect::<Vec<_>>(), &now);
        let quiet = profile(4, &[100, 200, 300, 400], &now);
        let both = || [&busy, &quiet].into_iter();
        // 24 awake, at most 21: the quiet cell's three oldest.
        assert_eq!(global_cut(both(), 21), ago(&now, 200));
        // At most 18: the quiet cell's four and the busy cell's two oldest.
        assert_eq!(global_cut(both(), 18), ago(&now, 19));
        // None past the cap.
        assert_eq!(global_cut(both(), 24), 0);
        // Fewer idle than the excess: every reported one.
        assert_eq!(global_cut([&busy].into_iter(), 0), ago(&now, 1));
    }
}
