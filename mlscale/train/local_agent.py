"""``python -m mlscale.train.local_agent TORCHRUN_ARGS``: torchrun for one replica group of a per-step job on
this machine, whose stores (the rendezvous, the workers' store) listen on ``$MLSCALE_BIND_HOST`` only
(loopback, as ``replica_groups`` sets it): torchrun's own listen on every interface whatever address
they are given."""

from __future__ import annotations

import sys

from torch.distributed.run import main as torchrun

from mlscale.train.dist import bind_host, stores_listening_on


def main(argv: list[str]) -> None:
    host = bind_host()
    if host is None:
        torchrun(argv)
        return
    with stores_listening_on(host):
        torchrun(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
