//! Gallery: ARC over VMs.
//!
//! Source: Megiddo and Modha, "ARC: A Self-Tuning, Low Overhead Replacement
//! Cache", FAST 2003. ARC keeps the items seen once recently (T1) apart
//! from those seen at least twice (T2), remembers recently evicted items of
//! each (ghost lists B1, B2), and moves the target size `p` of T1 towards
//! whichever ghost list is being hit.
//!
//! Here the items are VMs, evicted whole (as Denali's pager does), and
//! sizes are counted in blocks: |T1| is the resident blocks of the VMs in
//! T1, a ghost remembers how many blocks its VM had, the cache size `c` is
//! the budget. A request to a VM is one reference; the faults of the request
//! that brought a VM back are not a second one (densevm reports requests
//! after their faults, pagesim before).
//!
//! Build: `cargo build --release -p paging-policy --examples`, then
//! `--policy target/release/examples/libarc_policy.so`.

use std::collections::BTreeMap;

use paging_policy::policy::plugin::PluginPolicyFactory;
use paging_policy::policy::{BlockId, Policy, SwapLayout, VmId};

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum List {
    #[default]
    None,
    T1,
    T2,
    B1,
    B2,
}

#[derive(Debug, Default)]
struct VmState {
    present: bool,
    list: List,
    /// Position in its list (larger = more recent).
    seq: u64,
    /// Resident blocks when its eviction was chosen: the size it has as a
    /// ghost.
    ghost_blocks: u64,
    resident: Vec<bool>,
    count: u32,
    /// Admitted by a fault whose request has not been reported yet.
    admitted_by_fault: bool,
    /// Where eviction of its own blocks starts (last resort), round-robin.
    own_hand: u32,
}

/// Adaptive replacement over VMs.
struct Arc {
    /// Cache size in blocks (the budget).
    c: u64,
    /// Target size of T1 in blocks.
    p: u64,
    vms: Vec<VmState>,
    lists: [BTreeMap<u64, VmId>; 4],
    /// Blocks per list: resident blocks for T1/T2, remembered for B1/B2.
    sizes: [u64; 4],
    seq: u64,
}

fn index(list: List) -> Option<usize> {
    match list {
        List::None => None,
        List::T1 => Some(0),
        List::T2 => Some(1),
        List::B1 => Some(2),
        List::B2 => Some(3),
    }
}

impl Arc {
    fn vm(&mut self, vm: VmId) -> &mut VmState {
        let i = vm as usize;
        if i >= self.vms.len() {
            self.vms.resize_with(i + 1, VmState::default);
        }
        &mut self.vms[i]
    }

    /// Blocks `vm` contributes to its list's size.
    fn weight(e: &VmState) -> u64 {
        match e.list {
            List::B1 | List::B2 => e.ghost_blocks,
            _ => e.count as u64,
        }
    }

    /// Moves `vm` to the most recent end of `to` (or out of every list).
    fn place(&mut self, vm: VmId, to: List) {
        self.seq += 1;
        let seq = self.seq;
        let e = &mut self.vms[vm as usize];
        if let Some(i) = index(e.list) {
            self.lists[i].remove(&e.seq);
            self.sizes[i] -= Self::weight(e);
        }
        e.list = to;
        e.seq = seq;
        if let Some(i) = index(to) {
            self.lists[i].insert(seq, vm);
            self.sizes[i] += Self::weight(e);
        }
    }

    /// A reference to `vm`: ARC's cases I to IV.
    fn reference(&mut self, vm: VmId) {
        let (b1, b2) = (self.sizes[2].max(1), self.sizes[3].max(1));
        let e = &self.vms[vm as usize];
        let size = e.ghost_blocks.max(1);
        match e.list {
            List::T1 | List::T2 => self.place(vm, List::T2),
            List::B1 => {
                self.p = (self.p + (b2 / b1).max(1) * size).min(self.c);
                self.place(vm, List::T2);
            }
            List::B2 => {
                self.p = self.p.saturating_sub((b1 / b2).max(1) * size);
                self.place(vm, List::T2);
            }
            List::None => self.place(vm, List::T1),
        }
    }

    /// Drops the oldest ghosts so that |T1|+|B1| <= c and the total <= 2c.
    fn trim_ghosts(&mut self) {
        while self.sizes[0] + self.sizes[2] > self.c {
            let Some((_, vm)) = self.lists[2].first_key_value().map(|(k, v)| (*k, *v)) else {
                break;
            };
            self.place(vm, List::None);
        }
        while self.sizes.iter().sum::<u64>() > 2 * self.c {
            let Some((_, vm)) = self.lists[3].first_key_value().map(|(k, v)| (*k, *v)) else {
                break;
            };
            self.place(vm, List::None);
        }
    }

    /// The least recent VM of list `i` with resident blocks, other than
    /// `faulting` and not in `taken`.
    fn oldest(&self, i: usize, faulting: VmId, taken: &[VmId]) -> Option<VmId> {
        self.lists[i]
            .values()
            .copied()
            .find(|&vm| vm != faulting && self.vms[vm as usize].count > 0 && !taken.contains(&vm))
    }

    fn push_blocks(
        e: &VmState,
        vm: VmId,
        limit: u32,
        from: u32,
        out: &mut Vec<(VmId, BlockId)>,
    ) -> u32 {
        let n = e.resident.len() as u32;
        let mut pushed = 0;
        let mut b = from;
        for _ in 0..n {
            if pushed >= limit {
                break;
            }
            b %= n;
            if e.resident[b as usize] {
                out.push((vm, b));
                pushed += 1;
            }
            b += 1;
        }
        b
    }
}

impl Policy for Arc {
    fn name(&self) -> &str {
        "arc"
    }

    fn layout(&self) -> SwapLayout {
        SwapLayout::PerVm
    }

    fn on_vm_registered(&mut self, vm: VmId, blocks: u32) {
        self.vm(vm);
        self.place(vm, List::None);
        self.vms[vm as usize] = VmState {
            present: true,
            resident: vec![false; blocks as usize],
            ..VmState::default()
        };
    }

    fn on_vm_unregistered(&mut self, vm: VmId) {
        self.vm(vm);
        self.place(vm, List::None);
        self.vms[vm as usize] = VmState::default();
    }

    fn on_access(&mut self, vm: VmId) {
        if !self.vm(vm).present {
            return;
        }
        let e = &mut self.vms[vm as usize];
        if std::mem::take(&mut e.admitted_by_fault) {
            return;
        }
        self.reference(vm);
        self.trim_ghosts();
    }

    fn on_fault(&mut self, vm: VmId, _block: BlockId, _prefetch: &mut Vec<BlockId>) {
        let e = self.vm(vm);
        if e.present && !matches!(e.list, List::T1 | List::T2) {
            e.admitted_by_fault = true;
            self.reference(vm);
            self.trim_ghosts();
        }
    }

    fn on_installed(&mut self, vm: VmId, block: BlockId) {
        let e = self.vm(vm);
        let Some(slot) = e.resident.get_mut(block as usize).filter(|r| !**r) else {
            return;
        };
        *slot = true;
        e.count += 1;
        match index(e.list) {
            Some(i @ 0..=1) => self.sizes[i] += 1,
            // Installed without a reference (a prefetch or a fault the policy
            // has not seen): a new VM.
            _ => self.place(vm, List::T1),
        }
    }

    fn choose_victims(&mut self, need: u32, faulting_vm: VmId, victims: &mut Vec<(VmId, BlockId)>) {
        let mut got = 0u32;
        let mut taken = Vec::new();
        while got < need {
            let t1 = self.oldest(0, faulting_vm, &taken);
            let t2 = self.oldest(1, faulting_vm, &taken);
            let pick = match (t1, t2) {
                (Some(a), Some(_)) if self.sizes[0] > self.p => a,
                (Some(a), None) => a,
                (_, Some(b)) => b,
                (None, None) => break,
            };
            let e = &mut self.vms[pick as usize];
            // The size its ghost will remember.
            e.ghost_blocks = e.count as u64;
            Self::push_blocks(e, pick, e.count, 0, victims);
            got += e.count;
            taken.push(pick);
        }
        if got < need {
            if let Some(e) = self.vms.get(faulting_vm as usize).filter(|e| e.present) {
                let next = Self::push_blocks(e, faulting_vm, need - got, e.own_hand, victims);
                self.vms[faulting_vm as usize].own_hand = next;
            }
        }
    }

    fn on_evicted(&mut self, vm: VmId, block: BlockId) {
        let e = self.vm(vm);
        let Some(slot) = e.resident.get_mut(block as usize).filter(|r| **r) else {
            return;
        };
        *slot = false;
        e.count -= 1;
        let (list, count) = (e.list, e.count);
        if let Some(i @ 0..=1) = index(list) {
            self.sizes[i] -= 1;
            if count == 0 {
                let e = &mut self.vms[vm as usize];
                e.ghost_blocks = e.ghost_blocks.max(1);
                self.place(vm, if list == List::T1 { List::B1 } else { List::B2 });
                self.trim_ghosts();
            }
        }
    }
}

impl PluginPolicyFactory for Arc {
    fn create(args: &str, _block_bytes: u64, budget_blocks: u64) -> Result<Self, String> {
        if !args.is_empty() {
            return Err(format!("arc takes no arguments, got '{args}'"));
        }
        Ok(Arc {
            c: budget_blocks.max(1),
            p: 0,
            vms: Vec::new(),
            lists: Default::default(),
            sizes: [0; 4],
            seq: 0,
        })
    }
}

paging_policy::export_policy!(Arc);
