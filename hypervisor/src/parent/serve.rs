//! `densevm serve`: validate the configuration, start the pager and the
//! cells that hold the VMs, supervise them until a signal, tear down.

use crate::config::{
    boot_layout, cell_hibernation, cell_settings, cell_vms, check_flags, check_max_vms,
    ensure_fd_budget, fds_per_vm, load_guest, pager_config, vms_with_headroom, CellSettings,
    ConfigError, ServeArgs,
};
use crate::guest::boot::RamLayout;
use crate::parent::cell_handle::PendingCell;
use crate::parent::steering::Steering;
use crate::parent::supervisor::{emit, Exit, Supervisor, SupervisorSetup};
use crate::platform;
use crate::scheduling::{self, CellPlacement};
use kvm_ioctls::Kvm;
use paging_policy::trace::{TraceHeader, TraceWriter};
use paging_policy::Pager;
use serde_json::json;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Descriptors the parent holds per cell: link, userfaultfd, memfd, pidfd slack.
const FDS_PER_CELL: u64 = 4;
/// Cells that may be started beyond one per VM held (cells that died and
/// were replaced keep their index).
const MAX_CELLS_REPLACED: u32 = 4096;
/// Longest orderly teardown before the process just exits.
const TEARDOWN_GRACE: Duration = Duration::from_secs(30);

struct Prepared {
    api: std::os::unix::net::UnixListener,
    api_path: PathBuf,
    pager: Arc<Pager>,
    trace: Option<TraceWriter>,
    layout: RamLayout,
    /// What every cell runs with.
    settings: CellSettings,
    platform: &'static str,
    /// Most VMs a cell holds: `--cell-vms` or the default for the regime.
    cell_vms: u32,
    /// VMs each cell boots with, in ID order.
    cell_sizes: Vec<u32>,
    /// Most VMs held at once (`config::max_vms`).
    max_vms: u32,
    /// Every VM address steered to its cell's socket.
    steering: Steering,
}

fn prepare(args: &ServeArgs) -> Result<Prepared, ConfigError> {
    check_flags(args)?;
    let pinned_cpus = match args.cell_placement {
        CellPlacement::Pinned => Some(
            scheduling::allowed_cpus()
                .map_err(|e| ConfigError(format!("the CPUs densevm may use: {e}")))?
                .len(),
        ),
        CellPlacement::Floating => None,
    };
    let (guest, layout) = load_guest(args)?;
    let pager_config = pager_config(args, &layout)?;
    let cell_vms = cell_vms(args, &layout, &pager_config);
    let max_vms = check_max_vms(args.vms, cell_vms, args.max_live)?;
    let cell_sizes = boot_layout(args.vms, cell_vms, pinned_cpus);
    // The parent holds a few descriptors per cell; each cell checks its own VMs.
    ensure_fd_budget(cell_sizes.len() as u32, FDS_PER_CELL)
        .map_err(|e| ConfigError(e.to_string()))?;
    let largest_cell = cell_vms.min(args.vms);
    let fd_vms = cell_hibernation(args, cell_sizes.len() as u32)
        .map_or(largest_cell, |h| h.vms_with_fds(largest_cell));
    ensure_fd_budget(fd_vms, fds_per_vm(args))
        .map_err(|e| ConfigError(format!("--cell-vms {cell_vms}: {e}")))?;
    let trace = match &args.record_trace {
        Some(path) => {
            let header = TraceHeader {
                block_bytes: pager_config.block_bytes,
                vm_ram_bytes: layout.ram_bytes,
                vms: args.vms,
                request_ranges: layout.request_ranges(),
            };
            Some(
                TraceWriter::create(path, &header)
                    .map_err(|e| ConfigError(format!("--record-trace: {e}")))?,
            )
        }
        None => None,
    };
    // The cells open /dev/kvm; checking it here gives a configuration error
    // before anything starts.
    let kvm = Kvm::new().map_err(|e| ConfigError(format!("cannot open /dev/kvm: {e}")))?;
    let platform = platform::detect(&kvm)
        .map_err(|e| ConfigError(format!("probe the host: {e}")))?
        .name();

    let api_path = args
        .api
        .clone()
        .unwrap_or_else(|| PathBuf::from(format!("densevm-{}.sock", std::process::id())));
    check_api_path(&api_path)?;
    let pager = Pager::new(pager_config, vms_with_headroom(args.vms), layout.ram_bytes)
        .map_err(|e| ConfigError(e.to_string()))?;
    // Cells are never reused: a run that replaces many gets a clear error
    // at the create that finds no slot left.
    let steering = Steering::attach(
        args.port,
        max_vms,
        max_vms.saturating_add(MAX_CELLS_REPLACED),
    )
    .map_err(|e| ConfigError(e.to_string()))?;
    // Only the owner may drive the monitor: the socket is created 0600, whatever the umask.
    // SAFETY: umask only changes this process's file-creation mask; restored right after.
    let umask = unsafe { libc::umask(0o177) };
    let api = std::os::unix::net::UnixListener::bind(&api_path);
    // SAFETY: as above.
    unsafe { libc::umask(umask) };
    let api = api.map_err(|e| {
        ConfigError(format!(
            "cannot bind control socket {}: {e}",
            api_path.display()
        ))
    })?;
    api.set_nonblocking(true)
        .map_err(|e| ConfigError(format!("control socket: {e}")))?;
    Ok(Prepared {
        api,
        api_path,
        pager,
        trace,
        layout,
        settings: CellSettings {
            hibernation: cell_hibernation(args, cell_sizes.len() as u32),
            ..cell_settings(args, guest, layout)
        },
        platform,
        cell_vms,
        cell_sizes,
        max_vms,
        steering,
    })
}

/// Only a stale socket at the control path may be replaced: a live one is
/// another densevm's, and anything else (a file, a link, a folder) is left
/// alone and refused.
fn check_api_path(path: &std::path::Path) -> Result<(), ConfigError> {
    use std::os::unix::fs::FileTypeExt;
    let meta = match std::fs::symlink_metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => {
            return Err(ConfigError(format!(
                "control socket {}: {e}",
                path.display()
            )))
        }
    };
    if !meta.file_type().is_socket() {
        return Err(ConfigError(format!(
            "--api {} exists and is not a socket; it is left alone",
            path.display()
        )));
    }
    if std::os::unix::net::UnixStream::connect(path).is_ok() {
        return Err(ConfigError(format!(
            "control socket {} is in use by another densevm",
            path.display()
        )));
    }
    std::fs::remove_file(path)
        .map_err(|e| ConfigError(format!("stale control socket {}: {e}", path.display())))
}

/// Runs `densevm serve`; returns the exit code.
pub fn run(args: ServeArgs) -> i32 {
    let prepared = match prepare(&args) {
        Ok(p) => p,
        Err(ConfigError(message)) => {
            crate::log!("densevm: error: {message}");
            return 2;
        }
    };
    let Prepared {
        api,
        api_path,
        pager,
        trace,
        layout,
        settings,
        platform,
        cell_vms,
        cell_sizes,
        max_vms,
        mut steering,
    } = prepared;
    let boot_started = Instant::now();
    let fail = |message: String| {
        crate::log!("densevm: error: {message}");
        let _ = std::fs::remove_file(&api_path);
        pager.shutdown();
        1
    };
    // Every cell starts (and initialises, in parallel) before the first
    // handshake.
    let mut pending = Vec::new();
    let mut first = 0;
    for count in cell_sizes {
        match PendingCell::spawn(&settings, pending.len() as u32, first, count, cell_vms) {
            Ok(cell) => pending.push(cell),
            Err(e) => return fail(e.to_string()),
        }
        first += count;
    }
    let mut cells = Vec::with_capacity(pending.len());
    for cell in pending {
        match cell.handshake(
            &pager,
            &mut steering,
            layout.ram_bytes as usize,
            platform,
            None,
        ) {
            Ok(cell) => cells.push(cell),
            Err(e) => return fail(e.to_string()),
        }
    }
    let ready_line = json!({
        "api": api_path.display().to_string(),
        "platform": platform,
        "pvm": platform == "pvm",
        "addr_base": args.addr_base.to_string(),
        "port": args.port,
        "pid": std::process::id(),
        "cells": cells.len(),
        "cell_vms": cell_vms,
        "cell_placement": args.cell_placement,
    });
    let setup = SupervisorSetup {
        settings,
        cell_vms,
        max_vms,
        cells,
        pager: Arc::clone(&pager),
        steering,
        ram_bytes: layout.ram_bytes as usize,
        platform,
        api,
        api_path: api_path.clone(),
        boot_started,
        ready_line,
        trace,
    };
    let mut supervisor = match Supervisor::new(setup) {
        Ok(s) => s,
        Err(e) => return fail(format!("event loop: {e}")),
    };
    match supervisor.run() {
        Ok(Exit::Signal(signal)) => {
            // A cell that does not stop would hold the teardown forever;
            // exiting releases everything anyway.
            std::thread::spawn(|| {
                std::thread::sleep(TEARDOWN_GRACE);
                crate::log!(
                    "densevm: teardown took over {} s; exiting with VMs still held",
                    TEARDOWN_GRACE.as_secs()
                );
                std::process::exit(1);
            });
            // Nothing is measured any more, and a vCPU blocked in a fault
            // can only wait for the pager: its modeled disk time (a wsswap
            // swap-in on `hdd` is hundreds of ms, queued behind others) would
            // hold the cells' exit for tens of seconds.
            pager.set_disk_modeled(false);
            supervisor.shutdown();
            pager.shutdown();
            emit(&json!({ "event": "exit", "reason": "signal", "signal": signal }));
            0
        }
        Err(error) => {
            let message = error.to_string();
            // The run is broken (the pager failed, say): report first, then
            // stop the cells without waiting for vCPUs that may never return.
            crate::log!("densevm: error: {message}");
            emit(&json!({ "event": "exit", "reason": "error", "error": message }));
            supervisor.kill_cells();
            let _ = std::fs::remove_file(&api_path);
            pager.shutdown();
            std::process::exit(1);
        }
    }
}
