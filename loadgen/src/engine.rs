//! The event loop one thread runs: a mio poller over the connections, a
//! timer heap for their timeouts, a timerfd for precise wake-ups (epoll's
//! own timeout has millisecond resolution), and the 5-second reply-rate
//! windows. The open- and closed-loop drivers decide when to open
//! connections; the engine does everything else.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::io;
use std::net::SocketAddrV4;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token};
use thiserror::Error;

use crate::cli::Config;
use crate::conn::{open_socket, Conn, Ctx, Drive, Phase};
use crate::popularity::PopularityError;
use crate::stats::{micros, ErrorKind, Stats, SAMPLE_WINDOW};
use crate::workload::{SourceCursor, TargetPicker, UriPicker};

/// Token of the wake-up timerfd (connections use their slot index).
const TIMER: Token = Token(usize::MAX);
/// Receive buffer size.
const RECV_BUF: usize = 64 * 1024;
/// Longest wait in the poller, so every thread notices an interrupt soon.
const MAX_POLL_WAIT: Duration = Duration::from_millis(100);

/// Set by SIGINT/SIGTERM: the drivers end the run and the report is still written.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::Relaxed);
}

/// Make SIGINT and SIGTERM end the run early (with its report) instead of
/// killing the process.
pub fn install_interrupt_handler() -> io::Result<()> {
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: a zeroed sigaction with a handler that only stores to an
        // atomic (async-signal-safe); no SA_RESTART, so epoll_wait returns EINTR.
        let r = unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(sig, &sa, std::ptr::null_mut())
        };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Whether SIGINT or SIGTERM arrived.
pub fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::Relaxed)
}

/// A failure that stops a run (not a per-connection error).
#[derive(Debug, Error)]
pub enum EngineError {
    /// The poller or timerfd could not be set up.
    #[error("event loop: {0}")]
    Io(#[from] io::Error),
    /// The popularity distribution could not be built.
    #[error(transparent)]
    Popularity(#[from] PopularityError),
}

/// How a run ended, which decides what happens to calls still in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// Everything finished: nothing is in flight.
    Complete,
    /// --duration elapsed: calls in flight are abandoned (not errors).
    Duration,
    /// A num-conns run hit its time bound: calls in flight are client timeouts.
    Deadline,
    /// SIGINT or SIGTERM: calls in flight are abandoned (not errors).
    Interrupted,
}

/// A timerfd that wakes the poller at an exact instant.
struct WakeTimer {
    fd: OwnedFd,
    armed: Option<Instant>,
}

impl WakeTimer {
    fn new() -> io::Result<Self> {
        // SAFETY: plain timerfd_create(2) call.
        let fd = unsafe {
            libc::timerfd_create(
                libc::CLOCK_MONOTONIC,
                libc::TFD_NONBLOCK | libc::TFD_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fd was just created and is owned by nobody else.
        Ok(WakeTimer {
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
            armed: None,
        })
    }

    /// Make sure the timer fires no later than `at`.
    fn arm(&mut self, at: Instant, now: Instant) -> io::Result<()> {
        if self.armed.is_some_and(|a| a <= at && a > now) {
            return Ok(());
        }
        let d = at
            .saturating_duration_since(now)
            .max(Duration::from_nanos(1));
        let spec = libc::itimerspec {
            it_interval: libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            },
            it_value: libc::timespec {
                tv_sec: d.as_secs() as libc::time_t,
                tv_nsec: d.subsec_nanos() as libc::c_long,
            },
        };
        // SAFETY: fd is a timerfd; spec is a valid itimerspec.
        if unsafe { libc::timerfd_settime(self.fd.as_raw_fd(), 0, &spec, std::ptr::null_mut()) }
            != 0
        {
            return Err(io::Error::last_os_error());
        }
        self.armed = Some(at);
        Ok(())
    }

    /// Consume an expiry.
    fn clear(&mut self) {
        let mut n = 0u64;
        // SAFETY: reading 8 bytes from a timerfd into a u64; failure (EAGAIN) is harmless.
        unsafe { libc::read(self.fd.as_raw_fd(), (&mut n as *mut u64).cast(), 8) };
        self.armed = None;
    }
}

/// One thread's event loop and its connections.
pub struct Engine {
    poll: Poll,
    events: Events,
    ready: Vec<(usize, bool)>,
    wake: WakeTimer,
    conns: Vec<Option<Conn>>,
    gens: Vec<u64>,
    free: Vec<usize>,
    timers: BinaryHeap<Reverse<(Instant, usize, u64)>>,
    buf: Vec<u8>,
    stats: Stats,
    targets: TargetPicker,
    uris: UriPicker,
    uris_exhausted: bool,
    sources: Option<SourceCursor>,
    dsts: Vec<SocketAddrV4>,
    hosts: Vec<String>,
    timeout: Duration,
    think: Duration,
    linger0: bool,
    start: Instant,
    next_window: Instant,
    window_base: u64,
    live: u64,
    active: u64,
    ended_ok: u64,
    ended_failed: u64,
}

impl Engine {
    /// The event loop of thread `thread` (of cfg.threads) for a run that
    /// started at `start`.
    pub fn new(cfg: &Config, thread: u32, start: Instant) -> Result<Self, EngineError> {
        let poll = Poll::new()?;
        let wake = WakeTimer::new()?;
        poll.registry().register(
            &mut SourceFd(&wake.fd.as_raw_fd()),
            TIMER,
            Interest::READABLE,
        )?;
        let uris = UriPicker::new(cfg, thread)?;
        Ok(Engine {
            poll,
            events: Events::with_capacity(1024),
            ready: Vec::with_capacity(1024),
            wake,
            conns: Vec::new(),
            gens: Vec::new(),
            free: Vec::new(),
            timers: BinaryHeap::new(),
            buf: vec![0; RECV_BUF],
            stats: Stats::new(cfg.targets.len(), uris.listed()),
            targets: TargetPicker::new(cfg, thread)?,
            uris,
            uris_exhausted: false,
            sources: cfg
                .source
                .map(|r| SourceCursor::new(r, thread, cfg.threads)),
            dsts: cfg.targets.clone(),
            hosts: cfg.host_headers.clone(),
            timeout: cfg.timeout,
            think: cfg.think_timeout,
            linger0: cfg.linger0,
            start,
            next_window: start + SAMPLE_WINDOW,
            window_base: 0,
            live: 0,
            active: 0,
            ended_ok: 0,
            ended_failed: 0,
        })
    }

    /// When the run started.
    pub fn start(&self) -> Instant {
        self.start
    }

    /// Connections still making calls (open, and not just waiting for the
    /// server to close after their last reply).
    pub fn active(&self) -> u64 {
        self.active
    }

    /// Whether a non-wrapping --wlog list has run out.
    pub fn uris_exhausted(&self) -> bool {
        self.uris_exhausted
    }

    /// Note how many connections one driver turn started.
    pub fn note_burst(&mut self, n: u64) {
        self.stats.max_burst = self.stats.max_burst.max(n);
    }

    /// Connections that ended since the last call: (without error, with
    /// error). A connection ends without error when its last reply is in,
    /// even if it still waits for the server to close.
    pub fn take_ended(&mut self) -> (u64, u64) {
        let r = (self.ended_ok, self.ended_failed);
        self.ended_ok = 0;
        self.ended_failed = 0;
        r
    }

    /// Open a connection to a Zipf-chosen target whose first call is
    /// intended at `intended`, carrying `calls` calls. Returns false (and
    /// counts the error) when the socket could not even be created.
    pub fn open(&mut self, intended: Instant, calls: u64) -> bool {
        let now = Instant::now();
        self.stats.conns_initiated += 1;
        let target = self.targets.next();
        let src = self.sources.as_mut().map(SourceCursor::next);
        let mut stream = match open_socket(self.dsts[target as usize], src, self.linger0) {
            Ok(s) => s,
            Err(kind) => {
                self.stats.errors.add(kind);
                return false;
            }
        };
        let idx = self.free.pop().unwrap_or_else(|| {
            self.conns.push(None);
            self.gens.push(0);
            self.conns.len() - 1
        });
        if let Err(e) = self.poll.registry().register(
            &mut stream,
            Token(idx),
            Interest::READABLE | Interest::WRITABLE,
        ) {
            self.stats.errors.add(ErrorKind::from_io(&e));
            self.free.push(idx);
            return false;
        }
        let mut conn = Conn::new(stream, target, intended, now, calls, self.timeout);
        conn.timer_armed = true;
        self.timers
            .push(Reverse((conn.deadline, idx, self.gens[idx])));
        self.conns[idx] = Some(conn);
        self.live += 1;
        self.active += 1;
        self.stats.max_concurrent = self.stats.max_concurrent.max(self.live);
        true
    }

    fn close(&mut self, idx: usize, ok: bool, now: Instant) {
        let Some(conn) = self.conns[idx].take() else {
            return;
        };
        self.gens[idx] += 1;
        self.free.push(idx);
        self.live -= 1;
        if ok {
            self.stats.conns_completed += 1;
            self.stats
                .conn_time
                .saturating_record(micros(now.saturating_duration_since(conn.started())).max(1));
        }
        if !conn.released {
            self.active -= 1;
            if ok {
                self.ended_ok += 1;
            } else {
                self.ended_failed += 1;
            }
        }
        // Dropping the stream closes the socket, which also removes it from epoll.
    }

    fn dispatch(&mut self, idx: usize, hup: bool, now: Instant) {
        let Engine {
            conns,
            buf,
            stats,
            uris,
            hosts,
            timeout,
            think,
            linger0,
            uris_exhausted,
            ..
        } = self;
        let Some(conn) = conns.get_mut(idx).and_then(Option::as_mut) else {
            return;
        };
        let mut ctx = Ctx {
            buf,
            stats,
            uris,
            hosts,
            timeout: *timeout,
            think: *think,
            linger0: *linger0,
            uris_exhausted,
        };
        match conn.drive(now, hup, &mut ctx) {
            Drive::Pending => {
                if conn.phase() == Phase::Draining && !conn.released {
                    conn.released = true;
                    self.active -= 1;
                    self.ended_ok += 1;
                }
                if !conn.timer_armed {
                    conn.timer_armed = true;
                    self.timers
                        .push(Reverse((conn.deadline, idx, self.gens[idx])));
                }
            }
            Drive::Done => self.close(idx, true, now),
            Drive::Failed(kind) => {
                self.stats.errors.add(kind);
                self.close(idx, false, now);
            }
        }
    }

    fn expire(&mut self, now: Instant) {
        while let Some(&Reverse((at, idx, gen))) = self.timers.peek() {
            if at > now {
                break;
            }
            self.timers.pop();
            if self.gens[idx] != gen {
                continue;
            }
            let Some(conn) = self.conns[idx].as_mut() else {
                continue;
            };
            if conn.deadline > now {
                self.timers.push(Reverse((conn.deadline, idx, gen)));
                continue;
            }
            conn.timer_armed = false;
            if conn.phase() == Phase::Draining {
                // All replies are in; the server just did not close.
                self.close(idx, true, now);
            } else {
                self.stats.errors.add(ErrorKind::ClientTimeout);
                self.close(idx, false, now);
            }
        }
    }

    fn sample_windows(&mut self, now: Instant) {
        while now >= self.next_window {
            self.stats
                .window_replies
                .push(self.stats.replies - self.window_base);
            self.window_base = self.stats.replies;
            self.next_window += SAMPLE_WINDOW;
        }
    }

    /// Wait for readiness (until `wake` at the latest), drive the ready
    /// connections, expire timeouts and close finished rate windows.
    pub fn turn(&mut self, wake: Instant) -> io::Result<()> {
        let now = Instant::now();
        let mut at = wake.min(self.next_window);
        if let Some(Reverse((t, _, _))) = self.timers.peek() {
            at = at.min(*t);
        }
        let timeout = if at <= now {
            Duration::ZERO
        } else {
            self.wake.arm(at, now)?;
            // Backstop only: the timerfd gives the precise wake-up.
            (at - now + Duration::from_millis(1)).min(MAX_POLL_WAIT)
        };
        match self.poll.poll(&mut self.events, Some(timeout)) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => return Ok(()),
            Err(e) => return Err(e),
        }
        self.ready.clear();
        let mut timer_fired = false;
        for ev in self.events.iter() {
            if ev.token() == TIMER {
                timer_fired = true;
            } else {
                self.ready
                    .push((ev.token().0, ev.is_read_closed() || ev.is_error()));
            }
        }
        if timer_fired {
            self.wake.clear();
        }
        let now = Instant::now();
        let ready = std::mem::take(&mut self.ready);
        for &(idx, hup) in &ready {
            self.dispatch(idx, hup, now);
        }
        self.ready = ready;
        self.expire(now);
        self.sample_windows(now);
        Ok(())
    }

    /// End the run: settle connections still open according to `ending`
    /// and return the figures.
    pub fn finish(mut self, ending: Ending) -> Stats {
        let now = Instant::now();
        self.sample_windows(now);
        for idx in 0..self.conns.len() {
            let Some(conn) = self.conns[idx].as_ref() else {
                continue;
            };
            let phase = conn.phase();
            let in_flight = phase != Phase::Draining;
            if in_flight {
                conn.abort_on_close();
            }
            match ending {
                _ if !in_flight => self.close(idx, true, now),
                Ending::Deadline => {
                    self.stats.errors.add(ErrorKind::ClientTimeout);
                    self.close(idx, false, now);
                }
                Ending::Duration | Ending::Complete | Ending::Interrupted => {
                    self.stats.abandoned += 1;
                    let established = phase != Phase::Connecting;
                    self.close(idx, established, now);
                }
            }
        }
        self.stats.duration = now.saturating_duration_since(self.start);
        self.stats
    }
}
