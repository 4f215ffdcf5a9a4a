//! Counters and histograms one event loop fills, and their merge across
//! threads.

use std::time::Duration;

use hdrhistogram::Histogram;

/// Width of one reply-rate sample, as httperf.
pub const SAMPLE_WINDOW: Duration = Duration::from_secs(5);

/// Error counters, named as httperf's Errors lines.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Errors {
    /// A connect, send or reply made no progress within --timeout
    /// (or the call was in flight when a num-conns run hit its time bound).
    pub client_timo: u64,
    /// The kernel gave up on the connection (ETIMEDOUT).
    pub socket_timo: u64,
    /// Connection refused.
    pub connrefused: u64,
    /// Connection reset, or closed by the server in the middle of a reply.
    pub connreset: u64,
    /// Out of file descriptors for this process (EMFILE).
    pub fd_unavail: u64,
    /// No local address/port available (EADDRNOTAVAIL, EADDRINUSE, EAGAIN on connect).
    pub addrunavail: u64,
    /// System-wide file table full (ENFILE).
    pub ftab_full: u64,
    /// Anything else, including malformed replies.
    pub other: u64,
}

/// One kind of failure, as counted in [`Errors`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// See [`Errors::client_timo`].
    ClientTimeout,
    /// See [`Errors::socket_timo`].
    SocketTimeout,
    /// See [`Errors::connrefused`].
    ConnRefused,
    /// See [`Errors::connreset`].
    ConnReset,
    /// See [`Errors::fd_unavail`].
    FdUnavail,
    /// See [`Errors::addrunavail`].
    AddrUnavail,
    /// See [`Errors::ftab_full`].
    FtabFull,
    /// See [`Errors::other`].
    Other,
}

impl ErrorKind {
    /// Classify an OS error number.
    pub fn from_errno(errno: i32) -> Self {
        match errno {
            libc::ECONNREFUSED => ErrorKind::ConnRefused,
            libc::ECONNRESET | libc::EPIPE | libc::ECONNABORTED => ErrorKind::ConnReset,
            libc::ETIMEDOUT => ErrorKind::SocketTimeout,
            libc::EMFILE => ErrorKind::FdUnavail,
            libc::ENFILE => ErrorKind::FtabFull,
            libc::EADDRNOTAVAIL | libc::EADDRINUSE | libc::EAGAIN => ErrorKind::AddrUnavail,
            _ => ErrorKind::Other,
        }
    }

    /// Classify an I/O error.
    pub fn from_io(e: &std::io::Error) -> Self {
        e.raw_os_error().map_or(ErrorKind::Other, Self::from_errno)
    }
}

impl Errors {
    /// Count one error.
    pub fn add(&mut self, kind: ErrorKind) {
        let c = match kind {
            ErrorKind::ClientTimeout => &mut self.client_timo,
            ErrorKind::SocketTimeout => &mut self.socket_timo,
            ErrorKind::ConnRefused => &mut self.connrefused,
            ErrorKind::ConnReset => &mut self.connreset,
            ErrorKind::FdUnavail => &mut self.fd_unavail,
            ErrorKind::AddrUnavail => &mut self.addrunavail,
            ErrorKind::FtabFull => &mut self.ftab_full,
            ErrorKind::Other => &mut self.other,
        };
        *c += 1;
    }

    /// Sum of all counters.
    pub fn total(&self) -> u64 {
        self.client_timo
            + self.socket_timo
            + self.connrefused
            + self.connreset
            + self.fd_unavail
            + self.addrunavail
            + self.ftab_full
            + self.other
    }

    fn merge(&mut self, o: &Errors) {
        self.client_timo += o.client_timo;
        self.socket_timo += o.socket_timo;
        self.connrefused += o.connrefused;
        self.connreset += o.connreset;
        self.fd_unavail += o.fd_unavail;
        self.addrunavail += o.addrunavail;
        self.ftab_full += o.ftab_full;
        self.other += o.other;
    }
}

/// A histogram of microseconds (1 µs to 1 hour, 3 significant digits).
pub fn micros_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("static histogram bounds are valid")
}

/// Microseconds in a duration, as a histogram value.
pub fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// Everything one run (or one thread of it) measured.
#[derive(Debug, Clone)]
pub struct Stats {
    /// Wall time from the start to the end of the run.
    pub duration: Duration,
    /// Connections attempted (every socket zipfperf tried to open).
    pub conns_initiated: u64,
    /// Connections that ended without error (including those still open,
    /// and idle, when a duration-bounded run ended).
    pub conns_completed: u64,
    /// Lifetimes of completed connections, µs.
    pub conn_time: Histogram<u64>,
    /// Sum of connect times (SYN to established), µs.
    pub connect_us: f64,
    /// Connections that got established.
    pub connects: u64,
    /// Most connections open at once.
    pub max_concurrent: u64,
    /// Most connections started in one event-loop turn.
    pub max_burst: u64,
    /// Requests fully sent.
    pub requests: u64,
    /// Bytes of those requests.
    pub request_bytes: u64,
    /// Complete replies.
    pub replies: u64,
    /// Replies by status class: 1xx..5xx.
    pub status: [u64; 5],
    /// Sum of reply header bytes.
    pub header_bytes: u64,
    /// Sum of reply content bytes.
    pub content_bytes: u64,
    /// Sum of reply footer bytes (chunk framing, trailers).
    pub footer_bytes: u64,
    /// Sum of request-sent to first-reply-byte times, µs.
    pub response_us: f64,
    /// Sum of first-byte to last-byte times, µs.
    pub transfer_us: f64,
    /// Reply latency, µs: from the intended send time (open loop) or the
    /// actual send time (closed loop) to the reply's last byte.
    pub latency: Histogram<u64>,
    /// Error counters.
    pub errors: Errors,
    /// Bytes written to sockets.
    pub bytes_sent: u64,
    /// Bytes read from sockets.
    pub bytes_received: u64,
    /// Replies completed in each full 5-second window since the start.
    pub window_replies: Vec<u64>,
    /// Replies per target index.
    pub per_target: Vec<u64>,
    /// Replies per URI index (when URIs come from --wlog).
    pub per_uri: Vec<u64>,
    /// Calls in flight when a duration-bounded run ended (neither replies nor errors).
    pub abandoned: u64,
}

impl Stats {
    /// Empty statistics for `targets` targets and `uris` listed URIs.
    pub fn new(targets: usize, uris: usize) -> Self {
        Stats {
            duration: Duration::ZERO,
            conns_initiated: 0,
            conns_completed: 0,
            conn_time: micros_histogram(),
            connect_us: 0.0,
            connects: 0,
            max_concurrent: 0,
            max_burst: 0,
            requests: 0,
            request_bytes: 0,
            replies: 0,
            status: [0; 5],
            header_bytes: 0,
            content_bytes: 0,
            footer_bytes: 0,
            response_us: 0.0,
            transfer_us: 0.0,
            latency: micros_histogram(),
            errors: Errors::default(),
            bytes_sent: 0,
            bytes_received: 0,
            window_replies: Vec::new(),
            per_target: vec![0; targets],
            per_uri: vec![0; uris],
            abandoned: 0,
        }
    }

    /// Add another thread's figures (run concurrently over the same wall time).
    pub fn merge(&mut self, o: &Stats) {
        self.duration = self.duration.max(o.duration);
        self.conns_initiated += o.conns_initiated;
        self.conns_completed += o.conns_completed;
        self.conn_time
            .add(&o.conn_time)
            .expect("same histogram bounds");
        self.connect_us += o.connect_us;
        self.connects += o.connects;
        self.max_concurrent += o.max_concurrent;
        self.max_burst = self.max_burst.max(o.max_burst);
        self.requests += o.requests;
        self.request_bytes += o.request_bytes;
        self.replies += o.replies;
        for (a, b) in self.status.iter_mut().zip(o.status) {
            *a += b;
        }
        self.header_bytes += o.header_bytes;
        self.content_bytes += o.content_bytes;
        self.footer_bytes += o.footer_bytes;
        self.response_us += o.response_us;
        self.transfer_us += o.transfer_us;
        self.latency.add(&o.latency).expect("same histogram bounds");
        self.errors.merge(&o.errors);
        self.bytes_sent += o.bytes_sent;
        self.bytes_received += o.bytes_received;
        let n = self.window_replies.len().min(o.window_replies.len());
        self.window_replies.truncate(n);
        for (a, b) in self.window_replies.iter_mut().zip(&o.window_replies) {
            *a += b;
        }
        for (a, b) in self.per_target.iter_mut().zip(&o.per_target) {
            *a += b;
        }
        for (a, b) in self.per_uri.iter_mut().zip(&o.per_uri) {
            *a += b;
        }
        self.abandoned += o.abandoned;
    }

    /// Reply rates of the full 5-second windows, replies/s.
    pub fn rate_samples(&self) -> Vec<f64> {
        let w = SAMPLE_WINDOW.as_secs_f64();
        self.window_replies.iter().map(|&n| n as f64 / w).collect()
    }
}

/// min, avg, max, stddev (population) of a sample list; zeros when empty.
pub fn summary(xs: &[f64]) -> [f64; 4] {
    if xs.is_empty() {
        return [0.0; 4];
    }
    let n = xs.len() as f64;
    let avg = xs.iter().sum::<f64>() / n;
    let min = xs.iter().copied().fold(f64::INFINITY, f64::min);
    let max = xs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let var = xs.iter().map(|x| (x - avg) * (x - avg)).sum::<f64>() / n;
    [min, avg, max, var.sqrt()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errno_classes() {
        assert_eq!(
            ErrorKind::from_errno(libc::ECONNREFUSED),
            ErrorKind::ConnRefused
        );
        assert_eq!(
            ErrorKind::from_errno(libc::EADDRNOTAVAIL),
            ErrorKind::AddrUnavail
        );
        assert_eq!(ErrorKind::from_errno(libc::EMFILE), ErrorKind::FdUnavail);
        let mut e = Errors::default();
        e.add(ErrorKind::ConnReset);
        e.add(ErrorKind::Other);
        assert_eq!(e.total(), 2);
    }

    #[test]
    fn merge_sums_and_aligns_windows() {
        let mut a = Stats::new(2, 0);
        let mut b = Stats::new(2, 0);
        a.window_replies = vec![10, 20];
        b.window_replies = vec![1];
        a.per_target[1] = 3;
        b.per_target[1] = 4;
        a.merge(&b);
        assert_eq!(a.window_replies, vec![11]);
        assert_eq!(a.per_target, vec![0, 7]);
        assert_eq!(summary(&[1.0, 3.0]), [1.0, 2.0, 3.0, 1.0]);
    }
}
