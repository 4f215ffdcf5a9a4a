//! A long run destroys VMs and creates new ones under ever higher ids (ids
//! are never reused). The accounting of the ledger and of the policies must
//! follow the VMs alive, not every id handed out: densevm's parent grew by
//! about 1.1 KiB per replaced VM (cell_chaos.py) while they were arrays
//! indexed by id.
//!
//! The heap is counted by this binary's global allocator, so the file holds
//! one test: tests in parallel threads would count each other's bytes.

use paging_policy::ledger::Ledger;
use paging_policy::policy::demand::Demand;
use paging_policy::policy::wsswap::WsSwap;
use paging_policy::policy::{Policy, SwapLayout};
use paging_policy::space::SwapSpace;
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

/// The system allocator, counting the bytes live.
struct Counting;

static LIVE_BYTES: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call goes to the system allocator unchanged; only a counter
// is kept beside it.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE_BYTES.fetch_add(layout.size(), Ordering::Relaxed);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE_BYTES.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE_BYTES.fetch_add(new_size, Ordering::Relaxed);
        LIVE_BYTES.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

const BLOCK: u64 = 32 << 10;

/// A built-in policy, by name.
type MakePolicy = fn() -> Box<dyn Policy>;
const VM_BLOCKS: u32 = 128;

/// Creates and destroys VMs `ids` one after another, each faulting in one
/// block first (so the policy records it), as a replaced VM would.
fn churn(ledger: &mut Ledger, ids: std::ops::Range<u32>) {
    for vm in ids {
        ledger.register(vm, VM_BLOCKS).unwrap();
        ledger.note_access(vm).unwrap();
        assert_eq!(ledger.begin_unregister(vm).unwrap(), Some(0));
        ledger.unregister(vm).unwrap();
    }
}

#[test]
fn accounting_follows_the_vms_alive_not_the_ids_handed_out() {
    let policies: [(&str, MakePolicy); 2] = [
        ("demand", || Box::new(Demand::new())),
        ("wsswap", || Box::new(WsSwap::new(2))),
    ];
    for (name, policy) in policies {
        let space = SwapSpace::new(
            SwapLayout::PerVm,
            4 * VM_BLOCKS as u64 * BLOCK,
            BLOCK,
            VM_BLOCKS as u64 * BLOCK,
        );
        let mut ledger = Ledger::new(policy(), space, BLOCK, 64 * BLOCK);
        churn(&mut ledger, 0..1_000);
        let before = LIVE_BYTES.load(Ordering::Relaxed);
        churn(&mut ledger, 1_000..200_000);
        let grown = LIVE_BYTES.load(Ordering::Relaxed).saturating_sub(before);
        // Arrays indexed by id grew by about 1 KiB a VM here: ~200 MB.
        assert!(
            grown < 64 << 10,
            "{name}: {grown} bytes more after 199,000 VMs came and went"
        );
    }
}
