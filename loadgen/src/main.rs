//! zipfperf: an httperf-style HTTP load generator with Zipf popularity over
//! targets. See README.md for flags, output and the JSON schema.

mod cli;
mod closed_loop;
mod conn;
mod engine;
mod http;
mod json;
mod open_loop;
mod popularity;
mod report;
mod stats;
mod workload;

use std::io::Write;
use std::process::ExitCode;
use std::time::Instant;

use clap::error::ErrorKind as ClapErrorKind;
use clap::Parser;

use cli::{Args, Config, Mode};
use engine::{Ending, Engine, EngineError};
use report::CpuTime;
use stats::Stats;

/// Exit code for bad flags.
const EXIT_USAGE: u8 = 2;
/// Exit code for a failure during the run.
const EXIT_FAILURE: u8 = 1;

/// Raise the open-file soft limit to the hard limit: every connection is a descriptor.
fn raise_nofile_limit() {
    // SAFETY: getrlimit/setrlimit on a valid rlimit struct.
    unsafe {
        let mut r: libc::rlimit = std::mem::zeroed();
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) == 0 && r.rlim_cur < r.rlim_max {
            r.rlim_cur = r.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &r);
        }
    }
}

/// Share `n` among `parts`: part `i`'s count.
fn share(n: u64, parts: u32, i: u32) -> u64 {
    n / u64::from(parts) + u64::from(u64::from(i) < n % u64::from(parts))
}

/// Run one thread's share of the load.
fn run_thread(cfg: &Config, thread: u32, start: Instant) -> Result<(Stats, Ending), EngineError> {
    let mut engine = Engine::new(cfg, thread, start)?;
    let ending = match cfg.mode {
        Mode::Open { rate, conns, calls } => {
            let plan = open_loop::Plan {
                rate,
                thread,
                threads: cfg.threads,
                conns: conns.map(|n| share(n, cfg.threads, thread)),
                calls,
                duration: cfg.duration,
                call_budget: cfg.timeout + cfg.think_timeout,
            };
            open_loop::run(&mut engine, plan)?
        }
        Mode::Closed { concurrency, calls } => {
            let duration = cfg.duration.expect("validated: closed loop has a duration");
            let share = share(u64::from(concurrency), cfg.threads, thread) as u32;
            closed_loop::run(&mut engine, share, calls, duration)?
        }
    };
    Ok((engine.finish(ending), ending))
}

/// Run the whole load (all threads) and merge the figures.
fn run(cfg: &Config) -> Result<(Stats, Ending), EngineError> {
    let start = Instant::now();
    if cfg.threads == 1 {
        return run_thread(cfg, 0, start);
    }
    let results: Vec<Result<(Stats, Ending), EngineError>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..cfg.threads)
            .map(|t| scope.spawn(move || run_thread(cfg, t, start)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("load thread panicked"))
            .collect()
    });
    let mut merged: Option<(Stats, Ending)> = None;
    for r in results {
        let (s, e) = r?;
        match merged.as_mut() {
            None => merged = Some((s, e)),
            Some((m, me)) => {
                m.merge(&s);
                if e != Ending::Complete {
                    *me = e;
                }
            }
        }
    }
    Ok(merged.expect("at least one thread"))
}

fn bench_sampler(args: &Args, samples: u64) -> ExitCode {
    let n = args.targets.unwrap_or(4000);
    for alpha in [0.0, 0.5, 1.0, 1.5] {
        match popularity::sampler_speed(n, alpha, samples, args.seed) {
            Ok(speed) => println!(
                "sampler: n {n} alpha {alpha} samples {samples} rate {:.2} M samples/s (wall {:.2} M samples/s)",
                speed.cpu / 1e6,
                speed.wall / 1e6
            ),
            Err(e) => {
                eprintln!("zipfperf: error: {e}");
                return ExitCode::from(EXIT_FAILURE);
            }
        }
    }
    ExitCode::SUCCESS
}

fn main() -> ExitCode {
    let args = match Args::try_parse() {
        Ok(a) => a,
        Err(e) => {
            if matches!(
                e.kind(),
                ClapErrorKind::DisplayHelp | ClapErrorKind::DisplayVersion
            ) {
                print!("{e}");
                return ExitCode::SUCCESS;
            }
            let rendered = e.render().to_string();
            let first = rendered.lines().next().unwrap_or("error: bad arguments");
            eprintln!("zipfperf: {first}");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    if let Some(samples) = args.bench_sampler {
        return bench_sampler(&args, samples);
    }
    let cfg = match args.validate() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("zipfperf: error: {e}");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    raise_nofile_limit();
    if let Err(e) = engine::install_interrupt_handler() {
        eprintln!("zipfperf: error: signal handler: {e}");
        return ExitCode::from(EXIT_FAILURE);
    }
    let (stats, ending) = match run(&cfg) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("zipfperf: error: {e}");
            return ExitCode::from(EXIT_FAILURE);
        }
    };
    let cpu = CpuTime::of_process();
    let doc = json::document(&args, &stats, cpu, ending);
    let mut out = std::io::stdout().lock();
    let written = match args.json.as_deref() {
        Some("-") => writeln!(out, "{doc}"),
        other => {
            if let Some(path) = other {
                if let Err(e) = std::fs::write(path, format!("{doc}\n")) {
                    eprintln!("zipfperf: error: --json {path}: {e}");
                    return ExitCode::from(EXIT_FAILURE);
                }
            }
            write!(out, "{}\n{}", args.echo(), report::text(&stats, cpu))
        }
    };
    match written.and_then(|()| out.flush()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(_) => ExitCode::from(EXIT_FAILURE),
    }
}
