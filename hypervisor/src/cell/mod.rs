//! `densevm cell`: a worker process of `densevm serve` holding a few hundred
//! VMs in an address space of their own, so that a change to guest memory
//! visits only this cell's KVM MMU notifiers.
//!
//! Its standard input is the link to the parent (see `protocol`). It maps
//! its VMs' memory, forks the holders that will own them (`holder`), hands
//! their guest RAM (memfds, each registered with its holder's userfaultfd)
//! to the parent's pager, boots its VMs once the pager knows them, and then
//! runs its event loop (`event_loop`) until the parent says stop or goes
//! away.

pub mod cpu_governor;
pub mod event_loop;
pub mod microvm;
pub mod proxy;
pub mod stats;
pub mod vmtable;

use crate::cell::event_loop::{CellLoop, CellLoopSetup, Exit};
use crate::config::{self, ConfigError};
use crate::guest::memory;
use crate::guest::memory::HolderSlots;
use crate::holder::builder::{self, BuildContext};
use crate::holder::{self, HolderInputs};
use crate::link::framing::peer_gone;
use crate::link::protocol::{CellConfig, FromCell, Hello, Space, ToCell, MAX_LINK_LINE};
use crate::platform;
use crate::scheduling::{self, CellPlacement};
use crate::vstate::vm::VmCaps;
use kvm_ioctls::Kvm;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
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
    // Before any thread or holder starts: they inherit the CPU and the policy.
    if config.args.cell_placement == CellPlacement::Pinned {
        scheduling::pin_cell(config.cell).map_err(|e| format!("pin to a CPU: {e}"))?;
    }
    scheduling::use_cell_policy().map_err(|e| format!("scheduling policy: {e}"))?;
    let setup = (|| -> Result<_, ConfigError> {
        config::ensure_fd_budget(config.capacity, config::fds_per_vm(&config.args))?;
        build_context(&config)
    })();
    let mut ctx = setup.map_err(|ConfigError(e)| e)?;
    let irqs = (0..config.capacity)
        .map(|_| EventFd::new(EFD_NONBLOCK))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("irq eventfds: {e}"))?;
    let doorbells = (0..config.capacity)
        .map(|_| EventFd::new(EFD_NONBLOCK))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("doorbell eventfds: {e}"))?;
    // The process still has one thread: the holders may be forked.
    let (holders, uffds) = holder::fork_all(HolderInputs {
        ctx: &mut ctx,
        irqs: &irqs,
        doorbells: &doorbells,
        parent_link: link.as_raw_fd(),
    })?;
    let spaces = (0..ctx.ram.parts())
        .map(|h| {
            let part = ctx.ram.part(h).expect("the front maps every part");
            Space {
                base: part.as_ptr() as usize,
                len: part.len(),
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
    let fds: Vec<_> = uffds
        .iter()
        .enumerate()
        .flat_map(|(h, uffd)| {
            let memfd = ctx.ram.part(h).expect("the front maps every part").memfd();
            [uffd.as_raw_fd(), memfd.as_raw_fd()]
        })
        .collect();
    link.send_with_fds(&[&line[..]], &fds)
        .map_err(|e| link_error("hand the guest memory to the parent", e.into()))?;
    // The pager's copies of the userfaultfds must be the only ones.
    drop(uffds);
    match read_message::<ToCell>(&link)? {
        ToCell::Go => {}
        other => return Err(format!("expected go, got {other:?}").into()),
    }
    let boot_started = Instant::now();
    let (first_id, count) = (ctx.first_id, config.count);
    let setup = CellLoopSetup {
        ctx,
        doorbells,
        irqs: irqs.into_iter().map(Some).collect(),
        holders,
        link: link.try_clone().map_err(|e| format!("link: {e}"))?,
        boot_started,
        boot_timeout: Duration::from_secs(config.args.boot_timeout),
        inject_request: Duration::from_micros(config.args.inject_request_us),
    };
    let mut event_loop =
        CellLoop::new(setup).map_err(|e| report(&link, format!("event loop: {e}")))?;
    let booted = event_loop.create(first_id, count);
    if let Some(error) = booted.get("error").and_then(|e| e.as_str()) {
        let error = error.trim_start_matches("create: ").to_string();
        event_loop.shutdown();
        return Err(report(&link, error).into());
    }
    match event_loop.run() {
        Ok(Exit::Shutdown) => {
            event_loop.shutdown();
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
/// taken from the socket, since the event loop reads the rest.
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

fn build_context(config: &CellConfig) -> Result<BuildContext, ConfigError> {
    let args = &config.args;
    let (image, layout) = config::load_guest(args)?;
    let kvm = Kvm::new().map_err(|e| ConfigError(format!("cannot open /dev/kvm: {e}")))?;
    let caps = VmCaps::probe(&kvm).map_err(ConfigError)?;
    let platform =
        platform::detect(&kvm).map_err(|e| ConfigError(format!("probe the host: {e}")))?;
    let cpuid = kvm
        .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
        .map_err(|e| ConfigError(format!("get supported CPUID: {e}")))?;
    let per_holder = holder::holder_vms(config.capacity) as usize;
    let slots = config.capacity as usize;
    let ram = HolderSlots::guest_ram(layout.ram_bytes as usize, slots, per_holder)
        .map_err(|e| ConfigError(e.to_string()))?;
    let sys = HolderSlots::system(crate::guest::abi::SYS_BYTES as usize, slots, per_holder)
        .map_err(|e| ConfigError(e.to_string()))?;
    let ctx = BuildContext {
        first_id: config.first_id,
        kvm,
        caps,
        cpuid,
        platform,
        image,
        layout,
        extra_flags: if args.selfcheck {
            crate::guest::abi::FLAG_SELFCHECK
        } else {
            0
        },
        ws_write_stride: args.ws_write_stride,
        guest_arg: args.guest_arg,
        addr_base: args.addr_base,
        port: args.port,
        halt_poll_ns: args.halt_poll_ns,
        // A holder reports its crashed guests; the front runs none.
        on_exit: Arc::new(|_, _| {}),
        sys,
        ram,
        ram_slots_per_holder: per_holder,
        boot_threads: args.boot_threads,
        stack_arena: memory::Arena::new(
            crate::vstate::vcpu::VCPU_STACK_BYTES,
            builder::ARENA_CHUNK_VMS,
        ),
        vcpu_stats: args.vcpu_stats,
    };
    Ok(ctx)
}
