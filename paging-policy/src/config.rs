//! Pager configuration: the `--mem`, `--block`, `--policy`, `--swap`,
//! `--keep-swap`, `--disk` settings and their validation.
//!
//! Validation runs before any VM boots so that a bad setting costs one clear
//! line and a non-zero exit instead of a half-started run.

use std::fs::OpenOptions;
use std::path::{Path, PathBuf};

use crate::disk::DiskSpec;
use crate::error::PagerError;
use crate::policy::PolicySpec;

/// Smallest block size: one x86 page.
pub const MIN_BLOCK: u64 = 4 << 10;
/// Largest block size.
pub const MAX_BLOCK: u64 = 256 << 10;
/// Default global budget (Denali's host memory).
pub const DEFAULT_BUDGET: u64 = 1 << 30;
/// Default block size.
pub const DEFAULT_BLOCK: u64 = 32 << 10;

/// Settings of one pager; mirrors densevm's command-line flags.
#[derive(Debug, Clone)]
pub struct PagerConfig {
    /// Global budget for all resident guest memory (`--mem`).
    pub budget_bytes: u64,
    /// Unit of fault-in and eviction (`--block`).
    pub block_bytes: u64,
    /// The paging policy (`--policy`, parsed once by [`PolicySpec::parse`]).
    pub policy: PolicySpec,
    /// Swap file or block device; `None` = a file in the current directory.
    pub swap_path: Option<PathBuf>,
    /// Keep the swap file at exit instead of removing it.
    pub keep_swap: bool,
    /// The disk model (`--disk`, parsed once by [`DiskSpec::parse`]).
    pub disk: DiskSpec,
    /// Swap capacity; `None` = sized from the number of VMs and the policy.
    pub swap_bytes: Option<u64>,
    /// Most resident memory one VM may hold (`--vm-resident-max`); past it
    /// the VM's own blocks are evicted, whatever the policy chooses.
    pub vm_resident_max: Option<u64>,
    /// Kernel CPU work added to every fault-in: a known slowdown of the
    /// out-of-core path, only for checking regression detection.
    pub inject_fault: std::time::Duration,
    /// Commit a VM's swap at its first fault instead of at registration
    /// (densevm with `--idle-after`, whose VMs are created asleep): a VM
    /// that never runs costs the disk nothing, and one the disk has no room
    /// for fails alone when it first runs instead of refusing the start.
    pub swap_on_first_fault: bool,
    /// Store evicted blocks as compressed differences from the image's
    /// template ([`crate::compact`]), so swap holds many more VMs than
    /// their RAM (densevm with `--idle-after`); else each block whole.
    pub compact_swap: bool,
    /// The VM whose first hibernation saves the image's template for clones
    /// (clone boot): from then on every VM whose memory is first touched
    /// starts as a copy of the template's, each block the template's until
    /// the VM writes it (Potemkin's flash cloning). Needs `compact_swap`,
    /// which keeps the template. `None`: VMs start from zeros.
    pub clone_template: Option<u32>,
    /// Offset in a VM's RAM of what it touches first when it wakes (for
    /// densevm's guests, the top of the stack: a woken guest restarts at its
    /// entry). A wake's prefetch installs that block's part first and lets
    /// the VM run on each part as it lands. `None`: parts in address order.
    pub wake_first: Option<u64>,
}

impl Default for PagerConfig {
    fn default() -> Self {
        PagerConfig {
            budget_bytes: DEFAULT_BUDGET,
            block_bytes: DEFAULT_BLOCK,
            policy: PolicySpec::Demand,
            swap_path: None,
            keep_swap: false,
            disk: DiskSpec::default(),
            swap_bytes: None,
            vm_resident_max: None,
            inject_fault: std::time::Duration::ZERO,
            swap_on_first_fault: false,
            compact_swap: false,
            clone_template: None,
            wake_first: None,
        }
    }
}

/// The `block_bytes` blocks that byte ranges `(offset, length)` of a VM's
/// RAM overlap, ascending and each once: what a request touching those
/// ranges leaves resident.
pub fn blocks_touched(ranges: &[(u64, u64)], block_bytes: u64) -> Vec<u64> {
    let mut blocks: Vec<u64> = ranges
        .iter()
        .filter(|(_, len)| *len > 0)
        .flat_map(|&(offset, len)| offset / block_bytes..(offset + len).div_ceil(block_bytes))
        .collect();
    blocks.sort_unstable();
    blocks.dedup();
    blocks
}

/// Checks that a block size is a power of two in [4k, 256k].
pub fn check_block(block_bytes: u64) -> Result<(), PagerError> {
    if !block_bytes.is_power_of_two() || !(MIN_BLOCK..=MAX_BLOCK).contains(&block_bytes) {
        return Err(PagerError::BadBlock(block_bytes));
    }
    Ok(())
}

/// Checks that a per-VM quota (`--vm-resident-max`) holds at least one
/// request's `footprint` (whole blocks): below it, a VM would evict its own
/// working set on every fault and never finish a request.
pub fn check_vm_quota(quota: Option<u64>, footprint: u64) -> Result<(), PagerError> {
    match quota {
        Some(bytes) if bytes < footprint => Err(PagerError::QuotaTooSmall {
            quota: bytes,
            footprint,
        }),
        _ => Ok(()),
    }
}

/// Default swap file name in the current directory, unique per process so
/// that concurrent runs in one directory do not share a swap file.
pub fn default_swap_path() -> PathBuf {
    PathBuf::from(format!("densevm-swap-{}.img", std::process::id()))
}

impl PagerConfig {
    /// Checks every setting against a VM of `vm_ram_bytes` whose smallest
    /// resident footprint (what one request touches) is
    /// `vm_min_footprint_bytes`. Returns the first problem found.
    pub fn validate(
        &self,
        vm_ram_bytes: u64,
        vm_min_footprint_bytes: u64,
    ) -> Result<(), PagerError> {
        check_block(self.block_bytes)?;
        let footprint = vm_min_footprint_bytes.div_ceil(self.block_bytes).max(1) * self.block_bytes;
        if self.budget_bytes < footprint {
            return Err(PagerError::BudgetTooSmall {
                budget: self.budget_bytes,
                footprint,
                block: self.block_bytes,
            });
        }
        check_vm_quota(self.vm_resident_max, footprint)?;
        self.validate_settings(vm_ram_bytes)
    }

    /// The checks that need no request footprint (what [`crate::Pager::new`]
    /// runs; the caller runs [`PagerConfig::validate`] with the footprint
    /// first): the block size, the VM's RAM in whole blocks, a budget and a
    /// quota of at least one block, the plugin, the swap size and path.
    pub fn validate_settings(&self, vm_ram_bytes: u64) -> Result<(), PagerError> {
        check_block(self.block_bytes)?;
        if !vm_ram_bytes.is_multiple_of(self.block_bytes) {
            return Err(PagerError::RamNotBlockMultiple {
                ram: vm_ram_bytes,
                block: self.block_bytes,
            });
        }
        if self.budget_bytes < self.block_bytes {
            return Err(PagerError::BudgetTooSmall {
                budget: self.budget_bytes,
                footprint: self.block_bytes,
                block: self.block_bytes,
            });
        }
        check_vm_quota(self.vm_resident_max, self.block_bytes)?;
        if self.clone_template.is_some() && !self.compact_swap {
            return Err(PagerError::BadConfig(
                "clone_template needs compact_swap, which keeps the template".into(),
            ));
        }
        if let PolicySpec::Plugin { path, .. } = &self.policy {
            if !path.is_file() {
                return Err(PagerError::PluginMissing(path.clone()));
            }
        }
        if let Some(bytes) = self.swap_bytes {
            if bytes < vm_ram_bytes || bytes % self.block_bytes != 0 {
                return Err(PagerError::BadSwapSize {
                    bytes,
                    reason: format!(
                        "must be a multiple of the block size ({}) and hold at least one VM ({} bytes)",
                        self.block_bytes, vm_ram_bytes
                    ),
                });
            }
        }
        let path = self.swap_path.clone().unwrap_or_else(default_swap_path);
        check_writable(&path)
    }
}

/// Verifies that the swap device can be opened as [`crate::swap::SwapDevice::open`]
/// will: a block device opened for writing, or a file that does not exist
/// yet and can be created (made exclusively, 0600, and removed again).
fn check_writable(path: &Path) -> Result<(), PagerError> {
    use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
    let unwritable = |source| PagerError::SwapUnwritable {
        path: path.to_path_buf(),
        source,
    };
    match std::fs::metadata(path) {
        Ok(m) if m.file_type().is_block_device() => {
            OpenOptions::new()
                .write(true)
                .open(path)
                .map_err(unwritable)?;
            return Ok(());
        }
        Ok(_) => return Err(PagerError::SwapExists(path.to_path_buf())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(unwritable(e)),
    }
    if std::fs::symlink_metadata(path).is_ok() {
        return Err(PagerError::SwapExists(path.to_path_buf()));
    }
    OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .map_err(unwritable)?;
    let _ = std::fs::remove_file(path);
    Ok(())
}
