"""The verdict lines under a figure's axes: wrapped, never cut, and within the figure."""

from __future__ import annotations

import matplotlib.pyplot as plt
from scalebench import plots


def test_a_long_verdict_wraps_into_indented_rows_and_keeps_every_word():
    text = " ".join(f"word{i}" for i in range(60))
    rows = plots._verdict_rows([(True, "short"), (False, text)])
    assert rows[0] == (True, "PASS  short")
    long_rows = rows[1:]
    assert len(long_rows) > 1
    assert all(not passed for passed, _ in long_rows)
    assert all(len(line) <= plots.VERDICT_CHARS for _, line in long_rows)
    assert long_rows[0][1].startswith("FAIL  word0 ")
    assert all(line.startswith("      word") for _, line in long_rows[1:])
    assert " ".join(line for _, line in long_rows).split()[1:] == text.split()


def test_a_full_verdict_row_fits_across_the_figure():
    fig, _ = plots._figure([(True, "x")])
    try:
        label = fig.text(0.01, 0.01, "W" * plots.VERDICT_CHARS, fontsize=7, family="monospace")
        fig.canvas.draw()
        extent = label.get_window_extent()
        assert extent.x1 <= fig.bbox.width
    finally:
        plt.close(fig)
