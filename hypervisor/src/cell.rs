//! `densevm cell`: a worker process of `densevm serve` holding a few hundred
//! VMs in an address space of their own, so that a change to guest memory
//! visits only this cell's KVM MMU notifiers.
//!
//! Its standard input is the link to the parent (see `protocol`). It hands
//! its guest RAM (a memfd registered with its userfaultfd) to the parent's
//! pager, boots its VMs once the pager knows them, and then runs the monitor
//! until the parent says stop or goes away.

use crate::framing::peer_gone;
use crate::monitor::{Exit, Monitor, MonitorSetup};
use crate::protocol::{CellConfig, FromCell, Hello, ToCell, MAX_LINK_LINE};
use crate::scheduling::{self, CellPlacement};
use crate::serve::{self, ConfigError};
use crate::vm::{self, BuildContext, MicroVm, DOORBELL_GROUP};
use crate::vstate::vm::VmCaps;
use crate::{memory, platform};
use kvm_ioctls::Kvm;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

const KVM_MAX_CPUID_ENTRIES: usize = 256;

/// Why a cell stopped before the parent told it to.
#[derive(Debug)]
enum CellError {
    /// The parent closed or reset the link: it is going away and says why
    /// itself, so the cell (one of hundreds) adds nothing.
    ParentGone,
    /// The cell cannot go on.
    Failed(String),
}

impl From<String> for CellError {
    fn from(message: String) -> Self {
        CellError::Failed(message)
    }
}

/// Runs a cell; returns the exit code.
pub fn run() -> i32 {
    // SAFETY: fd 0 is the link the parent gave us; we own it from here on.
    let link = unsafe { UnixStream::from_raw_fd(0) };
    let (cell, result) = match read_message::<CellConfig>(&link) {
        Ok(config) => (Some(config.cell), serve_cell(link, config)),
        Err(e) => (None, Err(e)),
    };
    match result {
        Ok(()) => 0,
        Err(CellError::ParentGone) => 1,
        Err(CellError::Failed(message)) => {
            let cell = cell.map(|c| format!(" {c}")).unwrap_or_default();
            eprintln!("densevm: error: cell{cell}: {message}");
            1
        }
    }
}

fn serve_cell(link: UnixStream, config: CellConfig) -> Result<(), CellError> {
    stay_with_parent(config.parent_pid)?;
    // Before any thread starts: the vCPU and boot threads inherit the CPU
    // and the policy.
    if config.args.cell_placement == CellPlacement::Pinned {
        scheduling::pin_cell(config.cell).map_err(|e| format!("pin to a CPU: {e}"))?;
    }
    scheduling::use_cell_policy().map_err(|e| format!("scheduling policy: {e}"))?;
    let setup = (|| -> Result<_, ConfigError> {
        serve::ensure_fd_budget(config.capacity, serve::fds_per_vm(&config.args))?;
        build_context(&config)
    })();
    let (ctx, crashed, waker_slot) = setup.map_err(|ConfigError(e)| e)?;
    let memory = ctx.ram.memory();
    let handoff = memory.hand_over().map_err(|e| e.to_string())?;
    let hello = Hello {
        pid: std::process::id(),
        base: memory.as_ptr() as usize,
        len: memory.len(),
        platform: ctx.platform.name().to_string(),
    };
    let mut line = serde_json::to_vec(&hello).expect("hello serializes");
    line.push(b'\n');
    link.send_with_fds(
        &[&line[..]],
        &[handoff.uffd.as_raw_fd(), handoff.memfd.as_raw_fd()],
    )
    .map_err(|e| link_error("hand the guest memory to the parent", e.into()))?;
    drop(handoff);
    match read_message::<ToCell>(&link)? {
        ToCell::Go => {}
        other => return Err(format!("expected go, got {other:?}").into()),
    }
    let boot_started = Instant::now();
    let groups = config.count.div_ceil(DOORBELL_GROUP);
    let doorbells = (0..groups)
        .map(|_| EventFd::new(EFD_NONBLOCK))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("doorbell eventfds: {e}"))?;
    let vms = build_all(&ctx, &doorbells, config.count, config.args.boot_threads)
        .map_err(|e| report(&link, e))?;
    let setup = MonitorSetup {
        ctx,
        doorbells,
        vms,
        link: link.try_clone().map_err(|e| format!("link: {e}"))?,
        crashed,
        boot_started,
        boot_timeout: Duration::from_secs(config.args.boot_timeout),
        inject_request: Duration::from_micros(config.args.inject_request_us),
    };
    let (mut monitor, waker) =
        Monitor::new(setup).map_err(|e| report(&link, format!("event loop: {e}")))?;
    *waker_slot.lock().expect("waker") = Some(waker);
    // A crash reported before the waker existed is still in the queue.
    let _ = waker_slot.lock().expect("waker").as_ref().map(|w| w.wake());
    match monitor.run() {
        Ok(Exit::Shutdown) => {
            monitor.shutdown();
            Ok(())
        }
        // The parent died without a word: PDEATHSIG ends us anyway.
        Ok(Exit::ParentGone) => Err(CellError::ParentGone),
        Err(message) => Err(report(&link, message).into()),
    }
}

/// Tells the parent why the cell cannot go on; returns the message.
fn report(mut link: &UnixStream, error: String) -> String {
    let mut line = serde_json::to_vec(&FromCell::Failed {
        error: error.clone(),
    })
    .expect("serializes");
    line.push(b'\n');
    let _ = link.write_all(&line);
    error
}

/// A failed read or write on the link.
fn link_error(what: &str, e: std::io::Error) -> CellError {
    if peer_gone(&e) {
        CellError::ParentGone
    } else {
        CellError::Failed(format!("{what}: {e}"))
    }
}

/// Reads one handshake line, a byte at a time: nothing after it may be
/// taken from the socket, since the monitor reads the rest.
fn read_message<T: serde::de::DeserializeOwned>(mut link: &UnixStream) -> Result<T, CellError> {
    let mut line = Vec::new();
    let mut byte = [0u8];
    loop {
        match link.read(&mut byte) {
            Ok(0) => return Err(CellError::ParentGone),
            Ok(_) if byte[0] == b'\n' => break,
            Ok(_) => line.push(byte[0]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(link_error("link", e)),
        }
        if line.len() > MAX_LINK_LINE {
            return Err(CellError::Failed("handshake line too long".into()));
        }
    }
    serde_json::from_slice(&line)
        .map_err(|e| CellError::Failed(format!("bad message from the parent: {e}")))
}

/// The cell dies with its parent (SIGKILL), and leaves SIGINT/SIGTERM to
/// the parent, which stops the cells in order.
fn stay_with_parent(parent_pid: u32) -> Result<(), CellError> {
    // SAFETY: plain prctl/signal calls on our own process.
    unsafe {
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
        libc::signal(libc::SIGINT, libc::SIG_IGN);
        libc::signal(libc::SIGTERM, libc::SIG_IGN);
        if libc::getppid() as u32 != parent_pid {
            return Err(CellError::ParentGone);
        }
    }
    Ok(())
}

type CrashQueue = Arc<Mutex<Vec<u32>>>;
type WakerSlot = Arc<Mutex<Option<Arc<mio::Waker>>>>;

fn build_context(
    config: &CellConfig,
) -> Result<(BuildContext, CrashQueue, WakerSlot), ConfigError> {
    let args = &config.args;
    let (image, layout) = serve::load_guest(args)?;
    let kvm = Kvm::new().map_err(|e| ConfigError(format!("cannot open /dev/kvm: {e}")))?;
    let caps = VmCaps::probe(&kvm).map_err(ConfigError)?;
    let platform =
        platform::detect(&kvm).map_err(|e| ConfigError(format!("probe the host: {e}")))?;
    let cpuid = kvm
        .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
        .map_err(|e| ConfigError(format!("get supported CPUID: {e}")))?;
    let ram = memory::RamSlots::new(layout.ram_bytes as usize, config.capacity as usize)
        .map_err(|e| ConfigError(e.to_string()))?;
    let crashed: CrashQueue = Arc::new(Mutex::new(Vec::new()));
    let waker_slot: WakerSlot = Arc::new(Mutex::new(None));
    let on_exit = {
        let crashed = Arc::clone(&crashed);
        let waker_slot = Arc::clone(&waker_slot);
        Arc::new(move |vm: u32| {
            crashed.lock().expect("crash queue").push(vm);
            if let Some(waker) = waker_slot.lock().expect("waker").as_ref() {
                let _ = waker.wake();
            }
        })
    };
    let ctx = BuildContext {
        first_id: config.first_id,
        kvm,
        caps,
        cpuid,
        platform,
        image,
        layout,
        extra_flags: if args.selfcheck {
            crate::abi::FLAG_SELFCHECK
        } else {
            0
        },
        ws_write_stride: args.ws_write_stride,
        guest_arg: args.guest_arg,
        addr_base: args.addr_base,
        port: args.port,
        halt_poll_ns: args.halt_poll_ns,
        on_exit,
        sys_arena: memory::Arena::new(crate::abi::SYS_BYTES as usize, vm::ARENA_CHUNK_VMS),
        ram,
        stack_arena: memory::Arena::new(crate::vstate::vcpu::VCPU_STACK_BYTES, vm::ARENA_CHUNK_VMS),
        vcpu_stats: args.vcpu_stats,
    };
    Ok((ctx, crashed, waker_slot))
}

/// Builds the cell's first `count` VMs on `threads` threads, in id order.
fn build_all(
    ctx: &BuildContext,
    doorbells: &[EventFd],
    count: u32,
    threads: u32,
) -> Result<Vec<MicroVm>, String> {
    let threads = threads.clamp(1, 16);
    let ids = ctx.first_id..ctx.first_id + count;
    // Every KVM VM is created before any vCPU maps its run page: creating
    // one visits every VMA, so this keeps the boot linear in the VM count.
    let kvms = ids
        .clone()
        .map(|id| vm::create(ctx, id))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| e.to_string())?;
    let mut parts = Vec::with_capacity(count as usize);
    for (id, kvm) in ids.zip(kvms) {
        let vcpu = vm::park_vcpu(ctx, id).map_err(|e| e.to_string())?;
        parts.push(Mutex::new(Some(vm::Prebuilt { vcpu, kvm })));
    }
    let next = std::sync::atomic::AtomicU32::new(0);
    let built: Mutex<Vec<Option<MicroVm>>> = Mutex::new((0..count).map(|_| None).collect());
    let failure: Mutex<Option<String>> = Mutex::new(None);
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| loop {
                if failure.lock().expect("failure").is_some() {
                    return;
                }
                let index = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if index >= count {
                    return;
                }
                let prebuilt = parts[index as usize]
                    .lock()
                    .expect("prebuilt")
                    .take()
                    .expect("each VM built once");
                let id = ctx.first_id + index;
                match vm::build(
                    ctx,
                    id,
                    prebuilt,
                    &doorbells[(index / DOORBELL_GROUP) as usize],
                ) {
                    Ok(vm) => built.lock().expect("built")[index as usize] = Some(vm),
                    Err(e) => *failure.lock().expect("failure") = Some(e.to_string()),
                }
            });
        }
    });
    if let Some(error) = failure.into_inner().expect("failure") {
        return Err(error);
    }
    Ok(built
        .into_inner()
        .expect("built")
        .into_iter()
        .map(|vm| vm.expect("every VM built"))
        .collect())
}
