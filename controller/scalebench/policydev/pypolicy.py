"""Paging policies written in Python, replayed by pagesim through the `pagesim` extension.

The extension (pagesim-py/, built by `make build`) drives an object through the same
calls as the Rust `Policy` trait (paging-policy/src/policy/mod.rs): subclass `Policy`,
define `choose_victims` and the notifications the policy needs, and run

    import pagesim
    report = pagesim.simulate(MyPolicy(), trace="experiments/traces/zipf-4000vm-a1.0.trace")

`report` is the dictionary `pagesim --json` prints (hit_ratio, faults, predicted_rps,
sim_requests_per_second, ...). Python policies run in the simulator only; densevm needs
the Rust version (paging-policy/README.md, "Porting to Rust").

`Demand` mirrors the Rust `demand` (clock over VMs, a VM's blocks evicted together) and
`Fifo` is the smallest correct policy, the trivial policy of the speed figures.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections import OrderedDict
from collections.abc import Callable, Iterable
from itertools import islice
from pathlib import Path
from typing import Literal, TypeVar

Method = TypeVar("Method", bound=Callable[..., object])

Layout = Literal["per-vm", "log"]


def _default(method: Method) -> Method:
    """Marks a no-op of the base class: the extension never calls a method so marked, so a
    notification a policy does not override costs nothing."""
    method.__pagesim_default__ = True  # type: ignore[attr-defined]
    return method


class Policy:
    """A paging policy for pagesim: decides which blocks to evict and which to prefetch.

    VM and block numbers are ints (a block is an index into the VM's RAM in block-size
    units). The calls for one VM follow the Rust trait's protocol: `on_vm_registered`, then
    (`on_fault` -> `on_installed`)* and (`choose_victims` -> `on_evicted`)* in any order,
    then `on_vm_unregistered`; `on_access` for every request served. Every method runs
    while the simulator waits, so keep them cheap.

    `name` labels reports (default: the class name); `layout` is the swap layout the policy
    is designed for: "per-vm" (a region per VM, rewritten in place) or "log".

    A method that raises stops the simulation with `pagesim.SimulationError` ("policy N
    failed: on_fault raised ValueError: ..."), the exception chained as its cause. So does
    a victim that is not resident or does not exist, or a prefetch beyond the VM's RAM: the
    ledger checks every answer.
    """

    name: str
    layout: Layout = "per-vm"

    @_default
    def on_vm_registered(self, vm: int, blocks: int) -> None:
        """A VM with `blocks` blocks of RAM was created; none is resident."""

    @_default
    def on_vm_unregistered(self, vm: int) -> None:
        """A VM was destroyed; forget its state (its blocks go without `on_evicted`)."""

    @_default
    def on_access(self, vm: int) -> None:
        """The VM served a request (also implied by every fault)."""

    @_default
    def on_fault(self, vm: int, block: int) -> Iterable[int] | None:
        """`block` of `vm` is missing and will be installed: return other blocks of the same
        VM to bring in with it (missing ones are installed, others ignored), or None."""
        return None

    @_default
    def on_installed(self, vm: int, block: int) -> None:
        """A block became resident."""

    @_default
    def choose_victims(self, need: int, faulting_vm: int) -> Iterable[tuple[int, int]]:
        """Required. Memory is short by `need` blocks: return resident (vm, block) pairs to
        evict, at least `need` if possible. Evicting from `faulting_vm` is the last resort."""
        raise NotImplementedError

    @_default
    def on_evicted(self, vm: int, block: int) -> None:
        """A block left memory (chosen by `choose_victims`, or taken from a VM over its
        per-VM quota)."""

    @_default
    def on_quota_eviction(self, vm: int) -> None:
        """The `on_evicted` calls that follow are `vm` making room under its own quota."""


class Fifo(Policy):
    """Evicts blocks in the order they came in: the smallest correct policy."""

    name = "py-fifo"

    def __init__(self) -> None:
        # Resident blocks in installation order (an OrderedDict, whose deletions leave no
        # holes for the next iteration to skip, unlike a dict's).
        self.resident: OrderedDict[tuple[int, int], None] = OrderedDict()

    def on_installed(self, vm: int, block: int) -> None:
        self.resident[vm, block] = None

    def on_evicted(self, vm: int, block: int) -> None:
        del self.resident[vm, block]

    def choose_victims(self, need: int, faulting_vm: int) -> Iterable[tuple[int, int]]:
        return list(islice(self.resident, need))


class Demand(Policy):
    """A mirror of the Rust `demand` (paging-policy/src/policy/demand.rs and clock.rs).

    A clock hand sweeps the VMs in registration order. A VM used since the hand last passed
    gets a second chance; otherwise all its resident blocks leave together. If two turns
    find too few, the faulting VM gives just enough of its own blocks, round-robin over its
    RAM from where its last such eviction stopped.
    """

    name = "py-demand"

    def __init__(self) -> None:
        self.ring: list[int] = []  # VMs in sweep order
        self.slot: dict[int, int] = {}  # VM -> index in ring
        self.referenced: dict[int, bool] = {}
        self.resident: dict[int, set[int]] = {}
        self.bits: dict[int, int] = {}  # blocks rounded up to 64, as the Rust bitmap
        self.own_hand: dict[int, int] = {}
        self.hand = 0

    def on_vm_registered(self, vm: int, blocks: int) -> None:
        self.slot[vm] = len(self.ring)
        self.ring.append(vm)
        self.referenced[vm] = False
        self.resident[vm] = set()
        self.bits[vm] = -(-blocks // 64) * 64
        self.own_hand[vm] = 0

    def on_vm_unregistered(self, vm: int) -> None:
        slot = self.slot.pop(vm)
        for table in (self.referenced, self.resident, self.bits, self.own_hand):
            del table[vm]
        last = self.ring.pop()
        if slot < len(self.ring):
            self.ring[slot] = last
            self.slot[last] = slot
        if self.hand >= len(self.ring):
            self.hand = 0

    def on_access(self, vm: int) -> None:
        self.referenced[vm] = True

    def on_fault(self, vm: int, block: int) -> None:
        self.referenced[vm] = True

    def on_installed(self, vm: int, block: int) -> None:
        self.resident[vm].add(block)

    def on_evicted(self, vm: int, block: int) -> None:
        self.resident[vm].discard(block)

    def choose_victims(self, need: int, faulting_vm: int) -> list[tuple[int, int]]:
        out: list[tuple[int, int]] = []
        n = len(self.ring)
        taken: set[int] = set()
        for _ in range(2 * n):
            if len(out) >= need:
                break
            vm = self.ring[self.hand]
            self.hand = (self.hand + 1) % n
            blocks = self.resident[vm]
            if not blocks or vm == faulting_vm or vm in taken:
                continue
            if self.referenced[vm]:
                self.referenced[vm] = False
                continue
            out.extend((vm, b) for b in sorted(blocks))
            taken.add(vm)
        if len(out) < need and faulting_vm in self.resident:
            out.extend(self._own_blocks(faulting_vm, need - len(out)))
        return out

    def _own_blocks(self, vm: int, limit: int) -> list[tuple[int, int]]:
        """Up to `limit` resident blocks of `vm` from its own hand on, wrapping around."""
        start = self.own_hand[vm]
        ordered = sorted(self.resident[vm], key=lambda b: (b < start, b))
        chosen = ordered[:limit]
        if len(chosen) == limit:
            self.own_hand[vm] = (chosen[-1] + 1) % self.bits[vm]
        return [(vm, b) for b in chosen]


PREFIX = "py:"


def absolute(spec: str) -> str:
    """`spec` (`py:MODULE:CLASS`) with a .py file's path made absolute."""
    _, module, cls = spec.split(":", 2)
    if module.endswith(".py"):
        module = str(Path(module).expanduser().resolve())
    return f"{PREFIX}{module}:{cls}"


def load(spec: str) -> Policy:
    """A new instance of the policy `spec` names: `py:MODULE:CLASS`, MODULE an importable
    module or a path to a .py file, CLASS a `Policy` subclass taking no arguments (the
    spelling of `scalebench policy compare --policies`)."""
    parts = spec.split(":")
    if len(parts) != 3 or parts[0] + ":" != PREFIX or not all(parts[1:]):
        raise ValueError(f"{spec}: expected py:MODULE:CLASS")
    _, module, cls = parts
    if module.endswith(".py"):
        where = importlib.util.spec_from_file_location(Path(module).stem, module)
        if where is None or where.loader is None:
            raise ValueError(f"{spec}: cannot load {module}")
        loaded = importlib.util.module_from_spec(where)
        where.loader.exec_module(loaded)
    else:
        loaded = importlib.import_module(module)
    policy = getattr(loaded, cls)()
    if not isinstance(policy, Policy):
        raise TypeError(f"{spec}: {cls} is not a scalebench.policydev.pypolicy.Policy")
    return policy
