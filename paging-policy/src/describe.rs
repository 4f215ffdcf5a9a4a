//! The pager's facts as data (`densevm describe`): what a controller needs
//! to model the pager, so that it reads them instead of keeping copies.

use serde_json::{json, Value};

use crate::batching::WRITE_CLUSTER_GAP_BYTES;
use crate::config::{DEFAULT_BLOCK, DEFAULT_BUDGET, MAX_BLOCK, MIN_BLOCK};
use crate::disk::{DiskSpec, DriveKind, DriveParams};
use crate::pager::SERVICE_THREADS;
use crate::policy::{wsswap, SwapLayout};
// Lives with the swap layouts (the pager sizes swap by it); re-exported
// here so that describe.rs and pager.rs both depend on space.rs and not on
// each other.
pub use crate::space::swap_bytes_per_ram_byte;

fn drive(p: DriveParams) -> Value {
    json!({
        "kind": match p.kind { DriveKind::Rotating => "rotating", DriveKind::Flash => "flash" },
        "seek_ms": p.seek_ms,
        "track_ms": p.track_ms,
        "rpm": p.rpm,
        "mb_s": p.mb_s,
        "overhead_ms": p.overhead_ms,
        "lat_ms": p.lat_ms,
    })
}

/// Block limits, policies, batching, service threads, swap sizing and every
/// disk model with its parameters.
pub fn describe() -> Value {
    json!({
        "block": {"min": MIN_BLOCK, "max": MAX_BLOCK, "default": DEFAULT_BLOCK},
        "budget_default_bytes": DEFAULT_BUDGET,
        "policy": {
            "builtin": ["demand", "wsswap"],
            "default": "demand",
            "grammar": "demand | wsswap[,after=N] (N >= 1) | PATH.so[,ARGS] (a path holds '/' or ends in .so)",
            "wsswap_after_default": wsswap::DEFAULT_AFTER,
            "layouts": {"demand": "per-vm", "wsswap": "log"},
        },
        "service_threads": SERVICE_THREADS,
        "write_cluster_gap_bytes": WRITE_CLUSTER_GAP_BYTES,
        "swap_bytes_per_ram_byte": {
            "per-vm": swap_bytes_per_ram_byte(SwapLayout::PerVm),
            "log": swap_bytes_per_ram_byte(SwapLayout::Log),
        },
        "disks": {
            "names": ["none", "hdd", "hdd15k", "ssd", "array:N", "raid5:N"],
            "drives": {
                "hdd": drive(DriveParams::hdd()),
                "hdd15k": drive(DriveParams::hdd15k()),
                "ssd": drive(DriveParams::ssd()),
            },
            "array_drive": "hdd",
            "stripe_bytes": DiskSpec::default().stripe_bytes,
            "raid5_parity": "left-asymmetric",
        },
    })
}
