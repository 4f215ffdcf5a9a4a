"""Containment of densevm: a memory-limited cgroup it is started inside.

The memory controller is taken from the v2 tree when it offers one, otherwise
from the v1 `memory` hierarchy (this project's hosts: v1 memory works, the v2
tree has none). Independently, when a v2 tree is mounted the process also gets
a v2 group of its own, only to read its pressure stall information
(memory.pressure), which v2 groups expose with or without the memory controller.

Charges stay with the group a page was first charged to, so the process must be
started inside its groups rather than moved there: `wrap()` returns a command
prefix that joins the groups and then execs the real command.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from .describe import fact
from .units import MIB

CGROUP_ROOT = Path("/sys/fs/cgroup")
# Where a v2 tree may be mounted: alone at the root, or beside v1 hierarchies.
V2_CANDIDATES = (CGROUP_ROOT, CGROUP_ROOT / "unified")
V1_MEMORY = CGROUP_ROOT / "memory"
PARENT = "scalebench"

# The limit is the pager's budget plus what the budget does not cover: per live VM,
# KVM's kernel memory (docs/host-facts.md), the vCPU thread,
# its sockets and rings; per hibernated VM, what densevm says one keeps (`densevm
# describe`: config.host_bytes_per_hibernated_vm); per process, densevm's own heap,
# code and pager tables.
MARGIN_PER_VM_BYTES = 1 * MIB
MARGIN_FIXED_BYTES = 256 * MIB


def memory_limit(budget_bytes: int, vms: int, live: int | None = None) -> int:
    """budget + 1 MiB per live VM + a hibernated VM's share for the others + 256 MiB: see
    MARGIN_* for why. `live` is --max-live (None: every VM live)."""
    awake = vms if live is None else min(live, vms)
    asleep = (vms - awake) * fact("config.host_bytes_per_hibernated_vm")
    return budget_bytes + awake * MARGIN_PER_VM_BYTES + asleep + MARGIN_FIXED_BYTES


def _v2_root() -> Path | None:
    for root in V2_CANDIDATES:
        if (root / "cgroup.controllers").exists():
            return root
    return None


def parse_psi(text: str) -> dict:
    """memory.pressure -> {"some": {"avg10":..., "total": us}, "full": {...}}."""
    out: dict = {}
    for line in text.splitlines():
        kind, *fields = line.split()
        out[kind] = {k: float(v) for k, v in (f.split("=", 1) for f in fields)}
    return out


@dataclass
class Containment:
    """The groups one densevm runs in; `create()` makes them, `remove()` deletes them."""

    run_id: str
    limit_bytes: int
    memory_group: Path | None = None  # holds the limit (v2 or v1)
    memory_version: int | None = None
    psi_group: Path | None = None  # v2 group read for memory.pressure
    warning: str | None = None
    _made: list[Path] = field(default_factory=list)

    @classmethod
    def create(cls, run_id: str, limit_bytes: int) -> Containment:
        """Create the groups; never raises for a missing controller, records a warning instead."""
        c = cls(run_id, limit_bytes)
        v2 = _v2_root()
        problems = []
        if v2 is not None:
            v2_memory = "memory" in (v2 / "cgroup.controllers").read_text().split()
            try:
                c.psi_group = c._mkdir(v2, enable_memory=v2_memory)
                if v2_memory:
                    (c.psi_group / "memory.max").write_text(str(limit_bytes))
                    c.memory_group, c.memory_version = c.psi_group, 2
            except OSError as e:
                problems.append(f"v2 group under {v2}: {e.strerror}")
        if c.memory_group is None and (V1_MEMORY / "memory.limit_in_bytes").exists():
            try:
                group = c._mkdir(V1_MEMORY, enable_memory=False)
                (group / "memory.limit_in_bytes").write_text(str(limit_bytes))
                c.memory_group, c.memory_version = group, 1
            except OSError as e:
                problems.append(f"v1 memory limit: {e.strerror}")
        if c.memory_group is None:
            c.warning = "densevm runs uncontained: no writable memory cgroup" + (
                f" ({'; '.join(problems)})" if problems else ""
            )
        return c

    def _mkdir(self, root: Path, enable_memory: bool) -> Path:
        parent = root / PARENT
        if not parent.exists():
            parent.mkdir()
            self._made.append(parent)
        if enable_memory:
            self._enable_memory_v2(root)
        group = parent / self.run_id
        group.mkdir()
        self._made.append(group)
        return group

    @staticmethod
    def _enable_memory_v2(root: Path) -> None:
        """A v2 controller applies to a group only when its parents delegate it."""
        for d in (root, root / PARENT):
            ctl = d / "cgroup.subtree_control"
            if "memory" not in ctl.read_text().split():
                ctl.write_text("+memory")

    def procs_files(self) -> list[Path]:
        return [
            g / "cgroup.procs"
            for g in dict.fromkeys(x for x in (self.memory_group, self.psi_group) if x)
        ]

    def wrap(self, argv: list[str]) -> list[str]:
        """`argv` started through sh, which first writes its own pid into every group."""
        files = self.procs_files()
        if not files:
            return argv
        script = (
            "n=$1; shift; i=0; "
            'while [ $i -lt $n ]; do echo $$ > "$1" || exit 126; shift; i=$((i+1)); done; '
            'exec "$@"'
        )
        return ["/bin/sh", "-c", script, "sh", str(len(files)), *map(str, files), *argv]

    def pressure(self) -> dict | None:
        """memory.pressure of the densevm group (v2 only), or None."""
        if self.psi_group is None:
            return None
        try:
            return parse_psi((self.psi_group / "memory.pressure").read_text())
        except OSError:
            return None

    def memory_stats(self) -> dict:
        """Peak usage, limit hits and OOM kills of the memory group."""
        g = self.memory_group
        if g is None:
            return {}
        try:
            if self.memory_version == 1:
                oom = dict(
                    line.split() for line in (g / "memory.oom_control").read_text().splitlines()
                )
                return {
                    "peak_bytes": int((g / "memory.max_usage_in_bytes").read_text()),
                    "limit_hits": int((g / "memory.failcnt").read_text()),
                    "oom_kills": int(oom.get("oom_kill", 0)),
                }
            events = dict(line.split() for line in (g / "memory.events").read_text().splitlines())
            peak = g / "memory.peak"
            return {
                "peak_bytes": int(peak.read_text()) if peak.exists() else None,
                "limit_hits": int(events.get("max", 0)),
                "oom_kills": int(events.get("oom_kill", 0)),
            }
        except OSError:
            return {}

    def members(self) -> list[int]:
        pids: set[int] = set()
        for f in self.procs_files():
            with contextlib.suppress(OSError):
                pids.update(int(x) for x in f.read_text().split())
        return sorted(pids)

    def remove(self, timeout_s: float = 30.0) -> str | None:
        """Delete the groups, killing what is left inside them; None, or why a group stayed.

        Whatever is still a member once the run has stopped its processes is one of ours
        that outlived them (a cell whose monitor was killed), so it gets SIGKILL. A group
        stays busy for a moment after its last process exits, and a dying KVM process can
        take seconds to release its memory, hence the retries up to `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        stayed = None
        for path in reversed(self._made):
            while True:
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as e:
                    if path.name == PARENT:
                        break  # shared with a concurrent run
                    if time.monotonic() > deadline:
                        stayed = f"cgroup {path} stayed: {e.strerror} ({len(self.members())} left)"
                        break
                    for pid in self.members():
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)
                    time.sleep(0.05)
        self._made.clear()
        return stayed

    def describe(self) -> dict:
        return {
            "memory_group": str(self.memory_group) if self.memory_group else None,
            "memory_version": self.memory_version,
            "limit_bytes": self.limit_bytes,
            "psi_group": str(self.psi_group) if self.psi_group else None,
            "warning": self.warning,
        }
