"""What the workers of one server (``mlscale serve --workers N``, see ``workers.py``) share: a private
folder with a byte per worker, 1 while it is ready (readiness is ready only when every byte is), and
each worker's metrics, merged by whichever worker is scraped (``/metrics`` and the statistics calls
speak for the whole server). A worker's series live in its cells file (``cells.py``), read as they are
at the scrape: a scrape counts every request answered before it, whichever worker answered. What only
the worker knows (bytes held by its cache and request bodies, feature skew) it publishes every
``PUBLISH_S``. A dead worker's counters are kept, so no counter ever goes back, in one file per worker
index however often it was restarted."""

from __future__ import annotations

import contextlib
import json
import mmap
import os
from pathlib import Path
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from mlscale.serve.cells import Cells, read_cells
from mlscale.serve.metrics import MetricsView, snapshot_of

PUBLISH_S = 0.5  # how often a worker publishes what is not in its cells (ServerMetrics.local) for the others


def _read_json(path: Path) -> dict[str, Any] | None:
    with contextlib.suppress(FileNotFoundError, ValueError):
        return json.loads(path.read_bytes())
    return None


def _write_json(path: Path, value: dict[str, Any]) -> None:
    """Written whole, then renamed into place: a reader never sees half of it."""
    partial = path.with_suffix(f".{os.getpid()}.partial")
    partial.write_bytes(json.dumps(value).encode())
    os.replace(partial, path)


def _counters_of(snapshots: list[dict[str, Any]]) -> dict[str, Any]:
    """The counters and histograms of several snapshots summed into one (their gauges dropped): what
    dead workers leave, as ``ServerMetrics.snapshot`` shapes it, so the merge is the one scrapes do."""
    view = MetricsView.merge([(None, snapshot, False) for snapshot in snapshots])
    return {"models": [stats.snapshot() for stats in view.models.values()], "refused": view.refused,
            "body_bytes": 0, "cache": None}


class Peers:
    """The folder the workers of one server share: ready bytes and metrics.

    Per worker index: ``cells-I.bin``, the live worker's cells (its header holds its generation, how
    many workers of that index died before it), ``metrics-I.json``, what it last published, and
    ``retired-I.json``, the counters of all the dead ones, tagged ``through`` the last generation it
    took in. Never more: a server whose workers were restarted a thousand times reads three files per
    worker a scrape."""

    def __init__(self, directory: str | Path, count: int, index: int | None = None, generation: int = 0) -> None:
        """``index``: this worker's (its cells file is made now); None for the supervisor."""
        self.directory, self.count, self.index, self.generation = Path(directory), count, index, generation
        flags = self.directory / "flags.bin"  # a byte per worker: 1 while it is ready
        if not flags.exists():
            flags.write_bytes(bytes(count))
        self._file = flags.open("r+b")
        self.flags = mmap.mmap(self._file.fileno(), count)
        self.cells = None if index is None else Cells(self._cells(index), generation)

    def set_ready(self, ready: bool) -> None:
        assert self.index is not None
        self.flags[self.index] = 1 if ready else 0

    def all_ready(self) -> bool:
        return self.flags[:self.count] == b"\x01" * self.count

    def ready_count(self) -> int:
        return self.flags[:self.count].count(1)

    # -- metrics -------------------------------------------------------------------------------
    def _cells(self, index: int) -> Path:
        return self.directory / f"cells-{index}.bin"

    def _published(self, index: int) -> Path:
        return self.directory / f"metrics-{index}.json"

    def _retired(self, index: int) -> Path:
        return self.directory / f"retired-{index}.json"

    def publish(self, local: dict[str, Any]) -> None:
        """What this worker alone knows (``ServerMetrics.local``), replaced whole (a reader never sees
        half of it)."""
        _write_json(self._published(self.index or 0), {**local, "generation": self.generation})

    def _live(self, index: int) -> tuple[int, dict[str, Any]] | None:
        """(generation, snapshot) of the worker of ``index`` as it is now: its cells, with what it last
        published when that is its own; None when it has no cells file."""
        found = read_cells(self._cells(index))
        if found is None:
            return None
        generation, cells = found
        snapshot = {**snapshot_of(cells), "body_bytes": 0, "cache": None}
        local = _read_json(self._published(index))
        if local is not None and local.get("generation") == generation:
            snapshot["body_bytes"], snapshot["cache"] = local["body_bytes"], local["cache"]
            skew = {(model, version): rows for model, version, rows in local["skew"]}
            for model in snapshot["models"]:
                model["skew"] = skew.get(tuple(model["labels"]), [])
        return generation, snapshot

    def retire(self, index: int) -> None:
        """A dead worker's counters, as its cells hold them at its death: they count for ever, its gauges
        no more. Added to the index's retired file before its own files go, so a reader counts them once
        whichever it finds (see ``snapshots``)."""
        last = self._live(index)
        if last is not None:
            generation, snapshot = last
            earlier = _read_json(self._retired(index))
            retired = _counters_of([each for each in (earlier, snapshot) if each is not None])
            _write_json(self._retired(index), {**retired, "through": generation})
            self._cells(index).unlink(missing_ok=True)
        self._published(index).unlink(missing_ok=True)
        for partial in self.directory.glob(f"*-{index}.*.partial"):  # a write cut short by its death
            partial.unlink(missing_ok=True)

    def snapshots(self, own: dict[str, Any]) -> list[tuple[str | None, dict[str, Any], bool]]:
        """(worker label, snapshot, live) of every worker: this one's ``own``, the others' as their cells
        are now, and the counters of dead workers (not live)."""
        found: list[tuple[str | None, dict[str, Any], bool]] = [(str(self.index), own, True)]
        for index in range(self.count):
            live = None if index == self.index else self._live(index)
            retired = _read_json(self._retired(index))  # read after the cells: a retirement writes it first
            if live is not None and retired is not None and live[0] <= retired["through"]:
                live = None  # retired between the two reads: counted in the retired file
            if live is not None:
                found.append((str(index), live[1], True))
            if retired is not None:
                found.append((str(index), retired, False))
        return found

    def record_restarts(self, restarts: int) -> None:
        """The supervisor's count of restarted workers, for ``extra``."""
        _write_json(self.directory / "supervisor.json", {"restarts": restarts})

    def extra(self) -> list[Metric]:
        """The supervisor's own series: workers and restarts."""
        restarts = 0
        with contextlib.suppress(FileNotFoundError, ValueError):
            restarts = json.loads((self.directory / "supervisor.json").read_bytes())["restarts"]
        workers = GaugeMetricFamily("mlscale_workers", "Worker processes of this server, and how many are ready",
                                    labels=["state"])
        workers.add_metric(["configured"], self.count)
        workers.add_metric(["ready"], self.ready_count())
        return [workers, CounterMetricFamily("mlscale_worker_restarts", "Workers that died and were restarted",
                                             value=restarts)]

    def close(self) -> None:
        if self.cells is not None:
            self.cells.close()
        self.flags.close()
        self._file.close()
