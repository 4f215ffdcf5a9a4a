//! Gallery: WSClock with a working-set window in each VM's virtual time.
//!
//! Sources: Carr and Hennessy, "WSCLOCK — a simple and effective algorithm
//! for virtual memory management", SOSP 1981 (one clock over all frames; a
//! page is replaceable when it is unreferenced and older than the window
//! tau in its owner's *virtual* time, or when its owner is inactive); and
//! Whitaker, Shaw and Gribble, "Scale and Performance in the Denali
//! Isolation Kernel", OSDI 2002, whose isolation kernel pages VMs with a
//! WSClock variant so that a VM's working set is judged by the time the VM
//! itself ran, not by wall-clock time (a VM that waits does not see its
//! pages age). The project's built-in `demand` keeps only the VM-level
//! clock of that design; this plugin adds the per-block window.
//!
//! Mapping onto the pager's events:
//! - a VM's virtual time is the number of requests it served (`on_access`);
//! - a block's reference bit is set when it is installed (the pager sees no
//!   reference to a resident block: userfaultfd reports only faults);
//! - the hand sweeps resident blocks in a ring. A referenced block has its
//!   bit cleared and its last-use stamp set to its VM's current virtual
//!   time (the scan is bounded: 4 x need + 1,024 blocks per call). An unreferenced block whose VM ran more than `window` requests
//!   since the stamp is out of the working set: a victim. A block of a hot
//!   VM thus goes after `window` of that VM's requests, and faults back in
//!   if still used, which renews it (the working set is sampled by
//!   eviction).
//! - The virtual-time rule protects an idle VM's blocks from ageing. When a
//!   whole revolution finds too few victims, the VMs that ran least recently
//!   (global time) are evicted whole, as Denali's pager and WSClock's load
//!   control do with inactive processes; the faulting VM's own blocks are
//!   the last resort.
//!
//! Arguments: `window=N` (default 8 requests).
//! Build: `cargo build --release -p paging-policy --examples`, then
//! `--policy target/release/examples/libwsclock_policy.so[,window=N]`.

use std::collections::{BTreeSet, HashSet, VecDeque};

use paging_policy::policy::plugin::PluginPolicyFactory;
use paging_policy::policy::{BlockId, Policy, SwapLayout, VmId};

/// Working-set window when no `window=` is given, in the VM's requests.
const DEFAULT_WINDOW: u64 = 8;
/// Blocks the hand visits per call beyond 4 x need: a bounded scan (a full
/// revolution over a large ring of idle VMs' blocks, whose virtual time
/// stands still, would find nothing at a high price).
const SWEEP_SLACK: usize = 1024;

#[derive(Debug, Default, Clone, Copy)]
struct BlockState {
    resident: bool,
    /// Has an entry in the ring.
    in_ring: bool,
    referenced: bool,
    /// The VM's virtual time when the block was last known in use.
    stamp: u64,
}

#[derive(Debug, Default)]
struct VmState {
    present: bool,
    /// Requests served: the VM's virtual time.
    virtual_time: u64,
    /// Global time of the VM's last request or fault.
    last_run: u64,
    blocks: Vec<BlockState>,
    count: u32,
}

/// WSClock over all resident blocks.
struct WsClock {
    window: u64,
    vms: Vec<VmState>,
    /// Resident blocks in sweep order; the hand is the front.
    ring: VecDeque<(VmId, BlockId)>,
    /// VMs with resident blocks by global time of their last run.
    by_last_run: BTreeSet<(u64, VmId)>,
    global_time: u64,
}

impl WsClock {
    fn vm(&mut self, vm: VmId) -> &mut VmState {
        let i = vm as usize;
        if i >= self.vms.len() {
            self.vms.resize_with(i + 1, VmState::default);
        }
        &mut self.vms[i]
    }

    fn block(&mut self, vm: VmId, block: BlockId) -> Option<&mut BlockState> {
        self.vms
            .get_mut(vm as usize)
            .filter(|e| e.present)
            .and_then(|e| e.blocks.get_mut(block as usize))
    }

    fn ran(&mut self, vm: VmId, request: bool) {
        self.global_time += 1;
        let now = self.global_time;
        let e = self.vm(vm);
        let (before, resident) = (e.last_run, e.count > 0);
        e.last_run = now;
        if request {
            e.virtual_time += 1;
        }
        if resident {
            self.by_last_run.remove(&(before, vm));
            self.by_last_run.insert((now, vm));
        }
    }

    /// One revolution of the hand: pushes blocks out of their VM's working
    /// set until `need` are found.
    fn sweep(
        &mut self,
        need: u32,
        taken: &mut HashSet<(VmId, BlockId)>,
        out: &mut Vec<(VmId, BlockId)>,
    ) {
        let window = self.window;
        let visits = self.ring.len().min(4 * need as usize + SWEEP_SLACK);
        for _ in 0..visits {
            if out.len() as u32 >= need {
                return;
            }
            let Some((vm, b)) = self.ring.pop_front() else {
                return;
            };
            let Some(e) = self.vms.get_mut(vm as usize).filter(|e| e.present) else {
                continue;
            };
            let now = e.virtual_time;
            let Some(s) = e.blocks.get_mut(b as usize) else {
                continue;
            };
            if !s.resident {
                s.in_ring = false;
                continue;
            }
            self.ring.push_back((vm, b));
            if s.referenced {
                s.referenced = false;
                s.stamp = now;
            } else if now.saturating_sub(s.stamp) > window && taken.insert((vm, b)) {
                out.push((vm, b));
            }
        }
    }

    /// Evicts whole VMs, least recently run first, skipping `faulting`.
    fn evict_inactive(
        &mut self,
        need: u32,
        faulting: VmId,
        taken: &mut HashSet<(VmId, BlockId)>,
        out: &mut Vec<(VmId, BlockId)>,
    ) {
        for &(_, vm) in &self.by_last_run {
            if out.len() as u32 >= need {
                return;
            }
            if vm != faulting {
                Self::push_resident(&self.vms[vm as usize], vm, u32::MAX, taken, out);
            }
        }
    }

    fn push_resident(
        e: &VmState,
        vm: VmId,
        limit: u32,
        taken: &mut HashSet<(VmId, BlockId)>,
        out: &mut Vec<(VmId, BlockId)>,
    ) {
        let mut n = 0;
        for (b, s) in e.blocks.iter().enumerate() {
            if n >= limit {
                return;
            }
            if s.resident && taken.insert((vm, b as BlockId)) {
                out.push((vm, b as BlockId));
                n += 1;
            }
        }
    }
}

impl Policy for WsClock {
    fn name(&self) -> &str {
        "wsclock"
    }

    fn layout(&self) -> SwapLayout {
        SwapLayout::PerVm
    }

    fn on_vm_registered(&mut self, vm: VmId, blocks: u32) {
        *self.vm(vm) = VmState {
            present: true,
            blocks: vec![BlockState::default(); blocks as usize],
            ..VmState::default()
        };
    }

    fn on_vm_unregistered(&mut self, vm: VmId) {
        // Its ring entries are dropped when the hand reaches them.
        let e = std::mem::take(self.vm(vm));
        self.by_last_run.remove(&(e.last_run, vm));
    }

    fn on_access(&mut self, vm: VmId) {
        self.ran(vm, true);
    }

    fn on_fault(&mut self, vm: VmId, _block: BlockId, _prefetch: &mut Vec<BlockId>) {
        self.ran(vm, false);
    }

    fn on_installed(&mut self, vm: VmId, block: BlockId) {
        let Some(s) = self.block(vm, block) else {
            return;
        };
        if s.resident {
            return;
        }
        s.resident = true;
        s.referenced = true;
        let queue = !s.in_ring;
        s.in_ring = true;
        let e = &mut self.vms[vm as usize];
        e.count += 1;
        if e.count == 1 {
            self.by_last_run.insert((e.last_run, vm));
        }
        if queue {
            self.ring.push_back((vm, block));
        }
    }

    fn choose_victims(&mut self, need: u32, faulting_vm: VmId, victims: &mut Vec<(VmId, BlockId)>) {
        let mut taken = HashSet::new();
        self.sweep(need, &mut taken, victims);
        if (victims.len() as u32) < need {
            self.evict_inactive(need, faulting_vm, &mut taken, victims);
        }
        let short = need.saturating_sub(victims.len() as u32);
        if short > 0 {
            if let Some(e) = self.vms.get(faulting_vm as usize).filter(|e| e.present) {
                Self::push_resident(e, faulting_vm, short, &mut taken, victims);
            }
        }
    }

    fn on_evicted(&mut self, vm: VmId, block: BlockId) {
        let Some(s) = self.block(vm, block) else {
            return;
        };
        if s.resident {
            s.resident = false;
            let e = &mut self.vms[vm as usize];
            e.count -= 1;
            if e.count == 0 {
                self.by_last_run.remove(&(e.last_run, vm));
            }
        }
    }
}

impl PluginPolicyFactory for WsClock {
    fn create(args: &str, _block_bytes: u64, _budget_blocks: u64) -> Result<Self, String> {
        let window = match args {
            "" => DEFAULT_WINDOW,
            a => a
                .strip_prefix("window=")
                .and_then(|n| n.parse().ok())
                .ok_or_else(|| format!("wsclock takes window=N (requests), got '{a}'"))?,
        };
        Ok(WsClock {
            window,
            vms: Vec::new(),
            ring: VecDeque::new(),
            by_last_run: BTreeSet::new(),
            global_time: 0,
        })
    }
}

paging_policy::export_policy!(WsClock);
