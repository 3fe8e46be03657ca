"""Pictures of a run from its run directory: loss, throughput and the per-rank time split.

Needs matplotlib (the ``bench`` extra); training itself does not.
"""

from __future__ import annotations

from pathlib import Path

from mlscale.common.plotting import pyplot, save_figure
from mlscale.rundir import RunDir


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    plt = pyplot()
    from matplotlib.ticker import FuncFormatter
    run = RunDir(run_dir)
    metrics, report = run.read_metrics(), run.read_report()
    out = Path(out) if out else run.training_plot_path
    out.parent.mkdir(parents=True, exist_ok=True)
    steps = [m["step"] for m in metrics]
    fig, (loss_ax, speed_ax, split_ax) = plt.subplots(1, 3, figsize=(14, 4))
    loss_ax.plot(steps, [m["loss"] for m in metrics], marker=".")
    loss_ax.set(title="training loss (mean over ranks)", xlabel="step", yscale="log")
    # 2, not 2x10^0; between decades only 2, 3 and 5 are labelled, so labels never crowd
    loss_ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    loss_ax.yaxis.set_minor_formatter(FuncFormatter(lambda value, _: f"{value:g}" if f"{value:.0e}"[0] in "235"
                                                    else ""))
    speed_ax.plot(steps, [m["samples_per_s"] for m in metrics], marker=".")
    speed_ax.set(title="throughput", xlabel="step", ylabel="samples/s")
    ranks = report["per_rank"]
    parts = [("compute_ms_p50", "compute"), ("optimizer_ms_p50", "optimizer"), ("comm_exposed_ms_p50", "exposed comm"),
             ("data_wait_ms_p50", "data wait")]
    bottom = [0.0] * len(ranks)
    for key, label in parts:
        values = [r.get(key, 0.0) for r in ranks]
        split_ax.bar([str(r["rank"]) for r in ranks], values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    split_ax.set(title="median step time per rank", xlabel="rank", ylabel="ms", ylim=(0, max(bottom, default=1) * 1.3))
    split_ax.legend(loc="upper center", ncol=3, fontsize="small", frameon=False)  # above the bars, never on them
    fig.suptitle(f"{report['task']} · {report['strategy']} · {report['world_size']} worker(s)")
    save_figure(fig, out)
    return out
