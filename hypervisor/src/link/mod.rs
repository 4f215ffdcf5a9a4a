//! What crosses the boundary between the parent and a cell: the messages
//! ([`protocol`]), their framing on the socket ([`framing`]), and what a
//! cell reports to the parent's pager ([`pager_link`]).

pub mod framing;
pub mod pager_link;
pub mod protocol;
