//! The vCPU: its boot state, and the thread that keeps it in KVM_RUN.

use crate::guest::abi;
use crate::guest::boot;
use crate::guest::memory::Mapping;
use crate::platform::{Platform, PlatformError};
use kvm_bindings::{kvm_msr_entry, kvm_regs, kvm_segment, CpuId, Msrs};
use kvm_ioctls::{VcpuExit, VcpuFd};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU8, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender};
use std::sync::{Arc, Once};

const CR0_PE: u64 = 1 << 0;
const CR0_ET: u64 = 1 << 4;
const CR0_PG: u64 = 1 << 31;
const CR4_PAE: u64 = 1 << 5;
const EFER_LME: u64 = 1 << 8;
const EFER_LMA: u64 = 1 << 10;
const MSR_APIC_BASE: u32 = 0x1b;
/// APIC at its default address, enabled, x2APIC mode, bootstrap processor.
const APIC_BASE_X2APIC: u64 = 0xfee0_0000 | (1 << 11) | (1 << 10) | (1 << 8);
/// Stack of a vCPU thread: KVM_RUN and a small exit loop need little.
pub const VCPU_STACK_BYTES: usize = 128 << 10;

/// Why a vCPU could not be set up or started.
#[derive(Debug, thiserror::Error)]
pub enum VcpuError {
    /// A KVM call failed.
    #[error("{what}: {source}")]
    Kvm {
        /// The step that failed.
        what: &'static str,
        /// The KVM error.
        source: kvm_ioctls::Error,
    },
    /// Host-specific set-up failed.
    #[error(transparent)]
    Platform(#[from] PlatformError),
    /// The thread could not be spawned.
    #[error("spawn the vCPU thread: {0}")]
    Spawn(std::io::Error),
}

fn step<T>(what: &'static str, r: Result<T, kvm_ioctls::Error>) -> Result<T, VcpuError> {
    r.map_err(|source| VcpuError::Kvm { what, source })
}

/// Gives a vCPU its CPUID, which must precede [`configure`] (KVM checks the
/// registers it loads against it).
pub fn set_cpuid(vcpu: &VcpuFd, cpuid: &CpuId) -> Result<(), VcpuError> {
    step("set CPUID", vcpu.set_cpuid2(cpuid))
}

/// Enters KVM_RUN once with `immediate_exit` set, so that it returns at
/// once without running the guest: what KVM does at a vCPU's first entry
/// (on x86 since Linux 6.14, spawn the VM's NX huge page recovery thread,
/// whichever the `nx_huge_pages` setting) is then done here, ahead of the
/// wake that runs it, and not inside that wake's first KVM_RUN.
pub fn enter_once(vcpu: &mut VcpuFd) -> Result<(), VcpuError> {
    vcpu.set_kvm_immediate_exit(1);
    let entered = vcpu.run().map(|_| ());
    vcpu.set_kvm_immediate_exit(0);
    match entered {
        Err(e) if e.errno() == libc::EINTR => Ok(()),
        other => step("enter KVM_RUN once, ahead", other),
    }
}

/// Loads 64-bit mode state: registers, segments, paging, the x2APIC.
pub fn configure(
    vcpu: &VcpuFd,
    platform: &dyn Platform,
    entry: u64,
    stack_top: u64,
) -> Result<(), VcpuError> {
    let mut sregs = step("get special registers", vcpu.get_sregs())?;
    let code = kvm_segment {
        base: 0,
        limit: 0xffff_ffff,
        selector: 0x08,
        type_: 11,
        present: 1,
        dpl: 0,
        db: 0,
        s: 1,
        l: 1,
        g: 1,
        ..Default::default()
    };
    let data = kvm_segment {
        selector: 0x10,
        type_: 3,
        l: 0,
        db: 1,
        ..code
    };
    sregs.cs = code;
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    sregs.tr = kvm_segment {
        base: abi::TSS_GPA,
        limit: 0x67,
        selector: boot::TSS_SELECTOR,
        type_: 11,
        present: 1,
        s: 0,
        ..Default::default()
    };
    sregs.ldt = kvm_segment {
        unusable: 1,
        type_: 2,
        present: 1,
        ..Default::default()
    };
    sregs.gdt.base = abi::GDT_GPA;
    sregs.gdt.limit = boot::GDT_LIMIT;
    sregs.idt.base = 0;
    sregs.idt.limit = 0;
    sregs.cr0 = CR0_PE | CR0_ET | CR0_PG;
    sregs.cr3 = abi::PML4_GPA;
    sregs.cr4 = CR4_PAE;
    sregs.efer = EFER_LME | EFER_LMA;
    step("set special registers", vcpu.set_sregs(&sregs))?;
    let regs = kvm_regs {
        rip: entry,
        rsp: stack_top,
        rdi: abi::BOOTINFO_GPA,
        rflags: 0x2,
        ..Default::default()
    };
    step("set registers", vcpu.set_regs(&regs))?;
    let apic = kvm_msr_entry {
        index: MSR_APIC_BASE,
        data: APIC_BASE_X2APIC,
        ..Default::default()
    };
    let written = step(
        "switch the APIC to x2APIC mode",
        vcpu.set_msrs(&Msrs::from_entries(&[apic]).expect("one MSR")),
    )?;
    if written != 1 {
        return Err(VcpuError::Kvm {
            what: "switch the APIC to x2APIC mode",
            source: kvm_ioctls::Error::new(libc::EINVAL),
        });
    }
    platform.configure_vcpu(vcpu)?;
    Ok(())
}

/// Run state of a vCPU as the rest of the monitor sees it.
#[repr(u8)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunState {
    /// In KVM_RUN (or about to be).
    Running = 0,
    /// The guest died; the VM serves nothing more.
    Crashed = 1,
    /// Stopped by the monitor.
    Stopped = 2,
}

/// Called from a vCPU thread whose guest died: `(vm, reason)`.
pub type OnExit = Arc<dyn Fn(u32, &str) + Send + Sync>;

/// State shared between a vCPU thread and the monitor.
#[derive(Debug, Default)]
pub struct VcpuShared {
    state: AtomicU8,
    /// The thread's kernel id, once it runs (0 before).
    tid: AtomicI32,
    stop: AtomicBool,
}

impl VcpuShared {
    /// Current run state.
    pub fn state(&self) -> RunState {
        match self.state.load(Ordering::Acquire) {
            0 => RunState::Running,
            1 => RunState::Crashed,
            _ => RunState::Stopped,
        }
    }

    fn finish(&self, state: RunState) {
        self.state.store(state as u8, Ordering::Release);
    }
}

extern "C" fn kick_handler(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {}

fn kick_signal() -> libc::c_int {
    vmm_sys_util::signal::SIGRTMIN()
}

/// A vCPU thread: parked until it is given a VM's vCPU, then in KVM_RUN.
///
/// Threads are spawned before the VMs exist: starting a thread changes
/// memory protections, and once thousands of VMs have registered MMU
/// notifiers on this process every such change visits all of them. A
/// thread parked ahead of any VM (a holder's pool) keeps its spawn, about
/// 50-80 us here, off the wake that takes it.
pub struct VcpuHandle {
    thread: Option<libc::pthread_t>,
    start: Option<SyncSender<(u32, VcpuFd)>>,
    /// `kvm_run.immediate_exit`, written to stop a vCPU about to enter.
    immediate_exit: *mut u8,
    shared: Arc<VcpuShared>,
    /// The thread's stack, released after the join.
    _stack: Mapping,
}

// SAFETY: immediate_exit points into the vCPU's kvm_run mapping, which lives
// as long as the thread (joined before the handle goes away).
unsafe impl Send for VcpuHandle {}

type ThreadBody = Box<dyn FnOnce() + Send>;

extern "C" fn thread_entry(arg: *mut libc::c_void) -> *mut libc::c_void {
    // SAFETY: arg is the Box<ThreadBody> leaked by spawn_on_stack.
    let body = unsafe { Box::from_raw(arg.cast::<ThreadBody>()) };
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(body));
    std::ptr::null_mut()
}

/// Starts a POSIX thread on `stack` (no guard page, no signal stack): a
/// std thread would map both, adding VMAs and protection changes.
fn spawn_on_stack(stack: &Mapping, body: ThreadBody) -> Result<libc::pthread_t, VcpuError> {
    let arg = Box::into_raw(Box::new(body));
    // SAFETY: attr is initialised before use and destroyed after; the stack
    // outlives the thread (the handle joins before dropping it).
    unsafe {
        let mut attr: libc::pthread_attr_t = std::mem::zeroed();
        libc::pthread_attr_init(&mut attr);
        libc::pthread_attr_setstack(&mut attr, stack.as_ptr().cast(), stack.len());
        let mut thread: libc::pthread_t = 0;
        let rc = libc::pthread_create(&mut thread, &attr, thread_entry, arg.cast());
        libc::pthread_attr_destroy(&mut attr);
        if rc != 0 {
            drop(Box::from_raw(arg));
            return Err(VcpuError::Spawn(std::io::Error::from_raw_os_error(rc)));
        }
        Ok(thread)
    }
}

impl VcpuHandle {
    /// Spawns a thread on `stack`, parked until [`Self::start`] gives it a
    /// VM. `on_exit(vm, reason)` is called from the thread when the guest
    /// dies.
    pub fn park(stack: Mapping, on_exit: OnExit) -> Result<Self, VcpuError> {
        static HANDLER: Once = Once::new();
        HANDLER.call_once(|| {
            vmm_sys_util::signal::register_signal_handler(kick_signal(), kick_handler)
                .expect("register the vCPU kick handler");
        });
        let shared = Arc::new(VcpuShared::default());
        let (start, parked) = sync_channel::<(u32, VcpuFd)>(1);
        let thread_shared = Arc::clone(&shared);
        let thread = spawn_on_stack(
            &stack,
            Box::new(move || {
                // SAFETY: gettid has no preconditions.
                thread_shared
                    .tid
                    .store(unsafe { libc::gettid() }, Ordering::Release);
                let Ok((vm, mut vcpu)) = parked.recv() else {
                    return;
                };
                let name =
                    std::ffi::CString::new(format!("vcpu{vm}")).expect("no NUL in a thread name");
                // SAFETY: names the calling thread; the name is under 16 bytes.
                unsafe { libc::pthread_setname_np(libc::pthread_self(), name.as_ptr()) };
                let (state, reason) = run_loop(&mut vcpu, &thread_shared);
                if state == RunState::Crashed {
                    on_exit(vm, &reason);
                }
                thread_shared.finish(state);
            }),
        )?;
        Ok(VcpuHandle {
            thread: Some(thread),
            start: Some(start),
            immediate_exit: std::ptr::null_mut(),
            shared,
            _stack: stack,
        })
    }

    /// Hands the thread VM `vm`'s vCPU: the guest starts running.
    pub fn start(&mut self, vm: u32, mut vcpu: VcpuFd) {
        self.immediate_exit = std::ptr::addr_of_mut!(vcpu.get_kvm_run().immediate_exit);
        if let Some(start) = self.start.take() {
            let _ = start.send((vm, vcpu));
        }
    }

    /// The thread's kernel id (it sets it first thing; waits for that).
    pub fn tid(&self) -> i32 {
        loop {
            match self.shared.tid.load(Ordering::Acquire) {
                0 => std::thread::yield_now(),
                tid => return tid,
            }
        }
    }

    /// Asks the vCPU to leave KVM_RUN, without waiting.
    pub fn request_stop(&mut self) {
        self.start.take();
        let Some(thread) = self.thread else { return };
        self.shared.stop.store(true, Ordering::Release);
        if !self.immediate_exit.is_null() && self.shared.state() == RunState::Running {
            // SAFETY: the kvm_run mapping is alive until the thread ends.
            unsafe { std::ptr::write_volatile(self.immediate_exit, 1) };
            // SAFETY: the thread has not been joined, so its pthread_t is valid.
            unsafe { libc::pthread_kill(thread, kick_signal()) };
        }
    }

    /// Stops the vCPU (if it still runs) and joins its thread.
    pub fn stop(&mut self) {
        self.request_stop();
        if let Some(thread) = self.thread.take() {
            // SAFETY: joined exactly once.
            unsafe { libc::pthread_join(thread, std::ptr::null_mut()) };
        }
    }
}

impl Drop for VcpuHandle {
    fn drop(&mut self) {
        self.stop();
    }
}

fn run_loop(vcpu: &mut VcpuFd, shared: &VcpuShared) -> (RunState, String) {
    loop {
        if shared.stop.load(Ordering::Acquire) {
            return (RunState::Stopped, "stopped by the monitor".into());
        }
        match vcpu.run() {
            Ok(VcpuExit::IoOut(port, _)) if port == abi::PANIC_PORT => {
                return (RunState::Crashed, "guest exception".into());
            }
            Ok(VcpuExit::Hlt) => {}
            Ok(VcpuExit::Shutdown) => return (RunState::Crashed, "triple fault (shutdown)".into()),
            Ok(VcpuExit::IoOut(port, _)) => {
                return (
                    RunState::Crashed,
                    format!("write to unknown port {port:#x}"),
                )
            }
            Ok(VcpuExit::IoIn(port, _)) => {
                return (
                    RunState::Crashed,
                    format!("read from unknown port {port:#x}"),
                )
            }
            Ok(VcpuExit::MmioWrite(addr, _)) => {
                return (
                    RunState::Crashed,
                    format!("write to unbacked or read-only address {addr:#x}"),
                )
            }
            Ok(VcpuExit::MmioRead(addr, _)) => {
                return (
                    RunState::Crashed,
                    format!("read of unbacked address {addr:#x}"),
                )
            }
            Ok(other) => return (RunState::Crashed, format!("unexpected exit {other:?}")),
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {
                vcpu.set_kvm_immediate_exit(0);
            }
            Err(e) => return (RunState::Crashed, format!("KVM_RUN failed: {e}")),
        }
    }
}
