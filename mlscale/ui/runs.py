"""Runs as the UI shows them: found under a folder, summarised for the table, their records read once
and then only as they grow, and down-sampled on this side so that a long run on many ranks reaches the
page as a few hundred points a chart (full resolution where the page zooms in).

Everything here reads the run directory through ``RunDir`` and ``read_records``: the files a run writes
are the UI's only source, so what the page shows is what ``metrics.jsonl`` and the logs say.
"""

from __future__ import annotations

import json
import math
import operator
import os
import threading
import time
from array import array
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from mlscale.io import read_records
from mlscale.rundir import RunDir

# The split of a step the page stacks, in the order it stacks them (StepTimes' names in metrics.jsonl).
SPLIT_KEYS = ("compute_ms", "comm_exposed_ms", "data_wait_ms", "optimizer_ms")
RANK_KEYS = ("step_ms", *SPLIT_KEYS, "comm_ms", "straggler_score")
RUNNING_WITHIN_S = 60.0  # a run without a report whose heartbeats or records moved this recently is running
MAX_DEPTH = 3  # how deep under --runs run directories are looked for
ERROR_CHARS = 160  # a worker's error as the events table shows it (the whole of it in the event's data)
TAIL_BYTES = 1 << 20  # the runs table reads a run's newest metrics line from this much of its end
KEEP_RUNS = 16  # runs whose records are kept in memory (the most recently asked for)
WARM_RUNS = 8  # runs whose records the UI reads when it starts, the most recently started first
HEAT_CELLS = 12_000  # the straggler heat map's budget: drawn in well under a second, finer than its pixels


def find_runs(root: Path) -> dict[str, Path]:
    """Every run directory (one holding ``config.json``) at or under ``root``, by its path relative to
    ``root`` (``.`` for ``root`` itself); hidden folders and a run's own sub-folders are not searched."""
    found: dict[str, Path] = {}

    def walk(folder: Path, depth: int) -> None:
        if RunDir(folder).config_path.is_file():
            found[folder.relative_to(root).as_posix()] = folder
            return
        if depth >= MAX_DEPTH:
            return
        try:
            children = sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
        except OSError:
            return
        for child in children:
            walk(child, depth + 1)

    if root.is_dir():
        walk(root, 0)
    return found


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return None


def _finite(value: Any) -> float | None:
    return value if isinstance(value, (int, float)) and math.isfinite(value) else None


_RANK_VALUES = operator.itemgetter("rank", *RANK_KEYS)
_WIDTH = 1 + len(RANK_KEYS)


def _rank_values(entry: dict[str, Any]) -> list[float]:
    """(rank, *RANK_KEYS) of one per_rank entry; a key an older record lacks reads as its neutral value,
    a value that is not a number as NaN."""
    values = [entry.get("rank", 0), *(entry.get(k, 1.0 if k == "straggler_score" else 0.0) for k in RANK_KEYS)]
    return [float(v) if isinstance(v, (int, float)) else math.nan for v in values]


@dataclass
class Series:
    """A run's metrics.jsonl as columns, one row per line; the per-rank values kept flat as they come
    (line, rank, *RANK_KEYS) and laid out as a lines x ranks matrix per key when asked.

    A resumed run appends the steps after its checkpoint again: the later line of a step supersedes the
    earlier one. ``kept`` are the lines that stand (steps strictly increasing), what the charts draw."""

    steps: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)
    samples_per_s: list[float] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)  # every rank seen, sorted
    flat: array = field(default_factory=lambda: array("d"))  # (rank, *RANK_KEYS) per per_rank entry, in line order
    line_start: list[int] = field(default_factory=list)  # the entry each line's entries begin at
    extras: dict[int, dict[str, Any]] = field(default_factory=dict)  # line -> eval, stragglers, degraded steps
    kept: list[int] = field(default_factory=list)
    _matrices: dict[str, np.ndarray] = field(default_factory=dict)
    _rank_set: set[int] = field(default_factory=set)

    def add(self, record: dict[str, Any]) -> None:
        line, step = len(self.steps), int(record.get("step", 0))
        loss = _finite(record.get("loss"))
        self.steps.append(step)
        self.loss.append(math.nan if loss is None else loss)
        self.lr.append(record.get("lr") or 0.0)
        self.samples_per_s.append(record.get("samples_per_s") or 0.0)
        self.line_start.append(len(self.flat) // _WIDTH)
        entries = record.get("per_rank") or ()
        try:
            self.flat.fromlist(list(chain.from_iterable(map(_RANK_VALUES, entries))))
        except (KeyError, TypeError):  # a key missing (an older record) or not a number: entry by entry
            del self.flat[self.line_start[-1] * _WIDTH:]
            for entry in entries:
                self.flat.fromlist(_rank_values(entry))
        # the rank numbers this line brought, from its rank column (a set built in C: no loop over entries)
        seen = set(self.flat[self.line_start[-1] * _WIDTH::_WIDTH])
        if not seen <= self._rank_set:
            seen = {int(rank) for rank in seen if rank.is_integer()}  # a rank that is not a number is NaN
            self._rank_set |= seen
            self.ranks = sorted(self._rank_set)
        self._matrices.clear()
        extra = {key: record[key] for key in ("eval", "stragglers", "degraded_steps") if record.get(key)}
        if extra:
            self.extras[line] = extra
        while self.kept and self.steps[self.kept[-1]] >= step:
            self.kept.pop()
        self.kept.append(line)

    def row(self, line: int) -> dict[str, Any]:
        """Line ``line`` as the page draws it (the live stream sends these)."""
        end = self.line_start[line + 1] if line + 1 < len(self.line_start) else len(self.flat) // _WIDTH
        loss = self.loss[line]
        entries = [self.flat[i * _WIDTH:(i + 1) * _WIDTH] for i in range(self.line_start[line], end)]
        return {"line": line, "step": self.steps[line], "loss": None if math.isnan(loss) else loss,
                "lr": self.lr[line], "samples_per_s": self.samples_per_s[line],
                "per_rank": {str(int(e[0])): dict(zip(RANK_KEYS, e[1:])) for e in entries},
                **self.extras.get(line, {})}

    def standing(self, key: str) -> np.ndarray:
        """A column (``loss``, ``lr``, ``samples_per_s``, ``steps``) or a per-rank key's lines x ranks
        matrix, on the lines that stand (``kept``); laid out once per growth of the records."""
        if key not in self._matrices:
            self._layout()
        return self._matrices[key]

    def _layout(self) -> None:
        flat = np.frombuffer(self.flat, dtype=np.float64).reshape(-1, _WIDTH) if self.flat else np.zeros((0, _WIDTH))
        counts = np.diff(np.asarray([*self.line_start, len(flat)], dtype=np.int64))
        lines = np.repeat(np.arange(len(self.steps)), counts)
        known = np.isin(flat[:, 0], self.ranks)  # an entry without a rank number is left out
        flat, lines = flat[known], lines[known]
        ranks = np.searchsorted(self.ranks, flat[:, 0].astype(np.int64))
        kept = np.asarray(self.kept, dtype=np.int64)
        for i, key in enumerate(RANK_KEYS):
            out = np.full((len(self.steps), len(self.ranks)), np.nan)
            out[lines, ranks] = flat[:, 1 + i]
            self._matrices[key] = out[kept]
        for key in ("steps", "loss", "lr", "samples_per_s"):
            self._matrices[key] = np.asarray(getattr(self, key), dtype=np.float64)[kept]

    def kept_extras(self, key: str) -> list[tuple[int, Any]]:
        """(line, value) of one of the extras, on the lines that stand."""
        standing = set(self.kept)
        return [(line, extra[key]) for line, extra in sorted(self.extras.items()) if key in extra and line in standing]


def _buckets(count: int, points: int) -> np.ndarray:
    """Bucket edges splitting ``count`` lines into at most ``points`` nearly equal buckets."""
    buckets = max(1, min(points, count))
    return np.linspace(0, count, buckets + 1).round().astype(np.int64)


def _reduce(values: np.ndarray, edges: np.ndarray, how: str) -> np.ndarray:
    """Per bucket (axis 0) mean or max, NaN left out (an all-NaN bucket stays NaN); a bucket of one line
    is that line."""
    if len(edges) - 1 == len(values) or not len(values):
        return values
    starts = edges[:-1]
    if how == "max":
        return np.fmax.reduceat(values, starts, axis=0)
    seen = ~np.isnan(values)
    sums = np.add.reduceat(np.where(seen, values, 0.0), starts, axis=0)
    counts = np.add.reduceat(seen, starts, axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)


def _clean(values: np.ndarray, digits: int = 4) -> list[Any]:
    """JSON-ready: rounded, NaN as null."""
    rounded = np.round(values.astype(np.float64), digits)
    return [None if isinstance(v, float) and math.isnan(v) else v for v in rounded.tolist()] \
        if rounded.ndim == 1 else [_clean(row, digits) for row in rounded]


class RunView:
    """One run directory, read as it grows: ``refresh`` parses only the lines appended since the last
    call (a file that shrank, a resumed run cutting a torn line, is read again from the start)."""

    def __init__(self, run_id: str, path: Path) -> None:
        self.id, self.run = run_id, RunDir(path)
        self.series = Series()
        self._offset = 0
        self._lock = threading.Lock()

    def refresh(self) -> int:
        """Read what metrics.jsonl gained; returns how many lines it has now."""
        with self._lock:
            path = self.run.metrics_path
            try:
                size = path.stat().st_size
            except OSError:
                size = 0
            if size < self._offset:  # cut short (a torn line removed on resume) or replaced
                self.series, self._offset = Series(), 0
            if size > self._offset:
                with path.open("rb") as handle:
                    handle.seek(self._offset)
                    data = handle.read(size - self._offset)
                end = data.rfind(b"\n") + 1  # a line still being written waits for its newline
                self._offset += end
                for line in data[:end].splitlines():
                    try:
                        record = orjson.loads(line)
                    except orjson.JSONDecodeError:
                        try:  # NaN or Infinity (a diverged loss, as Python's json writes it): the slow way
                            record = json.loads(line)
                        except ValueError:
                            continue  # a torn line a killed run left (cut off when it resumes)
                    if isinstance(record, dict):
                        self.series.add(record)
            return len(self.series.steps)

    def forget(self) -> None:
        """Drop the records read so far (memory): read again from the start when next asked for."""
        with self._lock:
            if self.series.steps:
                self.series, self._offset = Series(), 0

    def rows(self, start: int) -> tuple[int, list[dict[str, Any]]]:
        """The lines from ``start`` on (the live stream): (lines now, rows)."""
        with self._lock:
            series = self.series
            return len(series.steps), [series.row(line) for line in range(start, len(series.steps))]

    # -- what the page asks for -----------------------------------------------------------------------
    def report(self) -> dict[str, Any] | None:
        """report.json, unless it is an earlier launch's: a resumed (or restarted) run writes config.json
        again when it starts, and its report only when it ends."""
        report = _read_json(self.run.report_path)
        if report is not None and (_mtime(self.run.config_path) or 0.0) > (_mtime(self.run.report_path) or 0.0):
            return None
        return report

    def _last_record(self) -> dict[str, Any]:
        """The newest metrics line: from the records if read, else from the file's tail only (the runs
        table reads no run whole)."""
        with self._lock:
            if self.series.steps and (_size(self.run.metrics_path) or 0) == self._offset:  # read to the end
                last = len(self.series.steps) - 1
                return {"step": self.series.steps[last], "loss": self.series.loss[last],
                        "samples_per_s": self.series.samples_per_s[last]}
        try:
            with self.run.metrics_path.open("rb") as handle:
                handle.seek(max(0, handle.seek(0, os.SEEK_END) - TAIL_BYTES))
                tail = handle.read()
        except OSError:
            return {}
        for line in reversed(tail.splitlines()[1:] if len(tail) == TAIL_BYTES else tail.splitlines()):
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                return record
        return {}

    def summary(self) -> dict[str, Any]:
        """The runs table's row (config, report and the newest metrics line)."""
        config = _read_json(self.run.config_path) or {}
        report = self.report()
        last = self._last_record()
        status = report.get("status", "completed") if report else self._status_without_report()
        started = _mtime(self.run.config_path)
        loss = report.get("final_loss") if report else last.get("loss")
        sps = report.get("samples_per_s") if report else last.get("samples_per_s")
        restarts = report.get("restarts") if report else len(read_records(self.run.recovery_path))
        return {
            "id": self.id, "status": status, "task": config.get("task"), "strategy": config.get("strategy"),
            "world": report.get("world_size") if report else _world(self.run, config),
            "steps": last.get("step", (report or {}).get("steps", 0)),
            "total_steps": (report or {}).get("steps") or config.get("steps"),
            "loss": _finite(loss), "samples_per_s": _finite(sps), "restarts": restarts,
            "started": started, "fault_tolerance": (config.get("recovery") or {}).get("fault_tolerance"),
        }

    def _status_without_report(self) -> str:
        latest = max([_mtime(self.run.config_path) or 0.0, _mtime(self.run.metrics_path) or 0.0,
                      *(_mtime(p) or 0.0 for p in _heartbeats(self.run))])
        return "running" if time.time() - latest <= RUNNING_WITHIN_S else "stopped"

    def detail(self) -> dict[str, Any]:
        """The run page's fixed parts: summary, config, plan, report, memory, pipeline, events."""
        self.refresh()
        summary = self.summary()
        report = self.report() or {}
        return {
            **summary,
            "config": _read_json(self.run.config_path) or {},
            "plan": _read_json(self.run.plan_path) or {},
            "report": report,
            "memory": report.get("memory") or [],
            "pipeline": report.get("pipeline"),
            "events": self.events(),
            "ranks": self.series.ranks,
            "lines": len(self.series.steps),
        }

    def events(self) -> list[dict[str, Any]]:
        """What happened to the job, by step, for the timeline: injected faults (kill, hang), worker
        errors, restarts and resumes (recovery.jsonl), live recoveries and replica restarts (per-step
        replica logs), steps without every replica (metrics lines) and the first flag of each straggler."""
        events: list[dict[str, Any]] = []
        for fault in read_records(self.run.faults_path):
            if fault.get("kind") == "slow":
                continue
            step = fault.get("step")
            events.append({"kind": fault.get("kind", "fault"), "step": step, "rank": fault.get("rank"),
                           "time": fault.get("time"),
                           "text": f"{fault.get('kind')} of rank {fault.get('rank')} at step {step} (injected)"})
        for failure in read_records(self.run.failures_path):
            step = failure.get("step")
            error = str(failure.get("error"))
            shown = error if len(error) <= ERROR_CHARS else error[:ERROR_CHARS - 1] + "…"
            events.append({"kind": "error", "step": None if step is None else step + 1, "rank": failure.get("rank"),
                           "time": failure.get("time"), "text": f"rank {failure.get('rank')}: {shown}",
                           "error": error})
        for event in read_records(self.run.recovery_path):
            downtime = event.get("downtime_s")
            events.append({"kind": "restart", "step": event.get("failed_at_step"), "attempt": event.get("attempt"),
                           "text": f"restart {event.get('attempt')}: the group stopped after step "
                                   f"{event.get('failed_at_step')}" + (f", down {downtime:.1f} s" if downtime else "")})
            events.append({"kind": "resume", "step": event.get("resumed_from_step"), "attempt": event.get("attempt"),
                           "text": f"resumed from the checkpoint of step {event.get('resumed_from_step')}, "
                                   f"{event.get('steps_redone')} step(s) redone"})
        events.extend(self._replica_events())
        for first, last, members in self._degraded_spans():
            events.append({"kind": "degraded", "step": first, "until": last, "participants": members,
                           "text": f"steps {first}-{last} trained by replica group(s) "
                                   f"{', '.join(map(str, members))} only"})
        flagged: dict[int, int] = {}
        for line, ranks in self.series.kept_extras("stragglers"):
            step = self.series.steps[line]
            for rank in ranks:
                flagged.setdefault(rank, step)
        for rank, step in sorted(flagged.items()):
            events.append({"kind": "straggler", "step": step, "rank": rank, "text": f"rank {rank} flagged a straggler"})
        return sorted(events, key=lambda e: (e["step"] if e.get("step") is not None else -1, e["kind"]))

    def _degraded_spans(self) -> list[tuple[int, int, list[int]]]:
        """Steps trained without every replica group, one span per stretch with the same groups (each
        metrics line reports the part of a stretch in its own window)."""
        spans: list[tuple[int, int, list[int]]] = []
        for _, reported in self.series.kept_extras("degraded_steps"):
            for span in reported:
                first, last = span["steps"]
                members = list(span["participants"])
                if spans and spans[-1][2] == members and first <= spans[-1][1] + 1:
                    spans[-1] = (spans[-1][0], max(last, spans[-1][1]), members)
                else:
                    spans.append((first, last, members))
        return spans

    def _replica_events(self) -> list[dict[str, Any]]:
        events = []
        for (group, _rank), path in self.run.replica_logs().items():
            for line in read_records(path):
                if line.get("event") == "start" and line.get("attempt", 0) > 0:
                    step = line.get("step") or None  # a replacement with no checkpoint starts at 0: its
                    # place on the timeline is its live recovery
                    events.append({"kind": "replica_restart", "step": step, "replica": group,
                                   "text": f"replica group {group} restarted (attempt {line['attempt']})"
                                           + (f", from step {step}" if step else ", to recover its state live")})
                elif line.get("event") == "received":
                    events.append({"kind": "live_recovery", "step": line.get("step"), "replica": group,
                                   "text": f"replica group {group} recovered live: the state of step "
                                           f"{line.get('step')} from its peers"})
        return events

    def series_payload(self, lo_step: float | None, hi_step: float | None, points: int,
                       rank: str = "all") -> dict[str, Any]:
        """The charts' data between two steps, at most ``points`` points a series: bucket means (the
        straggler score: the bucket's highest, so a slow rank is never averaged away); the split of
        ``rank`` (or the mean over ranks); each rank's mean split over the range."""
        self.refresh()
        with self._lock:
            return self._series_payload(lo_step, hi_step, points, rank)

    def _series_payload(self, lo_step: float | None, hi_step: float | None, points: int,
                        rank: str) -> dict[str, Any]:
        series = self.series
        steps = series.standing("steps").astype(np.int64) if series.steps else np.zeros(0, dtype=np.int64)
        lo = int(np.searchsorted(steps, lo_step, "left")) if lo_step is not None else 0
        hi = int(np.searchsorted(steps, hi_step, "right")) if hi_step is not None else len(steps)
        count = max(0, hi - lo)
        edges = _buckets(count, points)
        picked = steps[lo:hi]
        payload: dict[str, Any] = {
            "id": self.id, "lines": len(series.steps), "points_total": len(steps), "from": lo, "to": hi,
            "per_point": count / (len(edges) - 1) if count else 1, "ranks": series.ranks,
            "steps": (picked[np.maximum(edges[1:] - 1, 0)] if count else picked).tolist(),
            "first_step": int(steps[0]) if len(steps) else None, "last_step": int(steps[-1]) if len(steps) else None,
        }
        for key, digits in (("loss", 6), ("lr", 8), ("samples_per_s", 1)):
            payload[key] = _clean(_reduce(series.standing(key)[lo:hi], edges, "mean"), digits) if count else []
        ranked = count if series.ranks else 0
        # the heat map: at most HEAT_CELLS cells (a canvas rectangle each), never fewer columns than 100
        heat_edges = _buckets(ranked, max(100, min(points, HEAT_CELLS // max(1, len(series.ranks)))))
        payload["heat_steps"] = (picked[np.maximum(heat_edges[1:] - 1, 0)] if ranked else picked[:0]).tolist()
        payload["straggler"] = _clean(_reduce(series.standing("straggler_score")[lo:hi], heat_edges, "max").T, 3) \
            if ranked else []
        split: dict[str, Any] = {}
        means: dict[str, Any] = {}
        for key in (*SPLIT_KEYS, "step_ms"):
            values = series.standing(key)[lo:hi] if ranked else np.zeros((0, len(series.ranks)))
            if rank.isdigit() and int(rank) in series.ranks:
                column = values[:, series.ranks.index(int(rank))]
            else:
                column = _nanmean(values, axis=1) if ranked else np.zeros(0)
            split[key] = _clean(_reduce(column, edges, "mean"), 3) if ranked else []
            means[key] = _clean(_nanmean(values, axis=0), 3) if ranked else []
        payload["split"], payload["split_of"], payload["rank_means"] = split, rank, means
        evals = [extra for _, extra in series.kept_extras("eval")]
        payload["eval"] = [e for batch in evals for e in batch
                           if (lo_step is None or e.get("step", 0) >= lo_step)
                           and (hi_step is None or e.get("step", 0) <= hi_step)]
        return payload


def _nanmean(values: np.ndarray, axis: int) -> np.ndarray:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmean(values, axis=axis)


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


def _heartbeats(run: RunDir) -> list[Path]:
    try:
        return list(run.heartbeats.iterdir())
    except OSError:
        return []


def _world(run: RunDir, config: dict[str, Any]) -> int | None:
    plan = _read_json(run.plan_path) or {}
    return plan.get("processes") or config.get("workers")


class RunCatalog:
    """The runs under ``--runs``, found again on every listing (a new run shows up without a restart);
    each run's records kept between calls so only what a run appends is read again."""

    def __init__(self, root: Path | None) -> None:
        self.root = root
        self._views: dict[str, RunView] = {}
        self._lock = threading.Lock()

    def ids(self) -> dict[str, Path]:
        return find_runs(self.root) if self.root is not None else {}

    def view(self, run_id: str, found: dict[str, Path] | None = None, *, touch: bool = True) -> RunView | None:
        """The run of that id, or None (an id is a path found under ``--runs``, never one from the
        request: ``..`` or an absolute path finds nothing). ``found``: a listing just made. Asking for a
        run (``touch``; the runs table does not) makes it the most recently used: the records of at most
        ``KEEP_RUNS`` runs stay in memory."""
        with self._lock:
            view = self._views.get(run_id)
            if view is None or not view.run.config_path.is_file():
                path = (found if found is not None else self.ids()).get(run_id)
                if path is None:
                    return None
                view = RunView(run_id, path)
            if not touch:
                self._views.setdefault(run_id, view)
                return self._views[run_id]
            self._views.pop(run_id, None)
            self._views[run_id] = view  # the most recent last
            for older in list(self._views.values())[:-KEEP_RUNS]:
                older.forget()
            return view

    def summaries(self) -> list[dict[str, Any]]:
        rows = []
        found = self.ids()
        for run_id in found:
            view = self.view(run_id, found, touch=False)
            if view is not None:
                rows.append(view.summary())
        return sorted(rows, key=lambda r: -(r["started"] or 0))

    def read_ahead(self, runs: int = WARM_RUNS) -> None:
        """Read the records of the most recently started runs now (the UI does this in the background when
        it starts), so that opening one finds them read: a long run's first read takes seconds."""
        found = self.ids()
        recent = sorted(found, key=lambda run_id: -(_mtime(RunDir(found[run_id]).config_path) or 0.0))
        for run_id in recent[:runs]:
            view = self.view(run_id, found)
            if view is not None:
                view.refresh()

    def id_of(self, path: str | os.PathLike[str] | None) -> str | None:
        """The id of a run directory given by its path (a registry version's source run), if it is one
        of ours."""
        if not path or self.root is None:
            return None
        try:
            relative = Path(path).resolve().relative_to(self.root.resolve()).as_posix()
        except ValueError:
            return None
        return relative if relative in self.ids() else None
