"""Sweeps: experiment files, resumability, CSV, plots, cliff location.

The point runner here is a FAKE (it returns made-up results without starting
anything): these tests are about the sweep's bookkeeping, not about runs.
"""

from __future__ import annotations

import csv

import pytest
from scalebench.config import REPO_ROOT, ConfigError, RunConfig
from scalebench.result import RunResult
from scalebench.sweep import load_experiment, run_sweep
from scalebench.tables import cliff_rows

EXPERIMENT = """
name = "t"
title = "test sweep"
[base]
block = "32k"
duration = 1
[grid]
policy = ["demand", "wsswap"]
vms = [100, 200, 300, 400]
[[plot]]
name = "tput"
x = "vms"
y = ["throughput_rps", "model_rps"]
series = ["policy"]
[[plot]]
name = "cliff"
kind = "cliff"
x = "block_bytes"
series = ["policy"]
"""


class Interrupt(Exception):
    pass


class FakePointRunner:
    """FAKE point runner: a made-up result with a cliff between 200 and 300 VMs; can stop part
    way."""

    def __init__(self, stop_after: int | None = None) -> None:
        self.calls: list[str] = []
        self.stop_after = stop_after

    def __call__(self, cfg: RunConfig) -> RunResult:
        if self.stop_after is not None and len(self.calls) == self.stop_after:
            raise Interrupt()  # as a Ctrl-C in the middle of the sweep would
        self.calls.append(cfg.labels["point"])
        r = RunResult("fake", cfg.as_dict(), status="ok")
        r.throughput_rps = 1000.0 if cfg.vms <= 200 else 100.0
        r.model_rps = 1000.0 if cfg.vms <= 250 else 90.0
        r.model = {"cliff_vms": 250, "regime": "in-core", "hit_ratio": 1.0, "cpu_us": 1000.0}
        return r


def test_interrupted_sweep_resumes_without_redoing_points(tmp_path):
    path = tmp_path / "t.toml"
    path.write_text(EXPERIMENT)
    exp = load_experiment(path)
    first = FakePointRunner(stop_after=3)
    with pytest.raises(Interrupt):
        run_sweep(exp, tmp_path / "out", first)
    assert len(first.calls) == 3
    second = FakePointRunner()
    doc = run_sweep(exp, tmp_path / "out", second)
    assert len(second.calls) == 5 and not set(first.calls) & set(second.calls)
    assert len(doc["points"]) == 8 and all(p["status"] == "ok" for p in doc["points"].values())
    third = FakePointRunner()
    run_sweep(exp, tmp_path / "out", third)
    assert third.calls == []  # everything was done
    rows = list(csv.DictReader((tmp_path / "out" / "results.csv").read_text().splitlines()))
    assert len(rows) == 8 and {r["policy"] for r in rows} == {"demand", "wsswap"}
    for name in ("tput.png", "cliff.png", "cliff.csv", "sweep.json"):
        assert (tmp_path / "out" / name).stat().st_size > 0, name
    cliff = list(csv.DictReader((tmp_path / "out" / "cliff.csv").read_text().splitlines()))
    assert float(cliff[0]["measured_cliff_vms"]) == pytest.approx(
        200 + 100 * (1000 - 500) / 900, rel=1e-5
    )
    assert float(cliff[0]["model_cliff_vms"]) == 250


def test_part_of_a_grid_then_the_rest(tmp_path):
    path = tmp_path / "t.toml"
    path.write_text(EXPERIMENT)
    exp = load_experiment(path)
    part = FakePointRunner()
    run_sweep(exp.restricted(["policy=demand", "vms=300"]), tmp_path / "out", part)
    assert part.calls == ["policy=demand,vms=300"]
    rest = FakePointRunner()
    run_sweep(exp, tmp_path / "out", rest)
    assert len(rest.calls) == 7 and "policy=demand,vms=300" not in rest.calls
    for bad, message in (
        (["policy"], "KEY=VALUE"),
        (["alpha=1"], "KEY=VALUE"),
        (["policy=lru"], "demand, wsswap"),
    ):
        with pytest.raises(ConfigError, match=message):
            exp.restricted(bad)


def test_failed_points_are_run_again(tmp_path):
    path = tmp_path / "t.toml"
    path.write_text(EXPERIMENT)
    exp = load_experiment(path)
    failing = FakePointRunner()
    run_sweep(
        exp,
        tmp_path / "out",
        lambda cfg: RunResult("x", cfg.as_dict(), status="failed", error="boom"),
    )
    run_sweep(exp, tmp_path / "out", failing)
    assert len(failing.calls) == 8


def test_cliff_never_reached():
    rows = [
        {"vms": v, "throughput_rps": 1000, "status": "ok", "cliff_vms": 5000} for v in (100, 200)
    ]
    assert cliff_rows(rows, [])[0]["measured_cliff_vms"] is None


@pytest.mark.parametrize(
    "text,message",
    [
        ("[base]\nvms = 0\n", "--vms must be at least 1"),
        ("[grid]\nblock = ['3k']\n", "power of two"),
        ("[grid]\nvms = 5\n", "must be non-empty lists"),
        ("[base]\nbogus = 1\n", "unknown setting"),
        ("not toml [", "not valid TOML"),
    ],
)
def test_bad_experiment_files(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_experiment(path)


def test_unreadable_experiment_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read experiment file"):
        load_experiment(tmp_path / "missing.toml")


def test_the_repository_experiments_are_valid():
    files = sorted((REPO_ROOT / "experiments").glob("*.toml"))
    names = {f.stem for f in files}
    assert {"fig08", "fig09", "fig10", "fig11", "nightly"} <= names
    for f in files:
        if f.name.startswith("db_"):
            continue  # the database experiments belong to scalebench dbtrace
        exp = load_experiment(f)
        assert exp.points() and exp.plots, f


def test_acceptance_checks():
    from scalebench.checks import CheckSpec, run_checks

    def row(policy, vms, tput, ratio, regime):
        return {
            "status": "ok",
            "policy": policy,
            "vms": vms,
            "throughput_rps": tput,
            "cliff_vms": 1000,
            "measured_over_model": ratio,
            "regime": regime,
        }

    rows = [
        row("demand", 250, 1000, 1.0, "in-core"),
        row("demand", 500, 1050, 1.1, "in-core"),
        row("demand", 1000, 980, 0.9, "in-core"),
        row("demand", 1100, 40, 1.2, "disk-bound"),
        row("wsswap", 250, 1000, 1.0, "in-core"),
        row("wsswap", 500, 700, 1.0, "in-core"),
        row("wsswap", 1000, 990, 1.0, "in-core"),
        row("wsswap", 1100, 60, 1.5, "disk-bound"),
    ]
    verdicts = run_checks(
        [
            CheckSpec("flat_until_cliff", series=["policy"], min_vms=250),
            CheckSpec("cliff_matches_model", series=["policy"]),
            CheckSpec("disk_bound_past_cliff", series=["policy"]),
            CheckSpec("model_agreement"),
            CheckSpec("above", series=["vms"]),
            CheckSpec("rising", x="vms", series=["policy"]),
        ],
        rows,
    )
    got = {(v["check"], v["group"]): v["passed"] for v in verdicts}
    assert got[("flat until the cliff", "policy=demand")] == "yes"
    assert got[("flat until the cliff", "policy=wsswap")] == "NO"  # 700 is 30% below the median
    assert got[("cliff matches the model", "policy=demand")] == "yes"
    assert got[("disk-bound past the cliff", "policy=wsswap")] == "yes"
    assert got[("measured/model", "all")] == "NO"  # 1.5 is beyond +-35%
    assert got[("wsswap above demand", "vms=1100")] == "yes"
    assert got[("throughput_rps rises with vms", "policy=demand")] == "NO"
    # `only` restricts a check to matching points: wsswap's 1.5 no longer counts.
    demand_only = run_checks([CheckSpec("model_agreement", only={"policy": "demand"})], rows)
    assert [v["passed"] for v in demand_only] == ["yes"] and "4 points" in demand_only[0]["detail"]
    # A point measured before its closed loop's steady state is left out, by name; one that
    # was (steady_window True, or a row read back from CSV) counts. The row read back says so
    # as text.
    wsswap_late = {**rows[7], "point": "policy=wsswap,vms=1100", "steady_window": "False"}
    demand_late = {**rows[3], "steady_window": True}
    agreement = run_checks([CheckSpec("model_agreement")], [*rows[:3], demand_late, wsswap_late])
    assert agreement[0]["passed"] == "yes"
    assert agreement[0]["detail"].startswith("4 points")
    left_out = "left out, measured before the steady state: policy=wsswap,vms=1100"
    assert left_out in agreement[0]["detail"]


def test_unknown_plot_or_check_kinds_are_refused(tmp_path):
    for table in ("[[plot]]\nname = 'p'\nx = 'vms'\nkind = 'pie'\n", "[[check]]\nkind = 'vibes'\n"):
        path = tmp_path / "bad.toml"
        path.write_text("[grid]\nvms = [1]\n" + table)
        with pytest.raises(ConfigError, match=r"unknown (plot|check) kind"):
            load_experiment(path)


def test_set_replaces_base_settings_and_refuses_grid_axes(tmp_path):
    path = tmp_path / "t.toml"
    path.write_text(EXPERIMENT)
    exp = load_experiment(path).overridden(["addr_base=127.2.0.0", "warmup=30", "disk=hdd"])
    configs = [cfg for _, cfg in exp.points()]
    assert {(c.addr_base, c.warmup, c.disk) for c in configs} == {("127.2.0.0", 30, "hdd")}
    assert [k for k, _ in exp.points()] == [k for k, _ in load_experiment(path).points()]
    for bad, message in (
        (["warmup"], "KEY=VALUE"),
        (["colour=red"], "KEY=VALUE"),
        (["vms=5"], "grid axis"),
        (["block=3k"], "power of two"),
    ):
        with pytest.raises(ConfigError, match=message):
            load_experiment(path).overridden(bad)


def test_a_sweep_over_two_kinds_of_host_warns(tmp_path):
    path = tmp_path / "t.toml"
    path.write_text(EXPERIMENT)
    exp = load_experiment(path)
    fake = FakePointRunner()

    def on_two_kinds(cfg: RunConfig) -> RunResult:
        r = fake(cfg)
        r.host = {"hostname": f"h{cfg.vms}", "kind": "big" if cfg.vms <= 200 else "small"}
        return r

    doc = run_sweep(exp, tmp_path / "out", on_two_kinds)
    assert doc["hosts"] == {"big": ["h100", "h200"], "small": ["h300", "h400"]}
    assert len(doc["warnings"]) == 1 and "2 kinds of host" in doc["warnings"][0]
    rows = list(csv.DictReader((tmp_path / "out" / "results.csv").read_text().splitlines()))
    assert [(r["host"], r["host_kind"]) for r in rows[:3]] == [
        ("h100", "big"),
        ("h200", "big"),
        ("h300", "small"),
    ]
    one_kind = run_sweep(exp, tmp_path / "again", FakePointRunner())
    assert one_kind["warnings"] == [] and len(one_kind["hosts"]) == 1


def test_a_sweep_plot_marks_zeros_on_a_log_axis_and_windows_before_the_steady_state(
    tmp_path, monkeypatch
):
    import matplotlib.pyplot as plt
    from scalebench import plots

    figures = []
    monkeypatch.setattr(plots.plt, "close", figures.append)
    rows = [
        {"vms": 500, "throughput_rps": 9000.0, "steady_window": "True", "block": "4k"},
        {"vms": 1250, "throughput_rps": 3.5, "steady_window": "False", "block": "4k"},
        {"vms": 2000, "throughput_rps": 0.0, "steady_window": "False", "block": "4k"},
    ]
    plots.line_plot(rows, "vms", ["throughput_rps"], ["block"], tmp_path / "p.png", "t", logy=True)
    assert (tmp_path / "p.png").stat().st_size > 0
    (ax,) = figures[0].axes
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["block=4k", plots.ZERO_LABEL, plots.UNSTEADY_LABEL]
    series = ax.lines[0]
    assert list(series.get_xdata()) == [500.0, 1250.0]  # the 0 is not on the log axis's line
    marked = {(line.get_marker(), tuple(line.get_xdata())) for line in ax.lines[1:]}
    assert ("v", (2000.0,)) in marked  # ... but on its bottom edge
    assert ("x", (1250.0,)) in marked and ("x", (2000.0,)) in marked
    plt.close(figures[0])
