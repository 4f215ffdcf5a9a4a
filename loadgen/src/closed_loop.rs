//! Closed loop, as wrk: a fixed number of connections, each sending its next
//! request as soon as the previous reply is complete, until the duration
//! ends. By default connections are kept alive for the whole run; with
//! --num-calls N each carries N calls and is then replaced by a new one (to a
//! newly drawn target). A connection that ended normally (its calls made, or
//! closed by the server) is replaced at once; one that failed is replaced
//! after a short pause, so a dead server is not hammered in a tight loop.
//! Latency counts from each request's send (the first call's from the
//! connection's start, so it includes connecting).

use std::collections::VecDeque;
use std::io;
use std::time::{Duration, Instant};

use crate::engine::{interrupted, Ending, Engine};

/// Pause before replacing a connection that failed.
const RETRY_PAUSE: Duration = Duration::from_millis(10);

/// Keep `concurrency` connections, of `calls` calls each, busy for `duration`.
pub fn run(
    engine: &mut Engine,
    concurrency: u32,
    calls: u64,
    duration: Duration,
) -> io::Result<Ending> {
    let end = engine.start() + duration;
    let mut retry: VecDeque<Instant> = VecDeque::new();
    let now = Instant::now();
    for _ in 0..concurrency {
        if !engine.open(now, calls) {
            retry.push_back(now + RETRY_PAUSE);
        }
    }
    engine.note_burst(u64::from(concurrency));
    loop {
        if interrupted() {
            return Ok(Ending::Interrupted);
        }
        let now = Instant::now();
        if now >= end {
            return Ok(Ending::Duration);
        }
        let (ok, failed) = engine.take_ended();
        for _ in 0..ok {
            if !engine.open(now, calls) {
                retry.push_back(now + RETRY_PAUSE);
            }
        }
        for _ in 0..failed {
            retry.push_back(now + RETRY_PAUSE);
        }
        while retry.front().is_some_and(|&t| t <= now) {
            retry.pop_front();
            if !engine.open(now, calls) {
                retry.push_back(now + RETRY_PAUSE);
            }
        }
        let wake = retry.front().map_or(end, |&t| t.min(end));
        engine.turn(wake)?;
    }
}
