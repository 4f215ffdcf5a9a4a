//! Where and how a cell's threads run: on which CPU (`--cell-placement`)
//! and under which scheduling policy.
//!
//! Serving a request takes two wake-ups inside a cell: its event loop kicks
//! the VM's vCPU thread through the irqfd, and the guest rings the loop's
//! doorbell when its response is out. When the two threads sit on different
//! cores, each wake-up is an inter-processor interrupt, and on a host that is
//! itself a VM an IPI to an idle core goes through the hypervisor below. A
//! pinned cell keeps both ends of every such wake-up on one core.
//!
//! On one core, a woken thread would preempt the one that woke it: the vCPU
//! the loop just kicked, half-way through the loop's batch of events, and
//! the loop again when the guest rings, just before the guest halts. Under
//! SCHED_BATCH a wake-up never preempts, so each thread runs until it
//! blocks: the loop finishes its batch, then the guests it kicked run. Every
//! thread of a cell runs SCHED_BATCH; threads of other processes (the
//! client, the parent's pager) still preempt them as usual.

use serde::{Deserialize, Serialize};
use std::io;

/// Where a cell's threads may run.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CellPlacement {
    /// Every thread of cell i on one CPU: the i-th, round robin, of the CPUs
    /// densevm was allowed to run on.
    Pinned,
    /// The scheduler places every thread.
    Floating,
}

/// The CPU cell `index` runs on, given the CPUs allowed: round robin, so
/// neighbouring cells land on different CPUs.
pub fn cpu_for_cell(index: u32, allowed: &[usize]) -> Option<usize> {
    (!allowed.is_empty()).then(|| allowed[index as usize % allowed.len()])
}

/// The CPUs the calling thread may run on, in increasing order.
pub fn allowed_cpus() -> io::Result<Vec<usize>> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set, and the kernel writes
    // at most its size.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    let rc = unsafe { libc::sched_getaffinity(0, std::mem::size_of_val(&set), &mut set) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((0..libc::CPU_SETSIZE as usize)
        // SAFETY: `cpu` is below CPU_SETSIZE.
        .filter(|&cpu| unsafe { libc::CPU_ISSET(cpu, &set) })
        .collect())
}

/// The policy of every cell thread, vCPUs included unless demoted to
/// SCHED_IDLE by the CPU governor.
pub const CELL_POLICY: libc::c_int = libc::SCHED_BATCH;

/// Puts the calling thread under [`CELL_POLICY`]; threads it starts
/// afterwards inherit it.
pub fn use_cell_policy() -> io::Result<()> {
    set_thread_policy(0, CELL_POLICY)
}

/// Puts thread `tid` (0: the calling one) under `policy`, at priority 0
/// (SCHED_BATCH, SCHED_IDLE or SCHED_OTHER).
pub fn set_thread_policy(tid: i32, policy: libc::c_int) -> io::Result<()> {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: a plain syscall with a valid parameter; a stale id fails with
    // ESRCH.
    if unsafe { libc::sched_setscheduler(tid, policy, &param) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Binds the calling thread to cell `index`'s CPU of `allowed` (the CPUs
/// densevm may use). Threads it starts afterwards inherit the binding, so
/// a cell calls this before it starts any. Returns the CPU.
pub fn pin_cell(index: u32, allowed: &[usize]) -> io::Result<usize> {
    let cpu = cpu_for_cell(index, allowed).ok_or_else(|| io::Error::other("no CPU allowed"))?;
    set_thread_cpus(0, &[cpu])?;
    Ok(cpu)
}

/// Lets thread `tid` (0: the calling one) run on `cpus` only.
pub fn set_thread_cpus(tid: i32, cpus: &[usize]) -> io::Result<()> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &cpu in cpus.iter().filter(|&&cpu| cpu < libc::CPU_SETSIZE as usize) {
        // SAFETY: `cpu` is below CPU_SETSIZE.
        unsafe { libc::CPU_SET(cpu, &mut set) };
    }
    // SAFETY: a plain syscall with a valid set; a stale id fails with ESRCH.
    let rc = unsafe { libc::sched_setaffinity(tid, std::mem::size_of_val(&set), &set) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Where a cell's vCPU threads may run: `home` while they serve (the
/// cell's CPU when it is pinned), `background` once the CPU governor has
/// demoted them: every CPU densevm may use. A demoted vCPU left on its
/// pinned cell's CPU took that CPU's idle moments from the very neighbours
/// it shares the cell with, and each preemption of it in guest mode delayed
/// their wake-ups: on 2 cores, a spinning guest at SCHED_IDLE raised its
/// neighbours' p99 2.6-2.9x pinned, 1.2x floating (docs/measurements/2026-11-28.md).
#[derive(Debug, Clone)]
pub struct VcpuCpus {
    /// The cell's own CPUs.
    pub home: Vec<usize>,
    /// Every CPU densevm may use.
    pub background: Vec<usize>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threads_started_under_the_cell_policy_inherit_it() {
        let (own, child) = std::thread::spawn(|| {
            use_cell_policy().unwrap();
            // SAFETY: plain queries of the calling thread's policy.
            let own = unsafe { libc::sched_getscheduler(0) };
            let child = std::thread::spawn(|| unsafe { libc::sched_getscheduler(0) });
            (own, child.join().unwrap())
        })
        .join()
        .unwrap();
        assert_eq!((own, child), (CELL_POLICY, CELL_POLICY));
    }

    #[test]
    fn cells_go_round_robin_over_the_allowed_cpus() {
        let allowed = [2, 3, 5];
        let cpus: Vec<_> = (0..7).map(|i| cpu_for_cell(i, &allowed).unwrap()).collect();
        assert_eq!(cpus, [2, 3, 5, 2, 3, 5, 2]);
        assert_eq!(cpu_for_cell(0, &[]), None);
    }

    #[test]
    fn a_pinned_thread_and_the_threads_it_starts_run_only_on_its_cell_cpu() {
        let allowed = allowed_cpus().unwrap();
        assert!(!allowed.is_empty());
        // A thread of its own, so the test harness's other threads keep their CPUs.
        let (cpu, own, child) = std::thread::spawn(|| {
            let cpu = pin_cell(1, &allowed_cpus().unwrap()).unwrap();
            let child = std::thread::spawn(|| allowed_cpus().unwrap());
            (cpu, allowed_cpus().unwrap(), child.join().unwrap())
        })
        .join()
        .unwrap();
        assert_eq!(cpu, cpu_for_cell(1, &allowed).unwrap());
        assert_eq!(own, [cpu]);
        assert_eq!(child, [cpu]);
    }
}
