//! Budget and accounting: the state of every block, the global budget, and
//! the policy, all consulted together under one lock.
//!
//! The ledger performs no I/O and no system calls. The pager holds it under
//! its bookkeeping mutex for microseconds at a time and does the I/O between
//! calls; `pagesim` drives the very same calls synchronously. Blocks being
//! moved are marked busy so that no two operations touch one block at once;
//! faults that hit a busy block are deferred and woken when it settles.
//!
//! Budget invariant: `resident + reserved <= budget`, where `resident` counts
//! installed blocks not yet dropped (including those being evicted) and
//! `reserved` counts blocks being faulted in. A fault is admitted only when
//! its blocks fit, so resident guest memory never exceeds the budget.
//!
//! Per-VM quota (optional): a VM whose resident blocks, less those being
//! evicted, plus those being faulted in would pass its quota gives up its
//! own blocks first, whatever the policy: one thrashing VM then pages
//! against itself instead of evicting its neighbours.

use crate::error::PagerError;
use crate::policy::{BlockId, Policy, SwapLayout, VmId};
use crate::space::SwapSpace;
use crate::stats::VmCounters;
use std::collections::BTreeMap;

/// No swap copy.
pub const NO_LOC: u64 = u64::MAX;

/// Evictions at which a block found changed at its last comparison with its
/// swap copy is written without being hashed. A block that changes every
/// time is then hashed at 2 of 10 evictions (one to know its copy's hash,
/// one to compare), where hashing every 32 KiB victim cost a third of the
/// pager's user CPU; one that stops changing is written at most 9 times more.
const HASH_SKIPS: u8 = 8;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Not in memory: zero if `loc == NO_LOC`, else on swap at `loc`.
    Absent,
    /// In memory.
    Resident,
    /// Being read and installed.
    FaultIn,
    /// Being written out and dropped.
    Evict,
    /// Write protection being lifted after the first write.
    Unprotect,
}

#[derive(Debug, Clone, Copy)]
struct Block {
    loc: u64,
    state: State,
    /// Possibly modified since its swap copy (or since installed as zero):
    /// written, or mapped writable by someone who may write.
    dirty: bool,
    /// Content hash of the swap copy at `loc` (0 = unknown), kept while the
    /// block is in memory: memory starts as that copy, so the pager finds a
    /// block flagged dirty unchanged with one hash at eviction.
    sum: u64,
    /// Evictions left before this block is hashed again (`HASH_SKIPS`).
    hash_skips: u8,
    /// A fault was deferred on this busy block: wake its range when it
    /// settles.
    wake: bool,
}

/// A block never installed: zero, no swap copy.
const ABSENT: Block = Block {
    loc: NO_LOC,
    state: State::Absent,
    dirty: false,
    sum: 0,
    hash_skips: 0,
    wake: false,
};

/// Per-VM accounting.
#[derive(Debug)]
pub struct VmLedger {
    /// Its blocks' states, from its swap commitment on
    /// ([`Ledger::commit_swap`]); empty before, when every block is
    /// [`ABSENT`]: a VM registered asleep that never runs costs no table.
    blocks: Vec<Block>,
    /// Its RAM in blocks.
    size: u32,
    resident: u32,
    busy: u32,
    /// Blocks being faulted in (reserved) and being evicted (still resident).
    reserved: u32,
    evicting: u32,
    /// Where the search for this VM's own victims resumes (quota evictions).
    hand: u32,
    dying: bool,
    /// The blocks it had resident when last hibernated: prefetched at its
    /// wake, then forgotten.
    hibernated_set: Vec<BlockId>,
    /// Its memory started as a copy of the clone template's
    /// ([`Ledger::set_clone_source`]): a block without a swap copy holds
    /// the template's bytes, not zeros.
    from_template: bool,
    /// Statistics of this VM.
    pub stats: VmCounters,
}

/// What a fault on a block needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Classified {
    /// The block is busy; the fault was deferred and will be woken.
    Defer,
    /// Already resolved (resident, or gone since): wake the faulting thread
    /// so it retries.
    Stale,
    /// Write to a write-protected resident block: lift the protection and
    /// call [`Ledger::end_unprotect`].
    Unprotect,
    /// The block must be faulted in: call [`Ledger::plan_fault`].
    FaultIn,
    /// Unknown or dying VM: nothing to do.
    Gone,
}

/// How a fault touched its block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Missing page, read.
    Read,
    /// Missing page, write.
    Write,
    /// Write to a write-protected page.
    WriteProtect,
}

/// One block of a fault-in or eviction plan.
#[derive(Debug, Clone, Copy)]
pub struct PlanBlock {
    /// VM of the block.
    pub vm: VmId,
    /// Block index.
    pub block: BlockId,
    /// Fault-in: where to read it from (`NO_LOC` = zero-fill, or the
    /// template's block with `from_template`).
    /// Eviction: where to write it (`NO_LOC` = nothing to write).
    pub loc: u64,
    /// Fault-in without a swap copy: the block is the clone template's.
    pub from_template: bool,
    /// Fault-in: install writable and dirty (the faulting write, or the
    /// simulator's written blocks). Eviction: must be written.
    pub dirty: bool,
    /// Eviction: the previous swap copy, released once the write is done.
    pub old_loc: u64,
    /// Eviction only: the hash of the swap copy at `old_loc` (0 = unknown).
    /// The pager clears `dirty` when memory still hashes like that copy
    /// (like zeros when `old_loc` is `NO_LOC`), and sets this to the hash
    /// of what it writes (0 = not hashed).
    pub sum: u64,
    /// Eviction only: hash the block before writing it. False when the
    /// layout rewrites whole batches (the batch stays one extent, so hashes
    /// would never be compared) and for `HASH_SKIPS` evictions after a
    /// comparison found the block changed: it is written unhashed.
    pub hash: bool,
}

/// An admission decision.
#[derive(Debug)]
pub enum Admission {
    /// The fault's blocks are reserved; go ahead.
    Go,
    /// Other operations in flight will make room; wait for one to finish.
    Wait,
    /// Evict these blocks (sorted by VM, then block), then ask again.
    Evict(Vec<PlanBlock>),
    /// The faulting VM is being destroyed: drop the fault
    /// ([`Ledger::abandon_fault`]); nobody is evicted for it.
    Abandon,
}

/// Blocks whose ranges must be woken, as (VM, block).
pub type Wakes = Vec<(VmId, BlockId)>;

/// The accounting state.
pub struct Ledger {
    block_bytes: u64,
    budget_blocks: u64,
    policy: Box<dyn Policy>,
    space: SwapSpace,
    /// Registered VMs by id: a map, so that memory follows the VMs alive,
    /// not every id a long run has handed out.
    vms: BTreeMap<VmId, VmLedger>,
    resident: u64,
    reserved: u64,
    evicting: u64,
    prefetch: Vec<BlockId>,
    victims: Vec<(VmId, BlockId)>,
    /// VMs failed (no swap room for their copies) and why, until taken.
    failed_vms: Vec<(VmId, String)>,
    places: Vec<u64>,
    released: Vec<u64>,
    /// Most blocks one VM may hold (u64::MAX: no quota).
    vm_quota_blocks: u64,
    /// The template that VMs first touched from now on start as a copy of.
    clone_source: Option<CloneSource>,
    /// VMs started as its clones, over the run.
    clones_started: u64,
    /// Totals over all VMs, including destroyed ones.
    pub totals: VmCounters,
}

/// The template of clone boot: the VM it was saved from, and what that VM
/// had resident then, which each clone's first wake prefetches.
struct CloneSource {
    vm: VmId,
    prefetch: Vec<BlockId>,
}

impl Ledger {
    /// A ledger with no VMs.
    pub fn new(
        policy: Box<dyn Policy>,
        space: SwapSpace,
        block_bytes: u64,
        budget_bytes: u64,
    ) -> Ledger {
        Ledger {
            block_bytes,
            budget_blocks: budget_bytes / block_bytes,
            policy,
            space,
            vms: BTreeMap::new(),
            resident: 0,
            reserved: 0,
            evicting: 0,
            prefetch: Vec::new(),
            victims: Vec::new(),
            failed_vms: Vec::new(),
            places: Vec::new(),
            released: Vec::new(),
            vm_quota_blocks: u64::MAX,
            clone_source: None,
            clones_started: 0,
            totals: VmCounters::default(),
        }
    }

    /// Limits every VM to `bytes` of resident memory (rounded down to whole
    /// blocks, at least one); `None` lifts the limit.
    pub fn set_vm_quota(&mut self, bytes: Option<u64>) {
        self.vm_quota_blocks = bytes.map_or(u64::MAX, |b| (b / self.block_bytes).max(1));
    }

    fn policy_err(&mut self) -> Result<(), PagerError> {
        match self.policy.failure() {
            None => Ok(()),
            Some(reason) => Err(PagerError::PolicyFailed {
                policy: self.policy.name().to_string(),
                reason,
            }),
        }
    }

    fn nonsense(&self, reason: String) -> PagerError {
        PagerError::PolicyFailed {
            policy: self.policy.name().to_string(),
            reason,
        }
    }

    /// Policy name.
    pub fn policy_name(&self) -> &str {
        self.policy.name()
    }

    /// Swap layout in use.
    pub fn layout(&self) -> SwapLayout {
        self.space.layout()
    }

    /// Resident blocks (installed, not yet dropped).
    pub fn resident_blocks(&self) -> u64 {
        self.resident
    }

    /// Swap bytes in use.
    pub fn swap_used_bytes(&self) -> u64 {
        self.space.used_bytes()
    }

    /// A VM's accounting, if registered.
    pub fn vm(&self, vm: VmId) -> Option<&VmLedger> {
        self.vms.get(&vm)
    }

    fn vm_mut(&mut self, vm: VmId) -> Option<&mut VmLedger> {
        self.vms.get_mut(&vm)
    }

    /// Ids of registered VMs.
    pub fn vm_ids(&self) -> impl Iterator<Item = VmId> + '_ {
        self.vms.keys().copied()
    }

    /// Registers a VM of `blocks` blocks, none resident and no swap
    /// committed to it yet ([`Ledger::commit_swap`]): until then its faults
    /// find it [`Classified::Gone`].
    pub fn register(&mut self, vm: VmId, blocks: u32) -> Result<(), PagerError> {
        if self.vm(vm).is_some() {
            return Err(PagerError::BadVm {
                vm,
                reason: "already registered".into(),
            });
        }
        self.vms.insert(
            vm,
            VmLedger {
                blocks: Vec::new(),
                size: blocks,
                resident: 0,
                busy: 0,
                reserved: 0,
                evicting: 0,
                hand: 0,
                dying: false,
                hibernated_set: Vec::new(),
                from_template: false,
                stats: VmCounters::default(),
            },
        );
        self.policy.on_vm_registered(vm, blocks);
        self.policy_err()
    }

    /// Commits swap to a live registered VM before any of its blocks can be
    /// resident (at its first fault), allocating it on the device with
    /// `allocate` (see [`SwapSpace::commit`]); nothing for one already
    /// committed, unknown or dying. Only a VM that has run needs swap, so a
    /// host holds far more VMs asleep than its disk could back whole.
    pub fn commit_swap(
        &mut self,
        vm: VmId,
        allocate: impl FnOnce(u64) -> Result<(), PagerError>,
    ) -> Result<(), PagerError> {
        let Some(v) = self.vms.get_mut(&vm).filter(|v| !v.dying) else {
            return Ok(());
        };
        if !v.blocks.is_empty() {
            return Ok(());
        }
        self.space.commit(vm, allocate)?;
        v.blocks = vec![ABSENT; v.size as usize];
        if let Some(source) = self.clone_source.as_ref().filter(|s| s.vm != vm) {
            v.from_template = true;
            v.hibernated_set.clone_from(&source.prefetch);
            self.clones_started += 1;
        }
        Ok(())
    }

    /// Whether `vm`'s memory is wholly the template's to save: none of its
    /// blocks has ever gone to swap (so a hibernation now writes every
    /// block with content, and nothing of it is only on swap from before).
    pub fn never_evicted(&self, vm: VmId) -> bool {
        self.vm(vm)
            .is_some_and(|v| !v.dying && v.blocks.iter().all(|e| e.loc == NO_LOC))
    }

    /// Whether a block of `vm` is in flight: being faulted in, evicted or
    /// unprotected.
    pub fn in_flight(&self, vm: VmId) -> bool {
        self.vm(vm).is_some_and(|v| v.busy > 0)
    }

    /// Every VM whose memory is first touched from now on is a clone of
    /// `vm`, just hibernated whole (see [`Ledger::never_evicted`]): its
    /// blocks without a swap copy are the template's, and its first wake
    /// prefetches what `vm` had resident. Returns false, changing nothing,
    /// if `vm` is not wholly out of memory now.
    pub fn set_clone_source(&mut self, vm: VmId) -> bool {
        let Some(v) = self
            .vm(vm)
            .filter(|v| !v.dying && v.resident == 0 && v.busy == 0 && !v.from_template)
        else {
            return false;
        };
        let prefetch = v.hibernated_set.clone();
        self.clone_source = Some(CloneSource { vm, prefetch });
        true
    }

    /// VMs started as clones of the template, over the run.
    pub fn clones_started(&self) -> u64 {
        self.clones_started
    }

    /// Stops new work on a VM: its faults are ignored and the policy forgets
    /// it (so none of its blocks is chosen as a victim: its memory is about
    /// to be unmapped, writing it out would be wasted). Returns how many of
    /// its blocks are busy (the caller waits for zero before
    /// [`Ledger::unregister`]).
    pub fn begin_unregister(&mut self, vm: VmId) -> Result<Option<u32>, PagerError> {
        let Some(v) = self.vms.get_mut(&vm) else {
            return Ok(None);
        };
        let busy = v.busy;
        if !v.dying {
            v.dying = true;
            self.policy.on_vm_unregistered(vm);
            self.policy_err()?;
        }
        Ok(Some(busy))
    }

    /// Marks `vm` failed: it stops being served as if it were being
    /// unregistered (the policy forgets it, its faults are dropped), and is
    /// listed for [`Ledger::take_failed_vms`]. Its owner unregisters it.
    pub fn fail_vm(&mut self, vm: VmId, reason: String) {
        if let Some(v) = self.vms.get_mut(&vm) {
            if !v.dying {
                v.dying = true;
                self.policy.on_vm_unregistered(vm);
            }
            self.failed_vms.push((vm, reason));
        }
    }

    /// VMs failed since the last call, with why.
    pub fn take_failed_vms(&mut self) -> Vec<(VmId, String)> {
        std::mem::take(&mut self.failed_vms)
    }

    /// Drops a planned fault whose admission said [`Admission::Abandon`]:
    /// its blocks are absent again and not busy; deferred faults on them
    /// are to be woken (`wakes`).
    pub fn abandon_fault(&mut self, plan: &[PlanBlock], wakes: &mut Wakes) {
        for p in plan {
            let Some(v) = self.vms.get_mut(&p.vm) else {
                continue;
            };
            let e = &mut v.blocks[p.block as usize];
            e.state = State::Absent;
            if std::mem::take(&mut e.wake) {
                wakes.push((p.vm, p.block));
            }
            v.busy -= 1;
        }
    }

    /// Forgets a VM with no busy blocks: frees its memory accounting and swap.
    pub fn unregister(&mut self, vm: VmId) -> Result<(), PagerError> {
        let Some(v) = self.vms.remove(&vm) else {
            return Ok(());
        };
        debug_assert_eq!(v.busy, 0);
        self.resident -= v.resident as u64;
        let mut locs: Vec<u64> = v
            .blocks
            .iter()
            .map(|b| b.loc)
            .filter(|&l| l != NO_LOC)
            .collect();
        self.space.release(&mut locs);
        self.space.unregister(vm);
        if !v.dying {
            self.policy.on_vm_unregistered(vm);
        }
        self.policy_err()
    }

    /// Where `vm`'s blocks have swap copies (what [`Ledger::unregister`]
    /// releases).
    pub fn swap_copies(&self, vm: VmId) -> Vec<u64> {
        self.vm(vm).map_or_else(Vec::new, |v| {
            v.blocks
                .iter()
                .map(|b| b.loc)
                .filter(|&l| l != NO_LOC)
                .collect()
        })
    }

    /// Reports that a VM served a request.
    pub fn note_access(&mut self, vm: VmId) -> Result<(), PagerError> {
        self.policy.on_access(vm);
        self.policy_err()
    }

    /// Takes every resident block of `vm` as dirty: its memory is now
    /// mapped by a new process (a restarted holder) whose mapping carries
    /// none of the write protection that told clean blocks from written
    /// ones, so a write to one would not be seen.
    pub fn assume_dirty(&mut self, vm: VmId) {
        if let Some(v) = self.vm_mut(vm) {
            for b in v.blocks.iter_mut().filter(|b| b.state == State::Resident) {
                b.dirty = true;
            }
        }
    }

    /// True when the block is resident (settled).
    pub fn is_resident(&self, vm: VmId, block: BlockId) -> bool {
        self.vm(vm)
            .and_then(|v| v.blocks.get(block as usize))
            .is_some_and(|b| b.state == State::Resident)
    }

    /// Decides what a fault on `block` of `vm` needs.
    pub fn classify(&mut self, vm: VmId, block: BlockId, access: Access) -> Classified {
        let Some(v) = self.vm_mut(vm) else {
            return Classified::Gone;
        };
        if v.dying {
            return Classified::Gone;
        }
        let Some(b) = v.blocks.get_mut(block as usize) else {
            return Classified::Gone;
        };
        match (b.state, access) {
            (State::FaultIn | State::Evict | State::Unprotect, _) => {
                b.wake = true;
                Classified::Defer
            }
            (State::Resident, Access::WriteProtect) => {
                b.state = State::Unprotect;
                b.dirty = true;
                v.busy += 1;
                v.stats.wp_faults += 1;
                self.totals.wp_faults += 1;
                Classified::Unprotect
            }
            (State::Resident, _) | (State::Absent, Access::WriteProtect) => Classified::Stale,
            (State::Absent, Access::Write) => {
                v.stats.write_faults += 1;
                self.totals.write_faults += 1;
                Classified::FaultIn
            }
            (State::Absent, Access::Read) => Classified::FaultIn,
        }
    }

    /// Write protection of a block is lifted. Returns blocks to wake.
    pub fn end_unprotect(&mut self, vm: VmId, block: BlockId, wakes: &mut Wakes) {
        if let Some(v) = self.vm_mut(vm) {
            let b = &mut v.blocks[block as usize];
            b.state = State::Resident;
            v.busy -= 1;
            if std::mem::take(&mut b.wake) {
                wakes.push((vm, block));
            }
        }
    }

    /// Plans the fault-in of an absent `block` of `vm`: the block plus the
    /// policy's prefetch that is also absent, sorted by block, capped at the
    /// budget. All are marked busy. `write` installs them writable and
    /// (possibly) dirty: the faulting block is being written, and a KVM that
    /// faults with write intent does so for every block it touches, so
    /// write-protecting the prefetched ones would only cost a write-protect
    /// fault each (the swap copy's content hash still spares unchanged
    /// blocks the write-back).
    pub fn plan_fault(
        &mut self,
        vm: VmId,
        block: BlockId,
        write: bool,
        plan: &mut Vec<PlanBlock>,
    ) -> Result<(), PagerError> {
        plan.clear();
        let mut prefetch = std::mem::take(&mut self.prefetch);
        prefetch.clear();
        self.policy.on_fault(vm, block, &mut prefetch);
        let r = self.policy_err();
        let budget = self.budget_blocks;
        let v = self.vms.get_mut(&vm).expect("classified VM exists");
        let nblocks = v.blocks.len();
        if let Some(&bad) = prefetch.iter().find(|&&b| b as usize >= nblocks) {
            self.prefetch = prefetch;
            r?;
            return Err(self.nonsense(format!(
                "prefetch of block {bad} beyond VM {vm}'s {nblocks} blocks"
            )));
        }
        r?;
        prefetch.push(block);
        prefetch.sort_unstable();
        prefetch.dedup();
        // One fault may take at most half the budget: a prefetch as large as
        // the budget would evict every other VM, active ones included. The
        // blocks nearest the faulting one are kept.
        let cap = (budget / 2).max(1).min(self.vm_quota_blocks) as usize;
        prefetch.retain(|&b| v.blocks[b as usize].state == State::Absent);
        if prefetch.len() > cap {
            prefetch.sort_unstable_by_key(|&b| b.abs_diff(block));
            prefetch.truncate(cap);
            prefetch.sort_unstable();
        }
        v.start_fault_in(vm, &prefetch, write, plan);
        self.prefetch = prefetch;
        Ok(())
    }

    /// Tries to admit a fault of `n` blocks for `vm`: reserve them, or ask to
    /// wait, or hand out victims to evict first (marked busy, swap space
    /// placed). The policy's victims are validated here.
    pub fn admit(&mut self, n: u64, vm: VmId) -> Result<Admission, PagerError> {
        // A fault classified before its VM began to die (or before the VM
        // failed) must not cost another VM its memory.
        if self.vm(vm).is_none_or(|v| v.dying) {
            return Ok(Admission::Abandon);
        }
        if let Some(decision) = self.admit_within_quota(n, vm)? {
            return Ok(decision);
        }
        if self.resident + self.reserved + n <= self.budget_blocks {
            self.reserved += n;
            if let Some(v) = self.vm_mut(vm) {
                v.reserved += n as u32;
            }
            return Ok(Admission::Go);
        }
        let deficit = self.resident + self.reserved + n - self.budget_blocks;
        if self.evicting >= deficit {
            return Ok(Admission::Wait);
        }
        let need = (deficit - self.evicting).min(u32::MAX as u64) as u32;
        let mut victims = std::mem::take(&mut self.victims);
        victims.clear();
        self.policy.choose_victims(need, vm, &mut victims);
        if let Err(e) = self.policy_err() {
            self.victims = victims;
            return Err(e);
        }
        let checked = self.check_victims(&mut victims);
        let plan = match checked {
            Ok(skipped) => {
                if victims.is_empty() {
                    self.victims = victims;
                    // Blocks of a dying (or failed) VM are freed when its
                    // owner unregisters it: room is coming.
                    let dying_resident = self.vms.values().any(|v| v.dying && v.resident > 0);
                    if skipped || dying_resident || self.evicting > 0 || self.reserved > 0 {
                        return Ok(Admission::Wait);
                    }
                    return Err(self.nonsense(format!(
                        "no victim while {need} block(s) must be freed ({} resident, budget {})",
                        self.resident, self.budget_blocks
                    )));
                }
                self.start_eviction(&victims)
            }
            Err(e) => Err(e),
        };
        self.victims = victims;
        match plan? {
            plan if plan.is_empty() => Ok(Admission::Wait),
            plan => Ok(Admission::Evict(plan)),
        }
    }

    /// The quota's part of `admit`: `None` when `vm` stays within its quota
    /// with `n` more blocks, else a wait for its own evictions in flight, or
    /// its own blocks to evict (resuming where its last search stopped).
    fn admit_within_quota(&mut self, n: u64, vm: VmId) -> Result<Option<Admission>, PagerError> {
        let quota = self.vm_quota_blocks;
        let Some(v) = self.vm_mut(vm) else {
            return Ok(None);
        };
        let held = (v.resident - v.evicting + v.reserved) as u64 + n;
        if held <= quota {
            return Ok(None);
        }
        let mut need = held - quota;
        let mut victims = std::mem::take(&mut self.victims);
        victims.clear();
        let v = self.vms.get_mut(&vm).expect("looked up above");
        let blocks = v.blocks.len() as u32;
        for _ in 0..blocks {
            if need == 0 {
                break;
            }
            let b = v.hand;
            v.hand = (b + 1) % blocks;
            if v.blocks[b as usize].state == State::Resident {
                victims.push((vm, b));
                need -= 1;
            }
        }
        let decision = if victims.is_empty() {
            Ok(Admission::Wait)
        } else {
            victims.sort_unstable();
            self.policy.on_quota_eviction(vm);
            self.start_eviction(&victims).map(|plan| {
                if plan.is_empty() {
                    Admission::Abandon
                } else {
                    Admission::Evict(plan)
                }
            })
        };
        self.victims = victims;
        decision.map(Some)
    }

    /// Validates victims: known VM, block in range, no duplicates, resident.
    /// Blocks momentarily busy lifting write protection, and blocks of VMs
    /// being destroyed, are dropped from the list (returns true when any
    /// was). Sorts the list by (VM, block).
    fn check_victims(&mut self, victims: &mut Vec<(VmId, BlockId)>) -> Result<bool, PagerError> {
        if victims.len() as u64 > self.resident {
            return Err(self.nonsense(format!(
                "{} victims proposed, only {} blocks resident",
                victims.len(),
                self.resident
            )));
        }
        victims.sort_unstable();
        if victims.windows(2).any(|w| w[0] == w[1]) {
            return Err(self.nonsense("duplicate victims".into()));
        }
        let mut skipped = false;
        let mut bad = None;
        victims.retain(|&(vm, block)| {
            let state = self
                .vms
                .get(&vm)
                .and_then(|v| v.blocks.get(block as usize))
                .map(|b| b.state);
            let dying = self.vms.get(&vm).is_some_and(|v| v.dying);
            match state {
                Some(State::Resident) if !dying => true,
                Some(State::Unprotect) | Some(State::Resident) => {
                    skipped = true;
                    false
                }
                _ => {
                    bad.get_or_insert((vm, block, state));
                    false
                }
            }
        });
        if let Some((vm, block, state)) = bad {
            let what = match state {
                None => "does not exist".to_string(),
                Some(s) => format!("is not resident ({s:?})"),
            };
            return Err(self.nonsense(format!("victim VM {vm} block {block} {what}")));
        }
        Ok(skipped)
    }

    fn start_eviction(
        &mut self,
        victims: &[(VmId, BlockId)],
    ) -> Result<Vec<PlanBlock>, PagerError> {
        let mut plan = Vec::with_capacity(victims.len());
        let mut places = std::mem::take(&mut self.places);
        let mut i = 0;
        let mut result = Ok(());
        while i < victims.len() {
            let vm = victims[i].0;
            let mut j = i;
            while j < victims.len() && victims[j].0 == vm {
                j += 1;
            }
            // Blocks of this VM to write, in block order, get consecutive
            // swap places (one sequential write for the log layout).
            let whole = self.space.layout().rewrites_whole_batches();
            let v = self.vms.get_mut(&vm).expect("validated");
            let to_write = |e: &Block| e.dirty || (whole && e.loc != NO_LOC);
            let dirty: Vec<BlockId> = victims[i..j]
                .iter()
                .map(|&(_, b)| b)
                .filter(|&b| to_write(&v.blocks[b as usize]))
                .collect();
            if result.is_ok() {
                result = self.space.place(vm, &dirty, &mut places);
            }
            if let Err(PagerError::SwapFull { .. }) = &result {
                // No room on swap for this VM's copies: it fails alone (its
                // blocks stay resident, the policy forgets it, its faults are
                // no longer served, its owner is told), not the pager.
                let e = std::mem::replace(&mut result, Ok(())).unwrap_err();
                places.clear();
                self.fail_vm(vm, e.to_string());
                i = j;
                continue;
            }
            if result.is_err() {
                places.clear();
            }
            let v = self.vms.get_mut(&vm).expect("validated");
            let mut k = 0;
            for &(_, b) in &victims[i..j] {
                let e = &mut v.blocks[b as usize];
                e.state = State::Evict;
                v.busy += 1;
                v.evicting += 1;
                let (loc, dirty) = if to_write(&*e) {
                    let loc = places.get(k).copied().unwrap_or(NO_LOC);
                    k += 1;
                    (loc, true)
                } else {
                    (NO_LOC, false)
                };
                // A clone's block without a copy is the template's: the
                // hash of zeros tells nothing about it, so it is written
                // (compact swap stores nothing for it if it is unchanged).
                let hash =
                    e.dirty && !whole && e.hash_skips == 0 && !(v.from_template && e.loc == NO_LOC);
                if e.dirty {
                    e.hash_skips = e.hash_skips.saturating_sub(1);
                }
                plan.push(PlanBlock {
                    vm,
                    block: b,
                    loc,
                    from_template: false,
                    dirty,
                    old_loc: e.loc,
                    sum: e.sum,
                    hash,
                });
                self.policy.on_evicted(vm, b);
            }
            i = j;
        }
        self.places = places;
        self.evicting += plan.len() as u64;
        result?;
        self.policy_err()?;
        Ok(plan)
    }

    /// An eviction finished: the blocks are dropped from memory; those
    /// still `dirty` in the plan were written to their planned places, the
    /// others keep their previous copies. `io_seconds` is charged to the
    /// victims' VMs evenly.
    pub fn finish_eviction(&mut self, plan: &[PlanBlock], io_seconds: f64, wakes: &mut Wakes) {
        let bs = self.block_bytes;
        let share = io_seconds / plan.len().max(1) as f64;
        let mut released = std::mem::take(&mut self.released);
        released.clear();
        for p in plan {
            let v = self.vms.get_mut(&p.vm).expect("busy VM stays registered");
            let e = &mut v.blocks[p.block as usize];
            if p.dirty {
                if p.hash && e.sum != 0 {
                    // Compared with its copy's hash, and changed.
                    e.hash_skips = HASH_SKIPS;
                }
                if p.old_loc != NO_LOC && p.old_loc != p.loc {
                    released.push(p.old_loc);
                }
                e.loc = p.loc;
                e.sum = p.sum;
                v.stats.swap_write_bytes += bs;
                self.totals.swap_write_bytes += bs;
            } else if p.loc != NO_LOC && p.loc != p.old_loc {
                // Placed for a write that turned out unnecessary (content
                // unchanged): the old copy stays, the new place is freed.
                released.push(p.loc);
            }
            e.state = State::Absent;
            e.dirty = false;
            if std::mem::take(&mut e.wake) {
                wakes.push((p.vm, p.block));
            }
            v.busy -= 1;
            v.evicting -= 1;
            v.resident -= 1;
            v.stats.blocks_out += 1;
            v.stats.io_seconds += share;
        }
        self.space.release(&mut released);
        self.released = released;
        let n = plan.len() as u64;
        self.totals.blocks_out += n;
        self.totals.io_seconds += io_seconds;
        self.resident -= n;
        self.evicting -= n;
    }

    /// Plans the hibernation of `vm` (its vCPUs are gone; its memory stays
    /// registered): tells the policy (`on_hibernated`), then hands out
    /// every resident block of the VM as an eviction (busy, swap placed,
    /// `on_evicted`), sorted by block; evict it and call
    /// [`Ledger::finish_hibernation`], in parts if need be. Blocks in
    /// flight (being faulted in, evicted or unprotected) are left out: a
    /// later hibernation takes them. An unknown, dying or failed VM yields
    /// an empty plan.
    pub fn plan_hibernation(&mut self, vm: VmId) -> Result<Vec<PlanBlock>, PagerError> {
        let Some(v) = self.vm_mut(vm).filter(|v| !v.dying) else {
            return Ok(Vec::new());
        };
        v.stats.hibernations += 1;
        self.totals.hibernations += 1;
        self.policy.on_hibernated(vm);
        self.policy_err()?;
        let mut victims = std::mem::take(&mut self.victims);
        victims.clear();
        let v = self.vms.get(&vm).expect("looked up above");
        victims.extend(
            (0..v.blocks.len() as BlockId)
                .filter(|&b| v.blocks[b as usize].state == State::Resident)
                .map(|b| (vm, b)),
        );
        let set = victims.iter().map(|&(_, b)| b).collect();
        self.vms
            .get_mut(&vm)
            .expect("looked up above")
            .hibernated_set = set;
        let plan = self.start_eviction(&victims);
        self.victims = victims;
        plan
    }

    /// [`Ledger::finish_eviction`] for (part of) a plan of
    /// [`Ledger::plan_hibernation`]: its blocks also count as taken out by
    /// the VM's hibernation.
    pub fn finish_hibernation(&mut self, plan: &[PlanBlock], io_seconds: f64, wakes: &mut Wakes) {
        self.finish_eviction(plan, io_seconds, wakes);
        let n = plan.len() as u64;
        if let Some(v) = plan.first().and_then(|p| self.vm_mut(p.vm)) {
            v.stats.hibernated_blocks_out += n;
        }
        self.totals.hibernated_blocks_out += n;
    }

    /// Drops a planned eviction of a dying (or failed) VM's blocks before
    /// any of it was done: writing out memory about to be freed would only
    /// delay the VM's unregistration. The blocks are resident again as they
    /// were (untouched, still counted until the VM is unregistered; the
    /// policy has forgotten the VM), the swap places planned for them are
    /// released, and deferred faults on them are to be woken (`wakes`).
    pub fn abandon_eviction(&mut self, plan: &[PlanBlock], wakes: &mut Wakes) {
        let mut released = std::mem::take(&mut self.released);
        released.clear();
        for p in plan {
            let v = self.vms.get_mut(&p.vm).expect("busy VM stays registered");
            debug_assert!(v.dying, "only a dying VM's eviction is abandoned");
            let e = &mut v.blocks[p.block as usize];
            e.state = State::Resident;
            if p.loc != NO_LOC && p.loc != p.old_loc {
                released.push(p.loc);
            }
            if std::mem::take(&mut e.wake) {
                wakes.push((p.vm, p.block));
            }
            v.busy -= 1;
            v.evicting -= 1;
        }
        self.space.release(&mut released);
        self.released = released;
        self.evicting -= plan.len() as u64;
    }

    /// Reports that `vm` woke from hibernation, and plans the prefetch of
    /// what it had resident then (as the policy leaves the list, see
    /// `Policy::on_woken`): its absent blocks, at most half the budget and
    /// the VM's quota, marked busy as a fault's are, into `plan` (empty for
    /// an unknown or dying VM). Then [`Ledger::admit`] and
    /// [`Ledger::finish_install`] as for a fault.
    pub fn plan_wake(&mut self, vm: VmId, plan: &mut Vec<PlanBlock>) -> Result<(), PagerError> {
        plan.clear();
        let Some(v) = self.vm_mut(vm).filter(|v| !v.dying) else {
            return Ok(());
        };
        let mut prefetch = std::mem::take(&mut v.hibernated_set);
        self.policy.on_woken(vm, &mut prefetch);
        self.policy_err()?;
        let cap = (self.budget_blocks / 2).max(1).min(self.vm_quota_blocks) as usize;
        let v = self.vms.get_mut(&vm).expect("looked up above");
        let nblocks = v.blocks.len();
        if let Some(&bad) = prefetch.iter().find(|&&b| b as usize >= nblocks) {
            return Err(self.nonsense(format!(
                "wake prefetch of block {bad} beyond VM {vm}'s {nblocks} blocks"
            )));
        }
        prefetch.sort_unstable();
        prefetch.dedup();
        prefetch.retain(|&b| v.blocks[b as usize].state == State::Absent);
        prefetch.truncate(cap);
        // Writable: a write-protected block costs a write-protect fault
        // through KVM at the guest's first write, which made a wake 50 times
        // slower here (experiments/bench/hibernation.py: p50 185 ms against
        // 3.7 ms). Its next eviction hashes it and skips the write if it did
        // not change.
        v.start_fault_in(vm, &prefetch, true, plan);
        Ok(())
    }

    /// A fault-in finished: the blocks are installed (dirty ones writable).
    /// Counts one fault for the VM with `latency_us`.
    pub fn finish_install(
        &mut self,
        plan: &[PlanBlock],
        io_seconds: f64,
        latency_us: u64,
        wakes: &mut Wakes,
    ) {
        let Some(first) = plan.first() else { return };
        let vm = first.vm;
        let bs = self.block_bytes;
        let v = self.vms.get_mut(&vm).expect("busy VM stays registered");
        let mut read = 0;
        for p in plan {
            let e = &mut v.blocks[p.block as usize];
            e.state = State::Resident;
            e.dirty = p.dirty;
            if p.loc != NO_LOC {
                read += bs;
            }
            if std::mem::take(&mut e.wake) {
                wakes.push((vm, p.block));
            }
            self.policy.on_installed(vm, p.block);
        }
        let n = plan.len() as u64;
        v.busy -= n as u32;
        v.reserved -= n as u32;
        v.resident += n as u32;
        v.stats.record_fault(n, read, io_seconds, latency_us);
        self.totals.record_fault(n, read, io_seconds, latency_us);
        self.reserved -= n;
        self.resident += n;
    }

    /// Checks the policy after `finish_install` (its `on_installed` calls).
    pub fn check_policy(&mut self) -> Result<(), PagerError> {
        self.policy_err()
    }
}

impl VmLedger {
    /// Marks the absent ones of `blocks` busy being faulted in and plans
    /// them, installed writable (`dirty`) or write-protected.
    fn start_fault_in(
        &mut self,
        vm: VmId,
        blocks: &[BlockId],
        dirty: bool,
        plan: &mut Vec<PlanBlock>,
    ) {
        for &b in blocks {
            let e = &mut self.blocks[b as usize];
            if e.state != State::Absent {
                continue;
            }
            e.state = State::FaultIn;
            self.busy += 1;
            plan.push(PlanBlock {
                vm,
                block: b,
                loc: e.loc,
                from_template: self.from_template && e.loc == NO_LOC,
                dirty,
                old_loc: NO_LOC,
                sum: 0,
                hash: false,
            });
        }
    }

    /// Resident blocks of this VM.
    pub fn resident_blocks(&self) -> u32 {
        self.resident
    }

    /// Being unregistered, or failed: no longer served.
    pub fn is_dying(&self) -> bool {
        self.dying
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::demand::Demand;

    const BLOCK: u64 = 4096;
    const VM_BLOCKS: u32 = 16;

    /// Registers `vm` and commits its swap, as the pager does at its first
    /// fault.
    fn register(l: &mut Ledger, vm: VmId) {
        l.register(vm, VM_BLOCKS).unwrap();
        l.commit_swap(vm, |_| Ok(())).unwrap();
    }

    /// Issue 40: a VM registered asleep has no block table until its swap
    /// is committed (at its first fault): a VM that never runs costs none.
    #[test]
    fn a_vm_has_no_block_table_until_its_swap_is_committed() {
        let space = SwapSpace::new(SwapLayout::PerVm, 2 * 16 * BLOCK, BLOCK, 16 * BLOCK);
        let mut l = Ledger::new(Box::new(Demand::new()), space, BLOCK, 8 * BLOCK);
        l.register(0, VM_BLOCKS).unwrap();
        assert!(l.vm(0).unwrap().blocks.is_empty());
        assert!(!l.is_resident(0, 3));
        assert_eq!(l.classify(0, 3, Access::Read), Classified::Gone);
        l.commit_swap(0, |_| Ok(())).unwrap();
        assert_eq!(l.vm(0).unwrap().blocks.len(), VM_BLOCKS as usize);
        assert_eq!(l.classify(0, 3, Access::Read), Classified::FaultIn);
        // A second commit changes nothing.
        let v = l.vm_mut(0).unwrap();
        v.blocks[3].dirty = true;
        l.commit_swap(0, |_| unreachable!("already committed"))
            .unwrap();
        assert!(l.vm(0).unwrap().blocks[3].dirty);
    }

    /// Two VMs of 16 blocks under demand, a budget of 8 blocks.
    fn ledger(quota_blocks: Option<u64>) -> Ledger {
        let space = SwapSpace::new(SwapLayout::PerVm, 2 * 16 * BLOCK, BLOCK, 16 * BLOCK);
        let mut l = Ledger::new(Box::new(Demand::new()), space, BLOCK, 8 * BLOCK);
        l.set_vm_quota(quota_blocks.map(|b| b * BLOCK));
        register(&mut l, 0);
        register(&mut l, 1);
        l
    }

    /// Faults `block` of `vm` in, evicting as the ledger asks; returns the
    /// evicted (VM, block) pairs.
    fn fault(l: &mut Ledger, vm: VmId, block: BlockId) -> Vec<(VmId, BlockId)> {
        swap_in(l, vm, block, false, 0)
            .iter()
            .map(|p| (p.vm, p.block))
            .collect()
    }

    fn resident(l: &Ledger, vm: VmId) -> u32 {
        l.vm(vm).unwrap().resident_blocks()
    }

    #[test]
    fn a_vm_over_its_quota_evicts_its_own_blocks_in_turn() {
        let mut l = ledger(Some(3));
        for b in 0..3 {
            assert!(fault(&mut l, 1, b).is_empty());
        }
        for b in 0..3 {
            assert!(fault(&mut l, 0, b).is_empty());
        }
        // Within the budget (6 of 8), but VM 0 is at its quota: it pays.
        assert_eq!(fault(&mut l, 0, 3), vec![(0, 0)]);
        assert_eq!(fault(&mut l, 0, 4), vec![(0, 1)]);
        assert_eq!(fault(&mut l, 0, 5), vec![(0, 2)]);
        assert_eq!(resident(&l, 0), 3);
        assert_eq!(resident(&l, 1), 3);
        assert!((0..3).all(|b| l.is_resident(1, b)));
        assert_eq!(l.resident_blocks(), 6);
    }

    #[test]
    fn without_a_quota_the_policy_evicts_the_neighbour() {
        let mut l = ledger(None);
        for b in 0..3 {
            fault(&mut l, 1, b);
        }
        let evicted: Vec<_> = (0..8).flat_map(|b| fault(&mut l, 0, b)).collect();
        assert!(evicted.iter().any(|&(vm, _)| vm == 1), "{evicted:?}");
        assert_eq!(l.resident_blocks(), 8);
    }

    #[test]
    fn a_fault_never_plans_more_than_the_quota() {
        let mut l = ledger(Some(2));
        // A quota of 2 with the budget's cap of 4: the plan is the faulting
        // block alone under demand, and the VM never holds more than 2.
        for b in 0..VM_BLOCKS {
            fault(&mut l, 0, b);
            assert!(resident(&l, 0) <= 2);
        }
        assert_eq!(l.totals.blocks_out, u64::from(VM_BLOCKS) - 2);
    }

    // The block state machine, one VM block at a time.

    fn plan(l: &mut Ledger, vm: VmId, block: BlockId, write: bool) -> Vec<PlanBlock> {
        let mut plan = Vec::new();
        l.plan_fault(vm, block, write, &mut plan).unwrap();
        plan
    }

    #[test]
    fn a_fault_in_is_busy_until_installed_and_wakes_deferred_faults() {
        let mut l = ledger(None);
        assert_eq!(l.classify(0, 4, Access::Read), Classified::FaultIn);
        let p = plan(&mut l, 0, 4, false);
        assert_eq!((p.len(), p[0].loc, p[0].dirty), (1, NO_LOC, false));
        // Another vCPU faults on the block in flight: deferred, woken later.
        assert_eq!(l.classify(0, 4, Access::Read), Classified::Defer);
        assert!(matches!(l.admit(1, 0).unwrap(), Admission::Go));
        assert!(!l.is_resident(0, 4));
        let mut wakes = Vec::new();
        l.finish_install(&p, 0.0, 7, &mut wakes);
        assert_eq!(wakes, vec![(0, 4)]);
        assert!(l.is_resident(0, 4));
        assert_eq!(l.classify(0, 4, Access::Read), Classified::Stale);
        let v = l.vm(0).unwrap();
        assert_eq!(
            (v.resident_blocks(), v.stats.faults, v.stats.blocks_in),
            (1, 1, 1)
        );
    }

    #[test]
    fn a_write_protect_fault_defers_others_until_the_protection_is_lifted() {
        let mut l = ledger(None);
        fault(&mut l, 0, 2);
        let mut wakes = Vec::new();
        assert_eq!(
            l.classify(0, 2, Access::WriteProtect),
            Classified::Unprotect
        );
        assert_eq!(l.classify(0, 2, Access::Read), Classified::Defer);
        l.end_unprotect(0, 2, &mut wakes);
        assert_eq!(wakes, vec![(0, 2)]);
        assert!(l.is_resident(0, 2));
        // Another mapping's write-protect fault lifts it again.
        assert_eq!(
            l.classify(0, 2, Access::WriteProtect),
            Classified::Unprotect
        );
        l.end_unprotect(0, 2, &mut wakes);
        assert_eq!(l.vm(0).unwrap().stats.wp_faults, 2);
        // A write-protect fault on a block no longer resident is stale.
        assert_eq!(l.classify(0, 9, Access::WriteProtect), Classified::Stale);
    }

    #[test]
    fn a_written_block_goes_to_swap_and_comes_back_from_there() {
        let mut l = ledger(Some(1));
        assert_eq!(l.classify(0, 0, Access::Write), Classified::FaultIn);
        let p = plan(&mut l, 0, 0, true);
        assert!(p[0].dirty);
        assert!(matches!(l.admit(1, 0).unwrap(), Admission::Go));
        let mut wakes = Vec::new();
        l.finish_install(&p, 0.0, 0, &mut wakes);
        // The quota of one block evicts block 0 to make room for block 1.
        assert_eq!(l.classify(0, 1, Access::Read), Classified::FaultIn);
        let p1 = plan(&mut l, 0, 1, false);
        let Admission::Evict(victims) = l.admit(1, 0).unwrap() else {
            panic!("block 0 must go first");
        };
        assert_eq!((victims[0].block, victims[0].dirty), (0, true));
        assert_ne!(victims[0].loc, NO_LOC, "a dirty block gets a swap place");
        assert_eq!(l.classify(0, 0, Access::Read), Classified::Defer);
        l.finish_eviction(&victims, 0.5, &mut wakes);
        assert!(wakes.contains(&(0, 0)));
        assert!(matches!(l.admit(1, 0).unwrap(), Admission::Go));
        l.finish_install(&p1, 0.0, 0, &mut wakes);
        let v = l.vm(0).unwrap();
        assert_eq!((v.stats.blocks_out, v.stats.swap_write_bytes), (1, BLOCK));
        assert_eq!(v.stats.write_faults, 1);
        // Faulted again, block 0 is read from where it was written.
        let back = plan(&mut l, 0, 0, false);
        assert_eq!(back[0].loc, victims[0].loc);
    }

    /// Faults `block` of `vm` in as a pager would; every dirty victim is
    /// written with the hash `written` (unhashed: 0, when the plan says not
    /// to hash it). Returns the victims as planned.
    fn swap_in(
        l: &mut Ledger,
        vm: VmId,
        block: BlockId,
        write: bool,
        written: u64,
    ) -> Vec<PlanBlock> {
        swap_in_hashing(l, vm, block, write, |v| v.sum = written)
    }

    /// `swap_in` with the pager's comparison played by `hashed`, on each
    /// dirty victim the plan says to hash; the others are written unhashed.
    fn swap_in_hashing(
        l: &mut Ledger,
        vm: VmId,
        block: BlockId,
        write: bool,
        hashed: impl Fn(&mut PlanBlock),
    ) -> Vec<PlanBlock> {
        let access = if write { Access::Write } else { Access::Read };
        assert_eq!(l.classify(vm, block, access), Classified::FaultIn);
        let p = plan(l, vm, block, write);
        let (mut wakes, mut planned) = (Vec::new(), Vec::new());
        loop {
            match l.admit(p.len() as u64, vm).unwrap() {
                Admission::Go => break,
                Admission::Wait => panic!("nothing is in flight to wait for"),
                Admission::Abandon => panic!("the VM is not dying"),
                Admission::Evict(mut victims) => {
                    planned.extend_from_slice(&victims);
                    for v in victims.iter_mut().filter(|v| v.dirty) {
                        if v.hash {
                            hashed(v);
                        } else {
                            v.sum = 0;
                        }
                    }
                    l.finish_eviction(&victims, 0.0, &mut wakes);
                }
            }
        }
        l.finish_install(&p, 0.0, 0, &mut wakes);
        planned
    }

    #[test]
    fn a_written_copy_keeps_its_hash_until_it_is_written_again() {
        let mut l = ledger(Some(1));
        swap_in(&mut l, 0, 0, true, 0);
        // Block 0 goes out for the first time: compared with zeros, written
        // with hash 77.
        let first = swap_in(&mut l, 0, 1, false, 77);
        assert_eq!(
            (first[0].block, first[0].dirty, first[0].old_loc),
            (0, true, NO_LOC)
        );
        // Back in and flagged dirty, it goes out with that copy and its hash.
        swap_in(&mut l, 0, 0, true, 0);
        let second = swap_in(&mut l, 0, 1, false, 78);
        assert_eq!((second[0].block, second[0].dirty), (0, true));
        assert_eq!((second[0].old_loc, second[0].sum), (first[0].loc, 77));
        // Written again, the new hash replaced the old one.
        swap_in(&mut l, 0, 0, false, 0);
        let third = swap_in(&mut l, 0, 1, false, 0);
        assert_eq!((third[0].block, third[0].dirty), (0, false));
        assert_eq!((third[0].old_loc, third[0].sum), (second[0].loc, 78));
    }

    /// Block 0 of VM 0 is written, then evicted by a fault on block 1
    /// (quota 1); `hashed` plays the pager's comparison. Returns whether
    /// the eviction hashed it.
    fn write_and_evict(l: &mut Ledger, hashed: impl Fn(&mut PlanBlock)) -> bool {
        swap_in(l, 0, 0, true, 0);
        let victims = swap_in_hashing(l, 0, 1, false, hashed);
        assert_eq!((victims[0].block, victims[0].dirty), (0, true));
        victims[0].hash
    }

    #[test]
    fn a_block_found_changed_is_written_unhashed_until_hashed_twice_again() {
        let mut l = ledger(Some(1));
        let changed = |v: &mut PlanBlock| v.sum = 9;
        let unchanged = |v: &mut PlanBlock| v.dirty = false;
        // The first write-out is compared with zeros; it tells nothing about
        // a copy. The second finds the copy changed.
        assert!(write_and_evict(&mut l, changed));
        assert!(write_and_evict(&mut l, changed));
        let skipped: Vec<bool> = (0..HASH_SKIPS)
            .map(|_| write_and_evict(&mut l, changed))
            .collect();
        assert_eq!(skipped, vec![false; HASH_SKIPS as usize]);
        // Hashed to know its copy, then compared: unchanged this time, so
        // it stays hashed.
        assert!(write_and_evict(&mut l, changed));
        assert!(write_and_evict(&mut l, unchanged));
        assert!(write_and_evict(&mut l, unchanged));
        assert!(write_and_evict(&mut l, changed));
        assert!(!write_and_evict(&mut l, changed));
    }

    #[test]
    fn a_layout_that_rewrites_whole_batches_hashes_nothing() {
        let space = SwapSpace::new(SwapLayout::Log, 2 * 16 * BLOCK, BLOCK, 16 * BLOCK);
        let mut l = Ledger::new(Box::new(Demand::new()), space, BLOCK, 8 * BLOCK);
        l.set_vm_quota(Some(BLOCK));
        register(&mut l, 0);
        assert!(!write_and_evict(&mut l, |v| v.sum = 9));
    }

    #[test]
    fn an_unchanged_block_is_dropped_without_a_write_and_keeps_its_copy() {
        let mut l = ledger(Some(1));
        fault(&mut l, 0, 0);
        let p = plan(&mut l, 0, 1, false);
        let Admission::Evict(victims) = l.admit(1, 0).unwrap() else {
            panic!("block 0 must go first");
        };
        assert_eq!((victims[0].dirty, victims[0].loc), (false, NO_LOC));
        let mut wakes = Vec::new();
        l.finish_eviction(&victims, 0.0, &mut wakes);
        assert!(matches!(l.admit(1, 0).unwrap(), Admission::Go));
        l.finish_install(&p, 0.0, 0, &mut wakes);
        assert_eq!(l.vm(0).unwrap().stats.swap_write_bytes, 0);
        assert_eq!(
            plan(&mut l, 0, 0, false)[0].loc,
            NO_LOC,
            "still zero-filled"
        );
    }

    #[test]
    fn the_budget_waits_for_evictions_in_flight() {
        let mut l = ledger(None);
        for b in 0..4 {
            fault(&mut l, 1, b);
        }
        for b in 0..4 {
            fault(&mut l, 0, b);
        }
        assert_eq!(l.resident_blocks(), 8);
        let _p = plan(&mut l, 0, 4, false);
        let Admission::Evict(victims) = l.admit(1, 0).unwrap() else {
            panic!("the budget is full");
        };
        assert_eq!(victims.iter().map(|v| v.vm).collect::<Vec<_>>(), vec![1; 4]);
        // A second fault while those four are being written: room is coming.
        let _q = plan(&mut l, 0, 5, false);
        assert!(matches!(l.admit(1, 0).unwrap(), Admission::Wait));
        let mut wakes = Vec::new();
        l.finish_eviction(&victims, 0.0, &mut wakes);
        assert!(matches!(l.admit(1, 0).unwrap(), Admission::Go));
        assert!(matches!(l.admit(1, 0).unwrap(), Admission::Go));
        assert!(l.resident_blocks() + 2 <= 8);
    }

    #[test]
    fn a_dying_vm_is_gone_to_faults_and_reports_its_busy_blocks() {
        let mut l = ledger(None);
        fault(&mut l, 0, 0);
        let _p = plan(&mut l, 0, 1, false);
        assert_eq!(l.begin_unregister(0).unwrap(), Some(1));
        assert_eq!(l.classify(0, 2, Access::Read), Classified::Gone);
        assert_eq!(l.classify(7, 0, Access::Read), Classified::Gone);
        assert_eq!(l.begin_unregister(7).unwrap(), None);
        assert!(
            l.register(1, VM_BLOCKS).is_err(),
            "VM 1 is registered already"
        );
    }

    /// A test double for the policy, so that the ledger's checks of its
    /// answers can be exercised: it proposes a fixed victim list.
    struct Proposes(Vec<(VmId, BlockId)>);

    impl Policy for Proposes {
        fn name(&self) -> &str {
            "proposes"
        }
        fn layout(&self) -> SwapLayout {
            SwapLayout::PerVm
        }
        fn on_vm_registered(&mut self, _: VmId, _: u32) {}
        fn on_vm_unregistered(&mut self, _: VmId) {}
        fn on_fault(&mut self, _: VmId, _: BlockId, _: &mut Vec<BlockId>) {}
        fn on_installed(&mut self, _: VmId, _: BlockId) {}
        fn choose_victims(&mut self, _: u32, _: VmId, victims: &mut Vec<(VmId, BlockId)>) {
            victims.extend_from_slice(&self.0);
        }
        fn on_evicted(&mut self, _: VmId, _: BlockId) {}
    }

    fn full_ledger_proposing(victims: Vec<(VmId, BlockId)>) -> Ledger {
        let space = SwapSpace::new(SwapLayout::PerVm, 2 * 16 * BLOCK, BLOCK, 16 * BLOCK);
        let mut l = Ledger::new(Box::new(Proposes(victims)), space, BLOCK, 2 * BLOCK);
        register(&mut l, 0);
        for b in 0..2 {
            let mut p = Vec::new();
            l.plan_fault(0, b, false, &mut p).unwrap();
            assert!(matches!(l.admit(1, 0).unwrap(), Admission::Go));
            l.finish_install(&p, 0.0, 0, &mut Vec::new());
        }
        l
    }

    #[test]
    fn a_policy_proposing_impossible_victims_stops_the_run() {
        for (victims, why) in [
            (vec![(0, 5)], "is not resident"),
            (vec![(3, 0)], "does not exist"),
            (vec![(0, 0), (0, 0)], "duplicate"),
            (vec![(0, 0), (0, 1), (0, 2)], "only 2 blocks resident"),
            (vec![], "no victim"),
        ] {
            let mut l = full_ledger_proposing(victims);
            let mut p = Vec::new();
            l.plan_fault(0, 9, false, &mut p).unwrap();
            let err = l.admit(1, 0).unwrap_err().to_string();
            assert!(err.contains(why), "{err}");
        }
    }

    /// Issue 39 (Low): a fault classified before its VM began dying is
    /// abandoned at admission; it evicts nobody else's memory.
    #[test]
    fn a_dying_vms_fault_in_flight_is_not_admitted() {
        let mut l = ledger(None);
        for b in 0..8 {
            fault(&mut l, 1, b);
        }
        assert_eq!(l.classify(0, 0, Access::Read), Classified::FaultIn);
        let p = plan(&mut l, 0, 0, false);
        assert_eq!(
            l.begin_unregister(0).unwrap(),
            Some(1),
            "its fault is in flight"
        );
        let admitted = l.admit(p.len() as u64, 0).unwrap();
        assert!(
            matches!(admitted, Admission::Abandon),
            "a dying VM's fault was admitted"
        );
        assert_eq!(resident(&l, 1), 8, "VM 1 lost memory to a dying VM");
        let mut wakes = Vec::new();
        l.abandon_fault(&p, &mut wakes);
        assert_eq!(l.begin_unregister(0).unwrap(), Some(0));
        l.unregister(0).unwrap();
    }

    /// Issue 39 item 3: no swap room for a victim VM's copies fails that
    /// VM alone (reported, no longer served, its blocks kept), not the run.
    #[test]
    fn swap_full_at_eviction_fails_only_the_victims_vm() {
        let space = SwapSpace::new(SwapLayout::Log, 8 * 16 * BLOCK, BLOCK, 16 * BLOCK);
        let mut l = Ledger::new(Box::new(Demand::new()), space, BLOCK, 8 * BLOCK);
        register(&mut l, 0);
        register(&mut l, 1);
        // Something else holds every byte the log may use.
        let all: Vec<BlockId> = (0..64).collect();
        let mut out = Vec::new();
        l.space.place(1, &all, &mut out).unwrap();
        for b in 0..8 {
            swap_in(&mut l, 0, b, true, 0);
        }
        assert_eq!(l.classify(1, 0, Access::Read), Classified::FaultIn);
        let p = plan(&mut l, 1, 0, false);
        let admitted = l.admit(p.len() as u64, 1);
        assert!(matches!(admitted, Ok(Admission::Wait)), "{admitted:?}");
        let failed = l.take_failed_vms();
        assert_eq!(failed.len(), 1);
        assert_eq!(failed[0].0, 0);
        assert!(failed[0].1.contains("swap device full"), "{}", failed[0].1);
        assert_eq!(
            resident(&l, 0),
            8,
            "its memory is not dropped without a copy"
        );
        assert_eq!(l.classify(0, 9, Access::Read), Classified::Gone);
        // Its owner destroys it; the other VM goes on.
        assert_eq!(l.begin_unregister(0).unwrap(), Some(0));
        l.unregister(0).unwrap();
        assert!(matches!(l.admit(p.len() as u64, 1), Ok(Admission::Go)));
    }

    /// Issue 40: a hibernation takes exactly the VM's resident blocks (not
    /// those in flight, not another VM's); once finished the VM holds none,
    /// its written blocks have swap copies and its clean zero blocks none.
    #[test]
    fn a_hibernation_takes_exactly_the_vms_resident_blocks() {
        let mut l = ledger(None);
        fault(&mut l, 1, 0);
        fault(&mut l, 0, 0);
        fault(&mut l, 0, 1);
        swap_in(&mut l, 0, 2, true, 0);
        swap_in(&mut l, 0, 5, true, 0);
        // In flight: block 1 lifting its write protection, block 6 faulting in.
        assert_eq!(
            l.classify(0, 1, Access::WriteProtect),
            Classified::Unprotect
        );
        assert_eq!(l.classify(0, 6, Access::Read), Classified::FaultIn);
        let installing = plan(&mut l, 0, 6, false);
        assert!(matches!(l.admit(1, 0).unwrap(), Admission::Go));

        let first = l.plan_hibernation(0).unwrap();
        let taken: Vec<_> = first.iter().map(|p| (p.vm, p.block)).collect();
        assert_eq!(taken, vec![(0, 0), (0, 2), (0, 5)]);
        let written: Vec<_> = first
            .iter()
            .map(|p| (p.block, p.dirty, p.loc != NO_LOC))
            .collect();
        assert_eq!(
            written,
            vec![(0, false, false), (2, true, true), (5, true, true)]
        );
        // The woken VM's fault on a block being hibernated waits for it.
        assert_eq!(l.classify(0, 2, Access::Read), Classified::Defer);
        let mut wakes = Vec::new();
        l.finish_hibernation(&first, 0.0, &mut wakes);
        assert_eq!(wakes, vec![(0, 2)]);
        l.end_unprotect(0, 1, &mut wakes);
        l.finish_install(&installing, 0.0, 0, &mut wakes);
        assert_eq!(resident(&l, 0), 2, "the blocks in flight were left");

        // A second hibernation takes what the first left.
        let second = l.plan_hibernation(0).unwrap();
        let taken: Vec<_> = second.iter().map(|p| p.block).collect();
        assert_eq!(taken, vec![1, 6]);
        l.finish_hibernation(&second, 0.0, &mut wakes);
        assert_eq!(resident(&l, 0), 0);
        assert_eq!(l.resident_blocks(), 1);
        assert!(l.is_resident(1, 0), "another VM's block was taken");
        let v = l.vm(0).unwrap();
        assert_eq!(
            (
                v.stats.hibernations,
                v.stats.hibernated_blocks_out,
                v.stats.blocks_out
            ),
            (2, 5, 5)
        );
        assert_eq!(v.stats.swap_write_bytes, 3 * BLOCK, "blocks 1, 2 and 5");
        assert_eq!(
            (l.totals.hibernations, l.totals.hibernated_blocks_out),
            (2, 5)
        );
        // They come back from where they were written, or as zeros.
        assert_eq!(plan(&mut l, 0, 2, false)[0].loc, first[1].loc);
        assert_eq!(plan(&mut l, 0, 0, false)[0].loc, NO_LOC);
    }

    /// Issue 40, clone boot: once a VM hibernated whole is the clone
    /// source, a VM first touched after that is its clone: its blocks
    /// without a copy are the template's, its first wake prefetches what
    /// the template had resident, and such a block it wrote is written out
    /// without being compared with zeros. A VM touched before stays a VM of
    /// zeros.
    #[test]
    fn vms_first_touched_after_the_template_is_saved_start_as_its_clones() {
        let space = SwapSpace::new(SwapLayout::PerVm, 3 * 16 * BLOCK, BLOCK, 16 * BLOCK);
        let mut l = Ledger::new(Box::new(Demand::new()), space, BLOCK, 8 * BLOCK);
        register(&mut l, 0);
        register(&mut l, 1);
        swap_in(&mut l, 0, 1, true, 0);
        swap_in(&mut l, 0, 3, true, 0);
        assert!(l.never_evicted(0));
        assert!(!l.set_clone_source(0), "its memory is still resident");
        let out = l.plan_hibernation(0).unwrap();
        l.finish_hibernation(&out, 0.0, &mut Vec::new());
        assert!(!l.never_evicted(0), "its blocks went to swap");
        assert!(l.set_clone_source(0));

        l.register(2, VM_BLOCKS).unwrap();
        l.commit_swap(2, |_| Ok(())).unwrap();
        assert_eq!(l.clones_started(), 1);
        let mut woken = Vec::new();
        l.plan_wake(2, &mut woken).unwrap();
        let prefetched: Vec<_> = woken
            .iter()
            .map(|p| (p.block, p.loc, p.from_template))
            .collect();
        assert_eq!(prefetched, vec![(1, NO_LOC, true), (3, NO_LOC, true)]);
        assert!(matches!(l.admit(2, 2).unwrap(), Admission::Go));
        l.finish_install(&woken, 0.0, 0, &mut Vec::new());
        let p = plan(&mut l, 2, 5, false);
        assert!(
            p[0].from_template,
            "an untouched block is the template's too"
        );
        let out = l.plan_hibernation(2).unwrap();
        assert!(out.iter().all(|p| p.dirty && !p.hash), "{out:?}");

        // VM 1 was touched before the template was saved: zeros.
        let p = plan(&mut l, 1, 5, false);
        assert!(!p[0].from_template);
        assert_eq!(l.clones_started(), 1);
    }

    #[test]
    fn an_unknown_or_dying_vm_has_nothing_to_hibernate() {
        let mut l = ledger(None);
        fault(&mut l, 1, 0);
        assert!(l.plan_hibernation(7).unwrap().is_empty());
        assert_eq!(l.begin_unregister(1).unwrap(), Some(0));
        assert!(l.plan_hibernation(1).unwrap().is_empty());
        assert_eq!(l.totals.hibernations, 0);
        assert_eq!(resident(&l, 1), 1);
    }

    /// Issue 40: a VM unregistered while its hibernation waits to be
    /// written gives the plan up: nothing stays busy, no swap place leaks,
    /// its blocks stay counted until it is unregistered.
    #[test]
    fn an_abandoned_hibernation_frees_its_swap_places_and_busy_blocks() {
        let space = SwapSpace::new(SwapLayout::Log, 2 * 2 * 16 * BLOCK, BLOCK, 16 * BLOCK);
        let mut l = Ledger::new(Box::new(Demand::new()), space, BLOCK, 8 * BLOCK);
        register(&mut l, 0);
        for b in 0..4 {
            swap_in(&mut l, 0, b, true, 0);
        }
        let used = l.swap_used_bytes();
        let planned = l.plan_hibernation(0).unwrap();
        assert_eq!(l.swap_used_bytes(), used + 4 * BLOCK);
        assert_eq!(l.begin_unregister(0).unwrap(), Some(4));
        let mut wakes = Vec::new();
        l.abandon_eviction(&planned, &mut wakes);
        assert_eq!(l.swap_used_bytes(), used);
        assert_eq!(l.begin_unregister(0).unwrap(), Some(0));
        assert_eq!((resident(&l, 0), l.resident_blocks()), (4, 4));
        l.unregister(0).unwrap();
        assert_eq!(l.resident_blocks(), 0);
        assert_eq!(l.evicting, 0);
    }

    /// A policy that records the calls it gets.
    struct Records(std::sync::Arc<std::sync::Mutex<Vec<String>>>);

    impl Records {
        fn log(&self, call: String) {
            self.0.lock().unwrap().push(call);
        }
    }

    impl Policy for Records {
        fn name(&self) -> &str {
            "records"
        }
        fn layout(&self) -> SwapLayout {
            SwapLayout::PerVm
        }
        fn on_vm_registered(&mut self, _: VmId, _: u32) {}
        fn on_vm_unregistered(&mut self, _: VmId) {}
        fn on_fault(&mut self, _: VmId, _: BlockId, _: &mut Vec<BlockId>) {}
        fn on_installed(&mut self, _: VmId, _: BlockId) {}
        fn choose_victims(&mut self, _: u32, _: VmId, _: &mut Vec<(VmId, BlockId)>) {}
        fn on_evicted(&mut self, vm: VmId, block: BlockId) {
            self.log(format!("evicted {vm} {block}"));
        }
        fn on_hibernated(&mut self, vm: VmId) {
            self.log(format!("hibernated {vm}"));
        }
        fn on_woken(&mut self, vm: VmId, _: &mut Vec<BlockId>) {
            self.log(format!("woken {vm}"));
        }
    }

    #[test]
    fn a_policy_hears_of_a_hibernation_before_its_blocks_and_of_the_wake() {
        let calls = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let space = SwapSpace::new(SwapLayout::PerVm, 2 * 16 * BLOCK, BLOCK, 16 * BLOCK);
        let mut l = Ledger::new(Box::new(Records(calls.clone())), space, BLOCK, 8 * BLOCK);
        register(&mut l, 0);
        fault(&mut l, 0, 3);
        fault(&mut l, 0, 4);
        let planned = l.plan_hibernation(0).unwrap();
        l.finish_hibernation(&planned, 0.0, &mut Vec::new());
        let mut plan = Vec::new();
        l.plan_wake(0, &mut plan).unwrap();
        let prefetched: Vec<BlockId> = plan.iter().map(|p| p.block).collect();
        assert_eq!(
            prefetched,
            vec![3, 4],
            "the set resident at hibernation comes back"
        );
        assert!(plan.iter().all(|p| p.dirty), "prefetched writable");
        l.plan_wake(9, &mut plan).unwrap();
        assert!(plan.is_empty());
        assert_eq!(
            *calls.lock().unwrap(),
            vec!["hibernated 0", "evicted 0 3", "evicted 0 4", "woken 0"]
        );
    }
}
