//! `densevm serve`: validate the configuration, boot the VMs, run the
//! monitor until a signal, tear everything down.

use crate::boot::RamLayout;
use crate::loader;
use paging_policy::trace::{TraceHeader, TraceWriter};
use paging_policy::{parse_size, Pager, PagerConfig};
use crate::memory::Arena;
use crate::monitor::{Exit, Monitor, MonitorSetup};
use crate::platform;
use crate::vm::{self, BuildContext, MicroVm, DOORBELL_GROUP};
use crate::vstate::vm::VmCaps;
use clap::Args;
use kvm_ioctls::Kvm;
use serde_json::json;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

/// File descriptors each VM holds: VM, vCPU, irqfd, listener.
const FDS_PER_VM: u64 = 4;
/// Descriptors kept free for connections, the API and the pager.
const FD_HEADROOM: u64 = 1024;
const KVM_MAX_CPUID_ENTRIES: usize = 256;
/// Longest orderly teardown before the process just exits.
const TEARDOWN_GRACE: Duration = Duration::from_secs(30);

/// Flags of `densevm serve`.
#[derive(Args, Debug)]
pub struct ServeArgs {
    /// Number of VMs to boot.
    #[arg(long, default_value_t = 16)]
    pub vms: u32,
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
    #[arg(long, default_value_t = 4)]
    pub ws_write_stride: u32,
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
    /// Give up if the VMs are not all up after this many seconds.
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
    /// Threads that create VMs at boot.
    #[arg(long, default_value_t = 2)]
    pub boot_threads: u32,
}

/// A configuration or set-up error: one line, exit code 2.
#[derive(Debug)]
struct ConfigError(String);

fn default_guest() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(|dir| dir.join("webguest.elf")))
        .unwrap_or_else(|| PathBuf::from("webguest.elf"))
}

/// Raises the soft fd limit to the hard one; checks it covers `vms` VMs.
fn ensure_fd_budget(vms: u32, fds_per_vm: u64) -> Result<(), ConfigError> {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: plain getrlimit/setrlimit on our own process.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit);
        limit.rlim_cur = limit.rlim_max;
        libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
    }
    let needed = vms as u64 * fds_per_vm + FD_HEADROOM;
    if needed > limit.rlim_max {
        let most = (limit.rlim_max.saturating_sub(FD_HEADROOM)) / fds_per_vm;
        return Err(ConfigError(format!(
            "--vms {vms} needs about {needed} file descriptors but RLIMIT_NOFILE allows {} (at most {most} VMs here)",
            limit.rlim_max
        )));
    }
    Ok(())
}

struct Prepared {
    ctx: BuildContext,
    api: std::os::unix::net::UnixListener,
    api_path: PathBuf,
    crashed: Arc<Mutex<Vec<u32>>>,
    waker_slot: Arc<Mutex<Option<Arc<mio::Waker>>>>,
    pager: Arc<Pager>,
    trace: Option<TraceWriter>,
}

fn prepare(args: &ServeArgs) -> Result<Prepared, ConfigError> {
    if args.vms == 0 {
        return Err(ConfigError("--vms must be at least 1".into()));
    }
    if args.ws_write_stride == 0 {
        return Err(ConfigError("--ws-write-stride must be at least 1".into()));
    }
    let size = |flag: &str, text: &str| parse_size(text).map_err(|e| ConfigError(format!("{flag}: {e}")));
    let ws = size("--ws", &args.ws)?;
    let guest_mem = size("--guest-mem", &args.guest_mem)?;
    if ws % 4096 != 0 || guest_mem % 4096 != 0 {
        return Err(ConfigError("--ws and --guest-mem must be multiples of 4 KiB".into()));
    }
    if guest_mem > 1 << 30 {
        return Err(ConfigError("--guest-mem is at most 1G".into()));
    }
    let last = u32::from(args.addr_base).checked_add(args.vms - 1);
    match last.map(Ipv4Addr::from) {
        Some(addr) if addr.is_loopback() && args.addr_base.is_loopback() => {}
        _ => return Err(ConfigError(format!("--addr-base {} + {} VMs leaves 127.0.0.0/8", args.addr_base, args.vms))),
    }
    ensure_fd_budget(args.vms, FDS_PER_VM + args.vcpu_stats as u64)?;

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

    let pager_config = PagerConfig {
        budget_bytes: size("--mem", &args.mem)?,
        block_bytes: size("--block", &args.block)?,
        policy: args.policy.clone(),
        swap_path: args.swap.clone(),
        keep_swap: args.keep_swap,
        disk: args.disk.clone(),
        swap_bytes: args.swap_size.as_deref().map(|s| size("--swap-size", s)).transpose()?,
    };
    pager_config.validate(layout.ram_bytes, layout.request_footprint()).map_err(|e| ConfigError(e.to_string()))?;
    let trace = match &args.record_trace {
        Some(path) => {
            let header = TraceHeader {
                block_bytes: pager_config.block_bytes,
                vm_ram_bytes: layout.ram_bytes,
                vms: args.vms,
                request_ranges: layout.request_ranges(),
            };
            Some(TraceWriter::create(path, &header).map_err(|e| ConfigError(format!("--record-trace: {e}")))?)
        }
        None => None,
    };

    let kvm = Kvm::new().map_err(|e| ConfigError(format!("cannot open /dev/kvm: {e}")))?;
    let caps = VmCaps::probe(&kvm).map_err(ConfigError)?;
    let platform = platform::detect(&kvm).map_err(|e| ConfigError(format!("probe the host: {e}")))?;
    let cpuid = kvm.get_supported_cpuid(KVM_MAX_CPUID_ENTRIES).map_err(|e| ConfigError(format!("get supported CPUID: {e}")))?;

    let api_path = args.api.clone().unwrap_or_else(|| PathBuf::from(format!("densevm-{}.sock", std::process::id())));
    if api_path.exists() {
        if std::os::unix::net::UnixStream::connect(&api_path).is_ok() {
            return Err(ConfigError(format!("control socket {} is in use by another densevm", api_path.display())));
        }
        let _ = std::fs::remove_file(&api_path);
    }
    // Room in the swap for VMs created later through the API, too.
    let max_vms = args.vms.saturating_mul(2).max(args.vms + 64);
    let pager = Pager::new(pager_config, max_vms, layout.ram_bytes).map_err(|e| ConfigError(e.to_string()))?;
    let api = std::os::unix::net::UnixListener::bind(&api_path)
        .map_err(|e| ConfigError(format!("cannot bind control socket {}: {e}", api_path.display())))?;
    api.set_nonblocking(true).map_err(|e| ConfigError(format!("control socket: {e}")))?;

    let crashed = Arc::new(Mutex::new(Vec::new()));
    let waker_slot: Arc<Mutex<Option<Arc<mio::Waker>>>> = Arc::new(Mutex::new(None));
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
        kvm,
        caps,
        cpuid,
        platform,
        image,
        layout,
        extra_flags: if args.selfcheck { crate::abi::FLAG_SELFCHECK } else { 0 },
        ws_write_stride: args.ws_write_stride,
        addr_base: args.addr_base,
        port: args.port,
        halt_poll_ns: args.halt_poll_ns,
        on_exit,
        register_ram: {
            let pager = Arc::clone(&pager);
            Box::new(move |vm, ram| pager.register_vm(vm, ram.as_ptr(), ram.len()).map_err(|e| e.to_string()))
        },
        unregister_ram: {
            let pager = Arc::clone(&pager);
            Box::new(move |vm| pager.unregister_vm(vm))
        },
        sys_arena: Arena::new(crate::abi::SYS_BYTES as usize, vm::ARENA_CHUNK_VMS),
        ram_arena: Arena::new(layout.ram_bytes as usize, vm::ARENA_CHUNK_VMS),
        stack_arena: Arena::new(crate::vstate::vcpu::VCPU_STACK_BYTES, vm::ARENA_CHUNK_VMS),
        vcpu_stats: args.vcpu_stats,
    };
    Ok(Prepared { ctx, api, api_path, crashed, waker_slot, pager, trace })
}

/// Builds VMs `0..count` on `threads` threads, in index order.
fn build_all(ctx: &BuildContext, doorbells: &[EventFd], count: u32, threads: u32) -> Result<Vec<MicroVm>, String> {
    let threads = threads.clamp(1, 16);
    let mut kvms = Vec::with_capacity(count as usize);
    for id in 0..count {
        kvms.push(vm::create(ctx, id).map_err(|e| e.to_string())?);
    }
    let mut parts = Vec::with_capacity(count as usize);
    for (id, kvm) in (0..count).zip(kvms) {
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
                let id = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if id >= count {
                    return;
                }
                let prebuilt = parts[id as usize].lock().expect("prebuilt").take().expect("each VM built once");
                match vm::build(ctx, id, prebuilt, &doorbells[(id / DOORBELL_GROUP) as usize]) {
                    Ok(vm) => built.lock().expect("built")[id as usize] = Some(vm),
                    Err(e) => *failure.lock().expect("failure") = Some(e.to_string()),
                }
            });
        }
    });
    if let Some(error) = failure.into_inner().expect("failure") {
        return Err(error);
    }
    Ok(built.into_inner().expect("built").into_iter().map(|vm| vm.expect("every VM built")).collect())
}

/// Connects the monitor to the pager: reference bits and the request trace
/// as guests serve, the pager's stats in every stats reply, and its fatal
/// errors ending the run.
fn attach_pager(monitor: &mut Monitor, pager: &Arc<Pager>, mut trace: Option<TraceWriter>) {
    let noted = Arc::clone(pager);
    monitor.on_requests(Box::new(move |vm, requests| {
        noted.note_access(vm);
        if let Some(writer) = trace.as_mut() {
            for _ in 0..requests {
                if let Err(e) = writer.record(vm) {
                    eprintln!("densevm: error: trace: {e}; recording stops");
                    trace = None;
                    break;
                }
            }
        }
    }));
    let failed = Arc::clone(pager);
    monitor.fatal_check(Box::new(move || failed.fatal_error().map(|e| format!("pager: {e}"))));
    let disk = Arc::clone(pager);
    monitor.disk_control(Box::new(move |on| disk.set_disk_modeled(on)));
    let stats = Arc::clone(pager);
    monitor.extra_stats(Box::new(move |reply, per_vm| {
        let paging = if per_vm { stats.stats() } else { stats.totals() };
        if let (Some(totals), Some(ours)) = (paging.get("totals").and_then(|t| t.as_object()), reply.get_mut("totals")) {
            for (key, value) in totals {
                ours[key] = value.clone();
            }
        }
        if let (Some(per_vm), Some(vms)) = (paging.get("vms"), reply.get_mut("vms").and_then(|v| v.as_array_mut())) {
            for vm in vms {
                let id = vm["id"].to_string();
                if let Some(theirs) = per_vm.get(&id).and_then(|v| v.as_object()) {
                    for (key, value) in theirs {
                        vm[key] = value.clone();
                    }
                }
            }
        }
        reply["pager"] = paging.get("config").cloned().unwrap_or(paging["totals"].clone());
    }));
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
    let Prepared { ctx, api, api_path, crashed, waker_slot, pager, trace } = prepared;
    let fail = |message: String| {
        eprintln!("densevm: error: {message}");
        let _ = std::fs::remove_file(&api_path);
        pager.shutdown();
        1
    };
    let boot_started = Instant::now();
    let groups = args.vms.div_ceil(DOORBELL_GROUP);
    let doorbells: Result<Vec<EventFd>, _> = (0..groups).map(|_| EventFd::new(EFD_NONBLOCK)).collect();
    let doorbells = match doorbells {
        Ok(d) => d,
        Err(e) => return fail(format!("doorbell eventfds: {e}")),
    };
    let vms = match build_all(&ctx, &doorbells, args.vms, args.boot_threads) {
        Ok(vms) => vms,
        Err(e) => return fail(e),
    };
    let ready_line = json!({
        "api": api_path.display().to_string(),
        "platform": ctx.platform.name(),
        "pvm": ctx.platform.name() == "pvm",
        "addr_base": args.addr_base.to_string(),
        "port": args.port,
        "pid": std::process::id(),
    });
    let setup = MonitorSetup {
        ctx,
        doorbells,
        vms,
        api,
        api_path: api_path.clone(),
        crashed,
        boot_started,
        boot_timeout: Duration::from_secs(args.boot_timeout),
        ready_line,
    };
    let (mut monitor, waker) = match Monitor::new(setup) {
        Ok(m) => m,
        Err(e) => return fail(format!("event loop: {e}")),
    };
    attach_pager(&mut monitor, &pager, trace);
    *waker_slot.lock().expect("waker") = Some(waker);
    // A crash reported before the waker existed is still in the queue.
    let _ = waker_slot.lock().expect("waker").as_ref().map(|w| w.wake());
    match monitor.run() {
        Ok(Exit::Signal(signal)) => {
            // A vCPU blocked in a fault the pager can no longer serve would
            // hold the teardown forever; exiting releases everything anyway.
            std::thread::spawn(|| {
                std::thread::sleep(TEARDOWN_GRACE);
                eprintln!("densevm: teardown took over {} s; exiting with VMs still held", TEARDOWN_GRACE.as_secs());
                std::process::exit(1);
            });
            monitor.shutdown();
            pager.shutdown();
            println!("{}", json!({ "event": "exit", "reason": "signal", "signal": signal }));
            0
        }
        Err(message) => {
            // The run is broken (the pager failed, say): report first, then
            // leave without waiting for vCPUs that may never return.
            eprintln!("densevm: error: {message}");
            println!("{}", json!({ "event": "exit", "reason": "error", "error": message }));
            let _ = std::fs::remove_file(&api_path);
            pager.shutdown();
            std::process::exit(1);
        }
    }
}
