"""``python -m mlscale.train RUN_DIR``: the process our launcher starts for each worker."""

import sys

from mlscale.train.worker import main

sys.exit(main())
