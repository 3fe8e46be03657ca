"""``mlscale serve``: parse the options, start the server. Defaults, limits and help come from
``ServeOptions``, the one options model that the Python API validates with too."""

from __future__ import annotations

import argparse
import os
import types
import typing
from typing import TYPE_CHECKING, Any

from mlscale.cli.models import add_registry_option
from mlscale.errors import UsageError

if TYPE_CHECKING:
    from mlscale.serve.options import ServeOptions

# Every ServeOptions field but a secret (_NOT_FLAGS) is a flag of the same name (dashes for underscores),
# its type (int, float, str; a bool is a switch) or choices (a Literal) read from the field's annotation,
# its help the field's description and default; except where the help says more than that:
_HELP = {"runtime": "auto (default): onnxruntime when the version has an ONNX export, else torch"}


ONLINE_STORE_ENV = "MLSCALE_ONLINE_STORE"  # --online-store's value when the flag is not given
ROUTE_SECRET_ENV = "MLSCALE_ROUTE_SECRET"  # the route-key hash's secret; never a flag (no secret on a command line)
_NOT_FLAGS = {"route_secret"}


def _field_help(name: str) -> str:
    from mlscale.serve.options import ServeOptions

    field = ServeOptions.model_fields[name]
    if field.annotation is bool:  # a switch: off unless given
        return field.description or name.replace("_", " ")
    default = "none" if field.default is None else f"{field.default:g}" if isinstance(field.default, float) \
        else field.default
    return f"{field.description or name.replace('_', ' ')} (default {default})"


def _workers(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of workers (or auto)") from None


def _argument(annotation: Any) -> dict[str, Any]:
    """argparse's ``type`` or ``choices`` for a field's annotation: int, float, str or a Literal, or one
    of them | None (None is the flag left out); a number or ``auto`` for ``--workers``."""
    if annotation == (int | typing.Literal["auto"]):
        return {"type": _workers, "metavar": "N|auto"}
    if annotation is bool:
        return {"action": "store_true"}
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        (annotation,) = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
    if typing.get_origin(annotation) is typing.Literal:
        choices = list(typing.get_args(annotation))
        kind = type(choices[0])
        return {"choices": choices} if kind is str else {"type": kind, "choices": choices}
    if annotation not in (int, float, str):
        raise TypeError(f"no flag type for a ServeOptions field of type {annotation}")
    return {"type": annotation}


def add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve", help="serve registered models over HTTP and gRPC (Open Inference Protocol v2)",
        description="Serves one or more registered models with dynamic batching, a response cache and "
        "backpressure, over HTTP (JSON or binary tensors) and gRPC, to the protocol's own clients "
        "(tritonclient, perf_analyzer, KServe's) at their defaults. A URI with an alias or stage "
        "(models:/digits@production) is followed: when it moves, "
        "the new version is loaded in the background and swapped in without failing a request. On SIGTERM, "
        "readiness answers 503 at once, inference goes on for --drain-delay-s, then in-flight requests "
        "finish and the server exits 0; a second signal exits at once.",
        epilog="example: mlscale serve models:/digits@production --max-batch-size 64 --slo-ms 50; behind a "
        "Kubernetes Service add --host 0.0.0.0 --drain-delay-s 10 --exec-timeout-s 30",
        # built only when `serve` runs: the options model (pydantic) stays out of every other command
        arguments="mlscale.cli.serve:add_serve_arguments")
    p.set_defaults(handler=_serve)


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    from mlscale.serve.options import ServeOptions

    p.add_argument("uris", nargs="+", metavar="MODEL_URI")
    for name, field in ServeOptions.model_fields.items():
        if name in _NOT_FLAGS:
            continue
        text = _HELP.get(name) or _field_help(name)
        if name == "online_store":
            text += f"; default ${ONLINE_STORE_ENV}, which keeps a password off the command line"
        if name == "route_header":
            text += (f"; keys are hashed with a secret, random per server (its workers share it), or "
                     f"${ROUTE_SECRET_ENV} (16+ characters) to keep a key's version across restarts and replicas")
        p.add_argument("--" + name.replace("_", "-"), help=text, **_argument(field.annotation))
    p.add_argument("--no-grpc", action="store_true", help="serve HTTP only")
    add_registry_option(p)


def options_from_args(args: argparse.Namespace) -> ServeOptions:
    """The validated options of the parsed flags (a bad value is a one-line UsageError)."""
    from mlscale.serve.options import ServeOptions, serve_options

    values = {name: getattr(args, name, None) for name in ServeOptions.model_fields}
    # a store URL with a password comes from the environment (a Kubernetes Secret), never the command line
    values["online_store"] = values["online_store"] or os.environ.get(ONLINE_STORE_ENV) or None
    values["otlp_endpoint"] = values["otlp_endpoint"] or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None
    values["route_secret"] = _route_secret(os.environ.get(ROUTE_SECRET_ENV) or None)
    options = serve_options(**values)
    if args.no_grpc:
        options = options.model_copy(update={"grpc_port": None})
    return options


def _route_secret(secret: str | None) -> str | None:
    """The environment's route secret (None: a random one for this server), refused when short without
    echoing it, as a validation error would."""
    if secret is not None and len(secret) < 16:
        raise UsageError(f"${ROUTE_SECRET_ENV} has {len(secret)} characters: give at least 16 (random ones)")
    return secret


def _serve(args: argparse.Namespace) -> int:
    from mlscale.serve import serve

    return serve(args.uris, options=options_from_args(args), registry_location=args.registry)
