//! `densevm serve`: validate the configuration, boot the VMs, run the
//! monitor until a signal, tear everything down.

use crate::boot::RamLayout;
use crate::loader;
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

/// Parses sizes like 4096, 32k, 896K, 4M, 1G (binary units).
pub fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let (digits, unit) = t.split_at(t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len()));
    let base: u64 = digits.parse().map_err(|_| format!("'{text}' is not a size (e.g. 32k, 4M, 1G)"))?;
    let shift = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        _ => return Err(format!("'{text}' has an unknown unit (use k, M or G)")),
    };
    base.checked_mul(1 << shift).ok_or_else(|| format!("'{text}' is too large"))
}

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
}

fn prepare(args: &ServeArgs) -> Result<Prepared, ConfigError> {
    if args.vms == 0 {
        return Err(ConfigError("--vms must be at least 1".into()));
    }
    if args.ws_write_stride == 0 {
        return Err(ConfigError("--ws-write-stride must be at least 1".into()));
    }
    let ws = parse_size(&args.ws).map_err(|e| ConfigError(format!("--ws: {e}")))?;
    let guest_mem = parse_size(&args.guest_mem).map_err(|e| ConfigError(format!("--guest-mem: {e}")))?;
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
    let layout = RamLayout::new(guest_mem, image.bss_end, ws).ok_or_else(|| {
        ConfigError(format!(
            "--guest-mem {} cannot hold the guest ({} KiB of bss), a {} KiB working set and its stack: needs at least {} KiB",
            args.guest_mem,
            image.bss_end / 1024,
            ws / 1024,
            RamLayout::min_ram_bytes(image.bss_end, ws) / 1024
        ))
    })?;

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
        register_ram: Box::new(|_, _| Ok(())),
        unregister_ram: Box::new(|_| {}),
        sys_arena: Arena::new(crate::abi::SYS_BYTES as usize, vm::ARENA_CHUNK_VMS),
        ram_arena: Arena::new(layout.ram_bytes as usize, vm::ARENA_CHUNK_VMS),
        stack_arena: Arena::new(crate::vstate::vcpu::VCPU_STACK_BYTES, vm::ARENA_CHUNK_VMS),
        vcpu_stats: args.vcpu_stats,
    };
    Ok(Prepared { ctx, api, api_path, crashed, waker_slot })
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

/// Runs `densevm serve`; returns the exit code.
pub fn run(args: ServeArgs) -> i32 {
    let prepared = match prepare(&args) {
        Ok(p) => p,
        Err(ConfigError(message)) => {
            eprintln!("densevm: error: {message}");
            return 2;
        }
    };
    let Prepared { ctx, api, api_path, crashed, waker_slot } = prepared;
    let boot_started = Instant::now();
    let groups = args.vms.div_ceil(DOORBELL_GROUP);
    let doorbells: Result<Vec<EventFd>, _> = (0..groups).map(|_| EventFd::new(EFD_NONBLOCK)).collect();
    let doorbells = match doorbells {
        Ok(d) => d,
        Err(e) => {
            eprintln!("densevm: error: doorbell eventfds: {e}");
            let _ = std::fs::remove_file(&api_path);
            return 1;
        }
    };
    let vms = match build_all(&ctx, &doorbells, args.vms, args.boot_threads) {
        Ok(vms) => vms,
        Err(e) => {
            eprintln!("densevm: error: {e}");
            let _ = std::fs::remove_file(&api_path);
            return 1;
        }
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
        Err(e) => {
            eprintln!("densevm: error: event loop: {e}");
            let _ = std::fs::remove_file(&api_path);
            return 1;
        }
    };
    *waker_slot.lock().expect("waker") = Some(waker);
    // A crash reported before the waker existed is still in the queue.
    let _ = waker_slot.lock().expect("waker").as_ref().map(|w| w.wake());
    let outcome = monitor.run();
    monitor.shutdown();
    match outcome {
        Ok(Exit::Signal(signal)) => {
            println!("{}", json!({ "event": "exit", "reason": "signal", "signal": signal }));
            0
        }
        Err(message) => {
            eprintln!("densevm: error: {message}");
            println!("{}", json!({ "event": "exit", "reason": "error", "error": message }));
            1
        }
    }
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn sizes_parse_with_binary_units() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("32k"), Ok(32 << 10));
        assert_eq!(parse_size("896K"), Ok(896 << 10));
        assert_eq!(parse_size("4M"), Ok(4 << 20));
        assert_eq!(parse_size("1G"), Ok(1 << 30));
        assert!(parse_size("12q").is_err());
        assert!(parse_size("k").is_err());
        assert!(parse_size("99999999999999G").is_err());
    }
}
