//! One client connection: opening its socket, and the state machine that
//! connects, sends each call's request and reads its reply.

use std::io::{self, Read, Write};
use std::net::SocketAddrV4;
use std::os::fd::{AsRawFd, FromRawFd};
use std::time::{Duration, Instant};

use mio::net::TcpStream;

use crate::http::{write_request, Reply, ResponseParser};
use crate::stats::{micros, ErrorKind, Stats};
use crate::workload::UriPicker;

fn sockaddr(a: SocketAddrV4) -> libc::sockaddr_in {
    libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: a.port().to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(*a.ip()).to_be(),
        },
        sin_zero: [0; 8],
    }
}

fn last_errno() -> i32 {
    io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

fn set_int_opt(fd: i32, level: i32, name: i32, value: i32) -> Result<(), ErrorKind> {
    // SAFETY: fd is an open socket; the option value is a live c_int.
    let r = unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            (&value as *const i32).cast(),
            std::mem::size_of::<i32>() as libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(ErrorKind::from_errno(last_errno()))
    }
}

/// SO_LINGER 0: closing the socket resets the connection.
fn set_linger0(fd: i32) -> Result<(), ErrorKind> {
    let l = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: fd is an open socket; l is a live linger struct.
    let r = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&l as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(ErrorKind::from_errno(last_errno()))
    }
}

/// Open a non-blocking TCP socket to `dst` and start connecting. With `src`,
/// the socket is bound to that address first (IP_BIND_ADDRESS_NO_PORT: the
/// port is chosen at connect, unique per 4-tuple). `linger0` sets SO_LINGER
/// 0 so that closing resets the connection instead of leaving TIME_WAIT.
pub fn open_socket(
    dst: SocketAddrV4,
    src: Option<SocketAddrV4>,
    linger0: bool,
) -> Result<TcpStream, ErrorKind> {
    // SAFETY: plain socket(2) call.
    let fd = unsafe {
        libc::socket(
            libc::AF_INET,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    };
    if fd < 0 {
        return Err(ErrorKind::from_errno(last_errno()));
    }
    // SAFETY: fd is a freshly created socket that nothing else owns; the
    // stream closes it when dropped.
    let stream = unsafe { TcpStream::from_raw_fd(fd) };
    set_int_opt(fd, libc::IPPROTO_TCP, libc::TCP_NODELAY, 1)?;
    if linger0 {
        set_linger0(fd)?;
    }
    let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    if let Some(src) = src {
        set_int_opt(fd, libc::IPPROTO_IP, libc::IP_BIND_ADDRESS_NO_PORT, 1)?;
        let sa = sockaddr(src);
        // SAFETY: fd is open; sa is a valid sockaddr_in of length len.
        if unsafe { libc::bind(fd, (&sa as *const libc::sockaddr_in).cast(), len) } != 0 {
            return Err(ErrorKind::from_errno(last_errno()));
        }
    }
    let sa = sockaddr(dst);
    // SAFETY: fd is open; sa is a valid sockaddr_in of length len.
    if unsafe { libc::connect(fd, (&sa as *const libc::sockaddr_in).cast(), len) } != 0 {
        let e = last_errno();
        if e != libc::EINPROGRESS {
            return Err(ErrorKind::from_errno(e));
        }
    }
    Ok(stream)
}

/// Longest wait for the server's close once all replies are in; after it,
/// zipfperf closes the connection itself.
const DRAIN_GRACE: Duration = Duration::from_secs(1);

/// Where a connection is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Waiting for the TCP handshake.
    Connecting,
    /// Writing a request.
    Sending,
    /// Request sent, no reply byte yet.
    Waiting,
    /// Reading a reply.
    Receiving,
    /// All calls done; waiting for the server to close (so TIME_WAIT stays
    /// on the server's side).
    Draining,
}

/// Result of driving a connection as far as it can go without blocking.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Drive {
    /// Needs more readiness events.
    Pending,
    /// Finished without error; close it.
    Done,
    /// Failed; count the error and close it.
    Failed(ErrorKind),
}

/// What a connection shares with the event loop while it is driven.
pub struct Ctx<'a> {
    /// Scratch receive buffer.
    pub buf: &'a mut [u8],
    /// Figures to update.
    pub stats: &'a mut Stats,
    /// URI source.
    pub uris: &'a mut UriPicker,
    /// Host header per target.
    pub hosts: &'a [String],
    /// Per-activity timeout.
    pub timeout: Duration,
    /// Extra time before a reply's first byte.
    pub think: Duration,
    /// Close with a reset instead of waiting for the server's close.
    pub linger0: bool,
    /// Set when a non-wrapping --wlog list has run out.
    pub uris_exhausted: &'a mut bool,
}

/// One connection and its current call.
#[derive(Debug)]
pub struct Conn {
    stream: TcpStream,
    target: u32,
    phase: Phase,
    parser: ResponseParser,
    req: Vec<u8>,
    sent: usize,
    calls_left: u64,
    uri_index: Option<usize>,
    started: Instant,
    intended: Instant,
    call_sent: Instant,
    first_byte: Option<Instant>,
    /// When the current activity times out.
    pub deadline: Instant,
    /// Whether the event loop's timer heap holds an entry for this connection.
    pub timer_armed: bool,
    /// Whether the drivers were already told this connection is done with
    /// its calls (it is draining and no longer counts as active).
    pub released: bool,
}

impl Conn {
    /// A connection whose socket is connecting; its first call is intended
    /// to go out at `intended`; it carries `calls` calls (u64::MAX: unbounded).
    pub fn new(
        stream: TcpStream,
        target: u32,
        intended: Instant,
        now: Instant,
        calls: u64,
        timeout: Duration,
    ) -> Self {
        Conn {
            stream,
            target,
            phase: Phase::Connecting,
            parser: ResponseParser::new(),
            req: Vec::with_capacity(128),
            sent: 0,
            calls_left: calls,
            uri_index: None,
            started: now,
            intended,
            call_sent: now,
            first_byte: None,
            deadline: now + timeout,
            timer_armed: false,
            released: false,
        }
    }

    /// Current phase.
    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// Make closing this connection reset it (used for calls abandoned at
    /// the end of a run: cheaper than an orderly close, and leaves no state).
    pub fn abort_on_close(&self) {
        // Best effort: if it fails, the close is merely orderly.
        let _ = set_linger0(self.stream.as_raw_fd());
    }

    /// When the connection was opened.
    pub fn started(&self) -> Instant {
        self.started
    }

    /// Start the next call: pick its URI and send its request.
    fn begin_call(&mut self, now: Instant, ctx: &mut Ctx) -> Option<Drive> {
        let Some((uri, index)) = ctx.uris.next() else {
            *ctx.uris_exhausted = true;
            return Some(Drive::Done);
        };
        let close = self.calls_left == 1 && !ctx.linger0;
        write_request(&mut self.req, uri, &ctx.hosts[self.target as usize], close);
        self.uri_index = index;
        self.sent = 0;
        self.call_sent = now;
        self.first_byte = None;
        self.phase = Phase::Sending;
        self.deadline = now + ctx.timeout;
        None
    }

    /// Record a complete reply; returns whether another call follows.
    fn finish_call(&mut self, reply: Reply, now: Instant, ctx: &mut Ctx) -> bool {
        let s = &mut *ctx.stats;
        s.replies += 1;
        if (100..600).contains(&reply.status) {
            s.status[usize::from(reply.status / 100 - 1)] += 1;
        }
        s.header_bytes += reply.header_bytes;
        s.content_bytes += reply.content_bytes;
        s.footer_bytes += reply.footer_bytes;
        let first = self.first_byte.unwrap_or(now);
        s.response_us += micros(first.saturating_duration_since(self.call_sent)) as f64;
        s.transfer_us += micros(now.saturating_duration_since(first)) as f64;
        s.latency
            .saturating_record(micros(now.saturating_duration_since(self.intended)).max(1));
        s.per_target[self.target as usize] += 1;
        if let Some(i) = self.uri_index {
            s.per_uri[i] += 1;
        }
        self.parser.reset();
        self.calls_left = self.calls_left.saturating_sub(1);
        self.intended = now;
        self.calls_left > 0 && reply.keep_alive
    }

    /// The server closed its side.
    fn eof(&mut self, now: Instant, ctx: &mut Ctx) -> Drive {
        match self.phase {
            Phase::Draining => Drive::Done,
            Phase::Waiting | Phase::Receiving => match self.parser.eof() {
                Ok(Some(reply)) => {
                    self.finish_call(reply, now, ctx);
                    Drive::Done
                }
                Ok(None) | Err(_) => Drive::Failed(ErrorKind::ConnReset),
            },
            Phase::Connecting | Phase::Sending => Drive::Failed(ErrorKind::ConnReset),
        }
    }

    /// Advance as far as possible without blocking. `hup`: the poller saw
    /// the peer close or an error, so reads continue until end of file.
    pub fn drive(&mut self, now: Instant, hup: bool, ctx: &mut Ctx) -> Drive {
        loop {
            match self.phase {
                Phase::Connecting => {
                    match self.stream.take_error() {
                        Ok(Some(e)) | Err(e) => return Drive::Failed(ErrorKind::from_io(&e)),
                        Ok(None) => {}
                    }
                    match self.stream.peer_addr() {
                        Ok(_) => {}
                        Err(e) if e.raw_os_error() == Some(libc::ENOTCONN) && !hup => {
                            return Drive::Pending
                        }
                        Err(e) if e.raw_os_error() == Some(libc::ENOTCONN) => {
                            return Drive::Failed(ErrorKind::ConnReset)
                        }
                        Err(e) => return Drive::Failed(ErrorKind::from_io(&e)),
                    }
                    ctx.stats.connects += 1;
                    ctx.stats.connect_us +=
                        micros(now.saturating_duration_since(self.started)) as f64;
                    if let Some(d) = self.begin_call(now, ctx) {
                        return d;
                    }
                }
                Phase::Sending => match (&self.stream).write(&self.req[self.sent..]) {
                    Ok(n) => {
                        ctx.stats.bytes_sent += n as u64;
                        self.sent += n;
                        if self.sent == self.req.len() {
                            ctx.stats.requests += 1;
                            ctx.stats.request_bytes += self.req.len() as u64;
                            self.phase = Phase::Waiting;
                            self.deadline = now + ctx.timeout + ctx.think;
                            if !hup {
                                return Drive::Pending;
                            }
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Drive::Pending,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Drive::Failed(ErrorKind::from_io(&e)),
                },
                Phase::Waiting | Phase::Receiving | Phase::Draining => {
                    let n = match (&self.stream).read(ctx.buf) {
                        Ok(0) => return self.eof(now, ctx),
                        Ok(n) => n,
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Drive::Pending,
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                        // All replies are in: how the server ends the connection does not matter.
                        Err(_) if self.phase == Phase::Draining => return Drive::Done,
                        Err(e) => return Drive::Failed(ErrorKind::from_io(&e)),
                    };
                    ctx.stats.bytes_received += n as u64;
                    if self.phase == Phase::Draining {
                        // Bytes nobody asked for.
                        return Drive::Failed(ErrorKind::Other);
                    }
                    if self.first_byte.is_none() {
                        self.first_byte = Some(now);
                        self.phase = Phase::Receiving;
                    }
                    self.deadline = now + ctx.timeout;
                    let (used, reply) = match self.parser.feed(&ctx.buf[..n]) {
                        Ok(r) => r,
                        Err(_) => return Drive::Failed(ErrorKind::Other),
                    };
                    if let Some(reply) = reply {
                        let more = self.finish_call(reply, now, ctx);
                        if used < n {
                            // Bytes beyond the reply: we never pipeline.
                            return Drive::Failed(ErrorKind::Other);
                        }
                        if more {
                            if let Some(d) = self.begin_call(now, ctx) {
                                return d;
                            }
                            continue;
                        }
                        if ctx.linger0 {
                            return Drive::Done;
                        }
                        // Let the server close first; its FIN usually came with the reply.
                        self.phase = Phase::Draining;
                        self.deadline = now + ctx.timeout.min(DRAIN_GRACE);
                        continue;
                    }
                    if n < ctx.buf.len() && !hup {
                        // A short read drained the socket; the next arrival raises a new edge.
                        return Drive::Pending;
                    }
                }
            }
        }
    }
}
