"""Containment: a real memory cgroup is created with the limit, a child starts inside it, it is
removed."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from scalebench.cgroup import Containment, memory_limit, parse_psi
from scalebench.describe import fact
from scalebench.procs import Child, wait_until
from scalebench.units import GIB, MIB


def test_limit_is_budget_plus_documented_margin():
    assert memory_limit(GIB, 4000) == GIB + 4000 * MIB + 256 * MIB
    # Under --max-live the hibernated VMs count at what densevm says one keeps.
    asleep = fact("config.host_bytes_per_hibernated_vm")
    assert 0 < asleep < MIB
    assert memory_limit(GIB, 4000, 1000) == GIB + 1000 * MIB + 3000 * asleep + 256 * MIB
    assert memory_limit(GIB, 4000, 9000) == memory_limit(GIB, 4000)


def test_child_starts_inside_a_real_group_which_is_then_removed(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("creating cgroups needs root")
    c = Containment.create(f"test-{os.getpid()}", 300 * MIB)
    try:
        assert c.memory_group is not None, c.warning  # this host has the v1 memory controller
        limit_file = "memory.limit_in_bytes" if c.memory_version == 1 else "memory.max"
        assert int((c.memory_group / limit_file).read_text()) == 300 * MIB
        child = Child(c.wrap(["sleep", "30"]), stdout=None, stderr=None)
        try:
            # The wrapper joins the groups, then execs: the member is the sleep itself.
            comm = Path(f"/proc/{child.pid}/comm")
            assert wait_until(lambda: comm.read_text().strip() == "sleep", 5)
            membership = Path(f"/proc/{child.pid}/cgroup").read_text()
            assert child.pid in c.members()
            rel = (
                "/" + str(c.memory_group.relative_to(c.memory_group.parents[1]))
                if c.memory_version == 1
                else None
            )
            if rel:
                assert f":memory:{rel}\n" in membership
            if c.psi_group is not None:
                assert c.pressure()["some"]["total"] >= 0
        finally:
            child.stop()
        assert c.memory_stats()["peak_bytes"] > 0
    finally:
        c.remove()
    assert not c.memory_group.exists()
    if c.psi_group is not None:
        assert not c.psi_group.exists()


def test_a_member_that_outlives_its_parent_is_killed_and_the_group_removed():
    """As a cell outliving a killed densevm: remove() must not leave the group behind."""
    if os.geteuid() != 0:
        pytest.skip("creating cgroups needs root")
    c = Containment.create(f"test-orphan-{os.getpid()}", 300 * MIB)
    assert c.memory_group is not None, c.warning
    # The shell leaves a child that ignores SIGTERM and exits: the child is orphaned inside.
    child = Child(
        c.wrap(["/bin/sh", "-c", "trap '' TERM; sleep 300 & echo $!"]),
        stdout=subprocess.PIPE,
        stderr=None,
    )
    orphan = int(child.popen.stdout.readline())
    child.popen.wait(timeout=10)
    assert c.members() == [orphan]
    assert c.remove() is None
    assert not c.memory_group.exists()
    assert not Path(f"/proc/{orphan}").exists() or "Z" in Path(f"/proc/{orphan}/stat").read_text()


def test_psi_parsing():
    text = (
        "some avg10=1.50 avg60=0.00 avg300=0.00 total=1234\n"
        "full avg10=0.00 avg60=0.00 avg300=0.00 total=99\n"
    )
    psi = parse_psi(text)
    assert psi["some"]["avg10"] == 1.5 and psi["full"]["total"] == 99
