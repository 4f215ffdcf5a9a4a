//! Pager configuration: the `--mem`, `--block`, `--policy`, `--swap`,
//! `--keep-swap`, `--disk` settings and their validation.
//!
//! Validation runs before any VM boots so that a bad setting costs one clear
//! line and a non-zero exit instead of a half-started run.

use std::fs::OpenOptions;
use std::path::{Path, PathBuf};

use crate::disk::DiskSpec;
use crate::error::PagerError;

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
    /// `demand`, `wsswap` (`wsswap,after=N`), or a path to a policy plugin
    /// (`lib.so`), optionally followed by `,key=value,...` arguments passed
    /// to the plugin.
    pub policy: String,
    /// Swap file or block device; `None` = a file in the current directory.
    pub swap_path: Option<PathBuf>,
    /// Keep the swap file at exit instead of removing it.
    pub keep_swap: bool,
    /// Disk model (`none`, `hdd`, `hdd15k`, `ssd`, `array:N`, `raid5:N`, with
    /// optional `,key=value` overrides).
    pub disk: String,
    /// Swap capacity; `None` = sized from the number of VMs and the policy.
    pub swap_bytes: Option<u64>,
    /// Busy CPU work added to every fault-in: a known slowdown of the
    /// out-of-core path, only for checking regression detection.
    pub inject_fault: std::time::Duration,
}

impl Default for PagerConfig {
    fn default() -> Self {
        PagerConfig {
            budget_bytes: DEFAULT_BUDGET,
            block_bytes: DEFAULT_BLOCK,
            policy: "demand".to_string(),
            swap_path: None,
            keep_swap: false,
            disk: "none".to_string(),
            swap_bytes: None,
            inject_fault: std::time::Duration::ZERO,
        }
    }
}

/// Which policy a `--policy` string names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PolicySpec {
    /// Denali's demand paging with clustered clock eviction.
    Demand,
    /// Working-set swap; the recorded set is prefetched at the `after`-th
    /// fault since the VM's eviction (`wsswap,after=N`).
    WsSwap {
        /// Faults since eviction that trigger the prefetch (>= 1).
        after: u32,
    },
    /// A plugin shared library and the argument string handed to it.
    Plugin {
        /// Path of the shared library.
        path: PathBuf,
        /// Everything after the first comma, passed to the plugin verbatim.
        args: String,
    },
}

impl PolicySpec {
    /// Parses a `--policy` value. Anything containing a `/` or ending in `.so`
    /// is a plugin path; other names must be built in.
    pub fn parse(s: &str) -> Result<PolicySpec, PagerError> {
        let (head, args) = match s.split_once(',') {
            Some((h, a)) => (h, a),
            None => (s, ""),
        };
        match head {
            "demand" if args.is_empty() => Ok(PolicySpec::Demand),
            "wsswap" if args.is_empty() => Ok(PolicySpec::WsSwap {
                after: crate::policy::wsswap::DEFAULT_AFTER,
            }),
            "wsswap" => match args.strip_prefix("after=").map(str::parse::<u32>) {
                Some(Ok(after)) if after >= 1 => Ok(PolicySpec::WsSwap { after }),
                _ => Err(PagerError::UnknownPolicy(s.to_string())),
            },
            _ if head.contains('/') || head.ends_with(".so") => Ok(PolicySpec::Plugin {
                path: PathBuf::from(head),
                args: args.to_string(),
            }),
            _ => Err(PagerError::UnknownPolicy(s.to_string())),
        }
    }
}

/// Parses a size such as `32k`, `896K`, `1G`, `4096`, `4M`, `2GiB`.
/// Suffixes are binary (k = 1024).
pub fn parse_size(s: &str) -> Result<u64, PagerError> {
    let bad = || PagerError::BadSize(s.to_string());
    let t = s.trim();
    let t = t
        .strip_suffix("iB")
        .or_else(|| t.strip_suffix("ib"))
        .or_else(|| t.strip_suffix('B'))
        .or_else(|| t.strip_suffix('b'))
        .unwrap_or(t);
    let (num, shift) = match t.chars().last() {
        Some('k' | 'K') => (&t[..t.len() - 1], 10),
        Some('m' | 'M') => (&t[..t.len() - 1], 20),
        Some('g' | 'G') => (&t[..t.len() - 1], 30),
        Some('t' | 'T') => (&t[..t.len() - 1], 40),
        _ => (t, 0),
    };
    if num.is_empty() || !num.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    let n: u64 = num.parse().map_err(|_| bad())?;
    n.checked_mul(1u64 << shift).ok_or_else(bad)
}

/// Checks that a block size is a power of two in [4k, 256k].
pub fn check_block(block_bytes: u64) -> Result<(), PagerError> {
    if !block_bytes.is_power_of_two() || !(MIN_BLOCK..=MAX_BLOCK).contains(&block_bytes) {
        return Err(PagerError::BadBlock(block_bytes));
    }
    Ok(())
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
        if !vm_ram_bytes.is_multiple_of(self.block_bytes) {
            return Err(PagerError::RamNotBlockMultiple {
                ram: vm_ram_bytes,
                block: self.block_bytes,
            });
        }
        let footprint = vm_min_footprint_bytes.div_ceil(self.block_bytes).max(1) * self.block_bytes;
        if self.budget_bytes < footprint {
            return Err(PagerError::BudgetTooSmall {
                budget: self.budget_bytes,
                footprint,
                block: self.block_bytes,
            });
        }
        match PolicySpec::parse(&self.policy)? {
            PolicySpec::Plugin { path, .. } if !path.is_file() => {
                return Err(PagerError::PluginMissing(path));
            }
            _ => {}
        }
        DiskSpec::parse(&self.disk)?;
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

/// Verifies that `path` can be opened for writing, creating (and removing
/// again) a file that did not exist.
fn check_writable(path: &Path) -> Result<(), PagerError> {
    let existed = path.exists();
    OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(|source| PagerError::SwapUnwritable {
            path: path.to_path_buf(),
            source,
        })?;
    if !existed {
        let _ = std::fs::remove_file(path);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("32k").unwrap(), 32768);
        assert_eq!(parse_size("896K").unwrap(), 896 * 1024);
        assert_eq!(parse_size("1G").unwrap(), 1 << 30);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("4MiB").unwrap(), 4 << 20);
        for bad in ["", "k", "1.5G", "-1", "12q", "99999999999999999999T"] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn policy_specs() {
        assert_eq!(PolicySpec::parse("demand").unwrap(), PolicySpec::Demand);
        assert_eq!(
            PolicySpec::parse("wsswap").unwrap(),
            PolicySpec::WsSwap { after: 3 }
        );
        assert_eq!(
            PolicySpec::parse("wsswap,after=1").unwrap(),
            PolicySpec::WsSwap { after: 1 }
        );
        assert!(PolicySpec::parse("wsswap,after=0").is_err());
        assert!(PolicySpec::parse("demand,x=1").is_err());
        assert_eq!(
            PolicySpec::parse("./libx.so,mode=panic").unwrap(),
            PolicySpec::Plugin {
                path: "./libx.so".into(),
                args: "mode=panic".into()
            }
        );
        assert!(PolicySpec::parse("lru").is_err());
    }
}
