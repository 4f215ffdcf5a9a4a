//! Clock over VMs with each VM's blocks clustered: the shared victim
//! selection of `demand` and `wsswap`.
//!
//! The hand sweeps VMs in registration order. A VM used since the hand last
//! passed (reference bit set by `touch`) gets a second chance; otherwise all
//! of its resident blocks are evicted together, so a VM leaves memory as one
//! sequential write instead of being trickled out block by block.

use super::{BlockId, VmId};
use std::collections::HashMap;

#[derive(Debug)]
struct VmEntry {
    vm: VmId,
    referenced: bool,
    /// Resident blocks as a bitmap.
    resident: Vec<u64>,
    count: u32,
    /// Where the next eviction from this VM's own blocks starts (when it
    /// must make room for itself): a sweep, so its hottest low blocks (code,
    /// page tables) are not always the first to go.
    own_hand: u32,
}

/// Clock state of all VMs.
#[derive(Debug, Default)]
pub struct VmClock {
    /// The VMs in sweep order: the hand walks this without a lookup.
    ring: Vec<VmEntry>,
    /// Each VM's index in `ring`: a map, so that memory follows the VMs
    /// alive, not every id a long run has handed out.
    slots: HashMap<VmId, usize>,
    hand: usize,
}

impl VmClock {
    /// Adds a VM with `blocks` blocks at the end of the sweep order.
    pub fn add(&mut self, vm: VmId, blocks: u32) {
        self.remove(vm);
        self.slots.insert(vm, self.ring.len());
        self.ring.push(VmEntry {
            vm,
            referenced: false,
            resident: vec![0; (blocks as usize).div_ceil(64)],
            count: 0,
            own_hand: 0,
        });
    }

    /// Removes a VM.
    pub fn remove(&mut self, vm: VmId) {
        let Some(slot) = self.slots.remove(&vm) else {
            return;
        };
        self.ring.swap_remove(slot);
        if let Some(moved) = self.ring.get(slot) {
            self.slots.insert(moved.vm, slot);
        }
        if self.hand >= self.ring.len() {
            self.hand = 0;
        }
    }

    fn entry(&mut self, vm: VmId) -> Option<&mut VmEntry> {
        let slot = *self.slots.get(&vm)?;
        self.ring.get_mut(slot)
    }

    /// Sets the VM's reference bit.
    pub fn touch(&mut self, vm: VmId) {
        if let Some(e) = self.entry(vm) {
            e.referenced = true;
        }
    }

    /// Marks a block resident.
    pub fn insert(&mut self, vm: VmId, block: BlockId) {
        if let Some(e) = self.entry(vm) {
            let (w, bit) = (block as usize / 64, 1u64 << (block % 64));
            if let Some(word) = e.resident.get_mut(w) {
                if *word & bit == 0 {
                    *word |= bit;
                    e.count += 1;
                }
            }
        }
    }

    /// Marks a block not resident.
    pub fn remove_block(&mut self, vm: VmId, block: BlockId) {
        if let Some(e) = self.entry(vm) {
            let (w, bit) = (block as usize / 64, 1u64 << (block % 64));
            if let Some(word) = e.resident.get_mut(w) {
                if *word & bit != 0 {
                    *word &= !bit;
                    e.count -= 1;
                }
            }
        }
    }

    /// Pushes up to `limit` resident blocks of `e`, starting at block
    /// `from` and wrapping around; returns how many and where it stopped.
    fn push_blocks(
        e: &VmEntry,
        vm: VmId,
        limit: u32,
        from: u32,
        out: &mut Vec<(VmId, BlockId)>,
    ) -> (u32, u32) {
        let nbits = (e.resident.len() * 64) as u32;
        let mut n = 0;
        let mut b = from % nbits.max(1);
        for _ in 0..nbits {
            if n >= limit {
                break;
            }
            if e.resident[(b / 64) as usize] & (1u64 << (b % 64)) != 0 {
                out.push((vm, b));
                n += 1;
            }
            b = (b + 1) % nbits;
        }
        (n, b)
    }

    /// Sweeps for at least `need` blocks: whole unreferenced VMs other than
    /// `faulting`, then, if the sweep found too few, just enough blocks of
    /// `faulting` itself, taken round-robin over its RAM.
    pub fn choose(&mut self, need: u32, faulting: VmId, out: &mut Vec<(VmId, BlockId)>) {
        let mut got = 0u32;
        let n = self.ring.len();
        // VMs already taken in this sweep: their blocks stay resident until
        // `on_evicted`, so the second turn must not take them again.
        let mut taken: Vec<VmId> = Vec::new();
        // Two full turns: the first may only clear reference bits.
        for _ in 0..2 * n {
            if got >= need {
                break;
            }
            let e = &mut self.ring[self.hand];
            self.hand = (self.hand + 1) % n;
            let vm = e.vm;
            if e.count == 0 || vm == faulting || taken.contains(&vm) {
                continue;
            }
            if e.referenced {
                e.referenced = false;
                continue;
            }
            got += Self::push_blocks(e, vm, e.count, 0, out).0;
            taken.push(vm);
        }
        if got < need {
            if let Some(e) = self.entry(faulting) {
                let (_, next) = Self::push_blocks(e, faulting, need - got, e.own_hand, out);
                e.own_hand = next;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A clock of `n` VMs of 8 blocks, each with `resident[vm]` blocks
    /// resident from block 0.
    fn clock(resident: &[u32]) -> VmClock {
        let mut c = VmClock::default();
        for (vm, &count) in resident.iter().enumerate() {
            c.add(vm as VmId, 8);
            for b in 0..count {
                c.insert(vm as VmId, b);
            }
        }
        c
    }

    fn choose(c: &mut VmClock, need: u32, faulting: VmId) -> Vec<(VmId, BlockId)> {
        let mut out = Vec::new();
        c.choose(need, faulting, &mut out);
        out
    }

    #[test]
    fn an_unreferenced_vm_leaves_whole() {
        let mut c = clock(&[3, 1, 0]);
        assert_eq!(choose(&mut c, 1, 2), vec![(0, 0), (0, 1), (0, 2)]);
    }

    #[test]
    fn a_referenced_vm_gets_a_second_chance() {
        let mut c = clock(&[2, 1, 0]);
        c.touch(0);
        // The hand clears VM 0's bit and takes VM 1.
        assert_eq!(choose(&mut c, 1, 2), vec![(1, 0)]);
        // VM 1's blocks are still resident until evicted; once they are,
        // the next sweep comes back to VM 0, now unreferenced.
        c.remove_block(1, 0);
        assert_eq!(choose(&mut c, 1, 2), vec![(0, 0), (0, 1)]);
    }

    #[test]
    fn a_vm_touched_again_survives_every_sweep_while_another_can_go() {
        let mut c = clock(&[2, 2, 0]);
        for _ in 0..3 {
            c.touch(0);
            let out = choose(&mut c, 2, 2);
            assert!(out.iter().all(|&(vm, _)| vm == 1), "{out:?}");
        }
    }

    #[test]
    fn the_faulting_vm_gives_its_own_blocks_last_and_round_robin() {
        let mut c = clock(&[4]);
        assert_eq!(choose(&mut c, 2, 0), vec![(0, 0), (0, 1)]);
        // Blocks 0 and 1 stay resident until evicted: the own hand moves on.
        assert_eq!(choose(&mut c, 2, 0), vec![(0, 2), (0, 3)]);
        assert_eq!(choose(&mut c, 1, 0), vec![(0, 0)]);
    }

    #[test]
    fn a_block_is_counted_once_and_removed_blocks_are_not_chosen() {
        let mut c = clock(&[0, 0]);
        c.insert(0, 5);
        c.insert(0, 5);
        c.insert(0, 7);
        c.remove_block(0, 7);
        c.remove_block(0, 7);
        c.insert(0, 64); // beyond the VM: ignored
        assert_eq!(choose(&mut c, 1, 1), vec![(0, 5)]);
    }

    #[test]
    fn removing_a_vm_keeps_the_sweep_order_of_the_others() {
        let mut c = clock(&[1, 1, 1, 1]);
        c.remove(0);
        // The last VM (3) moved into VM 0's slot: the sweep meets it first.
        assert_eq!(choose(&mut c, 3, 9), vec![(3, 0), (1, 0), (2, 0)]);
        c.remove(3);
        c.remove(1);
        assert_eq!(choose(&mut c, 1, 9), vec![(2, 0)]);
        c.remove(2);
        assert!(choose(&mut c, 1, 9).is_empty());
    }
}
