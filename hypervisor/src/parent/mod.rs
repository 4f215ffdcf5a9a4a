//! The parent process (`densevm serve`, and `densevm describe`): it checks
//! the configuration, owns the pager and the control API, starts the cells
//! and supervises them.

pub mod api;
pub mod cell_handle;
pub mod describe;
pub mod heap_trim;
pub mod serve;
pub mod steering;
pub mod supervisor;
