//! The densevm pager and its simulator.
//!
//! * [`Pager`]: serves userfaultfd faults of every VM's RAM within a global
//!   memory budget, evicting by a [`policy::Policy`] to a swap device, with
//!   an optional [`disk`] model.
//! * [`sim`]: the trace-driven simulator behind the `pagesim` binary; it
//!   drives the same ledger and policies without real memory. [`replay`]
//!   holds pagesim's options and replay loop (shared with the Python
//!   extension, `pagesim-py`).
//!
//! Modules, one concern each: [`uffd`] (userfaultfd), [`guest_memory`]
//! (memfd-backed guest RAM handed to the pager), [`ledger`] (budget and
//! block accounting), [`policy`] (trait, built-ins, plugin loader),
//! [`space`] (swap layouts), [`swap`] (the O_DIRECT device), [`compact`]
//! (template-delta, compressed swap records), [`disk`] (disk models),
//! [`stats`], [`trace`], [`config`], [`error`].

pub mod batching;
pub mod compact;
pub mod config;
pub mod describe;
pub mod disk;
pub mod error;
pub mod guest_memory;
pub mod injected;
pub mod ledger;
pub mod pager;
pub mod policy;
pub mod replay;
pub mod sim;
pub mod space;
pub mod stats;
pub mod swap;
pub mod trace;
pub mod uffd;
pub mod units;

pub use config::PagerConfig;
pub use disk::DiskSpec;
pub use error::PagerError;
pub use guest_memory::{GuestMemory, SpaceHandoff, SpaceId};
pub use pager::{CloneTemplate, Pager, PagerFailure};
pub use policy::PolicySpec;
pub use units::parse_size;
