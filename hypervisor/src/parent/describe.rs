//! `densevm describe`: the monitor's and the pager's facts for a given set of
//! `serve` flags, as JSON. The controller reads them (cached per binary)
//! instead of keeping copies of constants that would drift.

use crate::config::{self, ConfigError, ServeArgs};
use crate::guest::abi;
use clap::Args;
use serde_json::{json, Value};

/// Flags of `densevm describe`: those of `serve`, whose configuration it
/// describes without starting anything.
#[derive(Args, Debug)]
pub struct DescribeArgs {
    /// One line of JSON (default: indented, for people).
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    serve: ServeArgs,
}

/// The description of `args.serve`'s configuration, checked as `serve`
/// checks it (its flags, guest, block, budget, policy, disk, swap path, the
/// most VMs this host allows).
pub fn describe(args: &ServeArgs) -> Result<Value, ConfigError> {
    config::check_flags(args)?;
    let (_, layout) = config::load_guest(args)?;
    let pager = config::pager_config(args, &layout)?;
    let cell_vms = config::cell_vms(args, &layout, &pager);
    let (max_vms, bound) = config::max_vms(cell_vms, args.max_live);
    config::check_max_vms(args.vms, cell_vms, args.max_live)?;
    Ok(json!({
        "schema": "densevm-describe/1",
        "version": env!("CARGO_PKG_VERSION"),
        "guest": {
            "ram_bytes": layout.ram_bytes,
            "ws_offset": layout.ws_offset,
            "ws_bytes": layout.ws_bytes,
            "stack_bytes": abi::STACK_BYTES,
            "request_ranges": layout.request_ranges(),
            "ws_write_stride_default": config::DEFAULT_WS_WRITE_STRIDE,
        },
        "config": {
            "block_bytes": pager.block_bytes,
            "budget_bytes": pager.budget_bytes,
            "policy": pager.policy.to_string(),
            "disk": pager.disk.text,
            "cell_vms": cell_vms,
            "max_vms": max_vms,
            "max_vms_bound": bound,
            "tasks": {
                "per_live_vm": config::TASKS_PER_LIVE_VM,
                "per_holder": config::TASKS_PER_HOLDER,
                "per_cell": config::TASKS_PER_CELL,
                "headroom": config::TASK_HEADROOM,
            },
            "kernel_bytes_per_live_vm": config::KERNEL_BYTES_PER_VM,
            "host_bytes_per_hibernated_vm": config::ASLEEP_BYTES_PER_VM,
        },
        "swap": {
            "vms_sized_for": config::vms_with_headroom(args.vms),
            "vms_times": config::SWAP_VMS_TIMES,
            "vms_plus": config::SWAP_VMS_PLUS,
            "rule": "max(vms_times x vms, vms + vms_plus) VMs, each ram_bytes x swap_bytes_per_ram_byte[layout]",
        },
        "pager": paging_policy::describe::describe(),
    }))
}

/// Prints the description; exit code 0, or 2 for a configuration error.
pub fn run(args: DescribeArgs) -> i32 {
    match describe(&args.serve) {
        Ok(value) => {
            let text = match args.json {
                true => value.to_string(),
                false => serde_json::to_string_pretty(&value).expect("JSON values print"),
            };
            println!("{text}");
            0
        }
        Err(ConfigError(e)) => {
            crate::log!("densevm: error: {e}");
            2
        }
    }
}
