"""The Python path of mlscale's own ``-m`` entry points, without the current directory.

A registry row or a config names a task by module; only declared factories are called, but importing
runs a module's top-level code, so where modules come from matters: from what is installed and what
the user put on PYTHONPATH, never from whatever file lies in the current directory.
"""

from __future__ import annotations

import os
import sys


def drop_implicit_cwd() -> None:
    """``python -m mlscale...`` puts the current directory first on ``sys.path``, before PYTHONPATH:
    a module dropped there could then be named by a task. Our ``-m`` entry points remove it; a user
    who wants it says so (``PYTHONPATH=.``), and that entry stays."""
    if not sys.flags.safe_path and sys.path and sys.path[0] in ("", os.getcwd()):
        del sys.path[0]
