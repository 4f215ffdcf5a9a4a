//! What crosses the boundary between the parent and a cell: the messages
//! ([`protocol`]), their framing on the socket ([`framing`]), descriptors
//! passed with them ([`fds`]), what a cell reports to the parent's
//! pager ([`pager_link`]), and its wake-latency histogram ([`wake_latency`]).

pub mod fds;
pub mod framing;
pub mod pager_link;
pub mod protocol;
pub mod wake_latency;
