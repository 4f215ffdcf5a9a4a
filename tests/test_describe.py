"""The controller reads the pager's and the guest's facts from `densevm describe`
instead of keeping copies: every fact it reads is there, and the models it
charges are the pager's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from scalebench import describe
from scalebench.config import ConfigError
from scalebench.disks import disk_model

CONTROLLER = Path(describe.__file__).parent


def test_every_fact_the_controller_reads_is_required_and_described():
    read = set()
    for source in CONTROLLER.rglob("*.py"):
        read.update(re.findall(r'fact\(\s*(?:f?)"([a-z_.{}0-9-]+)"', source.read_text()))
    read = {path for path in read if "{" not in path}
    assert read, "no fact() reads found: the scan is broken"
    assert read <= set(describe.REQUIRED), f"read but not required: {read - set(describe.REQUIRED)}"
    describe.check(describe.describe_config())


@pytest.mark.parametrize("missing", describe.REQUIRED)
def test_a_description_without_a_fact_is_refused(missing):
    doc = describe.describe_config()
    *parents, leaf = missing.split(".")
    node = doc
    for key in parents:
        node = node[key]
    del node[leaf]
    with pytest.raises(describe.DescribeError, match=re.escape(missing)):
        describe.check(doc)


@pytest.mark.parametrize("name", ["hdd", "hdd15k", "ssd", "array:4", "raid5:5"])
def test_the_models_drives_are_the_pagers(name):
    pager = describe.fact("pager.disks.drives")
    member = name if ":" not in name else describe.fact("pager.disks.array_drive")
    drive = disk_model(name).drive
    assert drive is not None
    for key in ("seek_ms", "track_ms", "rpm", "mb_s", "overhead_ms", "lat_ms"):
        assert getattr(drive, key) == pager[member][key], key


def test_densevm_refuses_what_it_would_refuse_to_serve():
    with pytest.raises(ConfigError, match="unknown policy 'lru'"):
        describe.describe_config("--policy", "lru")
    assert describe.describe_config("--policy", "wsswap,after=2")["config"]["policy"] == (
        "wsswap,after=2"
    )


def _resident_bytes(doc: dict) -> int:
    """Bytes of the blocks a request touches, from the guest's request ranges."""
    block = doc["config"]["block_bytes"]
    blocks = {
        b
        for offset, length in doc["guest"]["request_ranges"]
        for b in range(offset // block, -(-(offset + length) // block))
    }
    return len(blocks) * block


@pytest.mark.parametrize("block", ["4k", "32k", "256k"])
def test_cells_are_large_while_the_working_sets_fit_and_small_once_they_page(block):
    doc = describe.describe_config("--block", block)
    fit = doc["config"]["budget_bytes"] // _resident_bytes(doc)
    for vms, cell_vms in [(16, 500), (fit, 500), (fit + 1, 100), (4000, 100)]:
        got = describe.describe_config("--block", block, "--vms", str(vms))["config"]["cell_vms"]
        assert got == cell_vms, (vms, got)
    explicit = describe.describe_config("--block", block, "--vms", "16", "--cell-vms", "7")
    assert explicit["config"]["cell_vms"] == 7


@pytest.mark.parametrize("vms", [1, 20, 64, 65, 4000])
def test_the_swap_sizing_rule_is_densevms(vms):
    sized_for = describe.describe_config("--vms", str(vms))["swap"]["vms_sized_for"]
    assert describe.vms_swap_is_sized_for(vms) == sized_for
