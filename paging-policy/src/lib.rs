//! The densevm pager.
