"""Writing a benchmark's result: one JSON and one PNG per benchmark, the same way for all of them."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend (no display on servers and in CI)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    pyplot().close(fig)


def write_results(out: str | Path, name: str, results: dict[str, Any],
                  plot: Callable[[dict[str, Any], Path], None]) -> tuple[Path, Path]:
    """``OUT/NAME.json`` and ``OUT/NAME.png``; returns both paths."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    json_path, png_path = folder / f"{name}.json", folder / f"{name}.png"
    json_path.write_text(json.dumps(results, indent=2) + "\n")
    plot(results, png_path)
    return json_path, png_path
