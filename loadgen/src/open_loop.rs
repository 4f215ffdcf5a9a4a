//! Open loop, as httperf: new connections on a fixed schedule (connection
//! k of the whole run is intended at start + k / rate), each carrying
//! --num-calls calls, however slowly the server answers. Latency counts from
//! the intended time, so a late start is not hidden (no coordinated
//! omission). Rate 0 opens connections one after another instead.

use std::io;
use std::time::{Duration, Instant};

use crate::engine::{interrupted, Ending, Engine};

/// Most connections opened in one event-loop turn before serving events again.
const MAX_BURST: u64 = 64;
/// How often (in connections opened) a burst re-checks the clock.
const CLOCK_CHECK_EVERY: u64 = 16;
/// How long to wait when nothing is scheduled.
const IDLE_WAKE: Duration = Duration::from_secs(1);

/// One thread's share of an open-loop run.
#[derive(Debug, Clone, Copy)]
pub struct Plan {
    /// The whole run's connection rate (0: sequential).
    pub rate: f64,
    /// This thread is `thread` of `threads`: it opens connections
    /// thread, thread + threads, ... of the run's schedule.
    pub thread: u32,
    /// Number of threads.
    pub threads: u32,
    /// Connections this thread opens at most (None: until the duration ends).
    pub conns: Option<u64>,
    /// Calls per connection.
    pub calls: u64,
    /// The run's duration bound.
    pub duration: Option<Duration>,
    /// Per-call budget: timeout + think-timeout.
    pub call_budget: Duration,
}

/// Run the plan to its end.
pub fn run(engine: &mut Engine, plan: Plan) -> io::Result<Ending> {
    let start = engine.start();
    let stop_starts = plan.duration.map(|d| start + d);
    let limit = plan.conns.unwrap_or(u64::MAX);
    if limit == 0 {
        // More threads than connections: this one has none to open.
        return Ok(Ending::Complete);
    }
    // A num-conns run ends at the latest one call budget per call after its
    // last scheduled connection (rate > 0) ...
    let budget_end = match (plan.conns, plan.rate > 0.0) {
        (Some(n), true) => {
            let last =
                ((n - 1) * u64::from(plan.threads) + u64::from(plan.thread)) as f64 / plan.rate;
            Some(
                start
                    + Duration::from_secs_f64(last)
                    + plan.call_budget * plan.calls.min(1 << 20) as u32,
            )
        }
        _ => None,
    };
    // ... or when --duration elapses, whichever comes first.
    let (hard, hard_ending) = match (stop_starts, budget_end) {
        (Some(s), Some(b)) if b < s => (Some(b), Ending::Deadline),
        (Some(s), _) => (Some(s), Ending::Duration),
        (None, Some(b)) => (Some(b), Ending::Deadline),
        (None, None) => (None, Ending::Complete),
    };
    let intended = |k: u64| -> Instant {
        let slot = k * u64::from(plan.threads) + u64::from(plan.thread);
        start + Duration::from_secs_f64(slot as f64 / plan.rate)
    };
    let mut k = 0u64;
    loop {
        if interrupted() {
            return Ok(Ending::Interrupted);
        }
        let now = Instant::now();
        if hard.is_some_and(|h| now >= h) {
            return Ok(if engine.active() == 0 {
                Ending::Complete
            } else {
                hard_ending
            });
        }
        let wake;
        if plan.rate > 0.0 {
            let mut burst = 0;
            let mut next = None;
            while k < limit && !engine.uris_exhausted() {
                let t = intended(k);
                if stop_starts.is_some_and(|s| t >= s) {
                    break;
                }
                if t > now || burst == MAX_BURST {
                    next = Some(t);
                    break;
                }
                if burst > 0
                    && burst % CLOCK_CHECK_EVERY == 0
                    && hard.is_some_and(|h| Instant::now() >= h)
                {
                    // Out of time (a slow machine): stop opening; the loop ends the run.
                    next = Some(t);
                    break;
                }
                engine.open(t, plan.calls);
                k += 1;
                burst += 1;
            }
            engine.note_burst(burst);
            match next {
                Some(t) => wake = t,
                None if engine.active() == 0 => return Ok(Ending::Complete),
                None => wake = hard.unwrap_or(now + IDLE_WAKE),
            }
        } else {
            if engine.active() == 0 {
                let starts_over = stop_starts.is_some_and(|s| now >= s);
                if k >= limit || engine.uris_exhausted() || starts_over {
                    return Ok(Ending::Complete);
                }
                engine.open(now, plan.calls);
                engine.note_burst(1);
                k += 1;
                continue;
            }
            wake = hard.unwrap_or(now + IDLE_WAKE);
        }
        engine.turn(wake)?;
    }
}
