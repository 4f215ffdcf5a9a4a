"""`scalebench report DIR`: one self-contained HTML page for a sweep directory.

It shows every PNG plot and every CSV table at the top of DIR, then links to
each point's result and run plot. A small script checks, once the page has
loaded, that every image decoded, and says so on the page (and in the body's
`data-images` attribute, which the report test reads).
"""

from __future__ import annotations

import csv
import html
import json
from pathlib import Path

_CHECK_IMAGES = """
window.addEventListener('load', () => {
  const imgs = Array.from(document.images);
  const bad = imgs.filter(i => !(i.complete && i.naturalWidth > 0));
  document.body.dataset.images = bad.length
      ? 'broken:' + bad.map(i => i.getAttribute('src')).join(',')
      : 'ok:' + imgs.length;
  document.getElementById('imgstatus').textContent = bad.length
      ? bad.length + ' of ' + imgs.length + ' image(s) did not load'
      : imgs.length + ' image(s), all loaded';
});
"""

_STYLE = """
body { font-family: sans-serif; margin: 2em; max-width: 1100px; }
table { border-collapse: collapse; font-size: 12px; margin-bottom: 2em; }
td, th { border: 1px solid #ccc; padding: 2px 6px; text-align: right; }
th { background: #eee; }
img { max-width: 100%; border: 1px solid #ddd; }
.scroll { overflow-x: auto; }
"""


def _table(path: Path) -> str:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    if not rows:
        return "<p>(empty)</p>"
    head = "".join(f"<th>{html.escape(c)}</th>" for c in rows[0])
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows[1:]
    )
    return f'<div class="scroll"><table><tr>{head}</tr>{body}</table></div>'


def render(directory: Path) -> Path:
    """Write DIR/report.html and return its path; FileNotFoundError if DIR does not exist."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory} is not a directory")
    meta = {}
    if (directory / "experiment.json").exists():
        meta = json.loads((directory / "experiment.json").read_text())
    title = meta.get("title") or meta.get("name") or directory.name
    parts = [f"<h1>{html.escape(title)}</h1>", '<p id="imgstatus">checking images...</p>']
    if meta.get("claim"):
        parts.append(f"<p><b>The paper:</b> {html.escape(meta['claim'])}</p>")
    if meta.get("grid"):
        grid = ", ".join(f"{k}: {v}" for k, v in meta["grid"].items())
        parts.append(f"<p>Grid: {html.escape(grid)}</p>")
    for png in sorted(directory.glob("*.png")):
        parts.append(
            f"<h2>{html.escape(png.stem)}</h2>"
            f'<img src="{html.escape(png.name)}" alt="{html.escape(png.stem)}">'
        )
    for table in sorted(directory.glob("*.csv")):
        parts.append(f"<h2>{html.escape(table.name)}</h2>{_table(table)}")
    points = sorted(p.parent for p in directory.glob("points/*/result.json"))
    if points:
        items = []
        for p in points:
            rel = p.relative_to(directory)
            plot = f' <a href="{rel}/run.png">plot</a>' if (p / "run.png").exists() else ""
            items.append(
                f'<li>{html.escape(p.name)}: <a href="{rel}/result.json">result</a>{plot}</li>'
            )
        parts.append(f"<h2>Points</h2><ul>{''.join(items)}</ul>")
    page = (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{_STYLE}</style></head><body>{''.join(parts)}<script>{_CHECK_IMAGES}</script></body></html>"
    )
    out = directory / "report.html"
    out.write_text(page)
    return out


def render_history(history_file: Path, directory: Path) -> Path:
    """Write DIR/index.html: every nightly metric's series (samples, median, confidence band,
    change points) and the runs' table; return its path."""
    from .changepoint import change_points, estimate
    from .history import History, counts

    store = History(history_file)
    runs = store.runs()
    store.close()
    directory.mkdir(parents=True, exist_ok=True)
    metrics = list(dict.fromkeys(m for r in runs for m in r.samples))
    parts = [
        f"<h1>Nightly history: {html.escape(str(history_file))}</h1>",
        '<p id="imgstatus">checking images...</p>',
        "<p>Dots: samples (grey: runs on a busy host, left out of detection); line: medians;"
        " band: 95% bootstrap CI; dashed: change points found by E-Divisive.</p>",
    ]
    for metric in metrics:
        series = [(r, r.samples[metric]) for r in runs if metric in r.samples]
        counted = [s for r, s in series if counts(r)]
        cps = change_points([v for s in counted for v in s])
        counted_x = [x for x, (r, _) in enumerate(series) if counts(r)]
        first = [sum(len(s) for s in counted[:k]) for k in range(len(counted))]
        boundaries = []
        for cp in cps:  # a change at a run's first sample sits between runs, else on the run
            k = max(i for i, f in enumerate(first) if f <= cp)
            boundaries.append(counted_x[k] - 0.5 if cp == first[k] else counted_x[k])
        rows = []
        for r, s in series:
            e = estimate(s)
            rows.append((r.id or 0, s, e.median, e.ci_low, e.ci_high, not counts(r)))
        png = f"{metric}.png"
        phase = nightly_phase(metric)
        history_plot(metric, rows, boundaries, directory / png, phase)
        parts.append(
            f"<h2>{html.escape(metric)}</h2><p>{html.escape(phase)}</p>"
            f'<img src="{png}" alt="{html.escape(metric)}">'
        )
    head = "".join(f"<th>{c}</th>" for c in ("run", "started", "mode", "build", "verdict", "host"))
    body = "".join(
        "<tr>"
        + "".join(
            f"<td>{html.escape(str(c))}</td>"
            for c in (
                r.id,
                r.started_at,
                r.mode,
                r.build,
                r.verdict,
                f"load {r.host.get('load_start', ['?'])[0]}, "
                f"steal {r.host.get('steal_fraction', 0):.1%}",
            )
        )
        + "</tr>"
        for r in runs
    )
    parts.append(f'<h2>Runs</h2><div class="scroll"><table><tr>{head}</tr>{body}</table></div>')
    page = (
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>Nightly history</title>"
        f"<style>{_STYLE}</style></head><body>{''.join(parts)}<script>{_CHECK_IMAGES}</script>"
        "</body></html>"
    )
    out = directory / "index.html"
    out.write_text(page)
    return out


PER_BOOT_FIELDS = ("boot_seconds", "host_bytes_per_vm")


def nightly_phase(metric: str, metrics_file: Path | None = None) -> str:
    """Which phase of its probe a nightly metric is measured in (boot, or the load windows
    after the warm-up), from experiments/nightly/metrics.toml; "" for one it does not list."""
    import tomllib

    from .config import REPO_ROOT

    path = metrics_file or REPO_ROOT / "experiments" / "nightly" / "metrics.toml"
    try:
        doc = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return ""
    spec = next((m for m in doc.get("metrics", []) if m.get("name") == metric), None)
    if spec is None or "probe" not in spec:
        return "phase: ratio of two metrics" if spec else ""
    probe = doc.get("probe", {}).get(spec["probe"], {})
    if spec.get("field") in PER_BOOT_FIELDS:
        return f"phase: boot of probe {spec['probe']} ({probe.get('vms', '?')} VMs), once per boot"
    warmup = f" after a {probe['warmup_s']:g} s warm-up" if probe.get("warmup_s") else ""
    return (
        f"phase: load of probe {spec['probe']}: {probe.get('windows', '?')} measurement "
        f"window(s) of {probe.get('window_s', '?')} s{warmup}"
    )


def history_plot(
    metric: str,
    runs: list[tuple[int, list[float], float, float, float, bool]],
    boundaries: list[float],
    path: Path,
    phase: str = "",
) -> None:
    """A nightly metric's series: every sample, each run's median with its confidence band, runs
    on a busy host in grey, and change points as vertical lines. `runs` holds (run id, samples,
    median, CI low, CI high, left out of detection); `boundaries` are x positions between runs."""
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.5))
    xs = list(range(len(runs)))
    for x, (_, samples, _, _, _, left_out) in zip(xs, runs, strict=True):
        ax.scatter(
            [x] * len(samples), samples, s=8, color="grey" if left_out else "tab:blue", alpha=0.4
        )
    ax.fill_between(xs, [r[3] for r in runs], [r[4] for r in runs], alpha=0.2, label="95% CI")
    ax.plot(xs, [r[2] for r in runs], marker="o", color="tab:blue", label="median")
    for i, b in enumerate(boundaries):
        ax.axvline(b, color="tab:red", linestyle="--", label="change point" if i == 0 else None)
    ax.set_xticks(xs, [str(r[0]) for r in runs], fontsize=7)
    ax.set_xlabel("run")
    ax.set_title(f"{metric}\n{phase}" if phase else metric, fontsize=9 if phase else None)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def render_results(root: Path) -> Path:
    """Write ROOT/index.html: every stored figure and table (experiments/results) beside the
    paper's claim, each check's verdict (with the reason written beside a failed one), how
    this host differs from the paper's, and the manifest (build, host, command, wall time).
    A figure not run yet is listed with the command that makes it."""
    from .results import FIGURES, figure_state

    root = Path(root)
    parts = [
        "<h1>scalebench: Denali's figures and the storage study, reproduced</h1>",
        '<p id="imgstatus">checking images...</p>',
        "<p>Each section: the paper's claim, our plots, the checks' verdicts, how this host "
        "differs from the paper's, and the manifest of the run that made it. Every folder is "
        "made by the one command in its manifest.</p>",
        "<ul>"
        + "".join(f'<li><a href="#{f}">{html.escape(f)}</a></li>' for f in FIGURES)
        + "</ul>",
    ]
    for figure in FIGURES:
        parts.append(_figure_section(figure_state(root, figure)))
    page = (
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>scalebench results</title>"
        f"<style>{_STYLE}{_RESULTS_STYLE}</style></head><body>{''.join(parts)}"
        f"<script>{_CHECK_IMAGES}</script></body></html>"
    )
    out = root / "index.html"
    out.write_text(page)
    return out


_RESULTS_STYLE = """
.claim { background: #f3f7ff; border-left: 4px solid #4a7bd0; padding: 6px 10px; }
.diff { background: #fafafa; border-left: 4px solid #aaa; padding: 6px 10px; font-size: 13px; }
.pass { color: #17702a; font-weight: bold; } .fail { color: #b00020; font-weight: bold; }
td.l, th.l { text-align: left; }
.missing { color: #b00020; }
"""


def _figure_section(s: dict) -> str:
    e = html.escape
    f = s["figure"]
    out = [
        f'<h2 id="{e(f)}">{e(s["title"])}</h2>',
        f'<p class="claim"><b>The paper:</b> {e(s["claim"])}</p>',
    ]
    m = s["manifest"]
    if m is None:
        out.append(
            f'<p class="missing">Not run yet on this build. Make it with <code>{e(s["command"])}'
            f"</code> (about {s['estimated_hours']:g} h here).</p>"
        )
    for png in s["plots"]:
        out.append(f'<img src="{e(f)}/{e(png)}" alt="{e(f)} {e(png)}">')
    if s["checks"]:
        reasons = s["notes"]["reasons"]
        rows = []
        for c in s["checks"]:
            ok = c["passed"] == "yes"
            reason = reasons.get(f"{c['check']} | {c['group']}", "")
            if not ok and not reason:
                reason = "(no reason written yet: add it to notes.toml)"
            rows.append(
                "<tr>"
                + f'<td class="{"pass" if ok else "fail"}">{"PASS" if ok else "FAIL"}</td>'
                + "".join(
                    f'<td class="l">{e(str(x))}</td>'
                    for x in (c["check"], c["group"], c["detail"], c.get("study", ""), reason)
                )
                + "</tr>"
            )
        head = "".join(
            f'<th class="l">{h}</th>'
            for h in ("verdict", "check", "group", "measured", "study", "why it fails")
        )
        out.append(
            f'<h3>Checks</h3><div class="scroll"><table><tr>{head}</tr>{"".join(rows)}'
            "</table></div>"
        )
    if s["notes"]["text"]:
        out.append(f"<p>{e(s['notes']['text'])}</p>")
    out.append(f'<p class="diff"><b>This host against the paper\'s:</b> {e(s["differences"])}</p>')
    if m is not None:
        host, build = m.get("host") or {}, m.get("build") or {}
        cluster = m.get("cluster")
        facts = [
            ("command", m.get("command")),
            (
                "build",
                f"{build.get('commit')}"
                + (" (dirty: tracked files changed)" if build.get("dirty") else ""),
            ),
            (
                "host",
                f"{host.get('cpu_model')}, {host.get('cores')} cores, Linux {host.get('kernel')}, "
                f"{host.get('kvm')}",
            ),
            ("date (last invocation)", f"{m.get('started_at')} to {m.get('finished_at')}"),
            (
                "wall time",
                # A figure republished from kept points took seconds: its cost is all invocations'.
                f"{(m.get('wall_seconds_all_invocations') or 0) / 60:.1f} min over "
                f"{m.get('invocations')} invocation(s), the last "
                f"{(m.get('wall_seconds') or 0) / 60:.1f} min",
            ),
            ("points", json.dumps(m.get("points"))),
            (
                "cluster",
                f"{cluster['engine']} ({cluster['address']}): {cluster['points_on_cluster']} "
                f"point(s) on it, {cluster['points_retried']} retried"
                if cluster
                else "no (points run by this host's sweep)",
            ),
            (
                "complete",
                "yes" if m.get("complete") else "NO: part of the grid or changed settings",
            ),
        ]
        redrawn = m.get("plots_redrawn")
        if redrawn:
            facts.append(
                (
                    "plots redrawn",
                    f"{redrawn['at']} on build {redrawn['build'].get('commit')}, from the stored "
                    "points and checks (scalebench results replot)",
                )
            )
        rows = "".join(
            f'<tr><th class="l">{k}</th><td class="l">{e(str(v))}</td></tr>' for k, v in facts
        )
        out.append(f"<h3>Manifest</h3><table>{rows}</table>")
    links = " ".join(f'<a href="{e(f)}/{e(t)}">{e(t)}</a>' for t in s["tables"])
    if links:
        out.append(f"<p>Data: {links}</p>")
    return "".join(out)
