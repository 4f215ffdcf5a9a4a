//! pagesim: replays a request trace (recorded by densevm, or synthetic with
//! Zipf popularity) through a pager policy and a disk model, and prints the
//! hit ratio, swap traffic and predicted throughput.
//!
//! Exit status: 0 on success, 2 for bad flags or configuration (one line on
//! stderr), 1 for a failure during the simulation.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;
use rand::rngs::SmallRng;
use rand::{RngExt, SeedableRng};
use rand_distr::{Distribution, Zipf};
use serde_json::json;

use paging_policy::sim::{SimConfig, Simulator};
use paging_policy::trace::TraceReader;
use paging_policy::{parse_size, DiskSpec, PagerError, PolicySpec};

/// Trace-driven simulator of the densevm pager.
#[derive(Parser, Debug)]
#[command(name = "pagesim", version)]
struct Cli {
    /// Trace file written by densevm --record-trace (else: synthetic trace).
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Synthetic: number of VMs.
    #[arg(long, default_value_t = 4000)]
    vms: u32,
    /// Synthetic: Zipf exponent of VM popularity (0 = uniform).
    #[arg(long, default_value_t = 1.0)]
    alpha: f64,
    /// Synthetic: number of requests.
    #[arg(long, default_value_t = 1_000_000)]
    requests: u64,
    /// Synthetic: RNG seed.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Synthetic: working-set range touched by every request.
    #[arg(long, default_value = "896K", value_parser = size)]
    ws: u64,
    /// Synthetic: stack/bss pages touched by every request (top of RAM).
    #[arg(long, default_value = "128K", value_parser = size)]
    extra: u64,
    /// Synthetic: RAM of every VM.
    #[arg(long, default_value = "4M", value_parser = size)]
    guest_mem: u64,
    /// Global memory budget.
    #[arg(long, default_value = "1G", value_parser = size)]
    mem: u64,
    /// Block size (4k..256k, power of two).
    #[arg(long, default_value = "32k", value_parser = size)]
    block: u64,
    /// Policy: demand, wsswap or a plugin path.
    #[arg(long, default_value = "demand")]
    policy: String,
    /// Disk model: none, hdd, hdd15k, ssd, array:N, raid5:N (+ ,key=value).
    #[arg(long, default_value = "none")]
    disk: String,
    /// Swap capacity (default: sized like the pager does).
    #[arg(long, value_parser = size)]
    swap_size: Option<u64>,
    /// Most resident memory one VM may hold; past it the VM's own blocks are
    /// evicted, whatever the policy chooses (as densevm's --vm-resident-max).
    #[arg(long, value_parser = size)]
    vm_resident_max: Option<u64>,
    /// CPU cost of one in-core request, µs.
    #[arg(long, default_value_t = 30.0)]
    cpu_us: f64,
    /// CPU cost of serving one fault, µs.
    #[arg(long, default_value_t = 10.0)]
    fault_us: f64,
    /// Fraction of each request's blocks that the request writes.
    #[arg(long, default_value_t = 1.0)]
    dirty: f64,
    /// Requests replayed before counting.
    #[arg(long, default_value_t = 0)]
    warmup: u64,
    /// Requests in flight at once (their faults interleave at the disk);
    /// the default matches the pager's fault-service threads.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

fn size(s: &str) -> Result<u64, String> {
    parse_size(s).map_err(|e| e.to_string())
}

fn usage_error(msg: &str) -> ExitCode {
    eprintln!("pagesim: error: {msg}");
    ExitCode::from(2)
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
                let _ = e.print();
                return ExitCode::SUCCESS;
            }
            let text = e.to_string();
            let first = text.lines().next().unwrap_or("bad arguments");
            return usage_error(first.trim_start_matches("error: "));
        }
    };
    if !(0.0..=1.0).contains(&cli.dirty) {
        return usage_error("--dirty must be between 0 and 1");
    }
    if !(cli.alpha >= 0.0 && cli.alpha.is_finite()) || cli.vms == 0 || cli.concurrency == 0 {
        return usage_error("--alpha must be >= 0, --vms and --concurrency > 0");
    }
    // Everything up to the first request is configuration (exit 2); a
    // failure while replaying is a run failure (exit 1).
    let (sim, source, vms, vm_ram) = match setup(&cli) {
        Ok(s) => s,
        Err(e) => return usage_error(&e.to_string()),
    };
    match run(&cli, sim, source, vms, vm_ram) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("pagesim: error: {e}");
            ExitCode::from(1)
        }
    }
}

/// Where requests come from.
enum Source {
    Trace(TraceReader),
    Zipf {
        dist: Option<Zipf<f64>>,
        rng: SmallRng,
        n: u32,
        left: u64,
    },
}

impl Source {
    fn next(&mut self) -> Result<Option<u32>, PagerError> {
        match self {
            Source::Trace(r) => r.next_vm(),
            Source::Zipf { dist, rng, n, left } => {
                if *left == 0 {
                    return Ok(None);
                }
                *left -= 1;
                Ok(Some(match dist {
                    Some(d) => (d.sample(rng) as u32).clamp(1, *n) - 1,
                    None => rng.random_range(0..*n),
                }))
            }
        }
    }
}

/// CPU time of this process (user + system), seconds. The simulation speed
/// is reported per CPU second too, because wall time on a shared host
/// measures the neighbours as much as the simulator.
fn cpu_seconds() -> f64 {
    let mut ru = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage fills the struct.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, ru.as_mut_ptr()) };
    // SAFETY: zero-initialised and filled above.
    let ru = unsafe { ru.assume_init() };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// Opens the trace (or sets up the synthetic one) and builds the simulator.
fn setup(cli: &Cli) -> Result<(Simulator, Source, u32, u64), PagerError> {
    let (vms, vm_ram, ranges, source) = match &cli.trace {
        Some(path) => {
            let r = TraceReader::open(path)?;
            let h = r.header.clone();
            (h.vms, h.vm_ram_bytes, h.request_ranges, Source::Trace(r))
        }
        None => {
            if cli.ws + cli.extra > cli.guest_mem {
                return Err(PagerError::BadVm {
                    vm: 0,
                    reason: "--ws plus --extra exceed --guest-mem".into(),
                });
            }
            let mut ranges = vec![(0, cli.ws)];
            if cli.extra > 0 {
                ranges.push((cli.guest_mem - cli.extra, cli.extra));
            }
            let dist = if cli.alpha > 0.0 {
                Some(
                    Zipf::new(cli.vms as f64, cli.alpha).map_err(|e| PagerError::BadVm {
                        vm: 0,
                        reason: format!("Zipf: {e}"),
                    })?,
                )
            } else {
                None
            };
            let src = Source::Zipf {
                dist,
                rng: SmallRng::seed_from_u64(cli.seed),
                n: cli.vms,
                left: cli.requests,
            };
            (cli.vms, cli.guest_mem, ranges, src)
        }
    };
    let sim = Simulator::new(SimConfig {
        budget_bytes: cli.mem,
        block_bytes: cli.block,
        policy: PolicySpec::parse(&cli.policy)?,
        disk: DiskSpec::parse(&cli.disk)?,
        vm_ram_bytes: vm_ram,
        vms,
        request_ranges: ranges,
        cpu_us: cli.cpu_us,
        fault_us: cli.fault_us,
        dirty: cli.dirty,
        swap_bytes: cli.swap_size,
        vm_resident_max: cli.vm_resident_max,
        warmup: cli.warmup,
        concurrency: cli.concurrency,
    })?;
    Ok((sim, source, vms, vm_ram))
}

/// Replays every request and prints the results.
fn run(
    cli: &Cli,
    mut sim: Simulator,
    mut source: Source,
    vms: u32,
    vm_ram: u64,
) -> Result<(), PagerError> {
    let t0 = Instant::now();
    let c0 = cpu_seconds();
    let mut replayed = 0u64;
    while let Some(vm) = source.next()? {
        sim.request(vm)?;
        replayed += 1;
    }
    sim.drain()?;
    let secs = t0.elapsed().as_secs_f64();
    let cpu = cpu_seconds() - c0;
    let sim_rps = replayed as f64 / secs.max(1e-9);
    let sim_cpu_rps = replayed as f64 / cpu.max(1e-9);
    let r = sim.report();
    if cli.json {
        let mut j = serde_json::to_value(&r).expect("serializable");
        let o = j.as_object_mut().expect("object");
        o.insert("vms".into(), json!(vms));
        o.insert("vm_ram_bytes".into(), json!(vm_ram));
        o.insert("budget_bytes".into(), json!(cli.mem));
        o.insert("block_bytes".into(), json!(cli.block));
        o.insert("request_blocks".into(), json!(sim.request_blocks()));
        o.insert("sim_seconds".into(), json!(secs));
        o.insert("sim_requests_per_second".into(), json!(sim_rps));
        o.insert("sim_cpu_seconds".into(), json!(cpu));
        o.insert("sim_requests_per_cpu_second".into(), json!(sim_cpu_rps));
        println!("{j}");
    } else {
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        println!(
            "pagesim: policy {}, disk {}, {} VMs x {} KiB, budget {} MiB, block {} KiB, {} blocks per request",
            r.policy,
            r.disk,
            vms,
            vm_ram >> 10,
            cli.mem >> 20,
            cli.block >> 10,
            sim.request_blocks()
        );
        println!(
            "requests {} (warm-up {}), block touches {}, faults {}",
            r.requests, r.warmup, r.block_touches, r.faults
        );
        println!(
            "hit ratio {:.4} (requests entirely in core {:.4})",
            r.hit_ratio, r.request_hit_ratio
        );
        println!("blocks in {}, blocks out {}", r.blocks_in, r.blocks_out);
        println!(
            "swap read {:.1} MiB, swap written {:.1} MiB",
            mib(r.swap_read_bytes),
            mib(r.swap_write_bytes)
        );
        println!(
            "disk busy {:.3} s, cpu {:.3} s",
            r.disk_seconds, r.cpu_seconds
        );
        println!("predicted throughput {:.1} requests/s", r.predicted_rps);
        println!(
            "simulated {replayed} requests in {secs:.3} s ({sim_rps:.0} requests/s; {sim_cpu_rps:.0} per CPU second)"
        );
    }
    Ok(())
}
