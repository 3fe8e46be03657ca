"""``mlscale models ...`` and ``mlscale export``: parse, call the registry API, print (or ``--json``)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from mlscale.cli.parsers import int_at_least
from mlscale.cli.rollout import add_rollout_commands
from mlscale.common.display import as_json, pairs, table
from mlscale.errors import UsageError


def _registry(args: argparse.Namespace, create: bool = False) -> Any:
    """The registry named by --registry; only registering may create one (a typo must not)."""
    from mlscale.registry import Registry

    return Registry(args.registry, create=create)


def add_registry_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--registry", metavar="URL", help="registry: a folder, sqlite:///FILE or postgresql://... "
                   "(default: $MLSCALE_REGISTRY or ./mlscale-registry)")


def _common(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add_registry_option(p)
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    return p


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def add_models(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="the model registry: versions, stages, aliases, lineage",
                       description="Model URIs: models:/NAME/VERSION, models:/NAME@ALIAS, models:/NAME/STAGE.")
    msub = p.add_subparsers(dest="action", required=True)
    _common(msub.add_parser("list", help="registered models")).set_defaults(handler=_list)
    show = _common(msub.add_parser("show", help="a model's versions and history, or one version's lineage"))
    show.add_argument("target", help="NAME, or a model URI for one version")
    show.set_defaults(handler=_show)
    reg = _common(msub.add_parser("register", help="register a finished run's final model as a new version"))
    reg.add_argument("run_dir", metavar="RUN_DIR")
    reg.add_argument("--name", required=True, help="registered model name")
    reg.add_argument("--description", default="")
    reg.add_argument("--tag", action="append", type=_key_value, default=[], metavar="KEY=VALUE")
    reg.add_argument("--tokenizer", metavar="FILE", help="a language model's Hugging Face tokenizers file "
                     "(tokenizer.json): the server then takes and returns text")
    reg.add_argument("--generation-config", metavar="FILE", help="a language model's generation defaults "
                     "(generation_config.json: max_new_tokens, temperature, top_p, top_k, eos_token_id, stop) "
                     "and chat template (chat_template, as in tokenizer_config.json)")
    reg.set_defaults(handler=_register)
    stage = _common(msub.add_parser("stage", help="move a version to None, Staging, Production or Archived"))
    stage.add_argument("name")
    stage.add_argument("version", type=int)
    stage.add_argument("stage")
    stage.add_argument("--archive-existing", action="store_true",
                       help="archive the versions now in that stage (for Staging and Production)")
    stage.set_defaults(handler=_stage)
    alias = _common(msub.add_parser("alias", help="point an alias at a version (moves it if it exists)"))
    alias.add_argument("name")
    alias.add_argument("version", type=int)
    alias.add_argument("alias")
    alias.set_defaults(handler=_alias)
    unalias = _common(msub.add_parser("unalias", help="delete an alias"))
    unalias.add_argument("name")
    unalias.add_argument("alias")
    unalias.set_defaults(handler=_unalias)
    tag = _common(msub.add_parser("tag", help="set a tag on a version (version 0: on the model)"))
    tag.add_argument("name")
    tag.add_argument("version", type=int)
    tag.add_argument("tag", type=_key_value, metavar="KEY=VALUE")
    tag.set_defaults(handler=_tag)
    sample = msub.add_parser("sample", help="print a ready-to-send inference request made of held-out inputs",
                             description="Prints a request body for `mlscale serve`: rows of the version's held-out "
                             "inputs as an Open Inference Protocol v2 infer request (default) or a /predict body.")
    sample.add_argument("uri", help="model URI")
    sample.add_argument("--rows", type=int_at_least(1), default=1, help="rows in the request (default 1)")
    sample.add_argument("--predict", action="store_true", help="a /predict body instead of a v2 infer request")
    add_registry_option(sample)
    sample.set_defaults(handler=_sample)
    add_rollout_commands(msub, _common)
    mirror = _common(msub.add_parser("mirror", help="copy a version into MLflow (needs mlscale[mlflow])"))
    mirror.add_argument("uri", help="model URI")
    mirror.add_argument("--mlflow-uri", required=True, help="MLflow tracking/registry URI, e.g. sqlite:///mlflow.db")
    mirror.set_defaults(handler=_mirror)


EXPORT_DESCRIPTION = """Export a registered model in the form its users load.

  onnx  (default) torch.onnx (dynamo) with a dynamic batch dimension: input 'input', output 'output' (the
        model's predictions tensor: the tensor it returns, else its logits, else its first tensor). Checked
        against PyTorch with onnxruntime on held-out inputs, then stored in the version as model.onnx, where
        `mlscale serve` runs it (--runtime onnx, or auto).
  hf    a Hugging Face model (one with save_pretrained and a config) written to the folder DIR: config.json
        and model.safetensors as save_pretrained writes them (tied weights stored once, tied again on
        loading), plus mlscale.json naming the version. Load it with
        transformers.AutoModelForCausalLM.from_pretrained(DIR) or the model's own class. DIR must be new
        or empty; the registry is not changed. A model that is not a Hugging Face one is refused (exit 2).
"""

EXPORT_EXAMPLES = """examples:
  mlscale export models:/digits@champion                  # ONNX, stored in the version
  mlscale export models:/gpt2/1 --format hf exported/gpt2  # a folder for from_pretrained
"""


def add_export(sub: argparse._SubParsersAction) -> None:
    p = _common(sub.add_parser("export", help="export a registered model: ONNX (checked against PyTorch) or a "
                               "Hugging Face folder", description=EXPORT_DESCRIPTION, epilog=EXPORT_EXAMPLES,
                               formatter_class=argparse.RawDescriptionHelpFormatter, intermixed=True))
    p.add_argument("uri", help="model URI, e.g. models:/digits/Production")
    p.add_argument("directory", nargs="?", metavar="DIR", help="--format hf only: the folder to write")
    p.add_argument("--format", default="onnx", choices=["onnx", "hf"],
                   help="onnx (default): stored in the version; hf: a from_pretrained folder at DIR")
    p.set_defaults(handler=_export)


def _print_version(version: Any, as_json_: bool) -> int:
    print(as_json(version.as_dict()) if as_json_ else f"{version.uri}  stage {version.stage}"
          + (f"  aliases {', '.join(version.aliases)}" if version.aliases else ""))
    return 0


def _list(args: argparse.Namespace) -> int:
    models = _registry(args).list_models()
    if args.json:
        print(as_json(models))
    elif not models:
        print("no registered models")
    else:
        print(table(["name", "latest", "stages", "aliases", "updated"], [
            (m["name"], m["latest_version"], ", ".join(f"{s}: v{v}" for s, v in m["stages"].items()),
             ", ".join(f"{a}: v{v}" for a, v in m["aliases"].items()), m["updated_at"][:19]) for m in models]))
    return 0


def _metric_text(metrics: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v:.4g}" for k, v in (metrics.get("eval") or {}).items())


def _show(args: argparse.Namespace) -> int:
    registry = _registry(args)
    if args.target.startswith("models:/"):
        version = registry.resolve(args.target)
        if args.json:
            print(as_json({**version.as_dict(), "source_run_state": version.source_run_state()}))
        else:
            print(_lineage(registry, version))
        return 0
    versions, history = registry.versions(args.target), registry.history(args.target)
    if args.json:
        print(as_json({"versions": [v.as_dict() for v in versions], "history": history}))
        return 0
    print(f"{args.target}\n")
    print(table(["version", "stage", "aliases", "eval", "created", "by", "source run"], [
        (v.version, v.stage, ", ".join(v.aliases), _metric_text(v.metrics), v.created_at[:19], v.created_by,
         _source_run_text(v)) for v in versions]))
    print("\nhistory\n")
    print(table(["at", "who", "version", "action", "from", "to"], [
        (h["at"][:23], h["who"], h["version"], h["action"], h["from_value"], h["to_value"]) for h in history]))
    return 0


def _lineage(registry: Any, version: Any) -> str:
    config, code = version.config, version.code_version
    signature = version.signature
    sig = " -> ".join(", ".join(f"{t['name']} {t['datatype']} {t['shape']}" for t in signature[side])
                      for side in ("inputs", "outputs"))
    artifacts = []
    for a in version.artifacts.values():
        text = f"{a.name} ({a.size_bytes / 1e3:,.0f} kB, sha256 {a.sha256[:12]}...)"
        parity = a.info.get("parity")
        if parity:
            text += f" ONNX parity: max abs {parity['max_abs_err']:.2g}, max rel {parity['max_rel_err']:.2g}"
        artifacts.append(text)
    git = code.get("git_commit")
    rows = [
        ("uri", version.uri), ("stage", version.stage), ("aliases", ", ".join(version.aliases) or "-"),
        ("description", version.description or "-"), ("created", f"{version.created_at} by {version.created_by}"),
        ("source run", _source_run_text(version)),
        ("task", f"{config['task']} {config.get('task_options') or ''}".strip()),
        ("training", f"{config['strategy']}, {config['workers']} worker(s), batch {config['batch_size']}/worker, "
                     f"lr {config['lr']}, seed {config['seed']}, {config['dtype']}, {config['precision']}"),
        ("metrics", _metric_text(version.metrics) or "-"),
        ("features", _features_text(version.metrics.get("features"))),
        ("data", version.data_fingerprint or "-"),
        ("code", f"mlscale {code.get('mlscale', '?')}"
                 + (f", git {git[:12]}{' (with local changes)' if code.get('git_dirty') else ''}" if git else "")),
        ("signature", sig),
        ("artifacts", "\n".ljust(14).join(artifacts)),
        ("generation", _generation_text(registry, version)),
        ("tags", ", ".join(f"{k}={v}" for k, v in version.tags.items()) or "-"),
    ]
    return pairs(rows)


def _generation_text(registry: Any, version: Any) -> str:
    """A language model's tokenizer, chat template and defaults, when it registered any."""
    from mlscale.registry.generation import GENERATION_ARTIFACT, TOKENIZER_ARTIFACT, read_generation

    if not {TOKENIZER_ARTIFACT, GENERATION_ARTIFACT} & set(version.artifacts):
        return "-"
    return read_generation(registry, version).summary()


def _features_text(features: dict[str, Any] | None) -> str:
    if not features:
        return "-"
    return (f"{features['service']}: {', '.join(features['features'])} (training statistics of "
            f"{features['training_rows']:,} rows)")


def _source_run_text(version: Any) -> str:
    """The source run, and whether that directory still holds it: a later run written to the same
    directory would otherwise pass for this version's lineage."""
    return f"{version.source_run} ({version.source_run_state()})" if version.source_run else "-"


def _register(args: argparse.Namespace) -> int:
    from mlscale.registry import register_run

    version = register_run(_registry(args, create=True), args.run_dir, args.name, description=args.description,
                           tags=dict(args.tag), tokenizer=args.tokenizer, generation_config=args.generation_config)
    return _print_version(version, args.json)


def _stage(args: argparse.Namespace) -> int:
    version = _registry(args).set_stage(args.name, args.version, args.stage, archive_existing=args.archive_existing)
    return _print_version(version, args.json)


def _alias(args: argparse.Namespace) -> int:
    return _print_version(_registry(args).set_alias(args.name, args.version, args.alias), args.json)


def _unalias(args: argparse.Namespace) -> int:
    _registry(args).delete_alias(args.name, args.alias)
    print(as_json({"deleted": args.alias}) if args.json else f"deleted alias {args.alias} of {args.name}")
    return 0


def _tag(args: argparse.Namespace) -> int:
    from mlscale.serve.share import SHARE_TAG, canary_share

    key, value = args.tag
    if key == SHARE_TAG:  # refused here, where it is written, as every server following it would refuse it
        try:
            canary_share(value)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    _registry(args).set_tag(args.name, args.version or None, key, value)
    print(as_json({key: value}) if args.json else f"{args.name} v{args.version}: {key}={value}")
    return 0


def _sample(args: argparse.Namespace) -> int:
    from mlscale.registry.models import sample_request

    body = sample_request(_registry(args).resolve(args.uri), args.rows, predict=args.predict)
    print(json.dumps(body, separators=(",", ":")))  # one line: ready for curl -d @FILE
    return 0


def _mirror(args: argparse.Namespace) -> int:
    from mlscale.registry.mlflow_mirror import mirror_version

    registry = _registry(args)
    result = mirror_version(registry, registry.resolve(args.uri), args.mlflow_uri)
    done = "mirrored to MLflow" if result["created"] else "already in MLflow (same URI and content)"
    print(as_json(result) if args.json else f"{done}: model {result['name']} version {result['version']} "
          f"(run {result['run_id']})")
    return 0


def _export(args: argparse.Namespace) -> int:
    if args.format == "hf":
        return _export_hf(args)
    if args.directory is not None:
        raise UsageError(f"bad value DIR={args.directory!r}: an ONNX export is stored in the version; DIR is "
                         "for --format hf")
    from mlscale.export import export_version

    registry = _registry(args)
    existed = "model.onnx" in registry.resolve(args.uri).artifacts
    artifact, parity = export_version(registry, args.uri)
    if args.json:
        print(as_json({"artifact": artifact.__dict__, "parity": parity.__dict__, "already_exported": existed}))
    else:
        check = (f"max abs error {parity.max_abs_err:.3g}, max rel error {parity.max_rel_err:.3g} on "
                 f"{parity.samples} held-out inputs, batches {parity.batch_sizes} "
                 f"(rtol {parity.rtol:g}, atol {parity.atol:g})")
        stored = f"{artifact.key} (already exported: a version's files are write-once)" if existed else artifact.key
        print(pairs([("stored", stored), ("sha256", artifact.sha256), ("parity", check)]))
    return 0


def _export_hf(args: argparse.Namespace) -> int:
    from mlscale.export.hf import export_hf

    if args.directory is None:
        raise UsageError("--format hf writes a folder: give it, e.g. mlscale export URI --format hf DIR")
    folder = export_hf(_registry(args), args.uri, args.directory)
    files = sorted(path.name for path in folder.iterdir())
    if args.json:
        print(as_json({"directory": str(folder), "files": files}))
    else:
        print(pairs([("written", str(folder)), ("files", ", ".join(files)),
                     ("load with", f"transformers.AutoModelForCausalLM.from_pretrained({str(folder)!r})")]))
    return 0
