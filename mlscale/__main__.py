"""``python -m mlscale``: the same command as ``mlscale``."""

from mlscale.common.safe_path import drop_implicit_cwd

drop_implicit_cwd()

from mlscale.cli import run  # noqa: E402 - after the path is fixed

run()
