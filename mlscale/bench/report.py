"""Writing a benchmark's result: one JSON and one PNG per benchmark, the same way for all of them."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlscale.plotting import pyplot, save_figure

__all__ = ["pyplot", "save_figure", "write_results"]


def write_results(out: str | Path, name: str, results: dict[str, Any],
                  plot: Callable[[dict[str, Any], Path], None]) -> tuple[Path, Path]:
    """``OUT/NAME.json`` and ``OUT/NAME.png``; returns both paths."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    json_path, png_path = folder / f"{name}.json", folder / f"{name}.png"
    json_path.write_text(json.dumps(results, indent=2) + "\n")
    plot(results, png_path)
    return json_path, png_path
