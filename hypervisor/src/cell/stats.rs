//! Statistics replies: per VM and totals.

use crate::cell::cpu_governor::CpuGovernor;
use crate::cell::vmtable::{VmEntry, VmState};
use serde_json::{json, Value};

/// One VM's summary for `list`.
pub fn vm_summary(entry: &VmEntry) -> Value {
    match entry {
        VmEntry::Live(vm) => {
            let mut value =
                json!({ "id": vm.id, "addr": vm.addr.to_string(), "state": entry.state().name() });
            // A vCPU that stopped is reported with its reason before the event loop reaps the VM.
            if let Some(reason) = vm.stop_reason() {
                value["reason"] = json!(reason);
            }
            value
        }
        VmEntry::Dead(dead) => {
            json!({ "id": dead.id, "addr": dead.addr.to_string(), "state": dead.state.name(), "reason": dead.reason })
        }
        VmEntry::Forgotten => Value::Null,
    }
}

/// The `stats` reply: the totals, and with `per_vm` every VM and the kernel's
/// count of resident memory (mincore over every VM's mappings).
pub fn collect(vms: &[VmEntry], connections: usize, governor: &CpuGovernor, per_vm: bool) -> Value {
    let mut list = Vec::with_capacity(if per_vm { vms.len() } else { 0 });
    let (mut requests, mut errors, mut tx_bytes, mut wakeups) = (0u64, 0u64, 0u64, 0u64);
    let (mut selfcheck_pages, mut selfcheck_errors) = (0u64, 0u64);
    let (mut running, mut stopped, mut crashed, mut booting) = (0, 0, 0, 0);
    let mut hibernated = 0;
    let mut ram_resident = 0u64;
    let mut sys_resident = 0u64;
    let mut background = 0u64;
    let (mut lingering, mut linger_resets, mut doorbells_deferred) = (0u64, 0u64, 0u64);
    for (index, entry) in vms.iter().enumerate() {
        if !entry.is_known() {
            continue;
        }
        let in_background = governor.is_background(index) && matches!(entry, VmEntry::Live(_));
        background += u64::from(in_background);
        let state = entry.state();
        match state {
            VmState::Running => running += 1,
            VmState::Booting => booting += 1,
            VmState::Crashed => crashed += 1,
            VmState::Stopped => stopped += 1,
            VmState::Hibernated => hibernated += 1,
        }
        let ctrl = match entry {
            VmEntry::Live(vm) => vm.ctrl(),
            VmEntry::Dead(dead) => dead.ctrl,
            VmEntry::Forgotten => continue,
        };
        // Guest-written words: a lying guest saturates the totals, never wraps them.
        requests = requests.saturating_add(ctrl.requests);
        errors = errors.saturating_add(ctrl.responses_4xx);
        tx_bytes = tx_bytes.saturating_add(ctrl.tx_bytes);
        wakeups = wakeups.saturating_add(ctrl.wakeups);
        selfcheck_pages = selfcheck_pages.saturating_add(ctrl.selfcheck_pages);
        selfcheck_errors = selfcheck_errors.saturating_add(ctrl.selfcheck_errors);
        let (vm_lingering, vm_resets, vm_deferred) = match entry {
            VmEntry::Live(vm) => (vm.lingering as u64, vm.linger_resets, vm.doorbells_deferred),
            VmEntry::Dead(_) | VmEntry::Forgotten => (0, 0, 0),
        };
        lingering += vm_lingering;
        linger_resets += vm_resets;
        doorbells_deferred += vm_deferred;
        if !per_vm {
            continue;
        }
        let mut value = match entry {
            VmEntry::Live(vm) => {
                let ram = vm.ram.resident_bytes();
                let sys = vm.sys.resident_bytes();
                ram_resident += ram;
                sys_resident += sys;
                let mut value = json!({ "id": vm.id, "addr": vm.addr.to_string(), "state": state.name(), "ram_resident_bytes": ram, "sys_resident_bytes": sys });
                if let Some(counters) = vm.kvm_stats.as_ref().and_then(|s| s.read().ok()) {
                    value["kvm"] = counters.into();
                }
                if let Some(reason) = vm.stop_reason() {
                    value["reason"] = json!(reason);
                }
                value
            }
            VmEntry::Dead(dead) => {
                json!({ "id": dead.id, "addr": dead.addr.to_string(), "state": state.name(), "reason": dead.reason })
            }
            VmEntry::Forgotten => continue,
        };
        value["requests"] = json!(ctrl.requests);
        value["errors_4xx"] = json!(ctrl.responses_4xx);
        value["tx_bytes"] = json!(ctrl.tx_bytes);
        value["wakeups"] = json!(ctrl.wakeups);
        value["selfcheck_errors"] = json!(ctrl.selfcheck_errors);
        value["vcpu_background"] = json!(in_background);
        value["vcpu_demotions"] = json!(governor.demotions_of(index));
        value["lingering_connections"] = json!(vm_lingering);
        value["linger_resets"] = json!(vm_resets);
        value["doorbells_deferred"] = json!(vm_deferred);
        list.push(value);
    }
    let mut reply = json!({
        "ok": true,
        "totals": {
            "vms": vms.iter().filter(|e| e.is_known()).count(),
            "running": running,
            "booting": booting,
            "crashed": crashed,
            "stopped": stopped,
            "hibernated": hibernated,
            "connections": connections,
            "requests": requests,
            "errors_4xx": errors,
            "tx_bytes": tx_bytes,
            "wakeups": wakeups,
            "selfcheck_pages": selfcheck_pages,
            "selfcheck_errors": selfcheck_errors,
            "vcpus_background": background,
            "vcpu_demotions": governor.demotions(),
            "lingering_connections": lingering,
            "linger_resets": linger_resets,
            "doorbells_deferred": doorbells_deferred,
        },
    });
    if per_vm {
        reply["totals"]["ram_resident_bytes"] = json!(ram_resident);
        reply["totals"]["sys_resident_bytes"] = json!(sys_resident);
        reply["vms"] = Value::Array(list);
    }
    reply
}
