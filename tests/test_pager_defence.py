"""The pager's side of issue 39 (defence in depth between cells) and issue 38's paging-policy
items, checked from outside the crate: a bare `--policy x.so` is never looked up on the dynamic
loader's path, and paging-policy's modules import each other without a cycle. The rest is
covered by `cargo test -p paging-policy` (paging-policy/README.md, "Isolation and failure")."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

from conftest import REPO_ROOT, release_binary
from support.plugins import fifo_plugin

PAGER_SRC = REPO_ROOT / "paging-policy" / "src"


def test_a_bare_policy_name_is_read_from_the_current_directory_not_the_library_path(tmp_path):
    """`--policy libprobe.so`: a file of that name sits in the current directory (not a
    library at all), a real policy of that name on LD_LIBRARY_PATH. dlopen("libprobe.so") would
    load the latter; the pager must open ./libprobe.so and refuse it, in one line."""
    on_path = tmp_path / "libdir"
    on_path.mkdir()
    shutil.copy(fifo_plugin(), on_path / "libprobe.so")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "libprobe.so").write_bytes(b"not an ELF file\n")
    env = dict(os.environ, LD_LIBRARY_PATH=str(on_path))
    proc = subprocess.run(
        [
            str(release_binary("pagesim")),
            "--vms",
            "4",
            "--requests",
            "50",
            "--policy",
            "libprobe.so",
        ],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode != 0, f"the policy on LD_LIBRARY_PATH was loaded: {proc.stdout}"
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "./libprobe.so" in lines[0], proc.stderr


def module_imports() -> dict[str, set[str]]:
    """paging-policy's top-level modules and the crate modules each one uses."""
    graph: dict[str, set[str]] = {}
    for path in PAGER_SRC.rglob("*.rs"):
        rel = path.relative_to(PAGER_SRC)
        if rel.parts[0] == "bin":
            continue
        module = rel.parts[0].removesuffix(".rs")
        if module in ("lib", "main"):
            continue
        uses = graph.setdefault(module, set())
        # Code only: doc links (`[crate::x]`) name a module without using it.
        text = "\n".join(line.split("//")[0] for line in path.read_text().splitlines())
        for m in re.finditer(r"crate::(\w+)", text):
            uses.add(m.group(1))
        for m in re.finditer(r"use crate::\{([^}]*)\}", text):
            uses.update(re.findall(r"(?:^|,)\s*(\w+)", m.group(1)))
    for module, uses in graph.items():
        uses.discard(module)
        uses.intersection_update(graph)
    return graph


def test_paging_policy_modules_have_no_import_cycle():
    graph = module_imports()
    assert "describe" in graph and "pager" in graph
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        stack.append(module)
        for used in sorted(graph[module]):
            if state.get(used) == 1:
                cycle = [*stack[stack.index(used) :], used]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if used not in state:
                visit(used)
        stack.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
