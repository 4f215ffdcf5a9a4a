//! Example out-of-tree policy: global FIFO eviction of single blocks.
//!
//! Build: `cargo build --release -p paging-policy --examples`, then run with
//! `--policy target/release/examples/libfifo_policy.so`.
//!
//! It shows the whole plugin surface: implement `Policy`, add a constructor
//! through `PluginPolicyFactory`, export with `export_policy!`.

use std::collections::{HashMap, HashSet, VecDeque};

use paging_policy::policy::plugin::PluginPolicyFactory;
use paging_policy::policy::{BlockId, Policy, SwapLayout, VmId};

/// Evicts the blocks installed longest ago, one block at a time.
struct Fifo {
    /// Installation order; may hold blocks since evicted or of removed VMs
    /// (skipped lazily).
    queue: VecDeque<(VmId, BlockId)>,
    resident: HashSet<(VmId, BlockId)>,
    vms: HashMap<VmId, u32>,
}

impl Policy for Fifo {
    fn name(&self) -> &str {
        "fifo"
    }

    fn layout(&self) -> SwapLayout {
        SwapLayout::PerVm
    }

    fn on_vm_registered(&mut self, vm: VmId, blocks: u32) {
        self.vms.insert(vm, blocks);
    }

    fn on_vm_unregistered(&mut self, vm: VmId) {
        self.vms.remove(&vm);
        self.resident.retain(|&(v, _)| v != vm);
    }

    fn on_fault(&mut self, _vm: VmId, _block: BlockId, _prefetch: &mut Vec<BlockId>) {}

    fn on_installed(&mut self, vm: VmId, block: BlockId) {
        self.resident.insert((vm, block));
        self.queue.push_back((vm, block));
    }

    fn choose_victims(
        &mut self,
        need: u32,
        _faulting_vm: VmId,
        victims: &mut Vec<(VmId, BlockId)>,
    ) {
        // Propose the oldest resident blocks without dequeuing them: they
        // leave the queue when `on_evicted` confirms.
        let mut seen = HashSet::new();
        for &(vm, block) in &self.queue {
            if victims.len() as u32 >= need {
                break;
            }
            if self.resident.contains(&(vm, block)) && seen.insert((vm, block)) {
                victims.push((vm, block));
            }
        }
    }

    fn on_evicted(&mut self, vm: VmId, block: BlockId) {
        self.resident.remove(&(vm, block));
        while let Some(front) = self.queue.front() {
            if self.resident.contains(front) {
                break;
            }
            self.queue.pop_front();
        }
    }
}

impl PluginPolicyFactory for Fifo {
    fn create(args: &str, _block_bytes: u64, _budget_blocks: u64) -> Result<Self, String> {
        if !args.is_empty() {
            return Err(format!("fifo takes no arguments, got '{args}'"));
        }
        Ok(Fifo {
            queue: VecDeque::new(),
            resident: HashSet::new(),
            vms: HashMap::new(),
        })
    }
}

paging_policy::export_policy!(Fifo);
