//! Gallery: working-set prefetch that records only a window after restore.
//!
//! Source: Ustiugov, Petrov, Kogias, Bugnion and Grot, "Benchmarking,
//! Analysis, and Optimization of Serverless Function Snapshots" (REAP,
//! ASPLOS 2021). Restoring a microVM snapshot page by page costs one fault
//! per page; REAP records the pages touched by the *first invocation after
//! a restore* and prefetches exactly that set eagerly at the next restore.
//! The lesson against recording everything: the pages a VM had in memory
//! include boot-time and one-off pages that the next invocation never
//! touches, and bringing them back costs reads and evicts other VMs.
//!
//! Here, compared with the built-in `wsswap` (which prefetches every block
//! the VM had when it was evicted):
//! - victims are whole VMs by clock, as `demand` and `wsswap` choose them;
//! - a VM is *restored* when it faults again after being evicted to make
//!   room for another VM. From that first fault until it has served
//!   `window` more requests (default 1), the blocks it faults are recorded;
//!   the recorded set is the union of these windows;
//! - at the `after`-th fault since the eviction (default 3, for the reason
//!   `wsswap` gives: a VM merely woken faults two blocks) the recorded set
//!   is prefetched in one operation (the pager skips resident blocks and
//!   caps one fault's prefetch at half the budget);
//! - the swap is a log, so a VM's blocks evicted together come back with
//!   one sequential read.
//!
//! Arguments: `after=N`, `window=N` (comma separated).
//! Build: `cargo build --release -p paging-policy --examples`, then
//! `--policy target/release/examples/libreap_policy.so[,after=N][,window=N]`.

use paging_policy::policy::clock::VmClock;
use paging_policy::policy::plugin::PluginPolicyFactory;
use paging_policy::policy::{BlockId, Policy, SwapLayout, VmId};

#[derive(Debug, Default)]
struct VmState {
    /// Requests served.
    requests: u64,
    /// Evicted to make room for another VM, not faulted back `after` times.
    swapped_out: bool,
    faults_since_eviction: u32,
    /// Record faults while `requests` is below this.
    recording_until: Option<u64>,
    /// Recorded working set: membership and list.
    in_set: Vec<bool>,
    set: Vec<BlockId>,
}

/// Record-and-prefetch on restore.
struct Reap {
    clock: VmClock,
    vms: Vec<VmState>,
    after: u32,
    window: u64,
    /// The VM the current victims make room for: blocks it gives up itself
    /// are not a swap-out.
    making_room_for: Option<VmId>,
}

impl Reap {
    fn vm(&mut self, vm: VmId) -> &mut VmState {
        let i = vm as usize;
        if i >= self.vms.len() {
            self.vms.resize_with(i + 1, VmState::default);
        }
        &mut self.vms[i]
    }
}

impl Policy for Reap {
    fn name(&self) -> &str {
        "reap"
    }

    fn layout(&self) -> SwapLayout {
        SwapLayout::Log
    }

    fn on_vm_registered(&mut self, vm: VmId, blocks: u32) {
        self.clock.add(vm, blocks);
        *self.vm(vm) = VmState {
            in_set: vec![false; blocks as usize],
            ..VmState::default()
        };
    }

    fn on_vm_unregistered(&mut self, vm: VmId) {
        self.clock.remove(vm);
        *self.vm(vm) = VmState::default();
    }

    fn on_access(&mut self, vm: VmId) {
        self.clock.touch(vm);
        self.vm(vm).requests += 1;
    }

    fn on_fault(&mut self, vm: VmId, block: BlockId, prefetch: &mut Vec<BlockId>) {
        self.clock.touch(vm);
        let (after, window) = (self.after, self.window);
        let e = self.vm(vm);
        if e.swapped_out {
            e.faults_since_eviction += 1;
            if e.faults_since_eviction == 1 {
                e.recording_until = Some(e.requests + window);
            }
            if e.faults_since_eviction >= after {
                e.swapped_out = false;
                prefetch.extend_from_slice(&e.set);
            }
        }
        if e.recording_until.is_some_and(|end| e.requests < end) {
            if let Some(member) = e.in_set.get_mut(block as usize).filter(|m| !**m) {
                *member = true;
                e.set.push(block);
            }
        }
    }

    fn on_installed(&mut self, vm: VmId, block: BlockId) {
        self.clock.insert(vm, block);
    }

    fn choose_victims(&mut self, need: u32, faulting_vm: VmId, victims: &mut Vec<(VmId, BlockId)>) {
        self.making_room_for = Some(faulting_vm);
        self.clock.choose(need, faulting_vm, victims);
    }

    fn on_evicted(&mut self, vm: VmId, block: BlockId) {
        self.clock.remove_block(vm, block);
        if self.making_room_for != Some(vm) {
            let e = self.vm(vm);
            e.swapped_out = true;
            e.faults_since_eviction = 0;
            e.recording_until = None;
        }
    }
}

impl PluginPolicyFactory for Reap {
    fn create(args: &str, _block_bytes: u64, _budget_blocks: u64) -> Result<Self, String> {
        let mut policy = Reap {
            clock: VmClock::default(),
            vms: Vec::new(),
            after: 3,
            window: 1,
            making_room_for: None,
        };
        for arg in args.split(',').filter(|a| !a.is_empty()) {
            let bad = || format!("reap takes after=N (>= 1) and window=N (requests), got '{arg}'");
            let (key, value) = arg.split_once('=').ok_or_else(bad)?;
            let n: u64 = value.parse().map_err(|_| bad())?;
            match key {
                "after" if n >= 1 => policy.after = u32::try_from(n).map_err(|_| bad())?,
                "window" => policy.window = n,
                _ => return Err(bad()),
            }
        }
        Ok(policy)
    }
}

paging_policy::export_policy!(Reap);
