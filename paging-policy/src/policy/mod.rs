//! Eviction and fetch policies.
//!
//! A policy decides *what* moves; the ledger (budget/accounting) and the
//! pager decide *how* and do the I/O. The same policy objects drive the real
//! pager and `pagesim`, so a simulation exercises the code that runs for real.
//!
//! Every method is called with the pager's bookkeeping lock held, so it must
//! be cheap (no I/O, no blocking) and is never called concurrently.
//!
//! Call protocol for one VM block:
//! `on_vm_registered` → (`on_fault` → `on_installed`)* and
//! (`choose_victims` → `on_evicted`)* in any interleaving → `on_vm_unregistered`.
//! `on_access` reports that a VM served a request (densevm calls
//! `Pager::note_access`; pagesim calls it for every trace record) and is
//! implied by every fault. A VM that hibernates (scale to zero) hears
//! `on_hibernated` → `on_evicted`* for its resident blocks, and later
//! `on_woken` before its blocks fault back in as usual.

pub mod clock;
pub mod demand;
pub mod plugin;
pub mod wsswap;

use crate::error::PagerError;
use std::path::{Path, PathBuf};

/// Identifier of a VM (densevm's VM index).
pub type VmId = u32;
/// Index of a block within a VM's RAM (offset / block size).
pub type BlockId = u32;

/// How a policy wants evicted blocks laid out on the swap device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum SwapLayout {
    /// A fixed region per VM, allocated at registration; blocks are
    /// rewritten in place.
    PerVm = 0,
    /// A log: each eviction batch of a VM goes to a fresh contiguous extent.
    Log = 1,
}

impl SwapLayout {
    /// Whether an eviction rewrites every block of the batch that holds data
    /// (changed, or with a swap copy), not only the changed ones. The log
    /// does: a batch left partly in older extents would come back with one
    /// read per fragment instead of one sequential read, which is the
    /// layout's point; a sequential write of the unchanged blocks costs
    /// little beside the reads it saves.
    pub fn rewrites_whole_batches(self) -> bool {
        self == SwapLayout::Log
    }
}

/// An eviction and fetch policy.
pub trait Policy: Send {
    /// Short name for stats and errors.
    fn name(&self) -> &str;

    /// Swap layout the policy is designed for.
    fn layout(&self) -> SwapLayout;

    /// A VM with `blocks` blocks of RAM was created; none is resident.
    fn on_vm_registered(&mut self, vm: VmId, blocks: u32);

    /// A VM was destroyed; forget all its state (its blocks are gone
    /// without `on_evicted`).
    fn on_vm_unregistered(&mut self, vm: VmId);

    /// The VM was just used (served a request or faulted).
    fn on_access(&mut self, vm: VmId) {
        let _ = vm;
    }

    /// `block` of `vm` is missing and will be installed. Push other blocks of
    /// the same VM to bring in with it into `prefetch` (they are installed in
    /// the same operation; non-missing ones are ignored).
    fn on_fault(&mut self, vm: VmId, block: BlockId, prefetch: &mut Vec<BlockId>);

    /// A block became resident.
    fn on_installed(&mut self, vm: VmId, block: BlockId);

    /// Memory is short by `need` blocks: push resident blocks to evict into
    /// `victims` (at least `need` if possible; more is allowed, e.g. a whole
    /// VM). `faulting_vm` is the VM waiting for the memory; evicting from it
    /// should be a last resort. Every pushed block must be resident; an
    /// invalid answer stops the run.
    fn choose_victims(&mut self, need: u32, faulting_vm: VmId, victims: &mut Vec<(VmId, BlockId)>);

    /// A block is being evicted: it is no longer resident for the policy's
    /// purposes. Usually one chosen by `choose_victims` (proposed blocks
    /// that the pager could not evict, momentarily busy, get no call and
    /// stay resident); with a per-VM quota (`--vm-resident-max`), also a
    /// block the ledger took from a VM over its quota, in block order.
    fn on_evicted(&mut self, vm: VmId, block: BlockId);

    /// Blocks of `vm` are about to be evicted because it is over its
    /// per-VM quota: the `on_evicted` calls that follow are the VM making
    /// room for itself, not a choice of `choose_victims`.
    fn on_quota_eviction(&mut self, vm: VmId) {
        let _ = vm;
    }

    /// The pager starts hibernating `vm` (its monitor destroyed its vCPUs;
    /// its memory stays registered): every resident block of it follows
    /// with `on_evicted`, not chosen by `choose_victims`. Called before the
    /// blocks are taken, once per hibernation.
    fn on_hibernated(&mut self, vm: VmId) {
        let _ = vm;
    }

    /// `vm` woke from hibernation (a new KVM VM on the same memory) and is
    /// about to run. `prefetch` holds the blocks it had resident when it
    /// was hibernated, which the pager then reads back in one batch while
    /// the VM starts (REAP-style); the policy may change the list or clear
    /// it. Blocks not prefetched come back through `on_fault` as usual. It
    /// may arrive while the hibernation's evictions are still in flight.
    fn on_woken(&mut self, vm: VmId, prefetch: &mut Vec<BlockId>) {
        let _ = (vm, prefetch);
    }

    /// A failure the policy wants to report (plugins: a panic or a broken
    /// answer). Checked after every call; `Some` stops the run.
    fn failure(&mut self) -> Option<String> {
        None
    }
}

/// Which policy a `--policy` string names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PolicySpec {
    /// Denali's demand paging with clustered clock eviction.
    Demand,
    /// Working-set swap; the recorded set is prefetched at the `after`-th
    /// fault since the VM's eviction (`wsswap,after=N`).
    WsSwap {
        /// Faults since eviction that trigger the prefetch (>= 1).
        after: u32,
    },
    /// A plugin shared library and the argument string handed to it.
    Plugin {
        /// Path of the shared library.
        path: PathBuf,
        /// Everything after the first comma, passed to the plugin verbatim.
        args: String,
    },
}

impl PolicySpec {
    /// Parses a `--policy` value. Anything containing a `/` or ending in `.so`
    /// is a plugin path; other names must be built in. A bare `x.so` is
    /// `./x.so` (see [`plugin::explicit_path`]): never looked up on the
    /// dynamic loader's search path.
    pub fn parse(s: &str) -> Result<PolicySpec, PagerError> {
        let (head, args) = match s.split_once(',') {
            Some((h, a)) => (h, a),
            None => (s, ""),
        };
        match head {
            "demand" if args.is_empty() => Ok(PolicySpec::Demand),
            "wsswap" if args.is_empty() => Ok(PolicySpec::WsSwap {
                after: wsswap::DEFAULT_AFTER,
            }),
            "wsswap" => match args.strip_prefix("after=").map(str::parse::<u32>) {
                Some(Ok(after)) if after >= 1 => Ok(PolicySpec::WsSwap { after }),
                _ => Err(PagerError::UnknownPolicy(s.to_string())),
            },
            _ if head.contains('/') || head.ends_with(".so") => Ok(PolicySpec::Plugin {
                path: plugin::explicit_path(Path::new(head)),
                args: args.to_string(),
            }),
            _ => Err(PagerError::UnknownPolicy(s.to_string())),
        }
    }
}

impl std::fmt::Display for PolicySpec {
    /// The `--policy` text that parses back to this spec.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PolicySpec::Demand => write!(f, "demand"),
            PolicySpec::WsSwap { after } if *after == wsswap::DEFAULT_AFTER => write!(f, "wsswap"),
            PolicySpec::WsSwap { after } => write!(f, "wsswap,after={after}"),
            PolicySpec::Plugin { path, args } if args.is_empty() => write!(f, "{}", path.display()),
            PolicySpec::Plugin { path, args } => write!(f, "{},{args}", path.display()),
        }
    }
}

/// Builds the policy `spec` names. `budget_blocks` is the global budget in
/// blocks.
pub fn build_policy(
    spec: &PolicySpec,
    block_bytes: u64,
    budget_blocks: u64,
) -> Result<Box<dyn Policy>, PagerError> {
    Ok(match spec {
        PolicySpec::Demand => Box::new(demand::Demand::new()),
        PolicySpec::WsSwap { after } => Box::new(wsswap::WsSwap::new(*after)),
        PolicySpec::Plugin { path, args } => Box::new(plugin::PluginPolicy::load(
            path,
            args,
            block_bytes,
            budget_blocks,
        )?),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policy_specs() {
        assert_eq!(PolicySpec::parse("demand").unwrap(), PolicySpec::Demand);
        assert_eq!(
            PolicySpec::parse("wsswap").unwrap(),
            PolicySpec::WsSwap { after: 3 }
        );
        assert_eq!(
            PolicySpec::parse("wsswap,after=1").unwrap(),
            PolicySpec::WsSwap { after: 1 }
        );
        assert!(PolicySpec::parse("wsswap,after=0").is_err());
        assert!(PolicySpec::parse("demand,x=1").is_err());
        assert_eq!(
            PolicySpec::parse("./libx.so,mode=panic").unwrap(),
            PolicySpec::Plugin {
                path: "./libx.so".into(),
                args: "mode=panic".into()
            }
        );
        assert!(PolicySpec::parse("lru").is_err());
    }

    #[test]
    fn a_bare_plugin_name_is_a_path_in_the_current_directory() {
        // Handed to dlopen as "libx.so", it would be searched for on the
        // library path instead of read from the current directory.
        assert_eq!(
            PolicySpec::parse("libx.so,a=1").unwrap(),
            PolicySpec::Plugin {
                path: "./libx.so".into(),
                args: "a=1".into()
            }
        );
        assert_eq!(
            plugin::explicit_path(Path::new("libm.so.6")),
            Path::new("./libm.so.6")
        );
        assert_eq!(
            plugin::explicit_path(Path::new("/lib/x.so")),
            Path::new("/lib/x.so")
        );
    }

    #[test]
    fn policy_specs_print_as_they_parse() {
        for text in [
            "demand",
            "wsswap",
            "wsswap,after=5",
            "./libx.so",
            "./libx.so,a=1,b=2",
        ] {
            assert_eq!(PolicySpec::parse(text).unwrap().to_string(), text);
        }
    }
}
