"""densevm's own account of what the controller models: guest layout, block
limits, policies, write batching, service threads, swap sizing and the disk
models' parameters (`densevm describe --json`).

The controller reads these instead of keeping copies that drift. The default
description is cached per binary build (its path, size and mtime) under
$XDG_CACHE_HOME/scalebench; descriptions of a given configuration are asked
for when needed and double as its validation, the same densevm does.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import subprocess
from pathlib import Path
from typing import Any

from .binaries import binary
from .errors import ConfigError

# Every fact the controller reads: a description without one is refused (a test
# runs the real binary against this list).
REQUIRED = (
    "guest.ram_bytes",
    "guest.ws_offset",
    "guest.stack_bytes",
    "guest.ws_write_stride_default",
    "pager.block.min",
    "pager.block.max",
    "pager.policy.builtin",
    "pager.policy.layouts",
    "pager.policy.wsswap_after_default",
    "pager.service_threads",
    "pager.write_cluster_gap_bytes",
    "pager.swap_bytes_per_ram_byte",
    "pager.disks.drives.hdd",
    "pager.disks.drives.hdd15k",
    "pager.disks.drives.ssd",
    "pager.disks.stripe_bytes",
    "pager.disks.array_drive",
    "swap.vms_times",
    "swap.vms_plus",
    "config.host_bytes_per_hibernated_vm",
)


class DescribeError(ConfigError):
    """densevm's description lacks a fact the controller needs (binary and controller disagree)."""


def lookup(doc: dict, path: str) -> Any:
    """The value at a dotted path ("pager.block.min"); DescribeError when absent."""
    node: Any = doc
    for key in path.split("."):
        if not isinstance(node, dict) or key not in node:
            raise DescribeError(
                f"densevm describe has no '{path}': rebuild densevm (`make build`) "
                "to match this controller"
            )
        node = node[key]
    return node


def check(doc: dict) -> dict:
    """The description, once every REQUIRED fact is in it."""
    for path in REQUIRED:
        lookup(doc, path)
    return doc


def describe_config(*flags: str) -> dict:
    """densevm's description of `densevm serve FLAGS`; ConfigError with densevm's own
    one-line reason when it would refuse them."""
    done = subprocess.run(
        [str(binary("densevm")), "describe", "--json", *flags],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        reason = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "no reason given"
        raise ConfigError(reason.removeprefix("densevm: error: "))
    return check(json.loads(done.stdout))


def _cache_path(densevm: Path) -> Path:
    st = densevm.stat()
    key = hashlib.sha256(f"{densevm.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "scalebench" / f"densevm-describe-{key[:16]}.json"


@functools.cache
def facts() -> dict:
    """The default description, cached per binary build."""
    cache = _cache_path(binary("densevm"))
    try:
        return check(json.loads(cache.read_text()))
    except (OSError, ValueError, DescribeError):
        pass
    doc = describe_config()
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(doc))
    except OSError:
        pass  # an unwritable cache costs one process per controller run, nothing more
    return doc


def fact(path: str) -> Any:
    """One fact of the default description ("pager.service_threads")."""
    return lookup(facts(), path)


def vms_swap_is_sized_for(vms: int) -> int:
    """The VMs densevm sizes its swap for when `--vms` is `vms` (room for `create` too), by
    densevm's rule: computed here because the model asks it of counts past what this host
    could run (the cliff search), which `densevm describe --vms N` refuses."""
    return max(fact("swap.vms_times") * vms, vms + fact("swap.vms_plus"))
