//! Keeps a guest that burns CPU without serving from taking it from the
//! others: its vCPU thread is moved to SCHED_IDLE, where it runs only on CPU
//! time no other thread wants, and any waking neighbour preempts it at once.
//!
//! A web guest spends its CPU on requests, tens of microseconds each. A
//! guest that spins, floods its ring or rewrites its memory in a loop uses
//! whole cores and serves nothing. Every [`PERIOD`] each live vCPU's thread
//! is read and set against the requests the VM served, as the host can
//! vouch for them (never the guest's own counter: a guest that spins while
//! counting requests it never answered is judged on the responses the host
//! carried, see `event_loop`). A thread is judged by the time it was
//! runnable (on a CPU or waiting for one, from the kernel's schedstat), not
//! only by the time it ran: four spinners sharing two busy cores each ran a
//! fifth of a core, under any threshold on CPU used, while each wanted a
//! whole one. It is demoted when it wanted more than [`DEMOTE_SHARE`] of a
//! core, ran more than [`LOOK_SHARE`] of one and more than
//! [`HOG_CPU_PER_REQUEST`] per request served, and restored when what it
//! wants falls below [`RESTORE_SHARE`] or it serves (schedstat counts a
//! wait only once it ends, so a demoted thread still runnable at the look,
//! starved by a loaded host, is not taken for a calm one). The threads live in
//! the holders, where a read costs a file of /proc: a holder whose whole
//! process ran less than [`LOOK_SHARE`] of a core in the period is not
//! looked into (its threads' next read only sets a new baseline). A demoted
//! guest keeps running: on an idle host it loses nothing. A vCPU that has
//! just started (a boot or a wake) is not judged before its first request
//! until it has run [`START_GRACE`].
//!
//! A demoted thread also leaves its cell's CPU for every CPU densevm may use
//! ([`VcpuCpus`]), and comes back when restored: pinned beside its own
//! cell's threads, it took their CPU's idle moments.

use crate::cell::microvm::MicroVm;
use crate::holder::ThreadTimes;
use crate::scheduling::VcpuCpus;
use std::time::{Duration, Instant};

/// How often the vCPUs' CPU use is looked at.
pub const PERIOD: Duration = Duration::from_millis(250);
/// Share of a core a vCPU must want to be demoted, if it serves little.
const DEMOTE_SHARE: f64 = 0.5;
/// Share of a core a holder's threads must have run together in a period
/// for them to be looked at: a spinner gets at least this much of two
/// cores unless some 40 other threads are runnable beside it.
pub const LOOK_SHARE: f64 = 0.05;
/// Share of a core below which a demoted vCPU is restored.
const RESTORE_SHARE: f64 = 0.25;
/// CPU per served request above which a busy vCPU counts as not serving
/// (a web guest needs tens of microseconds).
const HOG_CPU_PER_REQUEST: Duration = Duration::from_millis(1);
/// CPU a new vCPU thread (a boot, or a wake) may run before its first
/// request without being judged. Booting and loading its working set take a
/// guest milliseconds of CPU and serve nothing yet; on a loaded host the
/// thread also waits for a CPU all along, so without this every VM booting
/// during a burst looked like a spinner and was demoted, starved in the
/// background with its first client waiting, and the burst fed itself (a
/// sweep of first GETs at 50 a second over 100,000 VMs fell to 10 a second,
/// its wakes taking seconds). A guest that spins from its start is judged
/// after this much.
const START_GRACE: Duration = Duration::from_millis(100);

/// What the governor last saw of one VM.
#[derive(Debug, Clone, Copy)]
struct Sample {
    /// Its thread's times at the last look; `None` before the first.
    times: Option<ThreadTimes>,
    requests: u64,
    background: bool,
    /// Times this VM's vCPU was demoted.
    demotions: u64,
    /// CPU its thread ran before its first request ([`START_GRACE`]); `None`
    /// once it has served one or used the grace up.
    starting: Option<Duration>,
}

impl Sample {
    /// What is known of a VM before its thread's first look.
    fn new() -> Sample {
        Sample {
            times: None,
            requests: 0,
            background: false,
            demotions: 0,
            starting: Some(Duration::ZERO),
        }
    }

    /// Whether its thread is still starting (within [`START_GRACE`] before
    /// its first request) after a period in which it ran `ran` and served
    /// `served` requests.
    fn starting(&mut self, ran: Duration, served: u64) -> bool {
        let Some(before) = self.starting else {
            return false;
        };
        let used = before + ran;
        self.starting = (served == 0 && used <= START_GRACE).then_some(used);
        self.starting.is_some()
    }
}

/// What a vCPU thread did in the last period, as the governor saw it.
#[derive(Debug, Clone, Copy)]
struct Period {
    /// The period's length.
    length: Duration,
    /// CPU time it ran.
    ran: Duration,
    /// Time it was runnable (ran, or finished waiting for a CPU).
    wanted: Duration,
    /// Runnable at the look, and so waiting still (a demoted vCPU is only
    /// looked at for this): the wait in progress is not in `wanted`, as
    /// schedstat adds a wait once it ends. A demoted spinner on a loaded
    /// host ran 4 ms after 28 ms of waiting and then waited out the rest of
    /// the period, which read as 32 ms wanted: calm, restored.
    waiting: bool,
    /// Requests it served, as the host can vouch for them.
    requests: u64,
}

/// Whether a vCPU should run in the background (`background`: it does now)
/// from what it did in the last period.
fn hogging(background: bool, p: Period) -> bool {
    let share = |time: Duration| time.as_secs_f64() / p.length.as_secs_f64();
    let costly = |cpu: Duration| cpu > HOG_CPU_PER_REQUEST * p.requests.min(u32::MAX as u64) as u32;
    let (ran, wanted) = (p.ran, p.wanted);
    match background {
        // What it ran there is only what others left it; one still waiting
        // for a CPU at the look, serving nothing, wants more than it shows.
        true => (p.waiting && p.requests == 0) || (share(wanted) > RESTORE_SHARE && costly(wanted)),
        // One that barely ran took nothing from anyone, however long it
        // waited for a CPU on a loaded host.
        false => share(wanted) > DEMOTE_SHARE && share(ran) > LOOK_SHARE && costly(ran),
    }
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
                ..Sample::new()
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
        self.samples.resize(count, Sample::new());
        for (index, sample) in self.samples.iter_mut().enumerate() {
            let Some((live, requests, may_hog)) = vm(index) else {
                continue;
            };
            if !may_hog && !sample.background {
                sample.times = None;
                continue;
            }
            let Some(times) = live.vcpu.times() else {
                continue;
            };
            let served = requests.saturating_sub(sample.requests);
            sample.requests = requests;
            let Some(before) = sample.times.replace(times) else {
                continue;
            };
            let ran = times.on_cpu.saturating_sub(before.on_cpu);
            let wanted = times.runnable.saturating_sub(before.runnable);
            if sample.starting(ran, served) {
                continue;
            }
            let period = Period {
                length: elapsed,
                ran,
                wanted,
                waiting: sample.background && live.vcpu.runnable_now(),
                requests: served,
            };
            let background = hogging(sample.background, period);
            if background != sample.background && live.vcpu.set_background(background).is_ok() {
                let cpus = match background {
                    true => &self.cpus.background,
                    false => &self.cpus.home,
                };
                // Left where it was, it is still demoted: SCHED_IDLE.
                let _ = live.vcpu.set_cpus(cpus);
                sample.background = background;
                if background {
                    self.demotions += 1;
                    sample.demotions += 1;
                    crate::log!(
                        "densevm: VM {} wanted {:.0}% of a core serving {} requests; its vCPU now runs in the background",
                        live.id,
                        100.0 * wanted.as_secs_f64() / elapsed.as_secs_f64(),
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

    /// A period of 250 ms in which the thread ran `ran`, was runnable
    /// `wanted` and served `requests`.
    fn period(ran: Duration, wanted: Duration, requests: u64) -> Period {
        Period {
            length: 250 * MS,
            ran,
            wanted,
            waiting: false,
            requests,
        }
    }

    /// A new thread is not judged until it serves or runs past the grace;
    /// then it is, like any other.
    #[test]
    fn a_starting_vcpu_is_judged_after_its_first_request_or_its_grace() {
        let mut booting = Sample::new();
        assert!(booting.starting(40 * MS, 0));
        assert!(booting.starting(60 * MS, 0), "100 ms is within the grace");
        assert!(!booting.starting(MS, 0), "past it: judged");
        assert!(!booting.starting(Duration::ZERO, 0), "and from then on");
        let mut served = Sample::new();
        assert!(served.starting(10 * MS, 0));
        assert!(
            !served.starting(10 * MS, 1),
            "its first request ends the grace"
        );
        assert!(!served.starting(Duration::ZERO, 0));
    }

    #[test]
    fn a_spinning_vcpu_is_demoted_and_a_serving_one_is_not() {
        assert!(hogging(false, period(250 * MS, 250 * MS, 0)));
        // 2,500 requests in 250 ms of CPU: 100 us each, a busy web guest.
        assert!(!hogging(false, period(250 * MS, 250 * MS, 2_500)));
        assert!(
            !hogging(false, period(75 * MS, 75 * MS, 0)),
            "a modest share is left alone"
        );
    }

    #[test]
    fn a_spinner_starved_by_others_is_judged_by_what_it_wants() {
        // One of several spinners on busy cores: it ran a fifth of a core
        // and waited for the rest.
        assert!(hogging(false, period(50 * MS, 250 * MS, 0)));
        // A busy web guest waiting as long: 400 requests in 20 ms of CPU.
        assert!(!hogging(false, period(20 * MS, 250 * MS, 400)));
        // A guest that waited long for a CPU on a loaded host, then ran a
        // slow request.
        assert!(!hogging(false, period(5 * MS, 250 * MS, 1)));
    }

    #[test]
    fn a_demoted_vcpu_comes_back_when_it_calms_down_or_serves() {
        assert!(
            hogging(true, period(10 * MS, 75 * MS, 0)),
            "between the thresholds it stays"
        );
        assert!(!hogging(true, period(10 * MS, 50 * MS, 0)));
        assert!(!hogging(true, period(250 * MS, 250 * MS, 1_000)));
    }

    /// Schedstat adds a wait for a CPU only once it ends: a demoted spinner
    /// that a loaded host left no CPU for most of a period (measured: 27 of
    /// 39 periods of a SCHED_IDLE spinner beside two busy loops showed no
    /// run and no wait; one showed 4 ms run of 32 ms wanted) must not pass
    /// for one that calmed down.
    #[test]
    fn a_demoted_spinner_starved_by_a_loaded_host_stays_demoted() {
        for (ran, wanted) in [(0, 0), (4, 32)] {
            let starved = Period {
                waiting: true,
                ..period(ran * MS, wanted * MS, 0)
            };
            assert!(hogging(true, starved), "{starved:?}");
            // Blocked (halted, or waiting on a fault): it calmed down.
            assert!(!hogging(true, period(ran * MS, wanted * MS, 0)));
            // Serving while starved: it comes back.
            assert!(!hogging(
                true,
                Period {
                    requests: 50,
                    ..starved
                }
            ));
        }
    }
}
