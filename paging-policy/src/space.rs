//! Swap layouts: where on the swap device each evicted block lives.
//!
//! * `PerVm` (Denali): each VM gets a region of its RAM size at registration;
//!   block `b` of the VM always lives at `region + b * block`. Rewrites go in
//!   place, so space is never fragmented and never reclaimed until the VM is
//!   destroyed.
//! * `Log` (working-set swap): every eviction batch of a VM is written to a
//!   fresh contiguous extent found from a moving cursor (log-structured, with
//!   wrap-around). A block's previous copy is released once the new copy is
//!   on disk, so space is reclaimed block by block; free space is a map of
//!   ranges merged on release. When no single free range is large enough the
//!   batch is split over several ranges; only when the total free space is
//!   short is the swap full.

use std::collections::{BTreeMap, HashMap};

use crate::error::PagerError;
use crate::policy::SwapLayout;

/// Swap bytes the pager sizes per byte of VM RAM, by the policy's layout:
/// the log needs slack to find contiguous extents.
pub fn swap_bytes_per_ram_byte(layout: SwapLayout) -> u64 {
    match layout {
        SwapLayout::PerVm => 1,
        SwapLayout::Log => 2,
    }
}

/// Free-space map of the log layout (and of compact swap's records).
#[derive(Debug, Default)]
pub(crate) struct LogSpace {
    free: BTreeMap<u64, u64>,
    free_bytes: u64,
    cursor: u64,
}

impl LogSpace {
    fn take(&mut self, start: u64, len: u64, at: u64, need: u64) -> u64 {
        self.free.remove(&start);
        if at > start {
            self.free.insert(start, at - start);
        }
        if at + need < start + len {
            self.free.insert(at + need, start + len - at - need);
        }
        self.free_bytes -= need;
        self.cursor = at + need;
        at
    }

    /// One contiguous range of `need` bytes, searching from the cursor and
    /// wrapping once.
    fn alloc_contiguous(&mut self, need: u64) -> Option<u64> {
        if let Some((&s, &l)) = self.free.range(..=self.cursor).next_back() {
            if s + l >= self.cursor + need {
                let at = self.cursor;
                return Some(self.take(s, l, at, need));
            }
        }
        let found = self
            .free
            .range(self.cursor..)
            .chain(self.free.range(..self.cursor))
            .find(|(_, &l)| l >= need)
            .map(|(&s, &l)| (s, l));
        found.map(|(s, l)| self.take(s, l, s, need))
    }

    /// One contiguous range of `len` bytes, if there is one.
    pub(crate) fn alloc(&mut self, len: u64) -> Option<u64> {
        self.alloc_contiguous(len)
    }

    /// Returns `len` bytes at `start` to the free space.
    pub(crate) fn free(&mut self, start: u64, len: u64) {
        self.release(start, len);
        self.free_bytes += len;
    }

    fn release(&mut self, mut start: u64, mut len: u64) {
        if let Some((&ps, &pl)) = self.free.range(..start).next_back() {
            if ps + pl == start {
                self.free.remove(&ps);
                start = ps;
                len += pl;
            }
        }
        if let Some(&nl) = self.free.get(&(start + len)) {
            self.free.remove(&(start + len));
            len += nl;
        }
        self.free.insert(start, len);
    }
}

/// Allocation state of the swap device.
#[derive(Debug)]
pub struct SwapSpace {
    layout: SwapLayout,
    block: u64,
    capacity: u64,
    slot_bytes: u64,
    slots: HashMap<u32, u64>,
    free_slots: Vec<u64>,
    next_slot: u64,
    log: LogSpace,
    /// End of the part of the device the log may use: grows by
    /// [`swap_bytes_per_ram_byte`] x VM RAM with each commit that needs it,
    /// up to the capacity, never shrinks. The pager allocates exactly this
    /// prefix of the swap file as VMs commit, so the log never writes where
    /// the filesystem could answer ENOSPC.
    log_limit: u64,
}

impl SwapSpace {
    /// Swap space of `capacity` bytes for VMs of `vm_ram_bytes`.
    pub fn new(layout: SwapLayout, capacity: u64, block: u64, vm_ram_bytes: u64) -> SwapSpace {
        let capacity = capacity / block * block;
        SwapSpace {
            layout,
            block,
            capacity,
            slot_bytes: vm_ram_bytes,
            slots: HashMap::new(),
            free_slots: Vec::new(),
            next_slot: 0,
            log: LogSpace {
                free: BTreeMap::new(),
                free_bytes: 0,
                cursor: 0,
            },
            log_limit: 0,
        }
    }

    /// Bytes currently holding block copies (or reserved as VM regions).
    pub fn used_bytes(&self) -> u64 {
        match self.layout {
            SwapLayout::PerVm => self.slots.len() as u64 * self.slot_bytes,
            SwapLayout::Log => self.log_limit - self.log.free_bytes,
        }
    }

    /// The layout in use.
    pub fn layout(&self) -> SwapLayout {
        self.layout
    }

    /// Bytes of swap a VM needs under this layout (what [`Self::commit`]
    /// checks the capacity for).
    pub fn bytes_per_vm(&self) -> u64 {
        self.slot_bytes * swap_bytes_per_ram_byte(self.layout)
    }

    /// Commits swap to a VM: its region (per-VM layout) or its share of the
    /// log. Committed VMs x [`Self::bytes_per_vm`] must fit in the
    /// capacity, or the VM is refused here ([`PagerError::SwapFull`])
    /// rather than found out of space at an eviction. `allocate(bytes)` is
    /// called first with the device's prefix that must then be allocated
    /// (every region handed out, or the log's limit); its error leaves the
    /// space as it was. Called at a VM's first fault, not at registration:
    /// a VM created asleep and never woken costs no swap.
    pub fn commit(
        &mut self,
        vm: u32,
        allocate: impl FnOnce(u64) -> Result<(), PagerError>,
    ) -> Result<(), PagerError> {
        if self.slots.contains_key(&vm) {
            return Ok(());
        }
        if self.layout == SwapLayout::Log {
            let per_vm = self.bytes_per_vm();
            let need = (self.slots.len() as u64 + 1).saturating_mul(per_vm);
            if need > self.capacity {
                return Err(PagerError::SwapFull {
                    needed: need - self.capacity,
                    capacity: self.capacity,
                });
            }
            if need > self.log_limit {
                allocate(need)?;
                self.log.release(self.log_limit, need - self.log_limit);
                self.log.free_bytes += need - self.log_limit;
                self.log_limit = need;
            }
            self.slots.insert(vm, 0);
            return Ok(());
        }
        let slot = match self.free_slots.last() {
            Some(&s) => s,
            None if (self.next_slot + 1) * self.slot_bytes <= self.capacity => self.next_slot,
            None => {
                return Err(PagerError::SwapFull {
                    needed: self.slot_bytes,
                    capacity: self.capacity,
                })
            }
        };
        // Every slot below the high-water mark: a free slot whose first
        // allocation failed is covered by the next one that succeeds.
        allocate(self.next_slot.max(slot + 1) * self.slot_bytes)?;
        if self.free_slots.last() == Some(&slot) {
            self.free_slots.pop();
        } else {
            self.next_slot += 1;
        }
        self.slots.insert(vm, slot);
        Ok(())
    }

    /// Returns a VM's region to the free pool (per-VM layout).
    pub fn unregister(&mut self, vm: u32) {
        if let Some(slot) = self.slots.remove(&vm) {
            if self.layout == SwapLayout::PerVm {
                self.free_slots.push(slot);
            }
        }
    }

    /// Chooses swap offsets for `blocks` of `vm` about to be written, in
    /// order; the log layout keeps them contiguous whenever it can. A VM
    /// without committed swap has no place ([`PagerError::SwapFull`]).
    pub fn place(&mut self, vm: u32, blocks: &[u32], out: &mut Vec<u64>) -> Result<(), PagerError> {
        out.clear();
        let Some(&slot) = self.slots.get(&vm) else {
            return Err(PagerError::SwapFull {
                needed: blocks.len() as u64 * self.block,
                capacity: self.capacity,
            });
        };
        match self.layout {
            SwapLayout::PerVm => {
                let base = slot * self.slot_bytes;
                out.extend(blocks.iter().map(|&b| base + b as u64 * self.block));
            }
            SwapLayout::Log => {
                let need = blocks.len() as u64 * self.block;
                if need > self.log.free_bytes {
                    return Err(PagerError::SwapFull {
                        needed: need - self.log.free_bytes,
                        capacity: self.capacity,
                    });
                }
                if let Some(at) = self.log.alloc_contiguous(need) {
                    out.extend((0..blocks.len() as u64).map(|i| at + i * self.block));
                } else {
                    // Fragmented: fall back to block-sized pieces.
                    for _ in blocks {
                        let at = self
                            .log
                            .alloc_contiguous(self.block)
                            .expect("free bytes counted");
                        out.push(at);
                    }
                }
            }
        }
        Ok(())
    }

    /// Releases the copies of blocks at `offsets` (log layout; per-VM
    /// regions keep their space until the VM goes away). Adjacent copies are
    /// released as one range: the free map is touched once per run, not
    /// once per block. `offsets` is sorted in place.
    pub fn release(&mut self, offsets: &mut [u64]) {
        if self.layout != SwapLayout::Log || offsets.is_empty() {
            return;
        }
        offsets.sort_unstable();
        self.log.free_bytes += offsets.len() as u64 * self.block;
        let mut start = offsets[0];
        let mut len = self.block;
        for &o in &offsets[1..] {
            if o == start + len {
                len += self.block;
            } else {
                self.log.release(start, len);
                start = o;
                len = self.block;
            }
        }
        self.log.release(start, len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn commit(s: &mut SwapSpace, vm: u32) -> Result<(), PagerError> {
        s.commit(vm, |_| Ok(()))
    }

    #[test]
    fn per_vm_regions() {
        let mut s = SwapSpace::new(SwapLayout::PerVm, 2 << 20, 4096, 1 << 20);
        commit(&mut s, 7).unwrap();
        commit(&mut s, 9).unwrap();
        assert!(commit(&mut s, 10).is_err());
        let mut out = Vec::new();
        s.place(9, &[0, 3], &mut out).unwrap();
        assert_eq!(out, vec![1 << 20, (1 << 20) + 3 * 4096]);
        s.unregister(7);
        commit(&mut s, 10).unwrap();
        s.place(10, &[1], &mut out).unwrap();
        assert_eq!(out, vec![4096]);
    }

    /// Swap is committed at a VM's first fault: until then it has no place,
    /// and the device is asked to allocate only the prefix handed out. A
    /// failed allocation leaves the space as it was, and the next commit
    /// asks for the same prefix again.
    #[test]
    fn swap_is_committed_not_registered_and_a_failed_allocation_changes_nothing() {
        let ram = 1 << 20;
        for layout in [SwapLayout::PerVm, SwapLayout::Log] {
            let per_vm = ram * swap_bytes_per_ram_byte(layout);
            let mut s = SwapSpace::new(layout, 100 * per_vm, 4096, ram);
            let mut out = Vec::new();
            assert!(s.place(1, &[0], &mut out).is_err(), "{layout:?}");
            let refused = || PagerError::SwapFull {
                needed: 1,
                capacity: 1,
            };
            let mut asked = Vec::new();
            let e = s.commit(1, |b| {
                asked.push(b);
                Err(refused())
            });
            assert!(e.is_err() && !s.slots.contains_key(&1), "{layout:?}");
            assert_eq!(s.used_bytes(), 0, "{layout:?}");
            s.commit(2, |b| {
                asked.push(b);
                Ok(())
            })
            .unwrap();
            s.commit(3, |b| {
                asked.push(b);
                Ok(())
            })
            .unwrap();
            assert_eq!(asked, vec![per_vm, per_vm, 2 * per_vm], "{layout:?}");
            assert!(s.slots.contains_key(&2) && s.slots.contains_key(&3));
            assert_eq!(
                s.used_bytes(),
                if layout == SwapLayout::PerVm {
                    2 * ram
                } else {
                    0
                }
            );
            s.place(3, &[0], &mut out).unwrap();
            assert!(out[0] < 2 * per_vm, "{layout:?}: {out:?}");
        }
    }

    #[test]
    fn log_appends_reclaims_and_fills() {
        let mut s = SwapSpace::new(SwapLayout::Log, 8 * 4096, 4096, 4 * 4096);
        commit(&mut s, 1).unwrap();
        let mut a = Vec::new();
        s.place(1, &[0, 1, 2], &mut a).unwrap();
        assert_eq!(a, vec![0, 4096, 8192]);
        let mut b = Vec::new();
        s.place(1, &[5, 6, 7], &mut b).unwrap();
        assert_eq!(b, vec![3 * 4096, 4 * 4096, 5 * 4096]);
        // Rewriting VM 1 releases its old copies; the log wraps and reuses.
        let mut c = Vec::new();
        s.place(1, &[0, 1, 2], &mut c).unwrap_err();
        s.release(&mut [8192, 0, 4096]);
        s.place(1, &[0, 1, 2], &mut c).unwrap();
        assert_eq!(c, vec![0, 4096, 8192]);
        // Fragmented free space is still usable, block by block.
        s.release(&mut [3 * 4096]);
        s.release(&mut [5 * 4096]);
        let mut d = Vec::new();
        s.place(1, &[0, 1, 2, 3], &mut d).unwrap();
        assert_eq!(d.len(), 4);
        assert_eq!(s.used_bytes(), 8 * 4096);
    }

    /// Issue 39 item 3: the log uses only the prefix reserved for the VMs
    /// committed (never the unreserved rest of the file), and a VM that
    /// would not fit is refused at its commit.
    #[test]
    fn log_capacity_is_checked_at_commit_and_used_as_reserved() {
        let vm_ram = 4 * 4096;
        // Room for three VMs' logs (2 x RAM each).
        let mut s = SwapSpace::new(SwapLayout::Log, 3 * 2 * vm_ram, 4096, vm_ram);
        commit(&mut s, 1).unwrap();
        let mut out = Vec::new();
        s.place(1, &[0, 1, 2, 3, 4, 5, 6, 7], &mut out).unwrap();
        assert!(out.iter().all(|&o| o < 2 * vm_ram), "{out:?}");
        assert!(
            s.place(1, &[0], &mut out).is_err(),
            "one VM's share is full; the rest of the device is not its"
        );
        commit(&mut s, 2).unwrap();
        commit(&mut s, 3).unwrap();
        let e = commit(&mut s, 4).unwrap_err();
        assert!(matches!(e, PagerError::SwapFull { .. }), "{e}");
        s.unregister(3);
        commit(&mut s, 4).unwrap();
    }
}
