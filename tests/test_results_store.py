"""experiments/results: the stored figures, their manifests and commands, the page of all of
them, and the run plot's phases.

Sweeps here are FAKE (test_scalebench_sweep's made-up point runner, nothing started) except
the local-cluster resume test, whose points are real tiny runs; the run plot is drawn from a
recorded result of a real run (tests/test_results_data/run_result.json: 64 VMs in 24 MiB,
so it has all five phases).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import release_binary
from scalebench import cli, results
from scalebench.plots import MEASUREMENT_LABEL, PHASES, phase_spans, run_plot
from scalebench.report import render_results
from scalebench.result import RunResult
from scalebench.sweep import run_sweep
from test_scalebench_report import images_state
from test_scalebench_sweep import FakePointRunner

ROOT = Path(__file__).resolve().parents[1]
RECORDED = Path(__file__).with_name("test_results_data") / "run_result.json"


def fake_make(figure: str, dest_root: Path, work: Path, **kw) -> dict:
    """results.make with the sweep's points made up (FakePointRunner), a small grid."""

    def runner(exp, out):
        run_sweep(exp, out, FakePointRunner())

    argv = ["results", "make", figure, *[f"--only={o}" for o in kw.get("only", [])]]
    return results.make(figure, argv, work=work, dest_root=dest_root, runner=runner, **kw)


def fake_ecommerce_runs() -> list[dict]:
    shares = {
        ("tpcw", "browsing"): (0.99, 10.0),
        ("tpcw", "ordering"): (0.97, 14.0),
        ("rubis", "browsing"): (0.985, 6.0),
        ("tpcc", "standard"): (0.62, 30.0),
        ("tpcc", "highwrite"): (0.45, 33.0),
    }
    return [
        {
            "options": {"workload": w, "mix": m, "db_cache_mib": 12},
            "steady": {"reached": True},
            "metrics": {"read_share": s, "regions_per_1000": r, "sectors_read": 1000},
        }
        for (w, m), (s, r) in shares.items()
        for _ in range(2)
    ]


def findings_bench():
    """experiments/bench/dbtrace_findings.py as a module."""
    path = ROOT / "experiments" / "bench" / "dbtrace_findings.py"
    spec = importlib.util.spec_from_file_location("dbtrace_findings", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def completed_run(
    run_dir: Path, workload: str, mix: str, clients: int = 4, duration: float = 60.0
) -> dict:
    """A FAKE dbtrace result document, as a completed default run leaves it in run_dir."""
    options = findings_bench().expected_options(workload, mix, clients, duration, run_dir)
    return {
        "options": {**options, "out_dir": str(run_dir)},
        "steady": {"reached": True, "steady_after_s": 90.0, "mode": "cv"},
        "throughput": {"per_minute": 600.0, "per_minute_label": "requests/min"},
        "metrics": {"read_share": 0.9, "regions_per_1000": 12.0},
    }


def test_the_findings_bench_keeps_only_a_completed_run_with_its_own_options(tmp_path: Path):
    bench = findings_bench()
    run = tmp_path / "tpcw-browsing-r1"
    assert bench.kept_run("tpcw", "browsing", 4, 60.0, run) is None
    run.mkdir()
    doc = completed_run(run, "tpcw", "browsing")
    (run / "result.json").write_text(json.dumps(doc))
    assert bench.kept_run("tpcw", "browsing", 4, 60.0, run)["metrics"]["read_share"] == 0.9
    assert bench.kept_run("tpcw", "browsing", 8, 60.0, run) is None
    assert bench.kept_run("tpcw", "browsing", 4, 120.0, run) is None
    assert bench.kept_run("tpcw", "ordering", 4, 60.0, run) is None
    # Made by an older build whose defaults differed (here the database's page cache).
    older = {**doc, "options": {**doc["options"], "db_cache_mib": 64}}
    (run / "result.json").write_text(json.dumps(older))
    assert bench.kept_run("tpcw", "browsing", 4, 60.0, run) is None
    for written in ('{"options": {"workload": "tp', "[]", '{"options": {}, "metrics": null}'):
        (run / "result.json").write_text(written)
        assert bench.kept_run("tpcw", "browsing", 4, 60.0, run) is None


def test_the_findings_bench_run_again_resumes_from_the_runs_it_completed(tmp_path: Path):
    bench = findings_bench()
    for rnd in (1, 2):
        for workload, mix in bench.MIXES:
            run = tmp_path / f"{workload}-{mix}-r{rnd}"
            run.mkdir()
            (run / "result.json").write_text(json.dumps(completed_run(run, workload, mix)))
    script = ROOT / "experiments" / "bench" / "dbtrace_findings.py"
    done = subprocess.run(
        [sys.executable, str(script), "--rounds", "2", "--out", str(tmp_path)],
        check=False, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.count(": kept from ") == 2 * len(bench.MIXES)
    assert " ...\n" not in done.stdout  # no dbtrace run started
    kept = json.loads((tmp_path / "results.json").read_text())
    assert [(d["options"]["workload"], d["options"]["mix"]) for d in kept] == [
        (w, m) for w, m in bench.MIXES for _ in (1, 2)
    ]


@pytest.fixture
def stored(tmp_path: Path) -> Path:
    """A results folder as the commands write it: Fig 8 (part of its grid, fake points) and
    the storage study (fake runs); the other figures not run yet."""
    root = tmp_path / "results"
    root.mkdir()
    shutil.copyfile(ROOT / "experiments" / "results" / "README.md", root / "README.md")
    fake_make("fig08", root, tmp_path / "work08", only=["vms=250"])

    def findings(work: Path) -> None:
        (work / "results.json").write_text(json.dumps(fake_ecommerce_runs()))

    results.make("ecommerce", ["results", "make", "ecommerce"], work=tmp_path / "workec",
                 dest_root=root, runner=findings)  # fmt: skip
    return root


def test_every_manifest_command_parses():
    """The stored manifests' commands, and the command each figure documents, parse."""
    manifests = sorted((ROOT / "experiments" / "results").glob("*/manifest.json"))
    for path in manifests:
        m = json.loads(path.read_text())
        assert m["figure"] == path.parent.name and m["command"].startswith("scalebench ")
        ns = cli.parse(m["argv"])
        assert ns.figure == m["figure"], path
    for figure, command in results.COMMANDS.items():
        assert cli.parse(command.split()[1:]).figure == figure


def test_a_made_figure_has_points_plots_checks_and_a_manifest(stored: Path):
    m = json.loads((stored / "fig08" / "manifest.json").read_text())
    assert cli.parse(m["argv"]).only == ["vms=250"]
    assert m["build"]["commit"] and isinstance(m["build"]["dirty"], bool)
    assert {"cpu_model", "cores", "kernel", "kvm"} <= set(m["host"])
    assert m["host"]["kvm"] in ("pvm", "kvm", "none")
    assert m["points"]["ok"] == m["points"]["stored"] == 2 == m["points"]["grid"]
    assert m["complete"] is False  # --only: part of the grid
    assert m["cluster"] is None and m["wall_seconds"] is not None
    assert "cliff near 1,000 VMs" in m["claim"] and "7,200 RPM" in m["differences"]
    for name in m["files"]:
        assert (stored / "fig08" / name).stat().st_size > 0, name
    assert {"points.csv", "checks.csv", "fig08_throughput.png"} <= set(m["files"])
    assert not list((stored / "fig08").glob("points/")), "per-run directories are not stored"
    assert m["checks"]["passed"] + m["checks"]["failed"] == len(m["checks"]["verdicts"]) > 0


def test_a_manifest_records_the_build_as_its_invocation_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """A figure's published files are tracked: read once they are written, the build of
    every remade figure would read dirty."""
    clean = {"commit": "a" * 40, "dirty": False, "changed_files": 0}
    tree = {"status": clean}
    monkeypatch.setattr(results, "build_info", lambda: dict(tree["status"]))

    def runner(exp, out):
        run_sweep(exp, out, FakePointRunner())
        tree["status"] = {**clean, "dirty": True, "changed_files": 4}

    work = tmp_path / "work"
    m = results.make("fig08", ["results", "make", "fig08", "--only=vms=250"], work=work,
                     dest_root=tmp_path / "results", runner=runner, only=["vms=250"])  # fmt: skip
    assert m["build"] == clean
    invocations = json.loads((work / "invocations.json").read_text())
    assert [i["build"] for i in invocations] == [clean]


def test_a_republished_figure_carries_only_its_experiments_plots(tmp_path: Path):
    root = tmp_path / "results"
    work = tmp_path / "work08"
    fake_make("fig08", root, work, only=["vms=250"])
    (work / "fig08_retired.png").write_bytes(b"an earlier invocation's plot")
    (work / "fig08_retired.csv").write_text("x\n1\n")
    m = fake_make("fig08", root, work, only=["vms=250"])
    assert not {"fig08_retired.png", "fig08_retired.csv"} & set(m["files"])
    assert not list((root / "fig08").glob("fig08_retired*"))
    assert "fig08_throughput.png" in m["files"]


def test_every_figure_named_in_the_report_exists(stored: Path, tmp_path: Path):
    page = render_results(stored).read_text()
    for figure in results.FIGURES:
        assert f'id="{figure}"' in page
        if figure != results.ECOMMERCE:
            assert results.experiment_file(figure).exists()
    srcs = re.findall(r'<img src="([^"]+)"', page)
    assert srcs and all((stored / s).is_file() for s in srcs), srcs
    for figure in ("fig09", "fig10", "fig11"):  # not run: their command is shown instead
        assert results.COMMANDS[figure] in page
    # The real folder's page names only figures that exist (none may have run yet).
    real = tmp_path / "real"
    shutil.copytree(ROOT / "experiments" / "results", real)
    text = render_results(real).read_text()
    assert all((real / s).is_file() for s in re.findall(r'<img src="([^"]+)"', text))
    # The README shows figures' images: each is a plot its figure's command writes.
    readme = (ROOT / "README.md").read_text()
    shown = re.findall(r"!\[[^\]]*\]\((experiments/results/([^/)]+)/([^/)]+\.png))\)", readme)
    # Once Fig 8 and Fig 11 are stored, the README shows them; a broken image before.
    made = {f for f in ("fig08", "fig11") if (ROOT / "experiments" / "results" / f).is_dir()}
    assert {f for _, f, _ in shown} == made
    for _, figure, png in shown:
        assert png in results.figure_plots(figure), (figure, png)
    assert "experiments/results/index.html" in readme


def test_a_failed_check_shows_its_reason_or_asks_for_one(stored: Path):
    (stored / "ecommerce" / "checks.csv").write_text(
        "check,group,passed,detail,study\nx,TPC-W browsing,NO,0.5,99.9/0.1\n"
        "y,RUBiS browsing,NO,0.5,99/1\n"
    )
    (stored / "ecommerce" / "notes.toml").write_text(
        '[reasons]\n"x | TPC-W browsing" = "the guest cache was cold"\n'
    )
    page = render_results(stored).read_text()
    assert "the guest cache was cold" in page and "no reason written yet" in page


def test_the_results_page_loads_every_image_in_headless_chromium(stored: Path, tmp_path: Path):
    page = render_results(stored)
    count = len(re.findall(r"<img ", page.read_text()))
    assert count >= 3  # Fig 8's plot, the study's two
    assert images_state(page, tmp_path / "profile") == f"ok:{count}"


def test_report_subcommand_renders_a_results_folder(stored: Path, capsys):
    assert cli.main(["report", str(stored)]) == 0
    assert (stored / "index.html").exists()


def test_ecommerce_findings_beside_the_study(stored: Path):
    d = stored / "ecommerce"
    m = json.loads((d / "manifest.json").read_text())
    assert m["checks"]["failed"] == 0 and m["checks"]["passed"] == 5 and m["complete"]
    assert (d / "study_block_metrics.csv").exists() and "12 MiB" in m["differences"]
    runs = fake_ecommerce_runs()
    runs[0]["metrics"]["read_share"] = 0.5  # TPC-W browsing no longer read-dominated
    verdicts = {v["group"]: v["passed"] for v in results.ecommerce_findings(runs)}
    assert verdicts["TPC-W browsing"] == "NO" and verdicts["RUBiS browsing"] == "yes"


def test_the_run_plot_labels_the_five_phases_and_the_measurement_window(tmp_path: Path):
    doc = json.loads(RECORDED.read_text())
    r = RunResult(**doc)
    assert [e["phase"] for e in r.timeline] == list(PHASES)
    starts = [e["from_s"] for e in r.timeline]
    assert starts == sorted(starts) and starts[0] < 0 <= starts[1]  # boot before ready
    labels = run_plot(r, tmp_path / "run.png")
    assert labels == [*PHASES, MEASUREMENT_LABEL]
    assert (tmp_path / "run.png").stat().st_size > 10_000
    # A result recorded before the timeline: the phases come from the samples' tags.
    doc.pop("timeline")
    old = RunResult(**doc)
    assert [p for p, _, _ in phase_spans(old)] == list(PHASES)


def test_local_cluster_resumes_an_interrupted_sweep(tmp_path: Path):
    pytest.importorskip("distributed", reason="the cluster extra (dask) is not installed")
    from test_scalebench_cluster import experiment, points, sweep_command, wait_until_gone

    exp, out = experiment(tmp_path, duration=1), tmp_path / "out"
    env = {
        **os.environ,
        "SCALEBENCH_BIN_DIR": str(release_binary("densevm").parent),
        "SCALEBENCH_CALIBRATION": str(tmp_path / "cal.json"),
        "SCALEBENCH_WORK_DIR": str(tmp_path / "worker"),  # the point's processes mention it
    }
    command = sweep_command(tmp_path, exp, out, "--cluster", "local", "--only", "policy=demand")
    first = subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 300
    while not [d for d in points(out).values() if d["status"] == "ok"]:
        assert first.poll() is None, first.stdout.read()
        assert time.monotonic() < deadline
        time.sleep(0.5)
    first.send_signal(signal.SIGTERM)
    assert first.wait(120) == 130, first.stdout.read()
    assert wait_until_gone(str(tmp_path)) == []  # the point's scalebench and densevm stopped
    kept = {k: d["run_id"] for k, d in points(out).items() if d["status"] == "ok"}
    assert 1 <= len(kept) < 3
    second = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=400, check=False
    )
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"{len(kept)} of 3 point(s) already done: kept" in second.stdout + second.stderr
    done = points(out)
    assert len(done) == 3 and all(d["status"] == "ok" for d in done.values())
    assert all(done[k]["run_id"] == run_id for k, run_id in kept.items())
    assert all(d["placement"]["cluster"] == "local" for d in done.values())
    assert wait_until_gone(str(tmp_path)) == []


def test_the_nightly_history_names_each_metric_s_phase():
    from scalebench.report import nightly_phase

    assert nightly_phase("boot1000_s").startswith("phase: boot of probe boot1000")
    load = nightly_phase("incore16_rps")
    assert load.startswith("phase: load of probe incore16") and "measurement window" in load
    assert nightly_phase("no_such_metric") == ""


def test_the_cliff_moves_later_with_smaller_blocks_check():
    from scalebench.checks import CheckSpec, run_checks

    spec = CheckSpec(kind="cliff_later_with_smaller_x", x="block_bytes", series=["alpha"])

    def rows(cliffs: dict[int, int]) -> list[dict]:
        return [
            {"status": "ok", "block_bytes": b, "alpha": 1.0, "vms": v,
             "throughput_rps": 1000.0 if v < cliff else 100.0}
            for b, cliff in cliffs.items()
            for v in (500, 800, 1000, 1250, 1500, 2000)
        ]  # fmt: skip

    assert run_checks([spec], rows({4096: 1500, 32768: 1000, 131072: 800}))[0]["passed"] == "yes"
    assert run_checks([spec], rows({4096: 800, 32768: 1000, 131072: 800}))[0]["passed"] == "NO"
    assert run_checks([spec], rows({4096: 1000, 32768: 1000, 131072: 1000}))[0]["passed"] == "NO"


def test_a_figures_title_and_claim_fit_across_its_plot():
    """Fig 11's title (104 characters) and claim ran off the right edge of its stored plot."""
    import matplotlib.pyplot as plt
    from scalebench.plots import _heading
    from scalebench.sweep import load_experiment

    exp = load_experiment(ROOT / "experiments" / "fig11.toml")
    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    _heading(ax, exp.title, exp.claim)
    fig.canvas.draw()
    heading = ax.get_title(loc="left")
    assert heading.startswith("Figure 11") and "Paper: out of core" in heading
    [text] = [t for t in (ax.title, *ax.texts, *ax.get_children()) if getattr(t, "get_text", None)
              and t.get_text() == heading]  # fmt: skip
    # The axes begin up to 1.1 inches from the figure's left edge (log ticks, a y label).
    assert text.get_window_extent(fig.canvas.get_renderer()).width <= fig.bbox.width - 110
    plt.close(fig)


@pytest.mark.parametrize("figure", ["fig08", "ecommerce"])
def test_replot_redraws_a_stored_figures_plots_and_keeps_its_points_checks_and_build(
    stored: Path, figure: str, capsys
):
    folder = stored / figure
    before = json.loads((folder / "manifest.json").read_text())
    kept = {name: (folder / name).read_bytes() for name in ("points.csv", "checks.csv")}
    plots = [name for name in before["files"] if name.endswith(".png")]
    for name in plots:
        (folder / name).unlink()
    assert cli.main(["results", "replot", figure, "--dest", str(stored)]) == 0
    assert figure in capsys.readouterr().out
    for name in plots:
        assert (folder / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert {name: (folder / name).read_bytes() for name in kept} == kept
    after = json.loads((folder / "manifest.json").read_text())
    redrawn = after.pop("plots_redrawn")
    assert after == before
    assert redrawn["at"] and redrawn["build"]["commit"]
    assert (
        f"{redrawn['at']} on build {redrawn['build']['commit']}"
        in render_results(stored).read_text()
    )


def test_replot_of_a_figure_not_stored_says_how_to_make_it(stored: Path, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["results", "replot", "fig09", "--dest", str(stored)])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "fig09 has no stored results" in err and results.COMMANDS["fig09"] in err


def test_a_redraws_build_is_clean_of_the_stored_results_own_files(monkeypatch):
    """Redrawing the figures one after another changes the stored results' files: they are
    not the drawing code's build, so they do not make it dirty; other changes do."""
    status = {"text": ""}

    def fake_git(*args: str) -> str:  # FAKE git: the status under test, a fixed HEAD
        return status["text"] if args[0] == "status" else "c" * 40

    monkeypatch.setattr(results, "_git", fake_git)
    status["text"] = (
        "M experiments/results/fig08/fig08_throughput.png\n M experiments/results/index.html"
    )
    assert results.build_info(ignoring=results.RESULTS_DIR) == {
        "commit": "c" * 40,
        "dirty": False,
        "changed_files": 0,
    }
    assert results.build_info()["changed_files"] == 2
    status["text"] += "\n M controller/scalebench/plots.py"
    built = results.build_info(ignoring=results.RESULTS_DIR)
    assert built["dirty"] is True and built["changed_files"] == 1


def test_rows_read_back_take_the_grids_values_so_replotted_lines_are_labelled_alike():
    from scalebench.sweep import grid_values, load_experiment

    exp = load_experiment(ROOT / "experiments" / "fig09.toml")
    [row] = grid_values(exp, [{"alpha": "0", "block": "4k", "vms": "500", "status": "ok"}])
    assert row == {"alpha": 0.0, "block": "4k", "vms": 500, "status": "ok"}
    assert isinstance(row["alpha"], float) and f"alpha={row['alpha']}" == "alpha=0.0"
