//! Error types of the pager.
//!
//! Every variant renders as one line that names the offending setting or
//! operation, because densevm prints it verbatim as `densevm: error: ...`.

use std::io;
use std::path::PathBuf;

/// Everything that can go wrong in the pager, from configuration to a run.
#[derive(Debug, thiserror::Error)]
pub enum PagerError {
    /// A size string (`--mem`, `--block`, ...) could not be parsed.
    #[error(
        "invalid size '{0}': expected a number with an optional k/M/G/T suffix, e.g. 32k or 1G"
    )]
    BadSize(String),
    /// The block size is not a power of two between 4 KiB and 256 KiB.
    #[error("invalid block size {0} bytes: must be a power of two between 4k and 256k")]
    BadBlock(u64),
    /// A VM's RAM is not a whole number of blocks.
    #[error("VM RAM size {ram} bytes is not a multiple of the block size {block} bytes")]
    RamNotBlockMultiple {
        /// VM RAM size in bytes.
        ram: u64,
        /// Block size in bytes.
        block: u64,
    },
    /// The budget cannot hold even one VM's minimum footprint.
    #[error("memory budget {budget} bytes is below one VM's minimum footprint of {footprint} bytes (rounded up to {block}-byte blocks)")]
    BudgetTooSmall {
        /// The configured budget in bytes.
        budget: u64,
        /// The footprint in bytes, rounded up to whole blocks.
        footprint: u64,
        /// Block size in bytes.
        block: u64,
    },
    /// A per-VM quota cannot hold one request's footprint.
    #[error("--vm-resident-max {quota} bytes is below one VM's minimum footprint of {footprint} bytes (rounded up to whole blocks)")]
    QuotaTooSmall {
        /// The configured quota in bytes.
        quota: u64,
        /// The footprint in bytes, rounded up to whole blocks.
        footprint: u64,
    },
    /// The policy name is neither built in nor a path to a shared library.
    #[error("unknown policy '{0}': expected demand, wsswap, wsswap,after=N or a path to a policy shared library (.so)")]
    UnknownPolicy(String),
    /// The policy shared library does not exist.
    #[error("policy plugin {0} not found")]
    PluginMissing(PathBuf),
    /// The policy shared library could not be loaded or is not a policy.
    #[error("policy plugin {path}: {reason}")]
    PluginLoad {
        /// Path of the shared library.
        path: PathBuf,
        /// Why it was refused.
        reason: String,
    },
    /// A policy (usually a plugin) panicked or returned an invalid answer.
    #[error("policy {policy} failed: {reason}")]
    PolicyFailed {
        /// Policy name.
        policy: String,
        /// What it did wrong.
        reason: String,
    },
    /// The `--disk` model string is malformed.
    #[error("invalid disk model '{spec}': {reason}")]
    BadDisk {
        /// The string given.
        spec: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The swap path cannot be created or written.
    #[error("swap {path} is not writable: {source}")]
    SwapUnwritable {
        /// The swap path.
        path: PathBuf,
        /// The underlying error.
        source: io::Error,
    },
    /// The swap path names an existing file or a symlink: the pager
    /// creates its swap file itself, exclusively.
    #[error("swap {0} already exists and is not a block device: the pager creates its swap file itself (0600, exclusively); remove it or name a new path")]
    SwapExists(PathBuf),
    /// The swap size is invalid for the configuration.
    #[error("invalid swap size {bytes} bytes: {reason}")]
    BadSwapSize {
        /// The swap size given.
        bytes: u64,
        /// What is wrong with it.
        reason: String,
    },
    /// The swap device has no room left.
    #[error("swap device full: needed {needed} bytes more, {capacity} bytes configured")]
    SwapFull {
        /// Bytes that could not be placed.
        needed: u64,
        /// Capacity of the swap device in bytes.
        capacity: u64,
    },
    /// The swap file's space could not be reserved (ENOSPC, or a filesystem
    /// without `fallocate`).
    #[error("cannot reserve {bytes} bytes of swap in {path}: {source}")]
    SwapReserve {
        /// The swap path.
        path: PathBuf,
        /// Bytes to reserve from the start of the file.
        bytes: u64,
        /// The underlying error.
        source: io::Error,
    },
    /// A read or write of the swap device failed.
    #[error("swap I/O error ({op} of {len} bytes at offset {offset}): {source}")]
    SwapIo {
        /// "read" or "write".
        op: &'static str,
        /// Byte offset in the swap device.
        offset: u64,
        /// Length of the transfer.
        len: u64,
        /// The underlying error.
        source: io::Error,
    },
    /// A userfaultfd operation failed.
    #[error("userfaultfd {op} failed: {source}")]
    Uffd {
        /// The operation (ioctl name).
        op: &'static str,
        /// The underlying error.
        source: io::Error,
    },
    /// A memory-management call (madvise, mmap) failed.
    #[error("{op} failed: {source}")]
    Mm {
        /// The call.
        op: &'static str,
        /// The underlying error.
        source: io::Error,
    },
    /// A pagesim option is out of range or inconsistent with another.
    #[error("{0}")]
    BadSimOption(String),
    /// A pager setting is inconsistent with another.
    #[error("{0}")]
    BadConfig(String),
    /// A VM registration was refused.
    #[error("VM {vm}: {reason}")]
    BadVm {
        /// The VM id.
        vm: u32,
        /// Why.
        reason: String,
    },
    /// A guest memory handed to the pager was refused (see
    /// [`crate::guest_memory::check_handoff`]).
    #[error("guest memory refused: {reason}")]
    BadSpace {
        /// What is wrong with it.
        reason: String,
    },
    /// The pager is stopped because of an earlier fatal error.
    #[error("pager stopped: {0}")]
    Stopped(String),
    /// A trace file could not be written or read.
    #[error("trace {path}: {reason}")]
    Trace {
        /// The trace path.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },
}
