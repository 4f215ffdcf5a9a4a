//! A KVM VM with its memory slots and interrupt wiring.

use crate::guest::abi;
use crate::guest::memory::Mapping;
use kvm_bindings::{
    kvm_enable_cap, kvm_irq_routing_entry, kvm_userspace_memory_region, KvmIrqRouting,
    KVM_CAP_HALT_POLL, KVM_CAP_SPLIT_IRQCHIP, KVM_IRQ_ROUTING_MSI, KVM_MEM_READONLY,
};
use kvm_ioctls::{Cap, IoEventAddress, Kvm, NoDatamatch, VcpuFd, VmFd};
use vmm_sys_util::eventfd::EventFd;

/// The GSI the host-to-guest interrupt is routed through.
const DOORBELL_GSI: u32 = 0;
/// MSI address targeting APIC 0.
const MSI_ADDRESS: u32 = 0xfee0_0000;
/// IOAPIC pins reserved when the split irqchip is used (none are wired).
const SPLIT_IRQCHIP_PINS: u64 = 24;

/// Why a VM could not be created.
#[derive(Debug, thiserror::Error)]
#[error("{what}: {source}")]
pub struct VmError {
    /// The step that failed.
    pub what: &'static str,
    /// The KVM error.
    pub source: kvm_ioctls::Error,
}

fn step<T>(what: &'static str, r: Result<T, kvm_ioctls::Error>) -> Result<T, VmError> {
    r.map_err(|source| VmError { what, source })
}

/// This KVM lacks a capability densevm needs.
#[derive(Debug, thiserror::Error)]
#[error("this KVM lacks {0}, which densevm needs")]
pub struct MissingCapability(pub &'static str);

/// Set in densevm's environment, it makes the cells act as on a KVM without
/// read-only memory slots: for tests of that path on hosts that have them.
pub const NO_READONLY_MEM_ENV: &str = "DENSEVM_TEST_NO_READONLY_MEM";

/// Host capabilities, probed once.
#[derive(Debug, Clone, Copy)]
pub struct VmCaps {
    /// Read-only memory slots: the image can be shared without copies.
    pub readonly_mem: bool,
    /// An in-kernel local APIC without PIC and IOAPIC.
    pub split_irqchip: bool,
}

impl VmCaps {
    /// Probes `kvm`; fails when irqfd or ioeventfd are missing.
    pub fn probe(kvm: &Kvm) -> Result<Self, MissingCapability> {
        for (cap, name) in [
            (Cap::Irqfd, "irqfd"),
            (Cap::Ioeventfd, "ioeventfd"),
            (Cap::Irqchip, "in-kernel irqchip"),
        ] {
            if !kvm.check_extension(cap) {
                return Err(MissingCapability(name));
            }
        }
        Ok(VmCaps {
            readonly_mem: kvm.check_extension(Cap::ReadonlyMem)
                && std::env::var_os(NO_READONLY_MEM_ENV).is_none(),
            split_irqchip: kvm.check_extension(Cap::SplitIrqchip),
        })
    }
}

/// KVM memory slot of a VM's system pages.
pub const SYS_SLOT: u32 = 0;
/// KVM memory slot of the guest image.
pub const IMAGE_SLOT: u32 = 1;
/// KVM memory slot of a VM's RAM.
pub const RAM_SLOT: u32 = 2;

/// Memory a VM maps, as (KVM slot, guest address, host mapping, bytes,
/// read-only).
pub struct Slot<'a> {
    /// KVM memory slot number ([`SYS_SLOT`], [`IMAGE_SLOT`], [`RAM_SLOT`]).
    pub index: u32,
    /// Guest-physical start.
    pub gpa: u64,
    /// Backing host memory.
    pub mapping: &'a Mapping,
    /// Bytes mapped (a prefix of the mapping).
    pub bytes: u64,
    /// Mapped read-only.
    pub readonly: bool,
}

/// Creates an empty VM.
///
/// KVM_CREATE_VM registers an MMU notifier, which takes every VMA lock of
/// the process: its cost grows with the address space. Creating all VMs
/// before mapping their memory keeps booting thousands of them linear.
pub fn create(kvm: &Kvm) -> Result<VmFd, VmError> {
    step("create the VM", kvm.create_vm())
}

/// Sets a VM up: memory slots, an in-kernel APIC, an MSI route for `irq`,
/// the doorbell port wired to `doorbell`, and its one vCPU.
pub fn configure(
    vm: &VmFd,
    caps: VmCaps,
    slots: &[Slot<'_>],
    irq: &EventFd,
    doorbell: &EventFd,
    halt_poll_ns: Option<u64>,
) -> Result<VcpuFd, VmError> {
    map_memory(vm, caps, slots)?;
    let vcpu = prepare(vm, caps, halt_poll_ns)?;
    wire(vm, irq, doorbell)?;
    Ok(vcpu)
}

/// What [`configure`] does that is alike for every VM: the in-kernel APIC,
/// halt polling, the doorbell interrupt's MSI route and the one vCPU. A
/// holder does it ahead for its pooled VM, off the wake path (the vCPU's
/// creation alone takes about 0.1 ms here).
pub fn prepare(vm: &VmFd, caps: VmCaps, halt_poll_ns: Option<u64>) -> Result<VcpuFd, VmError> {
    if caps.split_irqchip {
        let cap = kvm_enable_cap {
            cap: KVM_CAP_SPLIT_IRQCHIP,
            args: [SPLIT_IRQCHIP_PINS, 0, 0, 0],
            ..Default::default()
        };
        step("create the split irqchip", vm.enable_cap(&cap))?;
    } else {
        step("create the irqchip", vm.create_irq_chip())?;
    }
    if let Some(ns) = halt_poll_ns {
        let cap = kvm_enable_cap {
            cap: KVM_CAP_HALT_POLL,
            args: [ns, 0, 0, 0],
            ..Default::default()
        };
        step("set halt polling", vm.enable_cap(&cap))?;
    }
    let mut entry = kvm_irq_routing_entry {
        gsi: DOORBELL_GSI,
        type_: KVM_IRQ_ROUTING_MSI,
        ..Default::default()
    };
    entry.u.msi.address_lo = MSI_ADDRESS;
    entry.u.msi.data = abi::IRQ_VECTOR;
    let routing = KvmIrqRouting::from_entries(&[entry]).expect("one routing entry");
    step("route the doorbell interrupt", vm.set_gsi_routing(&routing))?;
    step("create the vCPU", vm.create_vcpu(0))
}

/// Maps a VM's memory: one KVM memory slot per entry of `slots`.
pub fn map_memory(vm: &VmFd, caps: VmCaps, slots: &[Slot<'_>]) -> Result<(), VmError> {
    for slot in slots {
        let region = kvm_userspace_memory_region {
            slot: slot.index,
            flags: if slot.readonly && caps.readonly_mem {
                KVM_MEM_READONLY
            } else {
                0
            },
            guest_phys_addr: slot.gpa,
            memory_size: slot.bytes,
            userspace_addr: slot.mapping.as_ptr() as u64,
        };
        // SAFETY: the mappings outlive the VM (the owner drops the VM first).
        step("map guest memory", unsafe {
            vm.set_user_memory_region(region)
        })?;
    }
    Ok(())
}

/// Wires a prepared VM's interrupt to `irq` and its doorbell port to
/// `doorbell`, the VM's own eventfds.
pub fn wire(vm: &VmFd, irq: &EventFd, doorbell: &EventFd) -> Result<(), VmError> {
    step("register the irqfd", vm.register_irqfd(irq, DOORBELL_GSI))?;
    step(
        "register the doorbell ioeventfd",
        vm.register_ioevent(
            doorbell,
            &IoEventAddress::Pio(abi::DOORBELL_PORT.into()),
            NoDatamatch,
        ),
    )
}
