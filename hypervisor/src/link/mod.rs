//! What crosses the boundary between the parent and a cell: the messages
//! ([`protocol`]), their framing on the socket ([`framing`]), descriptors
//! passed with them ([`fds`]), what a cell reports to the parent's
//! pager ([`pager_link`]), its wake-latency histogram ([`wake_latency`]),
//! and what its VMs' idleness tells the parent for `--max-live`
//! ([`idle_profile`]).

pub mod fds;
pub mod framing;
pub mod idle_profile;
pub mod pager_link;
pub mod protocol;
pub mod wake_latency;
