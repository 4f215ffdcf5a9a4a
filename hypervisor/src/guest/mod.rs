//! The guest as the host lays it out: the ABI shared with webguest, its
//! boot state and RAM layout, the loaded image, and the host mappings that
//! back guest memory.

pub mod abi;
pub mod boot;
pub mod loader;
pub mod memory;
