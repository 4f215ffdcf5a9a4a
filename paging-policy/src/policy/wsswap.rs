//! `wsswap`: working-set swap, the layout Denali's authors proposed.
//!
//! Victims are chosen like `demand` (whole VMs by clock), but the swap is a
//! log: the evicted working set is written as one sequential extent, and the
//! set is recorded. When the VM runs again the whole recorded set is
//! prefetched, so it comes back with one sequential read instead of one
//! random read per block.
//!
//! "Runs again" is the `after`-th fault since the eviction (default 3). An
//! idle VM that is merely woken (an interrupt: densevm's guests then touch
//! their code block and their stack block, two faults) must not pull its
//! whole working set back in and push an active VM out; a request touches
//! far more blocks, so by its third fault the VM is really running.
//! `wsswap,after=1` swaps in at the very first fault.
//!
//! A VM woken from hibernation is different: it was woken for work and runs
//! at once, so its first fault after the wake brings in the whole set
//! recorded when it hibernated, with one read (REAP's restore).

use super::clock::VmClock;
use super::{BlockId, Policy, SwapLayout, VmId};
use std::collections::HashMap;

/// Faults since eviction after which the recorded set is prefetched.
pub const DEFAULT_AFTER: u32 = 3;

#[derive(Debug, Default)]
struct VmSet {
    /// Blocks evicted (as part of the VM's eviction) since its swap-in.
    recorded: Vec<BlockId>,
    /// Faults since the VM was last evicted.
    faults: u32,
    /// Woken from hibernation and not faulted since: the next fault
    /// prefetches the recorded set, whatever `after` says.
    armed: bool,
}

/// Working-set swap.
#[derive(Debug)]
pub struct WsSwap {
    clock: VmClock,
    /// By id: a map, so that memory follows the VMs alive.
    sets: HashMap<VmId, VmSet>,
    after: u32,
    /// The VM the current victims make room for. Blocks a VM gives up to
    /// make room for itself are not its working set leaving: recording them
    /// would prefetch them back at its next fault, evicting others of its
    /// blocks in turn (a ping-pong inside one VM that is barely smaller than
    /// the budget).
    making_room_for: Option<VmId>,
}

impl WsSwap {
    /// A policy with no VMs that prefetches at the `after`-th fault since a
    /// VM's eviction.
    pub fn new(after: u32) -> WsSwap {
        WsSwap {
            clock: VmClock::default(),
            sets: HashMap::new(),
            after: after.max(1),
            making_room_for: None,
        }
    }

    /// A registered VM's set: events for a VM already unregistered (the
    /// last blocks of a dying one) make no new entry.
    fn set(&mut self, vm: VmId) -> Option<&mut VmSet> {
        self.sets.get_mut(&vm)
    }
}

impl Policy for WsSwap {
    fn name(&self) -> &str {
        "wsswap"
    }

    fn layout(&self) -> SwapLayout {
        SwapLayout::Log
    }

    fn on_vm_registered(&mut self, vm: VmId, blocks: u32) {
        self.clock.add(vm, blocks);
        self.sets.insert(vm, VmSet::default());
    }

    fn on_vm_unregistered(&mut self, vm: VmId) {
        self.clock.remove(vm);
        self.sets.remove(&vm);
    }

    fn on_access(&mut self, vm: VmId) {
        self.clock.touch(vm);
    }

    fn on_fault(&mut self, vm: VmId, _block: BlockId, prefetch: &mut Vec<BlockId>) {
        self.clock.touch(vm);
        let after = self.after;
        let Some(set) = self.set(vm) else {
            return;
        };
        set.faults = set.faults.saturating_add(1);
        let armed = std::mem::take(&mut set.armed);
        if armed || set.faults >= after {
            prefetch.append(&mut set.recorded);
        }
    }

    fn on_installed(&mut self, vm: VmId, block: BlockId) {
        self.clock.insert(vm, block);
    }

    fn choose_victims(&mut self, need: u32, faulting_vm: VmId, victims: &mut Vec<(VmId, BlockId)>) {
        self.making_room_for = Some(faulting_vm);
        self.clock.choose(need, faulting_vm, victims);
    }

    fn on_quota_eviction(&mut self, vm: VmId) {
        self.making_room_for = Some(vm);
    }

    fn on_hibernated(&mut self, _vm: VmId) {
        // The VM leaves whole with its working set, even if its last
        // eviction was it making room for itself: record every block.
        self.making_room_for = None;
    }

    fn on_woken(&mut self, vm: VmId, _prefetch: &mut Vec<BlockId>) {
        // The pager's batch brings the set back; a block it could not (busy
        // then, or past its cap) comes with the set at the first fault.
        if let Some(set) = self.set(vm) {
            set.armed = true;
        }
    }

    fn on_evicted(&mut self, vm: VmId, block: BlockId) {
        self.clock.remove_block(vm, block);
        if self.making_room_for == Some(vm) {
            return;
        }
        if let Some(set) = self.set(vm) {
            set.faults = 0;
            // Blocks installed one by one before the swap-in (the first
            // faults) may be recorded twice; the pager ignores repeats, and
            // the list is compacted before it can grow past the VM.
            set.recorded.push(block);
            if set.recorded.len() > 4096 {
                set.recorded.sort_unstable();
                set.recorded.dedup();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// VM 0 with blocks 0..3 resident, VM 1 with none (the faulting one).
    fn wsswap(after: u32) -> WsSwap {
        let mut w = WsSwap::new(after);
        w.on_vm_registered(0, 8);
        w.on_vm_registered(1, 8);
        for b in 0..3 {
            w.on_installed(0, b);
        }
        w
    }

    /// Evicts what the policy chooses to make room for `faulting`.
    fn evict_for(w: &mut WsSwap, faulting: VmId, need: u32) -> Vec<(VmId, BlockId)> {
        let mut out = Vec::new();
        w.choose_victims(need, faulting, &mut out);
        for &(vm, b) in &out {
            w.on_evicted(vm, b);
        }
        out
    }

    fn fault(w: &mut WsSwap, vm: VmId, block: BlockId) -> Vec<BlockId> {
        let mut prefetch = Vec::new();
        w.on_fault(vm, block, &mut prefetch);
        prefetch
    }

    #[test]
    fn writes_a_log() {
        assert_eq!(wsswap(3).layout(), SwapLayout::Log);
        assert_eq!(wsswap(3).name(), "wsswap");
    }

    #[test]
    fn the_evicted_set_comes_back_at_the_after_th_fault() {
        let mut w = wsswap(3);
        assert_eq!(evict_for(&mut w, 1, 1), vec![(0, 0), (0, 1), (0, 2)]);
        assert!(fault(&mut w, 0, 5).is_empty());
        assert!(fault(&mut w, 0, 6).is_empty());
        let mut back = fault(&mut w, 0, 0);
        back.sort_unstable();
        assert_eq!(back, vec![0, 1, 2]);
        // The set was handed out once; the next fault prefetches nothing.
        assert!(fault(&mut w, 0, 7).is_empty());
    }

    #[test]
    fn after_one_prefetches_at_the_first_fault() {
        let mut w = wsswap(1);
        evict_for(&mut w, 1, 1);
        assert_eq!(fault(&mut w, 0, 4).len(), 3);
    }

    #[test]
    fn blocks_a_vm_gives_up_for_itself_are_not_recorded() {
        let mut w = wsswap(1);
        // Only VM 0 has blocks and it is the one faulting: it makes room for itself.
        assert_eq!(evict_for(&mut w, 0, 2), vec![(0, 0), (0, 1)]);
        assert!(fault(&mut w, 0, 4).is_empty());
    }

    #[test]
    fn a_quota_eviction_is_the_vm_making_room_for_itself() {
        let mut w = wsswap(1);
        evict_for(&mut w, 1, 1); // VM 0 leaves whole: recorded
        for b in 0..3 {
            w.on_installed(0, b);
        }
        fault(&mut w, 0, 0); // swapped in: the recorded set is handed out
        w.on_quota_eviction(0);
        w.on_evicted(0, 2);
        assert!(fault(&mut w, 0, 2).is_empty());
    }

    #[test]
    fn a_woken_vm_brings_its_hibernated_set_back_at_its_first_fault() {
        let mut w = wsswap(3);
        // VM 0's last eviction was it making room for itself (not recorded);
        // the hibernation that follows is recorded all the same.
        assert_eq!(evict_for(&mut w, 0, 1), vec![(0, 0)]);
        w.on_installed(0, 0);
        w.on_hibernated(0);
        for b in 0..3 {
            w.on_evicted(0, b);
        }
        w.on_woken(0, &mut Vec::new());
        let mut back = fault(&mut w, 0, 7);
        back.sort_unstable();
        assert_eq!(back, vec![0, 1, 2]);
        assert!(fault(&mut w, 0, 6).is_empty(), "armed once per wake");
    }

    #[test]
    fn a_hibernated_vm_not_woken_waits_for_the_after_th_fault() {
        let mut w = wsswap(3);
        w.on_hibernated(0);
        for b in 0..3 {
            w.on_evicted(0, b);
        }
        assert!(fault(&mut w, 0, 5).is_empty());
        assert!(fault(&mut w, 0, 6).is_empty());
        assert_eq!(fault(&mut w, 0, 7).len(), 3);
    }

    #[test]
    fn a_new_registration_starts_with_no_recorded_set() {
        let mut w = wsswap(1);
        evict_for(&mut w, 1, 1);
        w.on_vm_unregistered(0);
        w.on_vm_registered(0, 8);
        assert!(fault(&mut w, 0, 1).is_empty());
    }

    #[test]
    fn events_after_unregistration_keep_nothing() {
        let mut w = wsswap(1);
        w.on_vm_unregistered(0);
        w.on_evicted(0, 2);
        w.on_woken(0, &mut Vec::new());
        assert!(fault(&mut w, 0, 1).is_empty());
        assert!(!w.sets.contains_key(&0), "a dead VM's set came back");
    }
}
