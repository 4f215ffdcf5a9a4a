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
