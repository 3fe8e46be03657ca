import sys

from mlscale.cli import main

sys.exit(main())
