//! `densevm cell`: a worker process of `densevm serve` holding a few hundred
//! VMs in an address space of their own, so that a change to guest memory
//! visits only this cell's KVM MMU notifiers.
//!
//! Its standard input is the link to the parent (see `link::protocol`). It maps
//! its VMs' memory, forks the holders that will own them (`holder`), hands
//! their guest RAM (memfds, each registered with its holder's userfaultfd)
//! to the parent's pager and its one listening socket (`listener`) to the
//! parent's address steering, boots its VMs once the pager knows them, and then
//! runs its event loop (`event_loop`) until the parent says stop or goes
//! away.

pub mod cpu_governor;
pub mod event_loop;
pub mod hibernation;
pub mod listener;
pub mod microvm;
pub mod proxy;
pub mod stats;
pub mod vmtable;

use crate::cell::event_loop::{CellLoop, CellLoopSetup, Exit, LoopError};
use crate::config::{self, CellSettings, FdShortage};
use crate::guest::boot::RamLayout;
use crate::guest::loader::{self, LoadError};
use crate::guest::memory::{self, HolderSlots};
use crate::holder::builder::{self, BuildContext};
use crate::holder::{self, HolderError, HolderInputs};
use crate::link::framing::peer_gone;
use crate::link::protocol::{CellConfig, FromCell, Hello, Request, Space, ToCell, MAX_LINK_LINE};
use crate::platform::{self, PlatformError};
use crate::scheduling::{self, CellPlacement, VcpuCpus};
use crate::vstate::vm::{MissingCapability, VmCaps};
use kvm_ioctls::Kvm;
use paging_policy::PagerError;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

const KVM_MAX_CPUID_ENTRIES: usize = 256;

/// Why a cell stopped before the parent told it to.
#[derive(Debug, thiserror::Error)]
pub enum CellError {
    /// The parent closed or reset the link: it is going away and says why
    /// itself, so the cell (one of hundreds) adds nothing.
    #[error("the parent is gone")]
    ParentGone,
    /// A system call of the set-up failed.
    #[error("{what}: {source}")]
    Io {
        /// The step.
        what: &'static str,
        /// The error.
        source: io::Error,
    },
    /// KVM refused a step.
    #[error("{what}: {source}")]
    Kvm {
        /// The step.
        what: &'static str,
        /// KVM's error.
        source: kvm_ioctls::Error,
    },
    /// This KVM lacks a capability.
    #[error(transparent)]
    Capability(#[from] MissingCapability),
    /// The host could not be probed.
    #[error("probe the host: {0}")]
    Platform(#[from] PlatformError),
    /// The guest image could not be loaded.
    #[error(transparent)]
    Guest(#[from] LoadError),
    /// The guest image no longer fits the layout the parent made for it.
    #[error("guest image {} changed since the parent laid it out", .0.display())]
    GuestChanged(PathBuf),
    /// Guest memory could not be mapped.
    #[error("map guest memory: {0}")]
    Memory(#[from] PagerError),
    /// The descriptor limit cannot cover the cell's VMs.
    #[error(transparent)]
    Fds(#[from] FdShortage),
    /// The holders could not be started.
    #[error(transparent)]
    Holder(#[from] HolderError),
    /// The parent sent what the cell cannot read.
    #[error("bad message from the parent: {0}")]
    BadMessage(serde_json::Error),
    /// A handshake line longer than [`MAX_LINK_LINE`].
    #[error("handshake line too long")]
    LineTooLong,
    /// The parent sent another request than the handshake's.
    #[error("expected go, got {0:?}")]
    Unexpected(ToCell),
    /// The event loop failed.
    #[error(transparent)]
    Loop(#[from] LoopError),
    /// The cell's VMs could not be booted (the create reply's message).
    #[error("{0}")]
    Boot(String),
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
        Err(error) => {
            let cell = cell.map(|c| format!(" {c}")).unwrap_or_default();
            crate::log!("densevm: error: cell{cell}: {error}");
            1
        }
    }
}

fn serve_cell(link: UnixStream, config: CellConfig) -> Result<(), CellError> {
    stay_with_parent(config.parent_pid)?;
    let settings = &config.settings;
    let densevm_cpus = scheduling::allowed_cpus().map_err(|source| CellError::Io {
        what: "the CPUs densevm may use",
        source,
    })?;
    // Before any thread or holder starts: they inherit the CPU and the policy.
    let home = match settings.placement {
        CellPlacement::Pinned => {
            let pinned = scheduling::pin_cell(config.cell, &densevm_cpus);
            vec![pinned.map_err(|source| CellError::Io {
                what: "pin to a CPU",
                source,
            })?]
        }
        CellPlacement::Floating => densevm_cpus.clone(),
    };
    scheduling::use_cell_policy().map_err(|source| CellError::Io {
        what: "scheduling policy",
        source,
    })?;
    let vcpu_cpus = VcpuCpus {
        home,
        background: densevm_cpus,
    };
    let fd_vms = settings
        .hibernation
        .map_or(config.capacity, |h| h.vms_with_fds(config.capacity));
    config::ensure_fd_budget(fd_vms, settings.fds_per_vm)?;
    let mut ctx = build_context(&config)?;
    // Without hibernation every VM boots on eventfds made here, before the
    // fork; with it, every VM is created asleep and each wake makes its own.
    let (irqs, doorbells) = match settings.hibernation {
        Some(_) => (Vec::new(), Vec::new()),
        None => (
            eventfds(config.capacity, "irq eventfds")?,
            eventfds(config.capacity, "doorbell eventfds")?,
        ),
    };
    // The process still has one thread: the holders may be forked.
    let (holders, uffds) = holder::fork_all(HolderInputs {
        ctx: &mut ctx,
        capacity: config.capacity,
        irqs: &irqs,
        doorbells: &doorbells,
        parent_link: link.as_raw_fd(),
    })?;
    // After the fork: no holder has it.
    let listener = listener::listen().map_err(|source| CellError::Io {
        what: "listen",
        source,
    })?;
    let spaces = (0..ctx.ram.parts())
        .map(|h| {
            let part = ctx.ram.part(h).expect("the front maps every part");
            Space {
                base: part.base,
                len: part.len,
            }
        })
        .collect();
    let hello = Hello {
        pid: std::process::id(),
        holder_vms: ctx.ram_slots_per_holder as u32,
        spaces,
        platform: ctx.platform.name().to_string(),
    };
    let mut line = serde_json::to_vec(&hello).expect("hello serializes");
    line.push(b'\n');
    let memfd = ctx
        .ram
        .memory()
        .memfd()
        .expect("the front closes its memfd after the hello");
    let fds: Vec<_> = uffds
        .iter()
        .map(|uffd| uffd.as_raw_fd())
        .chain([memfd.as_raw_fd(), listener.as_raw_fd()])
        .collect();
    link.send_with_fds(&[&line[..]], &fds)
        .map_err(|e| link_error("hand the guest memory to the parent", e.into()))?;
    // The pager's copies of the userfaultfds must be the only ones. The
    // memfds the front needs no more: it keeps their mappings (holders it
    // starts again inherit them).
    drop(uffds);
    ctx.ram.close_memfd();
    ctx.sys.close_memfd();
    match read_message::<Request>(&link)?.req {
        ToCell::Go => {}
        other => return Err(CellError::Unexpected(other)),
    }
    let boot_started = Instant::now();
    let (first_id, count) = (ctx.first_id, config.count);
    let setup = CellLoopSetup {
        ctx,
        doorbells: per_slot(doorbells, config.capacity),
        irqs: per_slot(irqs, config.capacity),
        holders,
        listener,
        link: link.try_clone().map_err(|source| CellError::Io {
            what: "link",
            source,
        })?,
        boot_started,
        boot_timeout: settings.boot_timeout,
        inject_request: settings.inject_request,
        hibernation: settings.hibernation,
        cell: config.cell,
        vcpu_cpus,
    };
    let mut event_loop = CellLoop::new(setup).map_err(|e| report(&link, e.into()))?;
    let booted = event_loop.create(first_id, count);
    if let Some(error) = booted.get("error").and_then(|e| e.as_str()) {
        let error = error.trim_start_matches("create: ").to_string();
        event_loop.shutdown();
        return Err(report(&link, CellError::Boot(error)));
    }
    event_loop.start_template();
    match event_loop.run() {
        Ok(Exit::Shutdown) => {
            event_loop.shutdown();
            Ok(())
        }
        // The parent died without a word: PDEATHSIG ends us anyway.
        Ok(Exit::ParentGone) => Err(CellError::ParentGone),
        Err(e) => Err(report(&link, e.into())),
    }
}

/// One nonblocking eventfd per slot.
fn eventfds(count: u32, what: &'static str) -> Result<Vec<EventFd>, CellError> {
    (0..count)
        .map(|_| EventFd::new(EFD_NONBLOCK))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|source| CellError::Io { what, source })
}

/// One entry per slot of a cell of `capacity`: `made`, then none.
fn per_slot(made: Vec<EventFd>, capacity: u32) -> Vec<Option<EventFd>> {
    let mut slots: Vec<Option<EventFd>> = made.into_iter().map(Some).collect();
    slots.resize_with(capacity as usize, || None);
    slots
}

/// Tells the parent why the cell cannot go on; returns the error.
fn report(mut link: &UnixStream, error: CellError) -> CellError {
    let mut line = serde_json::to_vec(&FromCell::Failed {
        error: error.to_string(),
    })
    .expect("serializes");
    line.push(b'\n');
    let _ = link.write_all(&line);
    error
}

/// A failed read or write on the link.
fn link_error(what: &'static str, source: io::Error) -> CellError {
    if peer_gone(&source) {
        CellError::ParentGone
    } else {
        CellError::Io { what, source }
    }
}

/// Reads one handshake line, a byte at a time: nothing after it may be
/// taken from the socket, since the event loop reads the rest.
fn read_message<T: serde::de::DeserializeOwned>(mut link: &UnixStream) -> Result<T, CellError> {
    let mut line = Vec::new();
    let mut byte = [0u8];
    loop {
        match link.read(&mut byte) {
            Ok(0) => return Err(CellError::ParentGone),
            Ok(_) if byte[0] == b'\n' => break,
            Ok(_) => line.push(byte[0]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(link_error("link", e)),
        }
        if line.len() > MAX_LINK_LINE {
            return Err(CellError::LineTooLong);
        }
    }
    serde_json::from_slice(&line).map_err(CellError::BadMessage)
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

/// Maps the guest image the parent laid out; it must still fit that layout.
fn load_image(settings: &CellSettings) -> Result<loader::GuestImage, CellError> {
    let image = loader::load(&settings.guest)?;
    let layout = settings.layout;
    let relaid = RamLayout::new(
        layout.ram_bytes,
        image.bss_end,
        image.rx_buffers,
        layout.ws_bytes,
    );
    if relaid != Some(layout) {
        return Err(CellError::GuestChanged(settings.guest.clone()));
    }
    Ok(image)
}

fn build_context(config: &CellConfig) -> Result<BuildContext, CellError> {
    let settings = &config.settings;
    let image = load_image(settings)?;
    let kvm = Kvm::new().map_err(|source| CellError::Kvm {
        what: "open /dev/kvm",
        source,
    })?;
    let caps = VmCaps::probe(&kvm)?;
    let platform = platform::detect(&kvm)?;
    let cpuid = kvm
        .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
        .map_err(|source| CellError::Kvm {
            what: "get supported CPUID",
            source,
        })?;
    let per_holder = config::holder_vms(config.capacity) as usize;
    let slots = config.capacity as usize;
    let ram = HolderSlots::guest_ram(settings.layout.ram_bytes as usize, slots, per_holder)?;
    let sys = HolderSlots::system(crate::guest::abi::SYS_BYTES as usize, slots, per_holder)?;
    let ctx = BuildContext {
        first_id: config.first_id,
        kvm,
        caps,
        cpuid,
        platform,
        image,
        layout: settings.layout,
        extra_flags: settings.boot_flags,
        ws_write_stride: settings.ws_write_stride,
        guest_arg: settings.guest_arg,
        addr_base: settings.addr_base,
        port: settings.port,
        halt_poll_ns: settings.halt_poll_ns,
        // A holder reports its crashed guests; the front runs none.
        on_exit: Arc::new(|_, _| {}),
        sys,
        ram,
        ram_slots_per_holder: per_holder,
        boot_threads: settings.boot_threads,
        stack_arena: memory::Arena::new(
            crate::vstate::vcpu::VCPU_STACK_BYTES,
            builder::ARENA_CHUNK_VMS,
        ),
        vcpu_stats: settings.vcpu_stats,
    };
    Ok(ctx)
}
