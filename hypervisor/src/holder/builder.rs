//! How a holder builds a microVM (after Firecracker's `builder.rs`): the
//! context every VM of a cell is built from ([`BuildContext`]), the empty
//! KVM VM and parked vCPU thread made ahead ([`Prebuilt`]), and the steps
//! that complete and start them ([`build`]) into a [`HeldVm`].

use crate::guest::abi::{self, BootInfo};
use crate::guest::boot::{self, RamLayout};
use crate::guest::loader::GuestImage;
use crate::guest::memory::{Arena, HolderSlots, Mapping};
use crate::platform::Platform;
use crate::vstate::stats::VcpuStats;
use crate::vstate::vcpu::{self, VcpuHandle};
use crate::vstate::vm::{self as kvm_vm, Slot, VmCaps};
use kvm_bindings::CpuId;
use kvm_ioctls::{Kvm, VcpuFd, VmFd};
use std::net::{Ipv4Addr, SocketAddrV4};
use std::os::fd::OwnedFd;
use std::sync::Arc;
use vmm_sys_util::eventfd::EventFd;

/// VMs whose memory one arena chunk holds.
pub const ARENA_CHUNK_VMS: usize = 64;

/// Why a VM could not be built.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// Host memory could not be mapped.
    #[error("VM {vm}: map memory: {source}")]
    Memory {
        /// VM index.
        vm: u32,
        /// The mmap error.
        source: std::io::Error,
    },
    /// KVM refused a step.
    #[error("VM {vm}: {source}")]
    Kvm {
        /// VM index.
        vm: u32,
        /// The failing step.
        source: kvm_vm::VmError,
    },
    /// The vCPU could not be configured or started.
    #[error("VM {vm}: {source}")]
    Vcpu {
        /// VM index.
        vm: u32,
        /// The vCPU error.
        source: vcpu::VcpuError,
    },
    /// The cell's guest RAM has no slot for the VM.
    #[error("VM {vm}: no RAM slot left in this cell")]
    NoSlot {
        /// VM index.
        vm: u32,
    },
    /// Every vCPU thread stack of its holder is in use.
    #[error("VM {vm}: no vCPU thread stack left in its holder")]
    NoStack {
        /// VM index.
        vm: u32,
    },
}

/// Everything shared by the VMs a cell builds (the front uses the memory
/// and addresses; its holders, forked with a copy, the rest).
pub struct BuildContext {
    /// Id of the cell's first VM: VM `first_id + i` uses slot `i` of every arena.
    pub first_id: u32,
    /// /dev/kvm.
    pub kvm: Kvm,
    /// Its capabilities.
    pub caps: VmCaps,
    /// CPUID given to every vCPU.
    pub cpuid: CpuId,
    /// Host-specific set-up.
    pub platform: Box<dyn Platform>,
    /// The shared guest image.
    pub image: GuestImage,
    /// RAM layout of every VM.
    pub layout: RamLayout,
    /// `FLAG_SELFCHECK` or 0, and the working-set write stride.
    pub extra_flags: u32,
    /// Write one word in every Nth working-set page per request.
    pub ws_write_stride: u32,
    /// `--guest-arg`, passed to every guest in its boot info.
    pub guest_arg: u64,
    /// Address of VM 0; VM i is at this plus i.
    pub addr_base: Ipv4Addr,
    /// TCP port of every VM.
    pub port: u16,
    /// Per-VM halt polling, if set.
    pub halt_poll_ns: Option<u64>,
    /// Called from a vCPU thread whose guest died, with the reason.
    pub on_exit: vcpu::OnExit,
    /// System pages of every VM, shared by the front and the VM's holder.
    pub sys: HolderSlots,
    /// RAM of every VM, shared by the front, the VM's holder and the pager.
    pub ram: HolderSlots,
    /// Slots of `sys` and `ram` per holder.
    pub ram_slots_per_holder: usize,
    /// Threads a holder builds VMs on.
    pub boot_threads: u32,
    /// vCPU thread stacks.
    pub stack_arena: Arena,
    /// Open each vCPU's KVM statistics (one more fd per VM).
    pub vcpu_stats: bool,
}

impl BuildContext {
    /// Slot of VM `id` in the cell's arenas.
    pub fn slot_of(&self, id: u32) -> usize {
        (id - self.first_id) as usize
    }

    /// Address VM `id` serves on.
    pub fn addr_of(&self, id: u32) -> SocketAddrV4 {
        SocketAddrV4::new(crate::config::vm_addr(self.addr_base, id), self.port)
    }
}

/// A microVM as its holder holds it.
pub struct HeldVm {
    /// The vCPU thread; first so it stops before anything else goes.
    pub vcpu: VcpuHandle,
    /// The KVM VM; `None` once released.
    kvm: Option<VmFd>,
    /// Index of the VM.
    pub id: u32,
    /// The slot of `ctx.stack_arena` its vCPU thread runs on, free again
    /// once the thread is stopped.
    pub stack: usize,
    /// KVM's statistics descriptor for the vCPU, until sent to the front.
    pub stats_fd: Option<OwnedFd>,
    /// Its memory, which the front and the pager free.
    _sys: Mapping,
    _ram: Mapping,
    /// Its own copy-on-write image, where KVM cannot map the shared one
    /// read-only.
    _image: Option<Mapping>,
}

impl HeldVm {
    /// Stops the vCPU and destroys the KVM VM. Once no KVM VM is left,
    /// releasing memory no longer visits MMU notifiers.
    pub fn release(&mut self) {
        self.vcpu.stop();
        self.kvm.take();
    }

    /// Stops the vCPU and hands over the KVM VM, whose destruction (an SRCU
    /// grace period, about 22 ms here) the caller may leave to another
    /// thread: once no vCPU runs, nothing of the VM touches its memory.
    pub fn stop_for_good(mut self) -> Option<VmFd> {
        self.vcpu.stop();
        self.kvm.take()
    }
}

/// Creates the empty KVM VM that [`build`] completes.
pub fn create(ctx: &BuildContext, id: u32) -> Result<VmFd, BuildError> {
    kvm_vm::create(&ctx.kvm).map_err(|source| BuildError::Kvm { vm: id, source })
}

/// Spawns a parked vCPU thread on slot `stack` of the stack arena, which
/// [`build`] starts (`id` names the VM in errors).
pub fn park_vcpu(ctx: &BuildContext, id: u32, stack: usize) -> Result<VcpuHandle, BuildError> {
    let mapping = ctx
        .stack_arena
        .slot(stack)
        .map_err(|source| BuildError::Memory { vm: id, source })?;
    VcpuHandle::park(mapping, Arc::clone(&ctx.on_exit))
        .map_err(|source| BuildError::Vcpu { vm: id, source })
}

/// The image's memory slot where every VM maps the one shared copy
/// (read-only memory slots); `None` where each VM has a copy of its own.
fn shared_image_slot(ctx: &BuildContext) -> Option<Slot<'_>> {
    ctx.caps
        .readonly_mem
        .then(|| image_slot(ctx, &ctx.image.mapping))
}

/// The image's memory slot on `mapping` (the shared copy or a VM's own).
fn image_slot<'a>(ctx: &BuildContext, mapping: &'a Mapping) -> Slot<'a> {
    Slot {
        index: kvm_vm::IMAGE_SLOT,
        gpa: abi::IMAGE_GPA,
        mapping,
        bytes: ctx.image.mapped_bytes,
        readonly: true,
    }
}

/// Creates a KVM VM for a holder's pool, with what every VM has alike made
/// ahead ([`kvm_vm::prepare`], the vCPU's CPUID and first entry, the shared
/// image's memory slot), so that a wake on it only maps the VM's own
/// memory, wires its eventfds and loads its registers. Each memory slot set
/// waits for an SRCU grace period (30-50 us here), on the wake path unless
/// made ahead.
pub fn prepare(ctx: &BuildContext, id: u32) -> Result<EmptyVm, BuildError> {
    let vm = create(ctx, id)?;
    let kvm_error = |source| BuildError::Kvm { vm: id, source };
    let vcpu_error = |source| BuildError::Vcpu { vm: id, source };
    let mut vcpu = kvm_vm::prepare(&vm, ctx.caps, ctx.halt_poll_ns).map_err(kvm_error)?;
    vcpu::set_cpuid(&vcpu, &ctx.cpuid).map_err(vcpu_error)?;
    vcpu::enter_once(&mut vcpu).map_err(vcpu_error)?;
    if let Some(image) = shared_image_slot(ctx) {
        kvm_vm::map_memory(&vm, ctx.caps, &[image]).map_err(kvm_error)?;
    }
    Ok(EmptyVm::Prepared { vcpu, vm })
}

/// A KVM VM that [`build`] completes.
pub enum EmptyVm {
    /// Just created ([`create`]): [`build`] makes every part.
    Created(VmFd),
    /// Made ahead in a holder's pool ([`prepare`]).
    Prepared {
        /// Its vCPU, with its CPUID.
        vcpu: VcpuFd,
        /// The VM, with its irqchip, interrupt route and, if shared, the
        /// image's memory slot.
        vm: VmFd,
    },
}

/// The pieces of a VM made ahead of [`build`]: creating every KVM VM before
/// any vCPU maps its run page keeps boot linear in the number of VMs.
pub struct Prebuilt {
    /// The parked vCPU thread.
    pub vcpu: VcpuHandle,
    /// Its slot of the stack arena.
    pub stack: usize,
    /// The KVM VM.
    pub kvm: EmptyVm,
}

/// How a VM's vCPU starts: from the image's entry on fresh memory, or on
/// the memory a hibernated VM left ([`abi::FLAG_RESUME`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Start {
    /// A first boot.
    Boot,
    /// The image's template boot ([`abi::FLAG_TEMPLATE`]).
    Template,
    /// A clone's first start, on the template's memory ([`abi::FLAG_CLONE`]).
    Clone,
    /// A wake from hibernation.
    Resume,
}

impl Start {
    /// Its boot-info flags.
    pub fn flags(self) -> u32 {
        match self {
            Start::Boot => 0,
            Start::Template => abi::FLAG_TEMPLATE,
            Start::Clone => abi::FLAG_RESUME | abi::FLAG_CLONE,
            Start::Resume => abi::FLAG_RESUME,
        }
    }
}

/// Builds and starts VM `id` from its prebuilt parts (in its holder), its
/// interrupt on `irq` and its doorbell wired to `doorbell`. `protect_sys`:
/// the holder has not yet made the VM's unused system pages inaccessible
/// in its mapping (once per holder process: the protection outlasts the
/// VM's sleeps, and three mprotect calls took 30-100 us of each wake).
pub fn build(
    ctx: &BuildContext,
    id: u32,
    parts: Prebuilt,
    (irq, doorbell): (&EventFd, &EventFd),
    start: Start,
    protect_sys: bool,
) -> Result<HeldVm, BuildError> {
    let Prebuilt {
        mut vcpu,
        stack,
        kvm,
    } = parts;
    let layout = ctx.layout;
    let sys = ctx
        .sys
        .borrowed_slot(ctx.slot_of(id))
        .ok_or(BuildError::NoSlot { vm: id })?;
    let ram = ctx
        .ram
        .borrowed_slot(ctx.slot_of(id))
        .ok_or(BuildError::NoSlot { vm: id })?;
    let info = BootInfo {
        magic: abi::BOOT_MAGIC,
        version: abi::BOOT_VERSION,
        vm_id: id,
        flags: ctx.platform.boot_flags() | ctx.extra_flags | start.flags(),
        ws_write_stride: ctx.ws_write_stride,
        ram_gpa: abi::RAM_GPA,
        ram_bytes: layout.ram_bytes,
        ws_gpa: abi::RAM_GPA + layout.ws_offset,
        ws_bytes: layout.ws_bytes,
        guest_arg: ctx.guest_arg,
    };
    boot::write_system_pages(&sys, &info);
    // In the holder's mapping only: the guest sees its unused system pages
    // as holes, the front keeps writing the rings.
    if protect_sys {
        sys.protect_unused(&abi::SYS_USED)
            .map_err(|source| BuildError::Memory { vm: id, source })?;
    }
    // Fault in, writable, the pages the guest reads before it writes them,
    // so its first touches do not each visit the holder's MMU notifiers. An
    // atomic add of 0 writes without changing anything: a resumed guest's
    // pages hold its rings' live indices, and the front may be producing
    // into them already (a connection that woke the VM).
    for page in [
        abi::VIF_GPA,
        abi::CTRL_GPA,
        abi::RINGHDR_GPA,
        abi::CREDIT_GPA,
    ] {
        sys.atomic_u32(page)
            .fetch_add(0, std::sync::atomic::Ordering::Relaxed);
    }
    // Without read-only memory slots a guest could write the image every
    // VM runs: each VM then gets a copy-on-write mapping of its own.
    let private_image = match ctx.caps.readonly_mem {
        true => None,
        false => Some(
            ctx.image
                .private_copy()
                .map_err(|source| BuildError::Memory { vm: id, source })?,
        ),
    };
    let own = [
        Slot {
            index: kvm_vm::SYS_SLOT,
            gpa: abi::SYS_GPA,
            mapping: &sys,
            bytes: abi::SYS_MAPPED_BYTES,
            readonly: false,
        },
        Slot {
            index: kvm_vm::RAM_SLOT,
            gpa: abi::RAM_GPA,
            mapping: &ram,
            bytes: layout.ram_bytes,
            readonly: false,
        },
    ];
    // Each VM's own copy of the image, where there is one; the shared one
    // is mapped in a pooled VM already.
    let own_image = private_image.as_ref().map(|copy| image_slot(ctx, copy));
    let kvm_error = |source| BuildError::Kvm { vm: id, source };
    let vcpu_error = |source| BuildError::Vcpu { vm: id, source };
    let (kvm, vcpu_fd) = match kvm {
        EmptyVm::Created(kvm) => {
            let image = own_image.or_else(|| shared_image_slot(ctx));
            let slots: Vec<Slot<'_>> = own.into_iter().chain(image).collect();
            let vcpu_fd =
                kvm_vm::configure(&kvm, ctx.caps, &slots, irq, doorbell, ctx.halt_poll_ns)
                    .map_err(kvm_error)?;
            vcpu::set_cpuid(&vcpu_fd, &ctx.cpuid).map_err(vcpu_error)?;
            (kvm, vcpu_fd)
        }
        EmptyVm::Prepared { vcpu, vm } => {
            let slots: Vec<Slot<'_>> = own.into_iter().chain(own_image).collect();
            kvm_vm::map_memory(&vm, ctx.caps, &slots).map_err(kvm_error)?;
            kvm_vm::wire(&vm, irq, doorbell).map_err(kvm_error)?;
            (vm, vcpu)
        }
    };
    let stack_top = abi::RAM_GPA + layout.ram_bytes;
    vcpu::configure(&vcpu_fd, ctx.platform.as_ref(), ctx.image.entry, stack_top)
        .map_err(vcpu_error)?;
    let stats_fd = match ctx.vcpu_stats {
        true => Some(
            VcpuStats::descriptor(&vcpu_fd)
                .map_err(|source| BuildError::Memory { vm: id, source })?,
        ),
        false => None,
    };
    vcpu.start(id, vcpu_fd);
    Ok(HeldVm {
        vcpu,
        kvm: Some(kvm),
        id,
        stack,
        stats_fd,
        _sys: sys,
        _ram: ram,
        _image: private_image,
    })
}
