"""`scalebench policy compare`: pagesim over policies x block sizes x workloads, in parallel.

A workload is either a Zipf alpha (pagesim's synthetic trace, the same seed for every
policy) or a trace file (its metadata's alpha labels it). Every point is one pagesim
process; points run on a pool of os.cpu_count() workers. The table gives the hit ratio,
the swap traffic, pagesim's predicted throughput and the gain over `demand` at the same
block and workload (demand is always run: it is the baseline).

A `py:MODULE:CLASS` policy (MODULE importable, or a path to a .py file) is a Python
policy (`scalebench.policydev.pypolicy`): its points run in this process through the
`pagesim` extension, one at a time (they hold the interpreter), beside the others.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from ..config import ConfigError, binary
from ..units import parse_size
from . import pypolicy, traces

BASELINE = "demand"
BUILT_IN = ("demand", "wsswap")


@dataclass(frozen=True)
class Workload:
    """Synthetic Zipf requests (trace None) or a trace file."""

    alpha: float | None
    trace: Path | None = None

    @property
    def label(self) -> str:
        return self.trace.name if self.trace else f"alpha={self.alpha:g}"


@dataclass(frozen=True)
class GridSpec:
    """The comparison: policies (names or plugin paths), blocks, workloads and fixed knobs."""

    policies: tuple[str, ...]
    blocks: tuple[str, ...]
    workloads: tuple[Workload, ...]
    disk: str = "hdd"
    mem: str = "1G"
    vms: int = 4000
    requests: int = 200_000
    warmup: int = 50_000
    seed: int = 1
    workers: int = os.cpu_count() or 1


@dataclass
class PointResult:
    """One grid point: pagesim's figures (or its error)."""

    policy: str
    block: str
    alpha: float | None
    workload: str
    hit_ratio: float | None = None
    request_hit_ratio: float | None = None
    swap_read_mib: float | None = None
    swap_write_mib: float | None = None
    predicted_rps: float | None = None
    gain_over_demand: float | None = None
    sim_seconds: float | None = None
    error: str = ""

    @property
    def block_kib(self) -> int:
        return parse_size(self.block) // 1024


def policy_label(policy: str) -> str:
    """A short name for tables and plots: built-ins as is, plugins by their file stem, Python
    policies by their class name, and arguments in parentheses (`wsswap(after=8)`)."""
    if policy.startswith(pypolicy.PREFIX):
        return policy.rsplit(":", 1)[-1]
    head, *args = policy.split(",")
    name = head if head in BUILT_IN else Path(head).stem.removeprefix("lib")
    return f"{name}({','.join(args)})" if args else name


def parse_policies(text: str) -> tuple[str, ...]:
    """The --policies list with plugin paths made absolute; demand first, added if absent.

    Items are separated by commas; a `key=value` item belongs to the policy before it, as
    its argument (`wsswap,after=8`, `./libmine.so,window=100`): the same spelling as
    densevm's and pagesim's `--policy`. A `py:MODULE:CLASS` item is a Python policy, loaded
    here once to check it (a .py path made absolute).
    """
    items: list[list[str]] = []
    for token in filter(None, (t.strip() for t in text.split(","))):
        if "=" in token:
            if not items:
                raise ConfigError(f"--policies: argument {token} comes before any policy")
            items[-1].append(token)
        else:
            items.append([token])
    out: list[str] = []
    for head, *args in items:
        if head.startswith(pypolicy.PREFIX):
            head = pypolicy.absolute(head)
            try:
                pypolicy.load(head)
            except Exception as e:  # any failure of the user's module
                raise ConfigError(f"--policies: {head}: {type(e).__name__}: {e}") from e
        elif head not in BUILT_IN:
            path = Path(head).expanduser()
            if not path.is_file():
                raise ConfigError(f"--policies: {head} is neither demand, wsswap nor a plugin file")
            head = str(path.resolve())
        out.append(",".join([head, *args]))
    if not out:
        raise ConfigError("--policies is empty")
    if BASELINE not in out:
        out.insert(0, BASELINE)
    return tuple(dict.fromkeys(out))


def parse_blocks(text: str) -> tuple[str, ...]:
    blocks = tuple(b.strip() for b in text.split(",") if b.strip())
    for b in blocks:
        try:
            size = parse_size(b)
        except ValueError as e:
            raise ConfigError(f"--blocks: {e}") from None
        if size < 4096 or size > 256 * 1024 or size & (size - 1):
            raise ConfigError(f"--blocks: {b} is not a power of two between 4k and 256k")
    if not blocks:
        raise ConfigError("--blocks is empty")
    return blocks


def parse_workloads(alphas: str | None, trace_files: list[str]) -> tuple[Workload, ...]:
    """Either alphas (synthetic) or traces, not both."""
    if trace_files and alphas:
        raise ConfigError("give --alpha or --trace, not both (a trace's alpha is in its metadata)")
    if trace_files:
        out = []
        for name in trace_files:
            try:
                info, _ = traces.read(Path(name))
            except traces.TraceError as e:
                raise ConfigError(str(e)) from None
            out.append(Workload(info.alpha, Path(name).resolve()))
        return tuple(out)
    try:
        values = tuple(float(a) for a in (alphas or "1.0").split(",") if a.strip())
    except ValueError:
        raise ConfigError(f"--alpha: not a list of numbers: {alphas}") from None
    if not values or any(not a >= 0 for a in values):
        raise ConfigError("--alpha needs numbers >= 0")
    return tuple(Workload(a) for a in values)


def pagesim_options(spec: GridSpec, block: str, w: Workload) -> dict[str, str]:
    """pagesim's options for one point (without the policy), as `--name value` pairs."""
    options = {"block": block, "mem": spec.mem, "disk": spec.disk, "warmup": str(spec.warmup)}
    if w.trace:
        return {**options, "trace": str(w.trace)}
    return {
        **options,
        **{"vms": str(spec.vms), "alpha": repr(w.alpha), "requests": str(spec.requests)},
        "seed": str(spec.seed),
    }


def run_point(pagesim: Path, spec: GridSpec, policy: str, block: str, w: Workload) -> PointResult:
    point = PointResult(policy_label(policy), block, w.alpha, w.label)
    options = pagesim_options(spec, block, w)
    if policy.startswith(pypolicy.PREFIX):
        try:
            r = simulate_python(pypolicy.load(policy), options)
        except (ValueError, RuntimeError) as e:
            point.error = str(e)
            return point
    else:
        argv = [str(pagesim), "--json", "--policy", policy]
        argv += [a for name, value in options.items() for a in (f"--{name}", value)]
        proc = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0:
            lines = proc.stderr.strip().splitlines()
            point.error = lines[-1] if lines else f"pagesim exited with status {proc.returncode}"
            return point
        r = json.loads(proc.stdout)
    point.hit_ratio = r["hit_ratio"]
    point.request_hit_ratio = r["request_hit_ratio"]
    point.swap_read_mib = r["swap_read_bytes"] / 2**20
    point.swap_write_mib = r["swap_write_bytes"] / 2**20
    point.predicted_rps = r["predicted_rps"]
    point.sim_seconds = r["sim_seconds"]
    return point


def simulate_python(policy: pypolicy.Policy, options: dict[str, str]) -> dict:
    """pagesim's report for a Python policy, through the `pagesim` extension."""
    import pagesim

    return pagesim.simulate(policy, **options)


def run_grid(spec: GridSpec, on_done=lambda point: None) -> list[PointResult]:
    """Every point (in grid order), with the gain over demand filled in."""
    pagesim = binary("pagesim")
    grid = [(p, b, w) for w in spec.workloads for b in spec.blocks for p in spec.policies]
    with ThreadPoolExecutor(max(1, spec.workers)) as pool:
        futures = [pool.submit(run_point, pagesim, spec, p, b, w) for p, b, w in grid]
        points = []
        for f in futures:
            points.append(f.result())
            on_done(points[-1])
    base = {(p.block, p.workload): p.predicted_rps for p in points if p.policy == BASELINE}
    for p in points:
        ref = base.get((p.block, p.workload))
        if p.predicted_rps is not None and ref:
            p.gain_over_demand = p.predicted_rps / ref
    return points


def table(points: list[PointResult]) -> str:
    """The comparison as aligned text; failed points are listed after it."""
    head = ("policy", "block", "workload", "hit", "swap in MiB", "swap out MiB", "pred req/s")
    rows = [(*head, "x demand")]
    for p in points:
        if not p.error:
            rows.append(
                (
                    p.policy,
                    p.block,
                    p.workload,
                    f"{p.hit_ratio:.4f}",
                    f"{p.swap_read_mib:.1f}",
                    f"{p.swap_write_mib:.1f}",
                    f"{p.predicted_rps:.1f}",
                    f"{p.gain_over_demand:.2f}x" if p.gain_over_demand else "-",
                )
            )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head) + 1)]
    lines = [
        "  ".join(
            c.ljust(w) if i < 3 else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in rows
    ]
    lines += [f"{p.policy} {p.block} {p.workload}: error: {p.error}" for p in points if p.error]
    return "\n".join(lines)


def write_outputs(out: Path, spec: GridSpec, points: list[PointResult]) -> list[Path]:
    """compare.csv, the plots and experiment.json (what `scalebench report` renders)."""
    from ..plots import line_plot

    out.mkdir(parents=True, exist_ok=True)
    names = [f.name for f in fields(PointResult)]
    with open(out / "compare.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[*names, "block_kib"])
        w.writeheader()
        for p in points:
            w.writerow({**asdict(p), "block_kib": p.block_kib})
    rows = [{**asdict(p), "block_kib": p.block_kib} for p in points if not p.error]
    written = [out / "compare.csv"]
    for workload in dict.fromkeys(p["workload"] for p in rows):
        path = out / f"throughput_vs_block_{_slug(workload)}.png"
        line_plot(
            [r for r in rows if r["workload"] == workload],
            "block_kib",
            ["predicted_rps"],
            ["policy"],
            path,
            f"predicted throughput vs block size ({workload}, disk {spec.disk}, mem {spec.mem})",
            logx=True,
            ylabel="predicted requests/s",
        )
        written.append(path)
    if len({r["alpha"] for r in rows if r["alpha"] is not None}) > 1:
        for block in spec.blocks:
            path = out / f"throughput_vs_alpha_{block}.png"
            line_plot(
                [r for r in rows if r["block"] == block and r["alpha"] is not None],
                "alpha",
                ["predicted_rps"],
                ["policy"],
                path,
                f"predicted throughput vs Zipf alpha (block {block}, disk {spec.disk})",
                ylabel="predicted requests/s",
            )
            written.append(path)
    experiment = {
        "title": "policy compare (pagesim)",
        "grid": {
            "policy": [policy_label(p) for p in spec.policies],
            "block": list(spec.blocks),
            "workload": [w.label for w in spec.workloads],
            "disk": spec.disk,
            "mem": spec.mem,
        },
        "policies": list(spec.policies),
    }
    (out / "experiment.json").write_text(json.dumps(experiment, indent=2) + "\n")
    return written


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in ".-" else "_" for c in text)
