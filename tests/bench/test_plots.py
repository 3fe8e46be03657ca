"""Every benchmark's picture is drawn from its JSON and is a real, non-empty PNG (the committed
results are the input, so a plot that breaks on real data fails here)."""

import json
from pathlib import Path

import pytest

from mlscale.bench import checkpoint, export, recovery, serve, startup
from tests.helpers import REPO


@pytest.mark.parametrize(("module", "name"), [(checkpoint, "checkpoint"), (export, "export"), (serve, "serve"),
                                            (recovery, "recovery"), (startup, "startup")])
def test_each_benchmark_plot_is_written_and_not_empty(module, name, tmp_path):
    results = json.loads((REPO / "bench" / "results" / name / f"{name}.json").read_text())
    out = tmp_path / f"{name}.png"
    module.plot(results, out)
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


def test_a_one_model_serving_plot_as_the_demo_draws_it(tmp_path):
    results = json.loads((REPO / "bench/results/serve/serve.json").read_text())
    one = {"slo_ms": results["slo_ms"], "models": {"digits (distinct inputs, cache off)": {
        "systems": {"mlscale": results["models"]["digits-mlp"]["systems"]["mlscale"]}}}}
    serve.plot(one, Path(tmp_path / "one.png"))
    assert (tmp_path / "one.png").stat().st_size > 20_000
