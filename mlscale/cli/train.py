"""``mlscale train``: the flags, their help and defaults come from the options models in ``mlscale.config``.

Train a task with a parallel strategy. Values from --config (TOML or JSON, flat keys such as "stages = 4"
or nested tables such as "[pipeline] stages = 4") are overridden by the flags given here; every option
has a flag of its name (--task-opt, --fault, --collective-timeout, --no-async-checkpoint and --no-progress
are spelled so). An option of another strategy or fault-tolerance mode than the job's is refused.

The flags are generated from the models into ``mlscale/train_flags.json`` (``make flags``, and
a test checks that it matches the models): building the parser from the table keeps ``mlscale train
--help`` as fast as a hand-written parser (the models need pydantic, which costs more to import than the
whole command otherwise does).
"""

from __future__ import annotations

import argparse
import json
import typing
from pathlib import Path
from typing import Any

from mlscale.cli.models import add_registry_option
from mlscale.common.display import as_json
from mlscale.train.plot import plot_run

# at the package's root, not beside this module: the Makefile, the docs and the flag test name it there
FLAGS_PATH = Path(__file__).parents[1] / "train_flags.json"

SHORTCUTS = {"precision": {"--bf16": "bf16", "--fp16": "fp16"}}  # the Hugging Face Trainer's flags


# -- the table, from the models (imports pydantic: used by `make flags` and the test, not at run time) --------
def flag_table() -> list[dict[str, Any]]:
    """One entry per option of ``TrainConfig`` and its groups: what argparse needs to build the flag."""
    from mlscale.config import GROUPS, TrainConfig

    rows = []
    for model, title in [(TrainConfig, ""), *((model, model.title) for model in GROUPS.values())]:
        for name, field in model.model_fields.items():
            if name in GROUPS and model is TrainConfig:
                continue
            extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
            default = field.default_factory() if field.default_factory else field.default
            rows.append({"dest": name, "flag": extra.get("flag") or f"--{name.replace('_', '-')}",
                         "group": title, "help": _help(field.description or "", default,
                                                       {**getattr(model, "only", {}), **extra.get("only", {})}),
                         "metavar": extra.get("metavar"), **_kind(field.annotation, default)})
    return rows


def _help(text: str, default: Any, only: dict[str, Any]) -> str:
    if only and "strategy" in only and "only" not in text:
        text += f"; {', '.join(only['strategy'])} only"
    if default is None or default in ([], {}) or isinstance(default, bool):
        return text
    return f"{text} (default {default:g})" if isinstance(default, float) else f"{text} (default {default})"


def _kind(annotation: Any, default: Any) -> dict[str, Any]:
    """How argparse reads the flag: its kind and, for a fixed set of words, the choices."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is bool:
        return {"kind": "switch_off" if default else "switch_on"}
    if origin is typing.Literal:
        return {"kind": "str", "choices": list(args)}
    if origin is list:
        inner = args[0]
        choices = list(typing.get_args(inner)) if typing.get_origin(inner) is typing.Literal else None
        return {"kind": "append", **({"choices": choices} if choices else {})}
    if origin is dict:
        return {"kind": "key_value"}
    words = [arg for arg in args if typing.get_origin(arg) is typing.Literal]
    numbers = [arg for arg in args if arg in (int, float)]
    if words and numbers:
        return {"kind": "int_or_word", "words": list(typing.get_args(words[0]))}
    base = numbers[0] if numbers else annotation
    return {"kind": {int: "int", float: "float"}.get(base, "str")}


def write_flag_table() -> None:
    """``make flags``: regenerate ``train_flags.json`` from the models."""
    FLAGS_PATH.write_text(json.dumps(flag_table(), indent=1) + "\n")


# -- the parser, from the table --------------------------------------------------------------------------------
def key_value(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    for convert in (int, float):
        try:
            return key, convert(raw)
        except ValueError:
            pass
    return key, {"true": True, "false": False}.get(raw.lower(), raw)


def _int_or_word(words: list[str]) -> Any:
    def parse(text: str) -> int | str:
        if text in words:
            return text
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number or {' or '.join(map(repr, words))}, "
                                             f"got {text!r}") from None
    parse.__name__ = "number"
    return parse


def _add_flag(p: Any, row: dict[str, Any]) -> None:
    kind, dest, help_text = row["kind"], row["dest"], row["help"]
    common: dict[str, Any] = {"dest": dest, "help": help_text}
    if row.get("metavar") or not row.get("choices"):
        common["metavar"] = row["metavar"]
    if kind == "switch_on":
        p.add_argument(row["flag"], action="store_true", default=None, dest=dest, help=help_text)
    elif kind == "switch_off":
        p.add_argument(row["flag"], action="store_false", default=None, dest=dest, help=help_text)
    elif kind == "append":
        p.add_argument(row["flag"], action="append", choices=row.get("choices"), **common)
    elif kind == "key_value":
        p.add_argument(row["flag"], action="append", type=key_value, **common)
    elif kind == "int_or_word":
        p.add_argument(row["flag"], type=_int_or_word(row["words"]), **common)
    elif dest == "data_cache":  # --data-cache alone: memory
        p.add_argument(row["flag"], nargs="?", const="memory", **_words(row), **common)
    else:
        kind_type = {"int": int, "float": float}.get(kind)
        p.add_argument(row["flag"], type=kind_type, **_words(row), **common)


def _words(row: dict[str, Any]) -> dict[str, Any]:
    """The choices shown in the help; the model checks them, so that a wrong word is the same one line
    (``bad value dtype='float16': ...``) from a flag, a file or the Python API."""
    if not row.get("choices") or row.get("metavar"):
        return {}
    return {"metavar": "{" + ",".join(row["choices"]) + "}"}


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="TOML or JSON file with any of the options below (flat keys, or "
                   "nested by group: [pipeline] stages = 4)")
    groups: dict[str, Any] = {"": p}
    for row in json.loads(FLAGS_PATH.read_text()):
        title = row["group"]
        if title not in groups:
            groups[title] = p.add_argument_group(title)
        target = groups[title]
        shortcuts = SHORTCUTS.get(row["dest"])
        if shortcuts:
            target = target.add_mutually_exclusive_group()
            for flag, value in shortcuts.items():
                target.add_argument(flag, action="store_const", const=value, dest=row["dest"],
                                    help=f"the same as {row['flag']} {value}")
        _add_flag(target, row)
    featured = p.add_argument_group("training from features")
    featured.add_argument("--features", metavar="MODULE:SERVICE", help="train on this feature service's "
                          "point-in-time training set (a declared feature repository module and a service in it; "
                          "sets --task features)")
    featured.add_argument("--entities", metavar="FILE", help="the entity rows: a Parquet file with the join keys, "
                          "an event_timestamp and the label")
    featured.add_argument("--label", metavar="COLUMN", help="the entity rows' label column (default label)")
    p.add_argument("--register", metavar="NAME", help="register the final model under NAME when training ends")
    p.add_argument("--json", action="store_true", help="print report.json instead of the summary table")
    p.add_argument("--check", action="store_true", help="check the configuration and the data for a job of "
                   "the processes --workers makes ($WORLD_SIZE when set, as torchrun sets it), train nothing: "
                   "exit 0, or 2 naming what is wrong (what a Kubernetes Job's check container runs)")
    p.add_argument("--no-plot", action="store_false", dest="plot",
                   help="do not draw RUN_DIR/plots/training.png at the end (drawn when matplotlib is installed)")

    add_registry_option(p)


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The options given on the command line (``None``: not given), by their flat names."""
    overrides = {row["dest"]: getattr(args, row["dest"]) for row in json.loads(FLAGS_PATH.read_text())}
    if overrides.get("task_options"):
        overrides["task_options"] = dict(overrides["task_options"])
    if args.features or args.entities:  # the features task, with the retrieval's inputs as its options
        featured = {"service": args.features, "entities": args.entities, "label": args.label}
        overrides["task"] = "features"
        overrides["task_options"] = {**(overrides.get("task_options") or {}),
                                     **{k: v for k, v in featured.items() if v is not None}}
    return overrides


def run_train(args: argparse.Namespace) -> int:
    from mlscale.config import build_config
    from mlscale.train.launcher import fit

    config = build_config(args.config, **overrides_from_args(args))
    if args.check:
        from mlscale.train.launcher import check_only

        print(check_only(config))
        return 0
    if args.register:  # the name is checked before training, not after it
        from mlscale.registry.uri import check_name

        check_name(args.register)
    report = fit(config, keep_group=True)  # `run` leaves the process without tearing the group down
    if not report:  # not rank 0 under torchrun: rank 0 reports (and registers)
        return 0
    if args.register:  # opened (created if new) only now: a refused job leaves no registry behind
        from mlscale.registry import Registry, register_run

        report["model_uri"] = register_run(Registry(args.registry), report["run_dir"], args.register).uri
    if args.plot:
        report["plot"] = _plot(report["run_dir"])
    if args.json:
        print(as_json(report))
    else:
        print_train_summary(report)
    return 0


def _plot(run_dir: str) -> str | None:
    """``RUN_DIR/plots/training.png``, when matplotlib (the ``bench`` extra) is installed."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return None

    return str(plot_run(run_dir))


def print_train_summary(report: dict[str, Any]) -> None:
    eval_text = ", ".join(f"{k} {v:.4f}" for k, v in report["eval"].items())
    workers, world = report.get("workers", report["world_size"]), report["world_size"]
    if report.get("parameter_server"):
        layout = f"{workers} worker(s) + {world - workers} server(s)"
    elif workers != world:  # a replica spans several processes
        layout = f"{world} processes, {workers} data-parallel replica(s)"
    else:
        layout = f"{workers} worker(s)"
    rows = [
        ("task", f"{report['task']} ({report['strategy']}, {layout})"),
        ("steps", f"{report['steps']} ({report['samples_seen']:,} samples)"),
        ("final loss", f"{report['final_loss']:.4f}"),
        ("eval", eval_text),
        ("throughput", f"{report['samples_per_s']:,.0f} samples/s"),
        ("wall time", f"{report['wall_s']:.1f} s"),
        ("run dir", report["run_dir"]),
    ]
    rows += _detail_rows(report)
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


def _detail_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    """The summary's rows that only some runs have (stragglers, a server, a pipeline, recoveries...)."""
    rows = []
    if report.get("stragglers"):
        flagged = report["straggler_detection"]["flagged"]
        rows.append(("stragglers", ", ".join(f"rank {r} (from step {f['first_step']}, up to {f['max_score']:.1f}x)"
                                             for r, f in flagged.items())))
    bad = (report.get("data") or {}).get("bad_samples") or {}
    if bad.get("count"):
        first = bad["samples"][0]
        rows.append(("bad samples", f"{bad['count']:,} left out (--bad-samples skip), the first at step "
                     f"{first['step']}: {first['error']}; all in report.json data.bad_samples"))
    waiting = (report.get("data") or {}).get("input_bound") or {}
    if waiting.get("bound"):
        rows.append(("input-bound", f"data wait {waiting['data_wait_share']:.0%} of the step on rank {waiting['rank']} "
                     f"(median): {waiting['advice']}"))
    server = report.get("parameter_server")
    if server:
        rows.append(("parameter server", f"{server['sync']}, {server['gradients_applied']:,} gradients applied, "
                     f"{server['gradients_dropped']:,} dropped, staleness max {server['staleness']['max']}"))
    pipeline = report.get("pipeline")
    if pipeline:
        rows.append(("pipeline", f"{pipeline['stages']} stages, {pipeline['microbatches']} microbatches, "
                     f"{pipeline['schedule']}: {pipeline['split']}"))
    tolerance = report.get("fault_tolerance")
    if tolerance:
        recovery = report["recovery"]
        live = recovery["live_recoveries"]
        rejoin = ", ".join(f"group {e['replica']} at step {e['step']}" for e in live)
        rows.append(("fault tolerance", f"per-step ({tolerance['engine']}), {tolerance['replicas']} replica groups: "
                     f"{recovery['steps_without_every_replica']} step(s) without every group, "
                     f"{recovery['samples_not_trained']:,} samples not trained, {len(live)} live recovery(ies)"
                     + (f" ({rejoin})" if rejoin else "")))
    memory = report.get("memory")
    if memory:
        rows.append(("memory", ", ".join(f"rank {m['rank']} {m['state_mb']:.1f} MB" for m in memory[:8])
                     + (" ..." if len(memory) > 8 else "") + " of state (parameters, gradients, optimizer)"))
    if report.get("model_uri"):
        rows.append(("registered", report["model_uri"]))
    if report.get("plot"):
        rows.append(("plot", report["plot"]))
    return rows


if __name__ == "__main__":
    write_flag_table()
