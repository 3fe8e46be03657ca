"""Writing a benchmark's result: one JSON and one PNG per benchmark, the same way for all of them."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from mlscale.common.plotting import pyplot, save_figure

__all__ = ["median_bars", "median_panels", "pyplot", "save_figure", "write_results"]


def write_results(out: str | Path, name: str, results: dict[str, Any],
                  plot: Callable[[dict[str, Any], Path], None]) -> tuple[Path, Path]:
    """``OUT/NAME.json`` and ``OUT/NAME.png``; returns both paths."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    json_path, png_path = folder / f"{name}.json", folder / f"{name}.png"
    json_path.write_text(json.dumps(results, indent=2) + "\n")
    plot(results, png_path)
    return json_path, png_path


def median_bars(ax: Any, names: Sequence[str], values: Sequence[Sequence[float]]) -> list[float]:
    """One bar per name at the median of its repeats, the error bar spanning their min and max; each
    median written inside its bar (where no error bar covers it). Returns the medians."""
    medians = [statistics.median(v) for v in values]
    errors = [[m - min(v) for m, v in zip(medians, values)], [max(v) - m for m, v in zip(medians, values)]]
    ax.bar(list(names), medians, yerr=errors, capsize=5, color=["tab:gray", "tab:blue"][: len(names)])
    for i, m in enumerate(medians):
        text = f"{m:,.2f}" if abs(m) < 100 else f"{m:,.0f}"
        if m:
            ax.text(i, m / 2, text, ha="center", va="center", color="white", fontweight="bold")
        else:  # no bar to write in
            ax.text(i, 0, text, ha="center", va="bottom", fontweight="bold")
    return medians


def median_panels(runs: dict[str, list[dict[str, Any]]], panels: Sequence[tuple[str, str]], title: str,
                  path: Path, width: float = 4) -> None:
    """The usual figure of a side-by-side benchmark: one panel per ``(key, label)`` of ``panels``, in
    each a median bar per mode of ``runs`` (mode -> its repeats' rows, in the order to draw)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(width * len(panels), 4))
    for ax, (key, label) in zip(axes, panels):
        median_bars(ax, list(runs), [[row[key] for row in rows] for rows in runs.values()])
        ax.set_title(label, fontsize=10)
    fig.suptitle(title)
    save_figure(fig, path)
