//! Known slowdowns (`--inject-request-us`, `--inject-fault-us`): CPU work a
//! run adds on purpose, only to check that regression detection sees it.
//! The work is measured on the calling thread's CPU clock, so a thread
//! preempted during it still spends exactly the amount asked for.

use std::io::Read;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Where injected work runs, which decides whose CPU time it raises.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Work {
    /// A spin loop in user space.
    User,
    /// Reads of /dev/zero: the kernel clears the buffer, so the time counts
    /// as kernel CPU, as a costlier fault path would.
    Kernel,
}

/// Spends `amount` of this thread's CPU time as `work`.
pub fn spend(amount: Duration, work: Work) {
    if amount.is_zero() {
        return;
    }
    let Some(start) = thread_cpu() else {
        return;
    };
    while let Some(now) = thread_cpu() {
        let left = amount.saturating_sub(now.saturating_sub(start));
        if left.is_zero() {
            return;
        }
        let done = match work {
            Work::User => spin_for(left),
            Work::Kernel => read_zeros_for(left),
        };
        if !done {
            return;
        }
    }
}

/// Spins for `wall` of wall-clock time. The thread CPU clock is a system
/// call, so it is read only between spins (a preempted spin falls short and
/// `spend` goes round again); the wall clock read here is the vDSO's.
fn spin_for(wall: Duration) -> bool {
    let start = Instant::now();
    while start.elapsed() < wall {
        std::hint::spin_loop();
    }
    true
}

/// Bytes per read of /dev/zero. Each read's user-space part (the system
/// call's return, the loop, the clock) is about the same whatever its
/// size: 16 KiB reads left ~11% of the time in user space on a 2.4 GHz
/// EPYC host, 256 KiB reads under 2%.
const ZERO_READ_BYTES: usize = 256 << 10;

/// Reads /dev/zero for `wall` of wall-clock time; false if it cannot.
fn read_zeros_for(wall: Duration) -> bool {
    static ZERO: OnceLock<Option<std::fs::File>> = OnceLock::new();
    thread_local! {
        static BUF: std::cell::RefCell<Vec<u8>> = std::cell::RefCell::new(vec![0; ZERO_READ_BYTES]);
    }
    let Some(mut zero) = ZERO
        .get_or_init(|| std::fs::File::open("/dev/zero").ok())
        .as_ref()
    else {
        return false;
    };
    BUF.with_borrow_mut(|buf| {
        let start = Instant::now();
        while start.elapsed() < wall {
            if zero.read(buf).is_err() {
                return false;
            }
        }
        true
    })
}

/// CPU time of the calling thread (CLOCK_THREAD_CPUTIME_ID).
fn thread_cpu() -> Option<Duration> {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `now` is a valid timespec to write to.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut now) } != 0 {
        return None;
    }
    Some(Duration::new(now.tv_sec as u64, now.tv_nsec as u32))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Long enough for the scheduler tick, which splits a thread's CPU time
    /// into user and kernel by sampling, to give the split a few dozen
    /// samples even at HZ=100.
    const SPENT: Duration = Duration::from_millis(300);

    fn cpu_of(work: Work) -> (Duration, Duration) {
        let (user0, kernel0) = rusage_thread();
        spend(SPENT, work);
        let (user1, kernel1) = rusage_thread();
        (user1 - user0, kernel1 - kernel0)
    }

    fn rusage_thread() -> (Duration, Duration) {
        // SAFETY: a zeroed rusage is a valid value for getrusage to fill.
        let mut r: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: `r` is a valid rusage to write to.
        assert_eq!(unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut r) }, 0);
        let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
        (tv(r.ru_utime), tv(r.ru_stime))
    }

    #[test]
    fn kernel_work_is_kernel_time_and_user_work_is_user_time() {
        let (user, kernel) = cpu_of(Work::Kernel);
        assert!(kernel > SPENT / 2 && user < kernel, "{user:?} {kernel:?}");
        let (user, kernel) = cpu_of(Work::User);
        assert!(user > SPENT / 2 && kernel < user, "{user:?} {kernel:?}");
    }
}
