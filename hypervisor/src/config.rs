//! The configuration of `densevm serve` (and `describe`): its flags
//! ([`ServeArgs`]), and everything derived from them once, in the parent:
//! the checks that refuse a configuration, the guest's RAM layout, the
//! pager's settings and the size of the cells.

use crate::guest::abi;
use crate::guest::boot::RamLayout;
use crate::guest::loader;
use crate::scheduling::CellPlacement;
use clap::Args;
use paging_policy::{parse_size, DiskSpec, PagerConfig, PolicySpec};
use serde::{Deserialize, Serialize};
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::time::Duration;

/// File descriptors a VM needs in one process of its cell, at most: its
/// irqfd and doorbell in the front; in its holder, its VM and vCPU besides
/// every irqfd and doorbell of the cell (inherited at the fork).
const FDS_PER_VM: u64 = 4;
/// Connections a cell accepts and holds for VMs with no free slot yet
/// (`cell::listener`): each is a descriptor of the cell.
pub const HELD_PER_CELL: usize = 2048;
/// Descriptors kept free for connections (the held ones and a thousand
/// more), the API and the pager.
const FD_HEADROOM: u64 = 1024 + HELD_PER_CELL as u64;
/// Kernel memory a 1-vCPU KVM VM holds (docs/host-facts.md, "Costs of KVM operations"):
/// a VM count the host cannot hold is refused up front.
pub const KERNEL_BYTES_PER_VM: u64 = 600 << 10;
/// Host memory a hibernated VM keeps (its system pages and records in the
/// cell and the parent): 35 KiB measured asleep at 2,000 and 4,000 VMs
/// (experiments/bench/hibernation.py, 2026-11-28), rounded up.
pub const ASLEEP_BYTES_PER_VM: u64 = 64 << 10;
/// A request writes one word in every 4th working-set page by default.
pub const DEFAULT_WS_WRITE_STRIDE: u32 = 4;

/// Flags of `densevm serve`.
#[derive(Args, Debug)]
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
    /// Hibernate a VM with no open connection once it has been idle this
    /// many seconds: its vCPU, KVM VM and thread are released and its
    /// memory goes to swap; its next connection wakes it. Default: never.
    #[arg(long)]
    pub idle_after: Option<f64>,
    /// Most VMs awake at once over all cells: past it, the host's least
    /// recently used idle VMs are hibernated, whichever cell holds them
    /// (needs --idle-after). Default: no cap.
    #[arg(long)]
    pub max_live: Option<u32>,
    /// With --idle-after, start every VM on its first connection as a clone
    /// of the image's template (VM 0, booted at the start and saved)
    /// instead of booting it from the image. Off by default until the main
    /// job is measured with it (hypervisor/README.md, "Clone boot").
    #[arg(long)]
    pub clone_boot: bool,
}

/// The VM booted as the image's template when VMs start as clones.
pub const TEMPLATE_VM: u32 = 0;

/// Whether VMs created asleep start as clones of the template
/// ([`TEMPLATE_VM`]): with hibernation and `--clone-boot`.
pub fn clone_boot(args: &ServeArgs) -> bool {
    args.idle_after.is_some() && args.clone_boot && args.vms > TEMPLATE_VM
}

/// Refuses hibernation flags that cannot work.
fn check_hibernation(args: &ServeArgs) -> Result<(), ConfigError> {
    if let Some(idle) = args.idle_after {
        if !(idle.is_finite() && (0.1..=1e6).contains(&idle)) {
            return Err(ConfigError(format!(
                "--idle-after {idle}: give seconds from 0.1 to 1000000"
            )));
        }
        if args.vcpu_stats {
            return Err(ConfigError(
                "--vcpu-stats cannot follow a VM through hibernation: drop one of it and --idle-after".into(),
            ));
        }
    }
    if args.clone_boot && args.idle_after.is_none() {
        return Err(ConfigError(
            "--clone-boot needs --idle-after (only VMs created asleep start as clones)".into(),
        ));
    }
    match args.max_live {
        Some(_) if args.idle_after.is_none() => Err(ConfigError(
            "--max-live needs --idle-after (VMs are hibernated only when idle)".into(),
        )),
        Some(0) => Err(ConfigError("--max-live must be at least 1".into())),
        _ => Ok(()),
    }
}

/// A configuration or set-up error: one line, exit code 2.
#[derive(Debug)]
pub struct ConfigError(pub String);

/// What every cell runs with: the flags' values a cell needs, derived and
/// checked once by the parent and sent to each cell in its configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CellSettings {
    /// Where the cell's threads run.
    pub placement: CellPlacement,
    /// The guest image, which the parent loaded and laid out.
    pub guest: PathBuf,
    /// The RAM layout of every VM.
    pub layout: RamLayout,
    /// Descriptors a VM holds in each process of its cell.
    pub fds_per_vm: u64,
    /// Flags for every guest's boot info beyond the platform's
    /// (`FLAG_SELFCHECK` or 0).
    pub boot_flags: u32,
    /// Write one word in every Nth working-set page per request.
    pub ws_write_stride: u32,
    /// `--guest-arg`, passed to every guest in its boot info.
    pub guest_arg: u64,
    /// Address of VM 0; VM i listens on this plus i.
    pub addr_base: Ipv4Addr,
    /// TCP port of every VM.
    pub port: u16,
    /// Per-VM halt polling, if set.
    pub halt_poll_ns: Option<u64>,
    /// Threads a holder builds VMs on.
    pub boot_threads: u32,
    /// Open each vCPU's KVM statistics (one more fd per VM).
    pub vcpu_stats: bool,
    /// A VM not up after this long is stopped as a boot failure.
    pub boot_timeout: Duration,
    /// Busy work per served request (`--inject-request-us`).
    pub inject_request: Duration,
    /// Hibernation of idle VMs, if on.
    pub hibernation: Option<Hibernation>,
}

/// When cells hibernate their VMs (`--idle-after`, `--max-live`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Hibernation {
    /// A VM without a connection idle this long is hibernated.
    pub idle_after: Duration,
    /// Most VMs awake at once over all cells (`--max-live`).
    pub max_live: Option<u32>,
    /// Cells at boot, over which `max_live` is shared out.
    pub cells: u32,
    /// VMs created asleep start as clones of the template ([`clone_boot`]).
    pub clone_boot: bool,
}

impl Hibernation {
    /// VMs of a cell of `capacity` that may hold descriptors: with
    /// hibernation only awake VMs do (a sleeping one has no eventfd), and
    /// under a cap one cell may hold all the awake VMs of the host; the cap
    /// is soft (a wake storm goes past it for a while), and the headroom
    /// covers that.
    pub fn vms_with_fds(&self, capacity: u32) -> u32 {
        self.max_live.map_or(capacity, |live| live.min(capacity))
    }

    /// Cell `cell`'s share of `--max-live`, its cap until the parent's first
    /// cut: an even split over the cells at boot, the remainder to the
    /// first ones; a cell started later by `create` gets an even share too.
    /// At least one VM per cell.
    pub fn cell_max_live(&self, cell: u32) -> Option<u32> {
        let total = self.max_live?;
        let cells = self.cells.max(1);
        let extra = u32::from(cell < total % cells);
        Some((total / cells + extra).max(1))
    }

    /// What cell `cell` keeps awake whatever the other cells report: a
    /// quarter of its share (at least one). The rest of the cap goes to
    /// the host's most recently used VMs, whichever cell holds them
    /// (`link::idle_profile`); a cell that lies about its VMs can take at
    /// most that rest from the others.
    pub fn cell_floor(&self, cell: u32) -> u32 {
        self.cell_max_live(cell)
            .map_or(0, |share| (share / 4).max(1))
    }
}

impl CellSettings {
    /// The address VM `id` serves on.
    pub fn addr_of(&self, id: u32) -> std::net::SocketAddrV4 {
        std::net::SocketAddrV4::new(vm_addr(self.addr_base, id), self.port)
    }
}

/// VM `id`'s IP address, VM 0's being `addr_base`.
pub fn vm_addr(addr_base: Ipv4Addr, id: u32) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(addr_base).wrapping_add(id))
}

/// What the cells run with, from checked flags and the guest's layout.
pub fn cell_settings(args: &ServeArgs, guest: PathBuf, layout: RamLayout) -> CellSettings {
    CellSettings {
        placement: args.cell_placement,
        guest,
        layout,
        fds_per_vm: fds_per_vm(args),
        boot_flags: if args.selfcheck {
            abi::FLAG_SELFCHECK
        } else {
            0
        },
        ws_write_stride: args.ws_write_stride,
        guest_arg: args.guest_arg,
        addr_base: args.addr_base,
        port: args.port,
        halt_poll_ns: args.halt_poll_ns,
        boot_threads: args.boot_threads,
        vcpu_stats: args.vcpu_stats,
        boot_timeout: Duration::from_secs(args.boot_timeout),
        inject_request: Duration::from_micros(args.inject_request_us),
        hibernation: None,
    }
}

/// Hibernation as the flags ask for it, for `cells` cells at boot.
pub fn cell_hibernation(args: &ServeArgs, cells: u32) -> Option<Hibernation> {
    Some(Hibernation {
        idle_after: Duration::from_secs_f64(args.idle_after?),
        max_live: args.max_live,
        cells,
        clone_boot: clone_boot(args),
    })
}

/// A process's descriptor limit cannot cover its VMs.
#[derive(Debug, thiserror::Error)]
#[error(
    "{count} x {fds_each} file descriptors need about {needed} but RLIMIT_NOFILE allows {allowed}"
)]
pub struct FdShortage {
    /// Holders of descriptors (VMs or cells).
    pub count: u32,
    /// Descriptors each holds.
    pub fds_each: u64,
    /// Descriptors needed, with the headroom.
    pub needed: u64,
    /// The hard limit.
    pub allowed: u64,
}

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
pub fn ensure_fd_budget(count: u32, fds_each: u64) -> Result<(), FdShortage> {
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
        return Err(FdShortage {
            count,
            fds_each,
            needed,
            allowed: limit.rlim_max,
        });
    }
    Ok(())
}

/// VM ids stay below this (the pager's limit).
pub const MAX_VM_ID: u32 = paging_policy::pager::MAX_VM_ID;
/// Tasks (processes and threads) left to the rest of the host.
pub const TASK_HEADROOM: u64 = 2048;
/// Tasks a cell's front takes besides its VMs (main thread, boot threads).
pub const TASKS_PER_CELL: u64 = 4;
/// Tasks a live VM takes: its vCPU thread, and the worker thread KVM gives
/// every VM (`kvm-nx-lpage-recovery`, made even with `nx_huge_pages` off).
/// Counting the vCPU thread alone, 100,000 VMs with 10,000 live passed the
/// check and then ran out of pids: 7,992 wakes failed to spawn a thread
/// (docs/measurements/2026-12-08.md).
pub const TASKS_PER_LIVE_VM: u64 = 2;
/// Tasks a holder takes besides its VMs': its two threads, and the KVM
/// worker thread of its pooled empty VM (with hibernation).
pub const TASKS_PER_HOLDER: u64 = 3;
/// VMs a holder owns by default. Smaller holders make each notifier walk
/// cheaper and cost a process each (docs/host-facts.md, "Address spaces and
/// MMU notifiers"; hypervisor/README.md, "Host memory per VM").
pub const HOLDER_VMS: u32 = 8;
/// Most holders a cell forks: its hello to the parent carries two
/// descriptors a holder, and SCM_RIGHTS carries at most 253.
pub const MAX_HOLDERS: u32 = 120;

/// VMs per holder in a cell that can hold `capacity`.
pub fn holder_vms(capacity: u32) -> u32 {
    capacity.div_ceil(MAX_HOLDERS).max(HOLDER_VMS)
}
/// Descriptors the parent holds per cell (its link, slack) and per holder
/// (the holder's userfaultfd and guest-RAM memfd, in the pager, and a
/// restarted holder's new userfaultfd until it replaces the old one).
const PARENT_FDS_PER_CELL: u64 = 2;
const PARENT_FDS_PER_HOLDER: u64 = 3;

/// The most VMs one densevm may hold at once with cells of `cell_vms` and
/// at most `live` of them live (`--max-live`; else all): each live one
/// takes [`TASKS_PER_LIVE_VM`], and every VM's cell and holder their share of tasks,
/// within the lowest of `kernel.pid_max`, `kernel.threads-max` and
/// RLIMIT_NPROC (less [`TASK_HEADROOM`]); the parent holds two descriptors
/// per holder and two per cell within RLIMIT_NOFILE; and ids stay below
/// [`MAX_VM_ID`]. Returns the maximum and what bounds it, in words.
pub fn max_vms(cell_vms: u32, live: Option<u32>) -> (u32, String) {
    let read = |path: &str| {
        std::fs::read_to_string(path)
            .ok()
            .and_then(|t| t.trim().parse::<u64>().ok())
    };
    let rlimit = |resource| {
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes the struct given.
        let rc = unsafe { libc::getrlimit(resource, &mut limit) };
        (rc == 0 && limit.rlim_cur != libc::RLIM_INFINITY).then_some(limit.rlim_cur)
    };
    let mut tasks = (u64::MAX, "");
    for (limit, name) in [
        (read("/proc/sys/kernel/pid_max"), "kernel.pid_max"),
        (read("/proc/sys/kernel/threads-max"), "kernel.threads-max"),
        (rlimit(libc::RLIMIT_NPROC), "RLIMIT_NPROC"),
    ] {
        if let Some(limit) = limit.filter(|&l| l < tasks.0) {
            tasks = (limit, name);
        }
    }
    let per_cell = cell_vms.max(1) as u64;
    let holders = per_cell.div_ceil(holder_vms(cell_vms.max(1)) as u64);
    let cell_tasks = holders * TASKS_PER_HOLDER + TASKS_PER_CELL;
    let by_tasks = match live {
        Some(live) => {
            tasks
                .0
                .saturating_sub(TASK_HEADROOM + live as u64 * TASKS_PER_LIVE_VM)
                / cell_tasks
                * per_cell
        }
        None => {
            tasks.0.saturating_sub(TASK_HEADROOM) / (cell_tasks + per_cell * TASKS_PER_LIVE_VM)
                * per_cell
        }
    };
    // ensure_fd_budget raises the soft limit to the hard one.
    let mut nofile = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct given.
    unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut nofile) };
    let cell_fds = holders * PARENT_FDS_PER_HOLDER + PARENT_FDS_PER_CELL;
    let by_fds = nofile.rlim_max.saturating_sub(FD_HEADROOM) / cell_fds * per_cell;
    let mut max = (MAX_VM_ID as u64, format!("VM ids below {MAX_VM_ID}"));
    if by_tasks < max.0 {
        max = (by_tasks, format!("{} {}", tasks.1, tasks.0));
    }
    if by_fds < max.0 {
        max = (by_fds, format!("RLIMIT_NOFILE {}", nofile.rlim_max));
    }
    (max.0 as u32, max.1)
}

/// Refuses `--vms` past [`max_vms`] for cells of `cell_vms` and `live`
/// VMs live at most.
pub fn check_max_vms(vms: u32, cell_vms: u32, live: Option<u32>) -> Result<u32, ConfigError> {
    let (max, bound) = max_vms(cell_vms, live);
    if vms > max {
        return Err(ConfigError(format!(
            "--vms {vms} is more than this host allows with --cell-vms {cell_vms}: at most {max} ({bound})"
        )));
    }
    Ok(max)
}

/// The guest image's path and the RAM layout of every VM: the image is
/// loaded to check it and to lay its bss out.
pub fn load_guest(args: &ServeArgs) -> Result<(PathBuf, RamLayout), ConfigError> {
    let guest = args.guest.clone().unwrap_or_else(default_guest);
    let image = loader::load(&guest).map_err(|e| ConfigError(e.to_string()))?;
    let layout = lay_out(args, image.bss_end, image.rx_buffers)?;
    Ok((guest, layout))
}

/// The RAM layout of a guest whose bss ends at `bss_end` (its connection
/// buffers at `rx_buffers`), with `--guest-mem` and `--ws`.
fn lay_out(args: &ServeArgs, bss_end: u64, rx_buffers: u64) -> Result<RamLayout, ConfigError> {
    let ws = size("--ws", &args.ws)?;
    let guest_mem = size("--guest-mem", &args.guest_mem)?;
    RamLayout::new(guest_mem, bss_end, rx_buffers, ws).ok_or_else(|| {
        ConfigError(format!(
            "--guest-mem {} cannot hold the guest ({} KiB of bss), a {} KiB working set and its stack: needs at least {} KiB",
            args.guest_mem,
            bss_end / 1024,
            ws / 1024,
            RamLayout::min_ram_bytes(bss_end, ws) / 1024
        ))
    })
}

/// The swap is sized for `--vms` times this many VMs ...
pub const SWAP_VMS_TIMES: u32 = 2;
/// ... or `--vms` plus this many, whichever is more.
pub const SWAP_VMS_PLUS: u32 = 64;

/// The VMs the swap is sized for: room for VMs created later through the
/// API, too.
pub fn vms_with_headroom(vms: u32) -> u32 {
    vms.saturating_mul(SWAP_VMS_TIMES)
        .max(vms.saturating_add(SWAP_VMS_PLUS))
}

fn size(flag: &str, text: &str) -> Result<u64, ConfigError> {
    parse_size(text).map_err(|e| ConfigError(format!("{flag}: {e}")))
}

/// Refuses flags that cannot work together, or a VM count the host's
/// memory cannot hold.
pub fn check_flags(args: &ServeArgs) -> Result<(), ConfigError> {
    check_flags_against(args, mem_available())
}

/// [`check_flags`] on a host with `available` bytes of MemAvailable
/// (`None`: unknown, not checked).
fn check_flags_against(args: &ServeArgs, available: Option<u64>) -> Result<(), ConfigError> {
    if args.vms == 0 {
        return Err(ConfigError("--vms must be at least 1".into()));
    }
    if args.cell_vms == Some(0) {
        return Err(ConfigError("--cell-vms must be at least 1".into()));
    }
    if args.ws_write_stride == 0 {
        return Err(ConfigError("--ws-write-stride must be at least 1".into()));
    }
    check_hibernation(args)?;
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
    // Under --max-live only that many VMs are ever live at once.
    let live = args.max_live.unwrap_or(args.vms).min(args.vms) as u64;
    let needed = live * KERNEL_BYTES_PER_VM + (args.vms as u64 - live) * ASLEEP_BYTES_PER_VM;
    match available {
        Some(available) if needed > available => Err(ConfigError(format!(
            "--vms {} needs about {:.1} GiB of kernel memory ({} KiB a live VM, {} KiB a hibernated one) but {:.1} GiB is available",
            args.vms,
            needed as f64 / GIB,
            KERNEL_BYTES_PER_VM >> 10,
            ASLEEP_BYTES_PER_VM >> 10,
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
        // VMs created asleep commit no swap until they run.
        swap_on_first_fault: args.idle_after.is_some(),
        compact_swap: args.idle_after.is_some(),
        clone_template: clone_boot(args).then_some(TEMPLATE_VM),
        wake_first: Some(layout.resume_stack_offset()),
    };
    config
        .validate(layout.ram_bytes, layout.request_footprint())
        .map_err(|e| ConfigError(e.to_string()))?;
    Ok(config)
}

/// Most VMs a cell holds: `--cell-vms`, or the default for the regime the
/// flags put the VMs in, raised where the host's limits need larger cells.
pub fn cell_vms(args: &ServeArgs, layout: &RamLayout, pager: &PagerConfig) -> u32 {
    args.cell_vms.unwrap_or_else(|| {
        let regime = default_cell_vms(
            args.vms,
            layout.request_blocks_bytes(pager.block_bytes),
            pager.budget_bytes,
        );
        cells_that_fit(args.vms, regime, args.max_live, |cell_vms, live| {
            max_vms(cell_vms, live).0
        })
    })
}

/// The smallest cell size from `regime` up to `vms` whose cells the host's
/// limits allow (`allowed(cell_vms, live)`, [`max_vms`]), or `regime` when
/// none does (the start then names the bound). Each cell costs tasks and
/// descriptors, so at 100,000 VMs asleep cells of 100 would need 1,000
/// processes and 41,000 descriptors in the parent; larger cells hold more
/// of them within the same limits (hypervisor/README.md, "Choosing
/// --cell-vms").
pub fn cells_that_fit(
    vms: u32,
    regime: u32,
    live: Option<u32>,
    allowed: impl Fn(u32, Option<u32>) -> u32,
) -> u32 {
    let fits = |cell_vms: u32| allowed(cell_vms, live) >= vms;
    if fits(regime) || !fits(vms.max(regime)) {
        return regime;
    }
    // Larger cells fit more VMs (fewer cells, each with at most
    // MAX_HOLDERS holders): the smallest that fits, by bisection.
    let (mut low, mut high) = (regime, vms.max(regime));
    while high - low > 1 {
        let mid = low + (high - low) / 2;
        if fits(mid) {
            high = mid;
        } else {
            low = mid;
        }
    }
    high
}

/// Most VMs a cell holds by default while every VM's working set fits in the
/// budget: in core, the cost is the cells' event loops waking, and fewer,
/// larger loops a core wake less (docs/host-facts.md, "The in-core path at
/// scale"; hypervisor/README.md, "Choosing --cell-vms").
pub const IN_CORE_CELL_VMS: u32 = 500;
/// Most VMs a cell holds by default when they page: smaller cells faulted
/// faster while a cell's VMs shared one address space, and with holders the
/// size no longer matters much (docs/host-facts.md, "Address spaces and MMU
/// notifiers"; hypervisor/README.md, "Choosing --cell-vms").
pub const PAGING_CELL_VMS: u32 = 100;

/// The default of `--cell-vms`: whether `vms` VMs, each holding
/// `resident_bytes` once it has served requests, fit in `budget_bytes`.
pub fn default_cell_vms(vms: u32, resident_bytes: u64, budget_bytes: u64) -> u32 {
    if u64::from(vms).saturating_mul(resident_bytes) <= budget_bytes {
        IN_CORE_CELL_VMS
    } else {
        PAGING_CELL_VMS
    }
}

/// How many VMs each cell boots with, in ID order: `vms` spread evenly over
/// the fewest cells that hold at most `cell_vms` each. Pinned cells go round
/// robin over `pinned_cpus` CPUs, so their number is rounded up to a multiple
/// of it (at most one cell per VM): every CPU then serves as many VMs, and an
/// uneven split would leave one core with twice the load of another.
pub fn boot_layout(vms: u32, cell_vms: u32, pinned_cpus: Option<usize>) -> Vec<u32> {
    let cpus = u32::try_from(pinned_cpus.unwrap_or(1).max(1)).unwrap_or(u32::MAX);
    let cells = vms
        .div_ceil(cell_vms.max(1))
        .div_ceil(cpus)
        .saturating_mul(cpus)
        .min(vms);
    (0..cells)
        .map(|i| vms / cells + u32::from(i < vms % cells))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    /// `densevm serve`'s flags alone, as clap parses them.
    #[derive(Parser)]
    struct Serve {
        #[command(flatten)]
        args: ServeArgs,
    }

    fn parse(flags: &[&str]) -> ServeArgs {
        Serve::try_parse_from(std::iter::once("serve").chain(flags.iter().copied()))
            .expect("flags parse")
            .args
    }

    /// The refusal of `check_flags` on a host with plenty of memory.
    fn refusal(flags: &[&str]) -> String {
        check_flags_against(&parse(flags), Some(u64::MAX))
            .expect_err("refused")
            .0
    }

    fn accepted(flags: &[&str]) -> bool {
        check_flags_against(&parse(flags), Some(u64::MAX)).is_ok()
    }

    #[test]
    fn holders_are_small_until_a_cell_needs_too_many() {
        assert_eq!(holder_vms(8), HOLDER_VMS);
        assert_eq!(holder_vms(500), HOLDER_VMS);
        let big = holder_vms(10_000);
        assert!(big > HOLDER_VMS);
        assert!(10_000u32.div_ceil(big) <= MAX_HOLDERS);
    }

    /// The parent's descriptors are counted for the holders a cell really
    /// forks: large cells have fewer, larger holders, and so room for more VMs.
    #[test]
    fn max_vms_counts_the_holders_a_cell_forks() {
        let (small, _) = max_vms(960, Some(1000));
        let (large, _) = max_vms(8000, Some(1000));
        // Both 120 holders: the larger cell's VMs cost the parent no more.
        assert!(large > small || small == MAX_VM_ID, "{large} <= {small}");
    }

    #[test]
    fn vms_past_the_hosts_maximum_are_refused_with_what_bounds_them() {
        let (max, bound) = max_vms(100, None);
        assert!((1..=MAX_VM_ID).contains(&max), "{max} ({bound})");
        assert!(check_max_vms(max, 100, None).is_ok());
        let refused = check_max_vms(u32::MAX, 100, None).unwrap_err().0;
        assert!(refused.contains(&format!("at most {max}")), "{refused}");
        // Smaller cells take more tasks a VM: never a larger maximum.
        assert!(max_vms(1, None).0 <= max);
        // With few VMs live at once, vCPU threads no longer bound the count.
        assert!(max_vms(100, Some(1000)).0 > max);
    }

    #[test]
    fn the_defaults_are_accepted() {
        assert!(accepted(&[]));
    }

    #[test]
    fn counts_of_zero_are_refused_and_one_is_accepted() {
        assert_eq!(refusal(&["--vms", "0"]), "--vms must be at least 1");
        assert_eq!(
            refusal(&["--cell-vms", "0"]),
            "--cell-vms must be at least 1"
        );
        assert_eq!(
            refusal(&["--ws-write-stride", "0"]),
            "--ws-write-stride must be at least 1"
        );
        assert!(accepted(&[
            "--vms",
            "1",
            "--cell-vms",
            "1",
            "--ws-write-stride",
            "1"
        ]));
    }

    #[test]
    fn sizes_that_do_not_parse_are_refused_with_their_flag() {
        assert!(refusal(&["--ws", "lots"]).starts_with("--ws: "));
        assert!(refusal(&["--guest-mem", "4Q"]).starts_with("--guest-mem: "));
    }

    #[test]
    fn memory_sizes_are_whole_pages() {
        let message = "--ws and --guest-mem must be multiples of 4 KiB";
        assert_eq!(refusal(&["--ws", "4097"]), message);
        assert_eq!(refusal(&["--guest-mem", "6k"]), message);
        assert!(accepted(&["--ws", "0", "--guest-mem", "8k"]));
    }

    #[test]
    fn guest_memory_is_at_most_one_gib() {
        assert_eq!(
            refusal(&["--guest-mem", "1025M"]),
            "--guest-mem is at most 1G"
        );
        assert!(accepted(&["--guest-mem", "1G"]));
    }

    #[test]
    fn every_vm_address_stays_on_the_loopback() {
        assert_eq!(
            refusal(&["--addr-base", "10.0.0.1", "--vms", "1"]),
            "--addr-base 10.0.0.1 + 1 VMs leaves 127.0.0.0/8"
        );
        assert_eq!(
            refusal(&["--addr-base", "127.255.255.255", "--vms", "2"]),
            "--addr-base 127.255.255.255 + 2 VMs leaves 127.0.0.0/8"
        );
        // Past 255.255.255.255 the address does not wrap around.
        assert_eq!(
            refusal(&["--addr-base", "255.255.255.255", "--vms", "2"]),
            "--addr-base 255.255.255.255 + 2 VMs leaves 127.0.0.0/8"
        );
        assert!(accepted(&["--addr-base", "127.255.255.255", "--vms", "1"]));
        assert!(accepted(&["--addr-base", "127.0.0.0", "--vms", "16777216"]));
    }

    #[test]
    fn a_vm_count_the_hosts_memory_cannot_hold_is_refused() {
        let args = parse(&["--vms", "1024"]);
        let needed = 1024 * KERNEL_BYTES_PER_VM;
        let ConfigError(message) = check_flags_against(&args, Some(needed - 1)).unwrap_err();
        assert_eq!(
            message,
            format!("--vms 1024 needs about 0.6 GiB of kernel memory (600 KiB a live VM, {} KiB a hibernated one) but 0.6 GiB is available", ASLEEP_BYTES_PER_VM >> 10)
        );
        assert!(check_flags_against(&args, Some(needed)).is_ok());
        assert!(check_flags_against(&args, None).is_ok());
        // At most 24 of them live: the others cost what a hibernated VM does.
        let capped = parse(&["--vms", "1024", "--idle-after", "1", "--max-live", "24"]);
        let needed = 24 * KERNEL_BYTES_PER_VM + 1000 * ASLEEP_BYTES_PER_VM;
        assert!(check_flags_against(&capped, Some(needed - 1)).is_err());
        assert!(check_flags_against(&capped, Some(needed)).is_ok());
    }

    #[test]
    fn flags_of_the_wrong_type_are_refused_by_the_parser() {
        for flags in [
            &["--vms", "-1"][..],
            &["--port", "65536"],
            &["--addr-base", "localhost"],
            &["--cell-placement", "anywhere"],
            &["--boot-timeout", "soon"],
        ] {
            let parsed =
                Serve::try_parse_from(std::iter::once("serve").chain(flags.iter().copied()));
            assert!(parsed.is_err(), "{flags:?} parsed");
        }
    }

    /// A guest with 64 KiB of bss whose connection buffers start at 32 KiB.
    const BSS_END: u64 = 64 << 10;
    const RX_BUFFERS: u64 = 32 << 10;

    #[test]
    fn the_guest_memory_must_hold_bss_working_set_and_stack() {
        let refused = lay_out(
            &parse(&["--guest-mem", "1M", "--ws", "1M"]),
            BSS_END,
            RX_BUFFERS,
        )
        .unwrap_err();
        assert_eq!(
            refused.0,
            "--guest-mem 1M cannot hold the guest (64 KiB of bss), a 1024 KiB working set and its stack: needs at least 1120 KiB"
        );
        // Exactly the minimum fits.
        let layout = lay_out(
            &parse(&["--guest-mem", "1120k", "--ws", "1M"]),
            BSS_END,
            RX_BUFFERS,
        )
        .unwrap();
        assert_eq!((layout.ram_bytes, layout.ws_offset), (1120 << 10, BSS_END));
        assert!(lay_out(&parse(&["--ws", "1x"]), BSS_END, RX_BUFFERS)
            .unwrap_err()
            .0
            .starts_with("--ws: "));
    }

    #[test]
    fn a_guest_image_that_cannot_be_read_is_refused() {
        let ConfigError(message) =
            load_guest(&parse(&["--guest", "/nonexistent/webguest.elf"])).unwrap_err();
        assert!(message.contains("/nonexistent/webguest.elf"), "{message}");
    }

    fn layout() -> RamLayout {
        lay_out(&parse(&[]), BSS_END, RX_BUFFERS).unwrap()
    }

    /// `pager_config` with `flags`, its swap file in a fresh temporary path.
    fn pager(flags: &[&str]) -> Result<PagerConfig, ConfigError> {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let swap =
            std::env::temp_dir().join(format!("densevm-config-{}-{n}.img", std::process::id()));
        let swap = swap.to_str().expect("a UTF-8 temporary path").to_string();
        let mut all = vec!["--swap", &swap];
        all.extend_from_slice(flags);
        let config = pager_config(&parse(&all), &layout());
        let _ = std::fs::remove_file(&swap);
        config
    }

    #[test]
    fn the_pager_flags_are_parsed_once_and_checked_against_the_layout() {
        let config = pager(&["--mem", "64M", "--block", "64k", "--vm-resident-max", "2M"]).unwrap();
        assert_eq!(config.budget_bytes, 64 << 20);
        assert_eq!(config.block_bytes, 64 << 10);
        assert_eq!(config.vm_resident_max, Some(2 << 20));
        for (flag, value) in [
            ("--mem", "big"),
            ("--block", "huge"),
            ("--swap-size", "x"),
            ("--vm-resident-max", "?"),
        ] {
            let ConfigError(message) = pager(&[flag, value]).unwrap_err();
            assert!(message.starts_with(&format!("{flag}: ")), "{message}");
        }
        assert!(pager(&["--policy", "no-such-policy"]).is_err());
        assert!(pager(&["--disk", "floppy"]).is_err());
        // The pager's own checks: a block that is not a power of two, a
        // budget below one request's blocks, a swap smaller than a VM.
        assert!(pager(&["--block", "48k"]).is_err());
        assert!(pager(&["--mem", "64k"]).is_err());
        assert!(pager(&["--swap-size", "1M"]).is_err());
    }

    #[test]
    fn a_descriptor_limit_too_low_for_the_vms_is_refused() {
        let shortage = ensure_fd_budget(u32::MAX, 1 << 20).unwrap_err();
        assert_eq!(shortage.count, u32::MAX);
        assert!(shortage.to_string().contains("RLIMIT_NOFILE allows"));
        assert!(ensure_fd_budget(1, 1).is_ok());
    }

    #[test]
    fn cells_get_the_flags_values_they_need() {
        let args = parse(&[
            "--selfcheck",
            "--boot-timeout",
            "7",
            "--inject-request-us",
            "3",
            "--addr-base",
            "127.9.0.250",
            "--port",
            "81",
        ]);
        let settings = cell_settings(&args, PathBuf::from("g.elf"), layout());
        assert_eq!(settings.boot_flags, abi::FLAG_SELFCHECK);
        assert_eq!(settings.boot_timeout, Duration::from_secs(7));
        assert_eq!(settings.inject_request, Duration::from_micros(3));
        assert_eq!(settings.addr_of(10).to_string(), "127.9.1.4:81");
        let line = serde_json::to_string(&settings).unwrap();
        assert_eq!(
            serde_json::from_str::<CellSettings>(&line).unwrap(),
            settings
        );
    }

    #[test]
    fn cells_are_large_while_the_working_sets_fit_and_small_once_they_page() {
        let mib = 1 << 20;
        assert_eq!(default_cell_vms(1024, mib, 1 << 30), IN_CORE_CELL_VMS);
        assert_eq!(default_cell_vms(1025, mib, 1 << 30), PAGING_CELL_VMS);
        assert_eq!(
            default_cell_vms(u32::MAX, u64::MAX, 1 << 30),
            PAGING_CELL_VMS
        );
    }

    #[test]
    fn default_cells_grow_only_as_far_as_the_host_limits_need() {
        // A host that allows 10 cells, whatever their size.
        let ten_cells = |cell_vms: u32, _live: Option<u32>| cell_vms * 10;
        assert_eq!(cells_that_fit(900, 100, Some(50), ten_cells), 100);
        assert_eq!(cells_that_fit(100_000, 100, Some(50), ten_cells), 10_000);
        assert_eq!(cells_that_fit(100_001, 100, Some(50), ten_cells), 10_001);
        // Nothing fits: the regime's size, refused at the start with its bound.
        assert_eq!(cells_that_fit(5_000, 100, None, |_, _| 10), 100);
        // The live cap is what the limits are asked about.
        let by_live = |cell_vms: u32, live: Option<u32>| {
            if live == Some(10) {
                cell_vms * 100
            } else {
                cell_vms
            }
        };
        assert_eq!(cells_that_fit(20_000, 100, Some(10), by_live), 200);
    }

    #[test]
    fn vms_spread_evenly_over_the_fewest_cells_that_fit() {
        assert_eq!(boot_layout(10, 3, None), [3, 3, 2, 2]);
        assert_eq!(boot_layout(4000, 500, None), [500; 8]);
        assert_eq!(boot_layout(750, 500, None), [375, 375]);
        assert_eq!(boot_layout(7, 100, None), [7]);
    }

    #[test]
    fn pinned_cells_give_every_cpu_the_same_share() {
        assert_eq!(boot_layout(1100, 500, Some(2)), [275; 4]);
        assert_eq!(boot_layout(250, 500, Some(2)), [125, 125]);
        assert_eq!(boot_layout(4000, 500, Some(2)), [500; 8]);
        assert_eq!(boot_layout(10, 3, Some(3)), [2, 2, 2, 2, 1, 1]);
        // Never an empty cell, and nothing changes on one CPU.
        assert_eq!(boot_layout(1, 500, Some(2)), [1]);
        assert_eq!(boot_layout(10, 3, Some(1)), boot_layout(10, 3, None));
    }
}
