//! Paravirtual devices: the stream device that carries connection bytes
//! between host sockets and the guest.

pub mod stream;
