//! `demand`: Denali's policy. Blocks come in one at a time when touched;
//! eviction is a clock over VMs with a VM's blocks clustered; each VM owns a
//! swap region of its RAM size allocated when it is created.

use super::clock::VmClock;
use super::{BlockId, Policy, SwapLayout, VmId};

/// Demand paging with clustered clock eviction.
#[derive(Debug, Default)]
pub struct Demand {
    clock: VmClock,
}

impl Demand {
    /// A policy with no VMs.
    pub fn new() -> Demand {
        Demand::default()
    }
}

impl Policy for Demand {
    fn name(&self) -> &str {
        "demand"
    }

    fn layout(&self) -> SwapLayout {
        SwapLayout::PerVm
    }

    fn on_vm_registered(&mut self, vm: VmId, blocks: u32) {
        self.clock.add(vm, blocks);
    }

    fn on_vm_unregistered(&mut self, vm: VmId) {
        self.clock.remove(vm);
    }

    fn on_access(&mut self, vm: VmId) {
        self.clock.touch(vm);
    }

    fn on_fault(&mut self, vm: VmId, _block: BlockId, _prefetch: &mut Vec<BlockId>) {
        self.clock.touch(vm);
    }

    fn on_installed(&mut self, vm: VmId, block: BlockId) {
        self.clock.insert(vm, block);
    }

    fn choose_victims(&mut self, need: u32, faulting_vm: VmId, victims: &mut Vec<(VmId, BlockId)>) {
        self.clock.choose(need, faulting_vm, victims);
    }

    fn on_evicted(&mut self, vm: VmId, block: BlockId) {
        self.clock.remove_block(vm, block);
    }
}
