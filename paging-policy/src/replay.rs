//! pagesim's command line and replay loop, shared by the `pagesim` binary
//! and the Python extension (`pagesim-py`), so both take the same options
//! with the same defaults and report the same figures.

use std::path::PathBuf;
use std::time::Instant;

use clap::Parser;
use rand::rngs::SmallRng;
use rand::{RngExt, SeedableRng};
use rand_distr::{Distribution, Zipf};
use serde_json::json;

use crate::error::PagerError;
use crate::policy::Policy;
use crate::sim::{SimConfig, SimReport, Simulator};
use crate::trace::TraceReader;
use crate::{parse_size, DiskSpec, PolicySpec};

/// Trace-driven simulator of the densevm pager.
#[derive(Parser, Debug)]
#[command(name = "pagesim", version)]
pub struct PagesimArgs {
    /// Trace file written by densevm --record-trace (else: synthetic trace).
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Synthetic: number of VMs.
    #[arg(long, default_value_t = 4000)]
    pub vms: u32,
    /// Synthetic: Zipf exponent of VM popularity (0 = uniform).
    #[arg(long, default_value_t = 1.0)]
    pub alpha: f64,
    /// Synthetic: number of requests.
    #[arg(long, default_value_t = 1_000_000)]
    pub requests: u64,
    /// Synthetic: RNG seed.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Synthetic: working-set range touched by every request.
    #[arg(long, default_value = "896K", value_parser = size)]
    pub ws: u64,
    /// Synthetic: stack/bss pages touched by every request (top of RAM).
    #[arg(long, default_value = "128K", value_parser = size)]
    pub extra: u64,
    /// Synthetic: RAM of every VM.
    #[arg(long, default_value = "4M", value_parser = size)]
    pub guest_mem: u64,
    /// Global memory budget.
    #[arg(long, default_value = "1G", value_parser = size)]
    pub mem: u64,
    /// Block size (4k..256k, power of two).
    #[arg(long, default_value = "32k", value_parser = size)]
    pub block: u64,
    /// Policy: demand, wsswap or a plugin path.
    #[arg(long, default_value = "demand")]
    pub policy: String,
    /// Disk model: none, hdd, hdd15k, ssd, array:N, raid5:N (+ ,key=value).
    #[arg(long, default_value = "none")]
    pub disk: String,
    /// Swap capacity (default: sized like the pager does).
    #[arg(long, value_parser = size)]
    pub swap_size: Option<u64>,
    /// Most resident memory one VM may hold; past it the VM's own blocks are
    /// evicted, whatever the policy chooses (as densevm's --vm-resident-max).
    #[arg(long, value_parser = size)]
    pub vm_resident_max: Option<u64>,
    /// CPU cost of one in-core request, µs.
    #[arg(long, default_value_t = 30.0)]
    pub cpu_us: f64,
    /// CPU cost of serving one fault, µs.
    #[arg(long, default_value_t = 10.0)]
    pub fault_us: f64,
    /// Fraction of each request's blocks that the request writes.
    #[arg(long, default_value_t = 1.0)]
    pub dirty: f64,
    /// Requests replayed before counting.
    #[arg(long, default_value_t = 0)]
    pub warmup: u64,
    /// Requests in flight at once (their faults interleave at the disk);
    /// the default matches the pager's fault-service threads.
    #[arg(long, default_value_t = 8)]
    pub concurrency: usize,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

fn size(s: &str) -> Result<u64, String> {
    parse_size(s).map_err(|e| e.to_string())
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

/// A simulation set up from [`PagesimArgs`], ready to replay.
pub struct Replay {
    sim: Simulator,
    source: Source,
    vms: u32,
    vm_ram: u64,
    budget: u64,
    block: u64,
}

/// The figures of a finished replay: the simulator's report, the setting
/// and the simulation's own speed.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// The simulator's report.
    pub report: SimReport,
    /// Number of VMs.
    pub vms: u32,
    /// RAM of every VM.
    pub vm_ram_bytes: u64,
    /// Global memory budget.
    pub budget_bytes: u64,
    /// Block size.
    pub block_bytes: u64,
    /// Blocks touched by every request.
    pub request_blocks: usize,
    /// Requests replayed (warm-up included).
    pub replayed: u64,
    /// Wall time of the replay (s).
    pub sim_seconds: f64,
    /// CPU time of the replay (s).
    pub sim_cpu_seconds: f64,
}

impl Replay {
    /// Checks the options, opens the trace (or sets up the synthetic one)
    /// and builds the simulator, running `policy` if given (else the one
    /// `--policy` names). An error here is a configuration error.
    pub fn new(args: &PagesimArgs, policy: Option<Box<dyn Policy>>) -> Result<Replay, PagerError> {
        let bad = |reason: &str| PagerError::BadSimOption(reason.into());
        if !(0.0..=1.0).contains(&args.dirty) {
            return Err(bad("--dirty must be between 0 and 1"));
        }
        if !(args.alpha >= 0.0 && args.alpha.is_finite()) || args.vms == 0 || args.concurrency == 0
        {
            return Err(bad("--alpha must be >= 0, --vms and --concurrency > 0"));
        }
        let (vms, vm_ram, ranges, source) = match &args.trace {
            Some(path) => {
                let r = TraceReader::open(path)?;
                let h = r.header.clone();
                (h.vms, h.vm_ram_bytes, h.request_ranges, Source::Trace(r))
            }
            None => {
                if args.ws + args.extra > args.guest_mem {
                    return Err(bad("--ws plus --extra exceed --guest-mem"));
                }
                let mut ranges = vec![(0, args.ws)];
                if args.extra > 0 {
                    ranges.push((args.guest_mem - args.extra, args.extra));
                }
                let dist = if args.alpha > 0.0 {
                    Some(
                        Zipf::new(args.vms as f64, args.alpha)
                            .map_err(|e| bad(&format!("Zipf: {e}")))?,
                    )
                } else {
                    None
                };
                let src = Source::Zipf {
                    dist,
                    rng: SmallRng::seed_from_u64(args.seed),
                    n: args.vms,
                    left: args.requests,
                };
                (args.vms, args.guest_mem, ranges, src)
            }
        };
        let cfg = SimConfig {
            budget_bytes: args.mem,
            block_bytes: args.block,
            policy: PolicySpec::parse(&args.policy)?,
            disk: DiskSpec::parse(&args.disk)?,
            vm_ram_bytes: vm_ram,
            vms,
            request_ranges: ranges,
            cpu_us: args.cpu_us,
            fault_us: args.fault_us,
            dirty: args.dirty,
            swap_bytes: args.swap_size,
            vm_resident_max: args.vm_resident_max,
            warmup: args.warmup,
            concurrency: args.concurrency,
        };
        let sim = match policy {
            Some(p) => Simulator::with_policy(cfg, p)?,
            None => Simulator::new(cfg)?,
        };
        Ok(Replay {
            sim,
            source,
            vms,
            vm_ram,
            budget: args.mem,
            block: args.block,
        })
    }

    /// Replays every request. An error here is a run failure.
    pub fn run(mut self) -> Result<Outcome, PagerError> {
        let t0 = Instant::now();
        let c0 = cpu_seconds();
        let mut replayed = 0u64;
        while let Some(vm) = self.source.next()? {
            self.sim.request(vm)?;
            replayed += 1;
        }
        self.sim.drain()?;
        Ok(Outcome {
            report: self.sim.report(),
            vms: self.vms,
            vm_ram_bytes: self.vm_ram,
            budget_bytes: self.budget,
            block_bytes: self.block,
            request_blocks: self.sim.request_blocks(),
            replayed,
            sim_seconds: t0.elapsed().as_secs_f64(),
            sim_cpu_seconds: cpu_seconds() - c0,
        })
    }
}

impl Outcome {
    /// Requests replayed per wall second.
    pub fn requests_per_second(&self) -> f64 {
        self.replayed as f64 / self.sim_seconds.max(1e-9)
    }

    /// Requests replayed per CPU second.
    pub fn requests_per_cpu_second(&self) -> f64 {
        self.replayed as f64 / self.sim_cpu_seconds.max(1e-9)
    }

    /// The report as `pagesim --json` prints it.
    pub fn to_json(&self) -> serde_json::Value {
        let mut j = serde_json::to_value(&self.report).expect("serializable");
        let o = j.as_object_mut().expect("object");
        o.insert("vms".into(), json!(self.vms));
        o.insert("vm_ram_bytes".into(), json!(self.vm_ram_bytes));
        o.insert("budget_bytes".into(), json!(self.budget_bytes));
        o.insert("block_bytes".into(), json!(self.block_bytes));
        o.insert("request_blocks".into(), json!(self.request_blocks));
        o.insert("sim_seconds".into(), json!(self.sim_seconds));
        o.insert(
            "sim_requests_per_second".into(),
            json!(self.requests_per_second()),
        );
        o.insert("sim_cpu_seconds".into(), json!(self.sim_cpu_seconds));
        o.insert(
            "sim_requests_per_cpu_second".into(),
            json!(self.requests_per_cpu_second()),
        );
        j
    }

    /// The report as `pagesim` prints it without `--json`.
    pub fn to_text(&self) -> String {
        let r = &self.report;
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        format!(
            "pagesim: policy {}, disk {}, {} VMs x {} KiB, budget {} MiB, block {} KiB, {} blocks per request\n\
             requests {} (warm-up {}), block touches {}, faults {}\n\
             hit ratio {:.4} (requests entirely in core {:.4})\n\
             blocks in {}, blocks out {}, requests whose VM was evicted mid page-in {}\n\
             swap read {:.1} MiB, swap written {:.1} MiB\n\
             disk busy {:.3} s, cpu {:.3} s\n\
             predicted throughput {:.1} requests/s\n\
             simulated {} requests in {:.3} s ({:.0} requests/s; {:.0} per CPU second)",
            r.policy,
            r.disk,
            self.vms,
            self.vm_ram_bytes >> 10,
            self.budget_bytes >> 20,
            self.block_bytes >> 10,
            self.request_blocks,
            r.requests,
            r.warmup,
            r.block_touches,
            r.faults,
            r.hit_ratio,
            r.request_hit_ratio,
            r.blocks_in,
            r.blocks_out,
            r.interrupted_requests,
            mib(r.swap_read_bytes),
            mib(r.swap_write_bytes),
            r.disk_seconds,
            r.cpu_seconds,
            r.predicted_rps,
            self.replayed,
            self.sim_seconds,
            self.requests_per_second(),
            self.requests_per_cpu_second(),
        )
    }
}
