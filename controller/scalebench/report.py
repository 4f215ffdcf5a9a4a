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
        history_plot(metric, rows, boundaries, directory / png)
        parts.append(f'<h2>{html.escape(metric)}</h2><img src="{png}" alt="{html.escape(metric)}">')
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


def history_plot(
    metric: str,
    runs: list[tuple[int, list[float], float, float, float, bool]],
    boundaries: list[float],
    path: Path,
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
    ax.set_title(metric)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
