"""What the workers of one server (``mlscale serve --workers N``, see ``workers.py``) share: a private
folder with a byte per worker, 1 while it is ready (readiness is ready only when every byte is), and
each worker's metrics, published every ``PUBLISH_S`` and merged by whichever worker is scraped
(``/metrics`` and the statistics calls speak for the whole server; a dead worker's counters are kept,
so no counter ever goes back, in one file per worker index however often it was restarted)."""

from __future__ import annotations

import contextlib
import json
import mmap
import os
from pathlib import Path
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from mlscale.serve.metrics import MetricsView

PUBLISH_S = 0.5  # how often a worker publishes its metrics for the others


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
    """The folder the workers of one server share: ready bytes and published metrics.

    Per worker index: ``metrics-I.json``, the live worker's last snapshot (tagged with its generation,
    how many workers of that index died before it), and ``retired-I.json``, the counters of all the
    dead ones, tagged ``through`` the last generation it took in. Never more: a server whose workers
    were restarted a thousand times reads two files per worker a scrape."""

    def __init__(self, directory: str | Path, count: int, index: int | None = None, generation: int = 0) -> None:
        self.directory, self.count, self.index, self.generation = Path(directory), count, index, generation
        flags = self.directory / "flags.bin"  # a byte per worker: 1 while it is ready
        if not flags.exists():
            flags.write_bytes(bytes(count))
        self._file = flags.open("r+b")
        self.flags = mmap.mmap(self._file.fileno(), count)

    def set_ready(self, ready: bool) -> None:
        assert self.index is not None
        self.flags[self.index] = 1 if ready else 0

    def all_ready(self) -> bool:
        return self.flags[:self.count] == b"\x01" * self.count

    def ready_count(self) -> int:
        return self.flags[:self.count].count(1)

    # -- metrics -------------------------------------------------------------------------------
    def _published(self, index: int) -> Path:
        return self.directory / f"metrics-{index}.json"

    def _retired(self, index: int) -> Path:
        return self.directory / f"retired-{index}.json"

    def publish(self, snapshot: dict[str, Any]) -> None:
        """This worker's snapshot, replaced whole (a reader never sees half of one)."""
        _write_json(self._published(self.index or 0), {**snapshot, "generation": self.generation})

    def retire(self, index: int) -> None:
        """A dead worker's last snapshot: its counters count for ever, its gauges no more. Added to the
        index's retired file before its own goes, so a reader counts it once whichever it finds (see
        ``snapshots``)."""
        last = _read_json(self._published(index))
        if last is not None:
            earlier = _read_json(self._retired(index))
            retired = _counters_of([each for each in (earlier, last) if each is not None])
            _write_json(self._retired(index), {**retired, "through": last.get("generation", 0)})
            self._published(index).unlink(missing_ok=True)
        for partial in self.directory.glob(f"metrics-{index}.*.partial"):  # a publish cut short by its death
            partial.unlink(missing_ok=True)

    def snapshots(self, own: dict[str, Any]) -> list[tuple[str | None, dict[str, Any], bool]]:
        """(worker label, snapshot, live) of every worker: this one's ``own``, the others' last published,
        and the counters of dead workers (not live)."""
        found: list[tuple[str | None, dict[str, Any], bool]] = [(str(self.index), own, True)]
        for index in range(self.count):
            live = None if index == self.index else _read_json(self._published(index))
            retired = _read_json(self._retired(index))  # read after the live file: a retirement writes it first
            if live is not None and retired is not None and live.get("generation", 0) <= retired["through"]:
                live = None  # retired between the two reads: counted in the retired file
            if live is not None:
                found.append((str(index), live, True))
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
        self.flags.close()
        self._file.close()
