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

#[cfg(test)]
mod tests {
    use super::*;

    fn demand_with(resident: &[u32]) -> Demand {
        let mut d = Demand::new();
        for (vm, &count) in resident.iter().enumerate() {
            d.on_vm_registered(vm as VmId, 8);
            for b in 0..count {
                d.on_installed(vm as VmId, b);
            }
        }
        d
    }

    fn victims(d: &mut Demand, need: u32, faulting: VmId) -> Vec<(VmId, BlockId)> {
        let mut out = Vec::new();
        d.choose_victims(need, faulting, &mut out);
        out
    }

    #[test]
    fn rewrites_each_vm_in_place() {
        let d = Demand::new();
        assert_eq!((d.name(), d.layout()), ("demand", SwapLayout::PerVm));
    }

    #[test]
    fn a_vm_that_served_or_faulted_is_kept_over_an_idle_one() {
        let mut d = demand_with(&[1, 1, 1, 0]);
        d.on_access(0);
        let mut prefetch = Vec::new();
        d.on_fault(1, 3, &mut prefetch);
        assert!(
            prefetch.is_empty(),
            "demand fetches only the faulting block"
        );
        assert_eq!(victims(&mut d, 1, 3), vec![(2, 0)]);
    }

    #[test]
    fn evicted_blocks_are_not_proposed_again() {
        let mut d = demand_with(&[2, 0]);
        assert_eq!(victims(&mut d, 1, 1), vec![(0, 0), (0, 1)]);
        d.on_evicted(0, 0);
        d.on_evicted(0, 1);
        assert!(victims(&mut d, 1, 1).is_empty());
    }

    #[test]
    fn an_unregistered_vm_is_forgotten() {
        let mut d = demand_with(&[2, 0]);
        d.on_vm_unregistered(0);
        assert!(victims(&mut d, 1, 1).is_empty());
    }
}
