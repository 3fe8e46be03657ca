"""``python -m tests.train.warm_child ACTION ARG``: a worker that the zygote of tests/train/test_warm.py
forks, ending in a chosen way. It prints its pid first (after its SIGTERM handler is set, for ``wait``).

- ``exit N``: exits with code N;
- ``signal N``: kills itself with signal N;
- ``wait N``: waits (up to a minute) for SIGTERM, then exits with code N.
"""

import os
import signal
import sys
import time


def main(action: str, arg: str) -> None:
    if action == "wait":
        signal.signal(signal.SIGTERM, lambda *_: os._exit(int(arg)))
    print(os.getpid(), flush=True)
    if action == "exit":
        sys.exit(int(arg))
    if action == "signal":
        os.kill(os.getpid(), int(arg))
    time.sleep(60)


if __name__ == "__main__":
    main(*sys.argv[1:])
