//! Keeps a guest that burns CPU without serving from taking it from the
//! others: its vCPU thread is moved to SCHED_IDLE, where it runs only on CPU
//! time no other thread wants, and any waking neighbour preempts it at once.
//!
//! A web guest spends its CPU on requests, tens of microseconds each. A
//! guest that spins, floods its ring or rewrites its memory in a loop uses
//! whole cores and serves nothing. Every [`PERIOD`] each live vCPU's thread
//! CPU time is read and set against the requests the VM served, as the host
//! can vouch for them (never the guest's own counter: a guest that spins
//! while counting requests it never answered is judged on the responses
//! the host carried, see `event_loop`); a thread is
//! demoted when it used more than [`DEMOTE_SHARE`] of a core at more than
//! [`HOG_CPU_PER_REQUEST`] per request. The threads live in the holders,
//! where a read costs a file of /proc: a holder whose whole process used
//! less than [`DEMOTE_SHARE`] in the period can hold no hog, so its
//! threads are not read (their next read only sets a new baseline). A demoted thread
//! is judged by the time it was runnable (on a CPU or waiting for one, from
//! the kernel's schedstat): a spinner starved by busy neighbours uses little
//! CPU but still wants all of it, and must not be restored for that. It is
//! restored when what it wants falls below [`RESTORE_SHARE`] or it serves. A
//! demoted guest keeps running: on an idle host it loses nothing.
//!
//! A demoted thread also leaves its cell's CPU for every CPU densevm may use
//! ([`VcpuCpus`]), and comes back when restored: pinned beside its own
//! cell's threads, it took their CPU's idle moments.

use crate::cell::microvm::MicroVm;
use crate::scheduling::VcpuCpus;
use std::time::{Duration, Instant};

/// How often the vCPUs' CPU use is looked at.
pub const PERIOD: Duration = Duration::from_millis(250);
/// Share of a core above which a vCPU that serves little is demoted.
pub const DEMOTE_SHARE: f64 = 0.5;
/// Share of a core below which a demoted vCPU is restored.
const RESTORE_SHARE: f64 = 0.25;
/// CPU per served request above which a busy vCPU counts as not serving
/// (a web guest needs tens of microseconds).
const HOG_CPU_PER_REQUEST: Duration = Duration::from_millis(1);

/// What the governor last saw of one VM.
#[derive(Debug, Default, Clone, Copy)]
struct Sample {
    cpu: Duration,
    requests: u64,
    /// Runnable time at the last look, while in the background.
    runnable: Option<Duration>,
    background: bool,
    /// Times this VM's vCPU was demoted.
    demotions: u64,
}

/// Whether a vCPU should run in the background, from what it did in the
/// last period: `share` of a core, `cpu` used (or wanted, in the
/// background) for `requests` served.
fn hogging(background: bool, share: f64, cpu: Duration, requests: u64) -> bool {
    let threshold = if background {
        RESTORE_SHARE
    } else {
        DEMOTE_SHARE
    };
    share > threshold && cpu > HOG_CPU_PER_REQUEST * requests.min(u32::MAX as u64) as u32
}

/// Per-cell governor over its VMs' vCPU threads.
pub struct CpuGovernor {
    cpus: VcpuCpus,
    last: Instant,
    samples: Vec<Sample>,
    demotions: u64,
}

impl CpuGovernor {
    /// A governor that has seen nothing yet, moving demoted vCPUs between
    /// `cpus`.
    pub fn new(cpus: VcpuCpus) -> Self {
        CpuGovernor {
            cpus,
            last: Instant::now(),
            samples: Vec::new(),
            demotions: 0,
        }
    }

    /// When the next look is due.
    pub fn due(&self) -> Instant {
        self.last + PERIOD
    }

    /// Times a vCPU was moved to the background so far.
    pub fn demotions(&self) -> u64 {
        self.demotions
    }

    /// Whether VM `index` runs in the background now.
    pub fn is_background(&self, index: usize) -> bool {
        self.samples.get(index).is_some_and(|s| s.background)
    }

    /// Times VM `index`'s vCPU was moved to the background so far.
    pub fn demotions_of(&self, index: usize) -> u64 {
        self.samples.get(index).map_or(0, |s| s.demotions)
    }

    /// VM `index` has a new vCPU thread (woken) or none (hibernated): what
    /// was seen of the old one no longer applies; its demotions stay counted.
    pub fn new_thread(&mut self, index: usize) {
        if let Some(sample) = self.samples.get_mut(index) {
            *sample = Sample {
                demotions: sample.demotions,
                ..Sample::default()
            };
        }
    }

    /// Looks at every VM if a period has passed. `vm(index)` gives the live
    /// VM at `index`, the requests it has served in all, and whether its
    /// holder was busy enough in the period to hold a hog.
    pub fn tick<'a>(
        &mut self,
        count: usize,
        mut vm: impl FnMut(usize) -> Option<(&'a MicroVm, u64, bool)>,
    ) {
        let now = Instant::now();
        let elapsed = now.duration_since(self.last);
        if elapsed < PERIOD {
            return;
        }
        self.last = now;
        self.samples.resize(count, Sample::default());
        for (index, sample) in self.samples.iter_mut().enumerate() {
            let Some((live, requests, may_hog)) = vm(index) else {
                continue;
            };
            if !may_hog && !sample.background {
                sample.cpu = Duration::ZERO;
                continue;
            }
            let Some(cpu) = live.vcpu.cpu_time() else {
                continue;
            };
            let mut used = cpu.saturating_sub(sample.cpu);
            let served = requests.saturating_sub(sample.requests);
            let first_look = sample.cpu.is_zero();
            sample.cpu = cpu;
            sample.requests = requests;
            if first_look {
                continue;
            }
            if sample.background {
                let runnable = live.vcpu.runnable_time();
                if let (Some(now), Some(before)) = (runnable, sample.runnable) {
                    used = used.max(now.saturating_sub(before));
                }
                sample.runnable = runnable;
            }
            let share = used.as_secs_f64() / elapsed.as_secs_f64();
            let background = hogging(sample.background, share, used, served);
            if background != sample.background && live.vcpu.set_background(background).is_ok() {
                let cpus = match background {
                    true => &self.cpus.background,
                    false => &self.cpus.home,
                };
                // Left where it was, it is still demoted: SCHED_IDLE.
                let _ = live.vcpu.set_cpus(cpus);
                sample.background = background;
                sample.runnable = live.vcpu.runnable_time().filter(|_| background);
                if background {
                    self.demotions += 1;
                    sample.demotions += 1;
                    crate::log!(
                        "densevm: VM {} used {:.0}% of a core serving {} requests; its vCPU now runs in the background",
                        live.id,
                        share * 100.0,
                        served
                    );
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn a_spinning_vcpu_is_demoted_and_a_serving_one_is_not() {
        assert!(hogging(false, 1.0, 250 * MS, 0));
        // 2,500 requests in 250 ms of CPU: 100 us each, a busy web guest.
        assert!(!hogging(false, 1.0, 250 * MS, 2_500));
        assert!(
            !hogging(false, 0.3, 75 * MS, 0),
            "a modest share is left alone"
        );
    }

    #[test]
    fn a_demoted_vcpu_comes_back_when_it_calms_down_or_serves() {
        assert!(
            hogging(true, 0.3, 75 * MS, 0),
            "between the thresholds it stays"
        );
        assert!(!hogging(true, 0.2, 50 * MS, 0));
        assert!(!hogging(true, 1.0, 250 * MS, 1_000));
    }
}
