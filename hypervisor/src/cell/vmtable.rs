//! A cell's VMs: live ones, and what is left of dead ones, by id.

use crate::cell::microvm::{MicroVm, Sleep};
use crate::guest::abi;
use crate::vstate::vcpu::RunState;
use serde::Serialize;
use std::net::SocketAddrV4;

/// What a VM is doing, as `list` and `stats` report it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum VmState {
    /// Its guest has not said it is ready yet.
    Booting,
    /// Serving.
    Running,
    /// Its guest faulted, broke the protocol or never came up; or its cell died.
    Crashed,
    /// Destroyed through the control API, or stopped at shutdown.
    Stopped,
    /// Hibernated (or being hibernated): no vCPU until its next connection.
    Hibernated,
}

impl VmState {
    /// The name the control API uses.
    pub fn name(self) -> &'static str {
        match self {
            VmState::Booting => "booting",
            VmState::Running => "running",
            VmState::Crashed => "crashed",
            VmState::Stopped => "stopped",
            VmState::Hibernated => "hibernated",
        }
    }
}

/// A VM's entry: alive, or what is left of a dead one.
pub enum VmEntry {
    /// Booted and serving (or booting).
    Live(Box<MicroVm>),
    /// Its guest died or it was destroyed; kept for the stats.
    Dead(DeadVm),
    /// A crashed VM destroyed through the control API: nothing of it is
    /// kept but its place, so that the ids after it keep their indices.
    Forgotten,
}

/// What the stats report about a VM that no longer runs.
#[derive(Debug, Clone)]
pub struct DeadVm {
    /// Id.
    pub id: u32,
    /// Address it listened on.
    pub addr: SocketAddrV4,
    /// Crashed or stopped.
    pub state: VmState,
    /// Why.
    pub reason: String,
    /// Its last control page.
    pub ctrl: abi::Ctrl,
}

impl VmEntry {
    /// The VM's state.
    pub fn state(&self) -> VmState {
        match self {
            VmEntry::Live(vm)
                if matches!(
                    vm.sleep,
                    Sleep::Unbooted | Sleep::Hibernating | Sleep::Asleep
                ) =>
            {
                VmState::Hibernated
            }
            VmEntry::Live(vm) => match vm.vcpu.state() {
                RunState::Running if vm.ready => VmState::Running,
                RunState::Running => VmState::Booting,
                RunState::Crashed => VmState::Crashed,
                RunState::Stopped => VmState::Stopped,
            },
            VmEntry::Dead(dead) => dead.state,
            VmEntry::Forgotten => VmState::Stopped,
        }
    }

    /// Whether the control API still reports it.
    pub fn is_known(&self) -> bool {
        !matches!(self, VmEntry::Forgotten)
    }
}

/// The VMs of a cell, VM `first_id + i` at index `i`.
pub struct VmTable {
    first_id: u32,
    entries: Vec<VmEntry>,
    /// VMs destroyed through the control API (each at most once).
    destroyed: usize,
}

impl VmTable {
    /// An empty table for VMs from `first_id` on.
    pub fn new(first_id: u32) -> Self {
        VmTable {
            first_id,
            entries: Vec::new(),
            destroyed: 0,
        }
    }

    /// Index of VM `id`, if the table has it.
    pub fn index_of(&self, id: u32) -> Option<usize> {
        let index = id.checked_sub(self.first_id)? as usize;
        (index < self.entries.len()).then_some(index)
    }

    /// Adds the next VM (ids are consecutive); returns its index.
    pub fn push(&mut self, vm: MicroVm) -> usize {
        debug_assert_eq!(
            vm.id,
            self.first_id + self.entries.len() as u32,
            "VM ids of a cell are consecutive"
        );
        self.entries.push(VmEntry::Live(Box::new(vm)));
        self.entries.len() - 1
    }

    /// Counts a VM destroyed through the control API: a live one stopped,
    /// or a crashed one forgotten (neither can be destroyed again).
    pub fn count_destroyed(&mut self) {
        self.destroyed += 1;
    }

    /// VMs not destroyed through the control API: when none is left, the
    /// cell serves nothing and its parent may retire it.
    pub fn not_destroyed(&self) -> usize {
        self.entries.len() - self.destroyed
    }

    /// The live VM at `index`.
    pub fn live(&mut self, index: usize) -> Option<&mut MicroVm> {
        match self.entries.get_mut(index) {
            Some(VmEntry::Live(vm)) => Some(vm),
            _ => None,
        }
    }

    /// Replaces the live VM at `index` by `dead`; returns the VM, if it was live.
    pub fn bury(&mut self, index: usize, dead: DeadVm) -> Option<Box<MicroVm>> {
        let entry = self.entries.get_mut(index)?;
        if !matches!(entry, VmEntry::Live(_)) {
            return None;
        }
        match std::mem::replace(entry, VmEntry::Dead(dead)) {
            VmEntry::Live(vm) => Some(vm),
            VmEntry::Dead(_) | VmEntry::Forgotten => None,
        }
    }

    /// Forgets the crashed VM at `index` (a destroy of a VM that died);
    /// false if it is live, was stopped, or is already forgotten.
    pub fn forget(&mut self, index: usize) -> bool {
        match self.entries.get_mut(index) {
            Some(
                entry @ VmEntry::Dead(DeadVm {
                    state: VmState::Crashed,
                    ..
                }),
            ) => {
                *entry = VmEntry::Forgotten;
                true
            }
            _ => false,
        }
    }

    /// Every entry, in id order.
    pub fn entries(&self) -> &[VmEntry] {
        &self.entries
    }

    /// Takes every live VM out (shutdown).
    pub fn drain_live(&mut self) -> Vec<MicroVm> {
        self.entries
            .drain(..)
            .filter_map(|entry| match entry {
                VmEntry::Live(vm) => Some(*vm),
                VmEntry::Dead(_) | VmEntry::Forgotten => None,
            })
            .collect()
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }
}
