//! The httperf-style text report: same line prefixes, field order and
//! number formats as httperf 0.9.0, so scripts that parse httperf keep
//! working, plus one extra line with latency percentiles.

use std::fmt::Write;

use crate::stats::{summary, Stats};

/// CPU time this process used, seconds.
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuTime {
    /// User time.
    pub user: f64,
    /// System time.
    pub system: f64,
}

impl CpuTime {
    /// This process's CPU time so far (all threads).
    pub fn of_process() -> Self {
        // SAFETY: getrusage fills the zeroed struct it is given.
        let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: ru is a valid rusage to fill.
        unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
        let secs = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6;
        CpuTime {
            user: secs(ru.ru_utime),
            system: secs(ru.ru_stime),
        }
    }
}

/// Divide, giving 0 for an empty denominator.
pub fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        0.0
    }
}

/// Connection-time figures in ms: min, avg, max, median, stddev.
pub fn conn_time_ms(s: &Stats) -> [f64; 5] {
    let h = &s.conn_time;
    if h.is_empty() {
        return [0.0; 5];
    }
    let ms = |us: f64| us / 1000.0;
    [
        ms(h.min() as f64),
        ms(h.mean()),
        ms(h.max() as f64),
        ms(h.value_at_quantile(0.5) as f64),
        ms(h.stdev()),
    ]
}

/// Reply latency in ms: mean, p50, p90, p99, p99.9, max.
pub fn latency_ms(s: &Stats) -> [f64; 6] {
    let h = &s.latency;
    if h.is_empty() {
        return [0.0; 6];
    }
    let q = |x: f64| h.value_at_quantile(x) as f64 / 1000.0;
    [
        h.mean() / 1000.0,
        q(0.5),
        q(0.9),
        q(0.99),
        q(0.999),
        h.max() as f64 / 1000.0,
    ]
}

/// The report body (after the echoed command line).
pub fn text(s: &Stats, cpu: CpuTime) -> String {
    let d = s.duration.as_secs_f64();
    let conns = s.conns_initiated as f64;
    let replies = s.replies as f64;
    let mut o = String::new();
    let _ = writeln!(o, "Maximum connect burst length: {}", s.max_burst);
    let _ = writeln!(o);
    let _ = writeln!(
        o,
        "Total: connections {} requests {} replies {} test-duration {:.3} s",
        s.conns_initiated, s.requests, s.replies, d
    );
    let _ = writeln!(o);
    let _ = writeln!(
        o,
        "Connection rate: {:.1} conn/s ({:.1} ms/conn, <={} concurrent connections)",
        ratio(conns, d),
        ratio(1000.0 * d, conns),
        s.max_concurrent
    );
    let [min, avg, max, median, sd] = conn_time_ms(s);
    let _ = writeln!(o, "Connection time [ms]: min {min:.1} avg {avg:.1} max {max:.1} median {median:.1} stddev {sd:.1}");
    let _ = writeln!(
        o,
        "Connection time [ms]: connect {:.1}",
        ratio(s.connect_us, s.connects as f64) / 1000.0
    );
    let _ = writeln!(
        o,
        "Connection length [replies/conn]: {:.3}",
        ratio(replies, s.conns_completed as f64)
    );
    let _ = writeln!(o);
    let reqs = s.requests as f64;
    let _ = writeln!(
        o,
        "Request rate: {:.1} req/s ({:.1} ms/req)",
        ratio(reqs, d),
        ratio(1000.0 * d, reqs)
    );
    let _ = writeln!(
        o,
        "Request size [B]: {:.1}",
        ratio(s.request_bytes as f64, reqs)
    );
    let _ = writeln!(o);
    let samples = s.rate_samples();
    let [rmin, ravg, rmax, rsd] = summary(&samples);
    let _ = writeln!(
        o,
        "Reply rate [replies/s]: min {rmin:.1} avg {ravg:.1} max {rmax:.1} stddev {rsd:.1} ({} samples)",
        samples.len()
    );
    let _ = writeln!(
        o,
        "Reply time [ms]: response {:.1} transfer {:.1}",
        ratio(s.response_us, replies) / 1000.0,
        ratio(s.transfer_us, replies) / 1000.0
    );
    let (h, c, f) = (
        ratio(s.header_bytes as f64, replies),
        ratio(s.content_bytes as f64, replies),
        ratio(s.footer_bytes as f64, replies),
    );
    let _ = writeln!(
        o,
        "Reply size [B]: header {h:.1} content {c:.1} footer {f:.1} (total {:.1})",
        h + c + f
    );
    let st = s.status;
    let _ = writeln!(
        o,
        "Reply status: 1xx={} 2xx={} 3xx={} 4xx={} 5xx={}",
        st[0], st[1], st[2], st[3], st[4]
    );
    let [mean, p50, p90, p99, p999, lmax] = latency_ms(s);
    let _ = writeln!(
        o,
        "Reply latency [ms]: mean {mean:.3} p50 {p50:.3} p90 {p90:.3} p99 {p99:.3} p99.9 {p999:.3} max {lmax:.3}"
    );
    let _ = writeln!(o);
    let _ = writeln!(
        o,
        "CPU time [s]: user {:.2} system {:.2} (user {:.1}% system {:.1}% total {:.1}%)",
        cpu.user,
        cpu.system,
        ratio(100.0 * cpu.user, d),
        ratio(100.0 * cpu.system, d),
        ratio(100.0 * (cpu.user + cpu.system), d)
    );
    let bytes = (s.bytes_sent + s.bytes_received) as f64;
    let _ = writeln!(
        o,
        "Net I/O: {:.1} KB/s ({:.1}*10^6 bps)",
        ratio(bytes, d) / 1024.0,
        ratio(8.0 * bytes, d) / 1e6
    );
    let _ = writeln!(o);
    let e = s.errors;
    let _ = writeln!(
        o,
        "Errors: total {} client-timo {} socket-timo {} connrefused {} connreset {}",
        e.total(),
        e.client_timo,
        e.socket_timo,
        e.connrefused,
        e.connreset
    );
    let _ = writeln!(
        o,
        "Errors: fd-unavail {} addrunavail {} ftab-full {} other {}",
        e.fd_unavail, e.addrunavail, e.ftab_full, e.other
    );
    o
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn lines_keep_httperf_prefixes_and_order() {
        let mut s = Stats::new(1, 0);
        s.duration = Duration::from_secs(10);
        s.conns_initiated = 100;
        s.conns_completed = 100;
        s.requests = 100;
        s.replies = 100;
        s.status[1] = 100;
        s.window_replies = vec![50, 50];
        let t = text(&s, CpuTime::default());
        let prefixes: Vec<&str> = t
            .lines()
            .filter(|l| !l.is_empty())
            .map(|l| l.split(':').next().unwrap())
            .collect();
        assert_eq!(
            prefixes,
            [
                "Maximum connect burst length",
                "Total",
                "Connection rate",
                "Connection time [ms]",
                "Connection time [ms]",
                "Connection length [replies/conn]",
                "Request rate",
                "Request size [B]",
                "Reply rate [replies/s]",
                "Reply time [ms]",
                "Reply size [B]",
                "Reply status",
                "Reply latency [ms]",
                "CPU time [s]",
                "Net I/O",
                "Errors",
                "Errors"
            ]
        );
        assert!(
            t.contains("Total: connections 100 requests 100 replies 100 test-duration 10.000 s")
        );
        assert!(
            t.contains("Reply rate [replies/s]: min 10.0 avg 10.0 max 10.0 stddev 0.0 (2 samples)")
        );
        assert!(t.contains("Reply status: 1xx=0 2xx=100 3xx=0 4xx=0 5xx=0"));
    }
}
