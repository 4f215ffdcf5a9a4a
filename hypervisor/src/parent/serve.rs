//! `densevm serve`: validate the configuration, start the pager and the
//! cells that hold the VMs, supervise them until a signal, tear down.

use crate::boot::RamLayout;
use crate::cells::{boot_layout, default_cell_vms, PendingCell};
use crate::loader::{self, GuestImage};
use crate::platform;
use crate::scheduling::{self, CellPlacement};
use crate::supervisor::{Exit, Supervisor, SupervisorSetup};
use clap::Args;
use kvm_ioctls::Kvm;
use paging_policy::trace::{TraceHeader, TraceWriter};
use paging_policy::{parse_size, DiskSpec, Pager, PagerConfig, PolicySpec};
use serde::{Deserialize, Serialize};
use serde_json::json;
use std::io::Write;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// File descriptors a VM needs in one process of its cell, at most: its
/// listener, irqfd and doorbell in the front; in its holder, its VM and vCPU
/// besides every irqfd and doorbell of the cell (inherited at the fork).
const FDS_PER_VM: u64 = 4;
/// Descriptors kept free for connections, the API and the pager.
const FD_HEADROOM: u64 = 1024;
/// Descriptors the parent holds per cell: link, userfaultfd, memfd, pidfd slack.
const FDS_PER_CELL: u64 = 4;
/// Kernel memory a 1-vCPU KVM VM holds (docs/host-facts.md, "Costs of KVM operations"):
/// a VM count the host cannot hold is refused up front.
const KERNEL_BYTES_PER_VM: u64 = 600 << 10;
/// A request writes one word in every 4th working-set page by default.
pub const DEFAULT_WS_WRITE_STRIDE: u32 = 4;
/// Longest orderly teardown before the process just exits.
const TEARDOWN_GRACE: Duration = Duration::from_secs(30);

/// Flags of `densevm serve`.
#[derive(Args, Debug, Clone, Serialize, Deserialize)]
pub struct ServeArgs {
    /// Number of VMs to boot.
    #[arg(long, default_value_t = 16)]
    pub vms: u32,
    /// At most this many VMs per worker process (cell): each cell has its own
    /// address space, so a change to guest memory visits only its VMs' MMU
    /// notifiers. The VMs are spread evenly over as few cells as fit (pinned:
    /// as many on every CPU). [default: 500 if the blocks every VM's requests
    /// touch fit in --mem together, else 100]
    #[arg(long)]
    pub cell_vms: Option<u32>,
    /// Where cells run: pinned (cell i and all its threads on one CPU, round
    /// robin over the CPUs densevm may use) or floating (the scheduler's choice).
    #[arg(long, value_enum, default_value_t = CellPlacement::Pinned)]
    pub cell_placement: CellPlacement,
    /// Address of VM 0; VM i listens on this address plus i.
    #[arg(long, default_value = "127.1.0.0")]
    pub addr_base: Ipv4Addr,
    /// TCP port every VM listens on.
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Working set every request touches (e.g. 896K).
    #[arg(long, default_value = "896K")]
    pub ws: String,
    /// Write one word in every Nth working-set page per request (1 = every page).
    #[arg(long, default_value_t = DEFAULT_WS_WRITE_STRIDE)]
    pub ws_write_stride: u32,
    /// A number given to every guest in its boot info, opaque to the monitor
    /// (the test guests read their behaviour from it).
    #[arg(long, default_value_t = 0)]
    pub guest_arg: u64,
    /// RAM of each VM.
    #[arg(long, default_value = "4M")]
    pub guest_mem: String,
    /// Control socket path [default: densevm-<pid>.sock in the current directory].
    #[arg(long)]
    pub api: Option<PathBuf>,
    /// Guest image [default: webguest.elf beside the densevm binary].
    #[arg(long)]
    pub guest: Option<PathBuf>,
    /// Guests stamp and verify every working-set page on every request.
    #[arg(long)]
    pub selfcheck: bool,
    /// KVM halt polling per VM, in ns [default: the host's setting].
    #[arg(long)]
    pub halt_poll_ns: Option<u64>,
    /// A VM not up after this many seconds is stopped as a boot failure.
    #[arg(long, default_value_t = 120)]
    pub boot_timeout: u64,
    /// Memory budget for all guest RAM together.
    #[arg(long, default_value = "1G")]
    pub mem: String,
    /// Paging block size: the unit of fault-in and eviction (4k..256k, a power of two).
    #[arg(long, default_value = "32k")]
    pub block: String,
    /// Paging policy: demand, wsswap, or the path of a policy plugin (.so).
    #[arg(long, default_value = "demand")]
    pub policy: String,
    /// Swap file or block device [default: densevm-swap-<pid>.img in the current directory].
    #[arg(long)]
    pub swap: Option<PathBuf>,
    /// Keep the swap file at exit.
    #[arg(long)]
    pub keep_swap: bool,
    /// Size of the swap device [default: room for every VM's RAM].
    #[arg(long)]
    pub swap_size: Option<String>,
    /// Disk model added to the swap I/O: none, hdd, hdd15k, ssd, array:N, raid5:N, with overrides (hdd,seek_ms=9).
    #[arg(long, default_value = "none")]
    pub disk: String,
    /// Record the VM of every served request, for pagesim.
    #[arg(long)]
    pub record_trace: Option<PathBuf>,
    /// Report KVM's per-vCPU counters in the stats (one more fd per VM).
    #[arg(long)]
    pub vcpu_stats: bool,
    /// Threads that create VMs at boot, per cell.
    #[arg(long, default_value_t = 2)]
    pub boot_threads: u32,
    /// Most resident memory one VM may hold (e.g. 512k); past it the VM's
    /// own blocks are evicted, whatever the policy chooses, so a thrashing
    /// VM pages against itself rather than its neighbours. Default: none.
    #[arg(long)]
    pub vm_resident_max: Option<String>,
    /// Busy CPU work per served request, in microseconds: a known slowdown of
    /// the in-core path, only for checking regression detection.
    #[arg(long, default_value_t = 0)]
    pub inject_request_us: u64,
    /// Kernel CPU work per page fault-in, in microseconds: a known slowdown
    /// of the out-of-core path, only for checking regression detection.
    #[arg(long, default_value_t = 0)]
    pub inject_fault_us: u64,
}

/// A configuration or set-up error: one line, exit code 2.
#[derive(Debug)]
pub struct ConfigError(pub String);

fn default_guest() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(|dir| dir.join("webguest.elf")))
        .unwrap_or_else(|| PathBuf::from("webguest.elf"))
}

/// Descriptors a VM holds in its cell with these flags.
pub fn fds_per_vm(args: &ServeArgs) -> u64 {
    FDS_PER_VM + args.vcpu_stats as u64
}

/// Raises the soft fd limit to the hard one; checks it covers `count`
/// holders of `fds_each` descriptors.
pub fn ensure_fd_budget(count: u32, fds_each: u64) -> Result<(), ConfigError> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: plain getrlimit/setrlimit on our own process.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit);
        limit.rlim_cur = limit.rlim_max;
        libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
    }
    let needed = count as u64 * fds_each + FD_HEADROOM;
    if needed > limit.rlim_max {
        return Err(ConfigError(format!(
            "{count} x {fds_each} file descriptors need about {needed} but RLIMIT_NOFILE allows {}",
            limit.rlim_max
        )));
    }
    Ok(())
}

/// The guest image and the RAM layout of every VM.
pub fn load_guest(args: &ServeArgs) -> Result<(GuestImage, RamLayout), ConfigError> {
    let ws = size("--ws", &args.ws)?;
    let guest_mem = size("--guest-mem", &args.guest_mem)?;
    let guest = args.guest.clone().unwrap_or_else(default_guest);
    let image = loader::load(&guest).map_err(|e| ConfigError(e.to_string()))?;
    let layout = RamLayout::new(guest_mem, image.bss_end, image.rx_buffers, ws).ok_or_else(|| {
        ConfigError(format!(
            "--guest-mem {} cannot hold the guest ({} KiB of bss), a {} KiB working set and its stack: needs at least {} KiB",
            args.guest_mem,
            image.bss_end / 1024,
            ws / 1024,
            RamLayout::min_ram_bytes(image.bss_end, ws) / 1024
        ))
    })?;
    Ok((image, layout))
}

/// The VMs the swap is sized for: room for VMs created later through the
/// API, too.
pub fn vms_with_headroom(vms: u32) -> u32 {
    vms.saturating_mul(2).max(vms.saturating_add(64))
}

fn size(flag: &str, text: &str) -> Result<u64, ConfigError> {
    parse_size(text).map_err(|e| ConfigError(format!("{flag}: {e}")))
}

struct Prepared {
    api: std::os::unix::net::UnixListener,
    api_path: PathBuf,
    pager: Arc<Pager>,
    trace: Option<TraceWriter>,
    layout: RamLayout,
    platform: &'static str,
    /// Most VMs a cell holds: `--cell-vms` or the default for the regime.
    cell_vms: u32,
    /// VMs each cell boots with, in ID order.
    cell_sizes: Vec<u32>,
}

fn check_flags(args: &ServeArgs) -> Result<(), ConfigError> {
    if args.vms == 0 {
        return Err(ConfigError("--vms must be at least 1".into()));
    }
    if args.cell_vms == Some(0) {
        return Err(ConfigError("--cell-vms must be at least 1".into()));
    }
    if args.ws_write_stride == 0 {
        return Err(ConfigError("--ws-write-stride must be at least 1".into()));
    }
    let ws = size("--ws", &args.ws)?;
    let guest_mem = size("--guest-mem", &args.guest_mem)?;
    if ws % 4096 != 0 || guest_mem % 4096 != 0 {
        return Err(ConfigError(
            "--ws and --guest-mem must be multiples of 4 KiB".into(),
        ));
    }
    if guest_mem > 1 << 30 {
        return Err(ConfigError("--guest-mem is at most 1G".into()));
    }
    let last = u32::from(args.addr_base).checked_add(args.vms - 1);
    match last.map(Ipv4Addr::from) {
        Some(addr) if addr.is_loopback() && args.addr_base.is_loopback() => {}
        _ => {
            return Err(ConfigError(format!(
                "--addr-base {} + {} VMs leaves 127.0.0.0/8",
                args.addr_base, args.vms
            )))
        }
    }
    let needed = args.vms as u64 * KERNEL_BYTES_PER_VM;
    match mem_available() {
        Some(available) if needed > available => Err(ConfigError(format!(
            "--vms {} needs about {:.1} GiB of kernel memory ({} KiB a VM) but {:.1} GiB is available",
            args.vms,
            needed as f64 / GIB,
            KERNEL_BYTES_PER_VM >> 10,
            available as f64 / GIB
        ))),
        _ => Ok(()),
    }
}

const GIB: f64 = (1u64 << 30) as f64;

/// MemAvailable from /proc/meminfo, in bytes.
fn mem_available() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    line.split_whitespace()
        .nth(1)?
        .parse::<u64>()
        .ok()
        .map(|kib| kib << 10)
}

/// The pager's configuration from `serve`'s flags, parsed once and checked
/// against the guest's layout.
pub fn pager_config(args: &ServeArgs, layout: &RamLayout) -> Result<PagerConfig, ConfigError> {
    let config = PagerConfig {
        budget_bytes: size("--mem", &args.mem)?,
        block_bytes: size("--block", &args.block)?,
        policy: PolicySpec::parse(&args.policy).map_err(|e| ConfigError(e.to_string()))?,
        swap_path: args.swap.clone(),
        keep_swap: args.keep_swap,
        disk: DiskSpec::parse(&args.disk).map_err(|e| ConfigError(e.to_string()))?,
        swap_bytes: args
            .swap_size
            .as_deref()
            .map(|s| size("--swap-size", s))
            .transpose()?,
        vm_resident_max: args
            .vm_resident_max
            .as_deref()
            .map(|s| size("--vm-resident-max", s))
            .transpose()?,
        inject_fault: std::time::Duration::from_micros(args.inject_fault_us),
    };
    config
        .validate(layout.ram_bytes, layout.request_footprint())
        .map_err(|e| ConfigError(e.to_string()))?;
    Ok(config)
}

/// Most VMs a cell holds: `--cell-vms`, or the default for the regime the
/// flags put the VMs in.
pub fn cell_vms(args: &ServeArgs, layout: &RamLayout, pager: &PagerConfig) -> u32 {
    args.cell_vms.unwrap_or_else(|| {
        default_cell_vms(
            args.vms,
            layout.request_blocks_bytes(pager.block_bytes),
            pager.budget_bytes,
        )
    })
}

fn prepare(args: &ServeArgs) -> Result<Prepared, ConfigError> {
    check_flags(args)?;
    let pinned_cpus = match args.cell_placement {
        CellPlacement::Pinned => Some(
            scheduling::allowed_cpus()
                .map_err(|e| ConfigError(format!("the CPUs densevm may use: {e}")))?
                .len(),
        ),
        CellPlacement::Floating => None,
    };
    let (_, layout) = load_guest(args)?;
    let pager_config = pager_config(args, &layout)?;
    let cell_vms = cell_vms(args, &layout, &pager_config);
    let cell_sizes = boot_layout(args.vms, cell_vms, pinned_cpus);
    // The parent holds a few descriptors per cell; each cell checks its own VMs.
    ensure_fd_budget(cell_sizes.len() as u32, FDS_PER_CELL)?;
    ensure_fd_budget(cell_vms.min(args.vms), fds_per_vm(args))
        .map_err(|ConfigError(e)| ConfigError(format!("--cell-vms {cell_vms}: {e}")))?;
    let trace = match &args.record_trace {
        Some(path) => {
            let header = TraceHeader {
                block_bytes: pager_config.block_bytes,
                vm_ram_bytes: layout.ram_bytes,
                vms: args.vms,
                request_ranges: layout.request_ranges(),
            };
            Some(
                TraceWriter::create(path, &header)
                    .map_err(|e| ConfigError(format!("--record-trace: {e}")))?,
            )
        }
        None => None,
    };
    // The cells open /dev/kvm; checking it here gives a configuration error
    // before anything starts.
    let kvm = Kvm::new().map_err(|e| ConfigError(format!("cannot open /dev/kvm: {e}")))?;
    let platform = platform::detect(&kvm)
        .map_err(|e| ConfigError(format!("probe the host: {e}")))?
        .name();

    let api_path = args
        .api
        .clone()
        .unwrap_or_else(|| PathBuf::from(format!("densevm-{}.sock", std::process::id())));
    if api_path.exists() {
        if std::os::unix::net::UnixStream::connect(&api_path).is_ok() {
            return Err(ConfigError(format!(
                "control socket {} is in use by another densevm",
                api_path.display()
            )));
        }
        let _ = std::fs::remove_file(&api_path);
    }
    let pager = Pager::new(pager_config, vms_with_headroom(args.vms), layout.ram_bytes)
        .map_err(|e| ConfigError(e.to_string()))?;
    // Only the owner may drive the monitor: the socket is created 0600, whatever the umask.
    // SAFETY: umask only changes this process's file-creation mask; restored right after.
    let umask = unsafe { libc::umask(0o177) };
    let api = std::os::unix::net::UnixListener::bind(&api_path);
    // SAFETY: as above.
    unsafe { libc::umask(umask) };
    let api = api.map_err(|e| {
        ConfigError(format!(
            "cannot bind control socket {}: {e}",
            api_path.display()
        ))
    })?;
    api.set_nonblocking(true)
        .map_err(|e| ConfigError(format!("control socket: {e}")))?;
    Ok(Prepared {
        api,
        api_path,
        pager,
        trace,
        layout,
        platform,
        cell_vms,
        cell_sizes,
    })
}

/// Writes one JSON line to stdout; a reader that went away is not an error
/// worth dying for.
pub fn emit(line: &serde_json::Value) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}").and_then(|()| out.flush());
}

/// Runs `densevm serve`; returns the exit code.
pub fn run(args: ServeArgs) -> i32 {
    let prepared = match prepare(&args) {
        Ok(p) => p,
        Err(ConfigError(message)) => {
            eprintln!("densevm: error: {message}");
            return 2;
        }
    };
    let Prepared {
        api,
        api_path,
        pager,
        trace,
        layout,
        platform,
        cell_vms,
        cell_sizes,
    } = prepared;
    let boot_started = Instant::now();
    let fail = |message: String| {
        eprintln!("densevm: error: {message}");
        let _ = std::fs::remove_file(&api_path);
        pager.shutdown();
        1
    };
    // Every cell starts (and initialises, in parallel) before the first
    // handshake.
    let mut pending = Vec::new();
    let mut first = 0;
    for count in cell_sizes {
        match PendingCell::spawn(&args, pending.len() as u32, first, count, cell_vms) {
            Ok(cell) => pending.push(cell),
            Err(e) => return fail(e),
        }
        first += count;
    }
    let mut cells = Vec::with_capacity(pending.len());
    for cell in pending {
        match cell.handshake(&pager, layout.ram_bytes as usize) {
            Ok(cell) => cells.push(cell),
            Err(e) => return fail(e),
        }
    }
    let ready_line = json!({
        "api": api_path.display().to_string(),
        "platform": platform,
        "pvm": platform == "pvm",
        "addr_base": args.addr_base.to_string(),
        "port": args.port,
        "pid": std::process::id(),
        "cells": cells.len(),
        "cell_vms": cell_vms,
        "cell_placement": args.cell_placement,
    });
    let setup = SupervisorSetup {
        args,
        cell_vms,
        cells,
        pager: Arc::clone(&pager),
        ram_bytes: layout.ram_bytes as usize,
        api,
        api_path: api_path.clone(),
        boot_started,
        ready_line,
        trace,
    };
    let mut supervisor = match Supervisor::new(setup) {
        Ok(s) => s,
        Err(e) => return fail(format!("event loop: {e}")),
    };
    match supervisor.run() {
        Ok(Exit::Signal(signal)) => {
            // A cell that does not stop would hold the teardown forever;
            // exiting releases everything anyway.
            std::thread::spawn(|| {
                std::thread::sleep(TEARDOWN_GRACE);
                eprintln!(
                    "densevm: teardown took over {} s; exiting with VMs still held",
                    TEARDOWN_GRACE.as_secs()
                );
                std::process::exit(1);
            });
            // Nothing is measured any more, and a vCPU blocked in a fault
            // can only wait for the pager: its modeled disk time (a wsswap
            // swap-in on `hdd` is hundreds of ms, queued behind others) would
            // hold the cells' exit for tens of seconds.
            pager.set_disk_modeled(false);
            supervisor.shutdown();
            pager.shutdown();
            emit(&json!({ "event": "exit", "reason": "signal", "signal": signal }));
            0
        }
        Err(message) => {
            // The run is broken (the pager failed, say): report first, then
            // stop the cells without waiting for vCPUs that may never return.
            eprintln!("densevm: error: {message}");
            emit(&json!({ "event": "exit", "reason": "error", "error": message }));
            supervisor.kill_cells();
            let _ = std::fs::remove_file(&api_path);
            pager.shutdown();
            std::process::exit(1);
        }
    }
}
