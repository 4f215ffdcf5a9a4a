//! What a cell's event loop tells the pager. The pager lives in the parent
//! process and holds the cell's guest memory; the cell only reports what
//! the pager cannot see from there.

/// The pager, as a cell's event loop sees it.
pub trait PagerLink {
    /// VM `vm` served `requests` more requests: the policy's reference bit,
    /// and the request trace when one is recorded.
    fn requests_served(&mut self, vm: u32, requests: u64);

    /// VM `vm` stopped for good (its vCPU no longer runs): the pager may
    /// release its memory and swap.
    fn vm_stopped(&mut self, vm: u32);
}
