//! Gives the heap that teardown freed back to the system.
//!
//! glibc keeps freed chunks in its arenas. After cells died, their VMs were
//! destroyed and the control clients that asked for it were gone, the
//! parent's RSS stayed ~13% above its start with nothing of theirs live
//! (`experiments/bench/cell_chaos.py` at 400 VMs, 1,416 VMs replaced). The
//! parent trims after such teardown, at most once a second, on its own loop.

use std::time::{Duration, Instant};

/// Shortest time between two trims.
const MIN_INTERVAL: Duration = Duration::from_secs(1);

/// Whether memory was freed since the last trim, and when that was.
#[derive(Debug)]
pub struct HeapTrim {
    due: bool,
    last: Instant,
}

impl HeapTrim {
    /// Nothing freed yet.
    pub fn new() -> Self {
        HeapTrim {
            due: false,
            last: Instant::now(),
        }
    }

    /// Something was freed: a VM unregistered, a cell ended, a client left.
    pub fn freed(&mut self) {
        self.due = true;
    }

    /// Trims if memory was freed and the last trim is a second old; the
    /// longest the loop should sleep before calling again, if a trim waits.
    pub fn tick(&mut self) -> Option<Duration> {
        if !self.due {
            return None;
        }
        let since = self.last.elapsed();
        if since < MIN_INTERVAL {
            return Some(MIN_INTERVAL - since);
        }
        // SAFETY: malloc_trim only returns free heap pages to the system.
        unsafe { libc::malloc_trim(0) };
        self.due = false;
        self.last = Instant::now();
        None
    }
}

impl Default for HeapTrim {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_freed_asks_for_no_wake_up() {
        let mut trim = HeapTrim::new();
        assert_eq!(trim.tick(), None);
        assert!(!trim.due);
    }

    #[test]
    fn a_free_soon_after_a_trim_waits_out_the_interval() {
        let mut trim = HeapTrim::new();
        trim.freed();
        let wait = trim.tick().expect("the last trim is under a second old");
        assert!(wait > Duration::ZERO && wait <= MIN_INTERVAL);
        assert!(trim.due, "still to be done");
    }

    #[test]
    fn a_free_after_the_interval_is_trimmed_at_once() {
        let mut trim = HeapTrim::new();
        trim.last -= MIN_INTERVAL;
        trim.freed();
        let before = Instant::now();
        assert_eq!(trim.tick(), None);
        assert!(!trim.due && trim.last >= before);
        assert_eq!(trim.tick(), None, "nothing freed since");
    }
}
