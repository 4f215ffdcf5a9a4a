//! Test fixture: a plugin that misbehaves on purpose, to check that the
//! pager contains it. Arguments: `mode=panic` (panics when asked for
//! victims) or `mode=nonsense` (names a block that is not resident).

use paging_policy::policy::demand::Demand;
use paging_policy::policy::plugin::PluginPolicyFactory;
use paging_policy::policy::{BlockId, Policy, SwapLayout, VmId};

#[derive(Clone, Copy)]
enum Mode {
    Panic,
    Nonsense,
}

/// `demand` until victims are needed, then the chosen misbehaviour.
struct Misbehaving {
    inner: Demand,
    mode: Mode,
}

impl Policy for Misbehaving {
    fn name(&self) -> &str {
        "misbehaving"
    }

    fn layout(&self) -> SwapLayout {
        SwapLayout::PerVm
    }

    fn on_vm_registered(&mut self, vm: VmId, blocks: u32) {
        self.inner.on_vm_registered(vm, blocks);
    }

    fn on_vm_unregistered(&mut self, vm: VmId) {
        self.inner.on_vm_unregistered(vm);
    }

    fn on_fault(&mut self, vm: VmId, block: BlockId, prefetch: &mut Vec<BlockId>) {
        self.inner.on_fault(vm, block, prefetch);
    }

    fn on_installed(&mut self, vm: VmId, block: BlockId) {
        self.inner.on_installed(vm, block);
    }

    fn choose_victims(
        &mut self,
        _need: u32,
        faulting_vm: VmId,
        victims: &mut Vec<(VmId, BlockId)>,
    ) {
        match self.mode {
            Mode::Panic => panic!("misbehaving policy: deliberate panic in choose_victims"),
            Mode::Nonsense => victims.push((faulting_vm, u32::MAX - 1)),
        }
    }

    fn on_evicted(&mut self, vm: VmId, block: BlockId) {
        self.inner.on_evicted(vm, block);
    }
}

impl PluginPolicyFactory for Misbehaving {
    fn create(args: &str, _block_bytes: u64, _budget_blocks: u64) -> Result<Self, String> {
        let mode = match args {
            "mode=panic" => Mode::Panic,
            "mode=nonsense" => Mode::Nonsense,
            _ => return Err("expected mode=panic or mode=nonsense".into()),
        };
        Ok(Misbehaving {
            inner: Demand::new(),
            mode,
        })
    }
}

paging_policy::export_policy!(Misbehaving);
