//! Gallery: plain LRU over blocks.
//!
//! Source: the textbook least-recently-used replacement (Mattson, Gecsei,
//! Slutz and Traiger, "Evaluation techniques for storage hierarchies", IBM
//! Systems Journal 9(2), 1970), applied to pager blocks.
//!
//! What "used" means here: the pager sees a block only when it faults
//! (userfaultfd reports missing blocks, not accesses to resident ones), and
//! a VM only when it serves a request (`on_access`). So a block's last use is
//! the later of its installation and its VM's last request: a request is
//! taken to touch every resident block of its VM. Victims are the `need`
//! least recently used blocks, oldest-installed first among the blocks of
//! one VM; unlike `demand`, a VM is trickled out block by block rather than
//! evicted whole.
//!
//! Build: `cargo build --release -p paging-policy --examples`, then
//! `--policy target/release/examples/liblru_policy.so`.

use std::collections::{BTreeSet, HashSet, VecDeque};

use paging_policy::policy::plugin::PluginPolicyFactory;
use paging_policy::policy::{BlockId, Policy, SwapLayout, VmId};

#[derive(Debug, Default)]
struct VmState {
    present: bool,
    /// Logical time of the VM's last request or fault.
    last_use: u64,
    /// Resident blocks in installation order (lazily cleaned: evicted
    /// blocks are skipped and dropped when they reach the front).
    queue: VecDeque<BlockId>,
    resident: Vec<bool>,
    count: u32,
}

impl VmState {
    /// Drops the queue's stale entries (evicted blocks, and older entries
    /// of blocks evicted and installed again), keeping installation order.
    fn compact(&mut self) {
        let mut kept = vec![false; self.resident.len()];
        let mut queue: VecDeque<BlockId> = VecDeque::with_capacity(self.count as usize);
        for &b in self.queue.iter().rev() {
            if self.resident[b as usize] && !kept[b as usize] {
                kept[b as usize] = true;
                queue.push_front(b);
            }
        }
        self.queue = queue;
    }
}

/// Least recently used blocks first.
struct Lru {
    vms: Vec<VmState>,
    /// VMs with resident blocks, by last use.
    order: BTreeSet<(u64, VmId)>,
    clock: u64,
}

impl Lru {
    fn vm(&mut self, vm: VmId) -> &mut VmState {
        let i = vm as usize;
        if i >= self.vms.len() {
            self.vms.resize_with(i + 1, VmState::default);
        }
        &mut self.vms[i]
    }

    fn touch(&mut self, vm: VmId) {
        self.clock += 1;
        let now = self.clock;
        let e = self.vm(vm);
        if !e.present {
            return;
        }
        let (old, count) = (e.last_use, e.count);
        e.last_use = now;
        if count > 0 {
            self.order.remove(&(old, vm));
            self.order.insert((now, vm));
        }
    }
}

impl Policy for Lru {
    fn name(&self) -> &str {
        "lru"
    }

    fn layout(&self) -> SwapLayout {
        SwapLayout::PerVm
    }

    fn on_vm_registered(&mut self, vm: VmId, blocks: u32) {
        *self.vm(vm) = VmState {
            present: true,
            resident: vec![false; blocks as usize],
            ..VmState::default()
        };
    }

    fn on_vm_unregistered(&mut self, vm: VmId) {
        let e = std::mem::take(self.vm(vm));
        self.order.remove(&(e.last_use, vm));
    }

    fn on_access(&mut self, vm: VmId) {
        self.touch(vm);
    }

    fn on_fault(&mut self, vm: VmId, _block: BlockId, _prefetch: &mut Vec<BlockId>) {
        self.touch(vm);
    }

    fn on_installed(&mut self, vm: VmId, block: BlockId) {
        let e = self.vm(vm);
        let Some(slot) = e.resident.get_mut(block as usize).filter(|r| !**r) else {
            return;
        };
        *slot = true;
        e.queue.push_back(block);
        e.count += 1;
        if e.queue.len() > 2 * e.resident.len() + 64 {
            e.compact();
        }
        let key = (e.last_use, vm);
        if e.count == 1 {
            self.order.insert(key);
        }
    }

    fn choose_victims(
        &mut self,
        need: u32,
        _faulting_vm: VmId,
        victims: &mut Vec<(VmId, BlockId)>,
    ) {
        // Least recently used VMs first; the faulting VM (the most recent
        // one) is reached last, if at all.
        let mut seen = HashSet::new();
        for &(_, vm) in &self.order {
            if victims.len() as u32 >= need {
                return;
            }
            let e = &self.vms[vm as usize];
            for &block in &e.queue {
                if victims.len() as u32 >= need {
                    break;
                }
                if e.resident[block as usize] && seen.insert((vm, block)) {
                    victims.push((vm, block));
                }
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
        while e.queue.front().is_some_and(|&b| !e.resident[b as usize]) {
            e.queue.pop_front();
        }
        if e.count == 0 {
            e.queue.clear();
            let key = (e.last_use, vm);
            self.order.remove(&key);
        }
    }
}

impl PluginPolicyFactory for Lru {
    fn create(args: &str, _block_bytes: u64, _budget_blocks: u64) -> Result<Self, String> {
        if !args.is_empty() {
            return Err(format!("lru takes no arguments, got '{args}'"));
        }
        Ok(Lru {
            vms: Vec::new(),
            order: BTreeSet::new(),
            clock: 0,
        })
    }
}

paging_policy::export_policy!(Lru);
