//! Clock over VMs with each VM's blocks clustered: the shared victim
//! selection of `demand` and `wsswap`.
//!
//! The hand sweeps VMs in registration order. A VM used since the hand last
//! passed (reference bit set by `touch`) gets a second chance; otherwise all
//! of its resident blocks are evicted together, so a VM leaves memory as one
//! sequential write instead of being trickled out block by block.

use super::{BlockId, VmId};

#[derive(Debug, Default)]
struct VmEntry {
    present: bool,
    referenced: bool,
    /// Index in `ring`.
    slot: usize,
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
    vms: Vec<VmEntry>,
    ring: Vec<VmId>,
    hand: usize,
}

impl VmClock {
    fn entry(&mut self, vm: VmId) -> &mut VmEntry {
        let i = vm as usize;
        if i >= self.vms.len() {
            self.vms.resize_with(i + 1, VmEntry::default);
        }
        &mut self.vms[i]
    }

    /// Adds a VM with `blocks` blocks at the end of the sweep order.
    pub fn add(&mut self, vm: VmId, blocks: u32) {
        let slot = self.ring.len();
        let e = self.entry(vm);
        *e = VmEntry {
            present: true,
            referenced: false,
            slot,
            resident: vec![0; (blocks as usize).div_ceil(64)],
            count: 0,
            own_hand: 0,
        };
        self.ring.push(vm);
    }

    /// Removes a VM.
    pub fn remove(&mut self, vm: VmId) {
        let Some(e) = self.vms.get_mut(vm as usize).filter(|e| e.present) else {
            return;
        };
        let slot = e.slot;
        *e = VmEntry::default();
        self.ring.swap_remove(slot);
        if let Some(&moved) = self.ring.get(slot) {
            self.vms[moved as usize].slot = slot;
        }
        if self.hand >= self.ring.len() {
            self.hand = 0;
        }
    }

    /// Sets the VM's reference bit.
    pub fn touch(&mut self, vm: VmId) {
        if let Some(e) = self.vms.get_mut(vm as usize) {
            e.referenced = true;
        }
    }

    /// Marks a block resident.
    pub fn insert(&mut self, vm: VmId, block: BlockId) {
        if let Some(e) = self.vms.get_mut(vm as usize).filter(|e| e.present) {
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
        if let Some(e) = self.vms.get_mut(vm as usize).filter(|e| e.present) {
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
            let vm = self.ring[self.hand];
            self.hand = (self.hand + 1) % n;
            let e = &mut self.vms[vm as usize];
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
            if let Some(e) = self.vms.get_mut(faulting as usize).filter(|e| e.present) {
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
