"""``python -m mlscale.train RUN_DIR``: the process our launcher starts for each worker."""

import sys

from mlscale.common.safe_path import drop_implicit_cwd

drop_implicit_cwd()

from mlscale.train.worker import main  # noqa: E402 - after the path is fixed

sys.exit(main())
