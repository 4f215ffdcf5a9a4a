//! What each connection and call asks for: the target (Zipf over targets),
//! the URI (fixed, a --wlog sequence, or Zipf over the --wlog list) and the
//! client source address.

use std::net::{Ipv4Addr, SocketAddrV4};

use rand::rngs::SmallRng;
use rand::SeedableRng;

use crate::cli::{Config, Mapping, SourceRange, UriPlan};
use crate::popularity::{Popularity, PopularityError};

/// Seed offset between threads' samplers.
const THREAD_SEED_STRIDE: u64 = 0x9e37_79b9_7f4a_7c15;

/// Picks the target of each new connection.
#[derive(Debug)]
pub struct TargetPicker {
    pop: Option<Popularity>,
    rng: SmallRng,
}

impl TargetPicker {
    /// The picker for thread `thread` of a run.
    pub fn new(cfg: &Config, thread: u32) -> Result<Self, PopularityError> {
        let n = cfg.targets.len() as u32;
        let perm_seed = (cfg.mapping == Mapping::Permute).then_some(cfg.seed);
        let pop = if n > 1 {
            Some(Popularity::new(n, cfg.alpha, perm_seed)?)
        } else {
            None
        };
        let rng = SmallRng::seed_from_u64(
            cfg.seed
                .wrapping_add(u64::from(thread).wrapping_mul(THREAD_SEED_STRIDE)),
        );
        Ok(TargetPicker { pop, rng })
    }

    /// Index of the next connection's target.
    pub fn next(&mut self) -> u32 {
        match &self.pop {
            Some(p) => p.sample(&mut self.rng),
            None => 0,
        }
    }
}

/// Picks the URI of each call.
#[derive(Debug)]
pub enum UriPicker {
    /// Always the same URI.
    Fixed(String),
    /// The list in order; `next` is the position of the next URI.
    Sequence {
        /// URIs.
        uris: Vec<String>,
        /// Next position.
        next: usize,
        /// Wrap around at the end (otherwise the list runs out).
        wrap: bool,
    },
    /// Zipf over the list's positions.
    Zipf {
        /// URIs.
        uris: Vec<String>,
        /// Rank distribution (identity mapping: rank = position).
        pop: Popularity,
        /// Sampler state.
        rng: SmallRng,
    },
}

impl UriPicker {
    /// The picker for thread `thread` of a run.
    pub fn new(cfg: &Config, thread: u32) -> Result<Self, PopularityError> {
        Ok(match &cfg.uris {
            UriPlan::Fixed(u) => UriPicker::Fixed(u.clone()),
            UriPlan::Sequence { uris, wrap } => UriPicker::Sequence {
                uris: uris.clone(),
                next: 0,
                wrap: *wrap,
            },
            UriPlan::Zipf { uris, alpha } => UriPicker::Zipf {
                pop: Popularity::new(uris.len() as u32, *alpha, None)?,
                uris: uris.clone(),
                rng: SmallRng::seed_from_u64(
                    (cfg.seed ^ 0x5572_695a)
                        .wrapping_add(u64::from(thread).wrapping_mul(THREAD_SEED_STRIDE)),
                ),
            },
        })
    }

    /// Number of listed URIs (0 for a fixed URI).
    pub fn listed(&self) -> usize {
        match self {
            UriPicker::Fixed(_) => 0,
            UriPicker::Sequence { uris, .. } | UriPicker::Zipf { uris, .. } => uris.len(),
        }
    }

    /// The next call's URI and its list index; None when a non-wrapping
    /// list has run out.
    pub fn next(&mut self) -> Option<(&str, Option<usize>)> {
        match self {
            UriPicker::Fixed(u) => Some((u.as_str(), None)),
            UriPicker::Sequence { uris, next, wrap } => {
                if *next == uris.len() {
                    if !*wrap {
                        return None;
                    }
                    *next = 0;
                }
                *next += 1;
                Some((uris[*next - 1].as_str(), Some(*next - 1)))
            }
            UriPicker::Zipf { uris, pop, rng } => {
                let i = pop.sample(rng) as usize;
                Some((uris[i].as_str(), Some(i)))
            }
        }
    }
}

/// Cycles through the source addresses of one thread.
#[derive(Debug)]
pub struct SourceCursor {
    range: SourceRange,
    next: u32,
    step: u32,
}

impl SourceCursor {
    /// Thread `thread` of `threads` takes every threads-th address.
    pub fn new(range: SourceRange, thread: u32, threads: u32) -> Self {
        SourceCursor {
            range,
            next: thread % range.len,
            step: threads,
        }
    }

    /// The next source address (port 0: the kernel picks the port at connect).
    pub fn next(&mut self) -> SocketAddrV4 {
        loop {
            let off = self.next;
            self.next = (self.next + self.step) % self.range.len;
            let ip = u32::from(self.range.base).wrapping_add(off);
            // Skip network/broadcast-looking addresses when the range is wide.
            let last = ip & 0xff;
            if self.range.len < 256 || (last != 0 && last != 255) {
                return SocketAddrV4::new(Ipv4Addr::from(ip), 0);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn source_cursor_spreads_and_skips_edges() {
        let r = SourceRange {
            base: Ipv4Addr::new(127, 2, 0, 0),
            len: 1 << 16,
        };
        let mut c = SourceCursor::new(r, 0, 1);
        assert_eq!(*c.next().ip(), Ipv4Addr::new(127, 2, 0, 1));
        assert_eq!(*c.next().ip(), Ipv4Addr::new(127, 2, 0, 2));
        let mut t1 = SourceCursor::new(r, 1, 2);
        assert_eq!(*t1.next().ip(), Ipv4Addr::new(127, 2, 0, 1));
        assert_eq!(*t1.next().ip(), Ipv4Addr::new(127, 2, 0, 3));
    }

    #[test]
    fn sequence_wraps_or_runs_out() {
        let uris = vec!["/a".to_string(), "/b".to_string()];
        let mut s = UriPicker::Sequence {
            uris: uris.clone(),
            next: 0,
            wrap: false,
        };
        assert_eq!(s.next(), Some(("/a", Some(0))));
        assert_eq!(s.next(), Some(("/b", Some(1))));
        assert_eq!(s.next(), None);
        let mut w = UriPicker::Sequence {
            uris,
            next: 0,
            wrap: true,
        };
        let got: Vec<_> = (0..3).map(|_| w.next().unwrap().0.to_string()).collect();
        assert_eq!(got, ["/a", "/b", "/a"]);
    }
}
