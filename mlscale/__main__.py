"""``python -m mlscale``: the same command as ``mlscale``."""

import sys

from mlscale.safe_path import drop_implicit_cwd

drop_implicit_cwd()

from mlscale.cli import main  # noqa: E402 - after the path is fixed

sys.exit(main())
