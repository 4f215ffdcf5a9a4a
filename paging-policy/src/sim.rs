//! The trace-driven simulator behind `pagesim`.
//!
//! It replays requests (one VM id each; every request touches the same RAM
//! ranges of its VM) through the real [`Ledger`] and policy, without memory
//! or I/O: faults, evictions and swap placement are decided by exactly the
//! code the pager runs, and the swap requests are fed to the disk model.
//!
//! Predicted throughput is a bottleneck bound: requests / max(CPU time, the
//! busiest drive's service time), with CPU time = requests x `cpu_us` +
//! faults x `fault_us`. Denali's out-of-core regime is disk-bound, so the
//! disk term dominates there; in core the CPU term does.
//!
//! Concurrency: like densevm serving many clients, up to `concurrency`
//! requests are in flight; they advance round-robin one fault at a time, so
//! the faults of different VMs interleave at the disk as they do in the real
//! pager (with one request at a time, a VM's demand faults would reach the
//! disk as one sequential stream, which no loaded server sees).
//!
//! Dirtiness: a fraction `dirty` of each VM's request blocks is written by
//! every request (chosen deterministically by block index); such blocks are
//! installed dirty, the rest stay clean and are dropped without a write.

use serde::Serialize;

use crate::batching::{cluster_writes, read_runs, write_runs};
use crate::config::{blocks_touched, check_block, check_vm_quota};
use crate::disk::{DiskModel, DiskSpec};
use crate::error::PagerError;
use crate::ledger::{Admission, Ledger, PlanBlock, Wakes};
use crate::policy::{build_policy, Policy, PolicySpec, SwapLayout, VmId};
use crate::space::SwapSpace;

/// Simulation settings.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// Global memory budget.
    pub budget_bytes: u64,
    /// Block size.
    pub block_bytes: u64,
    /// The paging policy.
    pub policy: PolicySpec,
    /// The disk model.
    pub disk: DiskSpec,
    /// RAM of every VM.
    pub vm_ram_bytes: u64,
    /// Number of VMs.
    pub vms: u32,
    /// RAM ranges touched by every request.
    pub request_ranges: Vec<(u64, u64)>,
    /// CPU cost of one request in core (µs).
    pub cpu_us: f64,
    /// CPU cost of serving one fault (µs).
    pub fault_us: f64,
    /// Fraction of request blocks written by every request.
    pub dirty: f64,
    /// Swap capacity (default: as the pager sizes it).
    pub swap_bytes: Option<u64>,
    /// Most resident memory one VM may hold (as the pager's `--vm-resident-max`).
    pub vm_resident_max: Option<u64>,
    /// Requests replayed before counting starts.
    pub warmup: u64,
    /// Requests in flight at once (at least 1).
    pub concurrency: usize,
}

/// Results of a simulation (counted after the warm-up).
#[derive(Debug, Clone, Serialize)]
pub struct SimReport {
    /// Policy name.
    pub policy: String,
    /// Disk model.
    pub disk: String,
    /// Requests counted.
    pub requests: u64,
    /// Requests replayed for warm-up.
    pub warmup: u64,
    /// Block touches (requests x request blocks).
    pub block_touches: u64,
    /// Missing-block faults.
    pub faults: u64,
    /// 1 - faults / block touches.
    pub hit_ratio: f64,
    /// Requests that found all their blocks resident.
    pub request_hit_ratio: f64,
    /// Blocks installed.
    pub blocks_in: u64,
    /// Blocks evicted.
    pub blocks_out: u64,
    /// Requests whose VM another VM's eviction took blocks from while they
    /// were still paging in: such a request faults again what it, or its
    /// VM's last request, had brought in (a policy thrashing).
    pub interrupted_requests: u64,
    /// Bytes read from swap.
    pub swap_read_bytes: u64,
    /// Bytes written to swap.
    pub swap_write_bytes: u64,
    /// Busiest drive's service time (s).
    pub disk_seconds: f64,
    /// Modeled CPU time (s).
    pub cpu_seconds: f64,
    /// Predicted requests per second.
    pub predicted_rps: f64,
}

#[derive(Debug, Default, Clone, Copy)]
struct Counts {
    requests: u64,
    touches: u64,
    full_hits: u64,
    faults: u64,
    blocks_in: u64,
    blocks_out: u64,
    interrupted: u64,
    read: u64,
    written: u64,
    disk: f64,
}

/// A request still paging in.
#[derive(Debug, Clone, Copy)]
struct InFlight {
    vm: VmId,
    /// Index of the next request block to touch.
    next: usize,
    /// Another VM's eviction took blocks of this VM meanwhile.
    interrupted: bool,
}

/// A simulator instance.
pub struct Simulator {
    cfg: SimConfig,
    ledger: Ledger,
    model: DiskModel,
    req_blocks: Vec<u32>,
    /// Per block index: touched by requests / written by requests.
    in_req: Vec<bool>,
    written: Vec<bool>,
    /// Per VM: how many request blocks are resident.
    req_resident: Vec<u32>,
    counts: Counts,
    base: Counts,
    plan: Vec<PlanBlock>,
    wakes: Wakes,
    /// In-flight requests.
    active: Vec<InFlight>,
    turn: usize,
    order: Vec<usize>,
    runs: Vec<(usize, usize)>,
}

impl Simulator {
    /// Builds a simulator running the policy `cfg.policy` names and
    /// registers all VMs.
    pub fn new(cfg: SimConfig) -> Result<Simulator, PagerError> {
        check_block(cfg.block_bytes)?;
        let policy = build_policy(
            &cfg.policy,
            cfg.block_bytes,
            cfg.budget_bytes / cfg.block_bytes,
        )?;
        Simulator::with_policy(cfg, policy)
    }

    /// Builds a simulator running `policy` (an object built outside
    /// [`PolicySpec`], e.g. a Python policy; `cfg.policy` is not used) and
    /// registers all VMs.
    pub fn with_policy(cfg: SimConfig, policy: Box<dyn Policy>) -> Result<Simulator, PagerError> {
        check_block(cfg.block_bytes)?;
        let bs = cfg.block_bytes;
        if !cfg.vm_ram_bytes.is_multiple_of(bs) {
            return Err(PagerError::RamNotBlockMultiple {
                ram: cfg.vm_ram_bytes,
                block: bs,
            });
        }
        for &(off, len) in &cfg.request_ranges {
            if len == 0 || off + len > cfg.vm_ram_bytes {
                return Err(PagerError::BadVm {
                    vm: 0,
                    reason: format!(
                        "request range {off}+{len} outside {} bytes of RAM",
                        cfg.vm_ram_bytes
                    ),
                });
            }
        }
        let nblocks = (cfg.vm_ram_bytes / bs) as usize;
        let req_blocks: Vec<u32> = blocks_touched(&cfg.request_ranges, bs)
            .into_iter()
            .map(|b| b as u32)
            .collect();
        let mut in_req = vec![false; nblocks];
        for &b in &req_blocks {
            in_req[b as usize] = true;
        }
        let footprint = req_blocks.len() as u64 * bs;
        if cfg.budget_bytes < footprint {
            return Err(PagerError::BudgetTooSmall {
                budget: cfg.budget_bytes,
                footprint,
                block: bs,
            });
        }
        check_vm_quota(cfg.vm_resident_max, footprint)?;
        // Deterministic choice of written blocks: a multiplicative hash of
        // the block index against the dirty fraction.
        let written = (0..nblocks as u64)
            .map(|b| {
                in_req[b as usize]
                    && ((b.wrapping_mul(2654435761) & 0xffff_ffff) as f64)
                        < cfg.dirty * 4294967296.0
            })
            .collect();
        let layout = policy.layout();
        let capacity = cfg.swap_bytes.unwrap_or_else(|| {
            let per_vm = cfg.vms.max(1) as u64 * cfg.vm_ram_bytes;
            if layout == SwapLayout::Log {
                2 * per_vm
            } else {
                per_vm
            }
        });
        let model = cfg.disk.build(capacity);
        let space = SwapSpace::new(layout, capacity, bs, cfg.vm_ram_bytes);
        let mut ledger = Ledger::new(policy, space, bs, cfg.budget_bytes);
        ledger.set_vm_quota(cfg.vm_resident_max);
        for vm in 0..cfg.vms {
            ledger.register(vm, nblocks as u32)?;
        }
        Ok(Simulator {
            req_resident: vec![0; cfg.vms as usize],
            cfg,
            ledger,
            model,
            req_blocks,
            in_req,
            written,
            counts: Counts::default(),
            base: Counts::default(),
            plan: Vec::new(),
            wakes: Vec::new(),
            active: Vec::new(),
            turn: 0,
            order: Vec::new(),
            runs: Vec::new(),
        })
    }

    /// Blocks touched by every request.
    pub fn request_blocks(&self) -> usize {
        self.req_blocks.len()
    }

    /// Starts one request to `vm`; when `concurrency` requests are already
    /// in flight, advances them until one completes first.
    pub fn request(&mut self, vm: VmId) -> Result<(), PagerError> {
        if vm >= self.cfg.vms {
            return Err(PagerError::BadVm {
                vm,
                reason: format!("request for VM {vm}, only {} VMs", self.cfg.vms),
            });
        }
        self.counts.requests += 1;
        let n = self.req_blocks.len() as u32;
        self.counts.touches += n as u64;
        self.ledger.note_access(vm)?;
        if self.req_resident[vm as usize] == n {
            // Entirely in core: completes without a fault.
            self.counts.full_hits += 1;
        } else {
            while self.active.len() >= self.cfg.concurrency.max(1) {
                self.step()?;
            }
            self.active.push(InFlight {
                vm,
                next: 0,
                interrupted: false,
            });
        }
        if self.counts.requests == self.cfg.warmup {
            self.base = self.counts;
            self.base.disk = self.model.max_busy_seconds();
        }
        Ok(())
    }

    /// Completes every request in flight.
    pub fn drain(&mut self) -> Result<(), PagerError> {
        while !self.active.is_empty() {
            self.step()?;
        }
        Ok(())
    }

    /// Advances the next in-flight request up to and including its next
    /// fault.
    fn step(&mut self) -> Result<(), PagerError> {
        if self.turn >= self.active.len() {
            self.turn = 0;
        }
        let InFlight { vm, mut next, .. } = self.active[self.turn];
        let n = self.req_blocks.len();
        while next < n {
            let b = self.req_blocks[next];
            next += 1;
            if !self.ledger.is_resident(vm, b) {
                self.fault(vm, b)?;
                break;
            }
        }
        if next >= n {
            let done = self.active.swap_remove(self.turn);
            self.counts.interrupted += done.interrupted as u64;
        } else {
            self.active[self.turn].next = next;
            self.turn += 1;
        }
        Ok(())
    }

    fn fault(&mut self, vm: VmId, block: u32) -> Result<(), PagerError> {
        let bs = self.cfg.block_bytes;
        let mut plan = std::mem::take(&mut self.plan);
        // As the pager does at a VM's first fault; the simulated device has
        // nothing to allocate.
        self.ledger.commit_swap(vm, |_| Ok(()))?;
        self.ledger.plan_fault(vm, block, false, &mut plan)?;
        for p in plan.iter_mut() {
            p.dirty = self.written[p.block as usize];
        }
        loop {
            let admission = self.ledger.admit(plan.len() as u64, vm)?;
            // A VM the pager would fail alone (no swap room for its copies)
            // ends a simulation: nobody is there to destroy it.
            if let Some((failed, reason)) = self.ledger.take_failed_vms().into_iter().next() {
                return Err(PagerError::BadVm { vm: failed, reason });
            }
            match admission {
                Admission::Go => break,
                Admission::Abandon => {
                    return Err(PagerError::BadVm {
                        vm,
                        reason: "faulted while failed".into(),
                    })
                }
                Admission::Wait => {
                    return Err(PagerError::PolicyFailed {
                        policy: self.ledger.policy_name().to_string(),
                        reason: "made no room (nothing in flight in a simulation)".into(),
                    })
                }
                Admission::Evict(mut victims) => {
                    cluster_writes(&mut victims, bs);
                    for run in write_runs(&victims, bs) {
                        let bytes = run.len() as u64 * bs;
                        self.model.submit(0.0, victims[run.start].loc, bytes, true);
                        self.counts.written += bytes;
                    }
                    self.wakes.clear();
                    self.ledger.finish_eviction(&victims, 0.0, &mut self.wakes);
                    self.counts.blocks_out += victims.len() as u64;
                    for v in &victims {
                        if self.in_req[v.block as usize] {
                            self.req_resident[v.vm as usize] -= 1;
                        }
                    }
                    for request in self.active.iter_mut() {
                        if request.vm != vm && victims.iter().any(|v| v.vm == request.vm) {
                            request.interrupted = true;
                        }
                    }
                }
            }
        }
        read_runs(&plan, bs, &mut self.order, &mut self.runs);
        for &(a, b) in &self.runs {
            let len = (b - a) as u64 * bs;
            self.model.submit(0.0, plan[self.order[a]].loc, len, false);
            self.counts.read += len;
        }
        self.wakes.clear();
        self.ledger.finish_install(&plan, 0.0, 0, &mut self.wakes);
        self.ledger.check_policy()?;
        self.counts.faults += 1;
        self.counts.blocks_in += plan.len() as u64;
        for p in &plan {
            if self.in_req[p.block as usize] {
                self.req_resident[vm as usize] += 1;
            }
        }
        self.plan = plan;
        Ok(())
    }

    /// The results so far (after the warm-up).
    pub fn report(&self) -> SimReport {
        let c = &self.counts;
        let b = if c.requests >= self.cfg.warmup && self.cfg.warmup > 0 {
            self.base
        } else {
            Counts::default()
        };
        let requests = c.requests - b.requests;
        let touches = c.touches - b.touches;
        let faults = c.faults - b.faults;
        let disk_seconds = self.model.max_busy_seconds() - b.disk;
        let cpu_seconds =
            (requests as f64 * self.cfg.cpu_us + faults as f64 * self.cfg.fault_us) / 1e6;
        let bound = disk_seconds.max(cpu_seconds);
        SimReport {
            policy: self.ledger.policy_name().to_string(),
            disk: self.cfg.disk.text.clone(),
            requests,
            warmup: self.cfg.warmup.min(c.requests),
            block_touches: touches,
            faults,
            hit_ratio: if touches > 0 {
                1.0 - faults as f64 / touches as f64
            } else {
                1.0
            },
            request_hit_ratio: if requests > 0 {
                (c.full_hits - b.full_hits) as f64 / requests as f64
            } else {
                1.0
            },
            blocks_in: c.blocks_in - b.blocks_in,
            blocks_out: c.blocks_out - b.blocks_out,
            interrupted_requests: c.interrupted - b.interrupted,
            swap_read_bytes: c.read - b.read,
            swap_write_bytes: c.written - b.written,
            disk_seconds,
            cpu_seconds,
            predicted_rps: if bound > 0.0 {
                requests as f64 / bound
            } else {
                0.0
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BLOCK: u64 = 4096;

    /// VMs of 4 blocks whose requests touch blocks 0 and 1, all written; a
    /// budget of 2 blocks (one VM's request), one request in flight.
    fn config(vms: u32, policy: &str, disk: &str) -> SimConfig {
        SimConfig {
            budget_bytes: 2 * BLOCK,
            block_bytes: BLOCK,
            policy: PolicySpec::parse(policy).unwrap(),
            disk: DiskSpec::parse(disk).unwrap(),
            vm_ram_bytes: 4 * BLOCK,
            vms,
            request_ranges: vec![(0, 2 * BLOCK)],
            cpu_us: 100.0,
            fault_us: 10.0,
            dirty: 1.0,
            swap_bytes: None,
            vm_resident_max: None,
            warmup: 0,
            concurrency: 1,
        }
    }

    fn replay(cfg: SimConfig, vms: &[VmId]) -> SimReport {
        let mut sim = Simulator::new(cfg).unwrap();
        for &vm in vms {
            sim.request(vm).unwrap();
        }
        sim.drain().unwrap();
        sim.report()
    }

    /// Each VM twice in a row, then VM 0 again. With one request in flight a
    /// request runs when the next one arrives (or at the drain), so each is
    /// checked for a full hit before its predecessor has run.
    const TURNS: [VmId; 6] = [0, 0, 1, 1, 0, 0];

    #[test]
    fn two_vms_taking_turns_in_a_one_vm_budget() {
        // VM 0 faults its 2 blocks in; VM 1 evicts VM 0 (2 written blocks)
        // and faults its own 2 in (zero-filled); VM 0 evicts VM 1 (2 more
        // written) and reads its 2 blocks back. Second visits hit.
        let r = replay(config(2, "demand", "none"), &TURNS);
        assert_eq!((r.requests, r.block_touches, r.faults), (6, 12, 6));
        assert_eq!((r.blocks_in, r.blocks_out), (6, 4));
        assert_eq!(r.swap_write_bytes, 4 * BLOCK);
        assert_eq!(r.swap_read_bytes, 2 * BLOCK);
        assert!((r.hit_ratio - 0.5).abs() < 1e-12);
        assert_eq!(r.request_hit_ratio, 0.0);
        // CPU-bound without a disk model: 6 x 100 us + 6 x 10 us.
        assert_eq!(r.disk_seconds, 0.0);
        assert!((r.cpu_seconds - 660e-6).abs() < 1e-12);
        assert!((r.predicted_rps - 6.0 / 660e-6).abs() < 1e-6);
    }

    #[test]
    fn a_request_whose_blocks_are_resident_is_a_full_hit() {
        // VM 0's second request arrives after its first has run (VM 1's
        // arrival ran it), before VM 1's has evicted it.
        let r = replay(config(2, "demand", "none"), &[0, 1, 0]);
        assert!((r.request_hit_ratio - 1.0 / 3.0).abs() < 1e-12);
    }

    #[test]
    fn clean_blocks_are_dropped_without_a_write() {
        let mut cfg = config(2, "demand", "none");
        cfg.dirty = 0.0;
        let r = replay(cfg, &TURNS);
        // Never written, so never on swap: VM 0 comes back zero-filled.
        assert_eq!(
            (r.blocks_out, r.swap_write_bytes, r.swap_read_bytes),
            (4, 0, 0)
        );
    }

    #[test]
    fn the_disk_model_is_charged_for_every_swap_request() {
        let r = replay(config(2, "demand", "hdd"), &TURNS);
        assert!(r.disk_seconds > 0.0);
        // Each positioned request pays at least the track-to-track seek (1 ms on `hdd`).
        assert!(r.disk_seconds >= 1e-3 * 4.0, "{}", r.disk_seconds);
        assert!(r.predicted_rps < 6.0 / r.cpu_seconds, "the disk bounds it");
    }

    #[test]
    fn the_warm_up_is_not_counted() {
        let mut cfg = config(2, "demand", "none");
        cfg.warmup = 2;
        let r = replay(cfg, &TURNS);
        // Counting starts when the second request arrives, after the first ran.
        assert_eq!((r.warmup, r.requests, r.faults), (2, 4, 4));
    }

    #[test]
    fn wsswap_brings_a_vm_back_as_its_recorded_set() {
        // Three VMs, room for two: VM 2 pushes VM 0 out (its set is
        // recorded); VM 0's return pushes VM 1 out and, under wsswap, brings
        // both its blocks back with its first fault.
        let visits = [0, 0, 1, 1, 2, 2, 0, 0];
        let run = |policy: &str| {
            let mut cfg = config(3, policy, "none");
            cfg.budget_bytes = 4 * BLOCK;
            replay(cfg, &visits)
        };
        let (ws, demand) = (run("wsswap,after=1"), run("demand"));
        assert_eq!((ws.faults, ws.blocks_in, ws.blocks_out), (7, 8, 4));
        assert_eq!(
            (demand.faults, demand.blocks_in, demand.blocks_out),
            (8, 8, 4)
        );
    }

    #[test]
    fn a_request_whose_vm_is_evicted_while_it_pages_in_is_counted() {
        // Two requests in flight, one VM's room: VM 0's second fault evicts
        // VM 1, whose request has faulted one of its two blocks in so far.
        let mut cfg = config(2, "demand", "none");
        cfg.concurrency = 2;
        assert_eq!(replay(cfg.clone(), &[0, 1]).interrupted_requests, 1);
        // One at a time, each request is done before the next evicts it.
        cfg.concurrency = 1;
        assert_eq!(replay(cfg, &[0, 1]).interrupted_requests, 0);
    }

    #[test]
    fn a_request_for_an_unknown_vm_is_refused() {
        let mut sim = Simulator::new(config(2, "demand", "none")).unwrap();
        assert!(sim.request(2).is_err());
    }

    #[test]
    fn a_budget_below_one_request_is_refused() {
        let mut cfg = config(2, "demand", "none");
        cfg.budget_bytes = BLOCK;
        assert!(matches!(
            Simulator::new(cfg),
            Err(PagerError::BudgetTooSmall { .. })
        ));
    }
}
