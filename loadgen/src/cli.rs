//! Command-line flags (httperf's names plus zipfperf's own) and their
//! validation into a [`Config`] the drivers run from.

use std::fs;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, ToSocketAddrs};
use std::time::Duration;

use clap::Parser;
use serde::Serialize;
use thiserror::Error;

/// Default per-call timeout in seconds. httperf's default is "infinity";
/// zipfperf bounds every run, so it uses a finite default.
pub const DEFAULT_TIMEOUT_S: f64 = 5.0;

/// Lowest non-zero --rate (one connection every 1,000 s).
const MIN_RATE: f64 = 0.001;
/// Most targets (a /8 worth of addresses).
const MAX_TARGETS: u32 = 1 << 24;

/// Flags as given on the command line. Every field is echoed in the JSON
/// document's `config` object.
#[derive(Parser, Debug, Clone, Serialize)]
#[command(
    name = "zipfperf",
    version,
    about = "httperf-style HTTP load generator with Zipf popularity over targets"
)]
pub struct Args {
    /// Server host name or IPv4 address (ignored for addresses when --targets is given).
    #[arg(long, default_value = "localhost")]
    pub server: String,
    /// Server TCP port.
    #[arg(long, default_value_t = 80)]
    pub port: u16,
    /// URI requested on every call (unless --wlog gives a list).
    #[arg(long, default_value = "/")]
    pub uri: String,
    /// New connections per second in open loop; 0 opens them one after another.
    #[arg(long, default_value_t = 0.0)]
    pub rate: f64,
    /// Total connections to open in open loop (default 1 unless --duration is given).
    #[arg(long)]
    pub num_conns: Option<u64>,
    /// Requests issued on each connection, one after another. Default: 1 in
    /// open loop; unbounded (keep-alive until the end) in closed loop, where
    /// a connection that has made its calls is replaced by a new one.
    #[arg(long)]
    pub num_calls: Option<u64>,
    /// Seconds allowed for connecting, sending, and each reply's progress.
    #[arg(long, default_value_t = DEFAULT_TIMEOUT_S)]
    pub timeout: f64,
    /// Extra seconds the server may take before the first byte of a reply.
    #[arg(long, default_value_t = 0.0)]
    pub think_timeout: f64,
    /// `y,FILE` or `n,FILE`: URIs from a NUL-separated file, taken in order
    /// (y: wrap around at the end; n: stop the run at the end).
    #[arg(long)]
    pub wlog: Option<String>,
    /// Accepted for httperf compatibility (zipfperf always manages its own ports).
    #[arg(long)]
    pub hog: bool,
    /// Number of targets: target i is at --addr-base + i, port --port.
    #[arg(long)]
    pub targets: Option<u32>,
    /// First target address (target i = addr-base + i).
    #[arg(long, default_value = "127.1.0.0")]
    pub addr_base: Ipv4Addr,
    /// Zipf exponent over targets (0 = uniform).
    #[arg(long, default_value_t = 0.0)]
    pub alpha: f64,
    /// Rank-to-target mapping: identity (rank r -> target r) or permute
    /// (a permutation drawn from --seed).
    #[arg(long, value_enum, default_value_t = Mapping::Identity)]
    pub mapping: Mapping,
    /// Seed of the popularity samplers and of the permutation.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Zipf exponent over the URIs of --wlog (rank = position in the file);
    /// without it URIs are taken in file order.
    #[arg(long)]
    pub uri_zipf: Option<f64>,
    /// Closed loop: this many keep-alive connections, each sending its next
    /// request as soon as a reply is complete (needs --duration).
    #[arg(long)]
    pub concurrency: Option<u32>,
    /// Seconds the run lasts at most.
    #[arg(long)]
    pub duration: Option<f64>,
    /// Write the JSON document to this path (`-` for stdout, replacing the text report).
    #[arg(long)]
    pub json: Option<String>,
    /// Event-loop threads; rate, connections and concurrency are split among them.
    #[arg(long, default_value_t = 1)]
    pub threads: u32,
    /// Client source addresses: `auto` (spread over 127.2.0.0/16 when every
    /// target is on loopback), `off`, or an IPv4 CIDR such as 127.3.0.0/16.
    #[arg(long, default_value = "auto")]
    pub source_addrs: String,
    /// Close connections with SO_LINGER 0 (a reset, so no TIME_WAIT anywhere).
    #[arg(long)]
    pub linger0: bool,
    /// Measure the Zipf sampler's speed over this many samples and exit.
    #[arg(long, hide = true)]
    pub bench_sampler: Option<u64>,
}

/// How popularity ranks map onto target indices.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mapping {
    /// Rank r is target r.
    Identity,
    /// Rank r is target perm[r], perm drawn from --seed.
    Permute,
}

/// A flag combination or value zipfperf refuses.
#[derive(Debug, Error)]
pub enum CliError {
    /// A value outside its allowed range.
    #[error("--{flag}: {why}")]
    Invalid {
        /// Flag name without dashes.
        flag: &'static str,
        /// What is wrong with it.
        why: String,
    },
    /// Two flags that cannot be used together.
    #[error("--{0} cannot be combined with --{1}")]
    Conflict(&'static str, &'static str),
    /// The server name does not resolve to an IPv4 address.
    #[error("--server {0}: no IPv4 address found")]
    Resolve(String),
    /// The --wlog file cannot be read.
    #[error("--wlog {path}: {err}")]
    Wlog {
        /// File path.
        path: String,
        /// The I/O error.
        err: std::io::Error,
    },
}

/// Where URIs come from.
#[derive(Debug, Clone)]
pub enum UriPlan {
    /// The same URI on every call.
    Fixed(String),
    /// URIs of a --wlog file in order; `wrap` = start again at the end.
    Sequence {
        /// The URIs.
        uris: Vec<String>,
        /// Whether to wrap around.
        wrap: bool,
    },
    /// URIs of a --wlog file drawn by Zipf rank (position in the file).
    Zipf {
        /// The URIs.
        uris: Vec<String>,
        /// The exponent.
        alpha: f64,
    },
}

/// Source addresses client sockets bind to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SourceRange {
    /// First address of the range.
    pub base: Ipv4Addr,
    /// Number of addresses.
    pub len: u32,
}

/// Which loop drives the load.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Mode {
    /// New connections at `rate` per second (0: one after another), each
    /// carrying `calls` requests; at most `conns` of them (None: until the
    /// duration ends).
    Open {
        /// Connections per second, 0 for sequential.
        rate: f64,
        /// Total connections, if bounded.
        conns: Option<u64>,
        /// Requests per connection.
        calls: u64,
    },
    /// `concurrency` connections kept busy until the duration ends, each
    /// carrying `calls` requests (u64::MAX: unbounded) before it is replaced.
    Closed {
        /// Connections kept open.
        concurrency: u32,
        /// Requests per connection.
        calls: u64,
    },
}

/// A validated run description.
#[derive(Debug, Clone)]
pub struct Config {
    /// Open or closed loop.
    pub mode: Mode,
    /// Target addresses; index = target id.
    pub targets: Vec<SocketAddrV4>,
    /// Host header per target (the --server name for a single target).
    pub host_headers: Vec<String>,
    /// Zipf exponent over targets.
    pub alpha: f64,
    /// Rank-to-target mapping.
    pub mapping: Mapping,
    /// Sampler seed.
    pub seed: u64,
    /// URI source.
    pub uris: UriPlan,
    /// Per-call timeout.
    pub timeout: Duration,
    /// Extra time allowed before a reply's first byte.
    pub think_timeout: Duration,
    /// Run length bound.
    pub duration: Option<Duration>,
    /// Source address range, if spreading.
    pub source: Option<SourceRange>,
    /// SO_LINGER 0 on close.
    pub linger0: bool,
    /// Event-loop threads.
    pub threads: u32,
}

fn invalid(flag: &'static str, why: impl Into<String>) -> CliError {
    CliError::Invalid {
        flag,
        why: why.into(),
    }
}

fn seconds(flag: &'static str, v: f64) -> Result<Duration, CliError> {
    if !(0.0..=1e9).contains(&v) {
        return Err(invalid(
            flag,
            format!("{v} is not a number of seconds >= 0"),
        ));
    }
    Ok(Duration::from_secs_f64(v))
}

fn parse_source(spec: &str, targets: &[SocketAddrV4]) -> Result<Option<SourceRange>, CliError> {
    match spec {
        "off" => Ok(None),
        "auto" => Ok(targets
            .iter()
            .all(|t| t.ip().is_loopback())
            .then_some(SourceRange {
                base: Ipv4Addr::new(127, 2, 0, 0),
                len: 1 << 16,
            })),
        _ => {
            let bad = || {
                invalid(
                    "source-addrs",
                    format!("{spec:?} is not auto, off or A.B.C.D/LEN"),
                )
            };
            let (addr, len) = spec.split_once('/').ok_or_else(bad)?;
            let addr: Ipv4Addr = addr.parse().map_err(|_| bad())?;
            let len: u32 = len.parse().map_err(|_| bad())?;
            if !(8..=32).contains(&len) {
                return Err(invalid("source-addrs", "prefix length must be 8..32"));
            }
            let mask = if len == 32 {
                u32::MAX
            } else {
                !(u32::MAX >> len)
            };
            Ok(Some(SourceRange {
                base: Ipv4Addr::from(u32::from(addr) & mask),
                len: 1u32 << (32 - len),
            }))
        }
    }
}

fn read_wlog(spec: &str) -> Result<(Vec<String>, bool), CliError> {
    let (flag, path) = spec
        .split_once(',')
        .ok_or_else(|| invalid("wlog", "expected y,FILE or n,FILE"))?;
    let wrap = match flag {
        "y" => true,
        "n" => false,
        _ => return Err(invalid("wlog", "expected y,FILE or n,FILE")),
    };
    let bytes = fs::read(path).map_err(|err| CliError::Wlog {
        path: path.to_string(),
        err,
    })?;
    let uris: Vec<String> = bytes
        .split(|&b| b == 0)
        .filter(|u| !u.is_empty())
        .map(|u| String::from_utf8_lossy(u).trim().to_string())
        .filter(|u| !u.is_empty())
        .collect();
    if uris.is_empty() {
        return Err(invalid("wlog", format!("{path} holds no URIs")));
    }
    if let Some(bad) = uris
        .iter()
        .find(|u| u.bytes().any(|b| b.is_ascii_whitespace()))
    {
        return Err(invalid("wlog", format!("URI {bad:?} contains whitespace")));
    }
    Ok((uris, wrap))
}

fn resolve(server: &str, port: u16) -> Result<SocketAddrV4, CliError> {
    (server, port)
        .to_socket_addrs()
        .map_err(|_| CliError::Resolve(server.to_string()))?
        .find_map(|a| match a {
            SocketAddr::V4(v4) => Some(v4),
            SocketAddr::V6(_) => None,
        })
        .ok_or_else(|| CliError::Resolve(server.to_string()))
}

impl Args {
    /// Check the flags and build the run description.
    pub fn validate(&self) -> Result<Config, CliError> {
        if self.port == 0 {
            return Err(invalid("port", "must be 1..65535"));
        }
        if !self.uri.starts_with('/') || self.uri.bytes().any(|b| b.is_ascii_whitespace()) {
            return Err(invalid(
                "uri",
                "must start with / and contain no whitespace",
            ));
        }
        if !self.rate.is_finite() || self.rate < 0.0 || (self.rate > 0.0 && self.rate < MIN_RATE) {
            return Err(invalid(
                "rate",
                format!("must be 0 or a number >= {MIN_RATE}"),
            ));
        }
        if self.num_calls == Some(0) {
            return Err(invalid("num-calls", "must be >= 1"));
        }
        if self.num_conns == Some(0) {
            return Err(invalid("num-conns", "must be >= 1"));
        }
        let timeout = seconds("timeout", self.timeout)?;
        if timeout.is_zero() {
            return Err(invalid("timeout", "must be > 0"));
        }
        let think_timeout = seconds("think-timeout", self.think_timeout)?;
        let duration = self.duration.map(|d| seconds("duration", d)).transpose()?;
        if duration.is_some_and(|d| d.is_zero()) {
            return Err(invalid("duration", "must be > 0"));
        }
        if !self.alpha.is_finite() || self.alpha < 0.0 {
            return Err(invalid("alpha", "must be a number >= 0"));
        }
        if self.threads == 0 || self.threads > 64 {
            return Err(invalid("threads", "must be 1..64"));
        }
        let mode = match self.concurrency {
            Some(c) => {
                if c == 0 {
                    return Err(invalid("concurrency", "must be >= 1"));
                }
                if self.num_conns.is_some() {
                    return Err(CliError::Conflict("concurrency", "num-conns"));
                }
                if self.rate != 0.0 {
                    return Err(CliError::Conflict("concurrency", "rate"));
                }
                if duration.is_none() {
                    return Err(invalid("concurrency", "needs --duration"));
                }
                if c < self.threads {
                    return Err(invalid("threads", "must not exceed --concurrency"));
                }
                Mode::Closed {
                    concurrency: c,
                    calls: self.num_calls.unwrap_or(u64::MAX),
                }
            }
            None => Mode::Open {
                rate: self.rate,
                conns: self
                    .num_conns
                    .or(if duration.is_some() { None } else { Some(1) }),
                calls: self.num_calls.unwrap_or(1),
            },
        };
        let (targets, host_headers) = match self.targets {
            Some(n) => {
                if n == 0 || n > MAX_TARGETS {
                    return Err(invalid("targets", format!("must be 1..{MAX_TARGETS}")));
                }
                let base = u32::from(self.addr_base);
                if base.checked_add(n - 1).is_none() {
                    return Err(invalid("targets", "addr-base + targets overflows IPv4"));
                }
                let addrs: Vec<SocketAddrV4> = (0..n)
                    .map(|i| SocketAddrV4::new(Ipv4Addr::from(base + i), self.port))
                    .collect();
                let hosts = addrs.iter().map(|a| a.ip().to_string()).collect();
                (addrs, hosts)
            }
            None => (
                vec![resolve(&self.server, self.port)?],
                vec![self.server.clone()],
            ),
        };
        let uris = match (&self.wlog, self.uri_zipf) {
            (None, None) => UriPlan::Fixed(self.uri.clone()),
            (None, Some(_)) => return Err(invalid("uri-zipf", "needs --wlog (the URI list)")),
            (Some(spec), None) => {
                let (uris, wrap) = read_wlog(spec)?;
                UriPlan::Sequence { uris, wrap }
            }
            (Some(spec), Some(alpha)) => {
                if !alpha.is_finite() || alpha < 0.0 {
                    return Err(invalid("uri-zipf", "must be a number >= 0"));
                }
                let (uris, _) = read_wlog(spec)?;
                UriPlan::Zipf { uris, alpha }
            }
        };
        if matches!(uris, UriPlan::Sequence { .. }) && self.threads > 1 {
            return Err(CliError::Conflict("wlog", "threads"));
        }
        let source = parse_source(&self.source_addrs, &targets)?;
        Ok(Config {
            mode,
            targets,
            host_headers,
            alpha: self.alpha,
            mapping: self.mapping,
            seed: self.seed,
            uris,
            timeout,
            think_timeout,
            duration,
            source,
            linger0: self.linger0,
            threads: self.threads,
        })
    }

    /// The command line in httperf's style, for the report's first line.
    pub fn echo(&self) -> String {
        let mut s = format!(
            "zipfperf --timeout={} --server={} --port={} --uri={}",
            self.timeout, self.server, self.port, self.uri
        );
        match self.concurrency {
            Some(c) => {
                s.push_str(&format!(" --concurrency={c}"));
                if let Some(n) = self.num_calls {
                    s.push_str(&format!(" --num-calls={n}"));
                }
            }
            None => {
                s.push_str(&format!(" --rate={}", self.rate));
                if let Some(n) = self.num_conns {
                    s.push_str(&format!(" --num-conns={n}"));
                }
                s.push_str(&format!(" --num-calls={}", self.num_calls.unwrap_or(1)));
            }
        }
        if let Some(d) = self.duration {
            s.push_str(&format!(" --duration={d}"));
        }
        if let Some(n) = self.targets {
            s.push_str(&format!(
                " --targets={n} --addr-base={} --alpha={} --seed={}",
                self.addr_base, self.alpha, self.seed
            ));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Config, String> {
        let mut v = vec!["zipfperf"];
        v.extend_from_slice(args);
        let a = Args::try_parse_from(v).map_err(|e| e.to_string())?;
        a.validate().map_err(|e| e.to_string())
    }

    #[test]
    fn httperf_style_flags_parse() {
        let c = parse(&[
            "--server=127.0.0.1",
            "--port=8080",
            "--rate=100",
            "--num-conns=50",
            "--num-calls",
            "3",
            "--hog",
        ])
        .unwrap();
        assert_eq!(
            c.mode,
            Mode::Open {
                rate: 100.0,
                conns: Some(50),
                calls: 3
            }
        );
        assert_eq!(c.targets, vec!["127.0.0.1:8080".parse().unwrap()]);
        assert_eq!(c.source.unwrap().base, Ipv4Addr::new(127, 2, 0, 0));
    }

    #[test]
    fn closed_loop_calls_default_to_unbounded() {
        let c = parse(&["--concurrency=4", "--duration=1"]).unwrap();
        assert_eq!(
            c.mode,
            Mode::Closed {
                concurrency: 4,
                calls: u64::MAX
            }
        );
        let c = parse(&["--concurrency=4", "--duration=1", "--num-calls=1"]).unwrap();
        assert_eq!(
            c.mode,
            Mode::Closed {
                concurrency: 4,
                calls: 1
            }
        );
    }

    #[test]
    fn targets_follow_densevm_convention() {
        let c = parse(&[
            "--targets=301",
            "--addr-base=127.1.0.0",
            "--port=8080",
            "--duration=1",
        ])
        .unwrap();
        assert_eq!(c.targets[300], "127.1.1.44:8080".parse().unwrap());
        assert_eq!(
            c.mode,
            Mode::Open {
                rate: 0.0,
                conns: None,
                calls: 1
            }
        );
    }

    #[test]
    fn bad_values_are_refused() {
        for bad in [
            &["--rate=-1"][..],
            &["--rate=1e-300"],
            &["--targets=4000000000"],
            &["--num-calls=0"],
            &["--timeout=0"],
            &["--alpha=-0.5"],
            &["--concurrency=4"],
            &["--concurrency=4", "--duration=1", "--num-conns=3"],
            &["--targets=0"],
            &["--uri=nope"],
            &["--uri-zipf=1"],
            &["--wlog=x,/nonexistent"],
            &["--source-addrs=10.0.0.0/99"],
            &["--duration=nan"],
            &["--port=70000"],
        ] {
            assert!(parse(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn source_cidr_is_masked() {
        let r = parse_source("127.3.4.5/24", &[]).unwrap().unwrap();
        assert_eq!(
            r,
            SourceRange {
                base: Ipv4Addr::new(127, 3, 4, 0),
                len: 256
            }
        );
        let t = ["10.0.0.1:80".parse().unwrap()];
        assert_eq!(parse_source("auto", &t).unwrap(), None);
    }
}
