"""Which feature repositories mlscale may load: ``--features package.module:SERVICE`` names a module
in data, so, as for tasks, its code runs only if the module declared its repository with
``declare_repository`` (and is not a standard-library module): a name in a config cannot make
mlscale call anything else. The module's source is checked for that call before it is imported
(``mlscale.common.declarations``): a module that declares nothing is never run.
"""

from __future__ import annotations

import importlib
import re
import sys

from mlscale.common.declarations import NotFound, calls_at_top_level, is_program, module_tree
from mlscale.errors import UsageError
from mlscale.features.definitions import FeatureRepository, FeatureService

_DECLARED: dict[str, FeatureRepository] = {}
_MODULE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


def declare_repository(repository: FeatureRepository, module: str | None = None) -> FeatureRepository:
    """Declare the repository of the calling module (or ``module``), so that mlscale may load it by name."""
    name = module or sys._getframe(1).f_globals["__name__"]
    _DECLARED[name] = repository
    return repository


def _check_source(module: str) -> None:
    """Refuse a module whose source does not call ``declare_repository`` when imported: read and parsed,
    never run, found without importing it or its packages (``mlscale.common.declarations``)."""
    undeclared = UsageError(f"bad value features={module!r}: not a declared feature repository; call "
                            "mlscale.features.declare_repository(FeatureRepository(...)) in it")
    if is_program(module) or module in sys.modules:  # imported already: it declared what it declares
        raise undeclared
    try:
        tree = module_tree(module)
    except NotFound as exc:
        raise UsageError(f"bad value features={module!r}: cannot import it ({exc})") from None
    except (SyntaxError, ValueError) as exc:
        raise UsageError(f"bad value features={module!r}: importing it failed: {type(exc).__name__}: {exc}") from None
    except Exception as exc:  # a finder on the path failed
        raise UsageError(f"bad value features={module!r}: cannot locate it ({type(exc).__name__}: {exc})") from None
    if tree is None or not calls_at_top_level(tree, "declare_repository"):
        raise undeclared


def load_repository(module: str) -> FeatureRepository:
    """The repository declared by ``module``, importing it from the Python path as it is."""
    if not _MODULE.fullmatch(module):
        raise UsageError(f"bad value features={module!r}: expected package.module")
    if module.split(".")[0] in sys.stdlib_module_names:
        raise UsageError(f"bad value features={module!r}: not a declared feature repository")
    if module not in _DECLARED:
        _check_source(module)  # before anything is imported
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise UsageError(f"bad value features={module!r}: cannot import it ({exc})") from None
        except Exception as exc:  # the user's module is broken: one line, not a traceback
            raise UsageError(f"bad value features={module!r}: importing it failed: {type(exc).__name__}: "
                             f"{exc}") from None
    repository = _DECLARED.get(module)
    if repository is None:
        raise UsageError(f"bad value features={module!r}: it declares no feature repository; call "
                         "mlscale.features.declare_repository(FeatureRepository(...)) in it")
    return repository


def load_service(spec: str) -> tuple[FeatureRepository, FeatureService]:
    """``package.module:SERVICE`` -> the declared repository and its service."""
    module, sep, service = spec.partition(":")
    if not sep or not service:
        raise UsageError(f"bad value features={spec!r}: expected package.module:SERVICE")
    repository = load_repository(module)
    return repository, repository.service(service)
