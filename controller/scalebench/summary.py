"""The short human summary printed after a run."""

from __future__ import annotations

from .result import RunResult
from .units import MIB


def _num(x: float | None, fmt: str = "{:,.0f}") -> str:
    return "n/a" if x is None else fmt.format(x)


def _ms(us: int | None) -> str:
    return _num(us and us / 1e3, "{:.2f}")


def hibernation_lines(r: RunResult) -> list[str]:
    """What hibernation did: the VMs awake and asleep at the end of the measurement, and its
    wakes over it beside the model's share of them."""
    c, m = r.config, r.model or {}
    cap = f", at most {c['max_live']} awake" if c.get("max_live") is not None else ""
    model = m.get("wake_fraction")
    return [
        f"  hibernation: idle after {c['idle_after']:g} s{cap}   at the end {_num(r.live)} awake, "
        f"{_num(r.hibernated)} hibernated"
        + (
            f", {_num(r.clones_started)} started as clones of the template"
            if r.clones_started is not None
            else ""
        ),
        f"  wakes:       {_num(r.wakes)} ({_num(r.wake_fraction, '{:.3f}')} of requests"
        + (f", model {model:.3f}" if model is not None else "")
        + f")   latency p50 {_ms(r.wake_us_p50)} ms, p99 {_ms(r.wake_us_p99)} ms   "
        f"failures {_num(r.wake_failures)}, hibernations {_num(r.hibernations)}",
    ]


def summary(r: RunResult) -> str:
    c = r.config
    lines = [
        f"scalebench {r.status}: {c['vms']} VMs, alpha {c['alpha']}, block {c['block']}, "
        f"mem {c['mem']}, policy {c['policy']}, disk {c['disk']}, {c['object']} object"
    ]
    if r.error:
        lines.append(f"  error:       {r.error}")
    lat = r.latency_ms or {}
    lines += [
        f"  throughput:  {_num(r.throughput_rps)} requests/s   latency p50 "
        f"{_num(lat.get('p50'), '{:.2f}')} ms, "
        f"p99 {_num(lat.get('p99'), '{:.2f}')} ms   errors {_num(r.errors)}",
        f"  memory:      resident {_num(r.resident_bytes and r.resident_bytes / MIB)} MiB of "
        f"{_num(r.budget_bytes and r.budget_bytes / MIB)} MiB budget   boot "
        f"{_num(r.boot_seconds, '{:.2f}')} s",
        f"  paging:      {_num(r.faults_per_s)} faults/s   swap in "
        f"{_num(r.swap_read_mbps, '{:.1f}')} MB/s, "
        f"out {_num(r.swap_write_mbps, '{:.1f}')} MB/s"
        + (
            f", {r.swap_io_us_per_block['measure'] / 1e3:.2f} ms a block"
            if (r.swap_io_us_per_block or {}).get("measure")
            else ""
        )
        + (
            f"   modeled drive busy {r.drive['utilization']:.0%}, {r.drive['positioning_ms']:.1f} "
            "ms a seek"
            if r.drive
            else ""
        ),
        f"  regime:      {r.regime or 'n/a'}"
        + (
            f"   hit ratio {r.hit_ratio:.3f} (resident VMs draw {r.resident_mass:.3f} of requests)"
            if r.hit_ratio is not None
            else ""
        ),
    ]
    m = r.model or {}
    if c.get("idle_after") is not None:
        lines += hibernation_lines(r)
    if m.get("model_rps") is not None:
        lines.append(
            f"  model:       {_num(m['model_rps'])} requests/s ({m['regime']}; hit ratio "
            f"{m['hit_ratio']:.3f}, {m['cache_vms']} VMs fit, cliff at {m['cliff_vms']}, miss "
            f"{m['miss_s'] * 1e3:.1f} ms, "
            f"cpu {m['cpu_us']:.0f} us/request from {r.calibration.get('source')})   "
            f"measured/model {_num(r.measured_over_model, '{:.2f}')}"
        )
    for warning in [(r.containment or {}).get("warning"), *r.warnings]:
        if warning:
            lines.append(f"  warning:     {warning}")
    if r.files.get("result"):
        lines.append(
            f"  result:      {r.files['result']}"
            + (f"   plot: {r.files['plot']}" if r.files.get("plot") else "")
        )
    return "\n".join(lines)
